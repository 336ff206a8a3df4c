-- tp.lua — tensor parallelism as Megatron-LM splits a transformer block
-- (TorchTitan's plan): the projections into
-- a region (wq, wk, wv; w1, w3) are split by output rows ("colwise": each
-- rank computes its own heads, its share of the hidden units), the
-- projection out of it (wo; w2) by input columns ("rowwise": each rank's
-- product is a partial sum). The region's input enters through an identity
-- whose backward all-reduces the gradient (Megatron's f), its output
-- leaves through an all-reduce whose backward is the identity (g): two
-- all-reduces of the activations per block in the forward, two in the
-- backward. Norms stay whole on every rank. The embedding and the output
-- layer are split by vocabulary rows (opts.vocab_parallel, opts.loss_parallel,
-- below); left whole (a tied flavor), every rank computes them on the same
-- values and their gradients agree without communication.
--
--   local tp = require("parallel.tp")
--   local plan = tp.apply(model, tp_group, family.tp_plan)   -- materialized, initialized model
--   plan.shard_of(name) -> global shape, offset (checkpoint boxes); plan.sharded[param] = true
--
-- Sequence parallelism (opts.sequence_parallel, Megatron-LM's; TorchTitan's
-- default with TP): between the regions, the residual stream, the norms and
-- the adds hold each rank's chunk of the sequence ([B, T/tp, D]), so their
-- activations are split tp ways too. A region's input is all-gathered along
-- the sequence (its backward reduce-scatters: f becomes an all-gather) and
-- its output reduce-scattered (g becomes a reduce-scatter): the same bytes
-- on the wire as the two all-reduces. The embedding's output enters as this
-- rank's chunk; the final norm's output is gathered for the output layer,
-- which every rank computes whole. The norms' weights see a chunk of the
-- tokens each, so their gradients are partial sums over the tp ranks:
-- plan.partial names them and the trainer sums them after the backward.
--
-- A mixture-of-experts layer (plan.moe) stays whole on every rank and
-- runs on the tokens the rank holds (under SP its chunk: the experts then
-- work as data parallelism over the tp ranks, their gradients summed with
-- the norms'); its experts may be spread over the data-parallel ranks
-- (lua/parallel/ep.lua).
--
-- The model family says what to split (a plan table: its regions, colwise
-- and rowwise linears, its sequence-parallel entry, exit and norms, its
-- MoE layer, and a check of its sizes); this file knows no model.
local autograd = require("titan.autograd")
local memory = require("titan.memory")
local tensor = require("titan.tensor")
local F = require("titan.functional")

local M = {}

-- Megatron's f: identity forward, gradient summed over the ranks.
local CopyIn = autograd.Function {
  name = "tp_copy_in",
  forward = function(ctx, x, group)
    ctx.group = group
    return x:detach()
  end,
  backward = function(ctx, g)
    ctx.group:all_reduce(g, "sum")
    return g
  end,
}

-- Megatron's g: the partial sums added over the ranks; identity backward.
local ReduceOut = autograd.Function {
  name = "tp_reduce_out",
  forward = function(_, x, group)
    local out = x:clone()
    group:all_reduce(out, "sum")
    return out
  end,
  backward = function(_, g) return g end,
}

-- ---- sequence parallelism: [B, T, D] split along T -------------------------
-- (the collectives split dim 0, so the sequence goes first for them)

local function gather_seq(x, group)
  return memory.scope(function()
    local all = group:all_gather(x:transpose(1, 2):contiguous()) -- [T, B, D], the ranks' chunks in order
    return all:transpose(1, 2):contiguous()
  end)
end

local function reduce_scatter_seq(x, group)
  return memory.scope(function()
    local mine = group:reduce_scatter(x:transpose(1, 2):contiguous(), "sum")
    return mine:transpose(1, 2):contiguous()
  end)
end

local function chunk_seq(x, group)
  local n = x:size(2) / group:size()
  return memory.scope(function() return x:narrow(2, group:rank() * n + 1, n):contiguous() end)
end

local function seq_function(name, fwd, bwd)
  return autograd.Function {
    name = name,
    forward = function(ctx, x, group)
      ctx.group = group
      return fwd(x, group)
    end,
    backward = function(ctx, g) return bwd(g, ctx.group) end,
  }
end

-- A region's input: the whole sequence (f); its output: the chunk of the sum (g).
local SeqGatherIn = seq_function("sp_gather_in", gather_seq, reduce_scatter_seq)
local SeqScatterOut = seq_function("sp_reduce_scatter_out", reduce_scatter_seq, gather_seq)
-- The embedding's output (the same on every rank): this rank's chunk.
local SeqEnter = seq_function("sp_enter", chunk_seq, gather_seq)
-- The final norm's output, for the output layer every rank computes whole
-- on the same values: its gradient is the same on every rank, and each
-- keeps its chunk.
local SeqExit = seq_function("sp_exit", gather_seq, chunk_seq)

-- ---- the vocabulary-parallel loss -------------------------------------------
-- (Megatron's vocab-parallel cross-entropy, TorchTitan's loss parallel.) The
-- output layer is split by vocabulary rows, so each rank has the logits of
-- its V/tp tokens for every position; the loss is computed from them
-- without gathering them: each row's maximum and sum of exponentials are
-- combined over the ranks (an all-reduce max, one sum), and each target's
-- logit comes from the rank that holds it (one more sum). The backward is
-- each rank's slice of softmax - onehot, with no communication. With the
-- output layer split, the gradient of its input is a partial sum over the
-- ranks: the final norm's output enters it through f (or, under sequence
-- parallelism, through the all-gather whose backward reduce-scatters).

local VocabCE = autograd.Function {
  name = "tp_vocab_parallel_cross_entropy",
  -- logits [N, n] (this rank's vocabulary slice); at [N, 1]: index of each
  -- target in the slice (0 when elsewhere), here (1 when in it), valid (1
  -- unless ignored); factor: the reduction's scale.
  forward = function(ctx, logits, at, here, valid, group, factor)
    local m = logits:max(2, true)
    group:all_reduce(m, "max")
    local s = (logits - m):exp():sum(2, true)
    group:all_reduce(s, "sum")
    local lse = s:log() + m
    local tl = logits:gather(2, at) * here
    group:all_reduce(tl, "sum")
    ctx:save_for_backward(logits, lse, at, here, valid)
    ctx.factor = factor
    return ((lse - tl) * valid):sum() * factor
  end,
  backward = function(ctx, g)
    local logits, lse, at, here, valid = unpack(ctx.saved_tensors)
    local p = (logits - lse):exp()
    p:scatter_add_(2, at, -here)
    return p * (valid * (g:item() * ctx.factor))
  end,
}

-- loss, count of the targets that are not ignored. logits: [N, V/tp] of the
-- ranks' slices in rank order; targets: [N] int64 (the same on every rank).
-- opts: ignore_index (-100), reduction ("mean" | "sum"), num_tokens (the
-- mean's denominator; default: the count).
function M.cross_entropy(logits, targets, group, opts)
  opts = opts or {}
  local ignore = opts.ignore_index or -100
  local N, n = logits:size(1), logits:size(2)
  local offset = group:rank() * n
  local at, here, valid, count = {}, {}, {}, 0
  for i, t in ipairs(targets:tolist_flat()) do
    local l = t - offset
    local ok = t ~= ignore
    if ok then count = count + 1 end
    valid[i] = ok and 1 or 0
    local mine = ok and l >= 0 and l < n
    at[i], here[i] = mine and l or 0, mine and 1 or 0
  end
  local dt, dev = logits:dtype(), logits:device()
  local denom = (opts.reduction or "mean") == "mean" and (opts.num_tokens or count) or 1
  local loss = memory.scope(function()
    local function col(list, dtype) return tensor.tensor(list, { dtype = dtype, device = dev }):reshape(N, 1) end
    return VocabCE(logits, col(at, "int64"), col(here, dt), col(valid, dt), group, denom > 0 and 1 / denom or 0)
  end)
  return loss, count
end

local function resolve(block, path)
  local m = block
  for part in path:gmatch("[^.]+") do
    m = m[part]
    if m == nil then error(("tp: the block has no %s (the model's tp_plan names it)"):format(path), 0) end
  end
  return m
end

-- Memory and initial values for parameter w (named name) when it has no
-- memory yet: init({[name] = true}) fills it.
local function materialize(w, name, init)
  if w:has_storage() then return end
  if not init then
    error(("tp: %s has no memory; expected materialized parameters, or opts.init to initialize them"):format(name), 0)
  end
  w:alloc_storage()
  init({ [name] = true })
end

-- Replaces linear m's weight by this rank's slice along dim (1: rows, 2:
-- columns); returns the global shape and the slice's offset.
local function split(m, name, dim, tp, rank, init)
  local w = rawget(m, "weight")
  materialize(w, name, init)
  local shape = w:shape()
  if shape[dim] % tp ~= 0 then
    error(("tp: %s has %d %s, not a multiple of tp = %d"):format(name, shape[dim], dim == 1 and "rows" or "columns",
      tp), 0)
  end
  if rawget(m, "bias") then error(("tp: %s has a bias; the plan splits bias-free linears only"):format(name), 0) end
  local n = shape[dim] / tp
  local part = autograd.no_grad(function()
    return memory.scope(function() return w:narrow(dim, rank * n + 1, n):clone() end)
  end)
  w:free()
  m:param("weight", part)
  if m.out_features and dim == 1 then m.out_features = n end
  if m.in_features and dim == 2 then m.in_features = n end
  local off = { 0, 0 }
  off[dim] = rank * n
  return shape, off
end

-- Can `model` (built, even on meta) be split tp ways by `plan`? An error
-- that says why not; before any process group exists.
function M.check(model, plan, tp)
  if not plan then error("tp: the model family has no tp_plan (which linears to split)", 0) end
  local why = plan.check and plan.check(model.args, tp)
  if why then error("tp: " .. why, 0) end
  if not rawget(model, "layers") then error("tp: the model has no `layers` (its blocks) to split", 0) end
end

-- model: materialized and initialized (the same on every rank), or with
-- parameters without memory (model:to_empty(device, {params_storage =
-- false})) and opts.init(names) to initialize a set of them the same on
-- every rank: then each is whole only while its slice is taken, one at a
-- time. group: the tp ranks. plan: { regions = {...}, colwise = {...},
-- rowwise = {...}, check = function(args, tp) -> error text or nil, and
-- for opts.sequence_parallel, opts.loss_parallel, opts.vocab_parallel:
-- sequence = { enter, exit, norms }, output, embedding (module names) }.
function M.apply(model, group, plan, opts)
  local init = opts and opts.init
  local sp = opts and opts.sequence_parallel
  local tp, rank = group:size(), group:rank()
  M.check(model, plan, tp)
  if sp and not plan.sequence then
    error("tp: the model family's tp_plan has no `sequence` (sequence parallelism)", 0)
  end
  local layers = rawget(model, "layers")
  local out = { boxes = {}, sharded = {}, group = group, partial = sp and {} or nil, sequence_parallel = sp }
  -- (loss parallel needs an output layer of its own: not with tied embeddings)
  local lp = opts and opts.loss_parallel and plan.output and true or false
  out.loss_parallel = lp
  local into, outof = sp and SeqGatherIn or CopyIn, sp and SeqScatterOut or ReduceOut
  for _, bname in ipairs(layers._children) do
    local block = layers[bname]
    local prefix = "layers." .. bname .. "."
    -- A mixture-of-experts block (plan.moe names its layer, in place of a
    -- region) runs it whole on every rank, on the tokens the rank holds:
    -- under SP its chunk of the sequence (its weights' gradients are then
    -- partial sums, like the norms'), without SP all of them (the same
    -- values, the same gradients, on every rank).
    local moe = plan.moe and rawget(block, plan.moe)
    local function skipped(path) return moe and rawget(block, path:match("^[^.]+")) == nil end
    if moe and sp then
      for _, p in ipairs(moe:parameters()) do out.partial[p] = true end
    end
    for dim, paths in ipairs({ plan.colwise, plan.rowwise }) do
      for _, path in ipairs(paths) do
        if skipped(path) then goto next_path end
        local m = resolve(block, path)
        local name = prefix .. path .. ".weight"
        local gshape, off = split(m, name, dim, tp, rank, init)
        out.boxes[name] = { gshape, off }
        out.sharded[rawget(m, "weight")] = true
        ::next_path::
      end
    end
    for _, path in ipairs(plan.regions) do
      if skipped(path) then goto next_region end
      local m = resolve(block, path)
      local forward = m.forward
      rawset(m, "forward", function(self, x, ...)
        return outof(forward(self, into(x, group), ...), group)
      end)
      ::next_region::
    end
    if sp then
      for _, path in ipairs(plan.sequence.norms) do out.partial[rawget(resolve(block, path), "weight")] = true end
    end
  end
  -- (a pipeline stage may hold neither end: its input arrives split, its output leaves split)
  local output = lp and rawget(model, plan.output)
  if output then
    local gshape, off = split(output, plan.output .. ".weight", 1, tp, rank, init)
    out.boxes[plan.output .. ".weight"] = { gshape, off }
    out.sharded[rawget(output, "weight")] = true
  end
  -- The embedding split by vocabulary rows (opts.vocab_parallel; an untied
  -- flavor: TorchTitan's rowwise embedding): each rank looks up the ids in
  -- its rows, zeros elsewhere, and the sum over the ranks is the embedding
  -- (an all-reduce; under SP the reduce-scatter that leaves each rank its
  -- chunk of the sequence).
  local emb = opts and opts.vocab_parallel and plan.embedding and rawget(model, plan.embedding)
  if emb then
    local name = plan.embedding .. ".weight"
    local gshape, off = split(emb, name, 1, tp, rank, init)
    out.boxes[name] = { gshape, off }
    out.sharded[rawget(emb, "weight")] = true
    local n = gshape[1] / tp
    emb.num_embeddings = n
    local leave = sp and SeqScatterOut or ReduceOut
    -- Two tables over the whole vocabulary, kept on the module as the
    -- model's RoPE tables are (made again, the old ones freed, when the
    -- device or dtype changes): an id's row here (0 when not here) and
    -- whether it is here (1 / 0). Looking the ids up in them keeps the
    -- forward on the device (the ids are never read on the host, so nothing
    -- waits for the GPU).
    local function lookup(self, w, dev)
      local tb = rawget(self, "_vocab_tables")
      if not tb or tb.device ~= dev or tb.dtype ~= w:dtype() then
        if tb then tb.at:free(); tb.here:free() end
        local at, here = {}, {}
        for v = 0, gshape[1] - 1 do
          local l = v - off[1]
          local mine = l >= 0 and l < n
          at[v + 1], here[v + 1] = mine and l or 0, mine and 1 or 0
        end
        tb = { device = dev, dtype = w:dtype(), at = memory.keep(tensor.tensor(at, { dtype = "int64", device = dev })),
          here = memory.keep(tensor.tensor(here, { dtype = w:dtype(), device = dev })) }
        rawset(self, "_vocab_tables", tb)
      end
      return tb
    end
    rawset(emb, "forward", function(self, ids)
      local w = rawget(self, "weight")
      local y = memory.scope(function()
        local tb = lookup(self, w, ids:device())
        local shape = ids:shape()
        local mshape = { unpack(shape) }
        mshape[#mshape + 1] = 1
        local flat = ids:reshape(ids:numel())
        local mine = tb.at:index_select(1, flat):reshape(shape)
        local mask = tb.here:index_select(1, flat):reshape(mshape)
        return F.embedding(w, mine) * mask
      end)
      return leave(y, group)
    end)
  end
  local enter = sp and not emb and rawget(model, plan.sequence.enter)
  if enter then
    local forward = enter.forward
    rawset(enter, "forward", function(self, ...) return SeqEnter(forward(self, ...), group) end)
  end
  local exit = (sp or output) and rawget(model, plan.sequence.exit)
  if exit then
    if sp then out.partial[rawget(exit, "weight")] = true end
    -- The final norm's output into the output layer: gathered along the
    -- sequence under SP; with the layer split, its gradient summed over the ranks.
    local via = output and (sp and SeqGatherIn or CopyIn) or SeqExit
    local forward, add_forward = exit.forward, exit.add_forward
    rawset(exit, "forward", function(self, ...) return via(forward(self, ...), group) end)
    if add_forward then
      rawset(exit, "add_forward", function(self, ...)
        local x, y = add_forward(self, ...)
        return x, via(y, group)
      end)
    end
  end
  for _, np in ipairs(model:named_parameters()) do materialize(np[2], np[1], init) end -- the whole ones
  function out.shard_of(name)
    local b = out.boxes[name]
    if b then return b[1], b[2] end
    return nil
  end
  return out
end

-- Several split models (a rank's pipeline stages) as one plan: their
-- boxes and split weights together (the names are the whole model's, so
-- they do not collide).
function M.combine(list)
  if #list == 1 then return list[1] end
  local out = { boxes = {}, sharded = {}, group = list[1].group, sequence_parallel = list[1].sequence_parallel,
    partial = list[1].partial and {} or nil, loss_parallel = list[1].loss_parallel }
  for _, p in ipairs(list) do
    for k, v in pairs(p.boxes) do out.boxes[k] = v end
    for k in pairs(p.sharded) do out.sharded[k] = true end
    for k in pairs(p.partial or {}) do out.partial[k] = true end
  end
  out.shard_of = function(name)
    local b = out.boxes[name]
    if b then return b[1], b[2] end
  end
  return out
end

-- The banner's line (lua/parallel/describe.lua): par, the job laid out.
function M.describe(par)
  if not par.tp_plan then return nil end
  local f = par.tp_flags
  return ("tensor parallel: %d ranks per replica split each block's heads and feed-forward units (%s); tps "
    .. "and MFU are per rank"):format(par.dims.tp, (f.sequence_parallel and "sequence parallel: norms and the "
    .. "residual stream split along the sequence, an all-gather into and a reduce-scatter out of each half-block"
    or "two all-reduces of the activations per block each way") .. (f.vocab_parallel and "; the embedding "
    .. "split by vocabulary" or "") .. (f.loss_parallel and "; loss parallel: "
    .. "the output layer split by vocabulary, the loss from the slices" or (f.loss_parallel_off and
    ("; loss parallel off: " .. f.loss_parallel_off) or "")))
end

return M
