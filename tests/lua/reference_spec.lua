-- Titan's Llama 3 against an independent PyTorch implementation
-- (tests/reference/llama3.py, run by tests/reference/run_reference.py under
-- /usr/bin/python3): the same weights and batch on both sides, then the
-- first-step loss, every parameter's gradient, and the losses of ten AdamW
-- steps must agree. The reference runs in float64; Titan runs twice from the
-- same weights, in float64 (tight bounds: implementation differences, not
-- rounding, would show) and in float32 (the production kernels).
-- Needs python3-torch; without it every test here fails (never skips).
local titan = require("titan")
local cjson = require("cjson")
local llama3 = require("models.llama3")
local optim = require("titan.optim")
local ffi, C, F = titan.ffi, titan.C, titan.F

local ROOT = require("titan.env").root
local PYTHON = os.getenv("TITAN_REFERENCE_PYTHON") or "/usr/bin/python3"
local DRIVER = ROOT .. "/tests/reference/run_reference.py"

-- float32: what the f32 kernels (sgemm, f32 activations) can hold against an
-- exact reference. float64: both sides in double; what remains is summation
-- order (~1e-15) and, over the steps, Titan's AdamW keeping its moments in
-- float32 (~1e-9 after ten steps), so these bounds sit ~100x above that.
local TOL = {
  float32 = { loss = 1e-5, grad = 1e-4, steps = 1e-4 },
  float64 = { loss = 1e-12, grad = 1e-10, steps = 1e-7 },
}
local STEPS = 10
local REPORT = os.getenv("TITAN_REFERENCE_REPORT") ~= nil
local OPTIM = { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }

-- ---- processes and files ---------------------------------------------------

local shell = dofile("tests/lua/shell.lua")
local sh_quote = shell.quote

-- Run a shell command; returns its exit status and its stdout + stderr.
local function run(cmd)
  local out, rc = shell.run(cmd)
  return rc, out
end

local function write_file(path, data)
  local f = assert(io.open(path, "wb"))
  assert(f:write(data))
  f:close()
end

local function read_file(path)
  local f, err = io.open(path, "rb")
  if not f then error("reference: cannot read " .. tostring(err), 2) end
  local s = f:read("*a")
  f:close()
  return s
end

local function torch_problem()
  local rc, out = run(sh_quote(PYTHON) .. " -c 'import torch'")
  if rc == 0 then return nil end
  return ("PyTorch is not importable with %s (exit %s): install python3-torch (Debian's package for the system "
    .. "Python) — this check compares Titan with a PyTorch reference and cannot run without it.\n%s"):format(
    PYTHON, tostring(rc), out)
end

-- ---- tensors <-> host ---------------------------------------------------------

-- The tensor's values as a fresh double[n] (any dtype).
local function to_f64(t)
  local n = t:numel()
  local buf = ffi.new("double[?]", math.max(n, 1))
  assert(C.tt_tensor_to_f64(t._c, buf, n) == 0, "tt_tensor_to_f64 failed")
  return buf, n
end

local function from_f64(t, buf) assert(C.tt_tensor_from_f64(t._c, buf, t:numel()) == 0) end

-- max|a - b| / max|b| over n doubles; math.huge on NaN.
local function rel_err(a, b, n)
  local num, den = 0, 0
  for i = 0, n - 1 do
    local d = math.abs(a[i] - b[i])
    if d ~= d then return math.huge end
    if d > num then num = d end
    local m = math.abs(b[i])
    if m > den then den = m end
  end
  if den == 0 then return num == 0 and 0 or math.huge end
  return num / den
end

-- ---- the batch: fixed pseudo-random tokens ----------------------------------------

local function batch(B, T, vocab, seed)
  local state = seed
  local function rnd() -- Park-Miller: products stay below 2^53, exact in doubles
    state = state * 16807 % 2147483647
    return state
  end
  local inputs, targets = {}, {}
  for b = 1, B do
    local seq = {}
    for i = 1, T + 1 do seq[i] = rnd() % vocab end
    inputs[b], targets[b] = {}, {}
    for t = 1, T do inputs[b][t], targets[b][t] = seq[t], seq[t + 1] end
  end
  -- a few ignored targets exercise ignore_index and the mean's denominator
  for t = T - 2, T do targets[B][t] = -100 end
  return inputs, targets
end

local function int64_bytes(rows_a, rows_b)
  local vals = {}
  for _, rows in ipairs({ rows_a, rows_b }) do
    for _, r in ipairs(rows) do
      for _, v in ipairs(r) do vals[#vals + 1] = v end
    end
  end
  local buf = ffi.new("int64_t[?]", #vals)
  for i, v in ipairs(vals) do buf[i - 1] = v end
  return ffi.string(buf, #vals * 8)
end

-- ---- one case: build, exchange, compare ---------------------------------------------

-- The model in float64 with weights rounded to float32 values, so the f32
-- weights.bin carries them exactly and both sides start from the same point.
-- embed_scale: multiplies tok_embeddings (std 1 as initialized; tied to the
-- output that would give logits in the hundreds).
local function build_model(overrides, embed_scale)
  local model = llama3.build("debugmodel", { seed = 0, dtype = "float64", overrides = overrides })
  titan.no_grad(function()
    for _, np in ipairs(model:named_parameters()) do
      local p = np[2]
      if embed_scale and np[1] == "tok_embeddings.weight" then p:mul_(embed_scale) end
      local r = p:to("float32")
      if r ~= p then
        p:copy_(r)
        r:free()
      end
    end
  end)
  return model
end

local function write_exchange(dir, model, B, T, inputs, targets)
  local a = model.args
  local manifest, chunks, offset = {}, {}, 0
  for _, np in ipairs(model:named_parameters()) do
    local name, p = np[1], np[2]
    local n = p:numel()
    local buf = ffi.new("float[?]", n)
    local d = to_f64(p)
    for i = 0, n - 1 do buf[i] = d[i] end
    chunks[#chunks + 1] = ffi.string(buf, n * 4)
    manifest[#manifest + 1] = { name = name, shape = p:shape(), offset = offset }
    offset = offset + n * 4
  end
  local sc = a.rope_scaling
  local config = {
    model = {
      dim = a.dim, n_layers = a.n_layers, n_heads = a.n_heads, n_kv_heads = a.n_kv_heads, ffn_hidden = a.ffn_hidden,
      vocab_size = a.vocab_size, norm_eps = a.norm_eps, rope_theta = a.rope_theta, tie_embeddings = a.tie_embeddings,
      rope_scaling = sc and {
        factor = sc.factor, low_freq_factor = sc.low_freq_factor, high_freq_factor = sc.high_freq_factor,
        original_max_seq = sc.original_max_seq,
      } or cjson.null,
    },
    batch = { batch_size = B, seq_len = T },
    optim = { lr = OPTIM.lr, betas = OPTIM.betas, eps = OPTIM.eps, weight_decay = OPTIM.weight_decay },
    steps = STEPS,
    weights_dtype = "float32",
    manifest = manifest,
  }
  write_file(dir .. "/config.json", cjson.encode(config))
  write_file(dir .. "/weights.bin", table.concat(chunks))
  write_file(dir .. "/batch.bin", int64_bytes(inputs, targets))
end

local function run_reference(dir)
  local problem = torch_problem()
  if problem then error(problem, 0) end
  local rc, out = run(sh_quote(PYTHON) .. " " .. sh_quote(DRIVER) .. " " .. sh_quote(dir))
  if rc ~= 0 then error(("reference: %s %s failed (exit %s):\n%s"):format(PYTHON, DRIVER, tostring(rc), out), 0) end
  local res = cjson.decode(read_file(dir .. "/result.json"))
  local blob = read_file(dir .. "/" .. res.grads_file)
  assert(res.grads_dtype == "float64", "reference: grads_dtype " .. tostring(res.grads_dtype))
  res.summary = out:gsub("%s+$", "")
  res.grads = {}
  local base = ffi.cast("const double*", blob)
  for _, e in ipairs(res.grads_manifest) do
    local n = 1
    for _, d in ipairs(e.shape) do n = n * d end
    assert(e.offset + n * 8 <= #blob, "reference: " .. res.grads_file .. " is too short for " .. e.name)
    res.grads[e.name] = base + e.offset / 8
  end
  res._blob = blob -- keeps the bytes behind res.grads alive
  return res
end

-- Forward + backward on the batch; returns the loss (a number).
local function loss_backward(model, ids, tgt)
  return titan.scope(function()
    local logits = model(ids)
    local loss = F.cross_entropy(logits:reshape(-1, model.args.vocab_size), tgt:reshape(-1))
    loss:backward()
    return loss:item()
  end)
end

-- {name -> rel err} of every parameter's .grad against the reference, and the worst.
local function grad_errors(model, ref)
  local errs, worst, worst_name = {}, -1, nil
  for _, np in ipairs(model:named_parameters()) do
    local name, p = np[1], np[2]
    local e = math.huge
    if p.grad and ref.grads[name] then
      local g, n = to_f64(p.grad)
      e = rel_err(g, ref.grads[name], n)
    end
    errs[name] = e
    if e > worst then worst, worst_name = e, name end
  end
  return errs, worst, worst_name
end

local function mktemp_dir()
  local rc, out = run("mktemp -d /tmp/titan_reference.XXXXXX")
  assert(rc == 0, "mktemp: " .. out)
  return (out:gsub("%s+$", ""))
end

local function rel(a, b) return math.abs(a - b) / math.abs(b) end

-- Titan's side of one case in one dtype: the first-step loss and gradient
-- errors, the negative control (when asked) and the losses of STEPS AdamW
-- steps. `model` is trained in place.
local function titan_run(case, model, ref, ids, tgt)
  local out = { losses = {} }
  if case.negative_control then
    -- one weight moved by 1e-3: the gradient comparison must notice
    local p
    for _, np in ipairs(model:named_parameters()) do
      if np[1] == case.negative_control then p = np[2] end
    end
    assert(p, "no parameter " .. case.negative_control)
    local orig, n = to_f64(p)
    local moved = ffi.new("double[?]", n)
    ffi.copy(moved, orig, n * 8)
    moved[0] = moved[0] + 1e-3
    from_f64(p, moved)
    loss_backward(model, ids, tgt)
    out.perturbed_errs, out.perturbed_worst, out.perturbed_worst_name = grad_errors(model, ref)
    model:zero_grad()
    from_f64(p, orig)
  end
  local opt = optim.AdamW(model:named_parameters(), OPTIM)
  for step = 1, STEPS do
    out.losses[step] = loss_backward(model, ids, tgt)
    if step == 1 then out.grad_errs, out.grad_worst, out.grad_worst_name = grad_errors(model, ref) end
    opt:step()
    opt:zero_grad()
  end
  out.loss_err = rel(out.losses[1], ref.loss)
  out.steps_worst = 0
  for i = 1, STEPS do out.steps_worst = math.max(out.steps_worst, rel(out.losses[i], ref.losses[i])) end
  return out
end

-- Everything one case needs, computed once: the reference's results, then
-- Titan in float32 and in float64 from the very same weights.
local function prepare(case)
  local B, T = case.B, case.T
  local model = build_model(case.overrides, case.embed_scale)
  local V = model.args.vocab_size
  local inputs, targets = batch(B, T, V, case.seed)
  local dir = mktemp_dir()
  write_exchange(dir, model, B, T, inputs, targets)
  local ok, ref = pcall(run_reference, dir)
  run("rm -rf " .. sh_quote(dir))
  if not ok then error(ref, 0) end
  local ids = titan.keep(titan.tensor(inputs, { dtype = "int64" }))
  local tgt = titan.keep(titan.tensor(targets, { dtype = "int64" }))
  local st = { ref = ref }

  local m32 = llama3.build("debugmodel", { seed = 0, dtype = "float32", overrides = case.overrides })
  local src = {}
  for _, np in ipairs(model:named_parameters()) do src[np[1]] = np[2] end
  titan.no_grad(function()
    for _, np in ipairs(m32:named_parameters()) do np[2]:copy_(src[np[1]]) end -- exact: f32 values
  end)
  st.float32 = titan_run({}, m32, ref, ids, tgt)
  st.float64 = titan_run(case, model, ref, ids, tgt)
  ids:free(); tgt:free()

  if REPORT then
    io.stderr:write(("\n[reference] %s\n  %s\n"):format(case.label, ref.summary))
    for _, dt in ipairs({ "float64", "float32" }) do
      local r = st[dt]
      io.stderr:write(("  titan %s: loss rel %.3g; worst grad rel %.3g (%s); worst step-loss rel %.3g; "
        .. "loss %.6f -> %.6f%s\n"):format(dt, r.loss_err, r.grad_worst, r.grad_worst_name, r.steps_worst,
        r.losses[1], r.losses[STEPS], r.perturbed_worst and ("; negative control: worst grad rel %.3g (%s)"):format(
        r.perturbed_worst, r.perturbed_worst_name) or ""))
    end
  end
  return st
end

local cases = {
  { label = "debugmodel (6 layers, dim 256, 16 heads), B=2 T=16", B = 2, T = 16, seed = 1,
    negative_control = "layers.0.attention.wq.weight" },
  { label = "debugmodel (6 layers, dim 256, 16 heads), B=2 T=64", B = 2, T = 64, seed = 2 },
  { label = "debugmodel dims, GQA (16 q / 4 kv heads), tied embeddings, 2 layers, B=2 T=32", B = 2, T = 32,
    seed = 3, overrides = { n_layers = 2, n_kv_heads = 4, tie_embeddings = true }, embed_scale = 0.05 },
}

describe("Llama 3 against the PyTorch reference", function()
  it("finds PyTorch for " .. PYTHON, function()
    local problem = torch_problem()
    assert(problem == nil, problem)
  end)

  for _, case in ipairs(cases) do
    describe(case.label, function()
      local st, err
      local function state() -- computed once; a failure fails every test of the case
        if not st and not err then
          local ok, r = pcall(prepare, case)
          if ok then st = r else err = r end
        end
        if err then error(err, 0) end
        return st
      end

      for _, dt in ipairs({ "float64", "float32" }) do
        local tol = TOL[dt]

        it(("titan %s: first-step loss agrees to %g relative"):format(dt, tol.loss), function()
          local s = state()
          local r = s[dt]
          assert(r.loss_err <= tol.loss, ("first-step loss: titan %.15g, reference %.15g, rel err %.3g > %g"):format(
            r.losses[1], s.ref.loss, r.loss_err, tol.loss))
        end)

        it(("titan %s: every parameter's gradient agrees to %g relative (max|a-b| / max|b|)"):format(dt, tol.grad),
          function()
            local s = state()
            local r = s[dt]
            local n = 0
            for _, e in ipairs(s.ref.grads_manifest) do
              assert(r.grad_errs[e.name], "titan has no parameter " .. e.name)
              n = n + 1
            end
            local bad = {}
            for name, e in pairs(r.grad_errs) do
              n = n - 1
              if not (e <= tol.grad) then bad[#bad + 1] = ("%s %.3g"):format(name, e) end
            end
            assert(n == 0, "titan and the reference have different parameter sets")
            table.sort(bad)
            assert(#bad == 0, ("gradients beyond %g: %s"):format(tol.grad, table.concat(bad, ", ")))
          end)

        it(("titan %s: %d AdamW steps, the loss agrees to %g relative at every step"):format(dt, STEPS, tol.steps),
          function()
            local s = state()
            local r, ref = s[dt], s.ref.losses
            assert.are.equal(STEPS, #ref)
            local lines, ok = {}, true
            for i = 1, STEPS do
              local e = rel(r.losses[i], ref[i])
              if not (e <= tol.steps) then ok = false end
              lines[#lines + 1] = ("step %d: titan %.12f reference %.12f rel %.2g"):format(i, r.losses[i], ref[i], e)
            end
            assert(ok, "losses differ:\n" .. table.concat(lines, "\n"))
            -- the check means something only if the loss moves
            assert(ref[1] - ref[STEPS] > 0.05 * ref[1],
              ("the loss barely moved: %.6f -> %.6f"):format(ref[1], ref[STEPS]))
          end)
      end

      if case.negative_control then
        it("fails the gradient comparison when one weight moves by 1e-3", function()
          local s = state()
          local r = s.float64
          assert(r.perturbed_worst > TOL.float32.grad,
            ("perturbing %s[0] by 1e-3 left every gradient within %g (worst %.3g)"):format(case.negative_control,
              TOL.float32.grad, r.perturbed_worst))
        end)
      end
    end)
  end
end)
