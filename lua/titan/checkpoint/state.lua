-- checkpoint/state.lua — the train state as checkpoint contents: which
-- named tensors (model parameters and buffers by their fully-qualified
-- names; AdamW's moments and master weights as optimizer.state.<name>.*)
-- and which JSON (step, RNG, data loader position, lr schedule, optimizer
-- scalars), and the way back: validate everything first, then read.
--
--   parts = { model = module, optimizer = adamw | nil, dataloader = loader | nil,
--             extra = { step =, rng = { seed =, offset = }, lr_step =, ... } }
local tensor = require("titan.tensor")
local memory = require("titan.memory")
local json = require("titan.checkpoint.json")

local M = {}

M.OPTIM_PREFIX = "optimizer.state."
M.MOMENTS = { "exp_avg", "exp_avg_sq", "master" }

local function fail(fmt, ...) error(("checkpoint: " .. fmt):format(...), 0) end

-- The box a local tensor holds of its global tensor: the whole of it unless
-- shard_of(name, t) says otherwise (returns global_shape, offset 0-based).
local function box(shard_of, name, t)
  local shape = t:shape()
  if shard_of then
    local gshape, offset = shard_of(name, t)
    if gshape then return gshape, offset, shape end
  end
  local zeros = {}
  for d = 1, #shape do zeros[d] = 0 end
  return shape, zeros, shape
end

-- JSON-safe copy of a Lua value (drops functions; 64-bit cdata -> strings).
local function plain(v, depth)
  depth = depth or 0
  if depth > 32 then fail("train state nested too deeply") end
  local tv = type(v)
  if tv == "table" then
    local out = {}
    for k, x in pairs(v) do
      if type(x) ~= "function" and type(x) ~= "userdata" then out[k] = plain(x, depth + 1) end
    end
    return out
  elseif tv == "cdata" then
    return (tostring(v):gsub("U?LL$", ""))
  end
  return v
end
M.plain = plain

-- parts -> items ({name, tensor, dtype, global_shape, offset}) and the JSON
-- train state. opts: model_only, dtype (stored dtype of model tensors),
-- shard_of.
function M.collect(parts, opts)
  opts = opts or {}
  local items = {}
  local sd = parts.model:state_dict()
  for _, name in ipairs(sd.names) do
    local t = sd.tensors[name]
    local g, off = box(opts.shard_of, name, t)
    items[#items + 1] = { name = name, tensor = t, dtype = opts.dtype, global_shape = g, offset = off }
  end
  local extra = plain(parts.extra or {})
  local ts = { extra = extra }
  if opts.model_only then return items, ts end
  local opt = parts.optimizer
  if opt then
    local steps = {}
    for _, e in ipairs(opt.params) do
      local st = opt.state[e.name]
      if st then
        steps[e.name] = st.step
        local g, off = box(opts.shard_of, e.name, e.param)
        for _, kind in ipairs(M.MOMENTS) do
          if st[kind] then
            items[#items + 1] = { name = M.OPTIM_PREFIX .. e.name .. "." .. kind, tensor = st[kind], global_shape = g,
              offset = off }
          end
        end
      end
    end
    ts.optimizer = { step_count = opt.step_count, lr_factor = opt.lr_factor, param_steps = steps }
  end
  if parts.dataloader and parts.dataloader.state_dict then ts.dataloader = plain(parts.dataloader:state_dict()) end
  ts.lr_scheduler = { step = extra.lr_step or extra.step }
  return items, ts
end

-- The first item whose tensor holds a NaN or an infinity, or nil: one sum
-- of squares in float64 over the items of each device (a float32 square
-- cannot overflow it), then item by item only when that sum is not finite.
function M.first_nonfinite(items)
  local ops = require("titan.ops")
  local function finite(v) return v == v and v ~= math.huge end
  local by_dev, order = {}, {}
  for _, it in ipairs(items) do
    local t = it.tensor
    if t:numel() > 0 and t:device() ~= "meta" then
      local d = t:device()
      if not by_dev[d] then by_dev[d] = {}; order[#order + 1] = d end
      local g = by_dev[d]
      g[#g + 1] = it
    end
  end
  for _, d in ipairs(order) do
    local ts = {}
    for i, it in ipairs(by_dev[d]) do ts[i] = it.tensor end
    if not finite(ops.global_norm(ts)) then
      for _, it in ipairs(by_dev[d]) do
        if not finite(ops.global_norm({ it.tensor })) then return it.name end
      end
    end
  end
  return nil
end

-- Optimizer state of parameter e, created as AdamW would on its first step
-- (f32 moments; an f32 master copy for bf16 parameters), kept.
local function ensure_optim_state(opt, e)
  local st = opt.state[e.name]
  if st then return st, false end
  local p = e.param
  st = {
    exp_avg = memory.keep(tensor.zeros(p:shape(), { dtype = "float32", device = p:device() })),
    exp_avg_sq = memory.keep(tensor.zeros(p:shape(), { dtype = "float32", device = p:device() })),
    step = 0,
  }
  if p:dtype() == "bfloat16" then st.master = memory.keep(p:to("float32")) end
  return st, true
end

-- What a full resume needs of ck and its train state ts, each checked
-- against what the save itself recorded (the optimizer's per-parameter step
-- counts name the parameters that had moments). Fails naming what is
-- missing and how to start without it.
function M.check_resumable(ck, ts, parts, exclude)
  local missing = {}
  local no_ts = type(ts) ~= "table"
  if no_ts then ts = {} end
  local opt = parts.optimizer
  if opt and not exclude.optimizer then
    local o = ts.optimizer
    if type(o) ~= "table" or type(o.step_count) ~= "number" or o.step_count < 0 or o.step_count % 1 ~= 0
      or (o.param_steps ~= nil and type(o.param_steps) ~= "table") then
      missing[#missing + 1] = "the optimizer's step count (train_state.optimizer)"
    else
      local lacking, first = 0, nil
      for name, s in pairs(o.param_steps or {}) do
        if type(s) ~= "number" then
          lacking, first = lacking + 1, first or name
        else
          for _, kind in ipairs({ "exp_avg", "exp_avg_sq" }) do
            if not ck:has(M.OPTIM_PREFIX .. name .. "." .. kind) then
              lacking, first = lacking + 1, first or (M.OPTIM_PREFIX .. name .. "." .. kind)
              break
            end
          end
        end
      end
      if lacking > 0 then
        missing[#missing + 1] = ("AdamW's moments of %d parameter(s) it trained (%s%s)"):format(lacking, first,
          lacking > 1 and ", ..." or "")
      end
    end
  end
  if parts.dataloader and parts.dataloader.load_state_dict and not exclude.dataloader
    and type(ts.dataloader) ~= "table" and type(ts.dataloader_ranks) ~= "table" then
    missing[#missing + 1] = "the data position (train_state.dataloader)"
  end
  if not exclude.lr_scheduler and (type(ts.lr_scheduler) ~= "table" or type(ts.lr_scheduler.step) ~= "number") then
    missing[#missing + 1] = "the learning-rate schedule's step (train_state.lr_scheduler)"
  end
  if no_ts and #missing > 0 then
    missing = { ("its train state (metadata.json has no train_state table: %s)"):format(table.concat(missing, ", ")) }
  end
  if #missing > 0 then
    fail("%s lacks %s: resuming would restart %s silently; expected a whole checkpoint, or name what to restart "
      .. "(--checkpoint.exclude_from_loading=optimizer,dataloader,lr_scheduler)", ck.dir, table.concat(missing, ", "),
      (#missing > 1 or no_ts) and "them" or "it")
  end
end

-- Restore parts from checkpoint ck. opts: model_only, exclude (set of
-- "optimizer", "dataloader", "lr_scheduler"), shard_of, verify, strict
-- (default true: tensors of the model group the model lacks are an error),
-- rank (this data-parallel rank: its own data position when the save kept
-- every rank's), known (a set of names other ranks hold: a pipeline stage
-- has some of the model's tensors, and the others are not extra).
-- Everything is validated (names, shapes, coverage, data file sizes) before
-- the first byte is read. Returns the saved train state table.
function M.restore(ck, parts, opts)
  opts = opts or {}
  local exclude = opts.exclude or {}
  local meta = ck.meta
  local model_only = opts.model_only or meta.model_only
  local jobs = {} -- { name, dst, want }
  local sd = parts.model:state_dict()
  local own = {}
  for _, name in ipairs(sd.names) do
    local t = sd.tensors[name]
    own[name] = true
    local g, off, size = box(opts.shard_of, name, t)
    jobs[#jobs + 1] = { name = name, dst = t, want = { global_shape = g, offset = off, size = size } }
  end
  if opts.strict ~= false then
    local extra = {}
    for _, name in ipairs(ck:names()) do
      if name:sub(1, #M.OPTIM_PREFIX) ~= M.OPTIM_PREFIX and not own[name] and not (opts.known and opts.known[name])
      then
        extra[#extra + 1] = name
      end
    end
    if #extra > 0 then
      fail("%s holds %d tensor(s) this model lacks (%s%s): a checkpoint of another model shape", ck.dir, #extra,
        table.concat(extra, ", ", 1, math.min(3, #extra)), #extra > 3 and ", ..." or "")
    end
  end
  local ts = meta.train_state
  local opt = parts.optimizer
  -- A resume takes every piece or refuses: a piece missing would restart
  -- silently (fresh AdamW moments, the data from its first batch).
  if not model_only then M.check_resumable(ck, ts, parts, exclude) end
  ts = type(ts) == "table" and ts or {}
  local new_state = {}
  if opt and not model_only and not exclude.optimizer and ts.optimizer then
    for _, e in ipairs(opt.params) do
      local base = M.OPTIM_PREFIX .. e.name .. "."
      if ck:has(base .. "exp_avg") then
        local st, created = ensure_optim_state(opt, e)
        if created then new_state[e.name] = st end
        local g, off, size = box(opts.shard_of, e.name, e.param)
        local want = { global_shape = g, offset = off, size = size }
        for _, kind in ipairs(M.MOMENTS) do
          if st[kind] then
            local src = base .. kind
            -- no master saved (an f32 run resumed in bf16): the f32 weights are it
            if kind == "master" and not ck:has(src) then src = e.name end
            jobs[#jobs + 1] = { name = src, dst = st[kind], want = want }
          end
        end
        st.step = (ts.optimizer.param_steps or {})[e.name] or ts.optimizer.step_count or 0
      end
    end
  end
  -- Validate everything, then read.
  local names = {}
  for _, j in ipairs(jobs) do
    j.reads = ck:plan(j.name, j.want)
    names[#names + 1] = j.name
  end
  ck:check_files(names)
  local autograd = require("titan.autograd")
  autograd.no_grad(function()
    for _, j in ipairs(jobs) do ck:read(j.name, j.reads, j.dst, { verify = opts.verify }) end
  end)
  if opt and not model_only and not exclude.optimizer and ts.optimizer then
    for name, st in pairs(new_state) do opt.state[name] = st end
    opt.step_count = ts.optimizer.step_count or 0
    opt.lr_factor = ts.optimizer.lr_factor
  end
  -- (a data-parallel save keeps every rank's position: this rank's, when it has one)
  local dl = ts.dataloader
  if type(ts.dataloader_ranks) == "table" and type(ts.dataloader_ranks[(opts.rank or 0) + 1]) == "table" then
    dl = ts.dataloader_ranks[(opts.rank or 0) + 1]
  end
  if parts.dataloader and not model_only and not exclude.dataloader and dl
    and dl ~= json.null and parts.dataloader.load_state_dict then
    parts.dataloader:load_state_dict(dl)
  end
  return ts
end

return M
