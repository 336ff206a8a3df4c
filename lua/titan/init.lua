-- titan — the library face: `local titan = require("titan")`.
--
--   titan.ones(2, 3)          creation (zeros, full, arange, tensor, rand, randn, ...)
--   titan.scope(fn)           release every temporary fn creates but returns
--   titan.no_grad(fn)         run without recording gradients
--   t:backward()              gradients into .grad of leaves
--   titan.nn, titan.F         modules and differentiable primitives
--   titan.memory_stats()      the caching allocators' statistics (per device, and "pinned")
--   titan.memory_info(dev)    the device's own free and total bytes
--   titan.synchronize(dev)    wait for a device; raise its deferred index errors
local tffi = require("titan.ffi")
local tensor = require("titan.tensor")
local memory = require("titan.memory")
local autograd = require("titan.autograd")
local ops = require("titan.ops")
local F = require("titan.functional")
local nn = require("titan.nn")
local ffi, C = tffi.ffi, tffi.C

local titan = {
  C = C,
  ffi = ffi,
  Tensor = tensor.Tensor,
  nn = nn,
  F = F,
  functional = F,
  autograd = autograd,
  ops = ops,
}

for _, name in ipairs({ "empty", "zeros", "ones", "full", "arange", "tensor", "rand", "randn", "trunc_normal",
  "zeros_like", "empty_like", "manual_seed", "rng_state", "set_rng_state" }) do
  titan[name] = tensor[name]
end

for _, name in ipairs({ "add", "sub", "mul", "div", "maximum", "minimum", "scale", "pow", "sum", "mean", "max",
  "norm", "argmax", "softmax", "log_softmax", "matmul", "cat", "stack", "index_select", "gather", "exp", "log",
  "sqrt", "rsqrt", "silu", "gelu", "relu", "neg", "abs", "tanh", "sigmoid", "square", "adamw_", "global_norm" }) do
  titan[name] = ops[name]
end

titan.set_default_cuda = tensor.set_default_cuda -- what "cuda" names (default: cuda:<local rank>)
titan.scope = memory.scope
titan.keep = memory.keep
titan.no_grad = autograd.no_grad
titan.is_tensor = ops.is_tensor

function tensor.Tensor:backward(grad, opts) return autograd.backward(self, grad, opts) end
function tensor.Tensor:requires_grad_(on)
  if on == nil then on = true end
  self.requires_grad = on or nil
  return self
end

function titan.version() return ffi.string(C.tt_version()) end
function titan.blas_info() return ffi.string(C.tt_blas_info()) end
function titan.num_threads() return C.tt_num_threads() end
function titan.set_num_threads(n) C.tt_set_num_threads(n) end
-- Deterministic mode (debug.deterministic; process-wide): see docs/cuda.md.
function titan.set_deterministic(on) C.tt_set_deterministic(on and 1 or 0) end
function titan.deterministic() return C.tt_deterministic() ~= 0 end
-- TF32 for f32 matmuls on CUDA, process-wide (off by default; the CPU ignores it).
function titan.set_allow_tf32(on) C.tt_set_allow_tf32(on and 1 or 0) end
function titan.allow_tf32() return C.tt_allow_tf32() ~= 0 end
-- GEMM autotuning on CUDA, process-wide (off by default; not in deterministic mode; the CPU ignores it).
function titan.set_gemm_autotune(on) C.tt_set_gemm_autotune(on and 1 or 0) end
function titan.gemm_autotune() return C.tt_gemm_autotune() ~= 0 end
function titan.cuda_available() return C.tt_cuda_available() ~= 0 end
function titan.cuda_device_count() return C.tt_cuda_device_count() end
function titan.live_tensors() return tonumber(C.tt_tensor_live_count()) end
-- synchronize("cuda:0") waits for the device's queued work and raises the
-- first out-of-range index its kernels met since the last check (GPU index
-- kernels record one instead of faulting; :item() and copies to the host
-- raise it too). Default device: "cuda" (this process's GPU) when there is
-- one, else cpu.
function titan.synchronize(device)
  local dev = device or (titan.cuda_available() and "cuda" or "cpu")
  tffi.check(C.tt_device_synchronize(tensor.device_of(dev)), 2)
end

local stats = ffi.new("tt_mem_stats")
-- memory_stats("cpu" | "cuda:0" | "pinned") -> {allocated, reserved, peak_allocated, num_allocs, ...} in
-- bytes; "pinned": the pinned host buffers that async checkpoints snapshot CUDA tensors into
function titan.memory_stats(device)
  if device == "pinned" then
    tffi.check(C.tt_memory_pinned_stats(stats), 2)
  else
    tffi.check(C.tt_memory_stats(tensor.device_of(device), stats), 2)
  end
  return {
    allocated = tonumber(stats.allocated),
    reserved = tonumber(stats.reserved),
    peak_allocated = tonumber(stats.peak_allocated),
    num_allocs = tonumber(stats.num_allocs),
    num_frees = tonumber(stats.num_frees),
    num_cache_hits = tonumber(stats.num_cache_hits),
    num_alloc_retries = tonumber(stats.num_alloc_retries),
    num_ooms = tonumber(stats.num_ooms),
    pending = tonumber(stats.pending), -- freed, waiting for another stream's work before reuse
    allocated_total = tonumber(stats.allocated_total), -- every request since the start (bytes written)
  }
end
-- memory_info("cpu" | "cuda:N") -> free, total bytes of the device itself (the host's MemAvailable and
-- MemTotal; on CUDA, cudaMemGetInfo: what the caching allocator holds counts as used)
local mem_free, mem_total = ffi.new("int64_t[1]"), ffi.new("int64_t[1]")
function titan.memory_info(device)
  tffi.check(C.tt_device_memory_info(tensor.device_of(device), mem_free, mem_total), 2)
  return tonumber(mem_free[0]), tonumber(mem_total[0])
end
function titan.reset_peak_memory(device) C.tt_memory_reset_peak(tensor.device_of(device)) end
function titan.empty_cache(device)
  if device == "pinned" then C.tt_memory_pinned_empty_cache() else C.tt_memory_empty_cache(tensor.device_of(device)) end
end

return titan
