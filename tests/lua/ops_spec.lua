-- Every differentiable op: a value check against a plain Lua reference and a
-- finite-difference gradient check in float64, at several shapes including
-- odd sizes.
local titan = require("titan")
local gradcheck = require("titan.gradcheck")
local F = titan.F

local function randn(shape, seed, dtype)
  return titan.randn(shape, { dtype = dtype or "float64", seed = seed, offset = 0 })
end
local function leaf(shape, seed) return randn(shape, seed):requires_grad_() end

local function max_abs_diff(a, b)
  local m = 0
  assert.are.equal(#a, #b)
  for i = 1, #a do
    local d = math.abs(a[i] - b[i])
    if d ~= d then return math.huge end
    if d > m then m = d end
  end
  return m
end

local function assert_close(got, want, tol, what)
  local d = max_abs_diff(got, want)
  assert(d <= tol, ("%s: max abs diff %g > %g"):format(what or "values", d, tol))
end

local function assert_grads(fn, inputs, what, opts)
  local ok, report, worst = gradcheck(fn, inputs, opts)
  assert(ok, (what or "gradcheck") .. " failed (worst rel err " .. tostring(worst) .. "):\n" .. report)
end

-- Index helpers for flat, row-major lists.
local function strides_of(shape)
  local s, st = 1, {}
  for i = #shape, 1, -1 do st[i] = s; s = s * shape[i] end
  return st
end

local function unravel(i, shape) -- 0-based flat -> 1-based multi-index
  local idx = {}
  for d = #shape, 1, -1 do
    idx[d] = i % shape[d] + 1
    i = math.floor(i / shape[d])
  end
  return idx
end

local function bcast_ref(a, b, f)
  local sa, sb = a:shape(), b:shape()
  local n = math.max(#sa, #sb)
  local shape = {}
  for i = 1, n do
    local da = sa[i - (n - #sa)] or 1
    local db = sb[i - (n - #sb)] or 1
    shape[i] = math.max(da, db)
  end
  local fa, fb = a:tolist_flat(), b:tolist_flat()
  local sta, stb = strides_of(sa), strides_of(sb)
  local out, total = {}, 1
  for _, v in ipairs(shape) do total = total * v end
  for i = 0, total - 1 do
    local idx = unravel(i, shape)
    local ia, ib = 0, 0
    for d = 1, n do
      local da, db = d - (n - #sa), d - (n - #sb)
      if da >= 1 and sa[da] ~= 1 then ia = ia + (idx[d] - 1) * sta[da] end
      if db >= 1 and sb[db] ~= 1 then ib = ib + (idx[d] - 1) * stb[db] end
    end
    out[i + 1] = f(fa[ia + 1], fb[ib + 1])
  end
  return out
end

describe("elementwise", function()
  local shapes = {
    { { 3, 4 }, { 3, 4 } }, { { 2, 3, 5 }, { 5 } }, { { 4, 1 }, { 1, 3 } }, { { 7 }, { 1 } }, { { 1, 5 }, { 3, 1, 5 } },
  }
  local bin = {
    add = function(x, y) return x + y end, sub = function(x, y) return x - y end,
    mul = function(x, y) return x * y end, div = function(x, y) return x / y end,
    maximum = math.max, minimum = math.min,
  }
  for name, ref in pairs(bin) do
    it(name .. " broadcasts and matches the reference, f32 and f64", function()
      for k, sh in ipairs(shapes) do
        for _, dt in ipairs({ "float32", "float64" }) do
          local a, b = randn(sh[1], k, dt), randn(sh[2], k + 100, dt)
          if name == "div" then b = b:abs() + 0.5 end
          local out = titan[name](a, b)
          assert_close(out:tolist_flat(), bcast_ref(a, b, ref), dt == "float32" and 1e-6 or 1e-12, name)
        end
      end
    end)
    it(name .. " gradients (finite differences, f64)", function()
      for k, sh in ipairs(shapes) do
        local a, b = leaf(sh[1], k), leaf(sh[2], k + 100)
        local fn = titan[name]
        if name == "div" then
          assert_grads(function(x, y) return fn(x, y:abs() + 0.5) end, { a, b }, name)
        else
          assert_grads(fn, { a, b }, name)
        end
      end
    end)
  end

  local un = {
    neg = function(x) return -x end, exp = math.exp, log = math.log, sqrt = math.sqrt,
    rsqrt = function(x) return 1 / math.sqrt(x) end, silu = function(x) return x / (1 + math.exp(-x)) end,
    relu = function(x) return x > 0 and x or 0 end, square = function(x) return x * x end, abs = math.abs,
    tanh = function(x) return (math.exp(2 * x) - 1) / (math.exp(2 * x) + 1) end,
    sigmoid = function(x) return 1 / (1 + math.exp(-x)) end, reciprocal = function(x) return 1 / x end,
  }
  local positive = { log = true, sqrt = true, rsqrt = true, reciprocal = true }
  for name, ref in pairs(un) do
    it(name .. " matches the reference and its gradient", function()
      for k, sh in ipairs({ { 5 }, { 3, 7 }, { 2, 3, 4 } }) do
        local x = randn(sh, k)
        if positive[name] then x = x:abs() + 0.5 end
        if name == "relu" or name == "abs" then x = x + 0.05 end -- keep clear of the kink for differences
        local want = {}
        for i, v in ipairs(x:tolist_flat()) do want[i] = ref(v) end
        assert_close(x[name](x):tolist_flat(), want, 1e-12, name)
        local xl = x:detach():requires_grad_()
        assert_grads(function(t) return t[name](t) end, { xl }, name)
      end
    end)
  end

  it("gelu (exact, erf form) value and gradient", function()
    local x = randn({ 4, 5 }, 3)
    local out = x:gelu():tolist_flat()
    for i, v in ipairs(x:tolist_flat()) do
      -- erf via a series good to 1e-12 on |v| < 4
      local function erf(z)
        local s, term, k = 0, z, 0
        repeat
          s = s + term / (2 * k + 1)
          k = k + 1
          term = -term * z * z / k
        until math.abs(term) < 1e-17 or k > 200
        return 2 / math.sqrt(math.pi) * s
      end
      assert(math.abs(out[i] - 0.5 * v * (1 + erf(v / math.sqrt(2)))) < 1e-12)
    end
    assert_grads(function(t) return t:gelu() end, { x:requires_grad_() }, "gelu")
  end)

  it("scale, add_scalar, pow and scalar operators", function()
    local x = randn({ 3, 4 }, 9):abs() + 0.5
    local got = (2 * x + 1 - x / 4):tolist_flat()
    for i, v in ipairs(x:tolist_flat()) do assert(math.abs(got[i] - (2 * v + 1 - v / 4)) < 1e-12) end
    local p = (x ^ 1.5):tolist_flat()
    for i, v in ipairs(x:tolist_flat()) do assert(math.abs(p[i] - v ^ 1.5) < 1e-12) end
    x:requires_grad_()
    assert_grads(function(t) return (3 - t) * 2 + t:scale(0.5) end, { x }, "scalar ops")
    assert_grads(function(t) return t ^ 1.5 end, { x }, "pow")
  end)
end)

describe("reductions", function()
  for _, name in ipairs({ "sum", "mean", "max", "norm" }) do
    it(name .. " over each dim and over everything, with gradients", function()
      local x = randn({ 3, 4, 5 }, 11)
      local flat, shape = x:tolist_flat(), x:shape()
      local st = strides_of(shape)
      for dim = 1, 3 do
        local out = titan[name](x, dim):tolist_flat()
        local oshape = {}
        for d = 1, 3 do if d ~= dim then oshape[#oshape + 1] = shape[d] end end
        local k = 0
        for i = 0, #out - 1 do
          local oi = unravel(i, oshape)
          local acc = name == "max" and -math.huge or 0
          for j = 1, shape[dim] do
            local idx, o = {}, 1
            for d = 1, 3 do
              if d == dim then idx[d] = j else idx[d] = oi[o]; o = o + 1 end
            end
            local off = 0
            for d = 1, 3 do off = off + (idx[d] - 1) * st[d] end
            local v = flat[off + 1]
            if name == "max" then acc = math.max(acc, v) elseif name == "norm" then acc = acc + v * v else acc = acc + v end
          end
          if name == "mean" then acc = acc / shape[dim] elseif name == "norm" then acc = math.sqrt(acc) end
          k = k + 1
          assert(math.abs(out[k] - acc) < 1e-12, name .. " dim " .. dim)
        end
        assert_grads(function(t) return titan[name](t, dim) end, { x:detach():requires_grad_() }, name)
        assert_grads(function(t) return titan[name](t, dim, true) end, { x:detach():requires_grad_() }, name .. " keepdim")
      end
      local all = titan[name](x):item()
      local acc = name == "max" and -math.huge or 0
      for _, v in ipairs(flat) do
        if name == "max" then acc = math.max(acc, v) elseif name == "norm" then acc = acc + v * v else acc = acc + v end
      end
      if name == "mean" then acc = acc / #flat elseif name == "norm" then acc = math.sqrt(acc) end
      assert(math.abs(all - acc) < 1e-10)
      assert_grads(function(t) return titan[name](t) end, { x:detach():requires_grad_() }, name .. " all")
    end)
  end

  it("softmax and log_softmax over the last dim", function()
    for _, shape in ipairs({ { 1, 1 }, { 3, 7 }, { 2, 3, 5 } }) do
      local x = randn(shape, 5)
      local n = shape[#shape]
      local flat = x:tolist_flat()
      local sm, lsm = x:softmax():tolist_flat(), x:log_softmax():tolist_flat()
      for r = 0, #flat / n - 1 do
        local mx, s = -math.huge, 0
        for j = 1, n do mx = math.max(mx, flat[r * n + j]) end
        for j = 1, n do s = s + math.exp(flat[r * n + j] - mx) end
        for j = 1, n do
          local want = math.exp(flat[r * n + j] - mx) / s
          assert(math.abs(sm[r * n + j] - want) < 1e-12)
          assert(math.abs(lsm[r * n + j] - math.log(want)) < 1e-12)
        end
      end
      assert_grads(function(t) return t:softmax() end, { x:detach():requires_grad_() }, "softmax")
      assert_grads(function(t) return t:log_softmax() end, { x:detach():requires_grad_() }, "log_softmax")
    end
  end)
end)

describe("matmul", function()
  local function ref_mm(a, b, M, K, N)
    local out = {}
    for i = 0, M - 1 do
      for j = 0, N - 1 do
        local s = 0
        for k = 0, K - 1 do s = s + a[i * K + k + 1] * b[k * N + j + 1] end
        out[i * N + j + 1] = s
      end
    end
    return out
  end

  it("2-D at odd sizes, f32 and f64, and through transposed views", function()
    for _, mkn in ipairs({ { 1, 1, 1 }, { 3, 5, 7 }, { 17, 9, 4 }, { 64, 33, 65 } }) do
      local M, K, N = unpack(mkn)
      for _, dt in ipairs({ "float32", "float64" }) do
        local a, b = randn({ M, K }, 1, dt), randn({ K, N }, 2, dt)
        local want = ref_mm(a:tolist_flat(), b:tolist_flat(), M, K, N)
        assert_close(a:matmul(b):tolist_flat(), want, dt == "float32" and 1e-4 or 1e-11, "matmul")
        -- a^T^T: a transposed view of a contiguous [K, M]
        local at = a:t():contiguous():t()
        assert.is_false(at:is_contiguous() and M > 1 and K > 1)
        assert_close(at:matmul(b):tolist_flat(), want, dt == "float32" and 1e-4 or 1e-11, "matmul transposed view")
      end
    end
  end)

  it("batched and broadcast operands, with gradients", function()
    local a, b = leaf({ 2, 3, 4 }, 1), leaf({ 2, 4, 5 }, 2)
    local out = titan.matmul(a, b)
    assert.are.same({ 2, 3, 5 }, out:shape())
    for bi = 1, 2 do
      local want = ref_mm(a:select(1, bi):contiguous():tolist_flat(), b:select(1, bi):contiguous():tolist_flat(), 3, 4, 5)
      assert_close(out:select(1, bi):contiguous():tolist_flat(), want, 1e-12, "batched")
    end
    assert_grads(titan.matmul, { a, b }, "batched matmul")
    assert_grads(titan.matmul, { leaf({ 2, 3, 4 }, 3), leaf({ 4, 5 }, 4) }, "3-D @ 2-D")
    assert_grads(titan.matmul, { leaf({ 3, 4 }, 5), leaf({ 2, 4, 5 }, 6) }, "2-D @ 3-D")
    assert_grads(function(x, y) return titan.matmul(x:t(), y) end, { leaf({ 4, 3 }, 7), leaf({ 4, 6 }, 8) }, "a^T @ b")
  end)

  it("bf16 and f16 operands compute in f32", function()
    local a, b = randn({ 8, 16 }, 1, "float32"), randn({ 16, 4 }, 2, "float32")
    local want = a:to("bfloat16"):float():matmul(b:to("bfloat16"):float())
    local got = a:to("bfloat16"):matmul(b:to("bfloat16"))
    assert.are.equal("bfloat16", got:dtype())
    assert_close(got:float():tolist_flat(), want:to("bfloat16"):float():tolist_flat(), 1e-6, "bf16 matmul")
    local h = a:to("float16"):matmul(b:to("float16"))
    assert_close(h:float():tolist_flat(), want:tolist_flat(), 0.05, "f16 matmul")
  end)
end)

describe("views and indexing", function()
  it("reshape, permute, transpose, narrow, expand, cat, split are differentiable", function()
    local x = leaf({ 2, 3, 4 }, 21)
    assert_grads(function(t) return t:reshape(4, 6) end, { x }, "reshape")
    assert_grads(function(t) return t:permute(3, 1, 2):contiguous() end, { x }, "permute")
    assert_grads(function(t) return t:transpose(1, 3) * 1 end, { x }, "transpose")
    assert_grads(function(t) return t:narrow(2, 2, 2) end, { x }, "narrow")
    assert_grads(function(t) return t:narrow(1, 1, 1):expand(5, 3, 4) end, { x }, "expand")
    local y = leaf({ 2, 5, 4 }, 22)
    assert_grads(function(a, b) return titan.cat({ a, b }, 2) end, { x, y }, "cat")
    assert_grads(function(t) local p = t:chunk(2, 3); return p[1] * p[2] end, { x }, "chunk")
    assert.are.same({ 2, 8, 4 }, titan.cat({ x, y:narrow(2, 1, 5) }, 2):shape())
  end)

  it("narrow and permute give the reference values", function()
    local x = titan.arange(24, { dtype = "float64" }):reshape(2, 3, 4)
    assert.are.same({ 5, 6, 9, 10 }, x:narrow(2, 2, 2):narrow(3, 2, 2):select(1, 1):contiguous():tolist_flat())
    local p = x:permute(3, 1, 2):contiguous()
    assert.are.same({ 4, 2, 3 }, p:shape())
    assert.are.same({ 0, 4, 8, 12, 16, 20 }, p:select(1, 1):contiguous():tolist_flat())
    local c = titan.cat({ x, x }, 3)
    assert.are.same({ 2, 3, 8 }, c:shape())
    assert.are.same({ 0, 1, 2, 3, 0, 1, 2, 3 }, c:select(1, 1):select(1, 1):contiguous():tolist_flat())
  end)

  it("index_select and gather with repeated indices", function()
    local x = leaf({ 5, 3 }, 23)
    local idx = titan.tensor({ 4, 0, 4, 2 }, { dtype = "int64" })
    local out = titan.index_select(x, 1, idx)
    local xf = x:tolist_flat()
    local want = {}
    for _, r in ipairs({ 4, 0, 4, 2 }) do for j = 1, 3 do want[#want + 1] = xf[r * 3 + j] end end
    assert.are.same(want, out:tolist_flat())
    assert_grads(function(t) return titan.index_select(t, 1, idx) end, { x }, "index_select")
    local gidx = titan.tensor({ { 0, 2, 2 }, { 1, 1, 0 }, { 2, 0, 1 }, { 0, 0, 0 }, { 1, 2, 1 } }, { dtype = "int64" })
    local g = titan.gather(x, 2, gidx)
    local gf = g:tolist_flat()
    local gi = gidx:tolist_flat()
    for r = 0, 4 do for j = 1, 3 do assert.are.equal(xf[r * 3 + gi[r * 3 + j] + 1], gf[r * 3 + j]) end end
    assert_grads(function(t) return titan.gather(t, 2, gidx) end, { x }, "gather")
  end)
end)

describe("nn primitives", function()
  it("linear with and without bias (value + gradient)", function()
    for _, shp in ipairs({ { { 3, 5 }, 4 }, { { 2, 3, 7 }, 1 }, { { 1, 1 }, 3 } }) do
      local xs, dout = shp[1], shp[2]
      local din = xs[#xs]
      local x, w, b = leaf(xs, 1), leaf({ dout, din }, 2), leaf({ dout }, 3)
      local y = F.linear(x, w, b)
      local want = titan.matmul(x:reshape(-1, din), w:t()) + b
      assert_close(y:reshape(-1, dout):tolist_flat(), want:tolist_flat(), 1e-12, "linear")
      assert_grads(F.linear, { x, w, b }, "linear")
      assert_grads(function(a, c) return F.linear(a, c) end, { x, w }, "linear no bias")
    end
  end)

  -- y[r, j] = sum_k x[r, k] * w[j, k] + b[j], in Lua doubles.
  local function linear_ref(x, w, b)
    local din, dout = w:size(2), w:size(1)
    local xf, wf, bf = x:contiguous():tolist_flat(), w:contiguous():tolist_flat(), b and b:contiguous():tolist_flat()
    local out = {}
    for r = 0, #xf / din - 1 do
      for j = 0, dout - 1 do
        local acc = bf and bf[j + 1] or 0
        for k = 1, din do acc = acc + xf[r * din + k] * wf[j * din + k] end
        out[#out + 1] = acc
      end
    end
    return out
  end

  it("linear's fused bias against a plain reference (f32, f64; ranks, views, bias dtypes)", function()
    for _, dt in ipairs({ "float64", "float32" }) do
      local tol = dt == "float64" and 1e-12 or 1e-5
      for k, xs in ipairs({ { 3, 5 }, { 2, 3, 7 }, { 7 }, { 2, 2, 2, 3 }, { 0, 4 }, { 33, 65 } }) do
        local din, dout = xs[#xs], 2 * k + 1
        local x, w, b = randn(xs, 10 * k, dt), randn({ dout, din }, 10 * k + 1, dt), randn({ dout }, 10 * k + 2, dt)
        local y = F.linear(x, w, b)
        local oshape = { unpack(xs) }
        oshape[#oshape] = dout
        assert.are.same(oshape, y:shape())
        assert.are.equal(dt, y:dtype())
        assert_close(y:tolist_flat(), linear_ref(x, w, b), tol, ("linear %s %s"):format(table.concat(xs, "x"), dt))
      end
      local x, w = randn({ 6, 4 }, 1, dt), randn({ 5, 4 }, 2, dt)
      -- a transposed 2-D x, a non-viewable 3-D x, a strided and an unaligned bias
      local xt = randn({ 4, 6 }, 3, dt):t()
      assert_close(F.linear(xt, w, randn({ 5 }, 4, dt)):tolist_flat(), linear_ref(xt, w, randn({ 5 }, 4, dt)), tol,
        "transposed x " .. dt)
      local x3 = randn({ 4, 3, 2 }, 5, dt):permute(2, 3, 1)
      local b5 = randn({ 5 }, 6, dt)
      assert_close(F.linear(x3, w, b5):tolist_flat(), linear_ref(x3, w, b5), tol, "permuted x " .. dt)
      local strided = randn({ 5, 2 }, 7, dt):select(2, 2)
      assert_close(F.linear(x, w, strided):tolist_flat(), linear_ref(x, w, strided), tol, "strided bias " .. dt)
      local unaligned = randn({ 6 }, 8, dt):narrow(1, 2, 5)
      assert_close(F.linear(x, w, unaligned):tolist_flat(), linear_ref(x, w, unaligned), tol, "unaligned bias " .. dt)
      -- a bias of another float dtype is added in the layer's dtype
      local other = dt == "float64" and "float32" or "float64"
      local bo = randn({ 5 }, 9, other)
      local yo = F.linear(x, w, bo)
      assert.are.equal(dt, yo:dtype())
      assert_close(yo:tolist_flat(), linear_ref(x, w, bo:to(dt)), tol, "bias " .. other .. " on " .. dt)
      -- no bias: the plain product
      assert_close(F.linear(x, w):tolist_flat(), linear_ref(x, w), tol, "no bias " .. dt)
      -- a given output is written, not accumulated
      local out = titan.full({ 6, 5 }, 0 / 0, { dtype = dt })
      local box = titan.ffi.new("tt_tensor*[1]", out._c)
      assert.are.equal(0, titan.C.tt_op_linear(x._c, w._c, b5._c, box), titan.ffi.string(titan.C.tt_last_error()))
      assert_close(out:tolist_flat(), linear_ref(x, w, b5), tol, "preallocated out " .. dt)
    end
    -- bf16 layers with an f32 bias (computed in f32 on the CPU, rounded once)
    local x, w, b = randn({ 9, 8 }, 11, "float32"), randn({ 3, 8 }, 12, "float32"), randn({ 3 }, 13, "float32")
    local xb, wb = x:to("bfloat16"), w:to("bfloat16")
    local yb = F.linear(xb, wb, b)
    assert.are.equal("bfloat16", yb:dtype())
    assert_close(yb:tolist_flat(), F.linear(xb:to("float32"), wb:to("float32"), b):to("bfloat16"):tolist_flat(), 0,
      "bf16 with an f32 bias")
  end)

  it("linear's gradients: finite differences of d(x), d(w), d(b) and accumulation into .grad", function()
    for _, xs in ipairs({ { 4 }, { 3, 2, 5 } }) do
      local din = xs[#xs]
      assert_grads(F.linear, { leaf(xs, 21), leaf({ 3, din }, 22), leaf({ 3 }, 23) }, "linear " .. table.concat(xs, "x"))
    end
    local x, w, b = leaf({ 5, 4 }, 24), leaf({ 3, 4 }, 25), leaf({ 3 }, 26)
    local function step()
      titan.scope(function() (F.linear(x, w, b) * randn({ 5, 3 }, 27)):sum():backward() end)
    end
    step()
    local gb1, gw1 = b.grad:tolist_flat(), w.grad:tolist_flat()
    local want = titan.ops.sum_to(randn({ 5, 3 }, 27), { 3 }):tolist_flat()
    assert_close(gb1, want, 1e-12, "d(b) = sum of dy over rows")
    local gb_tensor = b.grad
    step()
    assert.are.equal(gb_tensor, b.grad) -- accumulated in place, not replaced
    local two = {}
    for i, v in ipairs(gb1) do two[i] = 2 * v end
    assert_close(b.grad:tolist_flat(), two, 1e-12, "d(b) accumulates")
    for i, v in ipairs(gw1) do two[i] = 2 * v end
    assert_close(w.grad:tolist_flat(), two, 1e-12, "d(w) accumulates")
    -- an f32 bias of an f64 layer gets an f32 gradient
    local b32 = randn({ 3 }, 28, "float32"):requires_grad_()
    titan.scope(function() F.linear(x, w, b32):sum():backward() end)
    assert.are.equal("float32", b32.grad:dtype())
    assert_close(b32.grad:tolist_flat(), { 5, 5, 5 }, 0, "d(b) of a float32 bias")
  end)

  it("an activation feeding three linears (q, k, v): the later input gradients add inside the GEMM; "
    .. "finite differences agree", function()
    -- h is an intermediate, so the second and third linear backward find
    -- its gradient waiting and accumulate into it with beta = 1
    local function qkv(x, wq, wk, wv)
      local h = x * 1.5
      return F.linear(h, wq) * F.linear(h, wk) + F.linear(h, wv)
    end
    for _, xs in ipairs({ { 4, 5 }, { 3, 2, 5 } }) do
      assert_grads(qkv, { leaf(xs, 31), leaf({ 3, 5 }, 32), leaf({ 3, 5 }, 33), leaf({ 3, 5 }, 34) },
        "three linears on " .. table.concat(xs, "x"))
    end
  end)

  it("embedding (value + gradient with repeated ids)", function()
    local w = leaf({ 7, 3 }, 4)
    local ids = titan.tensor({ { 1, 6, 1 }, { 0, 0, 5 } }, { dtype = "int64" })
    local out = F.embedding(w, ids)
    assert.are.same({ 2, 3, 3 }, out:shape())
    local wf, of = w:tolist_flat(), out:tolist_flat()
    local k = 0
    for _, id in ipairs({ 1, 6, 1, 0, 0, 5 }) do
      for j = 1, 3 do k = k + 1; assert.are.equal(wf[id * 3 + j], of[k]) end
    end
    assert_grads(function(t) return F.embedding(t, ids) end, { w }, "embedding")
    local ids32 = titan.tensor({ 2, 3 }, { dtype = "int32" })
    assert.are.same({ 2, 3 }, F.embedding(w, ids32):shape())
  end)

  it("rms_norm (value + gradient) at odd sizes", function()
    for _, shape in ipairs({ { 1, 1 }, { 3, 5 }, { 2, 3, 17 } }) do
      local x, w = leaf(shape, 5), leaf({ shape[#shape] }, 6)
      local n = shape[#shape]
      local xf, wf, yf = x:tolist_flat(), w:tolist_flat(), F.rms_norm(x, w, 1e-6):tolist_flat()
      for r = 0, #xf / n - 1 do
        local ss = 0
        for j = 1, n do ss = ss + xf[r * n + j] ^ 2 end
        local rstd = 1 / math.sqrt(ss / n + 1e-6)
        for j = 1, n do assert(math.abs(yf[r * n + j] - xf[r * n + j] * rstd * wf[j]) < 1e-12) end
      end
      assert_grads(function(a, b) return F.rms_norm(a, b, 1e-6) end, { x, w }, "rms_norm")
    end
  end)

  it("add_rms_norm equals the add and the norm apart, bit for bit, with their gradients", function()
    for _, shape in ipairs({ { 1, 1 }, { 3, 5 }, { 2, 3, 17 } }) do
      local x, r, w = leaf(shape, 15), leaf(shape, 16), leaf({ shape[#shape] }, 17)
      local h, y = F.add_rms_norm(x, r, w, 1e-6)
      local h2 = x + r
      assert.are.same(h2:tolist_flat(), h:tolist_flat())
      assert.are.same(F.rms_norm(h2, w, 1e-6):tolist_flat(), y:tolist_flat())
      -- both outputs used (the norm's dx lands on h's waiting gradient), and the norm alone
      assert_grads(function(a, b, c) local hh, yy = F.add_rms_norm(a, b, c, 1e-6); return hh * yy end, { x, r, w },
        "add_rms_norm (h * y)")
      assert_grads(function(a, b, c) local _, yy = F.add_rms_norm(a, b, c, 1e-6); return yy end, { x, r, w },
        "add_rms_norm (y)")
    end
    local ok, err = pcall(F.add_rms_norm, leaf({ 2, 4 }, 1), leaf({ 2, 3 }, 2), leaf({ 4 }, 3))
    assert.is_false(ok)
    assert.truthy(tostring(err):find("add_rmsnorm: x [2, 4] and residual [2, 3]", 1, true), err)
  end)

  it("rope (value + gradient) with Llama 3.1 scaling and a position offset", function()
    local tabs = F.rope_tables(8, 16, 500000, { factor = 8, low_freq_factor = 1, high_freq_factor = 4,
      original_max_seq = 8192 }, { dtype = "float64" })
    local x = leaf({ 2, 5, 3, 8 }, 7)
    local y = F.rope(x, tabs, 3):tolist_flat()
    local xf, cf, sf = x:tolist_flat(), tabs.cos:tolist_flat(), tabs.sin:tolist_flat()
    for b = 0, 1 do for t = 0, 4 do for h = 0, 2 do for i = 0, 3 do
      local base = ((b * 5 + t) * 3 + h) * 8 + 2 * i
      local c, s = cf[(t + 3) * 4 + i + 1], sf[(t + 3) * 4 + i + 1]
      local x0, x1 = xf[base + 1], xf[base + 2]
      assert(math.abs(y[base + 1] - (x0 * c - x1 * s)) < 1e-12)
      assert(math.abs(y[base + 2] - (x0 * s + x1 * c)) < 1e-12)
    end end end end
    assert_grads(function(t) return F.rope(t, tabs, 3) end, { x }, "rope")
  end)

  local function ref_attention(q, k, v, causal)
    local B, T, Hq, D = unpack(q:shape())
    local S, Hkv = k:size(2), k:size(3)
    local qf, kf, vf = q:tolist_flat(), k:tolist_flat(), v:tolist_flat()
    local out = {}
    local scale = 1 / math.sqrt(D)
    for b = 0, B - 1 do for t = 0, T - 1 do for h = 0, Hq - 1 do
      local hk = math.floor(h / (Hq / Hkv))
      local scores, mx = {}, -math.huge
      local last = causal and (t + S - T) or (S - 1)
      for s = 0, last do
        local dot = 0
        for d = 0, D - 1 do
          dot = dot + qf[((b * T + t) * Hq + h) * D + d + 1] * kf[((b * S + s) * Hkv + hk) * D + d + 1]
        end
        scores[s] = dot * scale
        if scores[s] > mx then mx = scores[s] end
      end
      local den = 0
      for s = 0, last do scores[s] = math.exp(scores[s] - mx); den = den + scores[s] end
      for d = 0, D - 1 do
        local acc = 0
        for s = 0, last do acc = acc + scores[s] * vf[((b * S + s) * Hkv + hk) * D + d + 1] end
        out[((b * T + t) * Hq + h) * D + d + 1] = acc / den
      end
    end end end
    return out
  end

  it("attention matches a naive reference at T = 1, 7, 128 and 1024 (GQA, odd head_dim)", function()
    for _, cfg in ipairs({ { 1, 2, 2, 4 }, { 7, 4, 2, 5 }, { 128, 4, 1, 16 }, { 1024, 2, 2, 16 } }) do
      local T, Hq, Hkv, D = unpack(cfg)
      for _, causal in ipairs({ true, false }) do
        local q, k, v = randn({ 1, T, Hq, D }, 1, "float32"), randn({ 1, T, Hkv, D }, 2, "float32"),
            randn({ 1, T, Hkv, D }, 3, "float32")
        local got = F.attention(q, k, v, { causal = causal }):tolist_flat()
        assert_close(got, ref_attention(q, k, v, causal), 2e-5, ("attention T=%d causal=%s"):format(T, tostring(causal)))
      end
    end
  end)

  it("attention gradients (finite differences, f64) with grouped-query heads", function()
    for _, cfg in ipairs({ { 1, 3, 2, 1, 3 }, { 2, 4, 4, 2, 5 }, { 1, 6, 3, 3, 4 } }) do
      local B, T, Hq, Hkv, D = unpack(cfg)
      local q, k, v = leaf({ B, T, Hq, D }, 1), leaf({ B, T, Hkv, D }, 2), leaf({ B, T, Hkv, D }, 3)
      assert_grads(function(a, b, c) return F.attention(a, b, c) end, { q, k, v }, "attention causal")
      assert_grads(function(a, b, c) return F.attention(a, b, c, { causal = false }) end, { q, k, v }, "attention")
    end
  end)

  -- Ring attention (lua/parallel/cp.lua) runs each rank's queries against the keys a share at a
  -- time and folds the blocks together with their log-sum-exps.
  it("attention_merge folds blocks of keys into the attention over all of them (f32, f64)", function()
    local C, ffi, wrap = titan.C, titan.ffi, require("titan.tensor").wrap
    local function last_error() return ffi.string(C.tt_last_error()) end
    local function attn(q, k, v)
      local o, l = ffi.new("tt_tensor*[1]"), ffi.new("tt_tensor*[1]")
      assert(C.tt_op_attention(q._c, k._c, v._c, 0, 1 / math.sqrt(q:size(4)), o, l) == 0, last_error())
      return wrap(o[0]), wrap(l[0])
    end
    for _, dt in ipairs({ "float64", "float32" }) do
      local tol = dt == "float64" and 1e-12 or 2e-6
      local B, T, Hq, Hkv, D, S, T0 = 2, 5, 4, 2, 6, 9, 3
      local q, k, v = randn({ B, T, Hq, D }, 31, dt), randn({ B, S, Hkv, D }, 32, dt), randn({ B, S, Hkv, D }, 33, dt)
      local whole, wlse = attn(q, k, v)
      -- the queries land on rows 3..7 of a 10-row accumulator; rows 0..2 and 8..9 keep their values
      local acc = randn({ B, 10, Hq, D }, 34, dt)
      local acc_lse = randn({ B, Hq, 10 }, 35, dt)
      acc_lse:narrow(3, T0 + 1, T):copy_(titan.full({ B, Hq, T }, -math.huge, { dtype = dt }))
      local acc0, lse0 = acc:clone(), acc_lse:clone()
      -- (the later keys first: the order does not matter)
      for _, span in ipairs({ { 5, 4 }, { 0, 2 }, { 2, 3 } }) do
        local function part(x) return x:narrow(2, span[1] + 1, span[2]):contiguous() end
        local o, l = attn(q, part(k), part(v))
        assert(C.tt_op_attention_merge(acc._c, acc_lse._c, o._c, l._c, T0) == 0, last_error())
      end
      assert_close(acc:narrow(2, T0 + 1, T):tolist_flat(), whole:tolist_flat(), tol, "merged out " .. dt)
      assert_close(acc_lse:narrow(3, T0 + 1, T):tolist_flat(), wlse:tolist_flat(), tol, "merged lse " .. dt)
      for _, r in ipairs({ { 1, T0 }, { T0 + T + 1, 10 - T0 - T } }) do
        assert.are.same(acc0:narrow(2, r[1], r[2]):tolist_flat(), acc:narrow(2, r[1], r[2]):tolist_flat())
        assert.are.same(lse0:narrow(3, r[1], r[2]):tolist_flat(), acc_lse:narrow(3, r[1], r[2]):tolist_flat())
      end
      -- a block whose rows saw no key (lse -inf) changes nothing
      local before, lbefore = acc:tolist_flat(), acc_lse:tolist_flat()
      local none = titan.full({ B, Hq, T }, -math.huge, { dtype = dt })
      assert(C.tt_op_attention_merge(acc._c, acc_lse._c, whole._c, none._c, T0) == 0, last_error())
      assert.are.same(before, acc:tolist_flat())
      assert.are.same(lbefore, acc_lse:tolist_flat())
    end
    -- misuse: one line naming what was wrong
    local acc, lse = titan.zeros({ 1, 4, 2, 3 }), titan.zeros({ 1, 2, 4 })
    local o, l = titan.zeros({ 1, 3, 2, 3 }), titan.zeros({ 1, 2, 3 })
    assert.are_not.equal(0, C.tt_op_attention_merge(acc._c, lse._c, o._c, l._c, 2))
    assert.truthy(last_error():find("attention_merge: out [1, 3, 2, 3] at row 2 does not fit acc [1, 4, 2, 3]",
      1, true), last_error())
    local acc64 = titan.zeros({ 1, 4, 2, 3 }, { dtype = "float64" })
    assert.are_not.equal(0, C.tt_op_attention_merge(acc64._c, lse._c, o._c, l._c, 0))
    assert.truthy(last_error():find("acc [1, 4, 2, 3] has dtype float64; expected float32", 1, true),
      last_error())
  end)

  it("swiglu (value + gradient)", function()
    local a, b = leaf({ 3, 5 }, 8), leaf({ 3, 5 }, 9)
    local got, af, bf = F.swiglu(a, b):tolist_flat(), a:tolist_flat(), b:tolist_flat()
    for i = 1, #af do assert(math.abs(got[i] - af[i] / (1 + math.exp(-af[i])) * bf[i]) < 1e-12) end
    assert_grads(F.swiglu, { a, b }, "swiglu")
  end)

  it("cross_entropy with ignore_index (value + gradient), mean and sum", function()
    local logits = leaf({ 5, 7 }, 10)
    local targets = titan.tensor({ 3, -100, 0, 6, 2 }, { dtype = "int64" })
    local loss, count = F.cross_entropy(logits, targets)
    assert.are.equal(4, count)
    local lf, tf = logits:tolist_flat(), targets:tolist_flat()
    local total = 0
    for r = 0, 4 do
      if tf[r + 1] ~= -100 then
        local mx, s = -math.huge, 0
        for j = 1, 7 do mx = math.max(mx, lf[r * 7 + j]) end
        for j = 1, 7 do s = s + math.exp(lf[r * 7 + j] - mx) end
        total = total + (math.log(s) + mx - lf[r * 7 + tf[r + 1] + 1])
      end
    end
    assert(math.abs(loss:item() - total / 4) < 1e-12)
    assert(math.abs(F.cross_entropy(logits, targets, { reduction = "sum" }):item() - total) < 1e-12)
    assert_grads(function(t) return F.cross_entropy(t, targets) end, { logits }, "cross_entropy mean")
    assert_grads(function(t) return F.cross_entropy(t, targets, { reduction = "none" }) end, { logits }, "ce none")
  end)

  it("cross_entropy counts targets only without num_tokens (counting GPU targets waits for the GPU)", function()
    local logits = leaf({ 5, 7 }, 11)
    local targets = titan.tensor({ 3, -100, 0, 6, -100 }, { dtype = "int64" })
    local mean, count = F.cross_entropy(logits, targets)
    local sum, n = F.cross_entropy(logits, targets, { reduction = "sum" })
    assert.are.equal(3, count)
    assert.are.equal(3, n)
    assert(math.abs(mean:item() - sum:item() / 3) < 1e-12)
    local given, none = F.cross_entropy(logits, targets, { num_tokens = 6 })
    assert.is_nil(none)
    assert(math.abs(given:item() - sum:item() / 6) < 1e-12)
    titan.synchronize("cpu") -- nothing deferred on the CPU
  end)
end)
