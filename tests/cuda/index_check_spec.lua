-- Out-of-range indices on the device under test: every index op (index_select,
-- index_add, gather, scatter_add, embedding forward and backward,
-- cross_entropy forward and backward) with an index that is too large and one
-- that is negative must give TT_ERR_INDEX with one line naming the op, the
-- index, its position and the valid range, and must not fault.
--
-- Where it comes up differs by device, and both are accepted: the CPU checks
-- indices before the kernel, so the op itself fails; a GPU kernel records the
-- first bad index in the device's fault record and the error comes at the
-- next wait for the device (a :item(), a copy to the host, a synchronize),
-- with "(cuda:0; detected at the next synchronization)". On the GPU the
-- spec also checks what the kernels did with the bad element (zeros out,
-- nothing added), that the record was cleared (a second check is clean) and
-- that the device still computes right afterwards.
--
-- Without a GPU the file exits 77 (skipped); TITAN_GPU_SPEC_DEVICE=cpu runs
-- it against the CPU (see helpers.lua).
package.path = "./tests/cuda/?.lua;" .. package.path
local H = require("helpers")
H.require_device()

local titan = require("titan")
local tensor = require("titan.tensor")
local F = titan.F
local ffi, C = titan.ffi, titan.C
local box, ok, take, f64, dev = H.box, H.ok, H.take, H.f64, H.dev

local DEVC = tensor.device_of(H.DEV)
local DEV_NAME = tensor.device_name(DEVC)
local IGNORE = -100

local function last_error() return ffi.string(C.tt_last_error()) end

local function ids(flat, shape, dt)
  local t = titan.tensor(flat, { dtype = dt or "int64" })
  return shape and t:reshape(shape) or t
end

-- A copy of the list with v at flat position pos (0-based).
local function with(flat, pos, v)
  local c = { unpack(flat) }
  c[pos + 1] = v
  return c
end

-- A CPU float64 contiguous tensor with the given flat elements set to 0.
local function zero_at(t, positions)
  local c = f64(t):clone()
  local p = ffi.cast("double*", C.tt_tensor_data(c._c))
  for _, i in ipairs(positions) do p[i] = 0 end
  return c
end

-- The waits that must report a recorded fault, in turn: a Lua :item(), a raw
-- copy to the host, an explicit check. Each returns the message or nil.
local probe_buf = ffi.new("double[1]")
local DETECT = {
  function()
    local probe = titan.ones({ 1 }, { device = H.DEV })
    local fine, err = pcall(function() return probe:item() end)
    probe:free()
    return not fine and tostring(err) or nil
  end,
  function()
    local probe = titan.ones({ 1 }, { dtype = "float64", device = H.DEV })
    local st = C.tt_tensor_to_host(probe._c, probe_buf, 8)
    probe:free()
    return st ~= 0 and last_error() or nil
  end,
  function()
    local fine, err = pcall(titan.synchronize, H.DEV)
    return not fine and tostring(err) or nil
  end,
}
local detect_turn = 0

-- The op returned `status`: either the error itself (CPU) or TT_OK with the
-- fault left for the next wait (GPU). Checks the message, then that the
-- record is clear.
local function expect_fault(what, status, op, index, pos, bound)
  local msg
  if status ~= 0 then
    assert(status == C.TT_ERR_INDEX, what .. ": status " .. tonumber(status) .. ", expected TT_ERR_INDEX: "
      .. last_error())
    msg = last_error()
  else
    assert(H.ON_GPU, what .. ": the CPU checks indices before its kernels; expected an error from the op")
    detect_turn = detect_turn % #DETECT + 1
    msg = DETECT[detect_turn]()
    assert(msg, what .. ": no error at the next synchronization (probe " .. detect_turn .. ")")
    local where = "(" .. DEV_NAME .. "; detected at the next synchronization)"
    assert(msg:find(where, 1, true), what .. ": expected '" .. where .. "' in: " .. msg)
  end
  local want = ("%s: index %d at position %d is out of range [0, %d)"):format(op, index, pos, bound)
  assert(msg:find(want, 1, true), what .. ": expected '" .. want .. "' in: " .. msg)
  ok(C.tt_device_synchronize(DEVC), what .. ": a second check must be clean")
end

-- ---- the ops -----------------------------------------------------------------------
-- Each case: the index list (flat) and shape, the flat position of the bad
-- index, its bound, run(idx, on) -> status, result (on: the device or "cpu";
-- result nil on failure), and masked(good) -> what the GPU must produce when
-- the index at pos is out of range: the CPU result with that element's effect
-- removed (zeros out for the movers, nothing added for the adds, the row
-- ignored for the loss).

local SRC = H.randn({ 4, 6 }, 1, "float64")
local G_SRC = H.randn({ 3, 4 }, 2, "float64")
local ADD_DST = H.randn({ 5, 3 }, 3, "float64")
local ADD_SRC = H.randn({ 3, 3 }, 4, "float64")
local SC_DST = H.randn({ 3, 4 }, 5, "float64")
local SC_SRC = H.randn({ 3, 2 }, 6, "float64")
local W = H.randn({ 7, 4 }, 7, "float64")
local DY = H.randn({ 2, 3, 4 }, 8, "float64")
local DW = H.randn({ 7, 4 }, 9, "float64")
local LOGITS = H.randn({ 4, 5 }, 10, "float64")
local DLOSS = H.randn({ 4 }, 11, "float64")

local function on(t, where) return where == "cpu" and f64(t) or dev(t) end

-- A fresh (writable) copy of t on `where`.
local function fresh(t, where)
  local c = f64(t):clone()
  return where == "cpu" and c or dev(c)
end

local function fwd(fn)
  return function(idx, where)
    local o = box()
    local st = fn(idx, where, o)
    return st, st == 0 and take(o) or nil
  end
end

-- The CE forward's lse on `where` for valid targets (the backward's input).
local function lse_of(where)
  local l, s = box(), box()
  local t = ids({ 1, 0, 3, 4 })
  ok(C.tt_op_cross_entropy(on(LOGITS, where)._c, (where == "cpu" and t or dev(t))._c, IGNORE, l, s, nil), "lse")
  take(l):free()
  return take(s)
end

local CASES = {
  {
    op = "index_select", flat = { 0, 2, 3, 1 }, pos = 2, bound = 4,
    run = fwd(function(idx, where, o) return C.tt_op_index_select(on(SRC, where)._c, 0, idx._c, o) end),
    masked = function(out) return zero_at(out, { 12, 13, 14, 15, 16, 17 }) end, -- row 2
  },
  {
    op = "gather", flat = { 0, 3, 1, 2, 3, 3 }, shape = { 3, 2 }, pos = 3, bound = 4,
    run = fwd(function(idx, where, o) return C.tt_op_gather(on(G_SRC, where)._c, 1, idx._c, o) end),
    masked = function(out) return zero_at(out, { 3 }) end,
  },
  {
    op = "embedding", flat = { 0, 6, 2, 2, 5, 1 }, shape = { 2, 3 }, pos = 5, bound = 7,
    run = fwd(function(idx, where, o) return C.tt_op_embedding(on(W, where)._c, idx._c, o) end),
    masked = function(out) return zero_at(out, { 20, 21, 22, 23 }) end, -- ids[1][2]'s row
  },
  {
    op = "index_add", flat = { 1, 4, 1 }, pos = 1, bound = 5,
    run = function(idx, where, src)
      local d = fresh(ADD_DST, where)
      local st = C.tt_op_index_add(d._c, 0, idx._c, on(src or ADD_SRC, where)._c)
      return st, d
    end,
    masked = function(_, case) -- src row 1 adds nothing
      local _, r = case.run(ids(case.flat), "cpu", zero_at(ADD_SRC, { 3, 4, 5 }))
      return r
    end,
  },
  {
    op = "scatter_add", flat = { 0, 3, 3, 3, 2, 1 }, shape = { 3, 2 }, pos = 4, bound = 4,
    run = function(idx, where, src)
      local d = fresh(SC_DST, where)
      local st = C.tt_op_scatter_add(d._c, 1, idx._c, on(src or SC_SRC, where)._c)
      return st, d
    end,
    masked = function(_, case)
      local _, r = case.run(ids(case.flat, case.shape), "cpu", zero_at(SC_SRC, { 4 }))
      return r
    end,
  },
  {
    op = "embedding_backward", flat = { 0, 6, 2, 2, 5, 1 }, shape = { 2, 3 }, pos = 2, bound = 7,
    run = function(idx, where, dy)
      local d = fresh(DW, where)
      local st = C.tt_op_embedding_backward(on(dy or DY, where)._c, idx._c, d._c)
      return st, d
    end,
    masked = function(_, case)
      local _, r = case.run(ids(case.flat, case.shape), "cpu", zero_at(DY, { 8, 9, 10, 11 }))
      return r
    end,
  },
  {
    op = "cross_entropy", flat = { 1, IGNORE, 3, 4 }, pos = 2, bound = 5,
    run = function(idx, where)
      local l, s = box(), box()
      local st = C.tt_op_cross_entropy(on(LOGITS, where)._c, idx._c, IGNORE, l, s, nil)
      if st ~= 0 then return st end
      take(s):free()
      return st, take(l)
    end,
    masked = function(_, case) -- the row is ignored
      local _, r = case.run(ids(with(case.flat, case.pos, IGNORE)), "cpu")
      return r
    end,
  },
  {
    op = "cross_entropy_backward", flat = { 1, 0, IGNORE, 4 }, pos = 1, bound = 5,
    run = fwd(function(idx, where, o)
      return C.tt_op_cross_entropy_backward(on(LOGITS, where)._c, idx._c, lse_of(where)._c, on(DLOSS, where)._c,
        IGNORE, o)
    end),
    masked = function(_, case)
      local _, r = case.run(ids(with(case.flat, case.pos, IGNORE)), "cpu")
      return r
    end,
  },
}

describe("out-of-range indices on " .. DEV_NAME, function()
  for _, case in ipairs(CASES) do
    for _, kind in ipairs({ "too large", "negative" }) do
      it(case.op .. ": an index " .. kind .. " is TT_ERR_INDEX naming the op; the device stays usable",
        H.scoped(function()
          local bad = kind == "too large" and case.bound + 69996 or -3
          local what = ("%s, index %d"):format(case.op, bad)
          local st, out = case.run(dev(ids(with(case.flat, case.pos, bad), case.shape)), H.DEV)
          expect_fault(what, st, case.op, bad, case.pos, case.bound)
          if st == 0 then -- GPU: the op ran; its output is readable once the fault is reported
            local _, good = case.run(ids(case.flat, case.shape), "cpu")
            H.check(out, case.masked(good, case), 1e-12, what .. ": the bad element's effect is removed")
          end
          -- Valid indices right after: right results (the context survived).
          local st2, got = case.run(dev(ids(case.flat, case.shape)), H.DEV)
          ok(st2, what .. ": the valid op after the error")
          local _, want = case.run(ids(case.flat, case.shape), "cpu")
          H.check(got, want, 1e-12, what .. ": the valid op after the error")
          ok(C.tt_device_synchronize(DEVC), what .. ": valid indices leave no fault")
        end))
    end
  end

  it("int32 indices are checked too", H.scoped(function()
    local o = box()
    local st = C.tt_op_index_select(dev(SRC)._c, 1, dev(ids({ 5, 6, 0 }, nil, "int32"))._c, o)
    if st == 0 then take(o) end
    expect_fault("index_select int32", st, "index_select", 6, 1, 6)
  end))

  it("the first fault wins until it is reported", H.scoped(function()
    local o1, o2 = box(), box()
    local st1 = C.tt_op_index_select(dev(SRC)._c, 0, dev(ids({ 9, 0 }))._c, o1)
    if st1 ~= 0 then expect_fault("index_select", st1, "index_select", 9, 0, 4) end -- CPU: at the op
    local st2 = C.tt_op_gather(dev(G_SRC)._c, 1, dev(ids({ 0, 0, 0, 0, 0, -1 }, { 3, 2 }))._c, o2)
    if st2 ~= 0 then expect_fault("gather", st2, "gather", -1, 5, 4) end
    if st1 == 0 then
      take(o1); take(o2)
      assert(st2 == 0, "the GPU reports nothing at the op")
      expect_fault("first of two", 0, "index_select", 9, 0, 4)
    end
  end))

  it("Lua face: the error names the op at the op or at :item() / titan.synchronize", H.scoped(function()
    local x = dev(SRC)
    local fine, err = pcall(function() return titan.index_select(x, 1, dev(ids({ 0, 4 }))):sum():item() end)
    assert(not fine, "index_select with index 4 of 4 rows must fail")
    assert(tostring(err):find("index_select: index 4 at position 1 is out of range [0, 4)", 1, true), tostring(err))
    titan.synchronize(H.DEV) -- clean now

    local w = fresh(W, H.DEV):requires_grad_()
    local bad = dev(ids({ 1, 7, 2 }))
    fine, err = pcall(function()
      local e = F.embedding(w, bad)
      e:sum():backward()
      titan.synchronize(H.DEV)
    end)
    assert(not fine, "embedding with id 7 of 7 rows must fail")
    assert(tostring(err):find("embedding: index 7 at position 1 is out of range [0, 7)", 1, true), tostring(err))
    titan.synchronize(H.DEV)
  end))
end)

describe("cross_entropy targets on " .. DEV_NAME, function()
  it("targets equal to ignore_index are not errors, whatever the ignore_index", H.scoped(function()
    for _, ig in ipairs({ IGNORE, 7, -1 }) do
      local t = dev(ids({ 1, ig, 3, ig }))
      local l, s, g = box(), box(), box()
      ok(C.tt_op_cross_entropy(dev(LOGITS)._c, t._c, ig, l, s, nil), "forward, ignore_index " .. ig)
      local lse = take(s)
      take(l)
      ok(C.tt_op_cross_entropy_backward(dev(LOGITS)._c, t._c, lse._c, dev(DLOSS)._c, ig, g), "backward " .. ig)
      take(g)
      ok(C.tt_device_synchronize(DEVC), "ignore_index " .. ig .. " leaves no fault")
    end
  end))

  it("mean without num_tokens divides by the count of real targets, as on the CPU", H.scoped(function()
    local flat = { 1, IGNORE, 3, 0, IGNORE, 2, 4, 4 }
    local logits = H.randn({ 8, 5 }, 12, "float64")
    local want, want_n = F.cross_entropy(f64(logits), ids(flat))
    local got, got_n = F.cross_entropy(dev(logits), dev(ids(flat)))
    assert.are.equal(6, want_n)
    assert.are.equal(want_n, got_n)
    local a, b = got:item(), want:item()
    assert(b > 0 and math.abs(a - b) <= 1e-12 * b, ("mean loss %.17g, CPU %.17g"):format(a, b))
    -- With num_tokens the count is not computed (no wait for the device).
    local _, n = F.cross_entropy(dev(logits), dev(ids(flat)), { num_tokens = 6 })
    assert.is_nil(n)
  end))

  it("a bad target found while counting fails the op itself", H.scoped(function()
    local fine, err = pcall(function() return F.cross_entropy(dev(LOGITS), dev(ids({ 1, 5, 0, 2 }))) end)
    assert(not fine, "target 5 of 5 classes must fail")
    assert(tostring(err):find("cross_entropy: index 5 at position 1 is out of range [0, 5)", 1, true), tostring(err))
    ok(C.tt_device_synchronize(DEVC), "reported once")
  end))
end)
