-- The cuDNN SDPA graphs of kernels/cuda/attention.cu, checked without a GPU
-- (tt_cuda_attention_graph_check, docs/cuda.md): for each shape the GPU
-- benchmarks and the models train with, the graph Titan would build goes
-- through cuDNN's heuristics for an H200 described by cuDNN's JSON device
-- properties, and an engine must accept it (its plan finalizes up to loading
-- the compiled kernel, which needs the GPU; ctest runs this file with the
-- CUDA toolkit's stub libcuda). A graph no engine accepts would make every
-- such call take the slow fallback kernels on the GPU, silently. A build
-- without CUDA, or a cuDNN before 9.8, reports the cases pending.
local titan = require("titan")
local ffi, C = titan.ffi, titan.C

-- An H200 (sm_90, 132 SMs, 141 GB) in cuDNN's device-properties JSON, written
-- by hand from the card's published figures (no H200 was at hand to serialize
-- its own); heuristics read the SM version, counts and memory sizes.
local H200 = [[{"deviceVer":900,"driverVer":13000,"multiProcessorCount":132,"smClockRateKHz":1980000,]]
  .. [["memClockRateKHz":3201000,"l2CacheSize":52428800,"warpSize":32,"maxSharedMemoryPerBlock":49152,]]
  .. [["maxSharedMemoryPerBlockOptin":232448,"reservedSharedMemoryPerBlock":1024,"maxRegistersPerSM":65536,]]
  .. [["regsPerBlock":65536,"pciDeviceId":0,"maxCtasPerSM":32,"maxThreadsPerBlock":1024,"maxThreadsPerSM":2048,]]
  .. [["isTccDriver":0,"supportCoopLaunch":1,"cudaDeviceId":0,"totalGlobalMem":150754820096,]]
  .. [["maxGridSize":[2147483647,65535,65535],"maxBlockSize":[1024,1024,64],"deviceName":"NVIDIA H200"}]]

local function check(dir, dt, causal, det, B, T, S, Hq, Hkv, D)
  local acc, buf = ffi.new("int[1]"), ffi.new("char[512]")
  local st = C.tt_cuda_attention_graph_check(dir == "backward" and 1 or 0, dt, causal and 1 or 0, det and 1 or 0, B, T,
    S, Hq, Hkv, D, 90, H200, acc, buf, 512)
  return st, acc[0], ffi.string(buf)
end

local available, why = true, nil
do
  local st = check("forward", C.TT_BF16, true, false, 1, 128, 128, 4, 4, 64)
  if st == C.TT_ERR_UNSUPPORTED then available, why = false, ffi.string(C.tt_last_error()) end
end

local function name(c)
  return ("%s %s B%d T%d S%d Hq%d Hkv%d D%d %s%s"):format(c[1], c[2], c[5], c[6], c[7], c[8], c[9], c[10],
    c[3] and "causal" or "full", c[4] and " deterministic" or "")
end

-- {direction, dtype, causal, deterministic, B, T, S, Hq, Hkv, D}
local CASES = {
  { "forward", "bfloat16", true, false, 1, 8192, 8192, 32, 8, 128 }, -- bench/gpu.lua's headline shape
  { "backward", "bfloat16", true, false, 1, 8192, 8192, 32, 8, 128 },
  { "backward", "bfloat16", true, true, 1, 8192, 8192, 32, 8, 128 }, -- debug.deterministic: dQ written directly
  { "forward", "bfloat16", true, false, 4, 2048, 2048, 32, 8, 128 },
  { "backward", "bfloat16", true, false, 4, 2048, 2048, 32, 8, 128 },
  { "forward", "float16", true, false, 1, 8192, 8192, 32, 8, 128 },
  { "backward", "float16", true, false, 1, 8192, 8192, 32, 8, 128 },
  { "forward", "bfloat16", true, false, 1, 8192, 8192, 32, 8, 64 }, -- Llama 3 1B
  { "backward", "bfloat16", true, false, 1, 8192, 8192, 32, 8, 64 },
  { "forward", "bfloat16", true, false, 16, 2048, 2048, 16, 16, 16 }, -- debugmodel
  { "backward", "bfloat16", true, false, 16, 2048, 2048, 16, 16, 16 },
  { "forward", "bfloat16", false, false, 2, 1024, 1024, 16, 16, 64 }, -- no mask
  { "backward", "bfloat16", false, false, 2, 1024, 1024, 16, 16, 64 },
  { "forward", "bfloat16", true, false, 1, 4096, 8192, 32, 8, 128 }, -- bottom-right causal mask (S > T)
  { "backward", "bfloat16", true, false, 1, 4096, 8192, 32, 8, 128 },
}

describe("cuDNN SDPA graphs without a GPU (an H200 described by device properties)", function()
  for _, c in ipairs(CASES) do
    it(name(c) .. ": an engine accepts the graph", function()
      if not available then return pending(why) end
      local st, accepted, report = check(c[1], C["TT_" .. (c[2] == "bfloat16" and "BF16" or "F16")], c[3], c[4],
        c[5], c[6], c[7], c[8], c[9], c[10])
      assert.are.equal(0, tonumber(st), ffi.string(C.tt_last_error()))
      assert.is_true(accepted > 0, name(c) .. ": " .. report)
      assert.truthy(report:find("accepted the %d+%-op graph %(engine %d"), report)
    end)
  end

  it("a shape Titan's own rules refuse never reaches cuDNN, and says why", function()
    if not available then return pending(why) end
    local st, accepted, report = check("forward", C.TT_BF16, true, false, 1, 128, 128, 4, 4, 12)
    assert.are.equal(0, tonumber(st))
    assert.are.equal(0, accepted)
    assert.are.equal("not offered to cuDNN: head_dim 12 is not a multiple of 8 in [8, 256]", report)
  end)

  it("bad arguments are one clear error", function()
    if not available then return pending(why) end
    local acc, buf = ffi.new("int[1]"), ffi.new("char[64]")
    local st = C.tt_cuda_attention_graph_check(0, C.TT_F32, 1, 0, 1, 8, 8, 4, 4, 64, 90, H200, acc, buf, 64)
    assert.are.equal(C.TT_ERR_DTYPE, st)
    assert.are.equal("attention graph check: dtype 0 (cuDNN SDPA takes bf16 and f16)", ffi.string(C.tt_last_error()))
    st = C.tt_cuda_attention_graph_check(0, C.TT_BF16, 1, 0, 1, 8, 8, 6, 4, 64, 90, H200, acc, buf, 64)
    assert.are.equal(C.TT_ERR_SHAPE, st)
    st = C.tt_cuda_attention_graph_check(0, C.TT_BF16, 1, 0, 1, 8, 8, 4, 4, 64, 90, "{not json", acc, buf, 64)
    assert.are.equal(C.TT_ERR_INVALID, st)
    assert.truthy(ffi.string(C.tt_last_error()):find("cuDNN refused the device properties", 1, true))
  end)
end)
