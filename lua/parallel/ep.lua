-- ep.lua — expert parallelism: a mixture of experts' experts spread over
-- the ranks of an ep group (TorchTitan's expert_parallel_degree), the
-- tokens sent to the rank that holds their expert and the outputs sent
-- back (lua/models/moe.lua routes; this file moves the rows).
--
--   local plan = require("parallel.ep").apply(model, ep_group)   -- before the model is materialized
--   plan:params()  -- the set of this rank's expert parameters (whole tensors), once they are
--
-- Rank r of n keeps experts r*L .. r*L + L - 1 of each MoE layer (L =
-- num_experts / n) under their own names (`layers.3.moe.experts.5.w1.weight`
-- on the rank that holds expert 5), and drops the others' modules before
-- they get memory. Every expert is a whole tensor on its rank, so a
-- checkpoint needs nothing new: an ep = 4 checkpoint loads in one process
-- and back (each rank reads the tensors it holds; a tensor several ranks hold
-- is written once). The ep group is a run of data-parallel ranks: each
-- reads its own batch, routes its own tokens, and runs its experts on every
-- rank's tokens for them.
--
-- One MoE layer's forward (Ctx:run), after this rank put its (token,
-- choice) pairs' rows in expert order:
--   1. every rank's per-expert counts (one sum over the group of n x E numbers, on the host);
--   2. rows for rank j's experts sent to j, every rank's rows for this
--      rank's experts received (one batch of sends and receives: each pair's
--      exact count; a rank's own rows copied), in source-rank order;
--   3. the received rows put in expert order (source order within an
--      expert), each local expert run on its contiguous rows;
--   4. the outputs back in source order and sent back the same way, so the
--      layer gets them in the order it sent the rows.
-- The exchanges are autograd functions whose backward is the same exchange
-- reversed: the gradients of the outputs go to the experts' ranks, those of
-- the inputs back to the tokens' ranks. Every rank runs both backward
-- exchanges of every layer, in the same order, even with no rows for its
-- experts (its empty tensors stay in the graph).
--
-- Gradients: each rank's loss is its share of the global mean, so an
-- expert's gradient from the rows of every rank of its group is already the
-- group's sum; ranks holding the same experts (other ep groups, when ep is
-- smaller than the data-parallel ranks) sum theirs: the trainer's FSDP of
-- the experts shards them over those ranks (its reduce-scatter is the sum),
-- or, without FSDP, an all-reduce; with no such ranks FSDP leaves them whole
-- (fsdp.apply's keep).
local titan = require("titan")
local autograd = require("titan.autograd")
local memory = require("titan.memory")

local M = {}

-- Rows of x (contiguous, dim 0): send[j + 1] rows for rank j, in rank
-- order; returns the rows received, recv[i + 1] from rank i, in rank order.
local function exchange(x, group, send, recv)
  local r, n = group:rank(), group:size()
  local total = 0
  for i = 1, n do total = total + recv[i] end
  local shape = x:shape()
  shape[1] = total
  local out = titan.empty(shape, { dtype = x:dtype(), device = x:device() })
  memory.scope(function()
    local ops, so, ro = {}, 0, 0
    for j = 0, n - 1 do
      local s, c = send[j + 1], recv[j + 1]
      if j == r then
        if c > 0 then out:narrow(1, ro + 1, c):copy_(x:narrow(1, so + 1, s)) end
      else
        if s > 0 then ops[#ops + 1] = { "send", x:narrow(1, so + 1, s), j } end
        if c > 0 then ops[#ops + 1] = { "recv", out:narrow(1, ro + 1, c), j } end
      end
      so, ro = so + s, ro + c
    end
    if #ops > 0 then group:batch_p2p(ops) end
  end)
  return out
end
M.exchange = exchange

local Exchange = autograd.Function {
  name = "ep_exchange",
  forward = function(ctx, x, group, send, recv)
    ctx.group, ctx.send, ctx.recv = group, send, recv
    return exchange(x:contiguous(), group, send, recv)
  end,
  backward = function(ctx, g)
    return exchange(g:contiguous(), ctx.group, ctx.recv, ctx.send)
  end,
}

local Ctx = {}
Ctx.__index = Ctx

-- routed: this rank's pair rows in expert order, count[e]: its pairs for
-- expert e - 1 (all num_experts of them). Returns the experts' outputs for
-- those rows, in the same order.
function Ctx:run(layer, routed, count)
  local g, n, r, L, E = self.group, self.size, self.rank, self.L, self.E
  -- every rank's counts: c[i * E + e] = rank i's pairs for expert e - 1
  local c = {}
  for k = 1, n * E do c[k] = 0 end
  for e = 1, E do c[r * E + e] = count[e] end
  c = g:sum_numbers(c)
  local send, recv = {}, {}
  for j = 0, n - 1 do
    local s, k = 0, 0
    for l = 1, L do
      s = s + count[j * L + l]
      k = k + c[j * E + r * L + l]
    end
    send[j + 1], recv[j + 1] = s, k
  end
  local got = Exchange(routed, g, send, recv)
  -- The received rows are grouped by source rank, each group in expert
  -- order; the experts want theirs together: order[k] = the received row
  -- at place k of expert order (source order within an expert).
  local rows, first, at = {}, {}, 0 -- rows[l]: the rows for local expert l; first[i][l]: where (i, l) starts in got
  for l = 1, L do rows[l] = 0 end
  for i = 0, n - 1 do
    first[i] = {}
    for l = 1, L do
      local k = c[i * E + r * L + l]
      first[i][l], at = at, at + k
      rows[l] = rows[l] + k
    end
  end
  local grouped, inverse = got, nil
  if L > 1 and n > 1 then
    local order, inv, p = {}, {}, 0
    for l = 1, L do
      for i = 0, n - 1 do
        local f = first[i][l]
        for k = 1, c[i * E + r * L + l] do
          order[p + 1] = f + k - 1
          inv[f + k] = p
          p = p + 1
        end
      end
    end
    local dev = got:device()
    grouped = got:index_select(1, titan.tensor(order, { dtype = "int64" }):to(dev))
    inverse = titan.tensor(inv, { dtype = "int64" }):to(dev)
  end
  local outs, off = {}, 0
  for l = 1, L do
    if rows[l] > 0 then
      outs[#outs + 1] = layer.experts[tostring(r * L + l - 1)](grouped:narrow(1, off + 1, rows[l]))
      off = off + rows[l]
    end
  end
  -- (no rows for this rank's experts: the empty received tensor goes back,
  -- so the backward still passes through both exchanges here)
  local y = #outs == 0 and grouped or (#outs == 1 and outs[1] or titan.cat(outs, 1))
  if inverse then y = y:index_select(1, inverse) end
  return Exchange(y, g, recv, send)
end

local Plan = {}
Plan.__index = Plan

-- The set of this rank's expert parameters, as the modules hold them now
-- (materializing a meta model, module:to_empty, puts new tensors in place).
function Plan:params()
  local set = {}
  for _, list in ipairs(self.lists) do
    for _, p in ipairs(list:parameters()) do set[p] = true end
  end
  return set
end

-- Spreads the experts of model's MoE layers (still on meta: no memory yet)
-- over group's ranks. Returns a plan { group, layers = number of MoE
-- layers, local_experts = L, experts = E, lists = the experts' module
-- lists }; plan:params() the set of this rank's expert parameters.
function M.apply(model, group)
  local moe = require("models.moe")
  local n, r = group:size(), group:rank()
  local layers = moe.layers(model)
  local plan = setmetatable({ group = group, layers = #layers, lists = {} }, Plan)
  for _, nl in ipairs(layers) do
    local name, m = nl[1], nl[2]
    local E = m.m.num_experts
    if E % n ~= 0 then
      error(("ep: %s has %d experts, which do not split over parallelism.expert_parallel_degree = %d ranks; "
        .. "expected a divisor of %d"):format(name, E, n, E), 0)
    end
    local L = E / n
    for e = 0, E - 1 do
      if e < r * L or e >= (r + 1) * L then m.experts:remove(tostring(e)) end
    end
    -- (the MoE layer's run_experts slot: its rows in expert order go to the ranks holding their experts)
    local ctx = setmetatable({ group = group, rank = r, size = n, L = L, E = E }, Ctx)
    rawset(m, "run_experts", function(self, routed, count) return ctx:run(self, routed, count) end)
    plan.lists[#plan.lists + 1] = m.experts
    plan.local_experts, plan.experts = L, E
  end
  return plan
end

-- The banner's line (lua/parallel/describe.lua): par, the job laid out.
function M.describe(par)
  local e = par.ep_plan
  if not e then return nil end
  return ("expert parallel over %s: each group of %d data-parallel ranks shares the %d experts of each of %d "
    .. "MoE layers, %d per rank; each layer sends the tokens to their experts' ranks and the outputs back%s")
    :format(require("parallel.describe").over(par), par.dims.ep, e.experts, e.layers, e.local_experts, e.sharded and ("; FSDP shards them over "
    .. "the %d ranks holding the same ones"):format(e.replicas:size()) or e.replicas and ("; the experts' "
    .. "gradients summed over the %d ranks holding the same ones"):format(e.replicas:size()) or "")
end

return M
