-- cp.lua — context parallelism: each sequence split over the cp ranks, so
-- a rank holds T / cp of its tokens' activations (long contexts), as
-- TorchTitan's context_parallel_degree, with its two rotate methods:
--
--   "allgather" (Llama 3's context parallelism): every rank all-gathers the
--     keys and values of the whole sequence, which grouped-query heads keep
--     small, and runs each local chunk against the keys up to its end.
--   "alltoall" (ring attention, lua/parallel/cp_ring.lua): the keys and
--     values travel around the ring of cp ranks a rank's share at a time,
--     so no rank ever holds more than two shares of them.
--
-- Load balancing (head-tail): the sequence is cut into 2 cp chunks and
-- rank r holds chunks r and 2 cp - 1 - r, so every rank has as much causal
-- attention work (an early chunk sees few keys, a late one many) and, in
-- the ring, every step costs each rank the same.
--
-- Each rank embeds, normalizes and projects its own tokens; RoPE rotates
-- them by their positions in the whole sequence; attention is one of the
-- two above; the loss is each rank's tokens' share of the global mean, and
-- the cp ranks take part in the gradient sums as data-parallel ranks do
-- (lua/titan/trainer.lua).
--
--   local cp = require("parallel.cp")
--   cp.apply(model, group, { rotate_method = "alltoall" })  -- model: lua/models/llama3.lua
--   local ids_local = cp.shard(ids, group:rank(), group:size())
local titan = require("titan")
local autograd = require("titan.autograd")
local memory = require("titan.memory")
local tensor = require("titan.tensor")
local tffi = require("titan.ffi")

local C = tffi.C
local ffi = tffi.ffi

local M = {}

-- The two chunks (0-based, of 2 cp) that rank r holds.
function M.chunks(r, cp) return r, 2 * cp - 1 - r end

-- x [B, T, ...] -> this rank's [B, T / cp, ...]: its two chunks along dim 2, in order.
function M.shard(x, rank, cp)
  local T = x:size(2)
  if T % (2 * cp) ~= 0 then
    error(("cp: a sequence of %d tokens does not split into 2 x %d chunks"):format(T, cp), 2)
  end
  local L = T / (2 * cp)
  local a, b = M.chunks(rank, cp)
  return memory.scope(function()
    return titan.no_grad(function()
      return titan.cat({ x:narrow(2, a * L + 1, L), x:narrow(2, b * L + 1, L) }, 2)
    end)
  end)
end

-- The positions (0-based) of this rank's tokens in a sequence of T.
function M.positions(T, rank, cp)
  local L = T / (2 * cp)
  local a, b = M.chunks(rank, cp)
  local p = {}
  for i = 0, L - 1 do p[#p + 1] = a * L + i end
  for i = 0, L - 1 do p[#p + 1] = b * L + i end
  return p
end

-- ---- gathering keys and values -------------------------------------------------
-- The collectives split dim 0, so the sequence goes first for them:
-- [Tl, B, H, D], rank r's block being its chunks r and 2 cp - 1 - r.

-- [B, Tl, H, D] of every rank -> [B, S, H, D] in the sequence's order.
local function gather_whole(x, group)
  local cp = group:size()
  local Tl = x:size(2)
  local L = Tl / 2
  return memory.scope(function()
    local all = group:all_gather(x:transpose(1, 2):contiguous()) -- [cp Tl, B, H, D]
    local parts = {}
    for c = 0, 2 * cp - 1 do
      local r, half = c, 0
      if c >= cp then r, half = 2 * cp - 1 - c, 1 end
      parts[#parts + 1] = all:narrow(1, r * Tl + half * L + 1, L)
    end
    return titan.cat(parts, 1):transpose(1, 2):contiguous()
  end)
end

-- The inverse: seq [S, B, H, D] (the sequence first) summed over the ranks,
-- each keeping its [B, Tl, H, D].
local function reduce_scatter_whole(seq, group)
  local cp = group:size()
  local S = seq:size(1)
  local L = S / (2 * cp)
  return memory.scope(function()
    local parts = {}
    for r = 0, cp - 1 do
      local a, b = M.chunks(r, cp)
      parts[#parts + 1] = seq:narrow(1, a * L + 1, L)
      parts[#parts + 1] = seq:narrow(1, b * L + 1, L)
    end
    local mine = group:reduce_scatter(titan.cat(parts, 1), "sum") -- [Tl, B, H, D]
    return mine:transpose(1, 2):contiguous()
  end)
end

-- ---- attention --------------------------------------------------------------------

local o1, o2, o3 = ffi.new("tt_tensor*[1]"), ffi.new("tt_tensor*[1]"), ffi.new("tt_tensor*[1]")
local function check(st) tffi.check(st, 3) end

-- q [B, Tl, Hq, D], k and v [B, Tl, Hkv, D] of this rank's tokens -> the
-- attention output of its tokens over the whole sequence (causal). What
-- the backward needs is saved on the tape (its node frees it), made in the
-- caller's scope as any op's output is.
local Attention = autograd.Function {
  name = "cp_attention",
  forward = function(ctx, q, k, v, cp)
    local group, rank, n = cp.group, cp.group:rank(), cp.group:size()
    local L = q:size(2) / 2
    local scale = 1 / math.sqrt(q:size(-1))
    ctx.group, ctx.scale, ctx.L = group, scale, L
    local K, V = gather_whole(k, group), gather_whole(v, group)
    local saved, outs = {}, {}
    local a, b = M.chunks(rank, n)
    ctx.spans = { (a + 1) * L, (b + 1) * L } -- the keys each local chunk attends to
    for j = 1, 2 do
      local qj = q:narrow(2, (j - 1) * L + 1, L):contiguous()
      local kj = K:narrow(2, 1, ctx.spans[j]):contiguous()
      local vj = V:narrow(2, 1, ctx.spans[j]):contiguous()
      o1[0], o2[0] = nil, nil
      check(C.tt_op_attention(qj._c, kj._c, vj._c, 1, scale, o1, o2))
      local oj, lse = tensor.wrap(o1[0]), tensor.wrap(o2[0])
      outs[j] = oj
      for _, t in ipairs({ qj, kj, vj, oj, lse }) do saved[#saved + 1] = t end
    end
    K:free()
    V:free()
    ctx:save_for_backward(unpack(saved))
    return titan.cat(outs, 2)
  end,
  backward = function(ctx, g)
    local group, n, L = ctx.group, ctx.group:size(), ctx.L
    local sv = ctx.saved_tensors
    return memory.scope(function()
      local B, S = g:size(1), 2 * n * L
      local Hkv, D = sv[2]:size(3), sv[2]:size(4)
      -- (the sequence first: a chunk's keys are then one contiguous run to add into)
      local dK = titan.zeros({ S, B, Hkv, D }, { dtype = g:dtype(), device = g:device() })
      local dV = titan.zeros({ S, B, Hkv, D }, { dtype = g:dtype(), device = g:device() })
      local dqs = {}
      for j = 1, 2 do
        local qj, kj, vj, oj, lse = unpack(sv, 5 * j - 4, 5 * j)
        local gj = g:narrow(2, (j - 1) * L + 1, L):contiguous()
        o1[0], o2[0], o3[0] = nil, nil, nil
        check(C.tt_op_attention_backward(qj._c, kj._c, vj._c, oj._c, lse._c, gj._c, 1, ctx.scale, o1, o2, o3))
        dqs[j] = tensor.wrap(o1[0])
        local dkj, dvj = tensor.wrap(o2[0]), tensor.wrap(o3[0])
        dK:narrow(1, 1, ctx.spans[j]):add_(dkj:transpose(1, 2):contiguous())
        dV:narrow(1, 1, ctx.spans[j]):add_(dvj:transpose(1, 2):contiguous())
      end
      return titan.cat(dqs, 2), reduce_scatter_whole(dK, group), reduce_scatter_whole(dV, group), nil
    end)
  end,
}

-- ---- the model ----------------------------------------------------------------------

local Ctx = {}
Ctx.__index = Ctx

-- The attention of this rank's tokens (the model's Attention modules call it).
function Ctx:attention(q, k, v)
  if self.rotate_method == "alltoall" then return require("parallel.cp_ring").attention(q, k, v, self) end
  return Attention(q, k, v, self)
end

-- RoPE tables for this rank's tokens: the rows of the whole sequence's at
-- their positions (so F.rope's offset 0 rotates each by its own), kept
-- until the tables or the length change.
function Ctx:rope_tables(full, T_local)
  local n = self.group:size()
  local T = T_local * n
  local r = self.rope
  if r and r.full == full and r.T == T and r.cos_src == full.cos then return r end
  if r then r.cos:free(); r.sin:free() end
  local dev = full.cos:device()
  local pos = titan.tensor(M.positions(T, self.group:rank(), n), { dtype = "int64" }):to(dev)
  r = { cos = memory.keep(titan.index_select(full.cos, 1, pos)),
    sin = memory.keep(titan.index_select(full.sin, 1, pos)), full = full, T = T, cos_src = full.cos }
  pos:free()
  self.rope = r
  return r
end

function Ctx:free()
  if self.rope then self.rope.cos:free(); self.rope.sin:free(); self.rope = nil end
end

M.rotate_methods = { allgather = true, alltoall = true }

-- The context of `group`'s ranks: ctx:attention(q, k, v) on their tokens.
-- opts.rotate_method: "allgather" (default) or "alltoall" (ring attention).
function M.context(group, opts)
  local method = (opts or {}).rotate_method or "allgather"
  if not M.rotate_methods[method] then
    error(("cp: rotate_method '%s'; expected allgather or alltoall"):format(tostring(method)), 2)
  end
  return setmetatable({ group = group, rotate_method = method }, Ctx)
end

-- Make `model` (a lua/models/llama3.lua Transformer) context parallel over
-- `group` through its slots: the model's rope_positions (the tables cover
-- the whole sequence), and each Attention's rope_slice (this rank's
-- positions) and sdpa (attention over every rank's keys). opts: as
-- M.context's. Returns the context.
function M.apply(model, group, opts)
  if type(model.rope_positions) ~= "function" then
    error("cp: the model family has no rope_positions slot (expected lua/models/llama3.lua's Transformer)", 2)
  end
  local ctx = M.context(group, opts)
  local n = group:size()
  rawset(model, "rope_positions", function(_, T) return T * n end)
  local found = 0
  for _, nm in ipairs(model:named_modules()) do
    local m = nm[2]
    if type(m.sdpa) == "function" and type(m.rope_slice) == "function" then
      rawset(m, "rope_slice", function(_, rope, T) return ctx:rope_tables(rope, T) end)
      rawset(m, "sdpa", function(_, q, k, v) return ctx:attention(q, k, v) end)
      found = found + 1
    end
  end
  if found == 0 then error("cp: the model has no attention with sdpa and rope_slice slots", 2) end
  return ctx
end

-- The banner's line (lua/parallel/describe.lua): par, the job laid out.
function M.describe(par)
  if not par.cp_group then return nil end
  local cp, T = par.dims.cp, par.cfg.training.seq_len
  return ("context parallel over %s: %d ranks per sequence, each holding %d of its %d tokens (of %d chunks, "
    .. "rank r the r-th from the start and from the end: the same causal work); %s; gradients summed over the "
    .. "data-parallel and context-parallel ranks%s"):format(require("parallel.describe").over(par), cp, T / cp, T, 2 * cp,
    par.cp_rotate == "alltoall"
    and "ring attention (alltoall): keys and values passed around the cp ranks a rank's share at a time"
    or "keys and values all-gathered, their gradients reduce-scattered", par.fsdp and " (FSDP shards over both)" or "")
end

return M
