-- Every op of the CUDA backend against the CPU reference, on seeded random
-- inputs, through the C API with POISONED preallocated outputs (filled with
-- NaN, or a sentinel for integers, before the op): an element a kernel
-- never wrote fails the test. The reference is the CPU op in float64 on
-- exactly the values the device sees (bf16/f16 inputs are upcast after
-- rounding), compared by normwise relative error per dtype (helpers.lua).
-- Attention is in attention_spec.lua, whole-model checks in model_spec.lua.
--
-- Without a GPU (or without a CUDA build) the file exits 77: ctest reports
-- it skipped, never passed. TITAN_GPU_SPEC_DEVICE=cpu runs it against the
-- CPU (a self-test of the harness; see helpers.lua).
package.path = "./tests/cuda/?.lua;" .. package.path
local H = require("helpers")
H.require_device()

local titan = require("titan")
local ffi, C = titan.ffi, titan.C
local box, ok, take, poison, f64, dev = H.box, H.ok, H.take, H.poison, H.f64, H.dev

local function stat_dtype(dt) return dt == "float64" and "float64" or "float32" end

-- The reference: fn(box1, box2, ...) on CPU float64 inputs, outputs allocated.
local function ref(what, nout, fn)
  local boxes = {}
  for i = 1, nout do boxes[i] = box() end
  ok(fn(unpack(boxes, 1, nout)), what .. " (CPU reference)")
  local outs = {}
  for i = 1, nout do outs[i] = take(boxes[i]) end
  return unpack(outs, 1, nout)
end

-- The device: fn(box1, ...) with the given preallocated (poisoned) outputs.
local function run(what, outs, fn)
  local boxes = {}
  for i, o in ipairs(outs) do boxes[i] = box(o) end
  ok(fn(unpack(boxes, 1, #outs)), what)
  H.sync()
  return unpack(outs)
end

local BIN = { add = C.TT_ADD, sub = C.TT_SUB, mul = C.TT_MUL, div = C.TT_DIV, maximum = C.TT_MAXIMUM,
  minimum = C.TT_MINIMUM }
local BIN_ORDER = { "add", "sub", "mul", "div", "maximum", "minimum" }

-- unary ops: {enum, alpha, domain} (domain "pos": inputs |x| + 0.1)
local UN = {
  { "neg", C.TT_NEG, 0 }, { "exp", C.TT_EXP, 0 }, { "log", C.TT_LOG, 0, "pos" }, { "sqrt", C.TT_SQRT, 0, "pos" },
  { "rsqrt", C.TT_RSQRT, 0, "pos" }, { "silu", C.TT_SILU, 0 }, { "gelu", C.TT_GELU, 0 }, { "relu", C.TT_RELU, 0 },
  { "scale", C.TT_SCALE, -0.37 }, { "add_scalar", C.TT_ADD_SCALAR, 1.5 }, { "square", C.TT_SQUARE, 0 },
  { "abs", C.TT_ABS, 0 }, { "tanh", C.TT_TANH, 0 }, { "sigmoid", C.TT_SIGMOID, 0 },
  { "pow", C.TT_POW_SCALAR, 2.5, "pos" }, { "reciprocal", C.TT_RECIPROCAL, 0, "pos" },
}

-- Elementwise ops run in bf16 too: the mixed-precision train step adds
-- residuals, scales gradients (clipping) and sums losses in the activations' dtype.
local ELEM_DTYPES = { "float32", "float64", "bfloat16" }

describe("cuda ops: elementwise", function()
  local shapes = {
    { { 3, 4 }, { 3, 4 } }, { { 2, 3, 5 }, { 5 } }, { { 4, 1 }, { 1, 3 } }, { { 7 }, { 1 } },
    { { 1, 5 }, { 3, 1, 5 } }, { { 64, 1, 33 }, { 1, 17, 33 } }, { { 1000, 257 }, { 257 } }, { { 3, 1 }, {} },
  }
  for _, dt in ipairs(ELEM_DTYPES) do
    it("binary ops with broadcasting (" .. dt .. ")", H.scoped(function()
      for _, name in ipairs(BIN_ORDER) do
        local op = BIN[name]
        for k, sh in ipairs(shapes) do
          local a = H.randn(sh[1], k, dt)
          local b = name == "div" and H.positive(sh[2], k + 100, dt, 0.5) or H.randn(sh[2], k + 100, dt)
          local r = ref(name, 1, function(o) return C.tt_op_binary(op, f64(a)._c, f64(b)._c, o) end)
          local out = poison(r:shape(), dt)
          run(name, { out }, function(o) return C.tt_op_binary(op, dev(a)._c, dev(b)._c, o) end)
          H.check(out, r, H.tol(dt), ("%s %s %s"):format(name, dt, table.concat(sh[1], "x")))
        end
      end
    end))

    it("binary ops on strided (transposed) operands (" .. dt .. ")", H.scoped(function()
      local a = H.randn({ 37, 19 }, 1, dt)
      local b = H.randn({ 19, 37 }, 2, dt)
      for _, name in ipairs({ "add", "mul" }) do
        local op = BIN[name]
        local r = ref(name, 1, function(o) return C.tt_op_binary(op, f64(a):t()._c, f64(b)._c, o) end)
        local out = poison({ 19, 37 }, dt)
        run(name, { out }, function(o) return C.tt_op_binary(op, dev(a):t()._c, dev(b)._c, o) end)
        H.check(out, r, H.tol(dt), name .. " transposed " .. dt)
      end
    end))

    it("unary ops, out of place and in place (" .. dt .. ")", H.scoped(function()
      for _, u in ipairs(UN) do
        local name, op, alpha, domain = u[1], u[2], u[3], u[4]
        for k, shape in ipairs({ { 5 }, { 3, 7 }, { 2, 3, 4 }, { 1025, 33 } }) do
          local x = domain == "pos" and H.positive(shape, k, dt) or H.randn(shape, k, dt, 2)
          local r = ref(name, 1, function(o) return C.tt_op_unary(op, f64(x)._c, alpha, o) end)
          local out = poison(shape, dt)
          run(name, { out }, function(o) return C.tt_op_unary(op, dev(x)._c, alpha, o) end)
          H.check(out, r, H.tol(dt), name .. " " .. dt)
          local xi = dev(x):clone()
          run(name .. " in place", { xi }, function(o) return C.tt_op_unary(op, xi._c, alpha, o) end)
          H.check(xi, r, H.tol(dt), name .. " in place " .. dt)
        end
      end
    end))

    it("unary backward: dx = dy * f'(x) (" .. dt .. ")", H.scoped(function()
      for _, u in ipairs(UN) do
        local name, op, alpha, domain = u[1], u[2], u[3], u[4]
        do
          local shape = { 33, 65 }
          local x = domain == "pos" and H.positive(shape, 3, dt) or H.randn(shape, 3, dt, 2)
          local dy = H.randn(shape, 4, dt)
          local r = ref(name, 1, function(o) return C.tt_op_unary_backward(op, f64(x)._c, nil, f64(dy)._c, alpha, o) end)
          local out = poison(shape, dt)
          run(name .. " backward", { out },
            function(o) return C.tt_op_unary_backward(op, dev(x)._c, nil, dev(dy)._c, alpha, o) end)
          H.check(out, r, H.tol(dt), name .. " backward " .. dt)
        end
      end
    end))

    it("axpy and sum_to (" .. dt .. ")", H.scoped(function()
      local x, y = H.randn({ 4097 }, 1, dt), H.randn({ 4097 }, 2, dt)
      local yr = f64(y)
      ok(C.tt_op_axpy(yr._c, -0.75, f64(x)._c), "axpy (CPU)")
      local yd = dev(y)
      ok(C.tt_op_axpy(yd._c, -0.75, dev(x)._c), "axpy")
      H.check(yd, yr, H.tol(dt), "axpy " .. dt)
      local a = H.randn({ 4, 5, 6 }, 3, dt)
      for _, target in ipairs({ { 1, 5, 1 }, { 6 }, { 5, 1 }, { 4, 5, 6 }, { 1, 1, 1 }, { 4, 1, 6 } }) do
        local r = ref("sum_to", 1, function(o)
          return C.tt_op_sum_to(f64(a)._c, #target, ffi.new("int64_t[?]", #target, target), o)
        end)
        local out = poison(target, dt)
        run("sum_to", { out }, function(o)
          return C.tt_op_sum_to(dev(a)._c, #target, ffi.new("int64_t[?]", #target, target), o)
        end)
        H.check(out, r, H.tol(dt, 2), "sum_to " .. table.concat(target, "x") .. " " .. dt)
      end
      -- a bias gradient's shape: [tokens, dim] -> [dim]
      local g = H.randn({ 8192, 96 }, 5, dt)
      local r = ref("sum_to", 1, function(o) return C.tt_op_sum_to(f64(g)._c, 1, ffi.new("int64_t[1]", 96), o) end)
      local out = poison({ 96 }, dt)
      run("sum_to", { out }, function(o) return C.tt_op_sum_to(dev(g)._c, 1, ffi.new("int64_t[1]", 96), o) end)
      H.check(out, r, H.tol(dt, 2), "sum_to 8192x96 -> 96 " .. dt)
    end))
  end
end)

describe("cuda ops: reductions", function()
  local RED = { { "sum", C.TT_RSUM }, { "mean", C.TT_RMEAN }, { "max", C.TT_RMAX }, { "norm", C.TT_RNORM2 } }
  for _, dt in ipairs({ "float32", "float64", "bfloat16" }) do
    it("sum, mean, max (+ indices), norm over each dim and all (" .. dt .. ")", H.scoped(function()
      for k, shape in ipairs({ { 7, 33, 129 }, { 4, 100003 }, { 1, 1 }, { 1000003 } }) do
        local x = H.randn(shape, k, dt)
        local dims = { -100 }
        for d = 0, #shape - 1 do dims[#dims + 1] = d end
        for _, rd in ipairs(RED) do
          local name, op = rd[1], rd[2]
          for _, d in ipairs(dims) do
            for _, keep in ipairs({ 0, 1 }) do
              local what = ("%s dim %d keepdim %d %s %s"):format(name, d, keep, table.concat(shape, "x"), dt)
              local rb, ib = box(), op == C.TT_RMAX and box() or nil
              ok(C.tt_op_reduce(op, f64(x)._c, d, keep, rb, ib), what .. " (CPU)")
              local r, ri = take(rb), ib and take(ib)
              local out = poison(r:shape(), dt)
              local idx = ri and poison(ri:shape(), "int64")
              ok(C.tt_op_reduce(op, dev(x)._c, d, keep, box(out), idx and box(idx) or nil), what)
              H.check(out, r, H.tol(dt, dt == "float32" and 2 or 1), what)
              -- (bf16 rounding makes ties likely: which of equal maxima is picked is not specified)
              if idx and dt ~= "bfloat16" then H.check_exact(idx, ri, what .. " indices") end
            end
          end
        end
      end
    end))
  end

  for _, dt in ipairs({ "float32", "float64" }) do
    it("softmax and log_softmax, forward and backward (" .. dt .. ")", H.scoped(function()
      for k, shape in ipairs({ { 37, 1000 }, { 8, 32000 }, { 3, 1 }, { 2, 5, 129 } }) do
        local x = H.randn(shape, k, dt, k == 1 and 30 or 3) -- large logits: stability
        local dy = H.randn(shape, k + 10, dt)
        for _, log in ipairs({ 0, 1 }) do
          local name = log == 1 and "log_softmax" or "softmax"
          local r = ref(name, 1, function(o) return C.tt_op_softmax(f64(x)._c, log, o) end)
          local y = poison(shape, dt)
          run(name, { y }, function(o) return C.tt_op_softmax(dev(x)._c, log, o) end)
          H.check(y, r, H.tol(dt, 2), name .. " " .. dt)
          local rdx = ref(name .. "_backward", 1, function(o) return C.tt_op_softmax_backward(r._c, f64(dy)._c, log, o) end)
          local dx = poison(shape, dt)
          run(name .. "_backward", { dx }, function(o) return C.tt_op_softmax_backward(dev(r:to(dt))._c, dev(dy)._c, log, o) end)
          H.check(dx, rdx, H.tol(dt, 4), name .. " backward " .. dt)
        end
      end
    end))
  end

  it("global norm over a list of f32 and bf16 tensors (f64 accumulation)", H.scoped(function()
    local ts = { H.randn({ 1000 }, 1, "float32"), H.randn({ 33, 77 }, 2, "float32"), H.randn({ 4096 }, 3, "bfloat16"),
      H.randn({ 1048576 }, 4, "float32", 0.01) }
    local n = #ts
    local cpu, gpu = ffi.new("tt_tensor*[?]", n), ffi.new("tt_tensor*[?]", n)
    local keep = {}
    for i, t in ipairs(ts) do
      local c, d = f64(t), dev(t)
      keep[#keep + 1] = c
      keep[#keep + 1] = d
      cpu[i - 1], gpu[i - 1] = c._c, d._c
    end
    local want, got = ffi.new("double[1]"), ffi.new("double[1]")
    ok(C.tt_op_global_norm(n, cpu, want), "global_norm (CPU)")
    ok(C.tt_op_global_norm(n, gpu, got), "global_norm")
    local rel = math.abs(got[0] - want[0]) / want[0]
    assert(rel < 1e-6, ("global_norm: %.17g vs CPU %.17g (rel %.3g)"):format(got[0], want[0], rel))
  end))

  -- 300 tensors (empty, strided and CPU ones among them): one read-back per
  -- device, the result of the one-tensor calls added in order, the same bits
  -- on every call.
  it("global norm over many tensors on two devices, in one read-back per device", H.scoped(function()
    local list, n = {}, 300
    for i = 1, n do
      local t
      if i % 50 == 0 then t = H.randn({ 0 }, i, "float32")
      elseif i % 7 == 0 then t = H.randn({ 64, 9 }, i, "float32"):to(H.DEV):transpose(1, 2) -- strided
      elseif i % 11 == 0 then t = H.randn({ 37 }, i, "float32") -- stays on the CPU
      else t = H.randn({ 1 + (i * 97) % 5000 }, i, i % 3 == 0 and "bfloat16" or "float32"):to(H.DEV) end
      list[i] = t
    end
    local arr = ffi.new("tt_tensor*[?]", n)
    for i, t in ipairs(list) do arr[i - 1] = t._c end
    local one, all, again = ffi.new("double[1]"), ffi.new("double[1]"), ffi.new("double[1]")
    local total = 0
    for i = 1, n do
      ok(C.tt_op_global_norm(1, arr + (i - 1), one), "global_norm of tensor " .. i)
      total = total + one[0] * one[0]
    end
    ok(C.tt_op_global_norm(n, arr, all), "global_norm of the list")
    ok(C.tt_op_global_norm(n, arr, again), "global_norm of the list, again")
    assert.are.equal(all[0], again[0])
    local rel = math.abs(all[0] - math.sqrt(total)) / math.sqrt(total)
    assert(rel < 1e-12, ("global_norm of the list %.17g vs the one-tensor calls %.17g (rel %.3g)"):format(all[0],
      math.sqrt(total), rel))
  end))
end)

describe("cuda ops: matmul", function()
  local shapes = { { 1, 1, 1 }, { 17, 33, 9 }, { 128, 256, 64 }, { 512, 1024, 768 }, { 1, 4096, 1 }, { 2048, 64, 333 } }
  for _, dt in ipairs({ "float32", "float64", "bfloat16", "float16" }) do
    it("all transposes (flags and transposed views), alpha, poisoned out (" .. dt .. ")", H.scoped(function()
      for k, mkn in ipairs(shapes) do
        local M, K, N = mkn[1], mkn[2], mkn[3]
        for _, ta in ipairs({ 0, 1 }) do
          for _, tb in ipairs({ 0, 1 }) do
            local a = H.randn(ta == 1 and { K, M } or { M, K }, 10 * k + 1, dt)
            local b = H.randn(tb == 1 and { N, K } or { K, N }, 10 * k + 2, dt)
            local what = ("matmul %dx%dx%d ta%d tb%d %s"):format(M, K, N, ta, tb, dt)
            local r = ref(what, 1, function(o) return C.tt_op_matmul(f64(a)._c, f64(b)._c, ta, tb, 0.5, 0, o) end)
            local out = poison({ M, N }, dt)
            run(what, { out }, function(o) return C.tt_op_matmul(dev(a)._c, dev(b)._c, ta, tb, 0.5, 0, o) end)
            H.check(out, r, H.tol(dt), what)
            -- the same product from transposed views (no flags): the engine reads strides
            local av = ta == 1 and dev(a):t() or dev(a)
            local bv = tb == 1 and dev(b):t() or dev(b)
            local out2 = poison({ M, N }, dt)
            run(what .. " (views)", { out2 }, function(o) return C.tt_op_matmul(av._c, bv._c, 0, 0, 0.5, 0, o) end)
            H.check(out2, r, H.tol(dt), what .. " (views)")
          end
        end
      end
    end))

    it("batched, broadcast operands and beta = 1 accumulation (" .. dt .. ")", H.scoped(function()
      local a3, b3 = H.randn({ 3, 65, 40 }, 1, dt), H.randn({ 3, 40, 33 }, 2, dt)
      local a2, b2 = H.randn({ 65, 40 }, 3, dt), H.randn({ 40, 33 }, 4, dt)
      local cases = { { a3, b3, "3d@3d" }, { a3, b2, "3d@2d" }, { a2, b3, "2d@3d" } }
      for _, c in ipairs(cases) do
        local a, b, what = c[1], c[2], "matmul " .. c[3] .. " " .. dt
        local r = ref(what, 1, function(o) return C.tt_op_matmul(f64(a)._c, f64(b)._c, 0, 0, 1, 0, o) end)
        local out = poison(r:shape(), dt)
        run(what, { out }, function(o) return C.tt_op_matmul(dev(a)._c, dev(b)._c, 0, 0, 1, 0, o) end)
        H.check(out, r, H.tol(dt), what)
      end
      -- weight-gradient accumulation: out = x^T @ g + out
      local x, g = H.randn({ 300, 64 }, 5, dt), H.randn({ 300, 48 }, 6, dt)
      local acc = H.randn({ 64, 48 }, 7, dt)
      local racc = f64(acc)
      ok(C.tt_op_matmul(f64(x)._c, f64(g)._c, 1, 0, 1, 1, box(racc)), "matmul beta=1 (CPU)")
      local dacc = dev(acc)
      ok(C.tt_op_matmul(dev(x)._c, dev(g)._c, 1, 0, 1, 1, box(dacc)), "matmul beta=1")
      H.check(dacc, racc, H.tol(dt), "matmul beta=1 accumulation " .. dt)
    end))
  end
end)

describe("cuda ops: indexing", function()
  for _, dt in ipairs({ "float32", "float64", "bfloat16" }) do
    it("index_select, gather (int64 and int32 indices, duplicates) (" .. dt .. ")", H.scoped(function()
      local src = H.randn({ 5, 7, 9 }, 1, dt)
      for d = 0, 2 do
        local n = src:size(d + 1)
        for _, idt in ipairs({ "int64", "int32" }) do
          local idx = H.ids({ 11 }, n, 10 + d, idt)
          local what = ("index_select dim %d %s %s"):format(d, idt, dt)
          local r = ref(what, 1, function(o) return C.tt_op_index_select(f64(src)._c, d, idx._c, o) end)
          local out = poison(r:shape(), dt)
          run(what, { out }, function(o) return C.tt_op_index_select(dev(src)._c, d, dev(idx)._c, o) end)
          H.check_exact(out, r, what)
          local ishape = src:shape()
          ishape[d + 1] = 4
          local gidx = H.ids(ishape, n, 20 + d, idt)
          what = ("gather dim %d %s %s"):format(d, idt, dt)
          r = ref(what, 1, function(o) return C.tt_op_gather(f64(src)._c, d, gidx._c, o) end)
          out = poison(r:shape(), dt)
          run(what, { out }, function(o) return C.tt_op_gather(dev(src)._c, d, dev(gidx)._c, o) end)
          H.check_exact(out, r, what)
        end
      end
    end))

    it("index_add and scatter_add accumulate deterministically with duplicate indices (" .. dt .. ")",
      H.scoped(function()
        local dst = H.randn({ 6, 8, 5 }, 1, dt)
        for d = 0, 2 do
          local n = dst:size(d + 1)
          local idx = H.ids({ 40 }, n, 30 + d) -- 40 draws over <= 8 slots: many duplicates
          local sshape = dst:shape()
          sshape[d + 1] = 40
          local src = H.randn(sshape, 40 + d, dt)
          local what = ("index_add dim %d %s"):format(d, dt)
          local r = f64(dst)
          ok(C.tt_op_index_add(r._c, d, idx._c, f64(src)._c), what .. " (CPU)")
          local got = dev(dst)
          ok(C.tt_op_index_add(got._c, d, dev(idx)._c, dev(src)._c), what)
          H.check(got, r, H.tol(dt, 2), what)
          local gshape = dst:shape()
          gshape[d + 1] = 12
          local sidx = H.ids(gshape, n, 50 + d)
          local ssrc = H.randn(gshape, 60 + d, dt)
          what = ("scatter_add dim %d %s"):format(d, dt)
          r = f64(dst)
          ok(C.tt_op_scatter_add(r._c, d, sidx._c, f64(ssrc)._c), what .. " (CPU)")
          got = dev(dst)
          ok(C.tt_op_scatter_add(got._c, d, dev(sidx)._c, dev(ssrc)._c), what)
          H.check(got, r, H.tol(dt, 2), what)
          -- determinism: the same accumulation twice gives the same bits
          local again = dev(dst)
          ok(C.tt_op_scatter_add(again._c, d, dev(sidx)._c, dev(ssrc)._c), what)
          H.check_exact(again, got, what .. " (run twice)")
        end
      end))
  end

  it("cat along each dim into a poisoned output", H.scoped(function()
    local parts = { H.randn({ 2, 3, 4 }, 1, "float32"), H.randn({ 2, 3, 4 }, 2, "float32"), H.randn({ 2, 3, 4 }, 3, "float32") }
    for d = 0, 2 do
      local n = #parts
      local cpu, gpu = ffi.new("tt_tensor*[?]", n), ffi.new("tt_tensor*[?]", n)
      local keep = {}
      for i, t in ipairs(parts) do
        keep[#keep + 1] = dev(t)
        cpu[i - 1], gpu[i - 1] = t._c, keep[#keep]._c
      end
      local r = ref("cat", 1, function(o) return C.tt_op_cat(n, cpu, d, o) end)
      local out = poison(r:shape(), "float32")
      run("cat", { out }, function(o) return C.tt_op_cat(n, gpu, d, o) end)
      H.check_exact(out, r, "cat dim " .. d)
    end
  end))
end)

describe("cuda ops: embedding", function()
  for _, dt in ipairs({ "float32", "float64", "bfloat16" }) do
    it("forward (poisoned) and backward (accumulates, duplicate ids) (" .. dt .. ")", H.scoped(function()
      for k, vd in ipairs({ { 1000, 96 }, { 2048, 256 }, { 32000, 64 } }) do
        local V, D = vd[1], vd[2]
        local w = H.randn({ V, D }, k, dt)
        for _, idt in ipairs({ "int64", "int32" }) do
          local ids = H.ids({ 4, 33 }, math.min(V, 50), 10 + k, idt) -- few distinct ids: duplicates
          local what = ("embedding V%d D%d %s %s"):format(V, D, idt, dt)
          local r = ref(what, 1, function(o) return C.tt_op_embedding(f64(w)._c, ids._c, o) end)
          local out = poison({ 4, 33, D }, dt)
          run(what, { out }, function(o) return C.tt_op_embedding(dev(w)._c, dev(ids)._c, o) end)
          H.check_exact(out, r, what)
          local dy = H.randn({ 4, 33, D }, 20 + k, dt)
          local dw0 = H.randn({ V, D }, 30 + k, dt, 0.1)
          local rdw = f64(dw0)
          ok(C.tt_op_embedding_backward(f64(dy)._c, ids._c, rdw._c), what .. " backward (CPU)")
          local gdw = dev(dw0)
          ok(C.tt_op_embedding_backward(dev(dy)._c, dev(ids)._c, gdw._c), what .. " backward")
          H.check(gdw, rdw, H.tol(dt, 2), what .. " backward")
        end
      end
    end))
  end
end)

describe("cuda ops: index_add over one slice (the embedding gradient) sorted by row", function()
  -- ids skewed as a BPE vocabulary's tokens are (u^4: a few hot low rows),
  -- with -1 and n where bad ones are wanted
  local function skewed(n, V, seed, bad)
    local u = titan.rand({ n }, { seed = seed, offset = 0, dtype = "float64" }):pow(4)
    u:mul_(V)
    local ids = u:to("int64")
    if bad then
      local h = ids:tolist_flat()
      h[7], h[n - 3] = -1, V
      ids = titan.tensor(h, { dtype = "int64" })
    end
    return ids
  end
  local function both(fn) -- the default (sorted) plan's result and the scan's
    local a = fn()
    local b
    H.with_env("TITAN_CUDA_INDEX_ADD_PLAN", "scan", function() b = fn() end)
    return a, b
  end

  for _, dt in ipairs(H.ON_GPU and { "float32", "bfloat16", "float64" } or { "float32", "float64" }) do
    it("gives the scan's bits, and the CPU's for f32 (" .. dt .. ")", H.scoped(function()
      -- n over several chunks of the sort; D = 33: no 16-byte units, one column a thread
      for _, c in ipairs({ { 3000, 8016, 64 }, { 2500, 500, 33 }, { 5, 3, 8 } }) do
        local n, V, D = c[1], c[2], c[3]
        local ids = skewed(n, V, n + D)
        local dy = H.randn({ n, D }, 70 + D, dt)
        local dw0 = H.randn({ V, D }, 80 + D, dt, 0.1)
        local what = ("embedding_backward n%d V%d D%d %s"):format(n, V, D, dt)
        local sorted, scan = both(function()
          local g = dev(dw0)
          ok(C.tt_op_embedding_backward(dev(dy)._c, dev(ids)._c, g._c), what)
          return g
        end)
        H.check_exact(sorted, scan, what .. ": sorted vs scan")
        if dt == "float32" then -- the CPU adds in the same order
          local cpu = dw0:clone()
          ok(C.tt_op_embedding_backward(dy._c, ids._c, cpu._c), what .. " (CPU)")
          H.check_exact(sorted, cpu, what .. ": against the CPU")
        end
        -- index_add along dim 0 of a 2-D tensor is the same path
        local isorted, iscan = both(function()
          local g = dev(dw0)
          ok(C.tt_op_index_add(g._c, 0, dev(ids)._c, dev(dy)._c), what)
          return g
        end)
        H.check_exact(isorted, iscan, "index_add dim 0: sorted vs scan")
        H.check_exact(isorted, sorted, "index_add dim 0 = embedding_backward")
      end
    end))
  end

  it("skips and reports an id out of range as the scan does", H.scoped(function()
    if not H.ON_GPU then return end -- (the CPU refuses bad ids before adding: index_check_spec)
    local ids = skewed(1500, 300, 5, true)
    local dy = H.randn({ 1500, 16 }, 6, "float32")
    local dw0 = H.randn({ 300, 16 }, 7, "float32")
    local sorted, scan = both(function()
      local g = dev(dw0)
      ok(C.tt_op_embedding_backward(dev(dy)._c, dev(ids)._c, g._c), "embedding_backward with bad ids")
      local st = C.tt_device_synchronize(require("titan.tensor").device_of(H.DEV))
      assert.are_not.equal(0, st, "the bad ids are reported at the next sync")
      assert.truthy(ffi.string(C.tt_last_error()):find("embedding_backward: index", 1, true))
      return g
    end)
    H.check_exact(sorted, scan, "bad ids: sorted vs scan")
  end))

  it("falls back to the scan where the scratch cannot hold the sort (and gives its bits)", H.scoped(function()
    -- 2M rows: one chunk's counts fill half the 16 MiB scratch, so 20000 ids
    -- would need chunks of more than the 12288 a block sorts
    local V, n = 2000000, 20000
    local ids = skewed(n, V, 9)
    local dy = H.randn({ n, 1 }, 10, "float32")
    local dw0 = H.randn({ V, 1 }, 11, "float32")
    local sorted, scan = both(function()
      local g = dev(dw0)
      ok(C.tt_op_embedding_backward(dev(dy)._c, dev(ids)._c, g._c), "embedding_backward V2M")
      return g
    end)
    H.check_exact(sorted, scan, "fallback: sorted vs scan")
  end))

  it("a misspelt TITAN_CUDA_INDEX_ADD_PLAN fails the op with one line", H.scoped(function()
    H.with_env("TITAN_CUDA_INDEX_ADD_PLAN", "sort", function()
      local g = dev(titan.zeros({ 4, 8 }))
      local st = C.tt_op_embedding_backward(dev(titan.ones({ 2, 8 }))._c, dev(titan.tensor({ 1, 2 },
        { dtype = "int64" }))._c, g._c)
      if not H.ON_GPU then return end -- (the CPU backend reads no such setting)
      assert.are_not.equal(0, st)
      assert.truthy(ffi.string(C.tt_last_error()):find(
        "cuda embedding_backward: TITAN_CUDA_INDEX_ADD_PLAN=sort: expected sorted or scan", 1, true))
    end)
  end))
end)

-- One RMSNorm case: seeded inputs and the CPU float64 reference of y, rstd,
-- dx and dweight (accumulated onto dw0).
local function rmsnorm_case(rows, dim, dt, seed)
  local c = { rows = rows, dim = dim, dt = dt, what = ("rmsnorm %dx%d %s"):format(rows, dim, dt) }
  c.x, c.w = H.randn({ rows, dim }, seed, dt, 3), H.randn({ dim }, 10 + seed, dt, 0.5, 1)
  c.dy, c.dw0 = H.randn({ rows, dim }, 20 + seed, dt), H.randn({ dim }, 30 + seed, dt)
  c.ry, c.rr = ref(c.what, 2, function(o1, o2) return C.tt_op_rmsnorm(f64(c.x)._c, f64(c.w)._c, 1e-5, o1, o2) end)
  c.rdw = f64(c.dw0)
  c.rdx = ref(c.what .. " backward", 1, function(o)
    return C.tt_op_rmsnorm_backward(f64(c.x)._c, f64(c.w)._c, c.rr._c, f64(c.dy)._c, o, c.rdw._c)
  end)
  return c
end

-- The device's forward and backward (poisoned outputs, dweight onto dw0) against the case's reference.
local function check_rmsnorm(c, what)
  local y, rstd = poison({ c.rows, c.dim }, c.dt), poison({ c.rows }, stat_dtype(c.dt))
  run(what, { y, rstd }, function(o1, o2) return C.tt_op_rmsnorm(dev(c.x)._c, dev(c.w)._c, 1e-5, o1, o2) end)
  H.check(y, c.ry, H.tol(c.dt), what .. " y")
  H.check(rstd, c.rr, H.tol(stat_dtype(c.dt)), what .. " rstd")
  local dx, gdw = poison({ c.rows, c.dim }, c.dt), dev(c.dw0)
  run(what .. " backward", { dx }, function(o)
    return C.tt_op_rmsnorm_backward(dev(c.x)._c, dev(c.w)._c, rstd._c, dev(c.dy)._c, o, gdw._c)
  end)
  H.check(dx, c.rdx, H.tol(c.dt, 2), what .. " dx")
  H.check(gdw, c.rdw, H.tol(c.dt, 4), what .. " dweight (accumulated)")
end

describe("cuda ops: rmsnorm", function()
  for _, dt in ipairs({ "float32", "float64", "bfloat16" }) do
    it("forward (y, rstd) and backward (dx; dweight accumulates) (" .. dt .. ")", H.scoped(function()
      -- rows kept in registers (up to 1024 per warp, 8192 per block; f64 256 / 2048), rows read
      -- twice (longer), ragged tails, and rows that are not 16-byte aligned (12289); bf16 rows of
      -- whole 16-byte chunks take the lean kernels (both plans are checked below), f32 1536 and 2048
      -- on a block (every group size is checked below)
      for k, rd in ipairs({ { 1, 256 }, { 7, 100 }, { 4096, 256 }, { 512, 2048 }, { 64, 4096 }, { 3, 8192 },
        { 5, 1000 }, { 2, 12289 }, { 2, 16384 }, { 3, 4096 }, { 7, 1536 } }) do
        local c = rmsnorm_case(rd[1], rd[2], dt, k)
        check_rmsnorm(c, c.what)
      end
    end))

    it("add_rmsnorm (h = x + residual, then the norm) equals the two ops on the device, bit for bit; "
      .. "backward accumulating dx (" .. dt .. ")", H.scoped(function()
      for k, rd in ipairs({ { 1, 256 }, { 7, 100 }, { 4096, 256 }, { 64, 4096 }, { 3, 8192 }, { 2, 12289 },
        { 3, 4096 }, { 5, 2048 } }) do
        local rows, dim = rd[1], rd[2]
        local x, r = H.randn({ rows, dim }, 40 + k, dt, 3), H.randn({ rows, dim }, 50 + k, dt)
        local w = H.randn({ dim }, 60 + k, dt, 0.5, 1)
        local what = ("add_rmsnorm %dx%d %s"):format(rows, dim, dt)
        local dx_, dr_, dw_ = dev(x), dev(r), dev(w)
        local h, y, rstd = poison({ rows, dim }, dt), poison({ rows, dim }, dt), poison({ rows }, stat_dtype(dt))
        run(what, { h, y, rstd }, function(o1, o2, o3)
          return C.tt_op_add_rmsnorm(dx_._c, dr_._c, dw_._c, 1e-5, o1, o2, o3)
        end)
        local h2 = dx_ + dr_
        H.check_exact(h, h2, what .. " h")
        local b1, b2 = box(), box()
        ok(C.tt_op_rmsnorm(h2._c, dw_._c, 1e-5, b1, b2), what .. " apart")
        local y2, r2 = take(b1), take(b2)
        H.check_exact(y, y2, what .. " y")
        H.check_exact(rstd, r2, what .. " rstd")
        -- dx += the backward, onto a waiting gradient
        local dy, acc0 = H.randn({ rows, dim }, 70 + k, dt), H.randn({ rows, dim }, 80 + k, dt)
        local rdx = ref(what .. " backward", 1, function(o)
          return C.tt_op_rmsnorm_backward(f64(h2)._c, f64(w)._c, f64(r2)._c, f64(dy)._c, o, nil)
        end)
        local want = rdx + f64(acc0)
        local acc = dev(acc0)
        ok(C.tt_op_rmsnorm_backward_acc(h2._c, dw_._c, r2._c, dev(dy)._c, acc._c, nil), what .. " backward_acc")
        H.check(acc, want, H.tol(dt, 2), what .. " dx accumulated")
      end
    end))
  end
end)

-- A setting the RMSNorm launches read (with_setting(value, fn) runs fn under it): each bad value
-- makes the op fail with the line `want` (its %s: the value); unset again, the op runs.
local function norm_setting_refused(with_setting, dt, bads, want)
  local x, w = dev(H.randn({ 2, 64 }, 1, dt)), dev(H.randn({ 64 }, 2, dt))
  for _, bad in ipairs(bads) do
    local st, msg
    with_setting(bad, function()
      st = C.tt_op_rmsnorm(x._c, w._c, 1e-5, box(), box())
      msg = ffi.string(C.tt_last_error())
    end)
    assert.are_not.equal(0, st, bad .. ": the op went ahead")
    assert.truthy(msg:find(want:format(bad), 1, true), bad .. ": " .. msg)
  end
  ok(C.tt_op_rmsnorm(x._c, w._c, 1e-5, box(), box()), "rmsnorm with the setting unset")
end

local with_env = H.with_env

-- got (the lean kernels' output) has the same NaN and infinities (sign too) in the same places as want
-- (the exact kernels'), and its finite values are within tol of want's largest finite magnitude. There
-- must be some non-finite value to compare.
local function same_nonfinite(got, want, name, tol)
  local g, w = got:to("float64"):tolist_flat(), want:to("float64"):tolist_flat()
  local scale, bad = 0, 0
  for _, v in ipairs(w) do
    if v == v and math.abs(v) ~= math.huge then scale = math.max(scale, math.abs(v)) end
  end
  for i, b in ipairs(w) do
    local a = g[i]
    if b ~= b or math.abs(b) == math.huge then
      assert(a == b or (a ~= a and b ~= b), ("NaN and inf: %s element %d is %s, the exact kernels' %s")
        :format(name, i, tostring(a), tostring(b)))
      bad = bad + 1
    else
      assert(a == a and math.abs(a - b) <= tol * scale, ("NaN and inf: %s element %d is %s, the exact kernels' %s")
        :format(name, i, tostring(a), tostring(b)))
    end
  end
  assert.is_true(bad > 0, name .. ": no NaN or infinity to compare")
end

describe("cuda ops: rmsnorm's lanes per row (TITAN_CUDA_NORM_GROUP)", function()
  -- The setting is read at each launch, so one process can go through every
  -- choice: the GPU benchmark times them side by side (docs/cuda.md).
  pcall(ffi.cdef, "int setenv(const char *name, const char *value, int overwrite); int unsetenv(const char *name);")
  local function with_group(g, fn)
    ffi.C.setenv("TITAN_CUDA_NORM_GROUP", g, 1)
    local fine, err = pcall(fn)
    ffi.C.unsetenv("TITAN_CUDA_NORM_GROUP")
    if not fine then error(err, 0) end
  end

  for _, dt in ipairs({ "float32", "bfloat16" }) do
    it("each of 32, 64, 128 and 256 lanes gives the reference: y, rstd, dx and dweight (" .. dt .. ")",
      H.scoped(function()
        for k, rd in ipairs({ { 3, 4096 }, { 5, 1536 }, { 2, 12289 } }) do
          local c = rmsnorm_case(rd[1], rd[2], dt, 90 + k)
          for _, g in ipairs({ "32", "64", "128", "256" }) do
            with_group(g, function() check_rmsnorm(c, c.what .. ", " .. g .. " lanes") end)
          end
        end
      end))
  end

  -- (the CPU self-test has no such setting)
  local on_gpu = H.ON_GPU and it or pending
  on_gpu("any other value: the op fails with one line naming the setting and the choices", H.scoped(function()
    norm_setting_refused(with_group, "float32", { "100", "128x", "-64" },
      "TITAN_CUDA_NORM_GROUP=%s: expected 32, 64, 128 or 256 lanes per row")
  end))
end)

describe("cuda ops: rmsnorm's plans (TITAN_CUDA_NORM_PLAN: lean, the default, or exact)", function()
  -- bf16 rows of whole 16-byte chunks take the lean kernels (f32 sums within a lane, hardware rounding:
  -- the reference within bf16's tolerance); =exact gives them the double-statistics kernels, which the
  -- GPU benchmark times next to them (docs/cuda.md). Shapes: warp rows and block rows of 1, 2 and 4
  -- chunks a lane, ragged ones (4000, 2056: some lanes have one chunk fewer), rows that are not whole
  -- chunks (500, 12289: the exact kernels either way), many short rows.
  local SHAPES = { { 67, 256 }, { 130, 500 }, { 21, 2048 }, { 19, 4096 }, { 11, 4000 }, { 9, 1024 }, { 3, 8192 },
    { 2, 12289 }, { 5, 2056 }, { 300, 64 } }

  local function with_plan(v, fn) with_env("TITAN_CUDA_NORM_PLAN", v, fn) end

  for _, v in ipairs({ "lean", "exact" }) do
    it(v .. ": the reference within bf16's tolerance (y, rstd, dx, dweight); add_rmsnorm's h has the add's bits "
      .. "and its y and rstd the plan's norm of h; the backward adding dx onto a waiting gradient",
      H.scoped(function()
        for k, rd in ipairs(SHAPES) do
          local rows, dim = rd[1], rd[2]
          local c = rmsnorm_case(rows, dim, "bfloat16", 300 + k)
          with_plan(v, function() check_rmsnorm(c, c.what .. ", " .. v) end)
          local what = ("add_rmsnorm %dx%d bf16, %s"):format(rows, dim, v)
          local x = dev(H.randn({ rows, dim }, 400 + k, "bfloat16", 3))
          local r = dev(H.randn({ rows, dim }, 410 + k, "bfloat16"))
          local w = dev(H.randn({ dim }, 420 + k, "bfloat16", 0.5, 1))
          local h, y, y2 = poison({ rows, dim }, "bfloat16"), poison({ rows, dim }, "bfloat16"),
            poison({ rows, dim }, "bfloat16")
          local rstd, r2 = poison({ rows }, "float32"), poison({ rows }, "float32")
          local h2 = x + r
          with_plan(v, function()
            run(what, { h, y, rstd }, function(o1, o2, o3)
              return C.tt_op_add_rmsnorm(x._c, r._c, w._c, 1e-5, o1, o2, o3)
            end)
            run(what .. " apart", { y2, r2 }, function(o1, o2) return C.tt_op_rmsnorm(h2._c, w._c, 1e-5, o1, o2) end)
          end)
          H.check_exact(h, h2, what .. " h")
          H.check_exact(y, y2, what .. " y")
          H.check_exact(rstd, r2, what .. " rstd")
          local dy, acc0 = H.randn({ rows, dim }, 430 + k, "bfloat16"), H.randn({ rows, dim }, 440 + k, "bfloat16")
          local dw0 = H.randn({ dim }, 450 + k, "bfloat16")
          local rdw = f64(dw0)
          local rdx = ref(what .. " backward", 1, function(o)
            return C.tt_op_rmsnorm_backward(f64(h2)._c, f64(w)._c, f64(r2)._c, f64(dy)._c, o, rdw._c)
          end)
          local accd, dwd = dev(acc0), dev(dw0)
          with_plan(v, function()
            ok(C.tt_op_rmsnorm_backward_acc(h2._c, w._c, r2._c, dev(dy)._c, accd._c, dwd._c), what .. " backward_acc")
          end)
          H.check(accd, rdx + f64(acc0), H.tol("bfloat16", 2), what .. " dx accumulated")
          H.check(dwd, rdw, H.tol("bfloat16", 4), what .. " dweight accumulated")
        end
      end))
  end

  it("a NaN and an infinity in x, a NaN in w: the lean kernels give NaN and infinities where the exact ones do",
    H.scoped(function()
      local rows, dim = 6, 4096
      local xs = H.randn({ rows, dim }, 500, "bfloat16", 3):tolist_flat()
      local ws = H.randn({ dim }, 501, "bfloat16", 0.5, 1):tolist_flat()
      xs[dim + 7], xs[3 * dim + 100], ws[4000] = 0 / 0, 1 / 0, 0 / 0
      local x = dev(titan.tensor(xs, { dtype = "bfloat16" }):view({ rows, dim }))
      local w = dev(titan.tensor(ws, { dtype = "bfloat16" }))
      local dy = dev(H.randn({ rows, dim }, 502, "bfloat16"))
      local out = {}
      for _, v in ipairs({ "lean", "exact" }) do
        local o = { y = poison({ rows, dim }, "bfloat16"), rstd = poison({ rows }, "float32"),
          dx = poison({ rows, dim }, "bfloat16"), dw = dev(titan.zeros({ dim }, { dtype = "bfloat16" })) }
        with_plan(v, function()
          run("rmsnorm with NaN and inf, " .. v, { o.y, o.rstd }, function(o1, o2)
            return C.tt_op_rmsnorm(x._c, w._c, 1e-5, o1, o2)
          end)
          run("rmsnorm backward with NaN and inf, " .. v, { o.dx }, function(b)
            return C.tt_op_rmsnorm_backward(x._c, w._c, o.rstd._c, dy._c, b, o.dw._c)
          end)
        end)
        out[v] = o
      end
      -- the finite values within bf16's tolerance of the largest (the plans' statistics round differently)
      for _, name in ipairs({ "y", "rstd", "dx", "dw" }) do
        same_nonfinite(out.lean[name], out.exact[name], name, H.tol("bfloat16", 4))
      end
    end))

  local on_gpu = H.ON_GPU and it or pending
  on_gpu("any other value: the op fails with one line naming the setting and the choices", H.scoped(function()
    norm_setting_refused(with_plan, "bfloat16", { "1", "pipe", "fast" },
      "TITAN_CUDA_NORM_PLAN=%s: expected lean or exact")
  end))
end)

describe("cuda ops: rope", function()
  -- Tables as the model builds them: f32 (f64 for an f64 model), on the device.
  local function tables(D, seq, dt)
    local c, s = box(), box()
    ok(C.tt_op_rope_table(D, seq, 500000, 8, 1, 4, 8192, dt == "float64" and C.TT_F64 or C.TT_F32, c, s), "rope_table")
    return take(c), take(s)
  end
  for _, dt in ipairs({ "float32", "float64", "bfloat16" }) do
    it("rotates adjacent pairs, forward and inverse, with a position offset, in place too (" .. dt .. ")",
      H.scoped(function()
        for k, sh in ipairs({ { 2, 37, 4, 64 }, { 1, 128, 8, 128 }, { 3, 1, 2, 16 } }) do
          local D = sh[4]
          local tdt = dt == "float64" and "float64" or "float32"
          local cos, sin = tables(D, 256, tdt)
          local rcos, rsin = tables(D, 256, "float64")
          local dcos, dsin = dev(cos), dev(sin)
          local x = H.randn(sh, k, dt)
          for _, off in ipairs({ 0, 5 }) do
            for _, inv in ipairs({ 0, 1 }) do
              local what = ("rope %s offset %d inverse %d %s"):format(table.concat(sh, "x"), off, inv, dt)
              local r = ref(what, 1, function(o) return C.tt_op_rope(f64(x)._c, rcos._c, rsin._c, off, inv, o) end)
              local out = poison(sh, dt)
              run(what, { out }, function(o) return C.tt_op_rope(dev(x)._c, dcos._c, dsin._c, off, inv, o) end)
              H.check(out, r, H.tol(dt, dt == "float32" and 2 or 1), what)
              local xi = dev(x)
              run(what .. " in place", { xi }, function(o) return C.tt_op_rope(xi._c, dcos._c, dsin._c, off, inv, o) end)
              H.check(xi, r, H.tol(dt, dt == "float32" and 2 or 1), what .. " in place")
            end
          end
        end
      end))
  end
end)

describe("cuda ops: swiglu", function()
  for _, dt in ipairs({ "float32", "float64", "bfloat16" }) do
    it("forward and backward (" .. dt .. ")", H.scoped(function()
      for k, shape in ipairs({ { 7, 33 }, { 4096, 1536 }, { 1, 1 } }) do
        local a, b, dy = H.randn(shape, k, dt, 3), H.randn(shape, 10 + k, dt), H.randn(shape, 20 + k, dt)
        local what = ("swiglu %s %s"):format(table.concat(shape, "x"), dt)
        local r = ref(what, 1, function(o) return C.tt_op_swiglu(f64(a)._c, f64(b)._c, o) end)
        local y = poison(shape, dt)
        run(what, { y }, function(o) return C.tt_op_swiglu(dev(a)._c, dev(b)._c, o) end)
        H.check(y, r, H.tol(dt), what)
        local rda, rdb = ref(what .. " backward", 2, function(o1, o2)
          return C.tt_op_swiglu_backward(f64(a)._c, f64(b)._c, f64(dy)._c, o1, o2)
        end)
        local da, db = poison(shape, dt), poison(shape, dt)
        run(what .. " backward", { da, db }, function(o1, o2)
          return C.tt_op_swiglu_backward(dev(a)._c, dev(b)._c, dev(dy)._c, o1, o2)
        end)
        H.check(da, rda, H.tol(dt, 2), what .. " da")
        H.check(db, rdb, H.tol(dt, 2), what .. " db")
      end
    end))
  end
end)

describe("cuda ops: cross-entropy", function()
  for _, dt in ipairs({ "float32", "float64", "bfloat16" }) do
    it("forward (losses, lse, count) and backward with ignore_index, V = 2048 and 32000 (" .. dt .. ")",
      H.scoped(function()
        for k, nv in ipairs({ { 64, 2048 }, { 32, 32000 }, { 3, 5 } }) do
          local N, V = nv[1], nv[2]
          local logits = H.randn({ N, V }, k, dt, 3)
          local tl = H.ids({ N }, V, 10 + k):tolist_flat()
          for i = 1, N, 5 do tl[i] = -100 end -- every fifth target ignored
          for _, idt in ipairs({ "int64", "int32" }) do
            local targets = titan.tensor(tl, { dtype = idt })
            local what = ("cross_entropy N%d V%d %s %s"):format(N, V, idt, dt)
            local n_ref, n_got = ffi.new("int64_t[1]"), ffi.new("int64_t[1]", -1)
            local rl, rlse = ref(what, 2, function(o1, o2)
              return C.tt_op_cross_entropy(f64(logits)._c, targets._c, -100, o1, o2, n_ref)
            end)
            local losses, lse = poison({ N }, dt), poison({ N }, stat_dtype(dt))
            run(what, { losses, lse }, function(o1, o2)
              return C.tt_op_cross_entropy(dev(logits)._c, dev(targets)._c, -100, o1, o2, n_got)
            end)
            assert(n_got[0] == n_ref[0], ("%s: num_valid %d, CPU %d"):format(what, tonumber(n_got[0]), tonumber(n_ref[0])))
            H.check(losses, rl, H.tol(dt, dt == "float32" and 2 or 1), what .. " losses")
            H.check(lse, rlse, H.tol(stat_dtype(dt), 2), what .. " lse")
            local dl = H.randn({ N }, 30 + k, dt, 1 / N)
            local rd = ref(what .. " backward", 1, function(o)
              return C.tt_op_cross_entropy_backward(f64(logits)._c, targets._c, rlse._c, f64(dl)._c, -100, o)
            end)
            local dlogits = poison({ N, V }, dt)
            run(what .. " backward", { dlogits }, function(o)
              return C.tt_op_cross_entropy_backward(dev(logits)._c, dev(targets)._c, lse._c, dev(dl)._c, -100, o)
            end)
            H.check(dlogits, rd, H.tol(dt, 2), what .. " dlogits")
            -- ignored rows must be exactly zero
            local g = dlogits:to("cpu"):to("float64")
            for i = 1, N, 5 do
              local row = g:narrow(1, i, 1)
              local nrm = titan.norm(row):item()
              assert(nrm == 0, ("%s: ignored row %d has gradient norm %g"):format(what, i - 1, nrm))
            end
          end
        end
      end))
  end
end)

describe("cuda ops: swiglu's, cross-entropy's and rope's plans (TITAN_CUDA_{SWIGLU,CE,ROPE}_PLAN)", function()
  -- bf16 tensors of whole 16-byte chunks take the lean kernels (the hardware's exp2, reciprocal and bf16
  -- rounding: the reference within bf16's tolerance, kernels/cuda/lean.cuh); =exact gives them the
  -- kernels that compute as the CPU does. The specs above run the default; these run both plans.
  local BF = "bfloat16"

  -- x [B, T, H, D], forward and inverse, at a position offset, in place too; the tables f32 on the device
  local function rope_case(sh, seed, v)
    local D = sh[4]
    local c, s = box(), box()
    ok(C.tt_op_rope_table(D, 64, 500000, 8, 1, 4, 8192, C.TT_F32, c, s), "rope_table")
    local cos, sin = take(c), take(s)
    local dcos, dsin = dev(cos), dev(sin)
    local x = H.randn(sh, seed, BF)
    for _, inv in ipairs({ 0, 1 }) do
      local what = ("rope %s offset 3 inverse %d bf16, %s"):format(table.concat(sh, "x"), inv, v)
      local r = ref(what, 1, function(o) return C.tt_op_rope(f64(x)._c, f64(cos)._c, f64(sin)._c, 3, inv, o) end)
      local out, xi = poison(sh, BF), dev(x)
      with_env("TITAN_CUDA_ROPE_PLAN", v, function()
        run(what, { out }, function(o) return C.tt_op_rope(dev(x)._c, dcos._c, dsin._c, 3, inv, o) end)
        run(what .. " in place", { xi }, function(o) return C.tt_op_rope(xi._c, dcos._c, dsin._c, 3, inv, o) end)
      end)
      H.check(out, r, H.tol(BF), what)
      H.check_exact(xi, out, what .. " in place")
    end
  end

  local function swiglu_case(shape, seed, v)
    local a, b = H.randn(shape, seed, BF, 3), H.randn(shape, seed + 1, BF)
    local dy = H.randn(shape, seed + 2, BF)
    local what = ("swiglu %s bf16, %s"):format(table.concat(shape, "x"), v)
    local r = ref(what, 1, function(o) return C.tt_op_swiglu(f64(a)._c, f64(b)._c, o) end)
    local rda, rdb = ref(what .. " backward", 2, function(o1, o2)
      return C.tt_op_swiglu_backward(f64(a)._c, f64(b)._c, f64(dy)._c, o1, o2)
    end)
    local y, da, db = poison(shape, BF), poison(shape, BF), poison(shape, BF)
    local ad, bd = dev(a), dev(b)
    with_env("TITAN_CUDA_SWIGLU_PLAN", v, function()
      run(what, { y }, function(o) return C.tt_op_swiglu(ad._c, bd._c, o) end)
      run(what .. " backward", { da, db }, function(o1, o2)
        return C.tt_op_swiglu_backward(ad._c, bd._c, dev(dy)._c, o1, o2)
      end)
      run(what .. " in place", { ad }, function(o) return C.tt_op_swiglu(ad._c, bd._c, o) end)
    end)
    H.check(y, r, H.tol(BF), what)
    H.check(da, rda, H.tol(BF, 2), what .. " da")
    H.check(db, rdb, H.tol(BF, 2), what .. " db")
    H.check_exact(ad, y, what .. " in place")
  end

  -- every fifth target ignored; the backward also in place (dlogits over the logits)
  local function ce_case(N, V, seed, v)
    local logits = H.randn({ N, V }, seed, BF, 3)
    local tl = H.ids({ N }, V, seed + 1):tolist_flat()
    for i = 1, N, 5 do tl[i] = -100 end
    local targets = titan.tensor(tl, { dtype = "int64" })
    local what = ("cross_entropy N%d V%d bf16, %s"):format(N, V, v)
    local n = ffi.new("int64_t[1]")
    local rl, rlse = ref(what, 2, function(o1, o2)
      return C.tt_op_cross_entropy(f64(logits)._c, targets._c, -100, o1, o2, n)
    end)
    local dl = H.randn({ N }, seed + 2, BF, 1 / N)
    local rd = ref(what .. " backward", 1, function(o)
      return C.tt_op_cross_entropy_backward(f64(logits)._c, targets._c, rlse._c, f64(dl)._c, -100, o)
    end)
    local losses, lse, dlogits = poison({ N }, BF), poison({ N }, "float32"), poison({ N, V }, BF)
    local ld, td, dld = dev(logits), dev(targets), dev(dl)
    with_env("TITAN_CUDA_CE_PLAN", v, function()
      run(what, { losses, lse }, function(o1, o2) return C.tt_op_cross_entropy(ld._c, td._c, -100, o1, o2, n) end)
      run(what .. " backward", { dlogits }, function(o)
        return C.tt_op_cross_entropy_backward(ld._c, td._c, lse._c, dld._c, -100, o)
      end)
      run(what .. " backward in place", { ld }, function(o)
        return C.tt_op_cross_entropy_backward(ld._c, td._c, lse._c, dld._c, -100, o)
      end)
    end)
    H.check(losses, rl, H.tol(BF), what .. " losses")
    H.check(lse, rlse, H.tol("float32", 2), what .. " lse")
    H.check(dlogits, rd, H.tol(BF, 2), what .. " dlogits")
    H.check_exact(ld, dlogits, what .. " backward in place")
  end

  for _, v in ipairs({ "lean", "exact" }) do
    it(v .. ": swiglu forward, backward and in place within bf16's tolerance; a ragged tail (n % 8) too",
      H.scoped(function()
        for k, shape in ipairs({ { 64, 1024 }, { 7, 33 }, { 3, 8 }, { 1, 5 } }) do
          swiglu_case(shape, 600 + 10 * k, v)
        end
      end))
    it(v .. ": cross-entropy forward and backward (in place too) within tolerance, a 128k vocabulary too",
      H.scoped(function()
        -- 2056: 257 chunks, so one lane's second load runs past the row; 1000: the warp kernel
        for k, nv in ipairs({ { 6, 2056 }, { 11, 32000 }, { 2, 128256 }, { 4, 1000 } }) do
          ce_case(nv[1], nv[2], 700 + 10 * k, v)
        end
      end))
    it(v .. ": rope forward and inverse (in place too) within bf16's tolerance; head dims of 1, 2 and 16 chunks",
      H.scoped(function()
        -- 12: not whole chunks (the exact kernel either way)
        for k, sh in ipairs({ { 2, 9, 3, 8 }, { 1, 5, 4, 16 }, { 1, 3, 2, 128 }, { 2, 4, 3, 12 } }) do
          rope_case(sh, 900 + k, v)
        end
      end))
  end

  it("NaN and infinities: the lean kernels give them where the exact ones do", H.scoped(function()
    -- swiglu: a NaN, +inf and -inf in a, a NaN in b
    local n = 4 * 1024
    local as, bs = H.randn({ n }, 800, BF, 3):tolist_flat(), H.randn({ n }, 801, BF):tolist_flat()
    as[5], as[1000], as[2001], bs[3001] = 0 / 0, 1 / 0, -1 / 0, 0 / 0
    local a, b = dev(titan.tensor(as, { dtype = BF })), dev(titan.tensor(bs, { dtype = BF }))
    local dy = dev(H.randn({ n }, 802, BF))
    -- cross-entropy: a row with a NaN, one with +inf, one all -inf, one with a few -inf (finite)
    local N, V = 4, 2048
    local ls = H.randn({ N, V }, 803, BF, 3):tolist_flat()
    ls[17] = 0 / 0
    ls[V + 300] = 1 / 0
    for i = 2 * V + 1, 3 * V do ls[i] = -1 / 0 end
    ls[3 * V + 1], ls[3 * V + 999], ls[4 * V] = -1 / 0, -1 / 0, -1 / 0
    local logits = dev(titan.tensor(ls, { dtype = BF }):view({ N, V }))
    local targets = dev(titan.tensor({ 3, 7, 11, 2000 }, { dtype = "int64" }))
    local dl = dev(titan.full({ N }, 0.25, { dtype = BF }))
    local out = {}
    for _, v in ipairs({ "lean", "exact" }) do
      local o = { y = poison({ n }, BF), da = poison({ n }, BF), db = poison({ n }, BF), losses = poison({ N }, BF),
        lse = poison({ N }, "float32"), dlogits = poison({ N, V }, BF) }
      local cnt = ffi.new("int64_t[1]")
      with_env("TITAN_CUDA_SWIGLU_PLAN", v, function()
        run("swiglu with NaN and inf, " .. v, { o.y }, function(o1) return C.tt_op_swiglu(a._c, b._c, o1) end)
        run("swiglu backward with NaN and inf, " .. v, { o.da, o.db }, function(o1, o2)
          return C.tt_op_swiglu_backward(a._c, b._c, dy._c, o1, o2)
        end)
      end)
      with_env("TITAN_CUDA_CE_PLAN", v, function()
        run("cross_entropy with NaN and inf, " .. v, { o.losses, o.lse }, function(o1, o2)
          return C.tt_op_cross_entropy(logits._c, targets._c, -100, o1, o2, cnt)
        end)
        run("cross_entropy backward with NaN and inf, " .. v, { o.dlogits }, function(o1)
          return C.tt_op_cross_entropy_backward(logits._c, targets._c, o.lse._c, dl._c, -100, o1)
        end)
      end)
      out[v] = o
    end
    for _, name in ipairs({ "y", "da", "db", "losses", "lse", "dlogits" }) do
      same_nonfinite(out.lean[name], out.exact[name], name, H.tol(BF, 4))
    end
    -- the row with a few -inf is finite
    local lse = out.lean.lse:to("float64"):tolist_flat()
    assert(lse[4] == lse[4] and math.abs(lse[4]) ~= math.huge, "a row with some -inf logits: lse " .. lse[4])
    -- logits near bf16's largest: x - m never overflows (m log2 e would), so lse is the max, finite
    local big = titan.zeros({ 1, V }, { dtype = BF })
    big:narrow(2, 5, 1):fill_(3e38)
    big:narrow(2, 9, 1):fill_(-3e38)
    for _, v in ipairs({ "lean", "exact" }) do
      local l2, s2 = poison({ 1 }, BF), poison({ 1 }, "float32")
      local cnt = ffi.new("int64_t[1]")
      with_env("TITAN_CUDA_CE_PLAN", v, function()
        run("cross_entropy near bf16's largest, " .. v, { l2, s2 }, function(o1, o2)
          return C.tt_op_cross_entropy(dev(big)._c, dev(titan.tensor({ 4 }, { dtype = "int64" }))._c, -100, o1, o2, cnt)
        end)
      end)
      local got, want = s2:to("float64"):item(), big:narrow(2, 5, 1):to("float64"):item()
      assert(math.abs(got - want) <= 1e-6 * want, ("%s: lse %s, expected the max %s"):format(v, got, want))
    end
  end))

  local on_gpu = H.ON_GPU and it or pending
  on_gpu("any other value: the op fails with one line naming the setting and the choices", H.scoped(function()
    local x, t = dev(H.randn({ 2, 2048 }, 1, BF)), dev(titan.tensor({ 1, 2 }, { dtype = "int64" }))
    local x4 = x:view({ 1, 2, 16, 128 })
    local c, s = box(), box()
    ok(C.tt_op_rope_table(128, 2, 500000, 8, 1, 4, 8192, C.TT_F32, c, s), "rope_table")
    local cos, sin = dev(take(c)), dev(take(s))
    local cnt = ffi.new("int64_t[1]")
    local cases = {
      { "TITAN_CUDA_SWIGLU_PLAN", function() return C.tt_op_swiglu(x._c, x._c, box()) end },
      { "TITAN_CUDA_CE_PLAN", function() return C.tt_op_cross_entropy(x._c, t._c, -100, box(), box(), cnt) end },
      { "TITAN_CUDA_ROPE_PLAN", function() return C.tt_op_rope(x4._c, cos._c, sin._c, 0, 0, box()) end },
    }
    for _, c in ipairs(cases) do
      for _, bad in ipairs({ "1", "fast" }) do
        local st, msg
        with_env(c[1], bad, function()
          st = c[2]()
          msg = ffi.string(C.tt_last_error())
        end)
        assert.are_not.equal(0, st, c[1] .. "=" .. bad .. ": the op went ahead")
        assert.truthy(msg:find(("%s=%s: expected lean or exact"):format(c[1], bad), 1, true), msg)
      end
      ok(c[2](), c[1] .. " unset")
    end
  end))
end)

describe("cuda ops: adamw", function()
  local function adamw_case(pdt, gdt, with_master)
    return H.scoped(function()
      local n = 100003
      local p0 = H.randn({ n }, 1, pdt)
      local master0 = with_master and p0:to("float32") or nil
      local sides = {}
      for _, where in ipairs({ "cpu", H.DEV }) do
        local s = {
          p = p0:to(where):clone(), m = titan.zeros({ n }, { device = where }), v = titan.zeros({ n }, { device = where }),
          master = master0 and master0:to(where):clone() or nil,
        }
        for step = 1, 3 do
          local g = H.randn({ n }, 100 + step, gdt):to(where)
          ok(C.tt_op_adamw(s.p._c, g._c, s.m._c, s.v._c, s.master and s.master._c or nil, 1e-3, 0.9, 0.95, 1e-8, 0.1, step),
            ("adamw %s param %s grad %s"):format(where, pdt, gdt))
        end
        sides[#sides + 1] = s
      end
      local r, g = sides[1], sides[2]
      local what = ("adamw param %s grad %s%s"):format(pdt, gdt, with_master and " + f32 master" or "")
      H.check(g.m, r.m, 1e-6, what .. " exp_avg")
      H.check(g.v, r.v, 1e-6, what .. " exp_avg_sq")
      if with_master then H.check(g.master, r.master, 1e-6, what .. " master") end
      H.check(g.p, r.p, pdt == "bfloat16" and 4e-3 or 1e-6, what .. " param")
      if with_master then -- the bf16 param is the rounded master
        H.check_exact(g.p, g.master:to("bfloat16"), what .. " param = bf16(master)")
      end
    end)
  end
  it("f32 params, f32 grads", adamw_case("float32", "float32", false))
  it("f32 params, bf16 grads", adamw_case("float32", "bfloat16", false))
  it("bf16 params with an f32 master copy, bf16 grads", adamw_case("bfloat16", "bfloat16", true))

  -- 150 gradients: 130 f32 (three launches, of 64, 64 and 2), then 20 bf16,
  -- misaligned views among them (on both sides): the bits of mul_ / fill_
  -- per tensor.
  it("scale_multi and fill_multi equal mul_ and fill_ per tensor, bit for bit", H.scoped(function()
    local one, many = {}, {}
    for i = 1, 150 do
      -- (bf16 only on the GPU: the CPU harness has no bf16 scale)
      local n, dt = 1 + (i * 131) % 9000, H.ON_GPU and i > 130 and "bfloat16" or "float32"
      local function make()
        local base = H.randn({ n + 1 }, 900 + i, dt):to(H.DEV)
        return i % 5 == 0 and base:narrow(1, 2, n) or base:narrow(1, 1, n):contiguous()
      end
      one[i], many[i] = make(), make()
    end
    for _, t in ipairs(one) do t:mul_(0.731) end
    titan.ops.scale_multi_(many, 0.731)
    for i = 1, #one do H.check_exact(many[i], one[i], "scale_multi tensor " .. i) end
    titan.ops.fill_multi_(many, 0)
    for i = 1, #one do
      one[i]:fill_(0)
      H.check_exact(many[i], one[i], "fill_multi tensor " .. i)
    end
  end))

  -- 45 tensors: 40 f32 (two launches, of 32 and 8), then 5 bf16 + master,
  -- sizes from 1 to 70001, misaligned views among them (no vector access),
  -- different step counts: the multi-tensor update gives exactly the
  -- single-tensor update's bits on the device.
  it("adamw_multi equals adamw per tensor, bit for bit", H.scoped(function()
    local sizes, specs = { 1, 3, 4, 5, 17, 256, 1023, 4096, 70001 }, {}
    for i = 1, 45 do
      local n = sizes[(i - 1) % #sizes + 1]
      specs[i] = { n = n, pdt = i > 40 and "bfloat16" or "float32", skew = i % 4 == 1, step = 1 + i % 3 }
    end
    local function make(where)
      local out = {}
      for i, sp in ipairs(specs) do
        local base = H.randn({ sp.n + 1 }, 500 + i, sp.pdt):to(where)
        local p = sp.skew and base:narrow(1, 2, sp.n) or base:narrow(1, 1, sp.n):contiguous()
        local e = { p = p, g = H.randn({ sp.n }, 600 + i, sp.pdt):to(where), m = H.randn({ sp.n }, 700 + i, "float32"):to(where),
          v = H.positive({ sp.n }, 800 + i, "float32"):to(where) }
        if sp.pdt == "bfloat16" then e.master = p:to("float32") end
        out[i] = e
      end
      return out
    end
    local single, multi = make(H.DEV), make(H.DEV)
    for i, e in ipairs(single) do
      ok(C.tt_op_adamw(e.p._c, e.g._c, e.m._c, e.v._c, e.master and e.master._c or nil, 1e-3, 0.9, 0.95, 1e-8, 0.1,
        specs[i].step), "adamw tensor " .. i)
    end
    local entries = {}
    for i, e in ipairs(multi) do entries[i] = { e.p, e.g, e.m, e.v, e.master, specs[i].step } end
    titan.ops.adamw_multi_(entries, { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 })
    H.sync()
    for i = 1, #specs do
      local what = ("adamw_multi tensor %d (n %d, %s%s)"):format(i, specs[i].n, specs[i].pdt, specs[i].skew and ", misaligned" or "")
      H.check_exact(multi[i].p, single[i].p, what .. " param")
      H.check_exact(multi[i].m, single[i].m, what .. " exp_avg")
      H.check_exact(multi[i].v, single[i].v, what .. " exp_avg_sq")
      if multi[i].master then H.check_exact(multi[i].master, single[i].master, what .. " master") end
    end
  end))

  -- The update a CUDA graph captures (graph_step): the norm and clip
  -- coefficient computed on the device, the step's scalars read from device
  -- memory, the grads scaled inside the update. Same bits as the eager
  -- update (global_norm, scale_multi, adamw_multi), for f32 params and bf16
  -- params with masters and bf16 grads (the mixed-precision step), with
  -- different step counts and misaligned views; the grads stay unscaled.
  it("the device-scalar update equals global_norm + scale_multi + adamw_multi, bit for bit", H.scoped(function()
    local sizes, specs = { 1, 5, 256, 1023, 70001 }, {}
    for i = 1, 40 do
      local bf = H.ON_GPU and i > 34
      specs[i] = { n = sizes[(i - 1) % #sizes + 1], pdt = bf and "bfloat16" or "float32", skew = i % 4 == 1,
        step = 2 + i % 3 }
    end
    local function make()
      local out = {}
      for i, sp in ipairs(specs) do
        local base = H.randn({ sp.n + 1 }, 1500 + i, sp.pdt):to(H.DEV)
        local p = sp.skew and base:narrow(1, 2, sp.n) or base:narrow(1, 1, sp.n):contiguous()
        local e = { p = p, g = H.randn({ sp.n }, 1600 + i, sp.pdt):to(H.DEV),
          m = H.randn({ sp.n }, 1700 + i, "float32"):to(H.DEV), v = H.positive({ sp.n }, 1800 + i, "float32"):to(H.DEV) }
        if sp.pdt == "bfloat16" then e.master = p:to("float32") end
        out[i] = e
      end
      return out
    end
    local hp = { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }
    for _, max_norm in ipairs({ 1.0, 1e9 }) do -- clipping, and not
      local eager, dev = make(), make()
      local eg, dg, entries_e, entries_d = {}, {}, {}, {}
      for i = 1, #specs do
        eg[i], dg[i] = eager[i].g, dev[i].g
        entries_e[i] = { eager[i].p, eager[i].g, eager[i].m, eager[i].v, eager[i].master, specs[i].step }
        entries_d[i] = { dev[i].p, dev[i].g, dev[i].m, dev[i].v, dev[i].master, specs[i].step }
      end
      local norm = titan.ops.global_norm(eg)
      if norm > max_norm then titan.ops.scale_multi_(eg, max_norm / (norm + 1e-6)) end
      -- one call per dtype run, as the optimizer's batches would be
      titan.ops.adamw_multi_(entries_e, hp)
      local nc = titan.zeros({ 2 }, { dtype = "float64" }):to(H.DEV)
      titan.ops.global_norm_dev_(dg, max_norm, nc)
      local scal = titan.ops.adamw_scalars(entries_d, hp):to(H.DEV)
      titan.ops.adamw_multi_dev_(entries_d, hp, scal, max_norm < 1e9 and nc or nil)
      H.sync()
      local got = nc:to("cpu"):tolist()
      assert.are.equal(norm, got[1], "norm")
      assert.are.equal(norm > max_norm and max_norm / (norm + 1e-6) or 1, got[2], "clip coefficient")
      for i = 1, #specs do
        local what = ("max_norm %g, tensor %d (n %d, %s%s)"):format(max_norm, i, specs[i].n, specs[i].pdt,
          specs[i].skew and ", misaligned" or "")
        H.check_exact(dev[i].p, eager[i].p, what .. " param")
        H.check_exact(dev[i].m, eager[i].m, what .. " exp_avg")
        H.check_exact(dev[i].v, eager[i].v, what .. " exp_avg_sq")
        if dev[i].master then H.check_exact(dev[i].master, eager[i].master, what .. " master") end
      end
      local fresh = make()
      for i = 1, #specs do H.check_exact(dev[i].g, fresh[i].g, "grad " .. i .. " left unscaled") end
    end
    -- a NaN or inf norm (a NaN gradient under a finite loss): the kernels write nothing at all
    for _, bad in ipairs({ 0 / 0, math.huge }) do
      local dev, fresh = make(), make()
      local entries = {}
      for i = 1, #specs do entries[i] = { dev[i].p, dev[i].g, dev[i].m, dev[i].v, dev[i].master, specs[i].step } end
      local nc = titan.tensor({ bad, 1 }, { dtype = "float64" }):to(H.DEV)
      titan.ops.adamw_multi_dev_(entries, hp, titan.ops.adamw_scalars(entries, hp):to(H.DEV), nc)
      H.sync()
      for i = 1, #specs do
        local what = ("norm %s, tensor %d"):format(tostring(bad), i)
        H.check_exact(dev[i].p, fresh[i].p, what .. " param untouched")
        H.check_exact(dev[i].m, fresh[i].m, what .. " exp_avg untouched")
        H.check_exact(dev[i].v, fresh[i].v, what .. " exp_avg_sq untouched")
      end
    end
  end))
end)

describe("cuda ops: casts (copies with conversion, fp8 included)", function()
  local ALL = { "float32", "float64", "bfloat16", "float16", "int32", "int64", "uint8", "bool", "float8_e4m3fn",
    "float8_e5m2" }
  -- Values every float format must treat like the CPU: signed zeros,
  -- subnormals, rounding ties, overflow of the narrow formats, inf, NaN.
  local specials = { 0, -0.0, 1, -1, 0.5, 1 / 3, 1e-3, 1e-8, 6e-8, 2 ^ -126, 2 ^ -140, 65504, 65520, 70000, 448, 464,
    480, 500, 57344, 61440, 1e30, -1e30, 3.5, -2.5, 2.5, 0.0625, 1 + 2 ^ -8, 1 + 3 * 2 ^ -9, 255, 256, -129,
    math.huge, -math.huge, 0 / 0 }
  -- Integer destinations get integral in-range values only (C leaves the rest undefined).
  local ints = { 0, 1, -1, 2, 7, 100, 127, -128, 3, 42 }

  local function source(dt, into)
    local vals = {}
    if into == "int32" or into == "int64" or into == "uint8" or into == "bool" then
      for _, v in ipairs(ints) do
        if not (into == "uint8" and v < 0) and not ((dt == "uint8" or dt == "bool") and v < 0) then vals[#vals + 1] = v end
      end
      if dt == "bool" then vals = { 0, 1, 1, 0 } end
    elseif dt == "int32" or dt == "int64" or dt == "uint8" or dt == "bool" then
      vals = dt == "bool" and { 0, 1, 1, 0 } or { 0, 1, 2, 7, 100, 127, 3, 42, 255 }
      if dt == "int32" or dt == "int64" then vals[#vals + 1] = -129 end
    else
      for _, v in ipairs(specials) do vals[#vals + 1] = v end
      local r = H.randn({ 200 }, 7, "float64", 100):tolist_flat()
      for _, v in ipairs(r) do vals[#vals + 1] = v end
    end
    return titan.tensor(vals, { dtype = dt })
  end

  for _, src_dt in ipairs(ALL) do
    it("from " .. src_dt .. " to every dtype, on the device and across devices, strided too", H.scoped(function()
      for _, dst_dt in ipairs(ALL) do
        local s = source(src_dt, dst_dt)
        local n = s:numel()
        local what = ("cast %s -> %s"):format(src_dt, dst_dt)
        local want = titan.empty({ n }, { dtype = dst_dt })
        ok(C.tt_tensor_copy(want._c, s._c), what .. " (CPU)")
        -- device -> device
        local got = poison({ n }, dst_dt)
        ok(C.tt_tensor_copy(got._c, dev(s)._c), what)
        H.check_exact(got, want, what .. " on the device")
        -- host -> device and device -> host with the cast
        local got2 = poison({ n }, dst_dt)
        ok(C.tt_tensor_copy(got2._c, s._c), what .. " host->device")
        H.check_exact(got2, want, what .. " host->device")
        local back = titan.empty({ n }, { dtype = dst_dt })
        ok(C.tt_tensor_copy(back._c, dev(s)._c), what .. " device->host")
        H.check_exact(back, want, what .. " device->host")
      end
      -- strided source, contiguous destination (a transpose)
      local m = titan.rand({ 37, 29 }, { seed = 3, offset = 0 }):mul_(100):to(src_dt) -- [0, 100): valid for every dtype
      local want = m:t():contiguous()
      local got = poison({ 29, 37 }, m:dtype())
      ok(C.tt_tensor_copy(got._c, dev(m):t()._c), "strided copy " .. src_dt)
      H.check_exact(got, want, "strided copy " .. m:dtype())
    end))
  end
end)

describe("cuda ops: fill, arange, random numbers", function()
  it("fill and arange write every element", H.scoped(function()
    for _, dt in ipairs({ "float32", "float64", "bfloat16", "float16", "int32", "int64" }) do
      local t = poison({ 100003 }, dt)
      ok(C.tt_tensor_fill(t._c, 3), "fill " .. dt)
      H.check_exact(t, titan.full({ 100003 }, 3, { dtype = dt }), "fill " .. dt)
      local a = poison({ 1000 }, dt)
      ok(C.tt_tensor_arange(a._c, -7, 2), "arange " .. dt)
      local want = titan.empty({ 1000 }, { dtype = dt })
      ok(C.tt_tensor_arange(want._c, -7, 2), "arange (CPU) " .. dt)
      H.check_exact(a, want, "arange " .. dt)
    end
  end))

  for _, dt in ipairs({ "float32", "float64", "bfloat16" }) do
    it("uniform, normal and truncated normal give the CPU's numbers (" .. dt .. ")", H.scoped(function()
      for _, n in ipairs({ 1, 3, 1000003 }) do
        for _, off in ipairs({ 0, 7 }) do
          local what = ("%s n=%d offset=%d %s"):format("%s", n, off, dt)
          local u_cpu = titan.rand({ n }, { seed = 42, offset = off, dtype = dt })
          local u_dev = titan.rand({ n }, { seed = 42, offset = off, dtype = dt, device = H.DEV })
          H.check_exact(u_dev, u_cpu, what:format("uniform"))
          local z_cpu = titan.randn({ n }, { seed = 43, offset = off, dtype = dt })
          local z_dev = titan.randn({ n }, { seed = 43, offset = off, dtype = dt, device = H.DEV })
          -- Box-Muller in f64 on both sides: a last-ulp difference of log/cos may survive in f64 only
          H.check(z_dev, z_cpu, dt == "float64" and 1e-14 or 1e-7, what:format("normal"))
          local t_cpu = titan.trunc_normal({ n }, { seed = 44, offset = off, dtype = dt, std = 0.02 })
          local t_dev = titan.trunc_normal({ n }, { seed = 44, offset = off, dtype = dt, std = 0.02, device = H.DEV })
          H.check(t_dev, t_cpu, dt == "float64" and 1e-13 or 1e-7, what:format("trunc_normal"))
        end
      end
    end))
  end
end)

describe("cuda allocator", function()
  local dev_name = H.ON_GPU and "cuda:0" or "cpu"
  -- The garbage collector (a safety net that frees what failed tests leaked)
  -- must not move the counters while they are compared.
  before_each(function() collectgarbage("collect"); collectgarbage("stop") end)
  after_each(function() collectgarbage("restart") end)
  it("alloc/free round trip, peak, cache hits, empty_cache", function()
    local s0 = titan.memory_stats(dev_name)
    titan.reset_peak_memory(dev_name)
    local a = titan.empty({ 262144 }, { device = H.DEV }) -- 1 MiB of f32
    local b = titan.empty({ 786432 }, { device = H.DEV }) -- 3 MiB
    local s1 = titan.memory_stats(dev_name)
    assert(s1.allocated - s0.allocated >= 4194304, "allocated grew by " .. (s1.allocated - s0.allocated))
    assert(s1.peak_allocated >= s0.allocated + 4194304, "peak " .. s1.peak_allocated)
    assert(s1.num_allocs >= s0.num_allocs + 2, "num_allocs")
    assert(s1.reserved >= s1.allocated, "reserved >= allocated")
    a:free()
    b:free()
    local s2 = titan.memory_stats(dev_name)
    assert.are.equal(s0.allocated, s2.allocated)
    assert(s2.num_frees >= s0.num_frees + 2, "num_frees")
    assert(s2.peak_allocated >= s1.allocated, "peak survives the frees")
    local c = titan.empty({ 786432 }, { device = H.DEV }) -- the same size class: from the cache
    local s3 = titan.memory_stats(dev_name)
    assert(s3.num_cache_hits > s2.num_cache_hits, "a freed block of the same size is reused")
    c:free()
    titan.empty_cache(dev_name)
    local s4 = titan.memory_stats(dev_name)
    assert(s4.reserved <= s2.reserved, "empty_cache returns cached blocks")
    assert.are.equal(s0.allocated, s4.allocated)
    assert.are.equal(0, s4.num_ooms - s0.num_ooms)
  end)

  it("ops inside a scope return device memory and live tensors to the baseline", function()
    local x = H.randn({ 64, 256 }, 1, "float32")
    local w = H.randn({ 256 }, 2, "float32")
    local xd, wd = dev(x), dev(w)
    local function work()
      titan.scope(function()
        local y = titan.F.rms_norm(xd, wd)
        local z = titan.matmul(y, xd:t())
        return z:sum():item()
      end)
    end
    work()
    local base, live = titan.memory_stats(dev_name).allocated, titan.live_tensors()
    for _ = 1, 20 do work() end
    assert.are.equal(base, titan.memory_stats(dev_name).allocated)
    assert.are.equal(live, titan.live_tensors())
  end)
end)
