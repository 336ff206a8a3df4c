-- config.lua — the job configuration: every known key with its default and
-- type, recipe merging, `--section.key=value` overrides with type checks,
-- and one-line errors that list the nearest valid keys.
--
-- A recipe is a table of sections (job, model, optimizer, lr_scheduler,
-- training, validation, metrics, checkpoint, activation_checkpoint,
-- parallelism, debug) plus optional Lua functions (loss_fn, train_step,
-- build_data, ...). A recipe derives from another by
-- `base = "llama3_debugmodel"` (a file in lua/recipes/) or by requiring it
-- and changing the table.
local M = {}

-- The schema: defaults define the type of each key. `false`/`nil`-able keys
-- use a sentinel in `nullable` so their type is still known.
M.defaults = {
  job = {
    description = "",
    dump_folder = "./outputs",
    print_config = false,
  },
  model = {
    name = "llama3",
    flavor = "debugmodel",
    tokenizer = "assets/tokenizers/fortunes_2048.json",
    converters = "",        -- comma-separated model transforms: float8 (lua/parallel/float8.lua)
  },
  optimizer = {
    name = "AdamW",
    lr = 8e-4,
    beta1 = 0.9,
    beta2 = 0.95,
    eps = 1e-8,
    weight_decay = 0.1,
    no_decay_pattern = "", -- Lua pattern of parameter names without weight decay ("" = none)
  },
  lr_scheduler = {
    warmup_steps = 200,
    decay_ratio = -1,       -- fraction of steps spent decaying (WSD); -1: decay over all steps after warmup
    decay_type = "linear",  -- linear | sqrt | cosine
    min_lr_factor = 0.0,    -- the lr decays to min_lr_factor * lr
  },
  training = {
    dataset = "fortunes",   -- fortunes | text | jsonl | bin
    dataset_path = "",      -- files (comma-separated) for text/jsonl/bin; fortunes: the Debian corpus
    local_batch_size = 8,
    global_batch_tokens = -1, -- tokens per optimizer step; -1: local_batch_size * seq_len * dp (no accumulation)
    seq_len = 2048,
    steps = 10000,
    max_norm = 1.0,
    on_nonfinite_grad = "stop", -- a NaN/inf gradient norm: stop (the update skipped, nothing saved) | skip the update
    seed = 0,
    device = "cpu",
    mixed_precision_param = "float32",  -- dtype parameters compute in: float32 | bfloat16 (f32 master weights in AdamW) | float64
    mixed_precision_reduce = "float32", -- dtype gradients are reduced in across ranks (float32)
    threads = -1,           -- -1: OMP_NUM_THREADS or all cores
    shuffle = true,
    cuda_graphs = false,    -- replay each micro-batch's forward + backward from a captured CUDA graph (cuda only)
    allow_tf32 = false,     -- f32 matmuls on CUDA round their inputs to TF32 (as torch's allow_tf32); the CPU ignores it
    gemm_autotune = false,  -- time cuBLASLt's best candidates for each new GEMM shape (as torch's TunableOp; cuda only)
  },
  validation = {
    enable = false,
    freq = 100,
    steps = 5,
    split = 0.02,           -- fraction of documents held out
  },
  comm = {
    init_timeout_seconds = 300,  -- a collective waiting longer, before the first step is done: the job stops (0: never)
    train_timeout_seconds = 100, -- the same after the first step (TorchTitan's defaults)
    trace_buf_size = 2000,       -- collectives kept in each rank's flight recorder, written on a timeout
  },
  metrics = {
    log_freq = 1,
    enable_jsonl = true,
    enable_tensorboard = false,           -- TensorBoard event files (rank 0) under job.dump_folder/save_tb_folder
    save_tb_folder = "tb",                -- one subfolder a run: <YYYYmmdd-HHMM>
    peak_flops = -1,        -- FLOP/s of one device for MFU; -1: measured (CPU) or the GPU's table value
  },
  checkpoint = {
    enable = false,
    folder = "checkpoint",          -- under job.dump_folder
    interval = 500,
    load_step = -1,                 -- -1: the latest complete checkpoint
    keep_latest_k = 10,             -- 0 keeps all; the newest complete one is never purged
    async_mode = "disabled",        -- disabled | async (host snapshot written by a background thread)
    last_save_model_only = false,
    export_dtype = "float32",       -- dtype of a model-only final save: float32 | bfloat16
    exclude_from_loading = "",      -- comma-separated: dataloader, optimizer, lr_scheduler
    initial_load_path = "",         -- start from this checkpoint step directory
    initial_load_model_only = true,
    create_seed_checkpoint = false, -- initialize, save step 0, exit
  },
  activation_checkpoint = {
    mode = "none",                  -- none | full | selective (lua/parallel/ac.lua)
    selective_ac_option = "2",      -- selective: "N" (every Nth block) or "op" (per-op policy)
  },
  parallelism = {
    dp_replicate = 1,
    dp_shard = -1,
    fsdp_reshard_after_forward = "default", -- default | always | never (lua/parallel/fsdp.lua)
    ddp_overlap = true,                         -- DDP on GPUs: sum each block's gradients during the backward
    fsdp_overlap = true,                        -- FSDP on GPUs: prefetch the gathers, reduce during the backward
    tp = 1,
    sequence_parallel = true,                   -- with tp > 1: norms and residual stream split along the sequence
    loss_parallel = true,                       -- with tp > 1: output layer split by vocabulary, loss from the slices
    pp = 1,
    pipeline_parallel_schedule = "1F1B",        -- GPipe | 1F1B | Interleaved1F1B (lua/parallel/pp.lua)
    pipeline_parallel_microbatch_size = 1,      -- rows of local_batch_size per pipeline micro-batch
    pipeline_parallel_layers_per_stage = -1,    -- -1: the schedule's stages per rank (1; Interleaved1F1B: 2)
    cp = 1,                                     -- context-parallel degree: each sequence split over cp ranks
    context_parallel_rotate_method = "allgather", -- how keys and values reach every cp rank (lua/parallel/cp.lua)
    expert_parallel_degree = 1,                 -- MoE: the experts spread over this many data-parallel ranks
  },
  float8 = {
    recipe_name = "tensorwise",           -- dynamic scaling, one scale per tensor (the one recipe built)
    filter_fqns = "output",               -- comma-separated: Linear layers whose names contain one stay in bf16
    enable_fsdp_float8_all_gather = false, -- FSDP gathers the converted weights in fp8
  },
  debug = {
    deterministic = false,  -- same seed, same bits on a GPU (cuDNN attention: deterministic engines only)
  },
  profiling = {
    enable_profiling = false,             -- time every module, backward node and phase of some steps
    save_traces_folder = "profile_traces", -- under job.dump_folder: iteration_N/rank<r>_trace.json
    profile_freq = 10,                    -- the steps profiled: every Nth
    region_timing = "device",             -- on a GPU: "device" (marks on its stream) or "sync" (a sync per edge)
  },
}

-- The sections in the order a recipe reads (help and docs use it).
M.sections = { "job", "model", "optimizer", "lr_scheduler", "training", "validation", "metrics", "checkpoint",
  "activation_checkpoint", "parallelism", "float8", "comm", "debug", "profiling" }

-- One line per key for `titan RECIPE.lua --help` (docs/recipes.md has the
-- long form). training_spec checks that every key has one, and a row there.
M.descriptions = {
  ["job.description"] = "free text, printed in the banner",
  ["job.dump_folder"] = "where metrics.jsonl and checkpoints go",
  ["job.print_config"] = "print the resolved config and exit (also --print-config)",
  ["model.name"] = "a model family: a file in lua/models/",
  ["model.flavor"] = "debugmodel, 1B, 3B, 8B, 70B, 405B; debugmodel_moe (8 experts in every block)",
  ["model.converters"] = "comma-separated transforms of the built model: float8 (its Linear layers multiply in fp8)",
  ["float8.recipe_name"] = "tensorwise: each GEMM operand scaled by one factor from its largest magnitude (dynamic)",
  ["float8.filter_fqns"] = "comma-separated: Linear layers whose names contain one of these stay unconverted",
  ["float8.enable_fsdp_float8_all_gather"] =
    "FSDP all-gathers the converted weights in fp8, cast per shard with the whole weight's scale (same bits)",
  ["model.tokenizer"] = "tokenizer.json or tiktoken ranks file (relative: working dir, else source tree)",
  ["optimizer.name"] = "AdamW (the only one)",
  ["optimizer.lr"] = "peak learning rate",
  ["optimizer.beta1"] = "AdamW first-moment decay",
  ["optimizer.beta2"] = "AdamW second-moment decay",
  ["optimizer.eps"] = "AdamW epsilon",
  ["optimizer.weight_decay"] = "decoupled weight decay",
  ["optimizer.no_decay_pattern"] = "Lua pattern of parameter names without weight decay (\"\" = none)",
  ["lr_scheduler.warmup_steps"] = "linear warmup to the full lr",
  ["lr_scheduler.decay_ratio"] = "fraction of steps spent decaying (WSD); -1: all steps after warmup",
  ["lr_scheduler.decay_type"] = "linear, sqrt or cosine",
  ["lr_scheduler.min_lr_factor"] = "the lr decays to min_lr_factor * lr",
  ["training.dataset"] = "fortunes, text, jsonl or bin",
  ["training.dataset_path"] = "comma-separated files (text/jsonl/bin); fortunes: another corpus folder",
  ["training.local_batch_size"] = "sequences per micro-batch",
  ["training.global_batch_tokens"] = "tokens per optimizer step (gradient accumulation); -1: one micro-batch",
  ["training.seq_len"] = "tokens per sequence",
  ["training.steps"] = "optimizer steps to train",
  ["training.max_norm"] = "clip gradients to this global norm (0 = off)",
  ["comm.init_timeout_seconds"] = "a collective waiting longer than this before the first step ends stops the job "
    .. "(0: never)",
  ["comm.train_timeout_seconds"] = "the same after the first step (a stopped or stuck rank)",
  ["comm.trace_buf_size"] = "the last collectives each rank records, written to comm_traces/ on a timeout",
  ["training.on_nonfinite_grad"] = "a NaN/inf gradient norm: stop (its update skipped, nothing of it saved) or skip "
    .. "(the update skipped, training goes on)",
  ["training.seed"] = "seeds weights, data order and sampling",
  ["training.device"] = "cpu, cuda or cuda:N",
  ["training.mixed_precision_param"] = "float32, bfloat16 (f32 master weights in AdamW) or float64",
  ["training.mixed_precision_reduce"] = "dtype of cross-rank gradient reduction (float32)",
  ["training.threads"] = "CPU threads; -1: OMP_NUM_THREADS or all cores",
  ["training.shuffle"] = "seeded shuffle of the training windows",
  ["training.cuda_graphs"] = "replay forward+backward and the update from CUDA graphs (cuda only)",
  ["training.allow_tf32"] = "f32 matmuls on CUDA use TF32 tensor cores",
  ["training.gemm_autotune"] = "time cuBLASLt's candidate algorithms per GEMM shape, keep the fastest (cuda only)",
  ["validation.enable"] = "held-out loss during training",
  ["validation.freq"] = "every this many steps",
  ["validation.steps"] = "batches per validation",
  ["validation.split"] = "fraction of documents held out",
  ["metrics.log_freq"] = "a log line every N steps (and at the first and last)",
  ["metrics.enable_jsonl"] = "write <dump_folder>/metrics.jsonl",
  ["metrics.enable_tensorboard"] =
    "write TensorBoard event files (rank 0): tensorboard --logdir <dump_folder>/<save_tb_folder>",
  ["metrics.save_tb_folder"] = "under job.dump_folder; each run writes into a <YYYYmmdd-HHMM> subfolder of it",
  ["metrics.peak_flops"] = "FLOP/s of one device for MFU; -1: measured (CPU) or the GPU's table value",
  ["checkpoint.enable"] = "save checkpoints",
  ["checkpoint.folder"] = "under job.dump_folder (or absolute)",
  ["checkpoint.interval"] = "save every N steps (and at the last)",
  ["checkpoint.load_step"] = "resume from this step; -1: the latest complete one",
  ["checkpoint.keep_latest_k"] = "keep the newest k checkpoints (0 = all)",
  ["checkpoint.async_mode"] = "disabled or async (written by a background thread)",
  ["checkpoint.last_save_model_only"] = "the final save holds the model only",
  ["checkpoint.export_dtype"] = "float32 or bfloat16: dtype of a model-only final save",
  ["checkpoint.exclude_from_loading"] = "comma-separated: dataloader, optimizer, lr_scheduler",
  ["checkpoint.initial_load_path"] = "start from this checkpoint when the folder has none",
  ["checkpoint.initial_load_model_only"] = "from initial_load_path load the model only",
  ["checkpoint.create_seed_checkpoint"] = "initialize, save step 0, exit",
  ["activation_checkpoint.mode"] = "none, full or selective: blocks recompute their activations in the backward",
  ["activation_checkpoint.selective_ac_option"] = "selective: N (every Nth block) or op (per-op policy)",
  ["parallelism.dp_replicate"] =
    "data-parallel replicas (DDP: each rank holds the model; gradients reduced every step); -1: all ranks",
  ["parallelism.dp_shard"] =
    "FSDP shards (each rank holds 1/N of parameters, gradients, optimizer state); -1: the ranks dp_replicate leaves",
  ["parallelism.fsdp_reshard_after_forward"] =
    "default (every block but the last frees its gathered parameters after its forward), always or never",
  ["parallelism.ddp_overlap"] =
    "DDP on GPUs: sum each block's gradients as soon as its backward is done, overlapping the rest (false: after it)",
  ["parallelism.fsdp_overlap"] =
    "FSDP on GPUs: gather the next block's parameters and reduce each block's gradients while the GPU computes",
  ["parallelism.tp"] = "tensor-parallel degree: each block's heads and feed-forward split over tp ranks",
  ["parallelism.sequence_parallel"] =
    "with tp > 1, split the norms and the residual stream along the sequence (Megatron's SP; seq_len % tp == 0)",
  ["parallelism.loss_parallel"] =
    "with tp > 1, split the output layer by vocabulary and compute the loss from the slices (the default loss only)",
  ["parallelism.pp"] = "pipeline-parallel degree: the blocks split into stages held by pp ranks in turn",
  ["parallelism.pipeline_parallel_schedule"] = "GPipe, 1F1B or Interleaved1F1B (several stages per rank)",
  ["parallelism.pipeline_parallel_microbatch_size"] =
    "rows of training.local_batch_size per pipeline micro-batch (it must divide local_batch_size)",
  ["parallelism.pipeline_parallel_layers_per_stage"] =
    "blocks per stage (stages = n_layers / this, a multiple of pp); -1: one stage per rank (Interleaved1F1B: 2)",
  ["parallelism.cp"] =
    "context-parallel degree: each sequence split over cp ranks (head-tail chunks; seq_len % (2 cp) == 0)",
  ["parallelism.context_parallel_rotate_method"] =
    "allgather: every cp rank gathers the keys and values of the whole sequence (grouped-query heads keep them small); "
    .. "alltoall: ring attention, keys and values passed around the cp ranks a share at a time (longest contexts)",
  ["parallelism.expert_parallel_degree"] =
    "mixture of experts: each MoE layer's experts spread over this many data-parallel ranks, the tokens sent to "
    .. "their experts' ranks and back (lua/parallel/ep.lua)",
  ["debug.deterministic"] = "same seed, same bits on a GPU (deterministic cuDNN engines only)",
  ["profiling.enable_profiling"] = "time every module, backward node and phase of every profile_freq-th step",
  ["profiling.save_traces_folder"] = "under job.dump_folder: iteration_N/rank<r>_trace.json (Chrome trace) + summary",
  ["profiling.profile_freq"] = "profile every Nth step",
  ["profiling.region_timing"] = "on a GPU: device (events on its stream, the step runs as unprofiled) or sync",
}

local function sorted_keys(t)
  local k = {}
  for name in pairs(t) do k[#k + 1] = name end
  table.sort(k)
  return k
end

local function copy(v)
  if type(v) ~= "table" then return v end
  local out = {}
  for k, x in pairs(v) do out[k] = copy(x) end
  return out
end

-- Levenshtein distance, for "did you mean".
local function distance(a, b)
  local prev = {}
  for j = 0, #b do prev[j] = j end
  for i = 1, #a do
    local cur = { [0] = i }
    for j = 1, #b do
      local cost = a:sub(i, i) == b:sub(j, j) and 0 or 1
      cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
    end
    prev = cur
  end
  return prev[#b]
end

local function all_keys()
  local out = {}
  for _, sec in ipairs(sorted_keys(M.defaults)) do
    for _, key in ipairs(sorted_keys(M.defaults[sec])) do out[#out + 1] = sec .. "." .. key end
  end
  return out
end

function M.nearest_keys(name, n)
  local keys = all_keys()
  table.sort(keys, function(a, b)
    local da, db = distance(name, a), distance(name, b)
    if da ~= db then return da < db end
    return a < b
  end)
  local out = {}
  for i = 1, math.min(n or 3, #keys) do out[i] = keys[i] end
  return out
end

local function unknown_key(full, where)
  error(("config: unknown key '%s'%s; nearest valid keys: %s"):format(full, where or "",
    table.concat(M.nearest_keys(full), ", ")), 0)
end

-- Parse a command-line value into the type of the default.
local function coerce(full, default, raw)
  local t = type(default)
  if t == "number" then
    local v = tonumber(raw)
    if not v then error(("config: %s expects a number, got '%s'"):format(full, raw), 0) end
    return v
  elseif t == "boolean" then
    if raw == "true" or raw == "1" or raw == "" then return true end
    if raw == "false" or raw == "0" then return false end
    error(("config: %s expects true or false, got '%s'"):format(full, raw), 0)
  elseif t == "string" then
    return raw
  end
  error(("config: %s cannot be set from the command line"):format(full), 0)
end

local function check_type(full, default, v)
  if type(v) ~= type(default) then
    error(("config: %s expects a %s, got %s (%s)"):format(full, type(default), type(v), tostring(v)), 0)
  end
end

-- A file a config names (model.tokenizer): absolute as given; relative, from
-- the working directory when it is there (a user's own file), else from the
-- source tree (the shipped assets the recipes name, wherever titan runs).
function M.resolve_file(path)
  if path == "" or path:match("^/") then return path end
  local f = io.open(path, "rb")
  if f then
    f:close()
    return path
  end
  return require("titan.env").root .. "/" .. path
end

-- Load a recipe by name or path ("llama3_debugmodel" or "lua/recipes/x.lua").
function M.load_recipe(ref)
  local path = ref
  if not ref:find("/") and not ref:match("%.lua$") then
    local env = require("titan.env")
    path = env.root .. "/lua/recipes/" .. ref .. ".lua"
  end
  local chunk, err = loadfile(path)
  if not chunk then error("config: cannot load recipe " .. path .. ": " .. tostring(err), 0) end
  local r = chunk()
  if type(r) ~= "table" then error("config: recipe " .. path .. " must return a table, got " .. type(r), 0) end
  return r
end

-- A script run as `titan FILE.lua [ARGS]` that returned nothing: fine for a
-- script (its arguments are its own), but a recipe that forgot its `return`
-- would exit 0 having trained nothing. It is one when its text builds a
-- table with a model and a training section, or names a base recipe.
function M.check_script_result(path)
  local f = io.open(path, "rb")
  local text = f and f:read("*a") or ""
  if f then f:close() end
  local looks = (text:match("[%s{,]model%s*=%s*{") and text:match("[%s{,]training%s*=%s*{"))
    or text:match("[%s{,]base%s*=%s*[\"']")
  if looks then
    error(("%s returned nothing, so nothing was trained; expected a recipe to end with `return { ... }`"):format(path),
      0)
  end
end

-- Merge b over a (tables merged per section; functions and other fields replaced).
local function merge(a, b)
  local out = copy(a)
  for k, v in pairs(b) do
    if type(v) == "table" and type(out[k]) == "table" and M.defaults[k] then
      for kk, vv in pairs(v) do out[k][kk] = copy(vv) end
    else
      out[k] = v
    end
  end
  return out
end

-- Follow `base` chains: a recipe's own values win over its base's.
function M.flatten(recipe, seen)
  seen = seen or {}
  if recipe.base then
    local ref = recipe.base
    if seen[ref] then error("config: recipe base cycle through " .. ref, 0) end
    seen[ref] = true
    local base = M.flatten(type(ref) == "table" and ref or M.load_recipe(ref), seen)
    local own = copy(recipe)
    own.base = nil
    return merge(base, own)
  end
  return recipe
end

-- recipe table + argv list -> resolved config (sections filled from the
-- defaults, recipe values and overrides checked), plus the recipe's hooks.
function M.resolve(recipe, argv)
  recipe = M.flatten(recipe)
  local cfg = copy(M.defaults)
  for sec, vals in pairs(recipe) do
    if M.defaults[sec] then
      if type(vals) ~= "table" then error(("config: section %s must be a table"):format(sec), 0) end
      for k, v in pairs(vals) do
        local full = sec .. "." .. tostring(k)
        if M.defaults[sec][k] == nil then unknown_key(full, " in the recipe") end
        if type(v) == "table" then error(("config: %s must be a %s"):format(full, type(M.defaults[sec][k])), 0) end
        check_type(full, M.defaults[sec][k], v)
        cfg[sec][k] = v
      end
    elseif type(vals) == "function" then
      cfg[sec] = vals -- hooks: loss_fn, train_step, build_data, ...
    elseif sec ~= "base" then
      cfg[sec] = vals -- extra recipe data (e.g. datasets for a mixture)
    end
  end
  for _, a in ipairs(argv or {}) do
    if a == "--print-config" then
      cfg.job.print_config = true
    else
      local key, val = a:match("^%-%-([%w_]+%.[%w_]+)=(.*)$")
      if not key then
        key = a:match("^%-%-([%w_]+%.[%w_]+)$")
        val = key and "true"
      end
      if not key then
        error(("config: cannot parse argument '%s'; expected --section.key=value (or --print-config)"):format(a), 0)
      end
      local sec, k = key:match("^([%w_]+)%.([%w_]+)$")
      if not M.defaults[sec] or M.defaults[sec][k] == nil then unknown_key(key) end
      if not a:find("=", 1, true) and type(M.defaults[sec][k]) ~= "boolean" then
        -- (`--training.steps 30`: the 30 would be read as a recipe path or dropped)
        error(("config: --%s has no value; expected --%s=VALUE (with '=', not a space)"):format(key, key), 0)
      end
      cfg[sec][k] = coerce(key, M.defaults[sec][k], val)
    end
  end
  M.validate(cfg)
  return cfg
end

function M.validate(cfg)
  local function need(cond, msg) if not cond then error("config: " .. msg, 0) end end
  -- No key takes an infinite or NaN number (1e400 reads as inf): each would
  -- pass a `>= 0` check below and train on garbage.
  for _, sec in ipairs(sorted_keys(M.defaults)) do
    for _, k in ipairs(sorted_keys(M.defaults[sec])) do
      local v = type(cfg[sec]) == "table" and cfg[sec][k]
      if type(v) == "number" and (v ~= v or v == math.huge or v == -math.huge) then
        need(false, ("%s.%s = %s; expected a finite number"):format(sec, k, tostring(v)))
      end
    end
  end
  local t = cfg.training
  need(t.local_batch_size >= 1 and t.local_batch_size % 1 == 0, "training.local_batch_size must be a positive integer")
  need(t.seq_len >= 1 and t.seq_len % 1 == 0, "training.seq_len must be a positive integer")
  need(t.steps >= 0 and t.steps % 1 == 0, "training.steps must be a non-negative integer")
  need(({ linear = 1, sqrt = 1, cosine = 1 })[cfg.lr_scheduler.decay_type],
    "lr_scheduler.decay_type must be linear, sqrt or cosine, got '" .. cfg.lr_scheduler.decay_type .. "'")
  need(cfg.lr_scheduler.min_lr_factor >= 0 and cfg.lr_scheduler.min_lr_factor <= 1,
    "lr_scheduler.min_lr_factor must be in [0, 1]")
  need(cfg.optimizer.lr >= 0, "optimizer.lr must be >= 0")
  local o = cfg.optimizer
  need(o.beta1 >= 0 and o.beta1 < 1, "optimizer.beta1 must be in [0, 1), got " .. tostring(o.beta1))
  need(o.beta2 >= 0 and o.beta2 < 1, "optimizer.beta2 must be in [0, 1), got " .. tostring(o.beta2))
  need(o.eps >= 0, "optimizer.eps must be >= 0, got " .. tostring(o.eps))
  need(o.weight_decay >= 0, "optimizer.weight_decay must be >= 0, got " .. tostring(o.weight_decay))
  local ls = cfg.lr_scheduler
  need(ls.warmup_steps >= 0 and ls.warmup_steps % 1 == 0,
    "lr_scheduler.warmup_steps must be a non-negative integer, got " .. tostring(ls.warmup_steps))
  need(ls.decay_ratio == -1 or (ls.decay_ratio >= 0 and ls.decay_ratio <= 1),
    "lr_scheduler.decay_ratio must be in [0, 1], or -1 (decay over every step after warmup), got "
      .. tostring(ls.decay_ratio))
  need(t.max_norm >= 0, "training.max_norm must be >= 0 (0: no clipping), got " .. tostring(t.max_norm))
  local cm = cfg.comm
  need(cm.init_timeout_seconds >= 0 and cm.train_timeout_seconds >= 0, ("comm timeouts must be >= 0 (0: none), got "
    .. "init %s, train %s"):format(tostring(cm.init_timeout_seconds), tostring(cm.train_timeout_seconds)))
  need(cm.trace_buf_size >= 1 and cm.trace_buf_size % 1 == 0, ("comm.trace_buf_size = %s; expected a positive "
    .. "integer"):format(tostring(cm.trace_buf_size)))
  need(t.on_nonfinite_grad == "stop" or t.on_nonfinite_grad == "skip", ("training.on_nonfinite_grad = '%s'; "
    .. "expected stop or skip"):format(t.on_nonfinite_grad))
  need(t.threads == -1 or (t.threads >= 1 and t.threads % 1 == 0),
    "training.threads must be -1 (OMP_NUM_THREADS or all cores) or a positive integer, got " .. tostring(t.threads))
  need(t.device == "cpu" or t.device == "cuda" or t.device:match("^cuda:%d+$") ~= nil,
    "training.device must be cpu, cuda or cuda:N, got '" .. t.device .. "'")
  local v = cfg.validation
  need(v.freq >= 1 and v.freq % 1 == 0, "validation.freq must be a positive integer, got " .. tostring(v.freq))
  need(v.steps >= 1 and v.steps % 1 == 0, "validation.steps must be a positive integer, got " .. tostring(v.steps))
  need(v.split >= 0 and v.split < 1, "validation.split must be in [0, 1), got " .. tostring(v.split))
  need(cfg.model.name:match("^[%w_]+$") ~= nil, "model.name must be a file name in lua/models/, got '"
    .. cfg.model.name .. "'")
  do
    local env = require("titan.env")
    local mod = "models." .. cfg.model.name -- what the trainer will require
    if not (package.preload[mod] or package.loaded[mod] or package.searchpath(mod, package.path)) then
      local names = {}
      local ok, files = pcall(require("titan.checkpoint.fs").list, env.root .. "/lua/models")
      for _, file in ipairs(ok and files or {}) do names[#names + 1] = file:match("^(.+)%.lua$") end
      need(false, ("model.name: no model family '%s'; expected one of %s (files in lua/models/)"):format(
        cfg.model.name, table.concat(names, ", ")))
    end
  end
  need(({ float32 = 1, bfloat16 = 1, float64 = 1 })[t.mixed_precision_param],
    "training.mixed_precision_param must be float32, bfloat16 or float64, got '" .. t.mixed_precision_param .. "'")
  need(t.mixed_precision_reduce == "float32",
    "training.mixed_precision_reduce: only float32 gradient reduction is available, got '" .. t.mixed_precision_reduce .. "'")
  need(cfg.optimizer.name == "AdamW", "optimizer.name: only AdamW is available, got '" .. cfg.optimizer.name .. "'")
  need(cfg.metrics.log_freq >= 1, "metrics.log_freq must be >= 1")
  need(cfg.metrics.save_tb_folder ~= "", "metrics.save_tb_folder is empty; expected a folder name under job.dump_folder")
  local prof = cfg.profiling
  need(prof.profile_freq >= 1 and prof.profile_freq % 1 == 0, ("profiling.profile_freq = %s; expected a positive "
    .. "number of steps"):format(tostring(prof.profile_freq)))
  need(prof.region_timing == "device" or prof.region_timing == "sync", ("profiling.region_timing = '%s'; expected "
    .. "device or sync"):format(tostring(prof.region_timing)))
  need(prof.save_traces_folder ~= "", "profiling.save_traces_folder is empty; expected a folder name under "
    .. "job.dump_folder")
  need(not (prof.enable_profiling and t.cuda_graphs), "profiling.enable_profiling: not with training.cuda_graphs "
    .. "(a step replayed from a graph has no regions to time); profile with --training.cuda_graphs=false")
  -- The keys of the parallel layer (activation checkpointing, float8, CP,
  -- PP, FSDP): the model family checks them (lua/parallel/dims.lua).
  local family = require("models." .. cfg.model.name)
  if family.check_config then family.check_config(cfg, need) end
  -- The checkpoint manager checks its own section (it touches no files).
  require("titan.checkpoint.manager").new(cfg.checkpoint, {})
end

-- `titan RECIPE.lua --help`: the usage line, then every key with this
-- recipe's value and its one-line meaning, grouped by section.
function M.help(cfg, script)
  local lines = {
    ("usage: titan %s [--section.key=value ...] [--print-config] [--help]"):format(script or "RECIPE.lua"),
    "keys, with this recipe's values (docs/recipes.md explains each):",
  }
  for _, sec in ipairs(M.sections) do
    lines[#lines + 1] = ""
    for _, k in ipairs(sorted_keys(M.defaults[sec])) do
      local v = cfg[sec][k]
      -- strings a shell would split or that are empty are shown quoted
      local val = (type(v) == "string" and not v:match("^[%w%._/:,%-%+]+$")) and ("%q"):format(v) or tostring(v)
      local shown, what = ("  --%s.%s=%s"):format(sec, k, val), M.descriptions[sec .. "." .. k] or ""
      if #shown > 50 then
        lines[#lines + 1] = shown
        lines[#lines + 1] = (" "):rep(53) .. what
      else
        lines[#lines + 1] = ("%-52s %s"):format(shown, what)
      end
    end
  end
  return table.concat(lines, "\n")
end

-- The resolved config as a Lua table literal (sections in recipe order, keys sorted).
function M.dump(cfg)
  local lines = { "{" }
  for _, sec in ipairs(M.sections) do
    lines[#lines + 1] = ("  %s = {"):format(sec)
    for _, k in ipairs(sorted_keys(M.defaults[sec])) do
      local v = cfg[sec][k]
      local s = type(v) == "string" and ("%q"):format(v) or tostring(v)
      lines[#lines + 1] = ("    %s = %s,"):format(k, s)
    end
    lines[#lines + 1] = "  },"
  end
  local hooks = {}
  for k, v in pairs(cfg) do
    if not M.defaults[k] and type(v) == "function" then hooks[#hooks + 1] = k end
  end
  table.sort(hooks)
  if #hooks > 0 then lines[#lines + 1] = "  -- recipe functions: " .. table.concat(hooks, ", ") end
  lines[#lines + 1] = "}"
  return table.concat(lines, "\n")
end

return M
