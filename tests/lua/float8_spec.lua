-- Float8 training (lua/parallel/float8.lua, engine/ops_float8.c): the tensorwise dynamic cast against
-- its definition (scale, saturation, rounding, NaN, zeros), the fp8 GEMM against a float64 product of
-- the fp8 values, the float8 Linear's forward and backward against the same composition written out,
-- the model conversion, training, and the config's bad input.
local titan = require("titan")
local f8 = require("parallel.float8")
local sh = dofile("tests/lua/shell.lua")

local C, ffi = titan.C, titan.ffi
local function last_error() return ffi.string(C.tt_last_error()) end
local FMAX = { float8_e4m3fn = 448, float8_e5m2 = 57344 }

local function randn(shape, seed, dtype, scale)
  local t = titan.randn(shape, { seed = seed })
  if scale then t = t * scale end
  return dtype and t:to(dtype) or t
end

-- f32 rounding of a double, as the kernels' f32 arithmetic
local f32 = function(v) return ffi.new("float[1]", v)[0] end

describe("float8 cast (tensorwise dynamic scaling)", function()
  it("scales by the largest magnitude and rounds x * s to fp8, saturated (e4m3 and e5m2, f32 and bf16 in)", function()
    for _, dt in ipairs({ "float32", "bfloat16" }) do
      for fmt, fmax in pairs(FMAX) do
        local x = randn({ 7, 33 }, 3, dt, 5)
        local y, sinv = f8.to_float8(x, fmt)
        assert.are.equal(fmt, y:dtype())
        assert.are.same({}, sinv:shape())
        local xs = x:to("float32"):tolist_flat()
        local amax = 0
        for _, v in ipairs(xs) do amax = math.max(amax, math.abs(v)) end
        local s = f32(fmax / amax)
        assert.are.equal(f32(1 / s), sinv:item(), fmt .. " " .. dt .. " scale_inv")
        -- the reference: each f32 product cast with the plain (round to nearest even) conversion
        local prod = {}
        for i, v in ipairs(xs) do prod[i] = math.max(-fmax, math.min(fmax, f32(v * s))) end
        local ref = titan.tensor(prod):reshape(7, 33):to(fmt)
        assert.are.same(ref:tolist_flat(), y:tolist_flat(), fmt .. " " .. dt)
        -- the largest magnitude lands on the format's largest value
        local ys, top = y:tolist_flat(), 0
        for _, v in ipairs(ys) do top = math.max(top, math.abs(v)) end
        assert.are.equal(fmax, top)
      end
    end
  end)

  it("zeros stay zeros (scale from the 1e-12 floor); a NaN makes every value and the scale NaN", function()
    local y, sinv = f8.to_float8(titan.zeros({ 4, 4 }), "float8_e4m3fn")
    for _, v in ipairs(y:tolist_flat()) do assert.are.equal(0, v) end
    assert.are.equal(f32(1 / f32(448 / f32(1e-12))), sinv:item())
    local x = titan.ones({ 3, 5 })
    x:narrow(1, 2, 1):narrow(2, 3, 1):copy_(titan.full({ 1, 1 }, 0 / 0))
    local yn, sn = f8.to_float8(x, "float8_e5m2")
    assert.is_true(sn:item() ~= sn:item())
    for _, v in ipairs(yn:tolist_flat()) do assert.is_true(v ~= v) end
  end)

  it("float8_amax gives max |x|; a given amax (a shard's group max) replaces it in the scale", function()
    local f8ffi = ffi.new("tt_tensor*[1]")
    local x = randn({ 5, 16 }, 21, "bfloat16", 3)
    assert.are.equal(0, C.tt_op_float8_amax(x._c, f8ffi), last_error())
    local amax = require("titan.tensor").wrap(f8ffi[0])
    local want = 0
    for _, v in ipairs(x:tolist_flat()) do want = math.max(want, math.abs(v)) end
    assert.are.equal(f32(want), amax:item())
    -- the whole tensor's amax twice this shard's: the shard's values land on half the range
    local twice = titan.full({}, 2 * want)
    local box = ffi.new("tt_tensor*[2]")
    assert.are.equal(0, C.tt_op_to_float8(x._c, C.TT_F8E4M3, twice._c, box, box + 1), last_error())
    local y, s = require("titan.tensor").wrap(box[0]), require("titan.tensor").wrap(box[1])
    assert.are.equal(f32(1 / f32(448 / f32(2 * want))), s:item())
    local top = 0
    for _, v in ipairs(y:tolist_flat()) do top = math.max(top, math.abs(v)) end
    assert.are.equal(224, top)
    assert.are_not.equal(0, C.tt_op_to_float8(x._c, C.TT_F8E4M3, titan.ones({ 2 })._c, box, box + 1))
    assert.truthy(last_error():find("to_float8: amax [2] of float32; expected one float32", 1, true), last_error())
  end)

  it("bad input: one line naming what was wrong", function()
    local box = ffi.new("tt_tensor*[2]")
    local x = titan.ones({ 2, 3 })
    assert.are_not.equal(0, C.tt_op_to_float8(x._c, C.TT_BF16, nil, box, box + 1))
    assert.truthy(last_error():find("to_float8: target dtype bfloat16; expected float8_e4m3fn or float8_e5m2", 1,
      true), last_error())
    assert.are_not.equal(0, C.tt_op_to_float8(x:t()._c, C.TT_F8E4M3, nil, box, box + 1))
    assert.truthy(last_error():find("to_float8", 1, true), last_error())
    local i = titan.tensor({ 1, 2 }, { dtype = "int64" })
    assert.are_not.equal(0, C.tt_op_to_float8(i._c, C.TT_F8E4M3, nil, box, box + 1))
    assert.truthy(last_error():find("expected float32, bfloat16 or float16", 1, true), last_error())
  end)
end)

-- a [M, K] b [N, K] fp8 with scales -> the float64 product of the values the fp8 bytes hold
local function ref_mm(a8, b8, sa, sb)
  local M, K, N = a8:size(1), a8:size(2), b8:size(1)
  local a, b = a8:tolist_flat(), b8:tolist_flat()
  local s = sa:item() * sb:item()
  local out = {}
  for i = 0, M - 1 do
    for j = 0, N - 1 do
      local acc = 0
      for k = 0, K - 1 do acc = acc + a[i * K + k + 1] * b[j * K + k + 1] end
      out[i * N + j + 1] = acc * s
    end
  end
  return out
end

local function close(got, want, rel, what)
  local worst, scale = 0, 0
  for i = 1, #want do
    worst = math.max(worst, math.abs(got[i] - want[i]))
    scale = math.max(scale, math.abs(want[i]))
  end
  assert(#got == #want and worst <= rel * scale, ("%s: max abs diff %.3g, %.3g of the largest |value| (limit %.3g)")
    :format(what, worst, worst / scale, rel))
end

describe("float8 matmul", function()
  it("a b^T of the fp8 values times both inverse scales; accumulate adds; bf16 out", function()
    local a8, sa = f8.to_float8(randn({ 9, 32 }, 5), "float8_e4m3fn")
    local b8, sb = f8.to_float8(randn({ 16, 32 }, 6, nil, 3), "float8_e5m2")
    local want = ref_mm(a8, b8, sa, sb)
    close(f8.matmul(a8, b8, sa, sb, "float32"):tolist_flat(), want, 1e-6, "f32 out")
    close(f8.matmul(a8, b8, sa, sb, "bfloat16"):tolist_flat(), want, 8e-3, "bf16 out")
    local acc = titan.ones({ 9, 16 })
    f8.matmul(a8, b8, sa, sb, "float32", { out = acc })
    local plus = {}
    for i, v in ipairs(want) do plus[i] = v + 1 end
    close(acc:tolist_flat(), plus, 1e-6, "accumulated")
  end)

  it("bad input: e5m2 x e5m2, mismatched K, a scale that is not one f32", function()
    local a8, sa = f8.to_float8(randn({ 4, 16 }, 7), "float8_e5m2")
    local b8, sb = f8.to_float8(randn({ 8, 16 }, 8), "float8_e5m2")
    assert.has_error(function() f8.matmul(a8, b8, sa, sb, "float32") end,
      "matmul_float8: a is float8_e5m2 and b is float8_e5m2; expected float8_e4m3fn or float8_e5m2, not both "
      .. "float8_e5m2")
    local c8, sc = f8.to_float8(randn({ 8, 12 }, 9), "float8_e4m3fn")
    local ok, err = pcall(f8.matmul, a8, c8, sa, sc, "float32")
    assert.is_false(ok)
    assert.truthy(tostring(err):find("matmul_float8: a [4, 16] and b [8, 12]; expected a [M, K] and b [N, K]", 1,
      true), tostring(err))
    local d8 = f8.to_float8(randn({ 8, 16 }, 10), "float8_e4m3fn")
    ok, err = pcall(f8.matmul, a8, d8, sa, titan.ones({ 2 }), "float32")
    assert.is_false(ok)
    assert.truthy(tostring(err):find("b_scale_inv [2] of float32; expected one float32", 1, true), tostring(err))
  end)
end)

describe("float8 Linear", function()
  it("forward and backward are the fp8 products written out (e4m3 x and W, e5m2 gradient)", function()
    local x = randn({ 2, 3, 32 }, 11):requires_grad_()
    local w = randn({ 16, 32 }, 12, nil, 0.1):requires_grad_()
    local g = randn({ 2, 3, 16 }, 13, nil, 1e-3)
    local y = f8.linear(x, w)
    assert.are.same({ 2, 3, 16 }, y:shape())
    y:backward(g)
    titan.no_grad(function()
      local x8, sx = f8.to_float8(x:detach():reshape(6, 32):contiguous(), "float8_e4m3fn")
      local w8, sw = f8.to_float8(w:detach(), "float8_e4m3fn")
      local g8, sg = f8.to_float8(g:reshape(6, 16):contiguous(), "float8_e5m2")
      assert.are.same(f8.matmul(x8, w8, sx, sw, "float32"):tolist_flat(), y:detach():tolist_flat())
      local dx = f8.matmul(g8, w8:t():contiguous(), sg, sw, "float32")
      assert.are.same(dx:tolist_flat(), x.grad:tolist_flat())
      local dw = f8.matmul(g8:t():contiguous(), x8:t():contiguous(), sg, sx, "float32")
      assert.are.same(dw:tolist_flat(), w.grad:tolist_flat())
      -- and near the f32 layer's: fp8 keeps about two significant digits
      local yr = titan.F.linear(x:detach(), w:detach())
      close(y:detach():tolist_flat(), yr:tolist_flat(), 0.08, "forward vs f32")
    end)
  end)

  it("apply converts the Linear layers but the filtered ones, those not multiples of 16 and those with a bias",
    function()
      local nn = titan.nn
      local Net = nn.Module:extend("Net")
      function Net:init()
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(32, 24)
        self.biased = nn.Linear(32, 32, { bias = true })
        self.output = nn.Linear(64, 32)
      end
      local done, skipped = f8.apply(Net())
      assert.are.same({ "up" }, done)
      local why = {}
      for _, s in ipairs(skipped) do why[s[1]] = s[2] end
      assert.are.equal("24 x 32: fp8 GEMMs take multiples of 16", why.odd)
      assert.are.equal("a bias (not built)", why.biased)
      assert.are.equal("filter_fqns 'output'", why.output)
    end)
end)

describe("float8 under activation checkpointing", function()
  -- (selective "op" keeps the attention's and every other linear's outputs: an fp8 linear counts as one)
  it("full and per-op AC give the gradients of no AC; per op, the kept fp8 linears' GEMMs are not run again",
    function()
    local llama, ac, tiny = require("models.llama3"), require("parallel.ac"), dofile("tests/lua/tiny_llama.lua")
    local gemms = 0
    local matmul = f8.matmul
    f8.matmul = function(...)
      gemms = gemms + 1
      return matmul(...)
    end
    local function run(mode, option)
      local model = llama.build(tiny.ARGS, { device = "cpu", seed = 5 })
      local done = f8.apply(model, {})
      ac.apply(model, { mode = mode, selective_ac_option = option })
      gemms = 0
      local ids = tiny.ids_batch(3)
      titan.scope(function() titan.F.cross_entropy(model(ids):reshape(-1, 96), ids:reshape(-1)):backward() end)
      local grads = {}
      for _, np in ipairs(model:named_parameters()) do grads[np[1]] = np[2].grad:tolist_flat() end
      model:free(); ids:free()
      return grads, gemms, #done
    end
    local ok, err = pcall(function()
      local want, n0, linears = run("none")
      assert.are.equal(3 * 7, linears) -- (the 96-row output layer is filtered)
      assert.are.equal(3 * linears, n0) -- forward, dx, dW
      local full, n_full = run("full")
      local op, n_op = run("selective", "op")
      assert.are.same(want, full)
      assert.are.same(want, op)
      assert.are.equal(n0 + linears, n_full) -- every forward GEMM again
      assert.are.equal(n0 + linears - 3 * 4, n_op) -- the 1st, 3rd, 5th and 7th linear of each block kept
    end)
    f8.matmul = matmul
    assert(ok, err)
  end)
end)

describe("float8 training", function()
  local exe = "./build/titan"
  local function train(extra)
    local dump = sh.tmpdir()
    local out = sh.run_ok(exe .. " lua/recipes/llama3_debugmodel.lua --job.dump_folder=" .. dump
      .. " --training.steps=4 --training.seq_len=64 --training.local_batch_size=2 --metrics.log_freq=1"
      .. " --lr_scheduler.warmup_steps=2 --training.shuffle=false " .. (extra or ""))
    local losses = {}
    for i, l in ipairs(sh.losses(out)) do losses[i] = tonumber(l) end
    return losses, out
  end

  it("the debug model trains with float8 linears: the f32 curve to fp8 precision, and it learns", function()
    local want = train()
    local got, out = train("--model.converters=float8")
    assert.truthy(out:find("float8: 42 Linear layers multiply in fp8 (tensorwise dynamic scaling: e4m3 forward, e5m2 "
      .. "gradients); unconverted: output (filter_fqns 'output')", 1, true), out)
    assert.are.equal(4, #got)
    for s = 1, 4 do
      assert(math.abs(got[s] - want[s]) < 0.03, ("step %d: float8 loss %.4f, f32 %.4f"):format(s, got[s], want[s]))
    end
    assert.is_true(got[4] < got[1])
  end)

  it("bad float8 settings: one line each", function()
    local base = exe .. " lua/recipes/llama3_debugmodel.lua --training.steps=1 "
    sh.one_line(base .. "--model.converters=float9", "model.converters: 'float9'; expected float8 (comma-separated)")
    sh.one_line(base .. "--model.converters=float8 --float8.recipe_name=rowwise",
      "float8.recipe_name = 'rowwise'; expected tensorwise (the one built)")
    sh.one_line(base .. "--float8.enable_fsdp_float8_all_gather=true",
      "float8.enable_fsdp_float8_all_gather = true without model.converters = float8; expected the converter too")
    sh.one_line(base .. "--model.converters=float8 --float8.enable_fsdp_float8_all_gather=true",
      "float8.enable_fsdp_float8_all_gather = true, but FSDP does not shard this job's weights (one rank); expected "
      .. "parallelism.dp_shard > 1")
    -- (checked before any process group: the launcher's variables alone)
    sh.one_line("OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=4 " .. base .. "--model.converters=float8 "
      .. "--float8.enable_fsdp_float8_all_gather=true --parallelism.tp=2", "float8.enable_fsdp_float8_all_gather = "
      .. "true with parallelism.tp > 1: not built (a split weight's scale spans the tp ranks too); expected false, or "
      .. "tp = 1")
    sh.one_line(base .. "--model.converters=float8 --training.mixed_precision_param=float64",
      "model.converters = float8 with training.mixed_precision_param = float64; expected float32 or bfloat16")
  end)
end)
