-- dims.lua — TorchTitan's ParallelDims: the parallelism degrees of a config
-- on a world of ranks, every rule they must keep in one place, and the
-- device mesh they make.
--
--   local dims = require("parallel.dims")
--   local pd = dims.new(cfg, world)          -- the degrees: errors before any rank communicates
--   pd.tp, pd.dp_shard, pd:enabled("tp")    -- is TP on
--   pd:check_model(model, family)            -- what needs the model: heads, experts, stages, float8
--   local mesh = pd:build_mesh(rank, { group = root })  -- [pp, dp_replicate, dp_shard, cp, tp] + views
--
-- A layout that does not fit the ranks is refused, never bent: the job
-- would train something else than asked. The lines say "trainer:" as they
-- did when the trainer held these rules (scripts match them).
local meshlib = require("titan.mesh")

local M = {}

local Dims = {}
Dims.__index = Dims
M.Dims = Dims

-- The degrees against the ranks (TorchTitan's keys, and their -1 = "the
-- ranks left"). Returns dp_replicate, dp_shard, tp, pp, cp.
function M.resolve(p, world)
  local pp = p.pp
  if pp < 1 or pp % 1 ~= 0 then error(("trainer: parallelism.pp = %s; expected a positive degree"):format(pp), 0) end
  if world % pp ~= 0 then
    error(("trainer: parallelism.pp = %d, but the job has %d rank(s); expected pp to divide the number of ranks "
      .. "(titan --nproc N)"):format(pp, world), 0)
  end
  local full = world
  world = world / pp -- the ranks of one stage
  local tp = p.tp
  if tp < 1 or tp % 1 ~= 0 then error(("trainer: parallelism.tp = %s; expected a positive degree"):format(tp), 0) end
  if world % tp ~= 0 then
    if pp > 1 then
      error(("trainer: parallelism.tp x pp = %d x %d, but the job has %d rank(s); expected their product to divide "
        .. "the number of ranks (titan --nproc N)"):format(tp, pp, full), 0)
    end
    error(("trainer: parallelism.tp = %d, but the job has %d rank(s); expected tp to divide the number of ranks "
      .. "(titan --nproc N)"):format(tp, world), 0)
  end
  world = world / tp
  local cp = p.cp
  if cp < 1 or cp % 1 ~= 0 then error(("trainer: parallelism.cp = %s; expected a positive degree"):format(cp), 0) end
  if world % cp ~= 0 then
    if tp > 1 or pp > 1 then
      error(("trainer: parallelism.cp x tp x pp = %d x %d x %d, but the job has %d rank(s); expected their product "
        .. "to divide the number of ranks (titan --nproc N)"):format(cp, tp, pp, full), 0)
    end
    error(("trainer: parallelism.cp = %d, but the job has %d rank(s); expected cp to divide the number of ranks "
      .. "(titan --nproc N)"):format(cp, full), 0)
  end
  local tps = (tp > 1 and (" x %d"):format(tp) or "") .. (pp > 1 and (" x %d"):format(pp) or "")
    .. (cp > 1 and (" x %d"):format(cp) or "")
  world = world / cp -- the data-parallel ranks
  local rep, shard = p.dp_replicate, p.dp_shard
  for key, v in pairs({ dp_replicate = rep, dp_shard = shard }) do
    if v ~= -1 and (v < 1 or v % 1 ~= 0) then
      error(("trainer: parallelism.%s = %s; expected a positive degree or -1 (the ranks left)"):format(key, v), 0)
    end
  end
  if rep == -1 and shard == -1 then
    error("trainer: parallelism.dp_replicate and dp_shard are both -1; expected at most one of them to take "
      .. "the ranks left", 0)
  end
  if rep == -1 then rep = world / shard end
  if shard == -1 then shard = world / rep end
  -- (a -1 that leaves a fraction of a rank is as wrong as a product that misses)
  if rep * shard ~= world or rep % 1 ~= 0 or shard % 1 ~= 0 or rep < 1 or shard < 1 then
    error(("trainer: parallelism.dp_replicate x dp_shard%s%s%s = %s x %s%s, but the job has %d rank(s); expected "
      .. "their product to be the number of ranks (titan --nproc N)"):format(tp > 1 and " x tp" or "",
      pp > 1 and " x pp" or "", cp > 1 and " x cp" or "", tostring(p.dp_replicate), tostring(p.dp_shard), tps, full), 0)
  end
  return rep, shard, tp, pp, cp
end

-- cfg: a resolved config; world: the job's ranks. Only arithmetic: no model, no communication.
function M.new(cfg, world)
  local rep, shard, tp, pp, cp = M.resolve(cfg.parallelism, world)
  local self = setmetatable({ cfg = cfg, world = world, pp = pp, dp_replicate = rep, dp_shard = shard, cp = cp,
    tp = tp, ep = 1 }, Dims)
  self.dp_size = world / (pp * tp * cp) -- the ranks reading different data (dp_replicate x dp_shard)
  return self
end

-- Is a parallelism on: "pp", "dp_replicate", "dp_shard", "cp", "tp", "ep",
-- "dp" (any data parallelism), "fsdp" (dp_shard > 1).
function Dims:enabled(what)
  if what == "dp" then return self.dp_size * self.cp > 1 end
  if what == "fsdp" then return self.dp_shard > 1 end
  local d = self[what]
  if type(d) ~= "number" then
    error(("dims: enabled('%s'); expected pp, dp_replicate, dp_shard, cp, tp, ep, dp or fsdp"):format(tostring(what)), 2)
  end
  return d > 1
end

-- The ranks FSDP shards over, and the ranks that hold distinct pieces of
-- the parameters in all (FSDP x tp x pp).
function Dims:shards() return self.dp_shard * (self.dp_shard > 1 and self.cp or 1) * self.tp * self.pp end

-- This rank's coordinates as the trainer reads them: pp_rank, stage_rank
-- (its index in its stage), dp_rank (of dp_size), cp_rank.
function Dims:coords(rank)
  local inner = self.world / self.pp
  local stage_rank = rank % inner
  return { pp_rank = math.floor(rank / inner), stage_rank = stage_rank,
    dp_rank = math.floor(stage_rank / (self.tp * self.cp)), cp_rank = math.floor(stage_rank / self.tp) % self.cp }
end

-- The DeviceMesh [pp, dp_replicate, dp_shard, cp, tp] with its views (dp,
-- dp_shard_cp, dp_cp, and ep/ep_replica once check_model knows ep).
-- opts: mesh.new's (group: the root group to split; fake: offline).
function Dims:build_mesh(rank, opts)
  return meshlib.from_parallelism({ pp = self.pp, dp_replicate = self.dp_replicate, dp_shard = self.dp_shard,
    cp = self.cp, tp = self.tp, ep = self.ep }, self.world, rank, opts)
end

-- parallelism.expert_parallel_degree against the model and the ranks: the
-- experts spread over ep of the data-parallel ranks (dp_replicate x
-- dp_shard x cp of them), which each route their own tokens.
function Dims:check_experts(model, family)
  local cfg = self.cfg
  local ep = cfg.parallelism.expert_parallel_degree
  if ep < 1 or ep % 1 ~= 0 then
    error(("trainer: parallelism.expert_parallel_degree = %s; expected a positive degree"):format(ep), 0)
  end
  if ep == 1 then return 1 end
  local E = family.num_experts and family.num_experts(model) or 0
  if E == 0 then
    error(("trainer: parallelism.expert_parallel_degree = %d, but %s %s has no mixture-of-experts layers; expected 1, "
      .. "or a flavor with experts (debugmodel_moe)"):format(ep, cfg.model.name, cfg.model.flavor), 0)
  end
  if E % ep ~= 0 then
    error(("trainer: parallelism.expert_parallel_degree = %d does not divide the %d experts of %s %s's MoE layers; "
      .. "expected a divisor of %d"):format(ep, E, cfg.model.name, cfg.model.flavor, E), 0)
  end
  local nd = self.dp_size * self.cp
  if nd % ep ~= 0 then
    error(("trainer: parallelism.expert_parallel_degree = %d, but the data-parallel ranks (dp_replicate x dp_shard x "
      .. "cp) are %d x %d x %d = %d; expected a divisor of %d (the experts are spread over data-parallel ranks)%s")
      :format(ep, self.dp_replicate, self.dp_shard, self.cp, nd, nd, nd < ep and ", or more ranks (titan --nproc N)"
      or ""), 0)
  end
  return ep
end

-- The pipeline's stages and schedule, checked before the ranks meet.
-- Returns the layout and the number of micro-batches.
function Dims:check_pipeline(model, family)
  local cfg, par = self.cfg, self.cfg.parallelism
  local pp = require("parallel.pp")
  local why = family.pp_plan and family.pp_plan.check and family.pp_plan.check(model.args)
  if not family.pp_plan or why then
    error(("trainer: parallelism.pp = %d, but %s %s: %s"):format(self.pp, cfg.model.name, cfg.model.flavor,
      why or "the model family has no pp_plan"), 0)
  end
  local layout = pp.layout(model.args.n_layers, { pp = self.pp, schedule = par.pipeline_parallel_schedule,
    layers_per_stage = par.pipeline_parallel_layers_per_stage })
  local nmb = cfg.training.local_batch_size / par.pipeline_parallel_microbatch_size
  if layout.schedule == "Interleaved1F1B" and nmb % self.pp ~= 0 then
    error(("trainer: the Interleaved1F1B schedule runs micro-batches in groups of pp = %d, but local_batch_size / "
      .. "pipeline_parallel_microbatch_size = %d / %d = %d micro-batches; expected a multiple of %d"):format(self.pp,
      cfg.training.local_batch_size, par.pipeline_parallel_microbatch_size, nmb, self.pp), 0)
  end
  -- (on GPUs also in the steps it runs in on NCCL: pp.steps)
  local nccl = self.world > 1 and cfg.training.device ~= "cpu"
  why = pp.check(layout, pp.actions(layout, nmb), nmb, nccl)
  if why then error(("trainer: the %s schedule with %d micro-batches: %s"):format(layout.schedule, nmb, why), 0) end
  return layout, nmb
end

-- Everything that needs the model (on meta): TP against the heads and the
-- sequence, its loss and vocabulary flags, the pipeline, the experts, FSDP's
-- float8 gathers. Sets self.ep (and the ep views of later meshes), self.tp_flags,
-- self.pp_layout, self.n_microbatches.
function Dims:check_model(model, family)
  local cfg, t = self.cfg, self.cfg.training
  if self.tp > 1 then
    require("parallel.tp").check(model, family.tp_plan, self.tp)
    local f = { sequence_parallel = cfg.parallelism.sequence_parallel }
    -- Loss parallelism needs the default loss (a recipe's loss_fn or train_step takes whole logits) and an
    -- output layer of its own (not tied to the embedding).
    local lp = cfg.parallelism.loss_parallel
    f.loss_parallel = lp and not cfg.loss_fn and not cfg.train_step and family.tp_plan.output ~= nil
      and not model.args.tie_embeddings
    -- (the embedding is split by vocabulary too, unless it is also the output layer)
    f.vocab_parallel = not model.args.tie_embeddings
    if lp and not f.loss_parallel then
      f.loss_parallel_off = cfg.loss_fn and "the recipe's loss_fn takes whole logits"
        or cfg.train_step and "the recipe's train_step takes whole logits"
        or "the flavor ties the output layer to the embedding"
    end
    if f.sequence_parallel and t.seq_len % self.tp ~= 0 then
      error(("trainer: training.seq_len = %d does not split into parallelism.tp = %d chunks (sequence parallelism); "
        .. "expected a multiple of %d, or --parallelism.sequence_parallel=false"):format(t.seq_len, self.tp,
        self.tp), 0)
    end
    self.tp_flags = f
  end
  if self.pp > 1 then self.pp_layout, self.n_microbatches = self:check_pipeline(model, family) end
  self.ep = self:check_experts(model, family)
  if cfg.float8.enable_fsdp_float8_all_gather then
    if self.dp_shard * (self.dp_shard > 1 and self.cp or 1) <= 1 then
      error(("trainer: float8.enable_fsdp_float8_all_gather = true, but FSDP does not shard this job's weights (%s); "
        .. "expected parallelism.dp_shard > 1"):format(self.world == 1 and "one rank" or "dp_shard = 1"), 0)
    end
    if self.tp > 1 then
      error("trainer: float8.enable_fsdp_float8_all_gather = true with parallelism.tp > 1: not built (a split "
        .. "weight's scale spans the tp ranks too); expected false, or tp = 1", 0)
    end
  end
  if t.cuda_graphs and family.num_experts and family.num_experts(model) > 0 then
    error("training.cuda_graphs: not with a mixture-of-experts flavor (its dispatch reads the routing on the host, "
      .. "which a captured graph cannot); expected false", 0)
  end
  return self
end

-- The config keys the parallel layer reads, checked when the config is
-- resolved (lua/titan/config.lua calls this through the model family):
-- need(ok, message) is config's.
function M.check_config(cfg, need)
  local t, par = cfg.training, cfg.parallelism
  do
    local ok, err = pcall(require("parallel.ac").plan, cfg.activation_checkpoint)
    need(ok, tostring(err))
  end
  local conv = {}
  for c in (cfg.model.converters .. ","):gmatch("%s*([^,]-)%s*,") do
    if c ~= "" then
      need(c == "float8", ("model.converters: '%s'; expected float8 (comma-separated)"):format(c))
      conv[c] = true
    end
  end
  need(require("parallel.float8").recipes[cfg.float8.recipe_name], ("float8.recipe_name = '%s'; expected tensorwise "
    .. "(the one built)"):format(tostring(cfg.float8.recipe_name)))
  need(not cfg.float8.enable_fsdp_float8_all_gather or conv.float8, "float8.enable_fsdp_float8_all_gather = true "
    .. "without model.converters = float8; expected the converter too (there is nothing to gather in fp8)")
  need(not conv.float8 or t.mixed_precision_param ~= "float64", "model.converters = float8 with "
    .. "training.mixed_precision_param = float64; expected float32 or bfloat16")
  need(require("parallel.cp").rotate_methods[par.context_parallel_rotate_method], ("parallelism."
    .. "context_parallel_rotate_method = '%s'; expected allgather or alltoall"):format(
    tostring(par.context_parallel_rotate_method)))
  need(par.cp <= 1 or par.cp % 1 ~= 0 or t.seq_len % (2 * par.cp) == 0, ("training.seq_len = %d does not split into "
    .. "2 x parallelism.cp = %d chunks; expected a multiple of %d"):format(t.seq_len, par.cp, 2 * par.cp))
  need(require("parallel.pp").schedules[par.pipeline_parallel_schedule], "parallelism.pipeline_parallel_schedule "
    .. "must be GPipe, 1F1B or Interleaved1F1B, got '" .. tostring(par.pipeline_parallel_schedule) .. "'")
  local mbs = par.pipeline_parallel_microbatch_size
  need(mbs >= 1 and mbs % 1 == 0 and t.local_batch_size % mbs == 0, ("parallelism.pipeline_parallel_microbatch_size "
    .. "= %s must be a positive divisor of training.local_batch_size = %d"):format(tostring(mbs), t.local_batch_size))
  local lps = par.pipeline_parallel_layers_per_stage
  need(lps == -1 or (lps >= 1 and lps % 1 == 0), ("parallelism.pipeline_parallel_layers_per_stage = %s; expected a "
    .. "positive number of blocks or -1"):format(tostring(lps)))
  local raf = par.fsdp_reshard_after_forward
  need(require("parallel.fsdp").policies[raf], "parallelism.fsdp_reshard_after_forward must be default, always or "
    .. "never, got '" .. tostring(raf) .. "'")
end

return M
