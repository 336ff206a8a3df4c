-- grads.lua — a step's gradients once the backward is done: summed over the
-- mesh dims where they are Partial, and their global norm from the dims
-- where they are Shard, each read from the parameter's placements.
--
-- M.layout(par, named) gives each parameter the optimizer steps its
-- gradient's placements, by mesh dim name:
--
--   Shard (the norm's squares are summed over it)    Partial (summed here, after the backward)
--   tp: the weights TP splits (the layout's DTensor)  dp_cp: dense gradients, when neither FSDP
--   dp_shard_cp: FSDP's shards (the DTensor)            (reduce-scatter) nor DDP's hooks sum them
--   ep: the experts this rank holds                   tp: what runs on a chunk of the sequence under
--   ep_replica: FSDP's shards of them (the DTensor)     SP (norms, MoE layers: TP declares them)
--   pp: every parameter (a stage holds its own)       ep_replica: the experts, without their FSDP
--
-- The sums go dim by dim in a fixed order (tp, dp_cp, ep_replica), each in
-- ~25 MB buckets of one dtype, the parameters in the model's order. The
-- norm is one tree of sums over the Shard signatures, the same on the host
-- (numbers) and on the device (f64 tensors, no host wait): the squares of
-- the gradients of one signature, summed over its first dim; terms that
-- then share their remaining dims added (in the signatures' fixed order)
-- and summed over the next; so one process and any layout give the same bits.
local titan = require("titan")
local memory = require("titan.memory")
local ops = require("titan.ops")
local optim = require("titan.optim")

local M = {}

-- Tensors of one dtype and device summed over a group in place, as one
-- collective: packed into one buffer (n elements in all) and back.
local function all_reduce_packed(group, ts, n)
  if #ts == 1 then return group:all_reduce(ts[1], "sum") end
  titan.scope(function()
    local flat = titan.empty({ n }, { dtype = ts[1]:dtype(), device = ts[1]:device() })
    local off = 1
    for _, g in ipairs(ts) do
      local k = g:numel()
      flat:narrow(1, off, k):copy_(g:reshape(k))
      off = off + k
    end
    group:all_reduce(flat, "sum")
    off = 1
    for _, g in ipairs(ts) do
      local k = g:numel()
      g:copy_(flat:narrow(1, off, k):reshape(g:shape()))
      off = off + k
    end
  end)
end

-- The gradients of `params` (those in `set`, or all) summed over group in
-- buckets of about 25 MB (DDP's default) of one dtype: one collective per
-- bucket, not per parameter.
local function all_reduce_bucketed(group, params, set)
  local bucket_elems = math.floor(25 * 2 ^ 20 / 4)
  local pending, n = {}, 0
  local function flush()
    if #pending > 0 then all_reduce_packed(group, pending, n) end
    pending, n = {}, 0
  end
  for _, p in ipairs(params) do
    local g = p.grad
    if g and (not set or set[p]) then
      if #pending > 0 and (n + g:numel() > bucket_elems or g:dtype() ~= pending[1]:dtype()) then flush() end
      pending[#pending + 1] = g
      n = n + g:numel()
    end
  end
  flush()
end

-- The Shard dims a norm sums over, in this order; the Partial dims sync sums over, in this order.
M.SHARD_ORDER = { "tp", "dp_shard_cp", "ep", "ep_replica", "pp" }
M.PARTIAL_ORDER = { "tp", "dp_cp", "ep_replica" }

local function has(list, x)
  for _, v in ipairs(list) do if v == x then return true end end
  return false
end

-- Each of named's parameters ({name, tensor}: the optimizer's) with its
-- gradient's placements: { shard = {dims in SHARD_ORDER}, partial = {dims
-- in PARTIAL_ORDER} }, keyed by tensor; and the job's Shard signatures
-- (every rank of a group computes the same list, whatever it holds).
function M.layout(par, named)
  local d, L = par.dims, par.layout
  local tpp, ep, fsdp = par.tp_plan, par.ep_plan, par.fsdp
  local partial_tp = tpp and tpp.partial and (fsdp and fsdp:shards_of(tpp.partial) or tpp.partial) or {}
  local dense_partial = par.dp and not fsdp and not par.ddp
  local info = {}
  for _, np in ipairs(named) do
    local name, t = np[1], np[2]
    local dt = L.params[name]
    if not dt then error(("grads: %s has no placement in the job's layout"):format(name), 0) end
    local shard, partial = {}, {}
    local on = {}
    for i, dim in ipairs(dt.mesh:names()) do
      if dt.placements[i].kind == "shard" and dt.mesh:size(dim) > 1 then on[dim] = true end
    end
    local expert = ep and ep.params[t]
    if expert then on.ep = true end
    if d.pp > 1 then on.pp = true end
    for _, dim in ipairs(M.SHARD_ORDER) do if on[dim] then shard[#shard + 1] = dim end end
    if partial_tp[t] then partial[#partial + 1] = "tp" end
    if dense_partial and not expert then partial[#partial + 1] = "dp_cp" end
    if expert and ep.replicas and not ep.sharded then partial[#partial + 1] = "ep_replica" end
    info[t] = { name = name, shard = shard, partial = partial }
  end
  -- The signatures the job's layout makes (tp-split, whole, experts), in this order.
  local sigs = {}
  local function sig(on)
    local out = {}
    for _, dim in ipairs(M.SHARD_ORDER) do if on[dim] then out[#out + 1] = dim end end
    sigs[#sigs + 1] = out
  end
  local fsdp_on, pp_on = fsdp ~= nil and d.dp_shard * d.cp > 1, d.pp > 1
  if tpp then sig({ tp = true, dp_shard_cp = fsdp_on, pp = pp_on }) end
  sig({ dp_shard_cp = fsdp_on, pp = pp_on })
  if ep then sig({ ep = true, ep_replica = ep.sharded, pp = pp_on }) end
  local known = {}
  for i, s in ipairs(sigs) do known[table.concat(s, ",")] = i end
  for _, x in pairs(info) do
    local k = table.concat(x.shard, ",")
    if not known[k] then
      error(("grads: %s lies sharded over {%s}, which is none of this job's layouts of gradients; expected one of "
        .. "its parallelize steps' placements"):format(x.name, k), 0)
    end
    x.sig = known[k]
  end
  return { info = info, sigs = sigs }
end

-- The group of a mesh dim's ranks (dims whose group the job keeps by name).
local function group_of(par, dim)
  if dim == "tp" then return par.tp_group end
  if dim == "dp_cp" then return par.dp end
  if dim == "dp_shard_cp" then return par.fsdp.group end
  if dim == "ep" then return par.ep_plan.group end
  if dim == "ep_replica" then return par.ep_plan.replicas end
  if dim == "pp" then return par.pp_group end
  error("grads: no group for mesh dim " .. tostring(dim), 0)
end

-- A mixture of experts' expert that no token of this rank reached in the
-- step has no gradient; it gets zeros (TorchTitan's experts are one stacked
-- tensor, whose unused rows get zeros too), so every rank sums the same
-- tensors over its groups, and one process steps the same parameters as
-- several (AdamW moves an unused expert by its moments).
local function fill_experts(par, params)
  local set = par.expert_set
  if not set then return end
  for _, p in ipairs(params) do
    if set[p] and not p.grad then
      p.grad = memory.keep(titan.zeros(p:shape(), { dtype = p:dtype(), device = p:device() }))
    end
  end
end

-- Every Partial gradient summed over its dims, in place (each rank's loss
-- was already its share of the global mean); the step's loss (this rank's
-- sum) summed over the pipeline (the last stage's) and the data-parallel
-- ranks. Returns the global loss.
function M.sync(par, params, loss)
  fill_experts(par, params)
  local info = par.grad_layout.info
  for _, dim in ipairs(M.PARTIAL_ORDER) do
    if dim == "dp_cp" and par.pp_group then loss = par.pp_group:sum_numbers({ loss })[1] end
    local set, any = {}, false
    for _, p in ipairs(params) do
      if has(info[p].partial, dim) then set[p], any = true, true end
    end
    if any then all_reduce_bucketed(group_of(par, dim), params, set) end
  end
  if par.ddp then
    local n = par.ddp:finish(params) -- (most were started in the backward)
    if not par.ddp_told then -- (once: that the hooks did their part)
      par.ddp_told = true
      par.print(("DDP: %d of %d blocks' gradient sums started during the backward"):format(n, par.ddp.nblocks))
    end
  end
  if par.dp then loss = par.dp:sum_numbers({ loss })[1] end
  return loss
end

-- The norm's tree: sq(list of gradients) -> their squared norm, sum(group,
-- x) -> x summed over the group's ranks, add(a, b). Every rank runs the
-- same sums: the job's signatures, not the ones it holds.
local function norm_tree(par, params, sq, sum, add)
  local gl = par.grad_layout
  local lists = {}
  for i = 1, #gl.sigs do lists[i] = {} end
  for _, p in ipairs(params) do
    if p.grad then local l = lists[gl.info[p].sig]; l[#l + 1] = p.grad end
  end
  local terms = {}
  for i, s in ipairs(gl.sigs) do terms[i] = { value = sq(lists[i]), rest = s } end
  for _, dim in ipairs(M.SHARD_ORDER) do
    -- the terms whose next dim is dim, with the same dims after it, added then summed over dim
    local merged, order = {}, {}
    for _, t in ipairs(terms) do
      if t.rest[1] == dim then
        local key = table.concat(t.rest, ",")
        if merged[key] then merged[key].value = add(merged[key].value, t.value)
        else merged[key] = t; order[#order + 1] = key end
      else
        order[#order + 1] = t
      end
    end
    terms = {}
    for _, k in ipairs(order) do
      if type(k) == "string" then
        local t = merged[k]
        terms[#terms + 1] = { value = sum(group_of(par, dim), t.value), rest = { unpack(t.rest, 2) } }
      else
        terms[#terms + 1] = k
      end
    end
  end
  local total = terms[1].value
  for i = 2, #terms do total = add(total, terms[i].value) end
  return total
end


-- On the host: the global norm (clip_grad_norm's where ranks hold whole
-- gradients), the gradients scaled to max_norm. Returns the norm.
function M.clip_norm(par, params, max_norm)
  if not par:sharded() then return optim.clip_grad_norm(params, max_norm) end
  local function sq(ts)
    local n = #ts > 0 and ops.global_norm(ts) or 0
    return n * n
  end
  local total = norm_tree(par, params, sq, function(g, x) return g:sum_numbers({ x })[1] end,
    function(a, b) return a + b end)
  local norm = math.sqrt(total)
  if max_norm and max_norm > 0 and norm > max_norm then
    local gs = {}
    for _, p in ipairs(params) do if p.grad then gs[#gs + 1] = p.grad end end
    ops.scale_multi_(gs, max_norm / (norm + 1e-6))
  end
  return norm
end

-- On the device with no host wait, the same sums: into out (f64 {2}) as
-- global_norm_dev_ writes it, {norm, clip coefficient}.
function M.norm_on_device(par, params, max_norm, out)
  if not par:sharded() then
    local gs = {}
    for _, p in ipairs(params) do if p.grad then gs[#gs + 1] = p.grad end end
    return ops.global_norm_dev_(gs, max_norm, out)
  end
  memory.scope(function()
    local function sq(ts) -- f64 {1}: the sum of the squares of ts
      local nc = titan.zeros({ 2 }, { dtype = "float64", device = par.device })
      if #ts > 0 then ops.global_norm_dev_(ts, 0, nc) end
      local n = nc:narrow(1, 1, 1):contiguous()
      return n * n
    end
    local total = norm_tree(par, params, sq, function(g, x)
      g:all_reduce(x, "sum")
      return x
    end, function(a, b) return a + b end)
    ops.global_norm_dev_({ total:sqrt() }, max_norm, out)
  end)
end

return M
