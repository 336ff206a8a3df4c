-- bench/gpu.lua — Titan on one GPU: bf16 GEMM TFLOP/s (8192^3 and the
-- Llama 3 8B linear shapes), attention forward+backward TFLOP/s, HBM GB/s of
-- RMSNorm and AdamW (next to a plain device copy, the ceiling), and training
-- tokens/s + MFU of Llama 3 debugmodel and 1B. PyTorch on the same GPU:
-- bench/gpu_torch.py (it prints the side-by-side table). Targets: docs/gpu.md.
--
--   ./build-gpu/titan bench/gpu.lua [--json FILE] [--budget SECONDS] [--quick]
--                                   [--only SECTIONS] [--real-init] [--device cpu --smoke]
--
-- --budget: stop starting new measurements when it would run past this many
-- seconds (the GPU check gives each step a deadline); --quick: the headline
-- shapes only; --only gemm,attention,memory,train: those sections alone (a short
-- device lease); --real-init: the model's seeded init (drawn on the host when
-- the backend has no RNG kernel: ~20 s for 1B) instead of tiling one random
-- block on the device; --device cpu --smoke: tiny shapes on the CPU, to check
-- this script runs at all on a machine without a GPU.
--
-- Every measurement is guarded: one that fails prints `error: ...` and the
-- rest go on. Timing: warm-up, then rounds of back-to-back calls between
-- device synchronizations (cudaDeviceSynchronize through the FFI); the
-- median round. Benchmarks print figures; they never assert on them.
package.path = "./bench/?.lua;" .. package.path
local titan = require("titan")
local common = require("common")
local llama3 = require("models.llama3")
local optim = require("titan.optim")
local cuda_graph = require("titan.cuda_graph")
local profiler = require("titan.profiler")
local ffi, C = titan.ffi, titan.C
local F = titan.F

local PEAK = 989e12 -- H200 (and H100 SXM) dense bf16 FLOP/s

-- ---- arguments ----------------------------------------------------------------
local args = { budget = 1e9, json = nil, quick = false, device = "cuda", smoke = false, real_init = false, only = nil }
local SECTIONS = { gemm = true, attention = true, memory = true, train = true }
do
  local argv = { ... }
  local i = 1
  while i <= #argv do
    local a = argv[i]
    if a == "--json" then args.json = argv[i + 1]; i = i + 1
    elseif a == "--budget" then args.budget = tonumber(argv[i + 1]); i = i + 1
    elseif a == "--device" then args.device = argv[i + 1]; i = i + 1
    elseif a == "--quick" then args.quick = true
    elseif a == "--smoke" then args.smoke = true
    elseif a == "--real-init" then args.real_init = true
    elseif a == "--only" then
      args.only = {}
      for name in tostring(argv[i + 1]):gmatch("[^,]+") do
        if not SECTIONS[name] then
          error("bench/gpu.lua: --only " .. tostring(argv[i + 1]) .. ": no section " .. name
            .. " (expected a comma list of gemm, attention, memory, train)", 0)
        end
        args.only[name] = true
      end
      i = i + 1
    else error("bench/gpu.lua: unknown argument " .. tostring(a) .. " (expected --json FILE, --budget S, --quick, "
      .. "--only SECTIONS, --real-init, --device D, --smoke)", 0) end
    i = i + 1
  end
end
local DEV = args.device
local ON_GPU = DEV:match("^cuda") ~= nil
local T_START = common.now()
local function elapsed() return common.now() - T_START end
local function time_left() return args.budget - elapsed() end

if ON_GPU and not titan.cuda_available() then
  io.stderr:write("bench/gpu.lua: no CUDA device (or titan built without TITAN_CUDA)\n")
  os.exit(1)
end

-- ---- device synchronization -----------------------------------------------------
pcall(ffi.cdef, "int cudaDeviceSynchronize(void); const char *cudaGetErrorString(int error);")
local sync, sync_how
if not ON_GPU then
  sync, sync_how = function() end, "none (cpu)"
else
  local lib
  if pcall(function() return ffi.C.cudaDeviceSynchronize end) then
    lib, sync_how = ffi.C, "cudaDeviceSynchronize (cudart already in the process)"
  else
    for _, name in ipairs({ "cudart", "libcudart.so.13", "libcudart.so.12", "libcudart.so" }) do
      local ok, l = pcall(ffi.load, name)
      if ok then lib, sync_how = l, "cudaDeviceSynchronize (" .. name .. ")" break end
    end
  end
  if lib then
    sync = function()
      local rc = lib.cudaDeviceSynchronize()
      if rc ~= 0 then error("cudaDeviceSynchronize: " .. ffi.string(lib.cudaGetErrorString(rc)), 0) end
    end
  else
    sync_how = "a one-element device->host copy (cudart not found through the FFI)"
    sync = function()
      local t = titan.zeros({ 1 }, { device = DEV })
      t:to("cpu")
      t:free()
    end
  end
end

-- Median seconds per call: `warmup` calls, then `rounds` rounds of `reps`
-- back-to-back calls, each round between two synchronizations.
local function time_it(fn, reps, rounds, warmup)
  for _ = 1, warmup or 2 do fn() end
  sync()
  local ts = {}
  for r = 1, rounds or 5 do
    local t0 = common.now()
    for _ = 1, reps do fn() end
    sync()
    ts[r] = (common.now() - t0) / reps
  end
  table.sort(ts)
  return ts[math.floor((#ts + 1) / 2)]
end

-- Enough reps for ~`target` seconds per round, from one timed call (after
-- an untimed one: the first call builds plans and picks algorithms).
local function reps_for(fn, target)
  fn()
  sync()
  local t0 = common.now()
  fn()
  sync()
  local one = math.max(common.now() - t0, 1e-6)
  return math.max(1, math.min(200, math.floor((target or 0.05) / one)))
end

local function check(st, what) if st ~= 0 then error(what .. ": " .. ffi.string(C.tt_last_error()), 0) end end
local function box(t) local b = ffi.new("tt_tensor*[1]"); b[0] = t._c; return b end

-- ---- inputs -------------------------------------------------------------------------
-- Random device tensors without drawing gigabytes on the host: one block of
-- normals per (dtype, std), drawn once, tiled into each tensor by device
-- copies (from a seed-dependent start, so operands differ).
local CHUNK = args.smoke and 65536 or 16777216
local blocks = {}
local function block_for(dt, std)
  local key = dt .. ":" .. std
  if not blocks[key] then
    blocks[key] = titan.keep(titan.randn({ CHUNK }, { seed = 12345, offset = 0, std = std, dtype = dt, device = DEV }))
  end
  return blocks[key]
end

local function rand_dev(shape, dt, seed, std)
  local t = titan.empty(shape, { dtype = dt, device = DEV })
  local n = t:numel()
  local block = block_for(dt, std or 1)
  local flat = t:view(n)
  local off, start = 0, ((seed or 1) * 7919) % CHUNK
  while off < n do
    local len = math.min(CHUNK - start, n - off)
    flat:narrow(1, off + 1, len):copy_(block:narrow(1, start + 1, len))
    off = off + len
    start = 0
  end
  return t
end

-- ---- results --------------------------------------------------------------------------
local results = { meta = {}, gemm = {}, attention = {}, memory = {}, train = {}, errors = {} }

local function json_encode(v)
  local t = type(v)
  if t == "nil" then return "null" end
  if t == "boolean" then return tostring(v) end
  if t == "number" then
    if v ~= v or v == math.huge or v == -math.huge then return "null" end
    return (v == math.floor(v) and math.abs(v) < 1e15) and ("%d"):format(v) or ("%.6g"):format(v)
  end
  if t == "string" then
    return '"' .. v:gsub('[%c"\\]', function(c)
      local map = { ['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\t"] = "\\t", ["\r"] = "\\r" }
      return map[c] or ("\\u%04x"):format(c:byte())
    end) .. '"'
  end
  if #v > 0 or next(v) == nil then
    local parts = {}
    for i = 1, #v do parts[i] = json_encode(v[i]) end
    return "[" .. table.concat(parts, ",") .. "]"
  end
  local keys = {}
  for k in pairs(v) do keys[#keys + 1] = tostring(k) end
  table.sort(keys)
  local parts = {}
  for _, k in ipairs(keys) do parts[#parts + 1] = json_encode(k) .. ":" .. json_encode(v[k]) end
  return "{" .. table.concat(parts, ",") .. "}"
end

local function save()
  if not args.json then return end
  local f = io.open(args.json, "w")
  if f then
    f:write(json_encode(results), "\n")
    f:close()
  end
end

-- Run one measurement: skipped when less than `need` seconds are left, its
-- error printed (and recorded) without stopping the others.
local function guarded(section, label, need, fn)
  if args.only and not args.only[section] then return nil end
  if time_left() < need then
    print(("skipped: %s %s (%.0f s left of the budget, needs ~%.0f)"):format(section, label, time_left(), need))
    results.errors[#results.errors + 1] = { section = section, label = label, error = "skipped: no time left" }
    return nil
  end
  local ok, r = pcall(function() return titan.scope(fn) end)
  if ON_GPU then titan.empty_cache("cuda:0") end
  if not ok then
    local msg = tostring(r):gsub("\n", " ")
    print(("error: %s %s: %s"):format(section, label, msg))
    results.errors[#results.errors + 1] = { section = section, label = label, error = msg }
    return nil
  end
  save()
  return r
end

local function f1(x) return x and ("%.1f"):format(x) or "-" end
local function f3(x) return x and ("%.3f"):format(x) or "-" end

-- ---- GEMM ----------------------------------------------------------------------------------
pcall(ffi.cdef, "int setenv(const char *name, const char *value, int overwrite); int unsetenv(const char *name);")
-- fn() with the environment variable var set to v, unset afterwards (the CUDA settings are read at each
-- launch or GEMM).
local function with_env(var, v, fn)
  ffi.C.setenv(var, v, 1)
  local fine, err = pcall(fn)
  ffi.C.unsetenv(var)
  if not fine then error(err, 0) end
end
local gemm_rows = {}
local function add_gemm_row(r)
  results.gemm[#results.gemm + 1] = r
  gemm_rows[#gemm_rows + 1] = { r.label, r.dtype, ("%dx%dx%d"):format(r.M, r.N, r.K), f3(r.ms), f1(r.tflops),
    ("%.0f%%"):format(100 * r.tflops * 1e12 / PEAK) }
end
-- ta/tb as the C API takes them: y = x @ W^T is (x [M,K], W [N,K], 0, 1).
-- tuned: with training.gemm_autotune's switch on (docs/cuda.md), next to the
-- heuristic's row of the same shape; the first call, which times the
-- candidates, is outside the timing.
-- api: "cublas" for TITAN_CUDA_GEMM_API=cublas (cuBLAS's cublasGemmStridedBatchedEx, PyTorch's mm,
-- instead of cuBLASLt; docs/cuda.md), next to the cuBLASLt row of the same shape.
local function gemm(label, M, N, K, dt, ta, tb, tuned, api)
  if api then
    return with_env("TITAN_CUDA_GEMM_API", api, function() gemm(label .. " (" .. api .. ")", M, N, K, dt, ta, tb, tuned) end)
  end
  ta, tb = ta or 0, tb or 1
  label = tuned and label .. " (autotuned)" or label
  local est = 2 * M * N * K / 600e12 * (tuned and 60 or 20) + 3
  titan.set_gemm_autotune(tuned or false)
  local r = guarded("gemm", label, ON_GPU and est or 0, function()
    local a = rand_dev(ta == 1 and { K, M } or { M, K }, dt, 1)
    local b = rand_dev(tb == 1 and { N, K } or { K, N }, dt, 2)
    local out = titan.empty({ M, N }, { dtype = dt, device = DEV })
    local oa = box(out)
    local fn = function() check(C.tt_op_matmul(a._c, b._c, ta, tb, 1, 0, oa), "matmul") end
    if tuned then fn() end
    local t = time_it(fn, reps_for(fn, 0.05), 5, 2)
    local tflops = 2 * M * N * K / t / 1e12
    print(("  [gemm] %-26s %s %5dx%5dx%5d  %8.3f ms  %7.1f TFLOP/s"):format(label, dt, M, N, K, t * 1e3, tflops))
    return { label = label, dtype = dt, M = M, N = N, K = K, ms = t * 1e3, tflops = tflops, ta = ta, tb = tb }
  end)
  if r then add_gemm_row(r) end
  titan.set_gemm_autotune(false)
end

-- ---- attention -----------------------------------------------------------------------------
local attn_rows = {}
local function attention(B, T, Hq, Hkv, D, dt)
  local label = ("B%d T%d Hq%d Hkv%d D%d"):format(B, T, Hq, Hkv, D)
  local fwd_flops = 4 * B * Hq * T * T * D / 2
  local r = guarded("attention", label, ON_GPU and fwd_flops * 3.5 / 300e12 * 25 + 5 or 0, function()
    local q = rand_dev({ B, T, Hq, D }, dt, 1)
    local k = rand_dev({ B, T, Hkv, D }, dt, 2)
    local v = rand_dev({ B, T, Hkv, D }, dt, 3)
    local dout = rand_dev({ B, T, Hq, D }, dt, 4)
    local sdt = dt == "float64" and "float64" or "float32"
    local o, lse = titan.empty({ B, T, Hq, D }, { dtype = dt, device = DEV }), titan.empty({ B, Hq, T }, { dtype = sdt, device = DEV })
    local dq = titan.empty({ B, T, Hq, D }, { dtype = dt, device = DEV })
    local dk, dv = titan.empty({ B, T, Hkv, D }, { dtype = dt, device = DEV }), titan.empty({ B, T, Hkv, D }, { dtype = dt, device = DEV })
    local bo, bl, bq, bk, bv = box(o), box(lse), box(dq), box(dk), box(dv)
    local scale = 1 / math.sqrt(D)
    local fwd = function() check(C.tt_op_attention(q._c, k._c, v._c, 1, scale, bo, bl), "attention") end
    local bwd = function()
      check(C.tt_op_attention_backward(q._c, k._c, v._c, o._c, lse._c, dout._c, 1, scale, bq, bk, bv), "attention backward")
    end
    local both = function() fwd(); bwd() end
    local tf = time_it(fwd, reps_for(fwd, 0.05), 5, 2)
    local tb = time_it(bwd, reps_for(bwd, 0.05), 5, 2)
    local tfb = time_it(both, reps_for(both, 0.05), 5, 1)
    local res = { label = label, dtype = dt, B = B, T = T, Hq = Hq, Hkv = Hkv, D = D, fwd_ms = tf * 1e3, bwd_ms = tb * 1e3,
      fwd_bwd_ms = tfb * 1e3, fwd_tflops = fwd_flops / tf / 1e12, bwd_tflops = 2.5 * fwd_flops / tb / 1e12,
      fwd_bwd_tflops = 3.5 * fwd_flops / tfb / 1e12 }
    print(("  [attention] %s %s: fwd %.1f, bwd %.1f, fwd+bwd %.1f TFLOP/s"):format(label, dt, res.fwd_tflops,
      res.bwd_tflops, res.fwd_bwd_tflops))
    return res
  end)
  if r then
    results.attention[#results.attention + 1] = r
    attn_rows[#attn_rows + 1] = { r.label, r.dtype, f3(r.fwd_ms), f1(r.fwd_tflops), f3(r.bwd_ms), f1(r.bwd_tflops),
      f3(r.fwd_bwd_ms), f1(r.fwd_bwd_tflops) }
  end
end

-- ---- memory-bound kernels --------------------------------------------------------------------
local mem_rows = {}
local function mem_row(r)
  results.memory[#results.memory + 1] = r
  mem_rows[#mem_rows + 1] = { r.kernel, r.dtype, r.shape, f3(r.ms), f1(r.gbps) }
  print(("  [memory] %-18s %-9s %-12s %8.3f ms  %7.1f GB/s"):format(r.kernel, r.dtype, r.shape, r.ms, r.gbps))
end

local function esize(dt) return tonumber(C.tt_dtype_size(require("titan.tensor").dtype_of(dt))) end

local function copy_bench(n, dt)
  guarded("memory", "copy", ON_GPU and 5 or 0, function()
    local a = rand_dev({ n }, dt, 1)
    local b = titan.empty({ n }, { dtype = dt, device = DEV })
    local fn = function() check(C.tt_tensor_copy(b._c, a._c), "copy") end
    local t = time_it(fn, reps_for(fn, 0.05), 5, 2)
    mem_row({ kernel = "device copy", dtype = dt, shape = tostring(n), ms = t * 1e3, gbps = 2 * n * esize(dt) / t / 1e9 })
  end)
end

-- RMSNorm's plan (kernels/cuda/norm.cu): `how` nil for the kernel's own,
-- { lanes = N } for TITAN_CUDA_NORM_GROUP=N (the lanes each row gets, on the
-- exact kernels) or { plan = "exact" } for TITAN_CUDA_NORM_PLAN (bf16 on the
-- double-statistics kernels instead of the lean ones), for this measurement
-- only (the settings are read at each launch), to time the choices side by
-- side.
local function rmsnorm_bench(rows, dim, dt, how)
  local var = how and (how.lanes and "TITAN_CUDA_NORM_GROUP" or "TITAN_CUDA_NORM_PLAN")
  local val = how and tostring(how.lanes or how.plan)
  local note = not how and "" or how.lanes and (" (" .. val .. " lanes)") or (" (" .. val .. ")")
  if var then ffi.C.setenv(var, val, 1) end
  guarded("memory", "rmsnorm " .. dt .. note, ON_GPU and 11 or 0, function()
    local x = rand_dev({ rows, dim }, dt, 1)
    local w = rand_dev({ dim }, dt, 2, 0.1)
    local dy = rand_dev({ rows, dim }, dt, 3)
    local sdt = dt == "float64" and "float64" or "float32"
    local y, rstd = titan.empty({ rows, dim }, { dtype = dt, device = DEV }), titan.empty({ rows }, { dtype = sdt, device = DEV })
    local dx, dw = titan.empty({ rows, dim }, { dtype = dt, device = DEV }), titan.zeros({ dim }, { dtype = dt, device = DEV })
    local h = titan.empty({ rows, dim }, { dtype = dt, device = DEV })
    local by, br, bdx, bh = box(y), box(rstd), box(dx), box(h)
    local fwd = function() check(C.tt_op_rmsnorm(x._c, w._c, 1e-5, by, br), "rmsnorm") end
    local bwd = function() check(C.tt_op_rmsnorm_backward(x._c, w._c, rstd._c, dy._c, bdx, dw._c), "rmsnorm backward") end
    -- the blocks' form: h = x + residual (dy standing in for it), normalized
    local add = function() check(C.tt_op_add_rmsnorm(x._c, dy._c, w._c, 1e-5, bh, by, br), "add_rmsnorm") end
    local tf = time_it(fwd, reps_for(fwd, 0.05), 5, 2)
    local tb = time_it(bwd, reps_for(bwd, 0.05), 5, 2)
    local ta = time_it(add, reps_for(add, 0.05), 5, 2)
    local bytes = rows * dim * esize(dt)
    local shape = ("%dx%d"):format(rows, dim)
    local function row(kernel, t, moved) -- moved: row-sized tensors read and written
      mem_row({ kernel = kernel .. note, dtype = dt, shape = shape, ms = t * 1e3, gbps = moved * bytes / t / 1e9 })
    end
    row("rmsnorm fwd", tf, 2) -- x, y
    row("rmsnorm bwd", tb, 3) -- x, dy, dx
    row("add_rmsnorm fwd", ta, 4) -- x, r, h, y
  end)
  if var then ffi.C.unsetenv(var) end
end

-- The lean kernels' plan settings (kernels/cuda/lean.cuh) in force, as a note for a row: "" when none
-- is set, ", exact kernels" when all of them say exact, else each set one.
local PLAN_VARS = { { "TITAN_CUDA_NORM_PLAN", "norm" }, { "TITAN_CUDA_SWIGLU_PLAN", "swiglu" },
  { "TITAN_CUDA_CE_PLAN", "ce" }, { "TITAN_CUDA_ROPE_PLAN", "rope" } }
local function plan_note()
  local parts, exact = {}, 0
  for _, v in ipairs(PLAN_VARS) do
    local val = os.getenv(v[1])
    if val and val ~= "" then parts[#parts + 1] = v[2] .. " " .. val end
    if val == "exact" then exact = exact + 1 end
  end
  local api = os.getenv("TITAN_CUDA_GEMM_API")
  local gemm_api = api and api ~= "" and ", gemm " .. api or ""
  if exact == #PLAN_VARS then return ", exact kernels" .. gemm_api end
  return (#parts > 0 and ", " .. table.concat(parts, ", ") or "") .. gemm_api
end
local function with_plans(v, fn)
  for _, pv in ipairs(PLAN_VARS) do ffi.C.setenv(pv[1], v, 1) end
  local fine, err = pcall(fn)
  for _, pv in ipairs(PLAN_VARS) do ffi.C.unsetenv(pv[1]) end
  if not fine then error(err, 0) end
end

-- SwiGLU (the FFN's gate and up, rows x hidden), cross-entropy (rows x vocab logits) and RoPE (the
-- queries, rows x heads x head_dim), bf16 on a GPU: the lean kernels, or the exact ones with plan =
-- "exact" (the TITAN_CUDA_*_PLAN settings).
local function lean_bench(rows, hidden, vocab, heads, head_dim, dt, plan)
  local note = plan and (" (" .. plan .. ")") or ""
  local function go()
    guarded("memory", "rope " .. dt .. note, ON_GPU and 6 or 0, function()
      local x = rand_dev({ 1, rows, heads, head_dim }, dt, 5)
      local y = titan.empty({ 1, rows, heads, head_dim }, { dtype = dt, device = DEV })
      local c, s = ffi.new("tt_tensor*[1]"), ffi.new("tt_tensor*[1]")
      check(C.tt_op_rope_table(head_dim, rows, 500000, 32, 1, 4, 8192, C.TT_F32, c, s), "rope_table")
      local wrap = require("titan.tensor").wrap
      local cos, sin = wrap(c[0]):to(DEV), wrap(s[0]):to(DEV)
      local by = box(y)
      local fwd = function() check(C.tt_op_rope(x._c, cos._c, sin._c, 0, 0, by), "rope") end
      local t = time_it(fwd, reps_for(fwd, 0.05), 5, 2)
      mem_row({ kernel = "rope fwd" .. note, dtype = dt, shape = ("%dx%dx%d"):format(rows, heads, head_dim),
        ms = t * 1e3, gbps = 2 * rows * heads * head_dim * esize(dt) / t / 1e9 })
    end)
    guarded("memory", "swiglu " .. dt .. note, ON_GPU and 8 or 0, function()
      local sh = { rows, hidden }
      local a, b, dy = rand_dev(sh, dt, 1), rand_dev(sh, dt, 2), rand_dev(sh, dt, 3)
      local o = { dtype = dt, device = DEV }
      local y, da, db = titan.empty(sh, o), titan.empty(sh, o), titan.empty(sh, o)
      local by, bda, bdb = box(y), box(da), box(db)
      local fwd = function() check(C.tt_op_swiglu(a._c, b._c, by), "swiglu") end
      local bwd = function() check(C.tt_op_swiglu_backward(a._c, b._c, dy._c, bda, bdb), "swiglu backward") end
      local tf = time_it(fwd, reps_for(fwd, 0.05), 5, 2)
      local tb = time_it(bwd, reps_for(bwd, 0.05), 5, 2)
      local bytes, shape = rows * hidden * esize(dt), ("%dx%d"):format(rows, hidden)
      mem_row({ kernel = "swiglu fwd" .. note, dtype = dt, shape = shape, ms = tf * 1e3, gbps = 3 * bytes / tf / 1e9 })
      mem_row({ kernel = "swiglu bwd" .. note, dtype = dt, shape = shape, ms = tb * 1e3, gbps = 5 * bytes / tb / 1e9 })
    end)
    guarded("memory", "cross_entropy " .. dt .. note, ON_GPU and 8 or 0, function()
      local logits = rand_dev({ rows, vocab }, dt, 4, 3)
      local targets = titan.zeros({ rows }, { dtype = "int64", device = DEV })
      local dl = titan.full({ rows }, 1 / rows, { dtype = dt, device = DEV })
      local losses = titan.empty({ rows }, { dtype = dt, device = DEV })
      local lse = titan.empty({ rows }, { dtype = dt == "float64" and "float64" or "float32", device = DEV })
      local dlogits = titan.empty({ rows, vocab }, { dtype = dt, device = DEV })
      local bl, blse, bdl = box(losses), box(lse), box(dlogits)
      local n = ffi.new("int64_t[1]")
      local fwd = function() check(C.tt_op_cross_entropy(logits._c, targets._c, -100, bl, blse, n), "cross_entropy") end
      local bwd = function()
        check(C.tt_op_cross_entropy_backward(logits._c, targets._c, lse._c, dl._c, -100, bdl), "cross_entropy backward")
      end
      local tf = time_it(fwd, reps_for(fwd, 0.05), 5, 2)
      local tb = time_it(bwd, reps_for(bwd, 0.05), 5, 2)
      local bytes, shape = rows * vocab * esize(dt), ("%dx%d"):format(rows, vocab)
      mem_row({ kernel = "cross_entropy fwd" .. note, dtype = dt, shape = shape, ms = tf * 1e3,
        gbps = bytes / tf / 1e9 })
      mem_row({ kernel = "cross_entropy bwd" .. note, dtype = dt, shape = shape, ms = tb * 1e3,
        gbps = 2 * bytes / tb / 1e9 })
    end)
  end
  if plan then with_plans(plan, go) else go() end
end

-- The embedding's weight gradient (index_add over one slice): n ids into vocab x dim, with ids as
-- skewed as a BPE vocabulary's tokens (u^4: a few hot low rows) or uniform, through the sorted plan
-- and the scan (TITAN_CUDA_INDEX_ADD_PLAN). GB/s counts dy read and its rows' read and write.
local function embed_bench(n, vocab, dim, dt)
  for _, dist in ipairs({ "skewed", "uniform" }) do
    for _, plan in ipairs({ "sorted", "scan" }) do
      local label = ("embedding bwd (%s, %s ids)"):format(plan, dist)
      guarded("memory", label, ON_GPU and 4 or 0, function()
        local u = titan.rand({ n }, { seed = 3, offset = 0, dtype = "float64" })
        if dist == "skewed" then u = u:pow(4) end
        u:mul_(vocab)
        local ids = u:to("int64"):to(DEV)
        local dy = rand_dev({ n, dim }, dt, 6)
        local dw = titan.zeros({ vocab, dim }, { dtype = dt, device = DEV })
        local go = function() check(C.tt_op_embedding_backward(dy._c, ids._c, dw._c), "embedding_backward") end
        ffi.C.setenv("TITAN_CUDA_INDEX_ADD_PLAN", plan, 1)
        local fine, t = pcall(function() return time_it(go, reps_for(go, 0.05), 5, 2) end)
        ffi.C.unsetenv("TITAN_CUDA_INDEX_ADD_PLAN")
        if not fine then error(t, 0) end
        mem_row({ kernel = label, dtype = dt, shape = ("%dx%d of %d"):format(n, dim, vocab), ms = t * 1e3,
          gbps = 3 * n * dim * esize(dt) / t / 1e9 })
      end)
    end
  end
end

local function adamw_bench(n, pdt, gdt, master)
  local label = ("adamw %s%s"):format(pdt, master and "+master" or "")
  guarded("memory", label, ON_GPU and 8 or 0, function()
    local p = rand_dev({ n }, pdt, 1, 0.02)
    local g = rand_dev({ n }, gdt, 2, 0.001)
    local m, v = titan.zeros({ n }, { device = DEV }), titan.zeros({ n }, { device = DEV })
    local ms = master and p:to("float32") or nil
    local step = 0
    local fn = function()
      step = step + 1
      check(C.tt_op_adamw(p._c, g._c, m._c, v._c, ms and ms._c or nil, 1e-4, 0.9, 0.95, 1e-8, 0.1, step), "adamw")
    end
    local t = time_it(fn, reps_for(fn, 0.05), 5, 2)
    -- read p (not when a master holds the value), g, m, v (+ master); write p, m, v (+ master)
    local bytes = n * ((master and 1 or 2) * esize(pdt) + esize(gdt) + 16 + (master and 8 or 0))
    mem_row({ kernel = label, dtype = pdt .. "/" .. gdt, shape = tostring(n), ms = t * 1e3, gbps = bytes / t / 1e9 })
  end)
end

-- The whole optimizer step of a model's parameter list (the shapes of
-- `flavor`, f32): one tt_op_adamw launch per tensor against tt_op_adamw_multi
-- (up to 32 tensors per launch), the same bits. For a small model the
-- launches, not the bytes, are the cost.
local function adamw_model_bench(flavor)
  local label = ("adamw step, %s parameters"):format(flavor)
  guarded("memory", label, ON_GPU and 8 or 0, function()
    local model = llama3.build(flavor, { device = "meta" })
    local ps, entries, bytes = {}, {}, 0
    for i, np in ipairs(model:named_parameters()) do
      local shape = np[2]:shape()
      local n = 1
      for _, d in ipairs(shape) do n = n * d end
      local e = { rand_dev({ n }, "float32", i, 0.02), rand_dev({ n }, "float32", 1000 + i, 0.001),
        titan.zeros({ n }, { device = DEV }), titan.zeros({ n }, { device = DEV }), nil, 1 }
      ps[i], entries[i] = e, e
      bytes = bytes + n * 28 -- read p, g, m, v; write p, m, v
    end
    local step = 0
    local single = function()
      step = step + 1
      for _, e in ipairs(ps) do
        check(C.tt_op_adamw(e[1]._c, e[2]._c, e[3]._c, e[4]._c, nil, 1e-4, 0.9, 0.95, 1e-8, 0.1, step), "adamw")
      end
    end
    local multi = function()
      step = step + 1
      for _, e in ipairs(entries) do e[6] = step end
      titan.ops.adamw_multi_(entries, { lr = 1e-4, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 })
    end
    for _, case in ipairs({ { "per tensor", single }, { "multi-tensor", multi } }) do
      local t = time_it(case[2], reps_for(case[2], 0.05), 5, 2)
      mem_row({ kernel = ("%s (%d tensors, %s)"):format(label, #ps, case[1]), dtype = "float32", shape = tostring(bytes / 28),
        ms = t * 1e3, gbps = bytes / t / 1e9 })
    end
  end)
end

-- ---- training ----------------------------------------------------------------------------------
local train_rows = {}

-- Cheap realistic weights: std 0.02 (the embedding std 1, or dim^-0.5 when it
-- is also the output layer, as llama3.init_rules), norms 1, tiled from device
-- blocks seeded by the parameter's position.
local function fast_init(model)
  local emb_std = model.args.tie_embeddings and model.args.dim ^ -0.5 or 1
  titan.no_grad(function()
    for i, np in ipairs(model:named_parameters()) do
      local name, p = np[1], np[2]
      if name:match("norm%.weight$") then
        p:fill_(1)
      else
        local src = rand_dev(p:shape(), p:dtype(), i, name:match("^tok_embeddings") and emb_std or 0.02)
        p:copy_(src)
        src:free()
      end
    end
    for _, nb in ipairs(model:named_buffers()) do nb[2]:fill_(0) end -- (MoE's expert biases)
  end)
end

-- A transform applied to each train_bench model after its initialization (nil: none), e.g. the float8
-- conversion (docs/float8.md).
local train_convert

-- graphs: after the first step, replay the forward + backward and the
-- update (clip, AdamW, zero_grad) from two CUDA graphs (titan.cuda_graph;
-- training.cuda_graphs in the trainer). profile: one more step after the
-- timed ones, region by region (titan.profiler on the device's clock, then
-- again with a sync at every region): where the step's time goes, printed
-- and kept in the JSON.
local function train_bench(label, flavor, B, T, dtypes, steps, warmup, need, graphs, profile)
  for _, dt in ipairs(dtypes) do
    local r = guarded("train", label .. " " .. dt, need, function()
      -- What the run holds on the device, released whether it ends or fails
      -- (a graph left alive would also keep later attention shapes off cuDNN).
      local model, opt, graph, upd, plan, norm_clip, eager_nc
      local function cleanup()
        if eager_nc then eager_nc:free() end
        eager_nc = nil
        if graph then graph:free() end
        if upd then upd:free() end
        if plan then opt:free_device_plan(plan) end
        if norm_clip then norm_clip:free() end
        graph, upd, plan, norm_clip = nil, nil, nil, nil
        if opt then
          opt:free_state()
          opt = nil
        end
        if model then
          if model._rope then model._rope.cos:free(); model._rope.sin:free() end
          model:free()
          model = nil
        end
      end
      local ok, res = pcall(function()
        local t0 = common.now()
        model = llama3.build(flavor, { device = "meta", dtype = dt })
        model:to_empty(DEV)
        if args.real_init then llama3.init_weights(model, 0) else fast_init(model) end
        if train_convert then train_convert(model) end
        sync()
        local build_s = common.now() - t0
        local V = model.args.vocab_size
        local flops_per_token, nparams = llama3.flops_per_token(model, T)
        opt = optim.AdamW(model:named_parameters(), { lr = 1e-4, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 })
        local params = model:parameters()
        local u = titan.rand({ B, T + 1 }, { seed = 7, offset = 0, dtype = "float64" })
        u:mul_(V)
        local ids = u:to("int64")
        local x = ids:narrow(2, 1, T):contiguous():to(DEV)
        local y = ids:narrow(2, 2, T):contiguous():to(DEV)
        local stats_dev = ON_GPU and "cuda:0" or "cpu"
        local last_loss
        local function ce(logits) return F.cross_entropy(logits:reshape(-1, V), y:reshape(-1), { num_tokens = B * T }) end
        local function fwd_bwd() -- (the regions time only the profiled step)
          local logits = profiler.region("forward", "step", model, x)
          local loss = profiler.region("loss", "step", ce, logits)
          profiler.region("backward", "step", loss.backward, loss)
          return loss
        end
        -- As the trainer does: the loss is read once, after the update; the
        -- eager update runs through the device path (no wait for the norm).
        local loss_t
        local function step(i)
          if graphs and i > 1 then
            if not graph then
              local why
              graph, why = cuda_graph.capture(DEV, function() return { loss = fwd_bwd() } end)
              if not graph then error("cuda graph capture failed: " .. why, 0) end
            end
            graph:replay()
            loss_t = graph.outputs.loss
          else
            loss_t = titan.scope(function() return titan.keep(fwd_bwd()) end)
          end
          if graphs and i > 1 then
            -- the update as a second graph, as training.cuda_graphs does
            -- (titan.graph_step): scalars in device memory, rewritten per step
            if not upd then
              local grads, why = {}, nil
              for _, p in ipairs(params) do grads[#grads + 1] = p.grad end
              plan = assert(opt:device_plan())
              norm_clip = titan.keep(titan.zeros({ 2 }, { dtype = "float64", device = DEV }))
              upd, why = cuda_graph.capture(DEV, function()
                titan.ops.global_norm_dev_(grads, 1.0, norm_clip)
                opt:launch_device_step(plan, norm_clip)
                titan.ops.fill_multi_(grads, 0)
              end)
              if not upd then error("cuda graph capture of the update failed: " .. why, 0) end
            end
            opt:prepare_device_step(plan)
            upd:replay()
          else
            local grads = {}
            for _, p in ipairs(params) do grads[#grads + 1] = p.grad end
            eager_nc = eager_nc or titan.keep(titan.zeros({ 2 }, { dtype = "float64", device = DEV }))
            profiler.region("optimizer", "step", function()
              titan.ops.global_norm_dev_(grads, 1.0, eager_nc)
              if not opt:step_on_device(eager_nc) then -- float64: the host path
                optim.clip_grad_norm(params, 1.0)
                opt:step()
              end
              opt:zero_grad({ set_to_none = not graphs }) -- a graph accumulates into the same buffers
            end)
          end
          last_loss = loss_t:item()
          if not (graphs and i > 1) then loss_t:free() end
        end
        local ts = {}
        for i = 1, warmup + steps do
          local s0 = common.now()
          step(i)
          sync()
          if i > warmup then ts[#ts + 1] = common.now() - s0 end
          if i == warmup then titan.reset_peak_memory(stats_dev) end
        end
        table.sort(ts)
        local t = ts[math.floor((#ts + 1) / 2)]
        local peak = titan.memory_stats(stats_dev).peak_allocated
        local nodes = graph and graph.num_nodes + (upd and upd.num_nodes or 0)
        local tps = B * T / t
        local res = { model = label, dtype = dt, B = B, T = T, step_ms = t * 1e3, tokens_per_s = tps,
          graphs = graphs and true or false, graph_nodes = nodes, gemm_autotune = titan.gemm_autotune(),
          plans = plan_note(),
          mfu = tps * flops_per_token / PEAK, flops_per_token = flops_per_token, params = nparams,
          peak_gib = peak / 2 ^ 30, build_s = build_s, last_loss = last_loss, steps = steps,
          init = args.real_init and "seeded" or "tiled" }
        print(("  [train] %s %s B%d T%d%s: %.1f ms/step, %.0f tokens/s, MFU %.1f%%, peak %.1f GiB (built in %.1f s, loss %.3f)")
          :format(label, dt, B, T, (graphs and (" cuda graph (%d nodes)"):format(nodes or 0) or "") ..
            (res.gemm_autotune and ", gemm autotune" or "") .. res.plans,
            res.step_ms, tps,
            100 * res.mfu, res.peak_gib, build_s, last_loss))
        if profile and not graphs then
          -- One more step timed on the device's stream (events, no host
          -- wait: the step runs as the timed ones), then one with a sync at
          -- each region's edges (the earlier checks' way: a region's own
          -- kernels, launch gaps taken out, the whole step slower).
          local function profile_step(opts)
            opts.memory = function() return titan.memory_stats(stats_dev).allocated end
            local prof = profiler.new(opts)
            prof:name_modules(model)
            prof:start()
            prof:region("step", "step", step, warmup + steps + 1)
            prof:stop()
            local rows = {}
            for i, row in ipairs(prof:summary()) do
              if i > 80 then break end
              rows[i] = { cat = row.cat, name = row.name, calls = row.calls, total_ms = row.total * 1e3,
                self_ms = row.self * 1e3, host_ms = row.host and row.host * 1e3 or nil }
            end
            return prof, rows
          end
          local dc = ON_GPU and require("titan.device_clock").new(DEV) or nil
          local prof, rows = profile_step({ device_clock = dc, sync = not dc and sync or nil })
          print(("  [profile] %s %s B%d T%d: one more step, timed region by region %s: %.1f ms (%sthe timed steps: "
            .. "%.1f ms)"):format(label, dt, B, T, dc and "on the device (events on its stream)" or "on the host",
            prof:elapsed() * 1e3, dc and ("the host queued it in %.1f ms; "):format(prof:host_elapsed() * 1e3) or "",
            res.step_ms))
          print(prof:summary_text(40))
          res.profile, res.profile_clock = rows, dc and "device" or "host"
          if dc then
            dc:free()
            prof, rows = profile_step({ sync = sync })
            print(("  [profile] %s %s B%d T%d: one more step, a device sync at each region's edges: %.1f ms")
              :format(label, dt, B, T, prof:elapsed() * 1e3))
            print(prof:summary_text(12))
            res.profile_sync = rows
          end
        end
        return res
      end)
      cleanup()
      if not ok then error(res, 0) end
      return res
    end)
    if r then
      results.train[#results.train + 1] = r
      local launch = (r.graphs and "graph" or "eager") .. (r.gemm_autotune and ", gemm autotune" or "") .. r.plans
      train_rows[#train_rows + 1] = { r.model, r.dtype, ("%dx%d"):format(r.B, r.T), launch, f1(r.step_ms),
        ("%.0f"):format(r.tokens_per_s), ("%.1f%%"):format(100 * r.mfu), f1(r.peak_gib) }
      return r -- the first dtype that works
    end
  end
end

-- ---- the run ---------------------------------------------------------------------------------
results.meta = { titan = titan.version(), device = DEV, sync = sync_how, peak_flops = PEAK, budget_s = args.budget,
  quick = args.quick, smoke = args.smoke, date = os.date("!%Y-%m-%dT%H:%M:%SZ") }
print(("titan %s | bench/gpu.lua | device %s | sync: %s | budget %s s%s"):format(titan.version(), DEV, sync_how,
  tostring(args.budget), args.quick and " | quick" or ""))

-- The float8 GEMM (docs/float8.md): x [M, K] and W [N, K] cast to e4m3 once, outside the timing, then
-- tt_op_matmul_float8 to bf16 with cuBLASLt's fast accumulation, the forward's GEMM of a float8 Linear;
-- the row's "dtype" is the operands'. PyTorch's peer is torch._scaled_mm on the same operands.
local function gemm_float8(label, M, N, K)
  local f8 = require("parallel.float8")
  local out_dt = ON_GPU and "bfloat16" or "float32"
  local r = guarded("gemm", label, ON_GPU and 2 * M * N * K / 1000e12 * 20 + 3 or 0, function()
    local a8, sa = f8.to_float8(rand_dev({ M, K }, "float32", 1), "float8_e4m3fn")
    local b8, sb = f8.to_float8(rand_dev({ N, K }, "float32", 2), "float8_e4m3fn")
    local out = titan.empty({ M, N }, { dtype = out_dt, device = DEV })
    local fn = function() f8.matmul(a8, b8, sa, sb, out_dt, { fast_accum = true, into = out }) end
    local t = time_it(fn, reps_for(fn, 0.05), 5, 2)
    local tflops = 2 * M * N * K / t / 1e12
    print(("  [gemm] %-26s e4m3 %5dx%5dx%5d  %8.3f ms  %7.1f TFLOP/s"):format(label, M, N, K, t * 1e3, tflops))
    return { label = label, dtype = "float8_e4m3fn", M = M, N = N, K = K, ms = t * 1e3, tflops = tflops, ta = 0,
      tb = 1 }
  end)
  if r then add_gemm_row(r) end
end

local S = args.smoke -- tiny shapes (CPU smoke test of this script)
local BF = ON_GPU and "bfloat16" or "float32"

-- Headline figures first (the targets), then the rest, so a short budget keeps what matters.
if S then gemm("square", 64, 64, 64, BF) else gemm("square 8192^3", 8192, 8192, 8192, BF) end
if S then gemm("square", 64, 64, 64, BF, 0, 1, true) else gemm("square 8192^3", 8192, 8192, 8192, BF, 0, 1, true) end
if S then gemm("square", 64, 64, 64, BF, 0, 1, false, "cublas") else
  gemm("square 8192^3", 8192, 8192, 8192, BF, 0, 1, false, "cublas") end
if S then gemm_float8("square fp8", 64, 64, 64) else gemm_float8("square 8192^3 fp8", 8192, 8192, 8192) end
if S then attention(1, 64, 4, 2, 32, BF) else attention(1, 8192, 32, 8, 128, BF) end
if S then
  copy_bench(65536, "float32")
  rmsnorm_bench(64, 128, BF)
  rmsnorm_bench(64, 128, BF, { lanes = 256 })
  rmsnorm_bench(64, 128, BF, { plan = "exact" })
  adamw_bench(65536, "float32", "float32", false)
  lean_bench(16, 64, 2048, 4, 16, BF)
  lean_bench(16, 64, 2048, 4, 16, BF, "exact")
  embed_bench(64, 256, 16, BF)
  adamw_model_bench("debugmodel")
else
  copy_bench(268435456, "float32")
  rmsnorm_bench(32768, 4096, "bfloat16")
  -- the exact kernels next to the lean ones (docs/cuda.md)
  rmsnorm_bench(32768, 4096, "bfloat16", { plan = "exact" })
  rmsnorm_bench(16384, 4096, "float32")
  adamw_bench(268435456, "float32", "float32", false)
  adamw_bench(268435456, "bfloat16", "bfloat16", true)
  -- the 1B step's SwiGLU, loss and query RoPE shapes (8192 tokens), lean and exact
  lean_bench(8192, 8192, 128256, 32, 64, "bfloat16")
  lean_bench(8192, 8192, 128256, 32, 64, "bfloat16", "exact")
  -- the 1B step's embedding gradient (8192 ids, vocab 128256, dim 2048)
  embed_bench(8192, 128256, 2048, "bfloat16")
end
if S then
  train_bench("tiny", { dim = 64, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = 256, multiple_of = 32,
    max_seq_len = 64 }, 2, 32, { BF }, 2, 1, 0, false, true)
  -- The graph path too (emulated on the CPU: a check of this script only).
  cuda_graph.emulate = not ON_GPU
  train_bench("tiny", { dim = 64, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = 256, multiple_of = 32,
    max_seq_len = 64 }, 2, 32, { BF }, 2, 1, 0, true)
  cuda_graph.emulate = false
  -- float8 linears and a mixture of experts (their paths in this script)
  train_convert = function(m) require("parallel.float8").apply(m) end
  train_bench("tiny float8", { dim = 64, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = 256, multiple_of = 32,
    max_seq_len = 64 }, 2, 32, { BF }, 2, 1, 0)
  train_convert = nil
  train_bench("tiny moe", { dim = 64, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = 256, multiple_of = 32,
    max_seq_len = 64, moe = { num_experts = 4, top_k = 2 } }, 2, 32, { BF }, 2, 1, 0)
else
  train_bench("llama3 1B", "1B", 1, 8192, { "bfloat16", "float32" }, 5, 2, 45, false, true)
  train_bench("llama3 debugmodel", "debugmodel", 16, 2048, { "bfloat16", "float32" }, 10, 3, 15)
  -- Launch-bound: a small step, eager and replayed from a CUDA graph.
  local dm = train_bench("llama3 debugmodel", "debugmodel", 4, 512, { "bfloat16", "float32" }, 10, 3, 8)
  if dm then train_bench("llama3 debugmodel", "debugmodel", 4, 512, { dm.dtype }, 10, 3, 8, true) end
  -- The 1B step again with GEMM autotuning (docs/cuda.md), next to the row above: its warm-up steps time the
  -- candidates of each shape.
  titan.set_gemm_autotune(true)
  train_bench("llama3 1B", "1B", 1, 8192, { "bfloat16" }, 5, 2, 45)
  titan.set_gemm_autotune(false)
  -- and with the exact kernels in place of the lean ones (RMSNorm, SwiGLU, cross-entropy: the plan
  -- settings, read at each launch)
  with_plans("exact", function() train_bench("llama3 1B", "1B", 1, 8192, { "bfloat16" }, 5, 2, 45) end)
  -- and with the GEMMs through cuBLAS instead of cuBLASLt (TITAN_CUDA_GEMM_API=cublas: PyTorch's mm)
  with_env("TITAN_CUDA_GEMM_API", "cublas", function()
    train_bench("llama3 1B", "1B", 1, 8192, { "bfloat16" }, 5, 2, 45)
  end)
  -- float8 linears (docs/float8.md): the 1B step with its Linear layers' GEMMs in fp8, next to the bf16 rows
  train_convert = function(m) require("parallel.float8").apply(m) end
  train_bench("llama3 1B float8", "1B", 1, 8192, { "bfloat16" }, 5, 2, 45)
  train_convert = nil
  -- a mixture of experts (docs/moe.md: its dispatch waits for the routing; one GEMM per expert)
  train_bench("llama3 debugmodel_moe", "debugmodel_moe", 16, 2048, { "bfloat16" }, 10, 3, 15)
  -- After the headline figures: the optimizer step's launches.
  adamw_model_bench("debugmodel")
  adamw_model_bench("1B")
end
if not S then
  -- RMSNorm's lanes per row side by side on the exact kernels (kernels/cuda/norm.cu; a lanes setting
  -- leaves the lean ones out): at the 8B width (4096) 128 lanes, and at the 1B width (2048) the lean
  -- kernels, then the exact ones on 256 lanes, on 64, and on their own plan (64 lanes forward, 256
  -- backward).
  rmsnorm_bench(32768, 4096, "bfloat16", { lanes = 128 })
  rmsnorm_bench(16384, 4096, "float32", { lanes = 128 })
  rmsnorm_bench(65536, 2048, "bfloat16")
  rmsnorm_bench(65536, 2048, "bfloat16", { lanes = 256 })
  rmsnorm_bench(65536, 2048, "bfloat16", { lanes = 64 })
  rmsnorm_bench(65536, 2048, "bfloat16", { plan = "exact" })
  -- Llama 3 1B's linear layers at 8192 tokens, each of the step's three products: y = x @ W^T (fwd),
  -- dX = dY @ W (dgrad), dW = dY^T @ X (wgrad); bench/gpu_torch.py times the same, label by label
  for _, l in ipairs({ { "wq/wo", 2048, 2048 }, { "wk/wv", 2048, 512 }, { "w1/w3", 2048, 8192 }, { "w2", 8192, 2048 },
    { "output", 2048, 128256 } }) do
    local din, dout = l[2], l[3]
    for _, api in ipairs({ false, "cublas" }) do
      gemm("1B " .. l[1] .. " fwd", 8192, dout, din, "bfloat16", 0, 1, false, api or nil)
      gemm("1B " .. l[1] .. " dgrad", 8192, din, dout, "bfloat16", 0, 0, false, api or nil)
      gemm("1B " .. l[1] .. " wgrad", dout, din, 8192, "bfloat16", 1, 0, false, api or nil)
    end
  end
  -- Llama 3 8B's linear layers at 8192 tokens: y = x @ W^T (fwd), and the
  -- two backward products of one of them (dgrad: dY @ W, wgrad: dY^T @ X).
  gemm("8B wq/wo 4096->4096", 8192, 4096, 4096, "bfloat16")
  gemm("8B wk/wv 4096->1024", 8192, 1024, 4096, "bfloat16")
  gemm("8B w1/w3 4096->14336", 8192, 14336, 4096, "bfloat16")
  gemm("8B w1/w3 4096->14336", 8192, 14336, 4096, "bfloat16", 0, 1, true)
  gemm("8B w2 14336->4096", 8192, 4096, 14336, "bfloat16")
  gemm("8B output 4096->128256", 8192, 128256, 4096, "bfloat16")
  if not args.quick then
    gemm("8B w1 dgrad (dY @ W)", 8192, 4096, 14336, "bfloat16", 0, 0)
    gemm("8B w1 wgrad (dY^T @ X)", 14336, 4096, 8192, "bfloat16", 1, 0)
    gemm("square 8192^3 fp16", 8192, 8192, 8192, "float16")
    gemm("square 4096^3 fp32 (no TF32)", 4096, 4096, 4096, "float32")
    attention(4, 2048, 32, 8, 128, "bfloat16")
    attention(1, 8192, 32, 8, 128, "float16")
  end
end

-- ---- tables --------------------------------------------------------------------------------
print()
print(("## GEMM: y = x @ W^T (cuBLASLt through tt_op_matmul, preallocated output; (cublas): through cuBLAS, "
  .. "TITAN_CUDA_GEMM_API=cublas); peak %.0f TFLOP/s dense bf16; "
  .. "target >= 700 TFLOP/s at 8192^3"):format(PEAK / 1e12))
common.print_table({ "shape", "dtype", "MxNxK", "ms", "TFLOP/s", "of peak" }, gemm_rows)
print()
print("## Attention, causal (FLOPs fwd = 4*B*H*T^2*D/2, bwd = 2.5 x fwd); target >= 450 TFLOP/s fwd+bwd at T = 8192")
common.print_table({ "shape", "dtype", "fwd ms", "fwd TFLOP/s", "bwd ms", "bwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s" },
  attn_rows)
print()
print("## Memory-bound kernels: GB/s of the bytes each must move (device copy: read + write, the ceiling); "
  .. "target >= 3000 GB/s")
common.print_table({ "kernel", "dtype", "elements", "ms", "GB/s" }, mem_rows)
print()
print(("## Training on one GPU: AdamW, clip 1.0, random tokens; MFU = tokens/s x (6N + 12LHQT) / %.0f TFLOP/s; "
  .. "target 1B >= 50%% MFU"):format(PEAK / 1e12))
common.print_table({ "model", "dtype", "B x T", "launch", "step ms", "tokens/s", "MFU", "peak GiB" }, train_rows)
if #results.errors > 0 then
  print()
  print(("note: %d measurement(s) failed or were skipped (error:/skipped: lines above)"):format(#results.errors))
end
results.meta.elapsed_s = elapsed()
save()
