-- titan — the library face: `local titan = require("titan")`.
--
--   titan.ones(2, 3)          creation (zeros, full, arange, tensor, rand, randn, ...)
--   titan.scope(fn)           release every temporary fn creates but returns
--   titan.no_grad(fn)         run without recording gradients
--   t:backward()              gradients into .grad of leaves
--   titan.nn, titan.F         modules and differentiable primitives
--   titan.memory_stats()      the caching allocator's statistics
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
-- TF32 for f32 matmuls on CUDA, process-wide (off by default; the CPU ignores it).
function titan.set_allow_tf32(on) C.tt_set_allow_tf32(on and 1 or 0) end
function titan.allow_tf32() return C.tt_allow_tf32() ~= 0 end
function titan.cuda_available() return C.tt_cuda_available() ~= 0 end
function titan.cuda_device_count() return C.tt_cuda_device_count() end
function titan.live_tensors() return tonumber(C.tt_tensor_live_count()) end

local stats = ffi.new("tt_mem_stats")
-- memory_stats("cpu" | "cuda:0") -> {allocated, reserved, peak_allocated, num_allocs, ...} in bytes
function titan.memory_stats(device)
  tffi.check(C.tt_memory_stats(tensor.device_of(device), stats), 2)
  return {
    allocated = tonumber(stats.allocated),
    reserved = tonumber(stats.reserved),
    peak_allocated = tonumber(stats.peak_allocated),
    num_allocs = tonumber(stats.num_allocs),
    num_frees = tonumber(stats.num_frees),
    num_cache_hits = tonumber(stats.num_cache_hits),
    num_alloc_retries = tonumber(stats.num_alloc_retries),
    num_ooms = tonumber(stats.num_ooms),
  }
end
-- Wait until everything queued on the device has run.
function titan.synchronize(device) tffi.check(C.tt_device_synchronize(tensor.device_of(device or "cpu")), 2) end
function titan.reset_peak_memory(device) C.tt_memory_reset_peak(tensor.device_of(device)) end
function titan.empty_cache(device) C.tt_memory_empty_cache(tensor.device_of(device)) end

return titan
