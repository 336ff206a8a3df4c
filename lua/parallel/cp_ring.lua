-- cp_ring.lua — ring attention: context parallelism's rotate method
-- "alltoall" (lua/parallel/cp.lua holds the sharding, the "allgather"
-- method and the context that picks one).
--
-- The keys and values travel around the ring of cp ranks a rank's share
-- at a time; each rank runs its queries against the share it holds and
-- folds the block into its running output with the blocks' log-sum-exps
-- (tt_op_attention_merge), so no rank ever holds more than two shares of
-- keys and values. The backward walks the ring again with the final output
-- and log-sum-exp (then a block's probabilities are the whole row's), the
-- keys' and values' gradients travelling with them back to their owners.
-- PyTorch names the ring's neighbour exchange after the all_to_all it is
-- made of; here each step is one batch of sends and receives.
--
--   require("parallel.cp_ring").attention(q, k, v, ctx)  -- ctx: cp.context(group)
local titan = require("titan")
local autograd = require("titan.autograd")
local memory = require("titan.memory")
local tensor = require("titan.tensor")
local tffi = require("titan.ffi")

local C = tffi.C
local ffi = tffi.ffi

local M = {}

local o1, o2, o3 = ffi.new("tt_tensor*[1]"), ffi.new("tt_tensor*[1]"), ffi.new("tt_tensor*[1]")
local function check(st) tffi.check(st, 3) end

-- The blocks rank r runs against the keys and values of rank src (its
-- chunks src and 2 cp - 1 - src, L rows each, in that order): { first query
-- row, query rows, key rows (from the first), causal }. Chunk a = r is
-- always before chunk b = 2 cp - 1 - r, and causal aligns the last query
-- with the last key, so
--   src == r: chunk a against chunk a (causal); chunk b against a and b (causal)
--   src <  r: both chunks against chunk src (all of it; src's other chunk is after b)
--   src >  r: chunk b against both of src's chunks (all; chunk a is before both)
-- and every step but the first is the same 2 L x L of work on every rank.
local function ring_blocks(r, src, L)
  if src == r then return { { 0, L, L, true }, { L, L, 2 * L, true } } end
  if src < r then return { { 0, 2 * L, L, false } } end
  return { { L, L, 2 * L, false } }
end

-- Rows first .. first + n - 1 (0-based) of x along dim, packed.
local function rows(x, dim, first, n)
  if first == 0 and n == x:size(dim) then return x end
  return x:narrow(dim, first + 1, n):contiguous()
end

-- x [B, n, H, D] added, in the accumulator's dtype, into rows first.. of a
-- sequence-first accumulator [T, B, H, D] (its rows are then one contiguous run).
local function add_rows(acc, first, x)
  local t = titan.empty({ x:size(2), x:size(1), x:size(3), x:size(4) }, { dtype = acc:dtype(), device = acc:device() })
  t:copy_(x:transpose(1, 2))
  acc:narrow(1, first + 1, x:size(2)):add_(t)
  t:free()
end

-- The log-sum-exps, running outputs and gradients are f32 (f64 for f64): a
-- bf16 ring rounds once at the end, not once per block (as PyTorch's).
local function stat_dtype(x) return x:dtype() == "float64" and "float64" or "float32" end

-- t sent to the next rank of the ring while the previous one's arrives in a
-- new tensor (started, not waited for: on nccl it overlaps the blocks run meanwhile).
local function rotate(group, ts)
  local r, n = group:rank(), group:size()
  local ops, got = {}, {}
  for i, t in ipairs(ts) do
    got[i] = titan.empty(t:shape(), { dtype = t:dtype(), device = t:device() })
    ops[#ops + 1] = { "send", t, (r + 1) % n, i }
    ops[#ops + 1] = { "recv", got[i], (r - 1) % n, i }
  end
  return got, group:batch_p2p_async(ops)
end

-- fn(src, k_share, v_share) for each rank's share of the keys and values, in
-- the order the ring brings them (src = r, r - 1, ...), the next share on
-- its way while fn runs; each share that arrived is freed after its step.
local function walk(group, k, v, fn)
  local r, n = group:rank(), group:size()
  local kc, vc = k, v
  for s = 0, n - 1 do
    local nxt, work
    if s < n - 1 then nxt, work = rotate(group, { kc, vc }) end
    fn((r - s) % n, kc, vc)
    if work then work:wait() end
    if kc ~= k then kc:free(); vc:free() end
    if nxt then kc, vc = nxt[1], nxt[2] end
  end
end

-- Frees the packed copies rows() made: each of ts that is none of keep.
local function free_copies(ts, keep)
  for _, t in ipairs(ts) do
    local kept = false
    for _, x in ipairs(keep) do kept = kept or t == x end
    if not kept then t:free() end
  end
end

local Ring = autograd.Function {
  name = "cp_ring_attention",
  forward = function(ctx, q, k, v, cp)
    local group = cp.group
    local r = group:rank()
    local B, Tl, Hq, D = q:size(1), q:size(2), q:size(3), q:size(4)
    local L, scale = Tl / 2, 1 / math.sqrt(D)
    ctx.group, ctx.scale = group, scale
    local out, lse = memory.scope(function()
      local sd, dev = stat_dtype(q), q:device()
      local acc = titan.zeros({ B, Tl, Hq, D }, { dtype = sd, device = dev })
      local acc_lse = titan.full({ B, Hq, Tl }, -math.huge, { dtype = sd, device = dev })
      walk(group, k:contiguous(), v:contiguous(), function(src, kc, vc)
        for _, blk in ipairs(ring_blocks(r, src, L)) do
          local qb, kb, vb = rows(q, 2, blk[1], blk[2]), rows(kc, 2, 0, blk[3]), rows(vc, 2, 0, blk[3])
          o1[0], o2[0] = nil, nil
          check(C.tt_op_attention(qb._c, kb._c, vb._c, blk[4] and 1 or 0, scale, o1, o2))
          local ob, lb = tensor.wrap(o1[0]), tensor.wrap(o2[0])
          check(C.tt_op_attention_merge(acc._c, acc_lse._c, ob._c, lb._c, blk[1]))
          ob:free(); lb:free()
          free_copies({ qb, kb, vb }, { q, kc, vc })
        end
      end)
      local o = acc:to(q:dtype())
      if o ~= acc then acc:free() end
      return o, acc_lse
    end)
    ctx:save_for_backward(q, k, v, out, lse)
    return out
  end,
  backward = function(ctx, g)
    local group, scale = ctx.group, ctx.scale
    local r = group:rank()
    local q, k, v, out, lse = unpack(ctx.saved_tensors)
    return memory.scope(function()
      local B, Tl, Hq, D, Hkv = q:size(1), q:size(2), q:size(3), q:size(4), k:size(3)
      local L, sd, dev = Tl / 2, stat_dtype(q), q:device()
      local gc = g:contiguous()
      -- (sequence first; dk and dv travel with the keys and values they belong to)
      local dq = titan.zeros({ Tl, B, Hq, D }, { dtype = sd, device = dev })
      local dk = titan.zeros({ Tl, B, Hkv, D }, { dtype = sd, device = dev })
      local dv = titan.zeros({ Tl, B, Hkv, D }, { dtype = sd, device = dev })
      walk(group, k, v, function(src, kc, vc)
        for _, blk in ipairs(ring_blocks(r, src, L)) do
          local f, m, nk = blk[1], blk[2], blk[3]
          local qb, ob, gb = rows(q, 2, f, m), rows(out, 2, f, m), rows(gc, 2, f, m)
          local lb, kb, vb = rows(lse, 3, f, m), rows(kc, 2, 0, nk), rows(vc, 2, 0, nk)
          o1[0], o2[0], o3[0] = nil, nil, nil
          check(C.tt_op_attention_backward(qb._c, kb._c, vb._c, ob._c, lb._c, gb._c, blk[4] and 1 or 0, scale,
            o1, o2, o3))
          local dqb, dkb, dvb = tensor.wrap(o1[0]), tensor.wrap(o2[0]), tensor.wrap(o3[0])
          add_rows(dq, f, dqb)
          add_rows(dk, 0, dkb)
          add_rows(dv, 0, dvb)
          dqb:free(); dkb:free(); dvb:free()
          free_copies({ qb, ob, gb, lb, kb, vb }, { q, out, gc, lse, kc, vc })
        end
        -- this step's gradients go on with its keys and values; the previous rank's arrive
        local dnext, dwork = rotate(group, { dk, dv })
        dwork:wait()
        dk:free(); dv:free()
        dk, dv = dnext[1], dnext[2]
      end)
      -- (after n rotations each rank holds its own keys' and values' gradients)
      local function back(acc, like)
        return titan.empty(like:shape(), { dtype = like:dtype(), device = dev }):copy_(acc:transpose(1, 2))
      end
      return back(dq, q), back(dk, k), back(dv, v), nil
    end)
  end,
}

-- q [B, Tl, Hq, D], k and v [B, Tl, Hkv, D] of this rank's tokens (its two
-- head-tail chunks) -> their causal attention over the whole sequence.
function M.attention(q, k, v, ctx) return Ring(q, k, v, ctx) end

return M
