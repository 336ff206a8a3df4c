-- Float8 on the GPU against the CPU (engine/ops_float8.c, kernels/cuda/float8.cu, gemm.cu's fp8 GEMM,
-- lua/parallel/float8.lua): the tensorwise dynamic cast bit for bit (f32, bf16, f16 in; e4m3 and e5m2
-- out; a tensor of many blocks, whose largest magnitude the blocks agree on through the atomic max; a
-- NaN), the fp8 GEMM (cuBLASLt's scale pointers, f32 and bf16 out, accumulation, the e5m2 x e4m3
-- operands of the backward) against the CPU's widened f32 product, and the float8 Linear's forward and
-- backward against the CPU's. Outputs are poisoned first. Exits 77 without a GPU (helpers.lua).
package.path = "./tests/cuda/?.lua;" .. package.path
local H = require("helpers")
H.require_device()

local titan = require("titan")
local f8 = require("parallel.float8")
local tensor = require("titan.tensor")
local C = titan.C
local box, ok, take, dev = H.box, H.ok, H.take, H.dev

-- x cast on the device into poisoned outputs, and on the CPU
local function both_casts(x, fmt)
  local y, s = H.poison(x:shape(), fmt), H.poison({}, "float32")
  ok(C.tt_op_to_float8(dev(x)._c, tensor.dtype_of(fmt), nil, box(y), box(s)), "to_float8 " .. fmt)
  H.sync()
  local yr, sr = box(), box()
  ok(C.tt_op_to_float8(x:to("cpu")._c, tensor.dtype_of(fmt), nil, yr, sr), "to_float8 (CPU)")
  return y, s, take(yr), take(sr)
end

describe("cuda float8", function()
  for _, dt in ipairs({ "float32", "bfloat16", "float16" }) do
    for _, fmt in ipairs({ "float8_e4m3fn", "float8_e5m2" }) do
      it(("cast %s -> %s: the CPU's bits (one block, and 1000 of them)"):format(dt, fmt), H.scoped(function()
        for _, shape in ipairs({ { 7, 33 }, { 1000, 300 } }) do
          local x = H.randn(shape, shape[1] + 17, dt, 4)
          local y, s, yr, sr = both_casts(x, fmt)
          H.check_exact(s, sr, "scale_inv")
          H.check_exact(y, yr, "fp8 values")
        end
      end))
    end
  end

  it("float8_amax and a cast with a given amax (tensor parallelism's group max): the CPU's bits",
    H.scoped(function()
      local x = H.randn({ 300, 200 }, 9, "bfloat16", 2)
      local a, ar = H.poison({}, "float32"), box()
      ok(C.tt_op_float8_amax(dev(x)._c, box(a)), "float8_amax")
      ok(C.tt_op_float8_amax(x:to("cpu")._c, ar), "float8_amax (CPU)")
      H.sync()
      H.check_exact(a, take(ar), "amax")
      local given = titan.full({}, 3 * a:item())
      local y, s = H.poison(x:shape(), "float8_e5m2"), H.poison({}, "float32")
      ok(C.tt_op_to_float8(dev(x)._c, C.TT_F8E5M2, dev(given)._c, box(y), box(s)), "to_float8 with amax")
      local yr, sr = box(), box()
      ok(C.tt_op_to_float8(x:to("cpu")._c, C.TT_F8E5M2, given._c, yr, sr), "to_float8 with amax (CPU)")
      H.sync()
      H.check_exact(s, take(sr), "scale_inv")
      H.check_exact(y, take(yr), "fp8 values")
    end))

  it("a NaN anywhere makes the scale and every value NaN, as on the CPU", H.scoped(function()
    local x = H.randn({ 40, 70 }, 3, "float32")
    x:narrow(1, 33, 1):narrow(2, 5, 1):copy_(titan.full({ 1, 1 }, H.NAN))
    local y, s, yr, sr = both_casts(x, "float8_e4m3fn")
    H.check_exact(s, sr, "scale_inv")
    H.check_exact(y, yr, "fp8 values")
    assert.is_true(s:item() ~= s:item())
  end))

  -- a [M, K] (fmt_a) and b [N, K] (fmt_b) cast on the CPU, multiplied on both
  local function gemm_case(M, N, K, fmt_a, fmt_b, out_dt, tol)
    local a8, sa = f8.to_float8(H.randn({ M, K }, M + 1), fmt_a)
    local b8, sb = f8.to_float8(H.randn({ N, K }, N + 2, "float32", 0.5), fmt_b)
    local want = f8.matmul(a8, b8, sa, sb, "float32")
    local got = H.poison({ M, N }, out_dt)
    ok(C.tt_op_matmul_float8(dev(a8)._c, dev(b8)._c, dev(sa)._c, dev(sb)._c, tensor.dtype_of(out_dt), 0, 1,
      box(got)), "matmul_float8")
    H.sync()
    H.check(got, want, tol, ("fp8 GEMM %dx%dx%d %s x %s -> %s"):format(M, N, K, fmt_a, fmt_b, out_dt))
    -- accumulate (the weight gradient's beta = 1): onto values already there
    local base = H.randn({ M, N }, 99, "float32")
    local acc = dev(base)
    ok(C.tt_op_matmul_float8(dev(a8)._c, dev(b8)._c, dev(sa)._c, dev(sb)._c, C.TT_F32, 1, 0, box(acc)),
      "matmul_float8 accumulate")
    H.sync()
    H.check(acc, want + base, 1e-6, "accumulated")
  end

  it("fp8 GEMM: e4m3 x e4m3 (forward) to f32 and bf16", H.scoped(function()
    gemm_case(48, 64, 96, "float8_e4m3fn", "float8_e4m3fn", "float32", 1e-6)
    gemm_case(48, 64, 96, "float8_e4m3fn", "float8_e4m3fn", "bfloat16", 8e-3)
  end))

  it("fp8 GEMM: e5m2 x e4m3 (the gradients) and e4m3 x e5m2", H.scoped(function()
    gemm_case(32, 48, 64, "float8_e5m2", "float8_e4m3fn", "float32", 1e-6)
    gemm_case(16, 32, 48, "float8_e4m3fn", "float8_e5m2", "float32", 1e-6)
  end))

  it("fp8 GEMM refuses K or N that are not multiples of 16 on the device, in one line", H.scoped(function()
    local a8, sa = f8.to_float8(dev(H.randn({ 16, 24 }, 1)), "float8_e4m3fn")
    local b8, sb = f8.to_float8(dev(H.randn({ 16, 24 }, 2)), "float8_e4m3fn")
    local err = select(2, pcall(f8.matmul, a8, b8, sa, sb, "float32"))
    assert.truthy(tostring(err):find("matmul_float8: a [16, 24] and b [16, 24]; cuBLASLt's fp8 GEMMs need K and N "
      .. "multiples of 16", 1, true), tostring(err))
  end))

  it("the float8 Linear's forward and backward match the CPU's (f32 activations)", H.scoped(function()
    local function run(device)
      local x = H.randn({ 2, 16, 64 }, 5):to(device):requires_grad_()
      local w = H.randn({ 32, 64 }, 6, "float32", 0.05):to(device):requires_grad_()
      local g = H.randn({ 2, 16, 32 }, 7):to(device)
      local y = f8.linear(x, w)
      y:backward(g)
      return y:detach(), x.grad, w.grad
    end
    local y1, dx1, dw1 = run("cpu")
    local y2, dx2, dw2 = run(H.DEV)
    H.check(y2, y1, 1e-5, "forward")
    H.check(dx2, dx1, 1e-5, "dx")
    H.check(dw2, dw1, 1e-5, "dW")
  end))
end)
