-- The linear layer's fused bias (cuBLASLt's CUBLASLT_EPILOGUE_BIAS) and TF32
-- for f32 matmuls, on the device against the CPU reference: tt_op_linear
-- with POISONED preallocated outputs (helpers.lua), the reference being the
-- CPU op in float64 on exactly the values the device sees.
--
-- Without a GPU (or a CUDA build) the file exits 77 (ctest: skipped).
-- TITAN_GPU_SPEC_DEVICE=cpu runs it against the CPU: its f32/f64 cases must
-- pass there (the TF32 case then checks that the CPU ignores the switch).
package.path = "./tests/cuda/?.lua;" .. package.path
local H = require("helpers")
H.require_device()

local titan = require("titan")
local C = titan.C
local box, ok, take, poison, f64, dev = H.box, H.ok, H.take, H.poison, H.f64, H.dev

-- x @ w^T + bias on the CPU in float64 (bias may be nil).
local function ref(x, w, b)
  local o = box()
  ok(C.tt_op_linear(f64(x)._c, f64(w)._c, b and f64(b)._c or nil, o), "linear (CPU reference)")
  return take(o)
end

-- The same on the device into a poisoned output; xd/wd/bd are device tensors (or views).
local function run(xd, wd, bd, oshape, dt, what)
  local out = poison(oshape, dt)
  ok(C.tt_op_linear(xd._c, wd._c, bd and bd._c or nil, box(out)), what)
  H.sync()
  return out
end

local function out_shape(xshape, n)
  local s = { unpack(xshape) }
  s[#s] = n
  return s
end

local FLOATS = H.ON_GPU and H.FLOATS or { "float32", "float64" }

describe("cuda linear: bias fused into the GEMM", function()
  -- {rows, in, out}: odd sizes, a single element, a tall-skinny and Llama-like widths
  local shapes = { { 1, 1, 1 }, { 17, 33, 9 }, { 128, 256, 64 }, { 512, 1024, 768 }, { 2048, 64, 333 }, { 3, 4096, 5 } }
  for _, dt in ipairs(FLOATS) do
    it("2-D and 3-D x, transposed views, with and without a bias (" .. dt .. ")", H.scoped(function()
      for k, s in ipairs(shapes) do
        local M, K, N = s[1], s[2], s[3]
        local x, w, b = H.randn({ M, K }, 10 * k, dt), H.randn({ N, K }, 10 * k + 1, dt), H.randn({ N }, 10 * k + 2, dt)
        local what = ("linear %dx%dx%d %s"):format(M, K, N, dt)
        -- the plain product first: the same shape with a bias must not reuse its plan
        H.check(run(dev(x), dev(w), nil, { M, N }, dt, what .. " no bias"), ref(x, w), H.tol(dt), what .. " no bias")
        local r = ref(x, w, b)
        H.check(run(dev(x), dev(w), dev(b), { M, N }, dt, what), r, H.tol(dt), what)
        -- x and w as transposed views: the GEMM's trans flags flip, the bias stays per column
        local xt = dev(x):t():contiguous() -- [K, M] stored, read as its transpose
        local wt = dev(w):t():contiguous() -- [K, N] stored, read as its transpose
        H.check(run(xt:t(), wt:t(), dev(b), { M, N }, dt, what .. " views"), r, H.tol(dt),
          what .. " (transposed views)")
        -- a 3-D x: batches stacked into rows, one bias for all
        if M % 2 == 0 then
          local x3 = x:reshape(2, M / 2, K)
          H.check(run(dev(x3), dev(w), dev(b), { 2, M / 2, N }, dt, what .. " 3-D"), r:reshape(2, M / 2, N),
            H.tol(dt), what .. " 3-D x")
        end
      end
    end))

    it("strided and unaligned bias views, k = 0, and a non-viewable 3-D x (" .. dt .. ")", H.scoped(function()
      local x, w = H.randn({ 65, 40 }, 1, dt), H.randn({ 33, 40 }, 2, dt)
      local b2, b34 = H.randn({ 33, 2 }, 3, dt), H.randn({ 34 }, 4, dt)
      H.check(run(dev(x), dev(w), dev(b2):select(2, 2), { 65, 33 }, dt, "strided bias"), ref(x, w, b2:select(2, 2)),
        H.tol(dt), "strided bias " .. dt)
      H.check(run(dev(x), dev(w), dev(b34):narrow(1, 2, 33), { 65, 33 }, dt, "unaligned bias"),
        ref(x, w, b34:narrow(1, 2, 33)), H.tol(dt), "unaligned bias " .. dt)
      -- in = 0: out is the bias on every row (the GEMM adds nothing)
      local x0, w0, b0 = H.randn({ 7, 0 }, 5, dt), H.randn({ 9, 0 }, 6, dt), H.randn({ 9 }, 7, dt)
      H.check(run(dev(x0), dev(w0), dev(b0), { 7, 9 }, dt, "k = 0"), ref(x0, w0, b0), H.tol(dt), "k = 0 " .. dt)
      -- a permuted 3-D x cannot fold into rows as a view: packed first
      local xp, b33 = H.randn({ 40, 5, 13 }, 8, dt), H.randn({ 33 }, 9, dt)
      H.check(run(dev(xp):permute(2, 3, 1), dev(w), dev(b33), { 5, 13, 33 }, dt, "permuted x"),
        ref(xp:permute(2, 3, 1), w, b33), H.tol(dt), "permuted 3-D x " .. dt)
    end))
  end

  if H.ON_GPU then
    for _, dt in ipairs({ "bfloat16", "float16" }) do
      it("an f32 bias on a " .. dt .. " layer (rounded to " .. dt .. " for the epilogue)", H.scoped(function()
        local x, w = H.randn({ 300, 128 }, 1, dt), H.randn({ 96, 128 }, 2, dt)
        local b = H.randn({ 96 }, 3, "float32") -- f32 draws: most are not representable in 16 bits
        local out = run(dev(x), dev(w), dev(b), { 300, 96 }, dt, "f32 bias on " .. dt)
        H.check(out, ref(x, w, b), H.tol(dt), "f32 bias on " .. dt)
      end))
    end
  end
end)

describe("cuda matmul: TF32 for f32", function()
  -- One f32 product three times: TF32 off, on, off again (the plan cache
  -- must key on the switch, or "on" would replay the exact plan).
  local function product(x, w)
    local out = poison({ x:size(1), w:size(1) }, "float32")
    ok(C.tt_op_matmul(dev(x)._c, dev(w)._c, 0, 1, 1, 0, box(out)), "matmul f32")
    H.sync()
    return out
  end
  local function with_tf32(on, fn)
    titan.set_allow_tf32(on)
    local okk, r = pcall(fn)
    titan.set_allow_tf32(false)
    if not okk then error(r, 0) end
    return r
  end

  it("on: within TF32's ~1e-3 of the exact product and different from it; off: exact f32", H.scoped(function()
    assert.is_false(titan.allow_tf32())
    local x, w = H.randn({ 512, 1024 }, 1, "float32"), H.randn({ 384, 1024 }, 2, "float32")
    local r = ref(x, w)
    local exact = product(x, w)
    H.check(exact, r, H.tol("float32"), "f32, TF32 off")
    local fast = with_tf32(true, function()
      assert.is_true(titan.allow_tf32())
      return product(x, w)
    end)
    -- TF32 keeps 10 of 23 mantissa bits: ~5e-4 normwise here (2e-3: room for
    -- kernels that truncate instead of rounding)
    H.check(fast, r, 2e-3, "f32, TF32 on")
    local s = H.stats(fast, r)
    if H.ON_GPU then
      -- random f32 inputs carry 23 mantissa bits; TF32 keeps 10: the error is
      -- far above f32's rounding (~1e-7)
      assert(s.rel > 2e-5, ("TF32 on: relative error %.3g looks exact; was TF32 used?"):format(s.rel))
    else
      H.check_exact(fast, exact, "the CPU ignores TF32")
    end
    H.check(product(x, w), r, H.tol("float32"), "f32, TF32 off again")
    -- inputs TF32 represents exactly (bf16-rounded values: 7 mantissa bits)
    -- give the exact product with the switch on too
    local xb, wb = x:to("bfloat16"):to("float32"), w:to("bfloat16"):to("float32")
    local rb = ref(xb, wb)
    H.check(with_tf32(true, function() return product(xb, wb) end), rb, H.tol("float32"), "TF32 on, representable")
  end))

  it("does not touch bf16 or f64 products", H.scoped(function()
    for _, dt in ipairs(H.ON_GPU and { "bfloat16", "float64" } or { "float64" }) do
      local x, w = H.randn({ 64, 256 }, 3, dt), H.randn({ 48, 256 }, 4, dt)
      local off = run(dev(x), dev(w), nil, { 64, 48 }, dt, "linear " .. dt)
      local on = with_tf32(true, function() return run(dev(x), dev(w), nil, { 64, 48 }, dt, "linear " .. dt) end)
      H.check_exact(on, off, "TF32 switch on a " .. dt .. " product")
    end
  end))
end)

describe("cuda matmul: autotuning (training.gemm_autotune)", function()
  -- cuemu ranks three candidate algorithms per shape and counts the cuBLASLt matmuls that ran, and
  -- of them those with a candidate other than the heuristic's first (its events time nothing, so
  -- the first wins every tie). On a GPU the counts are not there: the products are checked against
  -- the reference, which is what any candidate must give.
  local ffi = require("ffi")
  pcall(ffi.cdef, "void tt_emu_matmul_counts(uint64_t *all, uint64_t *other);")
  local counted = H.ON_GPU and pcall(function() return ffi.C.tt_emu_matmul_counts end)
  local function counts()
    if not counted then return nil end
    local all, other = ffi.new("uint64_t[1]"), ffi.new("uint64_t[1]")
    ffi.C.tt_emu_matmul_counts(all, other)
    return { tonumber(all[0]), tonumber(other[0]) }
  end
  -- The matmuls (and non-first candidates) that ran since `before`.
  local function since(before, want, what)
    if not before then return end
    local now = counts()
    assert.are.same(want, { now[1] - before[1], now[2] - before[2] }, what)
  end
  local function with_tune(fn)
    titan.set_gemm_autotune(true)
    local fine, err = pcall(fn)
    titan.set_gemm_autotune(false)
    titan.set_deterministic(false)
    if not fine then error(err, 0) end
  end
  local DT = H.ON_GPU and "bfloat16" or "float32"
  -- out = x @ w^T (+ acc's values when acc: beta = 1), on the device
  local function product(x, w, acc)
    local out = acc and dev(acc) or poison({ x:size(1), w:size(1) }, DT)
    ok(C.tt_op_matmul(dev(x)._c, dev(w)._c, 0, 1, 1, acc and 1 or 0, box(out)), "matmul " .. DT)
    H.sync()
    return out
  end
  -- Candidates 3 x (a warm-up + 2 rounds of 3 timed runs) + the call itself; the other two candidates' 14.
  -- (3 runs: the fewest; a GPU takes as many as fill about 20 ms, timed on the warm-up, which cuemu's
  -- events give as 0 ms.)
  local TUNED = { 22, 14 }

  it("the first GEMM of a shape that overwrites its output times the candidates; later ones run once",
    H.scoped(function()
      local x, w = H.randn({ 72, 40 }, 11, DT), H.randn({ 56, 40 }, 12, DT)
      local plain = product(x, w)
      with_tune(function()
        local c0 = counts()
        local first = product(x, w)
        since(c0, TUNED, "the first tuned call")
        local c1 = counts()
        local again = product(x, w)
        since(c1, { 1, 0 }, "the second call: the kept algorithm")
        H.check(first, ref(x, w), H.tol(DT), "tuned product")
        H.check_exact(again, first, "the same algorithm again")
        if counted then H.check_exact(first, plain, "the heuristic's algorithm won the tie") end
      end)
    end))

  it("a GEMM that accumulates (beta = 1) runs once, adding once; the next one that overwrites tunes",
    H.scoped(function()
      local x, w, acc = H.randn({ 40, 24 }, 13, DT), H.randn({ 32, 24 }, 14, DT), H.randn({ 40, 32 }, 15, DT)
      with_tune(function()
        local c0 = counts()
        local summed = product(x, w, acc)
        since(c0, { 1, 0 }, "beta = 1: not timed (trial runs would add up)")
        H.check(summed, ref(x, w) + f64(acc), H.tol(DT, 2), "accumulated once")
        local c1 = counts()
        product(x, w)
        since(c1, TUNED, "the first overwriting call of the shape")
      end)
    end))

  it("deterministic mode turns it off: one run, the heuristic's algorithm", H.scoped(function()
    local x, w = H.randn({ 24, 16 }, 16, DT), H.randn({ 8, 16 }, 17, DT)
    with_tune(function()
      titan.set_deterministic(true)
      local c0 = counts()
      product(x, w)
      since(c0, { 1, 0 }, "deterministic")
    end)
  end))

  it("inside a graph capture nothing is timed (the capture cannot wait); the replay is right", H.scoped(function()
    if not H.ON_GPU then return end -- (graphs are CUDA's)
    local cuda_graph = require("titan.cuda_graph")
    local x = titan.keep(dev(H.randn({ 48, 32 }, 18, DT)))
    local w = titan.keep(dev(H.randn({ 16, 32 }, 19, DT)))
    with_tune(function()
      -- once eagerly first, as a capture wants (kernels loaded, the plan made), accumulating: not timed
      local c0 = counts()
      product(H.randn({ 48, 32 }, 20, DT), H.randn({ 16, 32 }, 21, DT), H.randn({ 48, 16 }, 22, DT))
      since(c0, { 1, 0 }, "eager, beta = 1")
      local c1 = counts()
      local g, why = cuda_graph.capture(H.DEV, function() return { y = titan.matmul(x, w:t()) } end)
      assert(g, why)
      since(c1, { 1, 0 }, "captured")
      g:replay()
      H.sync()
      H.check(g.outputs.y, ref(x, w), H.tol(DT), "replayed")
      g:free()
      -- the shape is still to be timed: the next eager call that overwrites does it
      local c2 = counts()
      product(H.randn({ 48, 32 }, 23, DT), H.randn({ 16, 32 }, 24, DT))
      since(c2, TUNED, "eager again, beta = 0")
    end)
    x:free(); w:free()
  end))
end)

describe("cuda matmul through cuBLAS (TITAN_CUDA_GEMM_API=cublas)", function()
  -- The setting is read at each GEMM. cuemu counts the cuBLAS GEMMs that ran (on a GPU the count is not
  -- there: the products are checked against the reference, which either library must give).
  local ffi = require("ffi")
  pcall(ffi.cdef, "uint64_t tt_emu_blas_gemm_count(void);")
  local counted = H.ON_GPU and pcall(function() return ffi.C.tt_emu_blas_gemm_count end)
  local function count() return counted and tonumber(ffi.C.tt_emu_blas_gemm_count()) or nil end
  local function ran(before, want, what)
    if before then assert.are.equal(want, count() - before, what) end
  end
  local function with_api(v, fn) H.with_env("TITAN_CUDA_GEMM_API", v, fn) end
  -- op(a) @ op(b) (+ acc when given: beta = 1) on the device into a poisoned output, and the CPU's in float64
  local function product(a, b, ta, tb, acc, dt)
    local M, N = ta == 1 and a:size(2) or a:size(1), tb == 1 and b:size(1) or b:size(2)
    local out = acc and dev(acc) or poison({ M, N }, dt)
    ok(C.tt_op_matmul(dev(a)._c, dev(b)._c, ta, tb, 1, acc and 1 or 0, box(out)), "matmul " .. dt)
    H.sync()
    local r = box()
    ok(C.tt_op_matmul(f64(a)._c, f64(b)._c, ta, tb, 1, 0, r), "matmul (CPU reference)")
    r = take(r)
    return out, acc and r + f64(acc) or r
  end

  for _, dt in ipairs(FLOATS) do
    it("every transpose, accumulating, batched, in " .. dt .. "; a bias still goes through cuBLASLt",
      H.scoped(function()
        with_api("cublas", function()
          local M, N, K = 37, 24, 56
          for ta = 0, 1 do
            for tb = 0, 1 do
              local a = H.randn(ta == 1 and { K, M } or { M, K }, 30 + 2 * ta + tb, dt)
              local b = H.randn(tb == 1 and { N, K } or { K, N }, 40 + 2 * ta + tb, dt)
              local what = ("cublas %s ta %d tb %d"):format(dt, ta, tb)
              local c0 = count()
              local got, want = product(a, b, ta, tb, nil, dt)
              ran(c0, 1, what)
              H.check(got, want, H.tol(dt), what)
              local acc = H.randn({ M, N }, 50 + 2 * ta + tb, dt)
              got, want = product(a, b, ta, tb, acc, dt)
              H.check(got, want, H.tol(dt, 2), what .. " + C")
            end
          end
          -- batched: [3, M, K] @ [3, K, N]
          local a3, b3 = H.randn({ 3, M, K }, 60, dt), H.randn({ 3, K, N }, 61, dt)
          local c0 = count()
          local got = titan.matmul(dev(a3), dev(b3))
          H.sync()
          ran(c0, 1, "one strided-batched call")
          H.check(got, titan.matmul(f64(a3), f64(b3)), H.tol(dt), "cublas batched " .. dt)
          -- a linear layer's bias rides in cuBLASLt's epilogue, which cuBLAS has not
          local x, w, bias = H.randn({ M, K }, 62, dt), H.randn({ N, K }, 63, dt), H.randn({ N }, 64, dt)
          c0 = count()
          H.check(run(dev(x), dev(w), dev(bias), { M, N }, dt, "linear with a bias"), ref(x, w, bias), H.tol(dt),
            "cublas setting, bias")
          ran(c0, 0, "the bias through cuBLASLt")
        end)
      end))
  end

  it("gives the bits of one run again, and a bad value is one line", H.scoped(function()
    local dt = H.ON_GPU and "bfloat16" or "float32"
    local a, b = H.randn({ 96, 80 }, 70, dt), H.randn({ 64, 80 }, 71, dt)
    with_api("cublas", function()
      local one = product(a, b, 0, 1, nil, dt)
      H.check_exact(product(a, b, 0, 1, nil, dt), one, "the same product again")
    end)
    if not H.ON_GPU then return end -- (a CUDA setting: the CPU's GEMM does not read it)
    with_api("fast", function()
      local st = C.tt_op_matmul(dev(a)._c, dev(b)._c, 0, 1, 1, 0, box(poison({ 96, 64 }, dt)))
      assert.are_not.equal(0, st)
      local msg = ffi.string(C.tt_last_error())
      assert.truthy(msg:find("TITAN_CUDA_GEMM_API=fast: expected lt or cublas", 1, true), msg)
    end)
  end))
end)
