-- devices.lua — what `titan estimate` knows of the machines a job may run
-- on: memory, peak dense FLOP/s by dtype, memory bandwidth and the links
-- between ranks. The figures are the vendors' data-sheet ones (dense, no
-- sparsity); edit them here, or pass your own table to
-- require("titan.estimate").run(cfg, world, { device = {...} }).
--
--   memory_gib       what a rank may hold (a GPU's memory; a CPU host's RAM is read at run time)
--   tflops[dtype]    peak dense TFLOP/s of the matmuls in that dtype (float32 on GPUs: TF32)
--   hbm_gbs          memory bandwidth, GB/s
--   intra_gbs        per-rank bandwidth to ranks of the same node, GB/s, each direction (NVLink)
--   inter_gbs        per-rank bandwidth to other nodes, GB/s (e.g. 400 Gb/s InfiniBand = 50)
--   ranks_per_node   ranks that share a node (and its intra-node links)
local M = {}

M.h100 = {
  name = "NVIDIA H100 SXM5 80GB", memory_gib = 79.6,
  tflops = { bfloat16 = 989.4, float32 = 494.7, float8 = 1978.9, float64 = 66.9 },
  hbm_gbs = 3350, intra_gbs = 450, inter_gbs = 50, ranks_per_node = 8,
}

M.h200 = {
  name = "NVIDIA H200 SXM 141GB", memory_gib = 139.8,
  tflops = { bfloat16 = 989.4, float32 = 494.7, float8 = 1978.9, float64 = 66.9 },
  hbm_gbs = 4800, intra_gbs = 450, inter_gbs = 50, ranks_per_node = 8,
}

-- This machine's CPU: its RAM and the matmul rate titan measures (filled
-- in when asked for: measuring takes a moment).
function M.cpu()
  local metrics = require("titan.metrics")
  local bytes = metrics.device_memory_bytes("cpu") or 0
  local peak = metrics.measure_cpu_peak_flops() / 1e12
  return {
    name = "this machine's CPU", memory_gib = 0.8 * bytes / 2 ^ 30, -- (the trainer's share: the rest is the OS's)
    tflops = { float32 = peak, float64 = peak / 2, bfloat16 = peak, float8 = peak },
    hbm_gbs = 100, intra_gbs = 10, inter_gbs = 10, ranks_per_node = 1024,
  }
end

-- The table of a device name (h100, h200, cpu), or nil.
function M.get(name)
  local d = M[name]
  if type(d) == "function" then return d() end
  return d
end

M.names = { "h100", "h200", "cpu" }

return M
