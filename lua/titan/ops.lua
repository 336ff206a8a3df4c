-- ops.lua — differentiable general tensor ops: elementwise with
-- broadcasting, reductions, views, matmul, indexing. Each forward is one C
-- entry point; each backward is expressed with C entry points too. Methods
-- and operators are attached to Tensor here (t + u, t:sum(), a @ b as
-- a:matmul(b)). The neural-network primitives live in functional.lua.
local tensor = require("titan.tensor")
local autograd = require("titan.autograd")
local tffi = require("titan.ffi")
local ffi, C, check = tffi.ffi, tffi.C, tffi.check

local Tensor, wrap, cptr, call_out = tensor.Tensor, tensor.wrap, tensor.cptr, tensor.call_out
local record, needs = autograd.record, autograd.needs

local M = {}

local outp = ffi.new("tt_tensor*[1]")
local outp2 = ffi.new("tt_tensor*[1]")
local ibuf = ffi.new("int[8]")

local function is_tensor(x) return type(x) == "table" and getmetatable(x) == Tensor end
M.is_tensor = is_tensor

-- ---- non-recorded helpers used by backward functions --------------------

local function raw_binary(op, a, b)
  outp[0] = nil
  check(C.tt_op_binary(op, cptr(a), cptr(b), outp), 3)
  return wrap(outp[0])
end

local function raw_unary(op, a, alpha)
  outp[0] = nil
  check(C.tt_op_unary(op, cptr(a), alpha or 0, outp), 3)
  return wrap(outp[0])
end

local function raw_sum_to(g, shape)
  local same = #shape == g:dim()
  if same then
    local gs = g:shape()
    for i = 1, #shape do if gs[i] ~= shape[i] then same = false break end end
  end
  if same then return g end
  outp[0] = nil
  check(C.tt_op_sum_to(cptr(g), #shape, tensor.fill_shape(shape), outp), 3)
  return wrap(outp[0])
end
M.sum_to = raw_sum_to

-- g reduced to x's shape, then freed if it was a temporary.
local function reduce_grad(gi, shape, g)
  local r = raw_sum_to(gi, shape)
  if r ~= gi and gi ~= g then gi:free() end
  return r
end

-- ---- views ---------------------------------------------------------------------

function Tensor:contiguous()
  if self:is_contiguous() then return self end
  local out = call_out(C.tt_tensor_contiguous, cptr(self))
  if needs(self) then
    record("contiguous", out, { self }, 1, function(_, g) return { g } end)
  end
  return out
end

function Tensor:clone()
  local out = tensor.empty(self:shape(), { dtype = self:dtype(), device = self:device() })
  check(C.tt_tensor_copy(out._c, cptr(self)), 2)
  if needs(self) then record("clone", out, { self }, 1, function(_, g) return { g } end) end
  return out
end

function Tensor:detach()
  local c = cptr(self)
  C.tt_tensor_retain(c)
  return wrap(c)
end

local function view_grad_reshape(shape)
  return function(_, g)
    local gc = g:is_contiguous() and g or g:clone()
    outp[0] = nil
    check(C.tt_view_reshape(cptr(gc), #shape, tensor.fill_shape(shape), outp))
    local r = wrap(outp[0])
    if gc ~= g then gc:free() end
    return { r }
  end
end

-- Reshape without recording (a view when possible, else a packed copy).
function M.raw_reshape(t, shape)
  outp[0] = nil
  local st = C.tt_view_reshape(cptr(t), #shape, tensor.fill_shape(shape), outp)
  if st == C.TT_ERR_LAYOUT then
    local packed = call_out(C.tt_tensor_contiguous, cptr(t))
    outp[0] = nil
    st = C.tt_view_reshape(packed._c, #shape, tensor.fill_shape(shape), outp)
    packed:free()
  end
  check(st, 3)
  return wrap(outp[0])
end

-- reshape/view: a view when the layout allows, else a copy.
function Tensor:reshape(...)
  local shape = tensor.parse_shape(...)
  outp[0] = nil
  local st = C.tt_view_reshape(cptr(self), #shape, tensor.fill_shape(shape), outp)
  local out
  if st == C.TT_ERR_LAYOUT then
    local packed = call_out(C.tt_tensor_contiguous, cptr(self))
    outp[0] = nil
    check(C.tt_view_reshape(packed._c, #shape, tensor.fill_shape(shape), outp), 2)
    out = wrap(outp[0])
    packed:free()
  else
    check(st, 2)
    out = wrap(outp[0])
  end
  if needs(self) then record("reshape", out, { self }, 1, view_grad_reshape(self:shape())) end
  return out
end

-- view: like reshape but never copies (an error names the layout problem).
function Tensor:view(...)
  local shape = tensor.parse_shape(...)
  outp[0] = nil
  check(C.tt_view_reshape(cptr(self), #shape, tensor.fill_shape(shape), outp), 2)
  local out = wrap(outp[0])
  if needs(self) then record("view", out, { self }, 1, view_grad_reshape(self:shape())) end
  return out
end

function Tensor:flatten() return self:reshape(self:numel()) end

-- permute with 1-based dims, as everything else in the Lua API.
function Tensor:permute(...)
  local dims = tensor.parse_shape(...)
  local n = self:dim()
  if #dims ~= n then error(("permute: %d dims given for a tensor with %d"):format(#dims, n), 2) end
  for i = 1, n do
    local d = dims[i]
    if d < 0 then d = d + n + 1 end
    ibuf[i - 1] = d - 1
  end
  outp[0] = nil
  check(C.tt_view_permute(cptr(self), ibuf, outp), 2)
  local out = wrap(outp[0])
  if needs(self) then
    local inv = {}
    for i = 1, n do
      local d = dims[i] < 0 and dims[i] + n + 1 or dims[i]
      inv[d] = i
    end
    record("permute", out, { self }, 1, function(_, g)
      for i = 1, n do ibuf[i - 1] = inv[i] - 1 end
      outp[0] = nil
      check(C.tt_view_permute(cptr(g), ibuf, outp))
      return { wrap(outp[0]) }
    end)
  end
  return out
end

local function norm_dim(d, n)
  if d < 0 then d = d + n + 1 end
  return d
end

function Tensor:transpose(d0, d1)
  local n = self:dim()
  d0, d1 = norm_dim(d0, n), norm_dim(d1, n)
  local out = call_out(C.tt_view_transpose, cptr(self), d0 - 1, d1 - 1)
  if needs(self) then
    record("transpose", out, { self }, 1, function(_, g)
      return { call_out(C.tt_view_transpose, cptr(g), d0 - 1, d1 - 1) }
    end)
  end
  return out
end

function Tensor:t()
  if self:dim() ~= 2 then error("t: expects a 2-D tensor, got shape " .. tensor.shape_str(self:shape()), 2) end
  return self:transpose(1, 2)
end

-- narrow(dim, start, length): start is 1-based.
function Tensor:narrow(dim, start, length)
  local n = self:dim()
  dim = norm_dim(dim, n)
  local out = call_out(C.tt_view_narrow, cptr(self), dim - 1, start - 1, length)
  if needs(self) then
    local shape = self:shape()
    local dt, dev = self:dtype(), self:device()
    record("narrow", out, { self }, 1, function(_, g)
      local z = tensor.zeros(shape, { dtype = dt, device = dev })
      local slot = call_out(C.tt_view_narrow, z._c, dim - 1, start - 1, length)
      check(C.tt_tensor_copy(slot._c, cptr(g)))
      slot:free()
      return { z }
    end)
  end
  return out
end

-- Python-style slice along dim: [from, to] inclusive, 1-based, negatives from the end.
function Tensor:slice(dim, from, to)
  local len = self:size(dim)
  if from < 0 then from = len + from + 1 end
  if to == nil then to = len elseif to < 0 then to = len + to + 1 end
  return self:narrow(dim, from, to - from + 1)
end

function Tensor:select(dim, index)
  local n = self:dim()
  dim = norm_dim(dim, n)
  local s = self:narrow(dim, index, 1)
  local shape = s:shape()
  table.remove(shape, dim)
  return s:reshape(shape)
end

function Tensor:expand(...)
  local shape = tensor.parse_shape(...)
  local out = call_out(C.tt_view_expand, cptr(self), #shape, tensor.fill_shape(shape))
  if needs(self) then
    local orig = self:shape()
    record("expand", out, { self }, 1, function(_, g) return { reduce_grad(g, orig, g) } end)
  end
  return out
end

function Tensor:unsqueeze(dim)
  local shape = self:shape()
  table.insert(shape, norm_dim(dim, #shape + 1), 1)
  return self:reshape(shape)
end

function Tensor:squeeze(dim)
  local shape = self:shape()
  if dim then
    dim = norm_dim(dim, #shape)
    if shape[dim] == 1 then table.remove(shape, dim) end
  else
    local s = {}
    for _, v in ipairs(shape) do if v ~= 1 then s[#s + 1] = v end end
    shape = s
  end
  return self:reshape(shape)
end

-- split into pieces of `size` along dim (the last may be smaller).
function Tensor:split(size, dim)
  dim = norm_dim(dim or 1, self:dim())
  local len, out = self:size(dim), {}
  local start = 1
  while start <= len do
    local l = math.min(size, len - start + 1)
    out[#out + 1] = self:narrow(dim, start, l)
    start = start + l
  end
  return out
end

-- chunk into n pieces as torch.chunk does (ceil-sized, the last smaller).
function Tensor:chunk(n, dim)
  dim = norm_dim(dim or 1, self:dim())
  return self:split(math.ceil(self:size(dim) / n), dim)
end

function M.cat(ts, dim)
  local n = #ts
  if n == 0 then error("cat: needs at least one tensor", 2) end
  dim = norm_dim(dim or 1, ts[1]:dim())
  local arr = ffi.new("tt_tensor*[?]", n)
  for i = 1, n do arr[i - 1] = cptr(ts[i]) end
  local out = call_out(C.tt_op_cat, n, arr, dim - 1)
  if needs(unpack(ts, 1, n)) then
    local sizes = {}
    for i = 1, n do sizes[i] = ts[i]:size(dim) end
    record("cat", out, ts, n, function(ctx, g)
      local grads, off = {}, 0
      for i = 1, n do
        if ctx:needs(i) then
          local v = call_out(C.tt_view_narrow, cptr(g), dim - 1, off, sizes[i])
          grads[i] = v:clone()
          v:free()
        end
        off = off + sizes[i]
      end
      return grads
    end)
  end
  return out
end

function M.stack(ts, dim)
  dim = dim or 1
  local us = {}
  for i, t in ipairs(ts) do us[i] = t:unsqueeze(dim) end
  return M.cat(us, dim)
end

-- ---- elementwise ------------------------------------------------------------------

local function scalar_like(x, v)
  return tensor.full({}, v, { dtype = x:dtype(), device = x:device() })
end

local function binary(op, name, a, b)
  if not is_tensor(a) then a = scalar_like(b, a) end
  if not is_tensor(b) then
    -- tensor op number: the unary scalar forms are cheaper
    if op == C.TT_ADD then return M.add_scalar(a, b) end
    if op == C.TT_SUB then return M.add_scalar(a, -b) end
    if op == C.TT_MUL then return M.scale(a, b) end
    if op == C.TT_DIV then return M.scale(a, 1 / b) end
    b = scalar_like(a, b)
  end
  if (op == C.TT_MAXIMUM or op == C.TT_MINIMUM) and needs(a, b) then
    -- Differentiable through relu: max(a, b) = b + relu(a - b),
    -- min(a, b) = a - relu(a - b) (ties send the gradient to one side).
    local d = M.relu(M.sub(a, b))
    if op == C.TT_MAXIMUM then return M.add(b, d) end
    return M.sub(a, d)
  end
  local out = raw_binary(op, a, b)
  if needs(a, b) then
    local sa, sb = a:shape(), b:shape()
    local saved = (op == C.TT_MUL or op == C.TT_DIV) and { a, b } or nil
    record(name, out, { a, b }, 2, function(ctx, g)
      local ga, gb
      if op == C.TT_ADD then
        if ctx:needs(1) then ga = reduce_grad(g, sa, g) end
        if ctx:needs(2) then gb = reduce_grad(g, sb, g) end
      elseif op == C.TT_SUB then
        if ctx:needs(1) then ga = reduce_grad(g, sa, g) end
        if ctx:needs(2) then gb = reduce_grad(raw_unary(C.TT_NEG, g), sb, g) end
      elseif op == C.TT_MUL then
        local x, y = ctx:saved(1), ctx:saved(2)
        if ctx:needs(1) then ga = reduce_grad(raw_binary(C.TT_MUL, g, y), sa, g) end
        if ctx:needs(2) then gb = reduce_grad(raw_binary(C.TT_MUL, g, x), sb, g) end
      elseif op == C.TT_DIV then
        local x, y = ctx:saved(1), ctx:saved(2)
        if ctx:needs(1) then ga = reduce_grad(raw_binary(C.TT_DIV, g, y), sa, g) end
        if ctx:needs(2) then -- -g * x / y^2
          local t1 = raw_binary(C.TT_MUL, g, x)
          local y2 = raw_binary(C.TT_MUL, y, y)
          local t2 = raw_binary(C.TT_DIV, t1, y2)
          t1:free(); y2:free()
          local t3 = raw_unary(C.TT_NEG, t2)
          t2:free()
          gb = reduce_grad(t3, sb, g)
        end
      end
      return { ga, gb }
    end, saved)
  end
  return out
end

function M.add(a, b) return binary(C.TT_ADD, "add", a, b) end
function M.sub(a, b) return binary(C.TT_SUB, "sub", a, b) end
function M.mul(a, b) return binary(C.TT_MUL, "mul", a, b) end
function M.div(a, b) return binary(C.TT_DIV, "div", a, b) end
function M.maximum(a, b) return binary(C.TT_MAXIMUM, "maximum", a, b) end
function M.minimum(a, b) return binary(C.TT_MINIMUM, "minimum", a, b) end

local unary_ops = {
  neg = C.TT_NEG, exp = C.TT_EXP, log = C.TT_LOG, sqrt = C.TT_SQRT, rsqrt = C.TT_RSQRT,
  silu = C.TT_SILU, gelu = C.TT_GELU, relu = C.TT_RELU, square = C.TT_SQUARE, abs = C.TT_ABS,
  tanh = C.TT_TANH, sigmoid = C.TT_SIGMOID, reciprocal = C.TT_RECIPROCAL,
}

local function unary(op, name, x, alpha)
  local out = raw_unary(op, x, alpha)
  if needs(x) then
    record(name, out, { x }, 1, function(ctx, g)
      local xs = ctx:saved(1)
      outp[0] = nil
      check(C.tt_op_unary_backward(op, cptr(xs), nil, cptr(g), alpha or 0, outp))
      return { wrap(outp[0]) }
    end, { x })
  end
  return out
end

for name, op in pairs(unary_ops) do
  M[name] = function(x) return unary(op, name, x) end
  Tensor[name] = M[name]
end

function M.scale(x, alpha)
  local out = raw_unary(C.TT_SCALE, x, alpha)
  if needs(x) then
    record("scale", out, { x }, 1, function(_, g) return { raw_unary(C.TT_SCALE, g, alpha) } end)
  end
  return out
end

function M.add_scalar(x, alpha)
  local out = raw_unary(C.TT_ADD_SCALAR, x, alpha)
  if needs(x) then record("add_scalar", out, { x }, 1, function(_, g) return { g } end) end
  return out
end

function M.pow(x, p) return unary(C.TT_POW_SCALAR, "pow", x, p) end

Tensor.add, Tensor.sub, Tensor.mul, Tensor.div = M.add, M.sub, M.mul, M.div
Tensor.maximum, Tensor.minimum = M.maximum, M.minimum
Tensor.scale, Tensor.add_scalar, Tensor.pow = M.scale, M.add_scalar, M.pow
Tensor.__add = function(a, b) return binary(C.TT_ADD, "add", a, b) end
Tensor.__sub = function(a, b)
  if not is_tensor(a) then return M.add_scalar(M.neg(b), a) end
  return binary(C.TT_SUB, "sub", a, b)
end
Tensor.__mul = function(a, b)
  if not is_tensor(a) then return M.scale(b, a) end
  return binary(C.TT_MUL, "mul", a, b)
end
Tensor.__div = function(a, b) return binary(C.TT_DIV, "div", a, b) end
Tensor.__unm = function(a) return M.neg(a) end
Tensor.__pow = function(a, p) return M.pow(a, p) end

-- In-place updates (no autograd: for optimizers and initialization).
function Tensor:add_(other, alpha)
  if is_tensor(other) then
    check(C.tt_op_axpy(cptr(self), alpha or 1, cptr(other)), 2)
  else
    outp[0] = cptr(self)
    check(C.tt_op_unary(C.TT_ADD_SCALAR, cptr(self), other, outp), 2)
  end
  return self
end

function Tensor:mul_(s)
  outp[0] = cptr(self)
  check(C.tt_op_unary(C.TT_SCALE, cptr(self), s, outp), 2)
  return self
end

-- ---- reductions ----------------------------------------------------------------------

local DIM_ALL = -100

local function reduce(op, name, x, dim, keepdim)
  local cdim = DIM_ALL
  if dim then cdim = norm_dim(dim, x:dim()) - 1 end
  outp[0] = nil
  local want_idx = op == C.TT_RMAX and needs(x)
  outp2[0] = nil
  check(C.tt_op_reduce(op, cptr(x), cdim, keepdim and 1 or 0, outp, want_idx and outp2 or nil), 3)
  local out = wrap(outp[0])
  local idx = want_idx and wrap(outp2[0]) or nil
  if needs(x) then
    local shape = x:shape()
    -- The gradient's shape with the reduced dim kept as 1 (for broadcasting).
    local kshape = {}
    for i = 1, #shape do kshape[i] = (cdim == DIM_ALL or i == cdim + 1) and 1 or shape[i] end
    local n = dim and shape[cdim + 1] or x:numel()
    local saved = (op == C.TT_RNORM2) and { x, out } or (op == C.TT_RMAX and { idx } or nil)
    record(name, out, { x }, 1, function(ctx, g)
      local gk = g:reshape(kshape)
      local r
      if op == C.TT_RSUM or op == C.TT_RMEAN then
        local e = call_out(C.tt_view_expand, gk._c, #shape, tensor.fill_shape(shape))
        r = e:clone()
        e:free()
        if op == C.TT_RMEAN then r:mul_(1 / n) end
      elseif op == C.TT_RNORM2 then -- x * g / ||x||
        local xs, nrm = ctx:saved(1), ctx:saved(2):reshape(kshape)
        local q = raw_binary(C.TT_DIV, gk, nrm)
        r = raw_binary(C.TT_MUL, xs, q)
        q:free(); nrm:free()
      else -- max: scatter g to the argmax positions
        r = tensor.zeros(shape, { dtype = g:dtype(), device = g:device() })
        local ix = ctx:saved(1):reshape(kshape)
        if cdim == DIM_ALL then
          local flat = r:view(x:numel())
          local gi = gk:reshape(1)
          check(C.tt_op_scatter_add(flat._c, 0, ix:reshape(1)._c, gi._c))
        else
          check(C.tt_op_scatter_add(r._c, cdim, ix._c, gk._c))
        end
      end
      if gk ~= g then gk:free() end
      return { r }
    end, saved)
  end
  if idx then idx:free() end
  return out
end

function M.sum(x, dim, keepdim) return reduce(C.TT_RSUM, "sum", x, dim, keepdim) end
function M.mean(x, dim, keepdim) return reduce(C.TT_RMEAN, "mean", x, dim, keepdim) end
function M.max(x, dim, keepdim) return reduce(C.TT_RMAX, "max", x, dim, keepdim) end
function M.norm(x, dim, keepdim) return reduce(C.TT_RNORM2, "norm", x, dim, keepdim) end
Tensor.sum, Tensor.mean, Tensor.max, Tensor.norm = M.sum, M.mean, M.max, M.norm

-- argmax along dim (no gradient).
function M.argmax(x, dim, keepdim)
  local cdim = dim and norm_dim(dim, x:dim()) - 1 or DIM_ALL
  outp[0], outp2[0] = nil, nil
  check(C.tt_op_reduce(C.TT_RMAX, cptr(x), cdim, keepdim and 1 or 0, outp, outp2), 2)
  wrap(outp[0]):free()
  return wrap(outp2[0])
end
Tensor.argmax = M.argmax

local function softmax(x, log)
  outp[0] = nil
  check(C.tt_op_softmax(cptr(x), log and 1 or 0, outp), 3)
  local out = wrap(outp[0])
  if needs(x) then
    record(log and "log_softmax" or "softmax", out, { x }, 1, function(ctx, g)
      outp[0] = nil
      check(C.tt_op_softmax_backward(cptr(ctx:saved(1)), cptr(g:contiguous()), log and 1 or 0, outp))
      return { wrap(outp[0]) }
    end, { out })
  end
  return out
end
function M.softmax(x) return softmax(x, false) end
function M.log_softmax(x) return softmax(x, true) end
Tensor.softmax, Tensor.log_softmax = M.softmax, M.log_softmax

-- ---- matmul -------------------------------------------------------------------------

local function raw_matmul(a, b, ta, tb, out, beta)
  if out then
    outp[0] = cptr(out)
    check(C.tt_op_matmul(cptr(a), cptr(b), ta and 1 or 0, tb and 1 or 0, 1, beta or 0, outp), 3)
    return out
  end
  outp[0] = nil
  check(C.tt_op_matmul(cptr(a), cptr(b), ta and 1 or 0, tb and 1 or 0, 1, 0, outp), 3)
  return wrap(outp[0])
end
M.raw_matmul = raw_matmul

-- a @ b for 2-D or 3-D (batched) operands; a 2-D operand broadcasts.
function M.matmul(a, b)
  local out = raw_matmul(a, b)
  if needs(a, b) then
    local a3, b3 = a:dim() == 3, b:dim() == 3
    record("matmul", out, { a, b }, 2, function(ctx, g)
      local x, w = ctx:saved(1), ctx:saved(2)
      local ga, gb
      if ctx:needs(1) then
        -- da = g @ b^T ; b 2-D broadcasts over the batch of g
        ga = raw_matmul(g, w, false, true)
        if not a3 and b3 then local s = ga:sum(1); ga:free(); ga = s end
      end
      if ctx:needs(2) then
        if b3 then
          gb = raw_matmul(x, g, true, false) -- x 2-D broadcasts over g's batch
        else
          -- b 2-D: sum over the batch by folding it into the rows
          local x2 = a3 and x:reshape(-1, x:size(-1)) or x
          local g2 = a3 and g:reshape(-1, g:size(-1)) or g
          local acc, fresh = ctx:accum(2, true)
          if acc then
            raw_matmul(x2, g2, true, false, acc, fresh and 0 or 1)
          else
            gb = raw_matmul(x2, g2, true, false)
          end
          if x2 ~= x then x2:free() end
          if g2 ~= g then g2:free() end
        end
      end
      return { ga, gb }
    end, { a, b })
  end
  return out
end
Tensor.matmul = M.matmul

-- ---- indexing -------------------------------------------------------------------------

function M.index_select(src, dim, index)
  dim = norm_dim(dim, src:dim())
  local out = call_out(C.tt_op_index_select, cptr(src), dim - 1, cptr(index))
  if needs(src) then
    local shape, dt, dev = src:shape(), src:dtype(), src:device()
    record("index_select", out, { src }, 1, function(ctx, g)
      local z = tensor.zeros(shape, { dtype = dt, device = dev })
      check(C.tt_op_index_add(z._c, dim - 1, cptr(ctx:saved(1)), cptr(g)))
      return { z }
    end, { index })
  end
  return out
end
Tensor.index_select = M.index_select

function M.gather(src, dim, index)
  dim = norm_dim(dim, src:dim())
  local out = call_out(C.tt_op_gather, cptr(src), dim - 1, cptr(index))
  if needs(src) then
    local shape, dt, dev = src:shape(), src:dtype(), src:device()
    record("gather", out, { src }, 1, function(ctx, g)
      local z = tensor.zeros(shape, { dtype = dt, device = dev })
      check(C.tt_op_scatter_add(z._c, dim - 1, cptr(ctx:saved(1)), cptr(g)))
      return { z }
    end, { index })
  end
  return out
end
Tensor.gather = M.gather

-- In place, not differentiable (used by backward passes and data code).
function Tensor:index_add_(dim, index, src)
  check(C.tt_op_index_add(cptr(self), norm_dim(dim, self:dim()) - 1, cptr(index), cptr(src)), 2)
  return self
end
function Tensor:scatter_add_(dim, index, src)
  check(C.tt_op_scatter_add(cptr(self), norm_dim(dim, self:dim()) - 1, cptr(index), cptr(src)), 2)
  return self
end

-- ---- optimizer primitives (not recorded) ------------------------------

-- One fused AdamW step on `param` (see tt_op_adamw): hp = {lr, betas =
-- {b1, b2}, eps, weight_decay, step}; master (f32) optional for bf16 params.
function M.adamw_(param, grad, exp_avg, exp_avg_sq, hp, master)
  local b = hp.betas or { 0.9, 0.999 }
  check(C.tt_op_adamw(cptr(param), cptr(grad), cptr(exp_avg), cptr(exp_avg_sq), master and cptr(master) or nil,
    hp.lr, b[1], b[2], hp.eps or 1e-8, hp.weight_decay or 0, hp.step), 2)
  return param
end

-- One AdamW step over many tensors (see tt_op_adamw_multi): entries =
-- { {param, grad, exp_avg, exp_avg_sq, master (or nil), step}, ... } sharing
-- hp = {lr, betas, eps, weight_decay}. The same bits as an adamw_ per
-- entry, in a few launches on a GPU.
function M.adamw_multi_(entries, hp)
  local n = #entries
  local b = hp.betas or { 0.9, 0.999 }
  local k = math.max(n, 1)
  local P, G, Mm, V, W = ffi.new("tt_tensor*[?]", k), ffi.new("tt_tensor*[?]", k), ffi.new("tt_tensor*[?]", k),
    ffi.new("tt_tensor*[?]", k), ffi.new("tt_tensor*[?]", k)
  local steps = ffi.new("int64_t[?]", k)
  for i, e in ipairs(entries) do
    P[i - 1], G[i - 1], Mm[i - 1], V[i - 1] = cptr(e[1]), cptr(e[2]), cptr(e[3]), cptr(e[4])
    W[i - 1] = e[5] and cptr(e[5]) or nil
    steps[i - 1] = e[6]
  end
  check(C.tt_op_adamw_multi(n, P, G, Mm, V, W, hp.lr, b[1], b[2], hp.eps or 1e-8, hp.weight_decay or 0, steps), 2)
end

-- In place over a list of contiguous tensors in few launches (see
-- tt_op_scale_multi): every x *= alpha, or every x = value.
local function tensor_array(ts)
  local arr = ffi.new("tt_tensor*[?]", math.max(#ts, 1))
  for i = 1, #ts do arr[i - 1] = cptr(ts[i]) end
  return arr
end
function M.scale_multi_(ts, alpha) check(C.tt_op_scale_multi(#ts, tensor_array(ts), alpha), 2) end
function M.fill_multi_(ts, value) check(C.tt_op_fill_multi(#ts, tensor_array(ts), value), 2) end

-- L2 norm over a list of tensors, accumulated in f64 in list order.
local norm_out = ffi.new("double[1]")
function M.global_norm(ts)
  check(C.tt_op_global_norm(#ts, tensor_array(ts), norm_out), 2)
  return norm_out[0]
end

-- The optimizer step with its per-step numbers in device memory, which a
-- CUDA graph can capture once (see tt_op_adamw_multi_dev in titan.h):
--   global_norm_dev_(grads, max_norm, out)  out (f64 {2}) = {norm, clip coefficient}
--   adamw_scalars(entries, hp) -> f32 CPU tensor {1 + 2n} of the step's scalars
--   adamw_multi_dev_(entries, hp, scalars, norm_clip)  entries as adamw_multi_
function M.global_norm_dev_(ts, max_norm, out)
  check(C.tt_op_global_norm_dev(#ts, tensor_array(ts), max_norm or 0, cptr(out)), 2)
  return out
end

function M.adamw_scalars(entries, hp)
  local n = #entries
  local b = hp.betas or { 0.9, 0.999 }
  local steps = ffi.new("int64_t[?]", math.max(n, 1))
  for i, e in ipairs(entries) do steps[i - 1] = e[6] end
  local out = tensor.empty({ 1 + 2 * n }, { dtype = "float32", device = "cpu" })
  check(C.tt_adamw_scalars(n, hp.lr, b[1], b[2], hp.weight_decay or 0, steps,
    ffi.cast("float*", C.tt_tensor_data(cptr(out)))), 2)
  return out
end

function M.adamw_multi_dev_(entries, hp, scalars, norm_clip)
  local n = #entries
  local b = hp.betas or { 0.9, 0.999 }
  local k = math.max(n, 1)
  local P, G, Mm, V, W = ffi.new("tt_tensor*[?]", k), ffi.new("tt_tensor*[?]", k), ffi.new("tt_tensor*[?]", k),
    ffi.new("tt_tensor*[?]", k), ffi.new("tt_tensor*[?]", k)
  for i, e in ipairs(entries) do
    P[i - 1], G[i - 1], Mm[i - 1], V[i - 1] = cptr(e[1]), cptr(e[2]), cptr(e[3]), cptr(e[4])
    W[i - 1] = e[5] and cptr(e[5]) or nil
  end
  check(C.tt_op_adamw_multi_dev(n, P, G, Mm, V, W, b[1], b[2], hp.eps or 1e-8, cptr(scalars),
    norm_clip and cptr(norm_clip) or nil), 2)
end

return M
