-- functional.lua — differentiable neural-network primitives: linear,
-- embedding, RMSNorm, RoPE, attention, SwiGLU, cross-entropy. Each is one
-- fused C kernel forward and one backward; weight gradients are
-- accumulated straight into the parameters' .grad by the backward kernels.
local tensor = require("titan.tensor")
local autograd = require("titan.autograd")
local ops = require("titan.ops")
local tffi = require("titan.ffi")
local ffi, C, check = tffi.ffi, tffi.C, tffi.check

local wrap, cptr, call_out = tensor.wrap, tensor.cptr, tensor.call_out
local record, needs = autograd.record, autograd.needs

local M = {}

local o1 = ffi.new("tt_tensor*[1]")
local o2 = ffi.new("tt_tensor*[1]")
local o3 = ffi.new("tt_tensor*[1]")
local nvalid = ffi.new("int64_t[1]")

-- y = x @ w^T + b over the last dim of x. w: [out, in], b: [out] or nil
-- (any float dtype; added inside the GEMM, not as a separate pass).
function M.linear(x, w, b)
  local shape = x:shape()
  local din = shape[#shape]
  -- Under a per-op checkpointing policy the output may be kept from the
  -- forward (autograd.checkpoint_ops): then the recomputation takes it back.
  local kept = autograd.sac_lookup("linear")
  local y
  if kept then
    y = kept[1]
  else
    o1[0] = nil
    check(C.tt_op_linear(cptr(x), cptr(w), b and cptr(b) or nil, o1), 2)
    y = wrap(o1[0])
    autograd.sac_store(y)
  end
  local bias_dtype = b and b:dtype()
  if needs(x, w, b) then
    record("linear", y, { x, w, b }, 3, function(ctx, g)
      local xs, ws = ctx:saved(1), ctx:saved(2)
      local dout = ws:size(1)
      local g2 = g:dim() == 2 and g or g:reshape(-1, dout)
      local xs2 = xs:dim() == 2 and xs or xs:reshape(-1, din)
      local gx, gw, gb
      if ctx:needs(1) then
        -- x feeding several linears (q, k and v; SwiGLU's gate and up):
        -- the second and later add their dx inside the GEMM (beta = 1)
        -- rather than through a separate add over the activation.
        local waiting = ctx:pending_grad(1)
        if waiting and waiting:dtype() == g2:dtype() and waiting:is_contiguous() then
          local w2 = #shape == 2 and waiting or waiting:view(-1, din)
          ops.raw_matmul(g2, ws, false, false, w2, 1)
          if w2 ~= waiting then w2:free() end
        else
          local gx2 = ops.raw_matmul(g2, ws)
          gx = gx2
          if #shape ~= 2 then gx = gx2:reshape(shape); gx2:free() end
        end
      end
      if ctx:needs(2) then
        local acc, fresh = ctx:accum(2, true)
        if acc then ops.raw_matmul(g2, xs2, true, false, acc, fresh and 0 or 1)
        else gw = ops.raw_matmul(g2, xs2, true, false) end
      end
      if b and ctx:needs(3) then
        local s = ops.sum_to(g2, { dout })
        if s:dtype() ~= bias_dtype then -- an f32 bias of a bf16 layer: its gradient in f32 too
          local sc = s:to(bias_dtype)
          if s ~= g2 then s:free() end
          s = sc
        end
        local acc = ctx:accum(3)
        if acc then
          check(C.tt_op_axpy(acc._c, 1, s._c))
          if s ~= g2 then s:free() end
        else
          gb = s ~= g2 and s or s:clone()
        end
      end
      if g2 ~= g then g2:free() end
      if xs2 ~= xs then xs2:free() end
      return { gx, gw, gb }
    end, { x, w })
  end
  return y
end

-- rows of weight picked by integer ids (any shape) -> ids.shape .. [dim]
function M.embedding(weight, ids)
  local out = call_out(C.tt_op_embedding, cptr(weight), cptr(ids))
  if needs(weight) then
    record("embedding", out, { weight }, 1, function(ctx, g)
      local ids_s = ctx:saved(1)
      local acc = ctx:accum(1)
      local gc = g:is_contiguous() and g or g:clone()
      local gw
      if acc then
        check(C.tt_op_embedding_backward(gc._c, ids_s._c, acc._c))
      else
        gw = tensor.zeros(weight:shape(), { dtype = weight:dtype(), device = weight:device() })
        check(C.tt_op_embedding_backward(gc._c, ids_s._c, gw._c))
      end
      if gc ~= g then gc:free() end
      return { gw }
    end, { ids })
  end
  return out
end

-- The tape node of y = rms_norm(x, weight) (rstd: the forward's statistic).
-- dx goes straight onto a gradient already waiting for x when there is one:
-- in a transformer block x is the residual stream, whose other consumer's
-- gradient arrives first.
local function record_rms_norm(y, x, weight, rstd)
  record("rms_norm", y, { x, weight }, 2, function(ctx, g)
    local xs, ws, rs = ctx:saved(1), ctx:saved(2), ctx:saved(3)
    local gc = g:is_contiguous() and g or g:clone()
    local gw
    local acc = ctx:accum(2)
    if not acc and ctx:needs(2) then
      gw = tensor.zeros(ws:shape(), { dtype = ws:dtype(), device = ws:device() })
      acc = gw
    end
    local waiting = ctx:needs(1) and ctx:pending_grad(1)
    local gx
    if waiting then
      check(C.tt_op_rmsnorm_backward_acc(xs._c, ws._c, rs._c, gc._c, waiting._c, acc and acc._c or nil))
    else
      o1[0] = nil
      check(C.tt_op_rmsnorm_backward(xs._c, ws._c, rs._c, gc._c, o1, acc and acc._c or nil))
      gx = wrap(o1[0])
      if not ctx:needs(1) then gx:free(); gx = nil end
    end
    if gc ~= g then gc:free() end
    return { gx, gw }
  end, { x, weight, rstd })
end

function M.rms_norm(x, weight, eps)
  o1[0], o2[0] = nil, nil
  check(C.tt_op_rmsnorm(cptr(x), cptr(weight), eps or 1e-6, o1, o2), 2)
  local y, rstd = wrap(o1[0]), wrap(o2[0])
  if needs(x, weight) then record_rms_norm(y, x, weight, rstd) end
  rstd:free()
  return y
end

-- h = x + residual and y = rms_norm(h, weight) in one pass over memory;
-- returns h, y. The tape holds what the two ops apart would record.
function M.add_rms_norm(x, residual, weight, eps)
  o1[0], o2[0], o3[0] = nil, nil, nil
  check(C.tt_op_add_rmsnorm(cptr(x), cptr(residual), cptr(weight), eps or 1e-6, o1, o2, o3), 2)
  local h, y, rstd = wrap(o1[0]), wrap(o2[0]), wrap(o3[0])
  if needs(x, residual) then
    record("add", h, { x, residual }, 2, function(_, g) return { g, g } end)
  end
  if needs(h, weight) then record_rms_norm(y, h, weight, rstd) end
  rstd:free()
  return h, y
end

-- Precomputed rotary tables: {cos = [max_seq, head_dim/2], sin = ...}.
-- scaling: {factor, low_freq_factor, high_freq_factor, original_max_seq} (Llama 3.1).
function M.rope_tables(head_dim, max_seq, theta, scaling, opts)
  scaling = scaling or {}
  opts = opts or {}
  o1[0], o2[0] = nil, nil
  check(C.tt_op_rope_table(head_dim, max_seq, theta or 10000, scaling.factor or 1, scaling.low_freq_factor or 1,
    scaling.high_freq_factor or 4, scaling.original_max_seq or 8192, tensor.dtype_of(opts.dtype or "float32"), o1, o2), 2)
  local cos, sin = wrap(o1[0]), wrap(o2[0])
  if opts.device and opts.device ~= "cpu" then
    local c2, s2 = cos:to(opts.device), sin:to(opts.device)
    cos:free(); sin:free()
    cos, sin = c2, s2
  end
  return { cos = cos, sin = sin }
end

-- x: [B, T, H, D]; rotates by positions pos_offset .. pos_offset + T - 1.
function M.rope(x, tables, pos_offset)
  pos_offset = pos_offset or 0
  local out = call_out(C.tt_op_rope, cptr(x), cptr(tables.cos), cptr(tables.sin), pos_offset, 0)
  if needs(x) then
    record("rope", out, { x }, 1, function(_, g)
      local gc = g:is_contiguous() and g or g:clone()
      local r = call_out(C.tt_op_rope, gc._c, cptr(tables.cos), cptr(tables.sin), pos_offset, 1)
      if gc ~= g then gc:free() end
      return { r }
    end)
  end
  return out
end

-- Scaled dot-product attention; q [B, T, Hq, D], k/v [B, S, Hkv, D].
-- opts: causal (default true), scale (default 1/sqrt(D)).
function M.attention(q, k, v, opts)
  opts = opts or {}
  local causal = opts.causal ~= false
  local scale = opts.scale or 1 / math.sqrt(q:size(-1))
  local out, lse
  local kept = autograd.sac_lookup("attention") -- (as in linear)
  if kept then
    out, lse = kept[1], kept[2]
  else
    o1[0], o2[0] = nil, nil
    check(C.tt_op_attention(cptr(q), cptr(k), cptr(v), causal and 1 or 0, scale, o1, o2), 2)
    out, lse = wrap(o1[0]), wrap(o2[0])
    autograd.sac_store(out, lse)
  end
  if needs(q, k, v) then
    record("attention", out, { q, k, v }, 3, function(ctx, g)
      local gc = g:is_contiguous() and g or g:clone()
      o1[0], o2[0], o3[0] = nil, nil, nil
      check(C.tt_op_attention_backward(ctx:saved(1)._c, ctx:saved(2)._c, ctx:saved(3)._c, ctx:saved(4)._c,
        ctx:saved(5)._c, gc._c, causal and 1 or 0, scale, o1, o2, o3))
      if gc ~= g then gc:free() end
      local gq, gk, gv = wrap(o1[0]), wrap(o2[0]), wrap(o3[0])
      if not ctx:needs(1) then gq:free(); gq = nil end
      if not ctx:needs(2) then gk:free(); gk = nil end
      if not ctx:needs(3) then gv:free(); gv = nil end
      return { gq, gk, gv }
    end, { q, k, v, out, lse })
  end
  lse:free()
  return out
end

-- silu(a) * b
function M.swiglu(a, b)
  local out = call_out(C.tt_op_swiglu, cptr(a), cptr(b))
  if needs(a, b) then
    record("swiglu", out, { a, b }, 2, function(ctx, g)
      local gc = g:is_contiguous() and g or g:clone()
      o1[0], o2[0] = nil, nil
      check(C.tt_op_swiglu_backward(ctx:saved(1)._c, ctx:saved(2)._c, gc._c, o1, o2))
      if gc ~= g then gc:free() end
      local ga, gb = wrap(o1[0]), wrap(o2[0])
      if not ctx:needs(1) then ga:free(); ga = nil end
      if not ctx:needs(2) then gb:free(); gb = nil end
      return { ga, gb }
    end, { a, b })
  end
  return out
end

-- Cross-entropy of logits [N, V] against integer targets [N].
-- opts: ignore_index (-100), reduction ("mean" | "sum" | "none"),
-- num_tokens (the mean's denominator; default: the local count of targets
-- that are not ignored — a trainer passes the global count).
-- Returns the loss and, without num_tokens, the number of targets that
-- counted (nil with num_tokens: counting GPU targets waits for the GPU,
-- which a train step must not do).
function M.cross_entropy(logits, targets, opts)
  opts = opts or {}
  local ignore = opts.ignore_index or -100
  local reduction = opts.reduction or "mean"
  local want_count = opts.num_tokens == nil
  o1[0], o2[0] = nil, nil
  check(C.tt_op_cross_entropy(cptr(logits), cptr(targets), ignore, o1, o2, want_count and nvalid or nil), 2)
  local losses, lse = wrap(o1[0]), wrap(o2[0])
  local count = want_count and tonumber(nvalid[0]) or nil
  local N = logits:size(1)
  local out, factor
  if reduction == "none" then
    out, factor = losses, nil
  else
    local denom = reduction == "mean" and (opts.num_tokens or count) or 1
    factor = denom > 0 and 1 / denom or 0
    o3[0] = nil
    check(C.tt_op_reduce(C.TT_RSUM, losses._c, -100, 0, o3, nil), 2)
    out = wrap(o3[0])
    if factor ~= 1 then out:mul_(factor) end
  end
  if needs(logits) then
    record("cross_entropy", out, { logits }, 1, function(ctx, g)
      local dl
      if factor then -- every row gets g * factor (ignored rows are zeroed by the kernel)
        local gs = g:reshape(1)
        local e = call_out(C.tt_view_expand, gs._c, 1, tensor.fill_shape({ N }))
        dl = e:clone()
        e:free(); gs:free()
        if factor ~= 1 then dl:mul_(factor) end
      else
        dl = g:is_contiguous() and g or g:clone()
      end
      o1[0] = nil
      check(C.tt_op_cross_entropy_backward(ctx:saved(1)._c, ctx:saved(2)._c, ctx:saved(3)._c, dl._c, ignore, o1))
      if dl ~= g then dl:free() end
      return { wrap(o1[0]) }
    end, { logits, targets, lse })
  end
  lse:free()
  if out ~= losses then losses:free() end
  return out, count
end

return M
