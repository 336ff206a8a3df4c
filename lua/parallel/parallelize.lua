-- parallelize.lua — a job laid over its ranks: the degrees (dims.lua), the
-- device mesh and its process groups, then the family's parallelize
-- function (lua/parallel/llama3.lua) or a recipe's own, which declares on
-- the model built on meta, one call per parallelism on a named sub-mesh:
--
--   function(model, mesh, cfg, par)
--     for _, m in ipairs(par:pipeline(model, mesh.pp)) do   -- this rank's stages (or { model })
--       par:tensor_parallel(m, mesh.tp)                     -- + sequence, loss and vocabulary parallel
--       par:float8(m, mesh.tp)
--       par:activation_checkpoint(m)
--       par:context_parallel(m, mesh.cp)
--       par:expert_parallel(m, mesh.ep)
--     end
--     par:fully_shard(mesh.dp_shard_cp, { replicate = mesh.dp_replicate }) -- or par:replicate(mesh.dp_cp)
--   end
--
-- Float8, AC, CP and EP change the meta modules as they are called. TP and
-- FSDP/DDP are declared, and par:finish() (after the function) gives the
-- weights memory once the layout is known: each rank materializes and
-- initializes only its pieces (the name-keyed RNG makes them the same
-- values a whole model has), TP taking its slices a weight at a time and
-- FSDP its shards a block at a time.
--
-- The trainer reaches all of this through the family's entry point
-- (family.parallel()), and asks the object back for what depends on the
-- layout: the parameters the optimizer steps, the batch this rank holds,
-- the gradient sums and norm (grads.lua), the banner's lines.
local titan = require("titan")
local dist = require("titan.dist")
local tensor = require("titan.tensor")
local metrics = require("titan.metrics")
local dims = require("parallel.dims")
local grads = require("parallel.grads")

local M = {}

-- The layout of cfg on world ranks as rank sees it, worked out offline (no
-- memory, no communication): the REPL's and the estimates'.
function M.layout(cfg, world, rank) return require("parallel.placements").job(cfg, world, rank) end
-- The job's degrees (ParallelDims) for a world of `world` ranks, with no process group.
function M.dims(cfg, world) return require("parallel.dims").new(cfg, world) end

local Par = {}
Par.__index = Par
M.Par = Par

local function names_of(model)
  local s = {}
  for _, np in ipairs(model:named_parameters()) do s[np[1]] = true end
  return s
end

-- The process group of a sub-mesh of the job's mesh (nil: off, or one
-- process): the job mesh's, cached there (one communicator per dim or view).
local function group_of(self, sub)
  if sub == nil or sub:world() <= 1 or self.world <= 1 then return nil end
  local names = sub:names()
  return self.mesh:group(#names == 1 and names[1] or names)
end

-- cfg: a resolved config; family: the model family's module; env:
-- dist.env(); opts.print: the log (rank 0's); opts.parallelize: replaces
-- the family's (a recipe's `parallelize`). For dry runs (titan estimate):
-- opts.device (where the weights go: "meta"), opts.root (the group of all
-- ranks: a fake one), opts.fit_check = false, opts.accounting(on) (turned
-- on while the weights get their memory, off around what only declares).
function M.setup(cfg, family, env, opts)
  opts = opts or {}
  local t = cfg.training
  local pd = dims.new(cfg, env.world)
  local self = setmetatable({ cfg = cfg, family = family, dims = pd, rank = env.rank, world = env.world,
    device = opts.device or t.device, print = opts.print or print, models = {}, decl = {}, cp_ctxs = {}, ac_blocks = 0,
    accounting = opts.accounting or function() end }, Par)
  for k, v in pairs(pd:coords(env.rank)) do self[k] = v end
  self.dp_size = pd.dp_size
  self.build_meta = function()
    return family.build(cfg.model.flavor, { device = "meta", dtype = t.mixed_precision_param,
      overrides = { max_seq_len = math.max(t.seq_len, family.args(cfg.model.flavor).max_seq_len) } })
  end
  local model = self.build_meta()
  self.flops_per_token, self.nparams = family.flops_per_token(model, t.seq_len)
  pd:check_model(model, family)
  self.n_blocks = model.args.n_layers
  if opts.fit_check ~= false then self:check_fit(env) end
  -- The ranks meet (MPI starts) once the layout and the sizes are known to
  -- fit. On GPUs the tensors' groups are NCCL's (each rank on its own GPU);
  -- the MPI world group stays for what the host decides (the stop signal,
  -- the checkpoint's exchanges) and the groups' exchanges of Lua values.
  if env.world > 1 then
    self.world_group = opts.root or dist.world_group()
    local root = self.world_group
    if not opts.root and t.device ~= "cpu" then root = dist.nccl_world_group(tensor.device_of(t.device).index) end
    self.mesh = pd:build_mesh(env.rank, { group = root })
    -- (the data-parallel ranks, cp's included: the loss, the data's stop, the gradient sums)
    if pd.dp_size * pd.cp > 1 then self.dp = self.mesh:group("dp_cp") end
    if pd.pp > 1 then self.pp_group = self.mesh:group("pp") end
  else
    self.mesh = pd:build_mesh(0, { fake = true })
  end
  self.whole, self.whole_names = model, names_of(model)
  -- (checkpoints and HF imports: the whole job's names; this rank's may be a
  -- part of them: a pipeline stage, its experts, or none of a tensor whose
  -- FSDP rows all went to the lower ranks, as torch.chunk deals them)
  self.all_names = self.whole_names
  local fn = opts.parallelize or family.parallelize
  local out = fn(model, self.mesh, cfg, self)
  self:finish(out or model)
  return self
end

-- The parameters' memory against the host or the GPU, before any memory
-- is taken: what this rank holds of the parameters, their gradients and
-- AdamW's state (two f32 moments, and f32 master weights under bf16), from
-- the layout's placements (what titan estimate and the REPL's memory()
-- report; activations come on top). On the CPU the ranks of one host share
-- its memory (80% of it: the rest is the OS's and the data's). The line is
-- said once, by rank 0; the other ranks stop without a word.
function Par:check_fit(env)
  local cfg, t = self.cfg, self.cfg.training
  local total = metrics.device_memory_bytes(t.device)
  if not total then return end
  local cpu = t.device == "cpu"
  local limit = cpu and 0.8 * total or total
  local here = cpu and env.local_size or 1
  local m = require("parallel.placements").job(cfg, env.world, env.rank):memory()
  if m.total * here <= limit then return end
  if env.rank ~= 0 then error("", 0) end
  local function g(b) return b >= 10 * 2 ^ 30 and ("%.0f GiB"):format(b / 2 ^ 30) or ("%.2f GiB"):format(b / 2 ^ 30) end
  local parts = ("(parameters %s, gradients %s, optimizer state %s, in %s; activations come on top)"):format(
    g(m.params), g(m.grads), g(m.optimizer), t.mixed_precision_param)
  local need, advice
  if cpu and here > 1 then
    need = ("~%s on each of the %d ranks on this host %s, %s together, but this machine has %s (%s for training)")
      :format(g(m.total), here, parts, g(m.total * here), g(total), g(limit))
    advice = "more ranks on this host do not help (they share its memory): train it on GPUs (training.device=cuda), "
      .. "over several hosts, or pick a smaller flavor"
  elseif cpu then
    need = ("~%s %s, but this machine has %s (%s for training)"):format(g(m.total), parts, g(total), g(limit))
    advice = "shard it over ranks on several hosts (parallelism.dp_shard), train it on GPUs (training.device=cuda), "
      .. "or pick a smaller flavor"
  else
    need = ("~%s on each rank %s, but %s has %.0f GiB"):format(g(m.total), parts, t.device, total / 2 ^ 30)
    advice = "shard it over more GPUs (parallelism.dp_shard, tp or pp), or pick a smaller flavor; titan estimate "
      .. "RECIPE --world N --device h100 tells what a layout needs, activations included"
  end
  error(("trainer: %s %s has %.2fB parameters and needs %s; %s"):format(cfg.model.name, cfg.model.flavor,
    self.nparams / 1e9, need, advice), 0)
end

-- Is a parallelism on ("tp", "fsdp", "dp", ...: dims.lua).
function Par:enabled(what) return self.dims:enabled(what) end

---------------------------------------------------------------------------
-- The steps a parallelize function calls

-- Pipeline parallelism (lua/parallel/pp.lua): this rank's stages, each the
-- model built again on meta and pruned to its blocks; { model } without PP.
function Par:pipeline(model, sub)
  if sub == nil or sub:world() <= 1 then
    self.models = { model }
    return self.models
  end
  local pp = require("parallel.pp")
  self.stages = pp.split(self.build_meta, self.family.pp_plan, self.dims.pp_layout, self.pp_rank)
  self.models = {}
  for i, st in ipairs(self.stages) do self.models[i] = st.model end
  return self.models
end

-- Tensor parallelism (lua/parallel/tp.lua), declared: the weights are
-- split as they get memory (finish). opts: sequence_parallel,
-- loss_parallel, vocab_parallel (default: the config's, as dims allows),
-- plan (default: the family's tp_plan).
function Par:tensor_parallel(model, sub, opts)
  local group = group_of(self, sub)
  if not group then return end
  local f = {}
  for k, v in pairs(self.dims.tp_flags) do f[k] = v end
  for k, v in pairs(opts or {}) do f[k] = v end
  if f.loss_parallel == false and self.dims.tp_flags.loss_parallel then
    f.loss_parallel_off = "the parallelize function keeps the output layer whole"
  end
  self.tp_group, self.tp_flags = group, f
  self.decl[model] = self.decl[model] or {}
  self.decl[model].tp = { group = group, plan = f.plan or self.family.tp_plan, opts = f }
end

-- model.converters = float8 (lua/parallel/float8.lua): the Linear layers
-- multiply in fp8; under TP each scale spans the tp ranks (sub), not in a
-- mixture of experts (whole on every rank, its experts run only where they got tokens).
function Par:float8(model, sub)
  local cfg = self.cfg
  if not (("," .. cfg.model.converters .. ","):gsub("%s", ""):find(",float8,", 1, true)) then return end
  local filter = {}
  for f in (cfg.float8.filter_fqns .. ","):gmatch("%s*([^,]-)%s*,") do
    if f ~= "" then filter[#filter + 1] = f end
  end
  local ungrouped = self.family.ungrouped_linear and self.family.ungrouped_linear(model)
  local done, skipped = require("parallel.float8").apply(model, { filter_fqns = filter, group = group_of(self, sub),
    ungrouped = ungrouped })
  self.float8_count = self.float8_count or { done = 0, skipped = {} }
  self.float8_count.done = self.float8_count.done + #done
  -- (named by pattern: layers.*.moe.router stands for one per block)
  for _, s in ipairs(skipped) do
    self.float8_count.skipped[#self.float8_count.skipped + 1] = s[1]:gsub("%.%d+%.", ".*.") .. " (" .. s[2] .. ")"
  end
end

-- Activation checkpointing (lua/parallel/ac.lua): the blocks ac (default
-- the config's activation_checkpoint) picks recompute in the backward.
function Par:activation_checkpoint(model, ac)
  self.ac = ac or self.cfg.activation_checkpoint
  self.ac_blocks = self.ac_blocks + require("parallel.ac").apply(model, self.ac)
end

-- Context parallelism (lua/parallel/cp.lua) over sub's ranks: each holds
-- 2 of the sequence's 2 x cp chunks; attention sees every rank's keys.
function Par:context_parallel(model, sub, opts)
  local group = group_of(self, sub)
  if not group then return end
  self.cp_group = group
  self.cp_rotate = (opts or {}).rotate_method or self.cfg.parallelism.context_parallel_rotate_method
  self.cp_ctxs[#self.cp_ctxs + 1] = require("parallel.cp").apply(model, group, { rotate_method = self.cp_rotate })
end

-- Expert parallelism (lua/parallel/ep.lua) over sub's ranks: this rank keeps
-- its share of every MoE layer's experts, dropped from the meta model
-- before any memory. The ranks at the same place of every ep group hold
-- the same experts (the ep_replica view).
function Par:expert_parallel(model, sub)
  if sub == nil or self.dims.ep <= 1 then return end
  local group = group_of(self, sub)
  local e = self.ep_plan
  if not e then
    local E = self.family.num_experts(self.whole)
    e = { group = group, layers = 0, plans = {}, experts = E, local_experts = E / self.dims.ep,
      replicas = self.mesh:size("ep_replica") > 1 and self.mesh:group("ep_replica") or nil }
    self.ep_plan, self.ep_group = e, group
  end
  local p = require("parallel.ep").apply(model, group)
  e.plans[#e.plans + 1] = p
  e.layers = e.layers + p.layers
end

-- FSDP (lua/parallel/fsdp.lua) over sub's ranks (dp_shard_cp), declared:
-- each block materialized, initialized and sharded on its own in finish.
-- opts.replicate: HSDP's replicas (dp_replicate).
function Par:fully_shard(sub, opts)
  if sub == nil or sub:world() <= 1 then return end
  opts = opts or {}
  local group = sub:world() == self.dp_size * self.dims.cp and self.dp or group_of(self, sub)
  self.fsdp_decl = { group = group, replicate = opts.replicate and group_of(self, opts.replicate) }
end

-- DDP over sub's ranks (dp_cp): gradients summed after the backward (or,
-- on NCCL, during it: lua/parallel/ddp.lua).
function Par:replicate(sub)
  if sub == nil or sub:world() <= 1 then return end
  self.ddp_decl = true
end

---------------------------------------------------------------------------
-- Memory: the declared layout made real

local function init_fn(family, m, seed) return function(names) family.init_weights(m, seed, names) end end

function Par:finish(model)
  local cfg, family = self.cfg, self.family
  local t = setmetatable({ device = self.device }, { __index = cfg.training }) -- (the weights' device)
  local seed = t.seed
  local models = self.models[1] and self.models or { model }
  self.models = models
  local fs = self.fsdp_decl
  if self.stages then -- (the banner counts the whole model's blocks and layers)
    self.ac_blocks = self.pp_group:sum_numbers({ self.ac_blocks })[1]
    if self.float8_count then
      local f = self.float8_count
      f.done = self.pp_group:sum_numbers({ f.done })[1]
      local all = {}
      for _, list in ipairs(self.pp_group:gather_object(f.skipped)) do
        for _, s in ipairs(list) do all[#all + 1] = s end
      end
      f.skipped = all
    end
    -- (under sequence parallelism a stage boundary carries this rank's chunk of the sequence)
    local sp = self.tp_flags and self.tp_flags.sequence_parallel
    self.pipe = require("parallel.pp").pipeline(self.stages, self.pp_group, self.dims.pp_layout,
      { dim = model.args.dim, seq_shards = sp and self.dims.tp or 1 })
    self.model = require("parallel.pp").Stages(self.stages)
  else
    self.model = models[1]
  end
  -- Materialize: TP takes its slices a weight at a time, FSDP its shards a
  -- block at a time (a rank never holds the whole model, not even at the start).
  self.accounting(true)
  local plans = {}
  for _, m in ipairs(models) do
    local tpd = self.decl[m] and self.decl[m].tp
    if fs or tpd then
      m:to_empty(t.device, { params_storage = false })
      if tpd then
        local o = tpd.opts
        plans[#plans + 1] = require("parallel.tp").apply(m, tpd.group, tpd.plan, { init = init_fn(family, m, seed),
          sequence_parallel = o.sequence_parallel, loss_parallel = o.loss_parallel, vocab_parallel = o.vocab_parallel })
      end
    else
      m:to_empty(t.device)
      family.init_weights(m, seed)
    end
  end
  if #plans > 0 then
    self.tp_plan = self.stages and require("parallel.tp").combine(plans) or plans[1]
    self.loss_parallel = self.tp_flags.loss_parallel
  end
  if self.ep_plan then
    local set = {}
    for _, p in ipairs(self.ep_plan.plans) do
      for x in pairs(p:params()) do set[x] = true end
    end
    self.ep_plan.params = set
  end
  if fs then self:shard(models, fs, t) end
  -- DDP on GPUs: each block's gradients summed during the backward, on the
  -- communication stream. (mpi's collectives block: nothing to overlap; TP
  -- and PP reduce their own way; a mixture of experts' experts have
  -- gradients on some ranks only, which per-parameter sums started by hooks
  -- cannot match up: the bucketed sum after the backward does.)
  if self.ddp_decl and self.dp and not self.fsdp and not self.tp_plan and not self.pipe
    and not (family.num_experts and family.num_experts(self.whole) > 0)
    and self.dp:backend() == "nccl" and cfg.parallelism.ddp_overlap then
    self.ddp = require("parallel.ddp").attach(self.model, self.dp)
  end
  -- The experts' parameters as the optimizer holds them (FSDP's shards), and their token counts summed over
  -- the data-parallel ranks, and under sequence parallelism over the tp ranks too (each routed its chunk).
  local named = self:named_parameters()
  if family.num_experts and family.num_experts(self.model) > 0 then
    self.expert_set = {}
    for _, np in ipairs(named) do
      if family.is_expert(np[1]) then self.expert_set[np[2]] = true end
    end
  end
  self.token_counts = self.dp
  if self.tp_plan and self.tp_plan.sequence_parallel then
    local dp, tp = self.dp, self.tp_group
    self.token_counts = { sum_numbers = function(_, c) return tp:sum_numbers(dp and dp:sum_numbers(c) or c) end }
  end
  self.accounting(false)
  -- Checkpoint boxes (and HF import's) from the parameters' placements
  -- (lua/parallel/placements.lua; tests/lua/placements_spec.lua checks them
  -- against what the transforms made), and each gradient's placements:
  -- what the sums after the backward and the norm read (grads.lua).
  self.layout = require("parallel.placements").job(self.cfg, self.world, self.rank, { tp_flags = self.tp_flags,
    tp = self.tp_plan ~= nil, fsdp = self.fsdp ~= nil })
  self.shard_of = function(name)
    local d = self.layout.params[name]
    if not d then return nil end
    return d.shape, d:box().offset
  end
  self.grad_layout = grads.layout(self, named)
end

-- FSDP: each model's blocks sharded over the declared group (HSDP: then
-- the replicas). Under expert parallelism each rank's experts stay whole
-- when its ep group is all the data-parallel ranks; otherwise an FSDP of
-- their own shards them over the ranks holding the same experts (the
-- replicas: TorchTitan's dp_shard_mod_ep), which sums their gradients.
function Par:shard(models, fs, t)
  local cfg, family = self.cfg, self.family
  local fsdp = require("parallel.fsdp")
  -- (on nccl the gathers and reductions overlap computation; mpi's block, so there is nothing to gain)
  local opts = { replicate = fs.replicate, reshard_after_forward = cfg.parallelism.fsdp_reshard_after_forward,
    overlap = fs.group:backend() == "nccl" and cfg.parallelism.fsdp_overlap }
  local ep = self.ep_plan
  local experts = ep and ep.replicas and { reshard_after_forward = opts.reshard_after_forward, overlap = opts.overlap,
    only = ep.params, buffers = false }
  if ep then
    if experts then opts.skip = ep.params else opts.keep = ep.params end
  end
  -- (a family with init_param initializes each rank's rows alone: no rank
  -- computes or holds a whole parameter, even at the start)
  local init_shard = family.init_param and function(name, sh, offset)
    family.init_param(models[1].args, t.seed, name, sh, offset)
  end
  local each = {}
  for _, m in ipairs(models) do
    opts.init, opts.init_shard = init_fn(family, m, t.seed), init_shard
    -- (the converted layers' weights gathered in fp8: lua/parallel/float8.lua)
    opts.fp8 = cfg.float8.enable_fsdp_float8_all_gather and require("parallel.float8").fsdp_fp8(m) or nil
    each[#each + 1] = fsdp.apply(m, fs.group, opts)
    if experts then
      experts.init, experts.init_shard = opts.init, init_shard
      each[#each + 1] = fsdp.apply(m, ep.replicas, experts)
    end
    family.init_weights(m, t.seed, {}) -- (the buffers: an empty set of parameters)
  end
  self.fsdp = fsdp.combine(each)
  if experts then -- (the optimizer's and the gradient norm's expert parameters are now the shards)
    ep.params, ep.sharded = self.fsdp:shards_of(ep.params), true
  end
  self.fsdp_overlap = opts.overlap
end

---------------------------------------------------------------------------
-- What the trainer asks

-- The parameters the optimizer steps (FSDP's shards, or the model's), with their names.
function Par:named_parameters() return self.fsdp and self.fsdp:named_parameters() or self.model:named_parameters() end
function Par:parameters() return self.fsdp and self.fsdp:parameters() or self.model:parameters() end
-- The modules a checkpoint saves (FSDP's view gathers each parameter's whole from the shards).
function Par:state_model() return self.fsdp and self.fsdp:state_model() or self.model end

-- Cross-entropy of logits [N, V] against targets [N]: from this rank's
-- vocabulary slice under loss parallelism. Returns the loss and the count.
function Par:cross_entropy(logits, targets, opts)
  if self.loss_parallel then return require("parallel.tp").cross_entropy(logits, targets, self.tp_group, opts) end
  return titan.F.cross_entropy(logits, targets, opts)
end

-- Numbers summed over the data-parallel ranks (one rank: as they are).
function Par:sum_data(xs)
  return self.dp and self.dp:sum_numbers(xs) or xs
end

-- Under context parallelism: the batch's tokens this rank holds (its
-- chunks of every sequence), and their count where the data counted the
-- real ones (targets at the ignore index do not count).
function Par:shard_batch(b)
  if not self.cp_group then return b end
  local cp = require("parallel.cp")
  local r, n = self.cp_group:rank(), self.cp_group:size()
  local inputs, targets = cp.shard(b.inputs, r, n), cp.shard(b.targets, r, n)
  b.inputs:free()
  b.targets:free()
  b.inputs, b.targets = inputs, targets
  if b.num_tokens then
    local real = 0
    for _, x in ipairs(targets:tolist_flat()) do if x >= 0 then real = real + 1 end end
    b.num_tokens = real
  end
  return b
end

-- A batch's rows cut into micro-batches of `rows` (views).
local function cut(b, rows)
  local mbs = {}
  for k = 1, b.inputs:size(1), rows do
    mbs[#mbs + 1] = { inputs = b.inputs:narrow(1, k, rows), targets = b.targets:narrow(1, k, rows) }
  end
  return mbs
end

-- The step's micro-batches: through the pipeline's schedule (each batch
-- cut into pipeline_parallel_microbatch_size rows; the last stage's
-- loss_fn gives the losses), or eagerly by eager(tr, batches, ctx), DDP
-- arming its hooks for the last backward. Returns the summed loss.
function Par:run_batches(tr, batches, ctx, eager)
  if self.pipe then
    local loss_sum = 0
    for i, b in ipairs(batches) do
      local mbs = cut(b, self.cfg.parallelism.pipeline_parallel_microbatch_size)
      loss_sum = loss_sum + self.pipe:step(mbs, tr.loss_fn, ctx)
      for _, mb in ipairs(mbs) do mb.inputs:free(); mb.targets:free() end
      b.inputs:free()
      b.targets:free()
      batches[i] = nil
    end
    return loss_sum
  end
  if not self.ddp then return eager(tr, batches, ctx) end
  -- (a failed micro-batch leaves no reduction running: lua/parallel/ddp.lua)
  local ok, res = pcall(eager, tr, batches, ctx)
  if not ok then
    self.ddp:drop()
    error(res, 0)
  end
  return res
end

-- Before the last micro-batch's backward (DDP's hooks sum the gradients).
function Par:before_last_backward()
  if self.ddp then self.ddp:arm() end
end

-- Validation's forward of batch b: add(logits, targets) is called with
-- this rank's logits (under PP by the last stage, in the training's
-- micro-batches where they divide the batch: the stages then work at once).
function Par:forward_eval(b, add)
  self:shard_batch(b)
  if not self.pipe then
    titan.scope(function() add(self.model(b.inputs), b.targets) end)
    return
  end
  local rows, n = self.cfg.parallelism.pipeline_parallel_microbatch_size, b.inputs:size(1)
  local mbs = (rows < n and n % rows == 0) and cut(b, rows) or { b }
  self.pipe:forward_only(mbs, add)
  if mbs[1] ~= b then
    for _, mb in ipairs(mbs) do mb.inputs:free(); mb.targets:free() end
  end
end

-- A validation's sums over the pipeline (the last stage's) and the data-parallel ranks.
function Par:sum_eval(total, ntok)
  if self.pp_group then total, ntok = unpack(self.pp_group:sum_numbers({ total, ntok })) end
  if self.dp then total, ntok = unpack(self.dp:sum_numbers({ total, ntok })) end
  return total, ntok
end

-- Gradient sums and the norm: lua/parallel/grads.lua.
function Par:sync(params, loss) return grads.sync(self, params, loss) end
function Par:clip_grad_norm(params, max_norm) return grads.clip_norm(self, params, max_norm) end
function Par:norm_on_device(params, max_norm, out) return grads.norm_on_device(self, params, max_norm, out) end
-- Does any rank hold a piece of the gradients only (the norm's squares are then summed over ranks)?
function Par:sharded() return (self.fsdp or self.tp_plan or self.pp_group or self.ep_plan) and true or false end

-- The family's hook before the optimizer's step (MoE's expert bias moves by
-- the step's token counts, summed over the ranks that routed them): the
-- log line's extra figures, or nil.
function Par:pre_optimizer_step()
  local hook = self.family.hooks and self.family.hooks.pre_optimizer_step
  return hook and hook(self.model, self.token_counts) or nil
end

-- The banner's lines about the layout, each transform's own.
function Par:describe()
  return require("parallel.describe").lines(self)
end

function Par:close()
  for _, c in ipairs(self.cp_ctxs) do c:free() end
end

return M
