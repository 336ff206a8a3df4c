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
-- batch is split). (Under loss parallelism the logits are this rank's
-- vocabulary slice, and the job's cross_entropy takes them so.)
function M.loss_fn(logits, targets, ctx)
  local V = logits:size(-1)
  local par = ctx.trainer and ctx.trainer.par
  local ce = par and function(...) return par:cross_entropy(...) end or F.cross_entropy
  return (ce(logits:reshape(-1, V), targets:reshape(-1), { num_tokens = ctx.num_tokens }))
end

-- The micro-batches of one optimizer step, and the real tokens in them
-- over every data-parallel rank (each rank's loss is its tokens' share of
-- the global mean, so the ranks' gradients add up to the global batch's).
-- Each batch is the part of it this rank holds (par:shard_batch).
function M.next_batches(tr)
  local batches, num_tokens = {}, 0
  for i = 1, tr.grad_accum do
    batches[i] = tr.par:shard_batch(tr.data.train:next())
    num_tokens = num_tokens + (batches[i].num_tokens or batches[i].targets:numel())
  end
  return batches, tr.par:sum_data({ num_tokens })[1]
end

-- Forward and backward of one micro-batch; returns its loss tensor. (The
-- regions only time a profiled step: profiler.region is fn(...) otherwise.)
local function backward(loss) loss:backward() end
-- A recipe hook's result that is not what it must be: one line naming the
-- hook, what it returned and what it must return (not a failure further in).
local function bad_hook(name, got, want)
  local what = type(got) == "table" and getmetatable(got) and got.shape and ("a tensor of shape [%s]"):format(
    table.concat(got:shape(), ", ")) or (type(got) == "table" and "a table" or tostring(got))
  error(("recipe: %s returned %s; expected %s"):format(name, what, want), 0)
end
M.bad_hook = bad_hook

function M.forward_backward(tr, b, ctx)
  local logits = profiler.region("forward", "step", tr.model, b.inputs)
  local loss = profiler.region("loss", "step", tr.loss_fn, logits, b.targets, ctx)
  if type(loss) ~= "table" or not loss.numel or loss:numel() ~= 1 then
    bad_hook("loss_fn", loss, "a scalar tensor (e.g. F.cross_entropy(logits:reshape(-1, V), targets:reshape(-1)))")
  end
  profiler.region("backward", "step", backward, loss)
  return loss
end

-- The micro-batches: the job runs them (a pipeline's schedule), or they
-- run eagerly here. Returns the summed loss.
function M.run_micro_batches(tr, batches, ctx)
  return tr.par:run_batches(tr, batches, ctx, M.run_micro_batches_eager)
end

-- The micro-batches, eagerly: every one runs inside its own scope, so
-- activations are released as soon as its backward is done; gradients
-- accumulate in the parameters' .grad. Returns the summed loss.
-- With several micro-batches the losses stay on the device until the last
-- one (on a GPU: one wait per step, not one per micro-batch); the sum is
-- the same either way.
function M.run_micro_batches_eager(tr, batches, ctx)
  local n = #batches
  local on_device = n > 1
  local losses
  local loss_sum = 0
  for i, b in ipairs(batches) do
    if i == n then tr.par:before_last_backward() end
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

-- opts.print: where log lines go (default stdout).
function M.new(cfg, opts)
  opts = opts or {}
  local self = setmetatable({ cfg = cfg }, Trainer)
  local t = cfg.training
  -- Ranks: from the launcher (titan --nproc N, mpirun, srun, --simulate N); one process otherwise.
  local env = dist.env()
  self.rank, self.world = env.rank, env.world
  -- Log lines come from rank 0 (every rank computes the same ones).
  self.print = opts.print or function(line)
    if self.rank == 0 then io.stdout:write(line, "\n"); io.stdout:flush() end
  end
  self:setup_runtime(env)
  -- The model on meta, the layout (degrees, mesh, groups), the family's or
  -- the recipe's parallelize function, then each rank's pieces materialized
  -- and initialized: all in the family's parallel layer (lua/parallel/).
  local family = require("models." .. cfg.model.name)
  self.family = family
  self.par = family.parallel().setup(cfg, family, env, { print = self.print, parallelize = cfg.parallelize })
  local par = self.par
  self.model, self.world_group, self.shard_of = par.model, par.world_group, par.shard_of
  self.dp_rank, self.dp_size = par.dp_rank, par.dims.dp_size
  self.flops_per_token, self.nparams = par.flops_per_token, par.nparams
  self:build_data()
  self:build_optimizer()
  self.loss_fn = cfg.loss_fn or M.loss_fn
  self.train_step = cfg.train_step or M.train_step
  if t.cuda_graphs then require("titan.graph_step").enable(self, cfg) end
  self:build_metrics()
  self:build_checkpoint()
  return self
end

-- Threads, determinism, TF32, seed, and the device against what the job asks.
function Trainer:setup_runtime(env)
  local cfg, t = self.cfg, self.cfg.training
  if t.threads > 0 then titan.set_num_threads(t.threads) end
  titan.set_deterministic(cfg.debug.deterministic)
  titan.set_allow_tf32(t.allow_tf32)
  titan.set_gemm_autotune(t.gemm_autotune)
  titan.manual_seed(t.seed)
  self.device = t.device
  -- Ranks as processes (not simulated: their own deadlock check): a rank
  -- that stops would leave the others waiting in a collective for ever.
  if env.world > 1 and env.launcher ~= "simulate" then
    local cm = cfg.comm
    local dir = cfg.job.dump_folder .. "/comm_traces"
    mkdir_p(dir)
    self.comm_trace = ("%s/rank%d.jsonl"):format(dir, env.rank)
    require("titan.ffi").check(titan.C.tt_watchdog_start(env.rank, env.world, cm.init_timeout_seconds,
      cm.train_timeout_seconds, cm.trace_buf_size, self.comm_trace))
  end
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
end

-- Tokenizer, data (this data-parallel rank's share) and the gradient
-- accumulation that makes the global batch in tokens.
function Trainer:build_data()
  local cfg, t = self.cfg, self.cfg.training
  local tok_path = config.resolve_file(cfg.model.tokenizer)
  self.tokenizer = require("titan.tokenizer").load(tok_path)
  if self.tokenizer.vocab_size > self.model.args.vocab_size then
    error(("trainer: the tokenizer %s has %d tokens but the model's vocab_size is %d"):format(cfg.model.tokenizer,
      self.tokenizer.vocab_size, self.model.args.vocab_size), 0)
  end
  if t.dataset == "bin" and not cfg.build_data then
    -- (a token above the model's vocabulary would fail hours in, inside the embedding)
    for p in t.dataset_path:gmatch("[^,]+") do
      local ok, f = pcall(require("titan.data.tokens").TokenFile.open, p)
      if ok and f.header.vocab_size > self.model.args.vocab_size then
        error(("trainer: the token file %s holds tokens of a %d-token vocabulary but the model's vocab_size is %d; "
          .. "expected a file prepared with this model's tokenizer (%s)"):format(p, f.header.vocab_size,
          self.model.args.vocab_size, cfg.model.tokenizer), 0)
      end
    end
  end
  local build_data = cfg.build_data or require("titan.data").build
  self.data = build_data(cfg, self.tokenizer, { rank = self.dp_rank, world = self.dp_size })
  if type(self.data) ~= "table" or type(self.data.train) ~= "table" then
    bad_hook("build_data", self.data, "{ train = loader, val = loader or nil } (e.g. titan.data.build(cfg, ...))")
  end
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
end

-- AdamW over the parameters this rank steps, and the schedule. Parameter
-- groups: a recipe's `optimizer_groups` list ({pattern =, lr =, betas =,
-- eps =, weight_decay =}, first match wins), then no_decay_pattern.
function Trainer:build_optimizer()
  local cfg, o = self.cfg, self.cfg.optimizer
  local groups = {}
  for _, g in ipairs(cfg.optimizer_groups or {}) do groups[#groups + 1] = g end
  if o.no_decay_pattern ~= "" then groups[#groups + 1] = { pattern = o.no_decay_pattern, weight_decay = 0 } end
  self.optimizer = optim.AdamW(self.par:named_parameters(), { lr = o.lr, betas = { o.beta1, o.beta2 }, eps = o.eps,
    weight_decay = o.weight_decay, groups = groups })
  self.schedule = lr_scheduler.new(cfg.lr_scheduler, cfg.training.steps)
end

-- This job's hold on its dump folder (rank 0): a second job writing there
-- would interleave its metrics and collide in its saves. An flock, so it
-- goes with the process however that ends; the next job finds it free.
function Trainer:lock_dump_folder()
  if self.rank ~= 0 then return end
  local fs = require("titan.checkpoint.fs")
  local dump = self.cfg.job.dump_folder
  local f = io.open("/proc/sys/kernel/hostname")
  local host = f and f:read("*l") or "this host"
  if f then f:close() end
  local h, who = fs.lock(fs.join(dump, ".titan.lock"), ("pid %d on %s, since %s UTC"):format(fs.pid(), host,
    os.date("!%Y-%m-%d %H:%M:%S")))
  if not h then
    error(("trainer: job.dump_folder %s is in use by another job (%s); expected a folder of its own "
      .. "(--job.dump_folder=...), or that job to end first"):format(dump, who), 0)
  end
  self.dump_lock = h
end

-- Profiler, dump folder, peak FLOP/s, TensorBoard, the metrics logger.
function Trainer:build_metrics()
  local cfg, t = self.cfg, self.cfg.training
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
  mkdir_p(cfg.job.dump_folder)
  self:lock_dump_folder()
  -- (made now: a folder that cannot be made stops the job before its first step)
  if self.profiler then mkdir_p(self:traces_folder(), "profiling.save_traces_folder") end
  local peak = cfg.metrics.peak_flops
  local measured = peak <= 0 and t.device == "cpu"
  -- (the measurement's matrices are not the job's: the memory peak the log reports starts after them)
  local function measure()
    local v = metrics.measure_cpu_peak_flops()
    titan.reset_peak_memory(t.device)
    return v
  end
  if peak <= 0 then peak = measured and measure() or 989e12 end
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
    tensorboard = tb, device = t.device, peak_flops = peak, flops_per_token = self.flops_per_token, rank = self.rank,
    print = self.print, remeasure_peak = measured and measure or nil,
  })
  self.step = 0
end

-- Checkpoints: resume from the latest complete one (or load_step), unless
-- this run only creates the seed checkpoint. Each rank's pieces lie where
-- the layout's placements put them (shard_of).
function Trainer:build_checkpoint()
  local cfg, wg = self.cfg, self.world_group
  self.checkpoint = ckpt.Manager(cfg.checkpoint, { dump_folder = cfg.job.dump_folder, rank = self.rank,
    world = self.world, log = function(line) self.print(line) end, shard_of = self.shard_of,
    data_rank = self.dp_rank, known_names = self.par.all_names, exclusive = self.dump_lock ~= nil,
    gather = wg and function(v) return wg:gather_object(v) end, barrier = wg and function() wg:barrier() end })
  self.checkpoint:prepare()
  if not cfg.checkpoint.create_seed_checkpoint then
    local state = self:ckpt_state()
    local s = self.checkpoint:load(state)
    if s then
      self.step = s
      if state.extra.rng then titan.set_rng_state(state.extra.rng) end
      self:note_changes(state.extra.run)
    end
  end
end

-- What a resumed run should keep, or say it changed: the step count (the
-- schedule's length), the tokenizer (its file and vocabulary) and the
-- corpus (its files and their sizes).
function Trainer:run_identity()
  if self.identity then return self.identity end
  local t, fs = self.cfg.training, require("titan.checkpoint.fs")
  local sizes = {}
  if t.dataset ~= "fortunes" then
    for p in t.dataset_path:gmatch("[^,]+") do sizes[#sizes + 1] = ("%s:%s"):format(p, tostring(fs.size(p))) end
  end
  self.identity = { steps = t.steps, tokenizer = self.cfg.model.tokenizer, vocab = self.tokenizer.vocab_size,
    corpus = t.dataset .. (#sizes > 0 and (" " .. table.concat(sizes, ",")) or "") }
  return self.identity
end

function Trainer:note_changes(saved)
  if type(saved) ~= "table" then return end
  local now = self:run_identity()
  local function note(what, old, new, consequence)
    self.print(("checkpoint: resuming with %s %s; the checkpoint's run had %s (%s)"):format(what, tostring(new),
      tostring(old), consequence))
  end
  if saved.steps ~= nil and saved.steps ~= now.steps then
    note("training.steps =", saved.steps, now.steps, "the learning-rate schedule now runs to the new last step")
  end
  if (saved.tokenizer ~= nil and saved.tokenizer ~= now.tokenizer) or (saved.vocab ~= nil and saved.vocab ~= now.vocab)
  then
    note("the tokenizer", ("%s (%s tokens)"):format(tostring(saved.tokenizer), tostring(saved.vocab)),
      ("%s (%d tokens)"):format(now.tokenizer, now.vocab), "the model's embeddings were trained on the old one's ids")
  end
  if saved.corpus ~= nil and saved.corpus ~= now.corpus then
    note("the corpus", saved.corpus, now.corpus, "the data position may point elsewhere in it")
  end
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

-- What a checkpoint holds: model, optimizer, data position, step, RNG.
function Trainer:ckpt_state()
  return {
    model = self.par:state_model(), optimizer = self.optimizer,
    dataloader = self.data.train,
    extra = { step = self.step, lr_step = self.step, rng = titan.rng_state(), run = self:run_identity() },
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
      self.peak_source or (self.cfg.metrics.peak_flops > 0 and "configured" or "measured"),
      metrics.commas(self.flops_per_token)))
  -- (the layout's lines: each parallelism's own, lua/parallel/describe.lua)
  for _, line in ipairs(self.par:describe()) do self.print(line) end
  if t.gemm_autotune then
    self.print("gemm autotune: " .. (t.device == "cpu" and "ignored on the CPU (one algorithm per GEMM)"
      or self.cfg.debug.deterministic and "off under debug.deterministic (the timing could change the bits)"
      or "the first overwriting GEMM of each shape times cuBLASLt's best candidates and keeps the fastest "
      .. "(a wait per new shape, in the first steps)"))
  end
  io.stdout:flush()
end

function Trainer:validate()
  local v = self.data.val
  if not v then return end
  local total, ntok = 0, 0
  local par = self.par
  local function add(logits, targets)
    local V = logits:size(-1)
    local loss, n = par:cross_entropy(logits:reshape(-1, V), targets:reshape(-1), { reduction = "sum" })
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
      if par:sum_data({ b and 0 or 1 })[1] > 0 then
        if b then b.inputs:free(); b.targets:free() end
        break
      end
      if not b then break end
      par:forward_eval(b, add)
      b.inputs:free()
      b.targets:free()
    end
  end)
  self.model:train()
  if v.reset then v:reset() end
  -- (each data-parallel rank validated its own share: the loss is over all of them)
  total, ntok = par:sum_eval(total, ntok)
  if ntok > 0 then
    self.logger:log_validation(self.step, total / ntok, ntok)
    self.last_val_loss = total / ntok
  end
  return ntok > 0 and total / ntok or nil
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

-- Forward/backward, the gradients summed where the layout left partial
-- sums (par:sync, lua/parallel/grads.lua), and the update of one step: the
-- loss, the step's tokens and the gradient norm (or a function reading it).
local function sync(self, params, loss) return self.par:sync(params, loss) end
function Trainer:step_once(step, params)
  local loss, ntok = self:train_step(step)
  if self.cfg.train_step then
    if type(loss) ~= "number" then bad_hook("train_step", loss, "the step's loss as a number, then its tokens") end
    if type(ntok) ~= "number" or ntok < 0 then
      bad_hook("train_step", ntok, "the step's loss, then its number of tokens (a second value)")
    end
  end
  loss = profiler.region("gradient reduction", "step", sync, self, params, loss)
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
  local summary = ("%s/rank%d_summary.txt"):format(dir, self.rank)
  local f, err = io.open(summary, "w")
  local ok = f and f:write(("step %d, rank %d, %.3f ms timed region by region%s\n"):format(step, self.rank,
    prof:elapsed() * 1e3, self:profile_how(prof)), text, "\n")
  if f then ok = f:close() and ok end
  if not ok then error(("profiler: cannot write %s: %s"):format(summary, tostring(err or "write failed")), 0) end
  self.print(("profiler: step %d took %.1f ms timed region by region%s; trace %s; the heaviest regions by their "
    .. "own time:"):format(step, prof:elapsed() * 1e3, self:profile_how(prof), trace))
  self.print(prof:summary_text(12))
end

-- After the gradients of a step: the family's hook (its figures go on the
-- log line), clip them, step the optimizer, zero them. Returns the gradient
-- norm before clipping. (titan.graph_step replaces it with a replay of the
-- same three, which returns a function reading the norm back.)
function Trainer:update(params)
  self.step_extra = self.par:pre_optimizer_step()
  -- device_update: nil = on for GPU devices; true forces it (specs run it
  -- on the CPU, whose backend has the same ops); false = the host path.
  -- Where ranks hold pieces of the gradients the squares are summed over
  -- them, on the device as on the host (lua/parallel/grads.lua).
  if self.device_update or (self.device_update == nil and self.device ~= "cpu") then
    local norm = self:update_on_device(params)
    if norm then return norm end
  end
  local grad_norm = self.par:clip_grad_norm(params, self.cfg.training.max_norm)
  if grad_norm ~= grad_norm or grad_norm == math.huge or grad_norm == -math.huge then
    self.optimizer:skip_step() -- (nothing updated: the train loop stops or goes on, training.on_nonfinite_grad)
  else
    self.optimizer:step()
  end
  -- A captured graph accumulates into these very buffers: zero, keep them.
  self.optimizer:zero_grad({ set_to_none = self.graph_state == nil })
  return grad_norm
end

-- The same update on a GPU with no host wait: the norm and clip
-- coefficient stay on the device, and AdamW reads them and its step's
-- scalars there (as the update graph does; the same bits as the host
-- path). Returns a function that reads the norm back, or nil (and the
-- host path runs from then on) when the optimizer cannot.
function Trainer:update_on_device(params)
  local opt = self.optimizer
  local any = false
  for _, p in ipairs(params) do
    if p.grad then any = true; break end
  end
  if not any or type(opt.step_on_device) ~= "function" then
    self.device_update = false
    return nil
  end
  local max_norm = self.cfg.training.max_norm
  local clip = max_norm and max_norm > 0
  -- {norm, clip coefficient, NaN/inf norms so far}: the job's one buffer (the count runs over its steps)
  self.norm_clip = self.norm_clip or memory.keep(titan.zeros({ 3 }, { dtype = "float64", device = self.device }))
  local norm_clip = self.norm_clip
  self.par:norm_on_device(params, clip and max_norm or 0, norm_clip)
  -- (given even without clipping, coefficient 1: a NaN/inf norm skips the step in the kernels)
  local ok, why = opt:step_on_device(norm_clip)
  if not ok then
    -- nothing was updated: the host path takes this step and the rest
    self.print("trainer: the optimizer step stays on the host: " .. why)
    self.device_update = false
    norm_clip:free()
    self.norm_clip = nil
    return nil
  end
  self.optimizer:zero_grad({ set_to_none = self.graph_state == nil })
  return function()
    local v = norm_clip:tolist_flat()
    return v[1], v[3]
  end
end

-- The device path's norm of this step, read back, and its running count of
-- NaN/inf norms (steps whose update the kernels skipped) since the last read.
function Trainer:device_norm(step, read, loss)
  local norm, count = read()
  local new = (count or 0) - (self.device_skips or 0)
  if new > 0 then
    local from = (self.norm_read_step or 0) + 1
    self.device_skips = count
    -- (one new skip and this step's norm bad: it is this step)
    self:nonfinite_grad(new == 1 and (norm ~= norm or math.abs(norm) == math.huge) and step or from, step, new, norm,
      loss)
  end
  self.norm_read_step = step
  return norm
end

-- `n` steps between first and last whose gradient norm was NaN or inf:
-- their updates were skipped (on the host, or by the device's kernels); stop,
-- or count them and go on (training.on_nonfinite_grad). Megatron stops by
-- default; llm.c skips.
function Trainer:nonfinite_grad(first, last, n, norm, loss)
  local what = first == last and (norm ~= norm and "the gradient norm is NaN" or "the gradient norm is infinite")
    or ("the gradient norm was NaN or inf at %d of steps %d-%d (a device's norm is read back at logged steps)")
    :format(n, first, last)
  if self.cfg.training.on_nonfinite_grad == "skip" then
    self.skipped_steps = (self.skipped_steps or 0) + n
    self.print(("trainer: step %d: %s (loss %.4f): %s skipped, %d so far (training.on_nonfinite_grad = skip)")
      :format(last, what, loss, n == 1 and "its update was" or "their updates were", self.skipped_steps))
    return
  end
  local saved = self.checkpoint.last_saved
  error(("trainer: %s at step %d (loss %.4f); %s skipped and nothing from this step was saved (%s); lower "
    .. "optimizer.lr, check the data, or set training.on_nonfinite_grad=skip to skip such steps"):format(what, last, loss,
    n == 1 and "its update was" or "their updates were", saved and ("the last checkpoint is step " .. saved)
    or "no checkpoint was saved"), 0)
end

-- Run steps until training.steps (or `until_step`). Returns the list of losses.
function Trainer:train(until_step)
  local cfg, t = self.cfg, self.cfg.training
  local last = until_step or t.steps
  local losses = {}
  local params = self.par:parameters()
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
    -- A NaN/inf gradient norm: the host path knows it now; on a device the
    -- update kernels skipped the step themselves, and the host learns it
    -- when it reads the norm back (logged steps, saves: no extra wait a step).
    local read_norm
    if type(grad_norm) == "function" then
      read_norm, grad_norm = grad_norm, nil
    elseif grad_norm ~= grad_norm or grad_norm == math.huge or grad_norm == -math.huge then
      self:nonfinite_grad(step, step, 1, grad_norm, loss)
    end
    self.step = step
    -- (start-up and the first step done: from now on the train timeout)
    if self.comm_trace and not self.comm_trained then
      self.comm_trained = true
      titan.C.tt_watchdog_training()
    end
    losses[#losses + 1] = loss
    self.last_loss = loss
    self.run_tokens = self.run_tokens + ntok
    self.logger:add_tokens(ntok / self.world)
    if read_norm and (step % cfg.metrics.log_freq == 0 or step == 1 or step == last
      or self.checkpoint:should_save(step, step == t.steps)) then
      grad_norm = self:device_norm(step, read_norm, loss)
    end
    if step % cfg.metrics.log_freq == 0 or step == 1 or step == last then
      local rec = { step = step, loss = loss, grad_norm = grad_norm, lr = self.optimizer:lr() }
      for k, v in pairs(self.step_extra or {}) do rec[k] = v end -- (the family hook's figures)
      self.logger:log_step(rec)
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
  if self.skipped_steps then
    parts[#parts + 1] = ("%d step%s skipped (NaN/inf gradients)"):format(self.skipped_steps,
      self.skipped_steps == 1 and "" or "s")
  end
  local saved = self.checkpoint.last_saved
  if saved then parts[#parts + 1] = ("checkpoint %s"):format(require("titan.checkpoint.format").step_dir(
    self.checkpoint.folder, saved)) end
  return table.concat(parts, " | ")
end

function Trainer:close()
  if self.dump_lock then self.dump_lock.release(); self.dump_lock = nil end
  if self.graph_state then require("titan.graph_step").release(self) end
  if self.norm_clip then self.norm_clip:free(); self.norm_clip = nil end
  self.par:close()
  if self.profiler and self.profiler.device_clock then self.profiler.device_clock:free() end
  self.checkpoint:close()
  self.logger:close()
end

-- --dry-run: the job's whole start-up on the meta device (config, mesh,
-- parallelize, data, checkpoint plan) and two steps without the math, for
-- every pipeline stage's ranks; rank 0 prints the banner and the estimate
-- (lua/titan/estimate.lua) for the job's world (titan --nproc N or
-- --simulate N: the same). Nothing is written.
function M.dry_run(cfg)
  local env = dist.env()
  if env.rank ~= 0 then return {} end
  local est = require("titan.estimate")
  local rep = est.run(cfg, env.world, { startup = true })
  for _, line in ipairs(rep.roles[1].banner) do print(line) end
  print(est.format(rep))
  io.stdout:flush()
  return rep
end

-- Entry point: a recipe table and the command-line arguments.
function M.run(recipe, argv)
  local rest, help, dry = {}, false, false
  for _, a in ipairs(argv or {}) do
    if a == "--help" or a == "-h" then help = true
    elseif a == "--dry-run" then dry = true
    else rest[#rest + 1] = a end
  end
  argv = rest
  if help then
    print(config.help(config.resolve(recipe, rest), arg and arg[0]))
    return {}
  end
  local cfg = config.resolve(recipe, argv)
  if dry then return M.dry_run(cfg) end
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
