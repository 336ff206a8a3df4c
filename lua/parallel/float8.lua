-- float8.lua — float8 linear layers (TorchTitan's `model.converters =
-- "float8"`, torchao's Float8Linear with the "tensorwise" recipe): each
-- converted Linear multiplies in fp8 on the tensor cores, at twice bf16's
-- rate on an H100/H200, with its master weights, optimizer and every other
-- op unchanged.
--
-- Dynamic tensorwise scaling: before each GEMM, each operand is scaled by
-- one factor so that its largest magnitude lands on the fp8 format's
-- largest value, and cast (tt_op_to_float8; the scale stays on the device):
--
--   forward   y  = x W^T       x, W in e4m3 (3 mantissa bits, range 448)
--   backward  dx = dy W        dy in e5m2 (2 mantissa bits, range 57344:
--             dW = dy^T x      gradients span more orders of magnitude)
--
-- tt_op_matmul_float8 multiplies the fp8 operands with their two inverse
-- scales (cuBLASLt's scale pointers; the forward with its fast accumulation,
-- the gradients without, as torchao). The fp8 copies of x and W made for
-- the forward are what the backward keeps (half of bf16's bytes), and it
-- lays them out again along the other dimension (cuBLASLt's fp8 GEMMs take
-- both operands contiguous along the summed dimension).
--
-- Which layers: every nn.Linear whose name contains none of filter_fqns
-- (default "output": the last layer's logits stay in bf16, as TorchTitan)
-- and whose in and out features are multiples of 16 (cuBLASLt's fp8 rule;
-- torchao skips the others too).
--
-- On the CPU the GEMM widens the fp8 values to f32 (ops_float8.c): the
-- numerics of a GPU run, for tests and for reading, slower than f32.
--
--   local float8 = require("parallel.float8")
--   local converted = float8.apply(model, { filter_fqns = { "output" } })
local autograd = require("titan.autograd")
local tensor = require("titan.tensor")
local tffi = require("titan.ffi")

local C = tffi.C
local ffi = tffi.ffi

local M = {}

local o1, o2 = ffi.new("tt_tensor*[1]"), ffi.new("tt_tensor*[1]")
local function check(st) tffi.check(st, 3) end

M.recipes = { tensorwise = true }

-- x (contiguous f32/bf16/f16) -> x in fp8 ("float8_e4m3fn" or
-- "float8_e5m2") scaled to the format's range, and the 0-d f32 inverse scale.
-- group: x is this rank's shard of a tensor split over the group (tensor
-- parallelism): the scale comes from the largest magnitude of every shard
-- (an all-reduce of one number), so every rank casts as one rank holding
-- the whole tensor would.
function M.to_float8(x, dtype, group)
  local amax
  if group then
    o1[0] = nil
    check(C.tt_op_float8_amax(x._c, o1))
    amax = tensor.wrap(o1[0])
    group:all_reduce(amax, "max")
  end
  o1[0], o2[0] = nil, nil
  check(C.tt_op_to_float8(x._c, tensor.dtype_of(dtype), amax and amax._c or nil, o1, o2))
  if amax then amax:free() end
  return tensor.wrap(o1[0]), tensor.wrap(o2[0])
end

-- a [M, K], b [N, K] fp8 with their inverse scales -> a b^T [M, N] of
-- out_dtype; opts.out: added into (accumulate); opts.into: written into;
-- opts.fast_accum.
function M.matmul(a, b, sa, sb, out_dtype, opts)
  opts = opts or {}
  local given = opts.out or opts.into
  o1[0] = given and given._c or nil
  check(C.tt_op_matmul_float8(a._c, b._c, sa._c, sb._c, tensor.dtype_of(out_dtype), opts.out and 1 or 0,
    opts.fast_accum and 1 or 0, o1))
  return given or tensor.wrap(o1[0])
end

-- A packed transpose of a 2-D tensor (fp8 included).
local function transposed(t) return t:t():contiguous() end

local Linear8 = autograd.Function {
  name = "float8_linear",
  -- kept: this output, kept from the forward by a per-op checkpointing
  -- policy (a recomputation): the casts run again for the backward, the GEMM
  -- not. pre: { w8, scale_inv }, the weight FSDP gathered in fp8 (w is then
  -- only where its gradient goes: it has no memory).
  forward = function(ctx, x, w, group, kept, pre)
    local shape = x:shape()
    local K, N = shape[#shape], w:size(1)
    local x2 = x:reshape(-1, K)
    local xc = x2:contiguous()
    local x8, sx = M.to_float8(xc, "float8_e4m3fn", group)
    if xc ~= x2 then xc:free() end
    if x2 ~= x then x2:free() end
    local w8, sw
    if pre then w8, sw = pre[1], pre[2] else w8, sw = M.to_float8(w:contiguous(), "float8_e4m3fn", group) end
    ctx.group = group
    -- (autograd is off inside a Function's forward: ask the tensors themselves)
    ctx.need_x, ctx.need_w = x.requires_grad == true, w.requires_grad == true
    ctx.x_dtype, ctx.w_dtype, ctx.shape = x:dtype(), w:dtype(), shape
    ctx:save_for_backward(x8, sx, w8, sw)
    if kept then return kept end
    local y = M.matmul(x8, w8, sx, sw, x:dtype(), { fast_accum = true })
    local out_shape = { unpack(shape) }
    out_shape[#out_shape] = N
    if #shape == 2 then return y end
    local yv = y:view(out_shape)
    y:free()
    return yv
  end,
  backward = function(ctx, g)
    local x8, sx, w8, sw = unpack(ctx.saved_tensors)
    local N = w8:size(1)
    local g2 = g:reshape(-1, N)
    local gc = g2:contiguous()
    local g8, sg = M.to_float8(gc, "float8_e5m2", ctx.group)
    if gc ~= g2 then gc:free() end
    if g2 ~= g then g2:free() end
    local dx, dw
    if ctx.need_x then -- dx [M, K] = dy [M, N] . W [N, K]: W laid out along N
      local w8t = transposed(w8)
      local dx2 = M.matmul(g8, w8t, sg, sw, ctx.x_dtype)
      w8t:free()
      dx = #ctx.shape == 2 and dx2 or dx2:view(ctx.shape)
      if dx ~= dx2 then dx2:free() end
    end
    if ctx.need_w then -- dW [N, K] = dy^T [N, M] . x [M, K]: both laid out along M
      local g8t, x8t = transposed(g8), transposed(x8)
      dw = M.matmul(g8t, x8t, sg, sx, ctx.w_dtype)
      g8t:free(); x8t:free()
    end
    g8:free(); sg:free()
    return dx, dw, nil, nil, nil
  end,
}

-- The weights FSDP gathered in fp8, by parameter (weak keys): { w8, scale_inv }.
M.gathered = setmetatable({}, { __mode = "k" })

-- FSDP's opts.fp8 for the converted layers of `model` (materialized: the
-- weights as the modules hold them now): their weights are cast per shard
-- with the scale of the whole (the largest magnitude over every shard) and
-- gathered in fp8, and the layers multiply with them (torchao's
-- enable_fsdp_float8_all_gather: the same bits as casting the gathered weight).
function M.fsdp_fp8(model)
  local params = {}
  for _, nm in ipairs(model:named_modules()) do
    if rawget(nm[2], "float8") then params[rawget(nm[2], "weight")] = true end
  end
  return {
    params = params, dtype = "float8_e4m3fn",
    amax = function(t)
      o1[0] = nil
      check(C.tt_op_float8_amax(t._c, o1))
      return tensor.wrap(o1[0])
    end,
    cast = function(t, amax)
      o1[0], o2[0] = nil, nil
      check(C.tt_op_to_float8(t._c, tensor.dtype_of("float8_e4m3fn"), amax._c, o1, o2))
      return tensor.wrap(o1[0]), tensor.wrap(o2[0])
    end,
    publish = function(param, w8, scale_inv) M.gathered[param] = w8 and { w8, scale_inv } or nil end,
  }
end

-- y = x W^T through fp8 (no bias: Llama's linears have none); group: the
-- tensor-parallel ranks when x, W or the gradient are split over them.
function M.linear(x, w, group) return Linear8(x, w, group) end

-- A converted layer's forward. Under per-op activation checkpointing
-- (selective "op": lua/parallel/ac.lua) it counts as a linear, as F.linear
-- does: the policy may keep its output from the forward, and the
-- recomputation then skips its GEMM.
local function forward8(self, x)
  local kept = autograd.sac_lookup("linear")
  local y = Linear8(x, self.weight, rawget(self, "float8_group"), kept and kept[1], M.gathered[self.weight])
  if not kept then autograd.sac_store(y) end
  return y
end

-- Converts `model`'s Linear modules in place (their forward goes through
-- fp8); returns the converted modules' names and the skipped ones' with why.
-- opts.filter_fqns: names containing any of these strings stay (default { "output" });
-- opts.group: the tensor-parallel group (the scales then span every rank's shard);
-- opts.ungrouped(name): true for layers whose weights are whole on every rank and
-- whose calls differ between ranks (a mixture of experts: an expert with no
-- tokens on a rank does not run there), which scale by this rank's values alone.
function M.apply(model, opts)
  opts = opts or {}
  local filter = opts.filter_fqns or { "output" }
  local done, skipped = {}, {}
  for _, nm in ipairs(model:named_modules()) do
    local name, mod = nm[1], nm[2]
    if getmetatable(mod).__name == "Linear" then
      local why
      for _, f in ipairs(filter) do
        if f ~= "" and name:find(f, 1, true) then why = "filter_fqns '" .. f .. "'" end
      end
      if not why and (mod.in_features % 16 ~= 0 or mod.out_features % 16 ~= 0) then
        why = ("%d x %d: fp8 GEMMs take multiples of 16"):format(mod.out_features, mod.in_features)
      end
      if not why and mod.bias then why = "a bias (not built)" end
      if why then
        skipped[#skipped + 1] = { name, why }
      else
        rawset(mod, "forward", forward8)
        rawset(mod, "float8", true)
        if opts.group and not (opts.ungrouped and opts.ungrouped(name)) then rawset(mod, "float8_group", opts.group) end
        done[#done + 1] = name
      end
    end
  end
  return done, skipped
end

-- The banner's line (lua/parallel/describe.lua): par, the job laid out.
function M.describe(par)
  local f = par.float8_count
  if not f then return nil end
  return ("float8: %d Linear layers multiply in fp8 (tensorwise dynamic scaling: e4m3 forward, e5m2 "
    .. "gradients)%s%s%s"):format(f.done, #f.skipped > 0 and "; unconverted: " .. require("parallel.describe").counted(f.skipped) or "",
    par.cfg.float8.enable_fsdp_float8_all_gather and "; FSDP gathers the converted weights in fp8, each shard "
    .. "cast with the whole weight's scale" or "",
    par.device == "cpu" and "; on the CPU the fp8 values are widened to f32 (the numerics, not the speed)" or "")
end

return M
