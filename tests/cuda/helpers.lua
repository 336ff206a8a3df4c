-- helpers.lua — shared by the GPU specs (tests/cuda/*_spec.lua; this file is
-- not a spec, so ctest does not run it): the device under test, seeded
-- inputs and token batches, poisoned outputs, the raw C calls with
-- preallocated outputs, model helpers, and comparisons against a CPU
-- reference.
--
-- The device under test is "cuda" (cuda:0). TITAN_GPU_SPEC_DEVICE=cpu runs
-- the same specs against the CPU itself: a self-test of this harness on a
-- machine without a GPU (the f32/f64 cases must pass there; bf16/f16 cases
-- of ops the CPU computes only in f32/f64 fail there, as expected).
--
-- Comparisons (METHOD: ‖got − ref‖ / ‖ref‖ against a float64 reference):
--   * normwise relative error ≤ tol, and
--   * every element: |got − ref| ≤ 10·tol·(|ref| + rms(ref)) — so a handful
--     of wrong elements cannot hide in a large norm (an all-zero reference is
--     compared absolutely: rms taken as 1);
--   * a NaN where the reference has none fails: outputs are POISONED (filled
--     with NaN) before the op, so an element the kernel never wrote shows up.
package.path = "./tests/cuda/?.lua;" .. package.path
local titan = require("titan")
local tensor = require("titan.tensor")
local ffi, C = titan.ffi, titan.C

local H = {}

H.DEV = os.getenv("TITAN_GPU_SPEC_DEVICE") or "cuda"
H.ON_GPU = H.DEV:match("^cuda") ~= nil
-- On cuemu (tests/cuemu: the CUDA backend run on the CPU, which ctest marks
-- with TITAN_CUEMU=1) a debug-model training takes many minutes; the specs
-- mark those cases `local long_it = H.EMULATED and pending or it`, so they
-- show as pending there and run on a GPU.
H.EMULATED = os.getenv("TITAN_CUEMU") == "1"

-- Without a GPU (or a CUDA build) a spec exits 77: ctest reports skipped.
function H.require_device()
  if H.ON_GPU and not titan.cuda_available() then
    io.stderr:write("no CUDA device (or built without TITAN_CUDA): skipped\n")
    os.exit(77)
  end
end

-- Normwise relative tolerances by dtype (ops scale them where they must).
H.TOL = { float64 = 1e-12, float32 = 1e-5, bfloat16 = 1e-2, float16 = 2e-3 }

H.FLOATS = { "float32", "float64", "bfloat16", "float16" }
H.NAN = 0 / 0

local function is_float(dt) return dt == "float32" or dt == "float64" or dt == "bfloat16" or dt == "float16" end
H.is_float = is_float

-- ---- C calls -------------------------------------------------------------------

-- A `tt_tensor **out`: holding t (a preallocated output) or NULL (allocate).
function H.box(t)
  local b = ffi.new("tt_tensor*[1]")
  if t then b[0] = t._c end
  return b
end

-- Own the tensor an op allocated into box b.
function H.take(b) return tensor.wrap(b[0]) end

-- Raise on a failed status, with the engine's message.
function H.ok(status, what)
  if status ~= 0 then error((what or "op") .. ": " .. ffi.string(C.tt_last_error()), 2) end
end

-- ---- inputs ---------------------------------------------------------------------

-- Seeded normal values on the CPU in dtype dt (drawn in f32, then cast, so a
-- bf16 input holds exactly the rounded f32 draw), times `scale`, plus `shift`.
function H.randn(shape, seed, dt, scale, shift)
  local t = titan.randn(shape, { seed = seed, offset = 0, dtype = dt == "float64" and "float64" or "float32" })
  if scale and scale ~= 1 then t:mul_(scale) end
  if shift and shift ~= 0 then t:add_(shift) end
  if dt and dt ~= t:dtype() then t = t:to(dt) end
  return t
end

-- Positive inputs (log, sqrt, ...): |x| + lo.
function H.positive(shape, seed, dt, lo)
  local t = titan.randn(shape, { seed = seed, offset = 0, dtype = dt == "float64" and "float64" or "float32" })
  local a = titan.abs(t)
  a:add_(lo or 0.1)
  if dt and dt ~= a:dtype() then a = a:to(dt) end
  return a
end

-- Integer ids in [0, n) (int64 by default) on the CPU, from a seeded draw.
function H.ids(shape, n, seed, dt)
  local u = titan.rand(shape, { seed = seed, offset = 0, dtype = "float64" })
  u:mul_(n)
  local ids = u:to("int64") -- truncates: [0, n)
  if dt and dt ~= "int64" then ids = ids:to(dt) end
  return ids
end

-- A CPU float64 copy (the reference's inputs: exactly the values the device sees).
-- Always a new tensor: `to` returns its receiver when nothing changes, and
-- an in-place op on the reference must not also change the input of the op
-- under test (nor, on the CPU self-test, the very tensor it is compared with).
local function fresh(r, t) return rawequal(r, t) and t:clone() or r end
function H.f64(t) return fresh(t:to("cpu"):to("float64"), t) end
-- The same values on the device under test (a copy, as above).
function H.dev(t) return fresh(t:to(H.DEV), t) end

-- Fixed batches of random token ids (CPU, int64, kept): {inputs [B, T], targets [B, T]}.
function H.batches(n, B, T, V, seed)
  local out = {}
  for i = 1, n do
    local ids = H.ids({ B, T + 1 }, V, seed + i)
    out[i] = { inputs = ids:narrow(2, 1, T):contiguous(), targets = ids:narrow(2, 2, T):contiguous() }
    titan.keep(out[i].inputs)
    titan.keep(out[i].targets)
  end
  return out
end

-- An output on the device, every element poisoned: NaN for floats, a
-- sentinel for integers.
function H.poison(shape, dt)
  local v = H.NAN
  if dt == "int32" or dt == "int64" then v = -123457
  elseif dt == "uint8" then v = 171
  elseif dt == "bool" then v = 1 end
  return titan.full(shape, v, { dtype = dt, device = H.DEV })
end

-- ---- models ------------------------------------------------------------------------

-- Releases a model, its RoPE tables and (when given) its AdamW state now.
function H.free_model(model, opt)
  if opt then opt:free_state() end
  if model._rope then
    model._rope.cos:free()
    model._rope.sin:free()
    model._rope = nil
  end
  model:free()
end

-- Mean cross-entropy of batch b ({inputs, targets}) through model on device.
function H.loss_of(model, b, device)
  local x, y = b.inputs:to(device), b.targets:to(device)
  local logits = model(x)
  local V = logits:size(-1)
  return titan.F.cross_entropy(logits:reshape(-1, V), y:reshape(-1))
end

-- Train `steps` AdamW steps (clip 1.0) of llama3 `flavor` built with opts
-- (device, seed, dtype, overrides) cycling over `bs`; returns the losses,
-- the gradient norms, the allocated device bytes after each step, and with
-- keep_weights host copies of the final parameters ({name, tensor}, kept).
function H.train(flavor, opts, bs, steps, keep_weights)
  local llama3, optim = require("models.llama3"), require("titan.optim")
  local device = opts.device
  local model = llama3.build(flavor, opts)
  local opt = optim.AdamW(model:named_parameters(), { lr = 3e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 })
  local params = model:parameters()
  local losses, norms, mem = {}, {}, {}
  local stats_dev = device:match("^cuda") and (device == "cuda" and "cuda:0" or device) or "cpu"
  for step = 1, steps do
    local b = bs[(step - 1) % #bs + 1]
    losses[step] = titan.scope(function()
      local loss = H.loss_of(model, b, device)
      loss:backward()
      return loss:item()
    end)
    norms[step] = optim.clip_grad_norm(params, 1.0)
    opt:step()
    opt:zero_grad()
    mem[step] = titan.memory_stats(stats_dev).allocated
  end
  local weights
  if keep_weights then
    weights = {}
    for _, np in ipairs(model:named_parameters()) do
      weights[#weights + 1] = { np[1], titan.keep(np[2]:to("cpu"):clone()) }
    end
  end
  H.free_model(model, opt)
  return losses, norms, mem, weights
end

-- ---- comparisons ------------------------------------------------------------------

-- A host float64 contiguous copy of t that the caller owns (never t itself).
local function host_f64(t)
  local h = t:to("cpu")
  local h2 = h:to("float64")
  if h ~= t and h ~= h2 then h:free() end
  if h2 == t or not h2:is_contiguous() then
    local c = h2:clone()
    h2 = c
  end
  return h2, ffi.cast("double*", C.tt_tensor_data(h2._c))
end

local function shape_str(t) return "[" .. table.concat(t:shape(), ", ") .. "]" end

-- Statistics of got against ref (any dtypes, devices, same shape).
function H.stats(got, ref)
  local n = got:numel()
  assert(n == ref:numel(), ("shape mismatch: got %s, reference %s"):format(shape_str(got), shape_str(ref)))
  local hg, pg = host_f64(got)
  local hr, pr = host_f64(ref)
  local nan, ss_d, ss_r = 0, 0, 0
  local first_nan
  for i = 0, n - 1 do
    local r = pr[i]
    if r == r and r ~= math.huge and r ~= -math.huge then ss_r = ss_r + r * r end
  end
  local rms = math.sqrt(ss_r / math.max(n, 1))
  -- An all-zero reference (a gradient that is exactly 0) is compared absolutely.
  local scale = rms > 0 and rms or 1
  local worst, worst_i = 0, -1
  for i = 0, n - 1 do
    local g, r = pg[i], pr[i]
    if g ~= g then
      if r == r then
        nan = nan + 1
        first_nan = first_nan or i
      end
    elseif r ~= r then
      nan = nan + 1 -- a number where the reference is NaN is wrong too
      first_nan = first_nan or i
    elseif r == math.huge or r == -math.huge or g == math.huge or g == -math.huge then
      if g ~= r then
        worst, worst_i = math.huge, i
      end
    else
      local d = math.abs(g - r)
      ss_d = ss_d + d * d
      local e = d / (math.abs(r) + scale)
      if e > worst then worst, worst_i = e, i end
    end
  end
  local rel = ss_r > 0 and math.sqrt(ss_d / ss_r) or math.sqrt(ss_d)
  local s = { n = n, nan = nan, first_nan = first_nan, rel = rel, worst = worst, worst_i = worst_i, rms = rms }
  if worst_i >= 0 then s.worst_got, s.worst_ref = pg[worst_i], pr[worst_i] end
  hg:free()
  hr:free()
  return s
end

-- Fails (error) unless got matches ref within tol; returns the statistics.
function H.check(got, ref, tol, what)
  local s = H.stats(got, ref)
  what = what or "values"
  if s.nan > 0 then
    error(("%s %s: %d of %d elements are NaN (or unwritten: outputs are poisoned with NaN) where the reference "
      .. "is finite; first at flat index %d"):format(what, shape_str(got), s.nan, s.n, s.first_nan), 2)
  end
  if s.rel > tol or s.worst > 10 * tol then
    error(("%s %s: relative error %.3g (tolerance %.3g); worst element %d: got %.9g, reference %.9g "
      .. "(%.3g of |ref| + rms, limit %.3g)"):format(what, shape_str(got), s.rel, tol, s.worst_i, s.worst_got or 0,
      s.worst_ref or 0, s.worst, 10 * tol), 2)
  end
  return s
end

-- Exact equality (NaN positions must match too).
function H.check_exact(got, ref, what)
  local n = got:numel()
  assert(n == ref:numel(), ("%s: shape mismatch %s vs %s"):format(what or "values", shape_str(got), shape_str(ref)))
  local hg, pg = host_f64(got)
  local hr, pr = host_f64(ref)
  local bad, first = 0, nil
  for i = 0, n - 1 do
    local g, r = pg[i], pr[i]
    if not (g == r or (g ~= g and r ~= r)) then
      bad = bad + 1
      first = first or i
    end
  end
  local fg, fr = first and pg[first], first and pr[first]
  hg:free()
  hr:free()
  if bad > 0 then
    error(("%s %s: %d of %d elements differ; first at flat index %d: got %.17g, expected %.17g"):format(
      what or "values", shape_str(got), bad, n, first, fg, fr), 2)
  end
end

-- The tolerance for dtype dt times a factor.
function H.tol(dt, factor) return (H.TOL[dt] or 1e-5) * (factor or 1) end

-- fn() with the environment variable var set to v (left unset for nil), unset afterwards. The CUDA
-- backend's settings (the lean kernels' plans, TITAN_CUDA_GEMM_API) are read at each launch, so one
-- process can go through every choice.
pcall(ffi.cdef, "int setenv(const char *name, const char *value, int overwrite); int unsetenv(const char *name);")
function H.with_env(var, v, fn)
  if v then ffi.C.setenv(var, v, 1) end
  local fine, err = pcall(fn)
  ffi.C.unsetenv(var)
  if not fine then error(err, 0) end
end

-- Run fn inside a titan.scope (device memory released after each test).
function H.scoped(fn) return function() titan.scope(fn) end end

-- A synchronizing read of one element (makes asynchronous kernel errors
-- surface inside the test that caused them).
function H.sync()
  if H.ON_GPU then
    local t = titan.zeros({ 1 }, { device = H.DEV })
    t:to("cpu")
    t:free()
  end
end

return H
