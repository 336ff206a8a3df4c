-- trainer.lua — the training loop. Everything a researcher changes is a
-- plain Lua function a recipe may replace:
--
--   recipe.loss_fn(logits, targets, ctx)      -> loss (a scalar tensor)
--   recipe.train_step(trainer, step)           -> loss value, tokens   (forward/backward over micro-batches)
--   recipe.build_data(cfg, tokenizer, dp)      -> { train = loader, val = loader | nil }
--
-- Flow: config -> model on meta -> materialize + seeded init -> optimizer +
-- schedule -> data -> loop { batches -> forward -> loss -> backward -> clip
-- -> step -> metrics -> validation }.
local titan = require("titan")
local config = require("titan.config")
local optim = require("titan.optim")
local lr_scheduler = require("titan.lr_scheduler")
local metrics = require("titan.metrics")
local ckpt = require("titan.checkpoint")
local memory = require("titan.memory")
local ops = require("titan.ops")
local dist = require("titan.dist")
local tensor = require("titan.tensor")
local profiler = require("titan.profiler")
local F = titan.F

local M = {}

-- ---- the default pieces a recipe can replace -----------------------------

-- Mean cross-entropy over the step's real tokens (ctx.num_tokens counts them
-- across every micro-batch, so the loss does not depend on how the global
-- batch is split).
function M.loss_fn(logits, targets, ctx)
  local V = logits:size(-1)
  local tr = ctx.trainer
  if tr and tr.loss_parallel then -- (logits of this rank's vocabulary slice: lua/parallel/tp.lua)
    return (require("parallel.tp").cross_entropy(logits:reshape(-1, V), targets:reshape(-1), tr.tp_group,
      { num_tokens = ctx.num_tokens }))
  end
  return F.cross_entropy(logits:reshape(-1, V), targets:reshape(-1), { num_tokens = ctx.num_tokens })
end

-- The micro-batches of one optimizer step, and the real tokens in them
-- over every data-parallel rank (each rank's loss is its tokens' share of
-- the global mean, so the ranks' gradients add up to the global batch's).
function M.next_batches(tr)
  local batches, num_tokens = {}, 0
  for i = 1, tr.grad_accum do
    batches[i] = tr.data.train:next()
    if tr.cp_group then M.cp_shard_batch(tr, batches[i]) end
    num_tokens = num_tokens + (batches[i].num_tokens or batches[i].targets:numel())
  end
  if tr.dp then num_tokens = tr.dp:sum_numbers({ num_tokens })[1] end
  return batches, num_tokens
end

-- Under context parallelism: the batch's tokens this rank holds (its
-- chunks of every sequence), and their count where the data counted the
-- real ones (targets at the ignore index do not count).
function M.cp_shard_batch(tr, b)
  local cp = require("parallel.cp")
  local r, n = tr.cp_group:rank(), tr.cp_group:size()
  local inputs, targets = cp.shard(b.inputs, r, n), cp.shard(b.targets, r, n)
  b.inputs:free()
  b.targets:free()
  b.inputs, b.targets = inputs, targets
  if b.num_tokens then
    local real = 0
    for _, t in ipairs(targets:tolist_flat()) do if t >= 0 then real = real + 1 end end
    b.num_tokens = real
  end
  return b
end

-- Forward and backward of one micro-batch; returns its loss tensor. (The
-- regions only time a profiled step: profiler.region is fn(...) otherwise.)
local function backward(loss) loss:backward() end
function M.forward_backward(tr, b, ctx)
  local logits = profiler.region("forward", "step", tr.model, b.inputs)
  local loss = profiler.region("loss", "step", tr.loss_fn, logits, b.targets, ctx)
  profiler.region("backward", "step", backward, loss)
  return loss
end

-- The micro-batches, eagerly: every one runs inside its own scope, so
-- activations are released as soon as its backward is done; gradients
-- accumulate in the parameters' .grad. Returns the summed loss.
-- With several micro-batches the losses stay on the device until the last
-- one (on a GPU: one wait per step, not one per micro-batch); the sum is
-- the same either way.
function M.run_micro_batches(tr, batches, ctx)
  if tr.pipe then return M.run_pipeline(tr, batches, ctx) end
  if tr.ddp then
    -- (a failed micro-batch leaves no reduction running: lua/parallel/ddp.lua)
    local ok, res = pcall(M.run_micro_batches_eager, tr, batches, ctx)
    if not ok then
      tr.ddp:drop()
      error(res, 0)
    end
    return res
  end
  return M.run_micro_batches_eager(tr, batches, ctx)
end
function M.run_micro_batches_eager(tr, batches, ctx)
  local n = #batches
  local on_device = n > 1
  local losses
  local loss_sum = 0
  for i, b in ipairs(batches) do
    if tr.ddp and i == n then tr.ddp:arm() end -- (the last backward's hooks sum the gradients)
    local v = titan.scope(function()
      local loss = M.forward_backward(tr, b, ctx)
      if not on_device then return loss:item() end
      losses = losses or memory.keep(titan.empty({ n }, { dtype = loss:dtype(), device = loss:device() }))
      losses:narrow(1, i, 1):copy_(loss:reshape(1))
      return nil
    end)
    if v then loss_sum = loss_sum + v end
    b.inputs:free()
    b.targets:free()
    batches[i] = nil
  end
  if losses then
    for _, v in ipairs(losses:tolist_flat()) do loss_sum = loss_sum + v end
    losses:free()
  end
  return loss_sum
end

-- Under pipeline parallelism (lua/parallel/pp.lua): each batch is cut into
-- micro-batches of parallelism.pipeline_parallel_microbatch_size rows that
-- the schedule runs through the stages; the last stage's loss_fn gives the
-- losses (the trainer sums them over the pipeline ranks).
function M.run_pipeline(tr, batches, ctx)
  local loss_sum = 0
  local rows = tr.cfg.parallelism.pipeline_parallel_microbatch_size
  for i, b in ipairs(batches) do
    local mbs = {}
    for k = 1, b.inputs:size(1), rows do
      mbs[#mbs + 1] = { inputs = b.inputs:narrow(1, k, rows), targets = b.targets:narrow(1, k, rows) }
    end
    loss_sum = loss_sum + tr.pipe:step(mbs, tr.loss_fn, ctx)
    for _, mb in ipairs(mbs) do mb.inputs:free(); mb.targets:free() end
    b.inputs:free()
    b.targets:free()
    batches[i] = nil
  end
  return loss_sum
end

-- One optimizer step's worth of forward/backward.
function M.train_step(tr, step)
  local batches, num_tokens = profiler.region("data", "step", M.next_batches, tr)
  local ctx = { num_tokens = num_tokens, step = step, trainer = tr }
  return M.run_micro_batches(tr, batches, ctx), num_tokens
end

-- ---- the trainer --------------------------------------------------------------

local Trainer = {}
Trainer.__index = Trainer
M.Trainer = Trainer

-- Makes path (and its parents), or stops with one line naming the config key it came from.
local function mkdir_p(path, key)
  local ok, err = pcall(require("titan.checkpoint.fs").mkdirs, path)
  if not ok then
    error(("trainer: %s: %s"):format(key or "job.dump_folder", (tostring(err):gsub("^checkpoint: ", ""))), 0)
  end
end

-- The parallelism degrees against the ranks this job has (TorchTitan's
-- keys and their -1 = "the ranks left"). Data parallelism runs today:
-- replicated (DDP), sharded (FSDP) and both (HSDP), tensor parallelism
-- alone or with any of them, and pipeline parallelism alone or with any of
-- those (3D: pp x dp x tp); a layout that does not fit the ranks is
-- refused, never bent: the job would train something else than asked.
-- Returns dp_replicate, dp_shard, tp, pp.
local function resolve_parallelism(p, world)
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

M.resolve_parallelism = resolve_parallelism

-- parallelism.expert_parallel_degree against the model and the ranks:
-- the experts spread over ep of the data-parallel ranks (dp_replicate x
-- dp_shard x cp of them), which each route their own tokens. Returns ep.
function M.check_expert_parallel(tr, cfg, model)
  local ep = cfg.parallelism.expert_parallel_degree
  if ep < 1 or ep % 1 ~= 0 then
    error(("trainer: parallelism.expert_parallel_degree = %s; expected a positive degree"):format(ep), 0)
  end
  if ep == 1 then return 1 end
  local layers = require("models.moe").layers(model)
  if #layers == 0 then
    error(("trainer: parallelism.expert_parallel_degree = %d, but %s %s has no mixture-of-experts layers; expected 1, "
      .. "or a flavor with experts (debugmodel_moe)"):format(ep, cfg.model.name, cfg.model.flavor), 0)
  end
  local E = layers[1][2].m.num_experts
  if E % ep ~= 0 then
    error(("trainer: parallelism.expert_parallel_degree = %d does not divide the %d experts of %s %s's MoE layers; "
      .. "expected a divisor of %d"):format(ep, E, cfg.model.name, cfg.model.flavor, E), 0)
  end
  local nd = tr.dp_size * tr.cp
  if nd % ep ~= 0 then
    error(("trainer: parallelism.expert_parallel_degree = %d, but the data-parallel ranks (dp_replicate x dp_shard x "
      .. "cp) are %d x %d x %d = %d; expected a divisor of %d (the experts are spread over data-parallel ranks)%s")
      :format(ep, tr.dp_replicate, tr.dp_shard, tr.cp, nd, nd, nd < ep and ", or more ranks (titan --nproc N)" or ""),
      0)
  end
  return ep
end

-- opts.print: where log lines go (default stdout).
function M.new(cfg, opts)
  opts = opts or {}
  local self = setmetatable({ cfg = cfg }, Trainer)
  local t = cfg.training
  -- Ranks: from the launcher (titan --nproc N, mpirun, srun); one process otherwise.
  local env = dist.env()
  self.rank, self.world = env.rank, env.world
  self.dp_replicate, self.dp_shard, self.tp, self.pp, self.cp = resolve_parallelism(cfg.parallelism, self.world)
  -- The mesh is [pp, dp_replicate, dp_shard, cp, tp], as TorchTitan's: pp
  -- is the outermost dim (a stage's ranks are consecutive) and tp the
  -- innermost (the ranks of a tp group are consecutive, and read the same
  -- data; the data-parallel rank is the tp group's). The cp ranks of a
  -- sequence read the same data too (each keeps its chunks:
  -- lua/parallel/cp.lua). Every stage reads the same data: the first takes
  -- the inputs, the last the targets.
  local inner = self.world / self.pp
  self.pp_rank, self.stage_rank = math.floor(self.rank / inner), self.rank % inner
  self.dp_rank, self.dp_size = math.floor(self.stage_rank / (self.tp * self.cp)), inner / (self.tp * self.cp)
  self.cp_rank = math.floor(self.stage_rank / self.tp) % self.cp
  -- Log lines come from rank 0 (every rank computes the same ones).
  self.print = opts.print or function(line)
    if self.rank == 0 then io.stdout:write(line, "\n"); io.stdout:flush() end
  end
  if t.threads > 0 then titan.set_num_threads(t.threads) end
  titan.set_deterministic(cfg.debug.deterministic)
  titan.set_allow_tf32(t.allow_tf32)
  titan.set_gemm_autotune(t.gemm_autotune)
  titan.manual_seed(t.seed)
  self.device = t.device
  if t.device:match("^cuda") and not titan.cuda_available() then
    error(("trainer: training.device = %s, but %s"):format(t.device, titan.C.tt_cuda_device_count() == 0 and
      "no CUDA device is visible (or titan was built without TITAN_CUDA)" or "that device does not exist"), 0)
  end
  if self.world > 1 and t.device ~= "cpu" then self:check_gpu_ranks(env) end
  if t.device == "cpu" and t.mixed_precision_param == "bfloat16" then
    -- (the CPU's fused kernels are f32/f64: the first RMSNorm would stop the job after the banner)
    error("trainer: training.mixed_precision_param = bfloat16 needs training.device=cuda; the CPU kernels compute "
      .. "in float32 or float64 (expected float32 on the CPU)", 0)
  end

  -- Model: built on meta first, so the size check costs nothing.
  local family = require("models." .. cfg.model.name)
  local function build_meta()
    return family.build(cfg.model.flavor, { device = "meta", dtype = t.mixed_precision_param,
      overrides = { max_seq_len = math.max(t.seq_len, family.args(cfg.model.flavor).max_seq_len) } })
  end
  local model = build_meta()
  local flops, nparams = family.flops_per_token(model, t.seq_len)
  if self.tp > 1 then
    require("parallel.tp").check(model, family.tp_plan, self.tp)
    self.sequence_parallel = cfg.parallelism.sequence_parallel
    -- Loss parallelism needs the default loss (a recipe's loss_fn or train_step takes whole logits) and an
    -- output layer of its own (not tied to the embedding).
    local lp = cfg.parallelism.loss_parallel
    self.loss_parallel = lp and not cfg.loss_fn and not cfg.train_step and family.tp_plan.output ~= nil
      and not model.args.tie_embeddings
    -- (the embedding is split by vocabulary too, unless it is also the output layer)
    self.vocab_parallel = not model.args.tie_embeddings
    if lp and not self.loss_parallel then
      self.loss_parallel_off = cfg.loss_fn and "the recipe's loss_fn takes whole logits"
        or cfg.train_step and "the recipe's train_step takes whole logits"
        or "the flavor ties the output layer to the embedding"
    end
    if self.sequence_parallel and t.seq_len % self.tp ~= 0 then
      error(("trainer: training.seq_len = %d does not split into parallelism.tp = %d chunks (sequence parallelism); "
        .. "expected a multiple of %d, or --parallelism.sequence_parallel=false"):format(t.seq_len, self.tp,
        self.tp), 0)
    end
  end
  if self.pp > 1 then self:plan_pipeline(family, model) end
  self.ep = M.check_expert_parallel(self, cfg, model)
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
  local bytes_per = ({ float32 = 4, float64 = 8, bfloat16 = 2 })[t.mixed_precision_param] or 4
  -- weights + gradients + two f32 AdamW moments (+ f32 master weights under bf16)
  local need = nparams * (2 * bytes_per + 8 + (bytes_per < 4 and 4 or 0))
  -- The host's memory is shared with the OS and the data: 80% of it. A GPU's
  -- activations come on top; past its total the job cannot start at all.
  -- Data-parallel ranks on one host each hold their share: all of it under
  -- DDP, 1/dp_shard under FSDP.
  local total = metrics.device_memory_bytes(t.device)
  local here = t.device == "cpu" and env.local_size or 1
  local limit = total and (t.device == "cpu" and 0.8 * total or total)
  local shards = self.dp_shard * (self.dp_shard > 1 and self.cp or 1) * self.tp * self.pp -- (FSDP: over dp_shard x cp)
  if limit and need * here / shards > limit then
    error(("trainer: %s %s has %.2fB parameters and needs ~%.0f GiB for weights, gradients and optimizer state "
      .. "in %s%s, but %s has %.0f GiB; %s"):format(cfg.model.name, cfg.model.flavor, nparams / 1e9, need / 2 ^ 30,
      t.mixed_precision_param, here > 1 and (" on each of the %d ranks on this host"):format(here) or "",
      t.device == "cpu" and "this machine" or t.device, total / 2 ^ 30,
      t.device == "cpu" and "shard it over more ranks (parallelism.dp_shard), train it on GPUs "
      .. "(training.device=cuda), or pick a smaller flavor"
      or "it needs sharding over several GPUs (the distributed work), or pick a smaller flavor"), 0)
  end
  -- The ranks meet (MPI starts) once the layout and the sizes are known to fit.
  -- self.dp: the data-parallel ranks (nil: one); self.tp_group: this rank's
  -- tensor-parallel ranks.
  -- self.pp_group: this rank's pipeline (one rank of each stage).
  -- On GPUs the tensors' groups are NCCL's (each rank on its own GPU); the
  -- MPI world group stays for what the host decides (the stop signal, the
  -- checkpoint's exchanges) and the groups' exchanges of Lua values.
  if self.world > 1 then
    self.world_group = dist.world_group()
    local all = self.world_group
    if t.device ~= "cpu" then all = dist.nccl_world_group(tensor.device_of(t.device).index) end
    local stage = all -- the ranks of this rank's pipeline stage
    if self.pp > 1 then
      self.pp_group = all:split(self.stage_rank, self.pp_rank)
      stage = inner > 1 and all:split(self.pp_rank, self.stage_rank) or nil
    end
    -- (with cp > 1 the data-parallel group holds the cp ranks too: the
    -- gradients and the loss are summed over both)
    if self.tp > 1 then
      self.tp_group = stage:split(math.floor(self.stage_rank / self.tp), self.stage_rank)
      if self.dp_size * self.cp > 1 then self.dp = stage:split(self.stage_rank % self.tp, self.stage_rank) end
    else
      self.dp = stage
    end
    if self.cp > 1 then -- (the ranks of one data-parallel rank holding the same heads)
      self.cp_group = stage:split(self.dp_rank * self.tp + self.stage_rank % self.tp, self.stage_rank)
    end
    -- Expert parallelism: runs of ep consecutive ranks of self.dp (in its
    -- order: dp rank, then cp rank) share each MoE layer's experts; the
    -- ranks at the same place of every run hold the same experts (replicas).
    if self.ep > 1 then
      local at, nd = self.dp_rank * self.cp + self.cp_rank, self.dp_size * self.cp
      self.ep_group = self.dp:split(math.floor(at / self.ep), at)
      if nd > self.ep then self.ep_replicas = self.dp:split(at % self.ep, at) end
    end
  end
  -- Transforms of the built model (TorchTitan's are TP, float8, AC, FSDP;
  -- of those, TP, AC and FSDP are built). TP splits materialized weights, so
  -- it comes after the initialization here; AC wraps whole blocks and TP
  -- the attention and feed-forward inside them, in either order.
  self.family = family
  if self.pp > 1 then
    self:build_pipeline(family, model, build_meta)
  else
    self:convert(model)
    self.ac_blocks, self.n_blocks = require("parallel.ac").apply(model, cfg.activation_checkpoint)
    self.model = model
  end
  if self.cp_group then -- (their local RoPE tables are freed by close)
    local cp = require("parallel.cp")
    self.cp_ctxs = {}
    local models = self:models_of(model)
    self.cp_rotate = cfg.parallelism.context_parallel_rotate_method
    for i, m in ipairs(models) do self.cp_ctxs[i] = cp.apply(m, self.cp_group, { rotate_method = self.cp_rotate }) end
  end
  if self.ep_group then self:spread_experts(model) end
  local init = function(names) family.init_weights(model, t.seed, names) end
  if self.pp > 1 then
    -- (each stage holds its blocks only; the names, hence the values, are the whole model's)
    local plans = {}
    for _, st in ipairs(self.pipe.stages) do
      if self.dp_shard > 1 or self.tp > 1 then
        -- (TP takes its slices a weight at a time, FSDP its shards a block at a time)
        st.model:to_empty(t.device, { params_storage = false })
        if self.tp > 1 then
          plans[#plans + 1] = require("parallel.tp").apply(st.model, self.tp_group, family.tp_plan,
            { init = function(names) family.init_weights(st.model, t.seed, names) end,
              sequence_parallel = self.sequence_parallel, loss_parallel = self.loss_parallel,
              vocab_parallel = self.vocab_parallel })
        end
      else
        st.model:to_empty(t.device)
        family.init_weights(st.model, t.seed)
      end
    end
    if #plans > 0 then self.tp_plan = require("parallel.tp").combine(plans) end
  elseif self.tp > 1 then
    -- (each weight is whole only while this rank takes its slice, one at a time)
    model:to_empty(t.device, { params_storage = false })
    self.tp_plan = require("parallel.tp").apply(model, self.tp_group, family.tp_plan, { init = init,
      sequence_parallel = self.sequence_parallel, loss_parallel = self.loss_parallel,
      vocab_parallel = self.vocab_parallel })
  elseif self.dp_shard <= 1 then
    model:to_empty(t.device)
    family.init_weights(model, t.seed)
  else
    -- (each block is materialized and initialized on its own, then sharded:
    -- a rank never holds the whole model, not even at the start)
    model:to_empty(t.device, { params_storage = false })
  end
  if self.ep_plan then self:expert_params() end
  if self.dp_shard > 1 then
    -- The shard groups are runs of dp_shard consecutive data-parallel ranks
    -- (the mesh is [dp_replicate, dp_shard, tp], as TorchTitan's); under HSDP
    -- the ranks holding the same shards form the replicate groups. Under TP
    -- (2D) FSDP shards each rank's slices over its data-parallel peers.
    -- With cp > 1 the shards go over dp_shard x cp ranks (TorchTitan's dp_shard_cp).
    local shard, rep = self.dp, nil
    if self.dp_replicate > 1 then
      local at = self.dp_rank * self.cp + self.cp_rank -- (this rank's place in self.dp)
      shard = self.dp:split(math.floor(self.dp_rank / self.dp_shard), at)
      rep = self.dp:split(self.dp_rank % self.dp_shard * self.cp + self.cp_rank, at)
    end
    local fsdp = require("parallel.fsdp")
    -- (on nccl the gathers and reductions overlap computation; mpi's block, so there is nothing to gain)
    local opts = { replicate = rep, reshard_after_forward = cfg.parallelism.fsdp_reshard_after_forward, init = init,
      overlap = self.dp:backend() == "nccl" and cfg.parallelism.fsdp_overlap }
    -- Expert parallelism (lua/parallel/ep.lua): each rank's experts stay whole
    -- when its ep group is all the data-parallel ranks; otherwise an FSDP of
    -- their own shards them over the ranks holding the same experts (the
    -- replicas: TorchTitan's dp_shard_mod_ep), which sums their gradients.
    local ep = self.ep_plan
    local experts = ep and ep.replicas and { reshard_after_forward = opts.reshard_after_forward, overlap = opts.overlap,
      only = ep.params, buffers = false }
    if ep then
      if experts then opts.skip = ep.params else opts.keep = ep.params end
    end
    local models = self:models_of(model) -- (under PP each stage sharded on its own, over the same ranks)
    -- (a family with init_param initializes each rank's rows alone: no rank
    -- computes or holds a whole parameter, even at the start)
    local init_shard = family.init_param and function(name, sh, offset)
      family.init_param(model.args, t.seed, name, sh, offset)
    end
    local each = {}
    for _, m in ipairs(models) do
      opts.init = function(names) family.init_weights(m, t.seed, names) end
      opts.init_shard = init_shard
      -- (the converted layers' weights gathered in fp8: lua/parallel/float8.lua)
      opts.fp8 = cfg.float8.enable_fsdp_float8_all_gather and require("parallel.float8").fsdp_fp8(m) or nil
      each[#each + 1] = fsdp.apply(m, shard, opts)
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
  -- DDP on GPUs: each block's gradients summed during the backward, on the
  -- communication stream (lua/parallel/ddp.lua). (mpi's collectives block:
  -- nothing to overlap; TP and PP reduce their own way; a mixture of
  -- experts' experts have gradients on some ranks only, which per-parameter
  -- sums started by hooks cannot match up: the bucketed sum after the backward does.)
  if self.dp and not self.fsdp and not self.tp_plan and not self.pipe and #require("models.moe").layers(model) == 0
    and self.dp:backend() == "nccl" and cfg.parallelism.ddp_overlap then
    self.ddp = require("parallel.ddp").attach(model, self.dp)
  end
  -- Checkpoint boxes (and HF import's) from the parameters' placements:
  -- where each of this rank's parameters lies in the whole
  -- (lua/parallel/placements.lua; tests/lua/placements_spec.lua checks them
  -- against what the transforms made).
  self.layout = require("parallel.placements").job(cfg, self.world, self.rank)
  self.shard_of = function(name)
    local d = self.layout.params[name]
    if not d then return nil end
    return d.shape, d:box().offset
  end
  self.flops_per_token, self.nparams = flops, nparams

  -- Tokenizer and data.
  local Tokenizer = require("titan.tokenizer")
  local tok_path = cfg.model.tokenizer
  tok_path = config.resolve_file(tok_path)
  self.tokenizer = Tokenizer.load(tok_path)
  if self.tokenizer.vocab_size > model.args.vocab_size then
    error(("trainer: the tokenizer %s has %d tokens but the model's vocab_size is %d"):format(cfg.model.tokenizer,
      self.tokenizer.vocab_size, model.args.vocab_size), 0)
  end
  local build_data = cfg.build_data or require("titan.data").build
  self.data = build_data(cfg, self.tokenizer, { rank = self.dp_rank, world = self.dp_size })

  -- Gradient accumulation from the global batch in tokens.
  local per_micro = t.local_batch_size * t.seq_len * self.dp_size
  if t.global_batch_tokens > 0 then
    if t.global_batch_tokens % per_micro ~= 0 then
      error(("trainer: training.global_batch_tokens = %d is not a multiple of local_batch_size * seq_len * dp = %d")
        :format(t.global_batch_tokens, per_micro), 0)
    end
    self.grad_accum = t.global_batch_tokens / per_micro
  else
    self.grad_accum = 1
  end

  -- Optimizer and schedule.
  local o = cfg.optimizer
  -- Parameter groups: a recipe's `optimizer_groups` list ({pattern =, lr =,
  -- betas =, eps =, weight_decay =}, first match wins), then no_decay_pattern.
  local groups = {}
  for _, g in ipairs(cfg.optimizer_groups or {}) do groups[#groups + 1] = g end
  if o.no_decay_pattern ~= "" then groups[#groups + 1] = { pattern = o.no_decay_pattern, weight_decay = 0 } end
  local named = self.fsdp and self.fsdp:named_parameters() or self.model:named_parameters()
  self.optimizer = optim.AdamW(named, { lr = o.lr, betas = { o.beta1, o.beta2 }, eps = o.eps,
    weight_decay = o.weight_decay, groups = groups })
  self.schedule = lr_scheduler.new(cfg.lr_scheduler, t.steps)
  self.loss_fn = cfg.loss_fn or M.loss_fn
  self.train_step = cfg.train_step or M.train_step
  self.moe_layers = require("models.moe").layers(self.model)
  if #self.moe_layers > 0 then -- (the experts' parameters as the optimizer holds them: FSDP's shards)
    self.expert_set = {}
    for _, np in ipairs(named) do
      if np[1]:find(".moe.experts.", 1, true) then self.expert_set[np[2]] = true end
    end
  end
  -- The experts' token counts of a step are summed over the data-parallel
  -- ranks, and under sequence parallelism over the tp ranks too (each
  -- routed its chunk of the sequence; without it they routed the same tokens).
  self.moe_counts = self.dp
  if #self.moe_layers > 0 and self.tp_plan and self.sequence_parallel then
    local dp, tp = self.dp, self.tp_group
    self.moe_counts = { sum_numbers = function(_, c) return tp:sum_numbers(dp and dp:sum_numbers(c) or c) end }
  end
  if t.cuda_graphs and #self.moe_layers > 0 then
    error("training.cuda_graphs: not with a mixture-of-experts flavor (its dispatch reads the routing on the host, "
      .. "which a captured graph cannot); expected false", 0)
  end
  if t.cuda_graphs then require("titan.graph_step").enable(self, cfg) end

  -- Profiling (docs/profiling.md): regions of every profile_freq-th step,
  -- on a GPU timed by events on its stream (or with a device sync at each
  -- region's edges: profiling.region_timing = sync).
  if cfg.profiling.enable_profiling then
    local dev = t.device
    local gpu = dev:match("^cuda") ~= nil
    local by_device = gpu and cfg.profiling.region_timing == "device"
    self.profiler = profiler.new({ sync = gpu and not by_device and function() titan.synchronize(dev) end or nil,
      device_clock = by_device and require("titan.device_clock").new(dev) or nil,
      memory = function() return titan.memory_stats(dev).allocated end })
    self.profiler:name_modules(self.model)
  end

  -- Metrics.
  mkdir_p(cfg.job.dump_folder)
  -- (made now: a folder that cannot be made stops the job before its first step)
  if self.profiler then mkdir_p(self:traces_folder(), "profiling.save_traces_folder") end
  local peak = cfg.metrics.peak_flops
  local measured = peak <= 0 and t.device == "cpu"
  if peak <= 0 then peak = measured and metrics.measure_cpu_peak_flops() or 989e12 end
  self.peak_flops = peak
  local tb
  if cfg.metrics.enable_tensorboard and self.rank == 0 then
    -- (as TorchTitan: a subfolder a run, so tensorboard shows each as a run)
    local f = cfg.metrics.save_tb_folder
    local dir = (f:sub(1, 1) == "/" and f or (cfg.job.dump_folder .. "/" .. f)) .. "/" .. os.date("%Y%m%d-%H%M")
    mkdir_p(dir, "metrics.save_tb_folder")
    tb = require("titan.tensorboard").Writer(dir)
    self.print("metrics: TensorBoard events in " .. tb.path)
  end
  self.logger = metrics.Logger({
    jsonl_path = cfg.metrics.enable_jsonl and self.rank == 0 and (cfg.job.dump_folder .. "/metrics.jsonl") or nil,
    tensorboard = tb,
    device = t.device, peak_flops = peak, flops_per_token = flops, rank = self.rank, print = self.print,
    remeasure_peak = measured and metrics.measure_cpu_peak_flops or nil,
  })
  self.step = 0

  -- Checkpoints: resume from the latest complete one (or load_step), unless
  -- this run only creates the seed checkpoint.
  local wg = self.world_group
  self.checkpoint = ckpt.Manager(cfg.checkpoint, { dump_folder = cfg.job.dump_folder, rank = self.rank,
    world = self.world, log = function(line) self.print(line) end, shard_of = self.shard_of,
    data_rank = self.dp_rank, known_names = self.all_names,
    gather = wg and function(v) return wg:gather_object(v) end, barrier = wg and function() wg:barrier() end })
  self.checkpoint:prepare()
  if not cfg.checkpoint.create_seed_checkpoint then
    local state = self:ckpt_state()
    local s = self.checkpoint:load(state)
    if s then
      self.step = s
      if state.extra.rng then titan.set_rng_state(state.extra.rng) end
    end
  end
  return self
end

-- Ranks on GPUs: each rank of a host on its own GPU (training.device=cuda
-- names the local rank's), their tensors' collectives over NCCL.
function Trainer:check_gpu_ranks(env)
  local t = self.cfg.training
  if not dist.built("nccl") then
    error(("trainer: %d ranks on training.device = %s, but this build has no NCCL backend; expected a build "
      .. "with TITAN_CUDA, or training.device=cpu"):format(self.world, t.device), 0)
  end
  -- (a rank shown one GPU by CUDA_VISIBLE_DEVICES is taken to be shown its own)
  local n = titan.cuda_device_count()
  if env.local_size > 1 and not (n == 1 and os.getenv("CUDA_VISIBLE_DEVICES")) then
    if t.device ~= "cuda" then
      error(("trainer: training.device = %s puts the %d ranks of this host on one GPU; expected "
        .. "training.device=cuda (each rank takes the GPU of its local rank)"):format(t.device, env.local_size), 0)
    end
    if env.local_size > n then
      error(("trainer: %d ranks on this host, but %d GPU%s visible; expected one GPU per rank (at most %d ranks "
        .. "per host, or each rank shown its own GPU by CUDA_VISIBLE_DEVICES)"):format(env.local_size, n,
        n == 1 and " is" or "s are", n), 0)
    end
  end
end

-- The pipeline's stages and schedule, checked before the ranks meet: a
-- layout that cannot run is one line.
function Trainer:plan_pipeline(family, model)
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
  if why then
    error(("trainer: the %s schedule with %d micro-batches: %s"):format(layout.schedule, nmb, why), 0)
  end
  self.pp_layout, self.n_microbatches = layout, nmb
end

-- "a, b, a, a" -> "a x3, b": a list's distinct entries in first-seen order, with their counts.
function M.counted(list)
  local n, order = {}, {}
  for _, s in ipairs(list) do
    if not n[s] then order[#order + 1] = s end
    n[s] = (n[s] or 0) + 1
  end
  for i, s in ipairs(order) do order[i] = n[s] > 1 and ("%s x%d"):format(s, n[s]) or s end
  return table.concat(order, ", ")
end

-- model.converters, before AC (TorchTitan's order: after TP, whose split
-- of the weights comes later here, which is the same since the conversion
-- only swaps the Linear layers' forward): float8 turns them into fp8 ones
-- (lua/parallel/float8.lua); self.float8 counts them for the banner.
function Trainer:convert(model)
  local conv = self.cfg.model.converters
  if not (("," .. conv .. ","):gsub("%s", ""):find(",float8,", 1, true)) then return end
  local filter = {}
  for f in (self.cfg.float8.filter_fqns .. ","):gmatch("%s*([^,]-)%s*,") do
    if f ~= "" then filter[#filter + 1] = f end
  end
  -- (under TP each scale spans every rank's shard: one all-reduce of a number per cast; not in a
  -- mixture of experts, whole on every rank, whose experts run only where they got tokens)
  local moe = {}
  for _, nl in ipairs(require("models.moe").layers(model)) do moe[#moe + 1] = nl[1] .. "." end
  local function ungrouped(name)
    for _, p in ipairs(moe) do
      if name:sub(1, #p) == p then return true end
    end
    return false
  end
  local done, skipped = require("parallel.float8").apply(model, { filter_fqns = filter, group = self.tp_group,
    ungrouped = ungrouped })
  self.float8 = self.float8 or { done = 0, skipped = {} }
  self.float8.done = self.float8.done + #done
  -- (named by pattern: layers.*.moe.router stands for one per block)
  for _, s in ipairs(skipped) do
    self.float8.skipped[#self.float8.skipped + 1] = s[1]:gsub("%.%d+%.", ".*.") .. " (" .. s[2] .. ")"
  end
end

-- Pipeline parallelism: this rank's stages, each a copy of the model built
-- on meta and pruned to its blocks (lua/parallel/pp.lua), with activation
-- checkpointing applied to each; self.model is their union (one module with
-- the whole model's parameter names), self.pipe runs the schedule.
function Trainer:build_pipeline(family, model, build_meta)
  local cfg, pp, layout = self.cfg, require("parallel.pp"), self.pp_layout
  local stages = pp.split(build_meta, family.pp_plan, layout, self.pp_rank)
  self.ac_blocks, self.n_blocks = 0, model.args.n_layers
  for _, st in ipairs(stages) do
    self:convert(st.model)
    self.ac_blocks = self.ac_blocks + require("parallel.ac").apply(st.model, cfg.activation_checkpoint)
  end
  self.ac_blocks = self.pp_group:sum_numbers({ self.ac_blocks })[1] -- (the banner counts the whole model's)
  if self.float8 then -- (likewise)
    self.float8.done = self.pp_group:sum_numbers({ self.float8.done })[1]
    local all = {}
    for _, list in ipairs(self.pp_group:gather_object(self.float8.skipped)) do
      for _, s in ipairs(list) do all[#all + 1] = s end
    end
    self.float8.skipped = all
  end
  -- (under sequence parallelism a stage boundary carries this rank's chunk of the sequence)
  self.pipe = pp.pipeline(stages, self.pp_group, layout, { dim = model.args.dim,
    seq_shards = self.sequence_parallel and self.tp or 1 })
  self.model = pp.Stages(stages)
  -- Checkpoints: the names the whole pipeline holds (this rank's are a part).
  self.all_names = {}
  for _, np in ipairs(model:named_parameters()) do self.all_names[np[1]] = true end
end

-- The models this rank runs: its pipeline stages, or the model.
function Trainer:models_of(model)
  if not self.pipe then return { model } end
  local out = {}
  for i, st in ipairs(self.pipe.stages) do out[i] = st.model end
  return out
end

-- Expert parallelism (lua/parallel/ep.lua): each rank keeps its share of
-- every MoE layer's experts, dropped from the meta model before any memory.
-- self.ep_plan: { group, replicas (nil: none), params (the set of this
-- rank's expert parameters, once materialized: Trainer:expert_params),
-- layers, local_experts, experts }.
function Trainer:spread_experts(model)
  if not self.all_names then -- (checkpoints: the names the whole job holds; this rank's are a part)
    self.all_names = {}
    for _, np in ipairs(model:named_parameters()) do self.all_names[np[1]] = true end
  end
  local ep = require("parallel.ep")
  local models = self:models_of(model)
  -- (the counts for the banner from the whole model: a pipeline stage may hold no MoE layer)
  local E = require("models.moe").layers(model)[1][2].m.num_experts
  local plan = { group = self.ep_group, replicas = self.ep_replicas, layers = 0, plans = {}, experts = E,
    local_experts = E / self.ep }
  for _, m in ipairs(models) do
    local p = ep.apply(m, self.ep_group)
    plan.plans[#plan.plans + 1] = p
    plan.layers = plan.layers + p.layers
  end
  self.ep_plan = plan
end

-- What a checkpoint holds: model, optimizer, data position, step, RNG.
function Trainer:ckpt_state()
  return {
    model = self.fsdp and self.fsdp:state_model() or self.model, optimizer = self.optimizer,
    dataloader = self.data.train,
    extra = { step = self.step, lr_step = self.step, rng = titan.rng_state() },
  }
end

function Trainer:banner()
  local t, a = self.cfg.training, self.model.args
  -- A tokenizer smaller than the flavor's vocabulary trains rows no token
  -- ever uses (the flavor fixes vocab_size): say how many it uses.
  local nv = self.tokenizer.vocab_size
  local vocab = nv < a.vocab_size and ("%d (the tokenizer uses %d)"):format(a.vocab_size, nv) or tostring(a.vocab_size)
  self.print(("titan %s | %s %s: %s parameters, dim %d, %d layers, %d heads (%d kv), vocab %s | %d threads | %s"):format(
    titan.version(), self.cfg.model.name, self.cfg.model.flavor, metrics.commas(self.nparams), a.dim, a.n_layers,
    a.n_heads, a.n_kv_heads, vocab, titan.num_threads(), t.device))
  self.print(("batch %d x %d tokens x %d accumulation = %s tokens/step | %d steps | peak %.1f GFLOP/s (%s) | %s FLOPs/token")
    :format(t.local_batch_size, t.seq_len, self.grad_accum,
      metrics.commas(t.local_batch_size * t.seq_len * self.grad_accum * self.dp_size), t.steps, self.peak_flops / 1e9,
      self.cfg.metrics.peak_flops > 0 and "configured" or "measured", metrics.commas(self.flops_per_token)))
  -- (on GPUs the collectives are NCCL's and the threads only feed the GPU)
  local over = self.dp and ({ nccl = "NCCL", ["local"] = "simulated ranks" })[self.dp:backend()] or "MPI"
  local each = t.device == "cpu" and (", %d threads each"):format(titan.num_threads()) or ""
  if self.fsdp then
    local rep = self.dp_replicate > 1 and (" x %d replicas (HSDP: shard gradients then summed over the replicas)")
      :format(self.dp_replicate) or ""
    self.print(("data parallel over %s: %d ranks, FSDP over %d shards%s: each rank keeps %s of the parameters (and "
      .. "that share of gradients and optimizer state), a block's full parameters only while it runs (reshard "
      .. "after forward: %s)%s%s; tps and MFU are per rank"):format(over, self.dp_size, self.dp_shard * self.cp, rep,
      ("%.1f MiB"):format(self.fsdp:sharded_bytes() / 2 ^ 20), self.cfg.parallelism.fsdp_reshard_after_forward,
      self.fsdp_overlap and ("; on the communication stream, the next block's parameters gathered while one "
        .. "computes and each block's gradients reduced during the backward") or "", each))
  elseif self.dp and self.dp_size > 1 then
    self.print(("data parallel over %s: %d ranks (DDP: %s)%s; tps and MFU are per rank"):format(over, self.dp_size,
      self.ddp and "each block's gradients summed during the backward, on the communication stream"
      or "gradients summed in ~25 MB buckets each step", each))
  end
  if self.cp_group then
    self.print(("context parallel over %s: %d ranks per sequence, each holding %d of its %d tokens (of %d chunks, "
      .. "rank r the r-th from the start and from the end: the same causal work); %s; gradients summed over the "
      .. "data-parallel and context-parallel ranks%s"):format(over, self.cp, t.seq_len / self.cp, t.seq_len,
      2 * self.cp, self.cp_rotate == "alltoall"
      and "ring attention (alltoall): keys and values passed around the cp ranks a rank's share at a time"
      or "keys and values all-gathered, their gradients reduce-scattered",
      self.fsdp and " (FSDP shards over both)" or ""))
  end
  if self.ep_plan then
    local e = self.ep_plan
    self.print(("expert parallel over %s: each group of %d data-parallel ranks shares the %d experts of each of %d "
      .. "MoE layers, %d per rank; each layer sends the tokens to their experts' ranks and the outputs back%s")
      :format(over, self.ep, e.experts, e.layers, e.local_experts, e.sharded and ("; FSDP shards them over the %d "
      .. "ranks holding the same ones"):format(e.replicas:size()) or e.replicas and ("; the experts' gradients "
      .. "summed over the %d ranks holding the same ones"):format(e.replicas:size()) or ""))
  end
  if self.tp_plan then
    self.print(("tensor parallel: %d ranks per replica split each block's heads and feed-forward units (%s); tps "
      .. "and MFU are per rank"):format(self.tp, (self.sequence_parallel and "sequence parallel: norms and the "
      .. "residual stream split along the sequence, an all-gather into and a reduce-scatter out of each half-block"
      or "two all-reduces of the activations per block each way") .. (self.vocab_parallel and "; the embedding "
      .. "split by vocabulary" or "") .. (self.loss_parallel and "; loss parallel: "
      .. "the output layer split by vocabulary, the loss from the slices" or (self.loss_parallel_off and
      ("; loss parallel off: " .. self.loss_parallel_off) or ""))))
  end
  if self.pipe then
    local L, parts = self.pipe.layout, {}
    for s = 0, L.S - 1 do
      local r = L.ranges[s]
      parts[#parts + 1] = r[2] - r[1] > 1 and ("%d-%d"):format(r[1], r[2] - 1) or tostring(r[1])
    end
    self.print(("pipeline parallel: %d stages over %d ranks (%s, %d micro-batches of %d rows per batch); blocks "
      .. "by stage: %s; stage s runs on pipeline rank s mod %d; tps and MFU are per rank"):format(L.S, self.pp,
      L.schedule, self.n_microbatches, self.cfg.parallelism.pipeline_parallel_microbatch_size,
      table.concat(parts, " | "), self.pp))
  end
  if t.gemm_autotune then
    self.print("gemm autotune: " .. (t.device == "cpu" and "ignored on the CPU (one algorithm per GEMM)"
      or self.cfg.debug.deterministic and "off under debug.deterministic (the timing could change the bits)"
      or "the first overwriting GEMM of each shape times cuBLASLt's best candidates and keeps the fastest "
      .. "(a wait per new shape, in the first steps)"))
  end
  if self.float8 then
    local f = self.float8
    self.print(("float8: %d Linear layers multiply in fp8 (tensorwise dynamic scaling: e4m3 forward, e5m2 "
      .. "gradients)%s%s%s"):format(f.done, #f.skipped > 0 and "; unconverted: " .. M.counted(f.skipped) or "",
      self.cfg.float8.enable_fsdp_float8_all_gather and "; FSDP gathers the converted weights in fp8, each shard "
      .. "cast with the whole weight's scale" or "",
      t.device == "cpu" and "; on the CPU the fp8 values are widened to f32 (the numerics, not the speed)" or ""))
  end
  if self.ac_blocks > 0 then
    -- (tflops and MFU count the model's FLOPs, not the recomputation's: as TorchTitan's)
    local ac = self.cfg.activation_checkpoint
    self.print(("activation checkpointing: %s, %d of %d blocks recompute their activations in the backward%s")
      :format(ac.mode, self.ac_blocks, self.n_blocks, (ac.mode == "selective" and ac.selective_ac_option == "op")
        and " (per op: attention and every other linear kept)" or ""))
  end
  io.stdout:flush()
end

function Trainer:validate()
  local v = self.data.val
  if not v then return end
  local total, ntok = 0, 0
  local function add(logits, targets)
    local V = logits:size(-1)
    local loss, n
    if self.loss_parallel then
      loss, n = require("parallel.tp").cross_entropy(logits:reshape(-1, V), targets:reshape(-1), self.tp_group,
        { reduction = "sum" })
    else
      loss, n = F.cross_entropy(logits:reshape(-1, V), targets:reshape(-1), { reduction = "sum" })
    end
    total = total + loss:item()
    ntok = ntok + n
  end
  -- (in eval mode: what a training forward counts, MoE's tokens per expert, it does not)
  self.model:eval()
  titan.no_grad(function()
    for _ = 1, self.cfg.validation.steps do
      local b = v:next()
      -- (the data-parallel ranks stop together: their forwards meet in
      -- collectives, FSDP's gathers and expert parallelism's exchanges, and a
      -- recipe's data may end one rank's share a batch before another's)
      if self.dp and self.dp:sum_numbers({ b and 0 or 1 })[1] > 0 then
        if b then b.inputs:free(); b.targets:free() end
        break
      end
      if not b then break end
      if self.cp_group then M.cp_shard_batch(self, b) end
      if self.pipe then -- (the last stage adds; the sums go over the pipeline below)
        -- in the training's micro-batches where they divide the batch: the stages then work at once
        -- on different micro-batches, and each holds one micro-batch's activations
        local rows, n = self.cfg.parallelism.pipeline_parallel_microbatch_size, b.inputs:size(1)
        local mbs = { b }
        if rows < n and n % rows == 0 then
          mbs = {}
          for k = 1, n, rows do
            mbs[#mbs + 1] = { inputs = b.inputs:narrow(1, k, rows), targets = b.targets:narrow(1, k, rows) }
          end
        end
        self.pipe:forward_only(mbs, add)
        if mbs[1] ~= b then
          for _, mb in ipairs(mbs) do mb.inputs:free(); mb.targets:free() end
        end
      else
        titan.scope(function() add(self.model(b.inputs), b.targets) end)
      end
      b.inputs:free()
      b.targets:free()
    end
  end)
  self.model:train()
  if v.reset then v:reset() end
  if self.pp_group then total, ntok = unpack(self.pp_group:sum_numbers({ total, ntok })) end
  -- (each data-parallel rank validated its own share: the loss is over all of them)
  if self.dp then total, ntok = unpack(self.dp:sum_numbers({ total, ntok })) end
  if ntok > 0 then
    self.logger:log_validation(self.step, total / ntok, ntok)
    self.last_val_loss = total / ntok
  end
  return ntok > 0 and total / ntok or nil
end

-- Data parallelism (DDP): every rank's gradients summed over the ranks,
-- in place (each rank's loss was already its share of the global mean),
-- and the step's loss summed the same way. Gradients go in buckets of
-- about 25 MB (DDP's default) packed into one buffer: one collective per
-- bucket, not per parameter. Returns the global loss.
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

-- A mixture of experts' expert that no token of this rank reached in the
-- step has no gradient; it gets zeros (TorchTitan's experts are one stacked
-- tensor, whose unused rows get zeros too), so every rank sums the same
-- tensors over its groups, and one process steps the same parameters as
-- several (AdamW moves an unused expert by its moments).
function Trainer:fill_expert_grads(params)
  local set = self.expert_set
  if not set then return end
  for _, p in ipairs(params) do
    if set[p] and not p.grad then
      p.grad = memory.keep(titan.zeros(p:shape(), { dtype = p:dtype(), device = p:device() }))
    end
  end
end

function Trainer:reduce_gradients(params, loss)
  local dp = self.dp
  local bucket_elems = math.floor(25 * 2 ^ 20 / 4)
  local pending, n = {}, 0
  local function flush()
    if #pending > 0 then all_reduce_packed(dp, pending, n) end
    pending, n = {}, 0
  end
  for _, p in ipairs(params) do
    local g = p.grad
    if g then
      if #pending > 0 and (n + g:numel() > bucket_elems or g:dtype() ~= pending[1]:dtype()) then flush() end
      pending[#pending + 1] = g
      n = n + g:numel()
    end
  end
  flush()
  return dp:sum_numbers({ loss })[1]
end

-- The gradients of the parameters of `params` in `set` summed over group,
-- in one buffer (they share a dtype: the model's).
local function all_reduce_grads_of(group, params, set)
  local grads, n = {}, 0
  for _, p in ipairs(params) do
    if set[p] and p.grad then
      grads[#grads + 1] = p.grad
      n = n + p.grad:numel()
    end
  end
  if n > 0 then all_reduce_packed(group, grads, n) end
end

-- Sequence parallelism: the norms' weights saw this rank's chunk of the
-- tokens, so their gradients (or their FSDP shards') are summed over the
-- tp ranks, in one buffer.
function Trainer:reduce_partial_grads(params)
  local tpp, fsdp = self.tp_plan, self.fsdp
  all_reduce_grads_of(tpp.group, params, fsdp and fsdp:shards_of(tpp.partial) or tpp.partial)
end

-- The set of this rank's expert parameters (after the model has memory:
-- materializing puts new tensors in the modules).
function Trainer:expert_params()
  local set = {}
  for _, p in ipairs(self.ep_plan.plans) do
    for t in pairs(p:params()) do set[t] = true end
  end
  self.ep_plan.params = set
  return set
end

-- Expert parallelism: the experts' gradients are the ep group's already
-- (each expert ran every rank's rows for it); ranks holding the same
-- experts in other ep groups sum theirs.
function Trainer:reduce_expert_grads(params)
  local plan = self.ep_plan
  if plan.replicas and not plan.sharded then all_reduce_grads_of(plan.replicas, params, plan.params) end
end

-- The largest signal number any rank has pending (nil: none), so that all
-- ranks take the same stop-or-go decision at a step boundary.
function Trainer:agree_signal(signum)
  local t = titan.tensor({ signum or 0 }, { dtype = "int64" })
  self.world_group:all_reduce(t, "max")
  local v = t:tolist_flat()[1]
  t:free()
  return v > 0 and v or nil
end

-- Forward/backward, gradient reduction and the update of one step: the
-- loss, the step's tokens and the gradient norm (or a function reading it).
local function reduce(self, params, loss)
  self:fill_expert_grads(params)
  if self.tp_plan and self.tp_plan.partial then self:reduce_partial_grads(params) end
  if self.pp_group then loss = self.pp_group:sum_numbers({ loss })[1] end -- (the last stage's)
  if self.fsdp then
    loss = self.dp:sum_numbers({ loss })[1] -- (the gradients were reduce-scattered in the backward)
  elseif self.ddp then
    local n = self.ddp:finish(params) -- (most were started in the backward)
    if not self.ddp_told then -- (once: that the hooks did their part)
      self.ddp_told = true
      self.print(("DDP: %d of %d blocks' gradient sums started during the backward"):format(n,
        self.ddp.nblocks))
    end
    loss = self.dp:sum_numbers({ loss })[1]
  elseif self.dp then
    local dense = params
    if self.ep_plan then -- (the experts' gradients are reduced their own way, below)
      dense = {}
      for _, p in ipairs(params) do
        if not self.ep_plan.params[p] then dense[#dense + 1] = p end
      end
    end
    loss = self:reduce_gradients(dense, loss)
  end
  if self.ep_plan then self:reduce_expert_grads(params) end
  return loss
end

function Trainer:step_once(step, params)
  local loss, ntok = self:train_step(step)
  loss = profiler.region("gradient reduction", "step", reduce, self, params, loss)
  if loss ~= loss or loss == math.huge or loss == -math.huge then
    -- Stop before the update: the weights stay those of the last good step, and
    -- nothing of this step is logged or saved.
    local saved = self.checkpoint.last_saved
    self.optimizer:zero_grad({ set_to_none = self.graph_state == nil })
    error(("trainer: loss is %s at step %d; nothing from this step was saved (%s); lower optimizer.lr, "
      .. "set training.max_norm, or check the data"):format(loss ~= loss and "NaN" or "infinite", step,
      saved and ("the last checkpoint is step " .. saved) or "no checkpoint was saved"), 0)
  end
  return loss, ntok, profiler.region("optimizer", "step", self.update, self, params)
end

-- profiling.save_traces_folder under job.dump_folder (an absolute path as it is).
function Trainer:traces_folder()
  local f = self.cfg.profiling.save_traces_folder
  return f:sub(1, 1) == "/" and f or (self.cfg.job.dump_folder .. "/" .. f)
end

-- How a profiled step's regions were timed, for its first line.
function Trainer:profile_how(prof)
  if prof.device_clock then
    return (" on the device (events on its stream; the host queued it in %.1f ms)"):format(prof:host_elapsed() * 1e3)
  end
  return self.device:match("^cuda") and " with a device sync at each (slower than an unprofiled step)" or ""
end

-- A profiled step's trace and summary: <dump_folder>/<save_traces_folder>/
-- iteration_<step>/rank<r>_trace.json and rank<r>_summary.txt; rank 0
-- prints the heaviest regions.
function Trainer:write_profile(step, prof)
  local dir = ("%s/iteration_%d"):format(self:traces_folder(), step)
  mkdir_p(dir, "profiling.save_traces_folder")
  local trace = ("%s/rank%d_trace.json"):format(dir, self.rank)
  prof:write_trace(trace, { rank = self.rank, step = step, world = self.world, device = self.device })
  local text = prof:summary_text()
  local f = io.open(("%s/rank%d_summary.txt"):format(dir, self.rank), "w")
  if f then
    f:write(("step %d, rank %d, %.3f ms timed region by region%s\n"):format(step, self.rank, prof:elapsed() * 1e3,
      self:profile_how(prof)), text, "\n")
    f:close()
  end
  self.print(("profiler: step %d took %.1f ms timed region by region%s; trace %s; the heaviest regions by their "
    .. "own time:"):format(step, prof:elapsed() * 1e3, self:profile_how(prof), trace))
  self.print(prof:summary_text(12))
end

-- After the gradients of a step: clip them, step the optimizer, zero them.
-- Returns the gradient norm before clipping. (titan.graph_step replaces it
-- with a replay of the same three, which returns a function reading the
-- norm back.)
function Trainer:update(params)
  -- MoE's aux-loss-free balance (lua/models/moe.lua): each layer's expert
  -- bias moves by the step's token counts, summed over the data-parallel
  -- (and context-parallel) ranks, before the optimizer's step.
  -- self.moe_load: the busiest expert's load over the mean, averaged over this rank's MoE layers (the
  -- log line's "moe load")
  local moe = require("models.moe")
  local load = 0
  for _, l in ipairs(self.moe_layers) do load = load + moe.max_load(l[2]:update_bias(self.moe_counts)) end
  self.moe_load = #self.moe_layers > 0 and load / #self.moe_layers or nil
  -- device_update: nil = on for GPU devices; true forces it (specs run it
  -- on the CPU, whose backend has the same ops); false = the host path.
  -- Where ranks hold shares of the gradients (FSDP, TP, PP) the squares are
  -- summed over the ranks first, on the device (sharded_norm_dev) as on the
  -- host (clip_grad_norm's sums below).
  local fsdp, tpp, ppg, ep = self.fsdp, self.tp_plan, self.pp_group, self.ep_plan
  local whole = not (fsdp or tpp or ppg or ep)
  if self.device_update or (self.device_update == nil and self.device ~= "cpu") then
    local norm = self:update_on_device(params, not whole)
    if norm then return norm end
  end
  local opts
  if not whole then
    -- The squares of the split weights' pieces are summed over the tp ranks
    -- and the whole weights counted once; then every rank's total over its
    -- FSDP shard group (the replicas hold the same shares), the experts'
    -- over the ep group (each holds its own), and the sum over the
    -- pipeline's stages (each holds its own parameters).
    opts = { sharded = self:tp_split_params(), own = ep and ep.params,
      sum_squares = function(sq) return tpp and tpp.group:sum_numbers({ sq })[1] or sq end,
      sum_total = function(x, own)
        if fsdp then x = fsdp:sum_over_shards(x) end
        if ep then -- (each rank of the ep group holds its own experts; FSDP's shards of them, their share)
          own = ep.group:sum_numbers({ own })[1]
          if ep.sharded then own = ep.replicas:sum_numbers({ own })[1] end
        end
        x = x + own
        if ppg then x = ppg:sum_numbers({ x })[1] end
        return x
      end }
  end
  local grad_norm = optim.clip_grad_norm(params, self.cfg.training.max_norm, opts)
  self.optimizer:step()
  -- A captured graph accumulates into these very buffers: zero, keep them.
  self.optimizer:zero_grad({ set_to_none = self.graph_state == nil })
  return grad_norm
end

-- The parameters tensor parallelism splits (under FSDP, their shards), or
-- nil without it: their gradients' squares are summed over the tp group.
function Trainer:tp_split_params()
  local tpp = self.tp_plan
  return tpp and (self.fsdp and self.fsdp:shards_of(tpp.sharded) or tpp.sharded)
end

-- The gradient norm where ranks hold shares of the gradients, on the device
-- with no host wait, summed as clip_grad_norm sums it on the host: the
-- squares of the split weights' pieces over the tp group, the whole weights
-- once, then each rank's total over its FSDP shard group (the replicas hold
-- the same shares) and over the pipeline's stages. Into out (f64 {2}) as
-- global_norm_dev_ writes it: {norm, clip coefficient}.
function Trainer:sharded_norm_dev(params, max_norm, out)
  local fsdp, tpp, ppg, ep = self.fsdp, self.tp_plan, self.pp_group, self.ep_plan
  local _, split, whole, mine = optim.grads_by_share(params, self:tp_split_params(), ep and ep.params)
  memory.scope(function()
    local function squares(ts) -- f64 {1}: the sum of the squares of ts
      local nc = titan.zeros({ 2 }, { dtype = "float64", device = self.device })
      if #ts > 0 then ops.global_norm_dev_(ts, 0, nc) end
      local n = nc:narrow(1, 1, 1):contiguous()
      return n * n
    end
    local total = squares(split)
    if tpp then tpp.group:all_reduce(total, "sum") end
    total = total + squares(whole)
    if fsdp then fsdp.group:all_reduce(total, "sum") end
    if ep then -- (each rank of the ep group holds its own experts; FSDP's shards of them, their share)
      local own = squares(mine)
      ep.group:all_reduce(own, "sum")
      if ep.sharded then ep.replicas:all_reduce(own, "sum") end
      total = total + own
    end
    if ppg then ppg:all_reduce(total, "sum") end
    ops.global_norm_dev_({ total:sqrt() }, max_norm, out)
  end)
end

-- The same update on a GPU with no host wait: the norm and clip
-- coefficient stay on the device, and AdamW reads them and its step's
-- scalars there (as the update graph does; the same bits as the host
-- path where each rank holds whole gradients). sharded: ranks hold shares
-- of them (sharded_norm_dev). Returns a function that reads the norm back,
-- or nil (and the host path runs from then on) when the optimizer cannot.
function Trainer:update_on_device(params, sharded)
  local opt = self.optimizer
  local grads = {}
  for _, p in ipairs(params) do
    if p.grad then grads[#grads + 1] = p.grad end
  end
  if #grads == 0 or type(opt.step_on_device) ~= "function" then
    self.device_update = false
    return nil
  end
  local max_norm = self.cfg.training.max_norm
  local clip = max_norm and max_norm > 0
  if self.norm_clip then self.norm_clip:free() end -- the previous step's, read by now if it was logged
  local norm_clip = memory.keep(titan.zeros({ 2 }, { dtype = "float64", device = self.device }))
  self.norm_clip = norm_clip
  if sharded then self:sharded_norm_dev(params, clip and max_norm or 0, norm_clip)
  else ops.global_norm_dev_(grads, clip and max_norm or 0, norm_clip) end
  local ok, why = opt:step_on_device(clip and norm_clip or nil)
  if not ok then
    -- nothing was updated: the host path takes this step and the rest
    self.print("trainer: the optimizer step stays on the host: " .. why)
    self.device_update = false
    norm_clip:free()
    self.norm_clip = nil
    return nil
  end
  self.optimizer:zero_grad({ set_to_none = self.graph_state == nil })
  return function() return norm_clip:tolist_flat()[1] end
end

-- Run steps until training.steps (or `until_step`). Returns the list of losses.
function Trainer:train(until_step)
  local cfg, t = self.cfg, self.cfg.training
  local last = until_step or t.steps
  local losses = {}
  local params = self.fsdp and self.fsdp:parameters() or self.model:parameters()
  local t0, first = metrics.now(), self.step
  self.run_tokens = self.run_tokens or 0
  while self.step < last do
    local step = self.step + 1
    local factor = self.schedule.factor(step)
    self.optimizer:set_lr_factor(factor)
    local loss, ntok, grad_norm
    local prof = self.profiler and step % cfg.profiling.profile_freq == 0 and self.profiler or nil
    if prof then
      prof:start()
      local ok, a, b, c = pcall(prof.region, prof, "step " .. step, "step", self.step_once, self, step, params)
      prof:stop()
      if not ok then error(a, 0) end
      loss, ntok, grad_norm = a, b, c
      self:write_profile(step, prof)
    else
      loss, ntok, grad_norm = self:step_once(step, params)
    end
    self.step = step
    losses[#losses + 1] = loss
    self.last_loss = loss
    self.run_tokens = self.run_tokens + ntok
    self.logger:add_tokens(ntok / self.world)
    if step % cfg.metrics.log_freq == 0 or step == 1 or step == last then
      if type(grad_norm) == "function" then grad_norm = grad_norm() end -- read back only when logged
      self.logger:log_step({ step = step, loss = loss, grad_norm = grad_norm, lr = self.optimizer:lr(),
        moe_max_load = self.moe_load })
    end
    if cfg.validation.enable and step % cfg.validation.freq == 0 then self:validate() end
    self.checkpoint:maybe_save(step, self:ckpt_state(), { final = step == t.steps })
    local sig, signum = ckpt.signal_pending()
    if self.world_group then
      -- Every rank stops at the same step boundary (the saves are collective):
      -- a signal any rank has seen stops them all, named by the highest number.
      signum = self:agree_signal(signum)
      sig = signum and (sig or ({ [2] = "SIGINT", [15] = "SIGTERM" })[signum] or ("signal " .. signum))
    end
    if sig then
      -- Preemption: save at this step boundary, then stop cleanly.
      local dir = self.checkpoint:save(step, self:ckpt_state(), { force = true })
      self.checkpoint:wait()
      if dir then
        self.print(("trainer: %s: saved step %d, stopping"):format(sig, step))
      else -- (it said "saved" with checkpoints off, and nothing was)
        self.print(("trainer: %s: stopping at step %d; nothing saved (checkpoint.enable is false)"):format(sig, step))
      end
      self.stopped_by = sig
      break
    end
  end
  self.run_seconds = (self.run_seconds or 0) + (metrics.now() - t0)
  self.run_steps = (self.run_steps or 0) + (self.step - first)
  return losses
end

-- The closing line of a run: where it ended, the last losses, the average
-- rate over the steps this process trained, the last checkpoint.
function Trainer:summary()
  local parts = { ("trainer: done at step %d"):format(self.step) }
  if self.run_steps and self.run_steps > 0 then
    parts[#parts + 1] = ("%d steps in %s (%s tokens/s)"):format(self.run_steps, metrics.duration(self.run_seconds),
      metrics.commas(self.run_tokens / math.max(self.run_seconds, 1e-9)))
  elseif self.step >= self.cfg.training.steps then
    parts[#parts + 1] = ("nothing to train: training.steps = %d"):format(self.cfg.training.steps)
  end
  if self.last_loss then parts[#parts + 1] = ("loss %.4f"):format(self.last_loss) end
  if self.last_val_loss then parts[#parts + 1] = ("validation loss %.4f"):format(self.last_val_loss) end
  local saved = self.checkpoint.last_saved
  if saved then parts[#parts + 1] = ("checkpoint %s"):format(require("titan.checkpoint.format").step_dir(
    self.checkpoint.folder, saved)) end
  return table.concat(parts, " | ")
end

function Trainer:close()
  if self.graph_state then require("titan.graph_step").release(self) end
  if self.norm_clip then self.norm_clip:free(); self.norm_clip = nil end
  for _, c in ipairs(self.cp_ctxs or {}) do c:free() end
  if self.profiler and self.profiler.device_clock then self.profiler.device_clock:free() end
  self.checkpoint:close()
  self.logger:close()
end

-- Entry point: a recipe table and the command-line arguments.
function M.run(recipe, argv)
  local rest, help = {}, false
  for _, a in ipairs(argv or {}) do
    if a == "--help" or a == "-h" then help = true else rest[#rest + 1] = a end
  end
  if help then
    print(config.help(config.resolve(recipe, rest), arg and arg[0]))
    return {}
  end
  local cfg = config.resolve(recipe, argv)
  if cfg.job.print_config then
    print(config.dump(cfg))
    return cfg
  end
  local tr = M.new(cfg)
  if cfg.checkpoint.create_seed_checkpoint then
    tr.checkpoint:save(0, tr:ckpt_state(), { force = true })
    tr:close()
    tr.print("trainer: seed checkpoint saved (step 0)")
    return {}, tr
  end
  ckpt.install_signal_handlers()
  tr:banner()
  if tr.step > 0 then tr.print(("trainer: resumed from step %d"):format(tr.step)) end
  -- metrics.jsonl is appended to by every run in this dump folder (a resume
  -- continues it): a record marks where each run starts.
  tr.logger:write_jsonl({ event = "start", step = tr.step, time = os.time() })
  local losses = tr:train()
  tr:close()
  if not tr.stopped_by then tr.print(tr:summary()) end
  return losses, tr
end

return M
