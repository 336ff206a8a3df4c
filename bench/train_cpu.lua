-- bench/train_cpu.lua — training throughput of one model config on the CPU:
-- forward + backward + AdamW per step on random tokens, best and mean
-- tokens/s over the timed steps, MFU (6·N + 12·L·H·Q·T FLOPs per token
-- over the measured 2048^3 sgemm rate) and peak memory (max RSS of the
-- process, and the allocator's peak).
--
--   ./titan bench/train_cpu.lua CONFIG BATCH SEQ STEPS [AC]
--   CONFIG: debugmodel | 125m
--   AC: none (default), full, N (every Nth block) or op (per-op policy): activation checkpointing
-- Prints one line of `key=value` pairs (read by bench/train_cpu.sh).
package.path = "./bench/?.lua;" .. package.path
local titan = require("titan")
local common = require("common")
local llama3 = require("models.llama3")
local optim = require("titan.optim")
local metrics = require("titan.metrics")
local ffi = titan.ffi

pcall(ffi.cdef, [[
typedef struct { long tv_sec; long tv_usec; } tt_bench_timeval;
typedef struct { tt_bench_timeval ru_utime, ru_stime; long ru_maxrss, ru_ixrss, ru_idrss, ru_isrss, ru_minflt,
  ru_majflt, ru_nswap, ru_inblock, ru_oublock, ru_msgsnd, ru_msgrcv, ru_nsignals, ru_nvcsw, ru_nivcsw; } tt_bench_rusage;
int getrusage(int who, tt_bench_rusage *usage);
]])

local config_name, B, T, steps = arg[1] or "debugmodel", tonumber(arg[2] or 1), tonumber(arg[3] or 2048),
    tonumber(arg[4] or 6)
local ac = arg[5] or "none"
local flavors = {
  debugmodel = "debugmodel",
  ["125m"] = { dim = 768, n_layers = 12, n_heads = 12, n_kv_heads = 12, multiple_of = 256, vocab_size = 32000,
    max_seq_len = 2048 },
}
local flavor = flavors[config_name] or error("unknown config " .. tostring(config_name))
local peak = metrics.measure_cpu_peak_flops()
local model = llama3.build(flavor, { device = "meta" })
local ac_blocks = require("parallel.ac").apply(model, (ac == "none" or ac == "full") and { mode = ac } or
  { mode = "selective", selective_ac_option = ac })
model:to_empty("cpu")
llama3.init_weights(model, 0)
local V = model.args.vocab_size
local flops_per_token = llama3.flops_per_token(model, T)
local opt = optim.AdamW(model:named_parameters(), { lr = 1e-4, betas = { 0.9, 0.95 }, weight_decay = 0.1 })

local function step(i)
  titan.scope(function()
    local toks = (titan.rand({ B, T + 1 }, { seed = 7, offset = i * B * (T + 1) }) * (V - 1)):to("int64")
    local inputs = toks:narrow(2, 1, T):contiguous()
    local targets = toks:narrow(2, 2, T):contiguous()
    local logits = model(inputs)
    local loss = titan.F.cross_entropy(logits:reshape(-1, V), targets:reshape(-1))
    loss:backward()
  end)
  opt:step()
  opt:zero_grad()
end

step(0) -- warm-up: optimizer state, allocator cache
local times = {}
for i = 1, steps do
  local t0 = common.now()
  step(i)
  times[i] = common.now() - t0
end
local best, total = math.huge, 0
for _, t in ipairs(times) do
  best = math.min(best, t)
  total = total + t
end
local ru = ffi.new("tt_bench_rusage")
ffi.C.getrusage(0, ru)
local tok = B * T
print(("impl=titan config=%s batch=%d seq=%d tps_best=%.1f tps_mean=%.1f mfu=%.4f peak_gflops=%.1f "
  .. "maxrss_mib=%.1f alloc_peak_mib=%.1f threads=%d ac=%s ac_blocks=%d"):format(config_name, B, T, tok / best,
  tok * steps / total, tok / best * flops_per_token / peak, peak / 1e9, tonumber(ru.ru_maxrss) / 1024,
  titan.memory_stats().peak_allocated / 2 ^ 20, titan.num_threads(), ac, ac_blocks))
