-- checkpoint/manager.lua — the CheckpointManager: when to save, where, in
-- the background or not, what to keep, and what to load at start-up.
--
--   local mgr = ckpt.Manager(cfg.checkpoint, { dump_folder = cfg.job.dump_folder, rank = 0, world = 1 })
--   local step = mgr:load(state)              -- nil: nothing to load, train from scratch
--   ... each step: mgr:maybe_save(step, state, { final = step == last })
--   mgr:close()                               -- waits for an async save in flight
--
-- state = { model =, optimizer =, dataloader =, extra = { step =, rng =, lr_step = } }.
-- With world > 1, opts.gather(value) -> { value of rank 0, ..., value of rank W-1 }
-- (an all-gather of Lua tables) and opts.barrier() come from the
-- distributed layer; rank 0 writes metadata.json and commits.
local format = require("titan.checkpoint.format")
local state = require("titan.checkpoint.state")
local fs = require("titan.checkpoint.fs")

local M = {}

local Manager = {}
Manager.__index = Manager
M.Manager = Manager

local function fail(fmt, ...) error(("checkpoint: " .. fmt):format(...), 0) end

-- The `checkpoint` config section's keys, defaults and meaning (for config.lua).
M.defaults = {
  enable = false,
  folder = "checkpoint",          -- relative to job.dump_folder (or absolute)
  interval = 500,                 -- save every `interval` steps
  load_step = -1,                 -- -1: the latest complete checkpoint; N: step-N exactly
  keep_latest_k = 10,             -- keep the newest k complete checkpoints (0: keep all)
  async_mode = "disabled",        -- disabled | async (host snapshot, written by a background thread)
  last_save_model_only = false,   -- the final save holds the model only (in export_dtype)
  export_dtype = "float32",       -- float32 | bfloat16: dtype of a model-only final save
  exclude_from_loading = "",      -- comma-separated: dataloader, optimizer, lr_scheduler
  initial_load_path = "",         -- a checkpoint (step folder, folder of steps, or HF folder) when the folder has none
  initial_load_model_only = true, -- from initial_load_path load the model only
  create_seed_checkpoint = false, -- save step 0 (model only) and stop
}

local EXCLUDABLE = { dataloader = true, optimizer = true, lr_scheduler = true }
local ASYNC = { disabled = false, async = true, async_with_pinned_mem = true }
local EXPORT = { float32 = true, bfloat16 = true }

local function warn(msg)
  io.stderr:write("titan: checkpoint: " .. msg .. "\n")
  io.stderr:flush()
end

-- cfg: the `checkpoint` section (missing keys take M.defaults); opts:
-- dump_folder, rank, world, gather, barrier, shard_of, data_rank (this
-- rank's data-parallel rank, whose data position it restores: tensor-
-- parallel ranks share one; default rank), known_names (the set of tensor
-- names the whole job holds, when this rank holds a part: a pipeline
-- stage), log (a function
-- receiving info lines; default: print on rank 0).
function M.new(cfg, opts)
  cfg = cfg or {}
  opts = opts or {}
  local c = {}
  for k, v in pairs(M.defaults) do
    if cfg[k] == nil then c[k] = v else c[k] = cfg[k] end
  end
  for k in pairs(cfg) do
    if M.defaults[k] == nil then fail("unknown key checkpoint.%s", tostring(k)) end
  end
  if ASYNC[c.async_mode] == nil then
    fail("checkpoint.async_mode must be disabled or async, got '%s'", tostring(c.async_mode))
  end
  if not EXPORT[c.export_dtype] then
    fail("checkpoint.export_dtype must be float32 or bfloat16, got '%s'", tostring(c.export_dtype))
  end
  if type(c.interval) ~= "number" or c.interval < 1 or c.interval % 1 ~= 0 then
    fail("checkpoint.interval must be a positive integer, got %s", tostring(c.interval))
  end
  if type(c.keep_latest_k) ~= "number" or c.keep_latest_k < 0 or c.keep_latest_k % 1 ~= 0 then
    fail("checkpoint.keep_latest_k must be 0 (keep all) or a positive integer, got %s", tostring(c.keep_latest_k))
  end
  if type(c.load_step) ~= "number" or (c.load_step ~= -1 and (c.load_step < 0 or c.load_step % 1 ~= 0
    or c.load_step >= 2 ^ 53)) then
    fail("checkpoint.load_step = %s; expected -1 (the latest step) or a step number", tostring(c.load_step))
  end
  -- (checkpoints off load nothing: a path or step asked for would be ignored)
  if not c.enable and c.initial_load_path ~= "" then
    fail("checkpoint.initial_load_path = %s, but checkpoint.enable is false, so nothing would be loaded; expected "
      .. "--checkpoint.enable=true", c.initial_load_path)
  end
  if c.create_seed_checkpoint and (c.initial_load_path ~= "" or c.load_step ~= -1) then
    fail("checkpoint.create_seed_checkpoint writes freshly initialized weights as step 0, so %s would be ignored; "
      .. "expected one or the other (a checkpoint from Hugging Face weights: titan ckpt convert --from hf)",
      c.initial_load_path ~= "" and ("initial_load_path = " .. c.initial_load_path) or
      ("load_step = " .. tostring(c.load_step)))
  end
  if not c.enable and c.load_step ~= -1 then
    fail("checkpoint.load_step = %s, but checkpoint.enable is false, so nothing would be loaded; expected "
      .. "--checkpoint.enable=true", tostring(c.load_step))
  end
  local exclude = {}
  for name in tostring(c.exclude_from_loading):gmatch("[^,%s]+") do
    if not EXCLUDABLE[name] then
      fail("checkpoint.exclude_from_loading: unknown part '%s'; expected dataloader, optimizer or lr_scheduler", name)
    end
    exclude[name] = true
  end
  local rank, world = opts.rank or 0, opts.world or 1
  if world > 1 and not (opts.gather and opts.barrier) then
    fail("a world of %d ranks needs opts.gather and opts.barrier from the distributed layer", world)
  end
  local self = setmetatable({
    cfg = c, enable = c.enable, interval = c.interval, async = ASYNC[c.async_mode], exclude = exclude,
    folder = fs.join(opts.dump_folder or ".", c.folder), rank = rank, world = world,
    gather = opts.gather or function(v) return { v } end, barrier = opts.barrier or function() end,
    shard_of = opts.shard_of, pending = nil, last_saved = nil, data_rank = opts.data_rank or rank,
    known_names = opts.known_names,
    -- (this process holds the job's dump-folder lock: a temporary folder in
    -- a checkpoint folder under it is no live job's, whatever its host)
    exclusive = opts.exclusive and not c.folder:match("^/") or false,
    log = opts.log or function(msg) if rank == 0 then print("checkpoint: " .. msg) end end,
  }, Manager)
  return self
end

-- Creates the checkpoint folder now, so a folder that cannot be made stops
-- the job at start-up rather than at its first save, hours in.
function Manager:prepare()
  if not self.enable or self.rank ~= 0 then return end
  fs.mkdirs(self.folder) -- its error names the folder and why
  -- (a folder that takes no files fails now, not at the first save hours in)
  local probe = fs.join(self.folder, (".write-test-%d"):format(fs.pid()))
  local ok, err = pcall(fs.write_file, probe, "")
  if not ok then
    fail("cannot write into %s (%s); expected a writable checkpoint folder", self.folder,
      (tostring(err):gsub("^checkpoint: ", "")))
  end
  pcall(fs.remove_all, probe)
  self:clean_stale()
end

-- Removes the temporary folders of saves and purges that never finished
-- (a killed job): those of dead processes on this host, or, when this job
-- holds the dump folder's lock (exclusive), every one but this process's.
function Manager:clean_stale()
  if not (self.world == 1 or self.exclusive) or not fs.is_dir(self.folder) then return end
  for _, name in ipairs(fs.list(self.folder)) do
    local pid = name:match("^%.step%-%d+%.tmp%-(%d+)$") or name:match("^%.purge%-step%-%d+%-(%d+)$")
    if pid and tonumber(pid) ~= fs.pid() and (self.exclusive or not fs.alive(pid)) then
      pcall(fs.remove_all, fs.join(self.folder, name))
    end
  end
end

function Manager:should_save(step, final)
  if not self.enable then return false end
  return final or (step > 0 and step % self.interval == 0)
end

-- ---- saving --------------------------------------------------------------------

-- opts: force (save whatever the interval), final (the last step: model
-- only in export_dtype when last_save_model_only). Returns the step folder
-- (committed when sync; committed by poll/wait/close/the next save when async).
function Manager:save(step, parts, opts)
  opts = opts or {}
  if not self.enable then return nil end
  if not (opts.force or self:should_save(step, opts.final)) then return nil end
  self:wait()
  local model_only = step == 0 or (opts.final and self.cfg.last_save_model_only) or false
  -- already saved at this step (an interval save, then the final one or a signal's)
  if self.last_saved == step and self.last_model_only == model_only then return format.step_dir(self.folder, step) end
  local dtype = opts.final and self.cfg.last_save_model_only and self.cfg.export_dtype or nil
  local items, ts = state.collect(parts, { model_only = model_only, dtype = dtype, shard_of = self.shard_of })
  -- Never a poisoned save: a NaN or inf anywhere (on any rank) refuses it,
  -- and the checkpoints already saved stay as they are.
  local bad = state.first_nonfinite(items)
  for r, b in ipairs(self.gather(bad or false)) do
    if b then
      fail("not saving step %d: %s holds NaN or inf values%s; the last checkpoint %s", step, b,
        self.world > 1 and (" (rank %d)"):format(r - 1) or "",
        self.last_saved and ("is step " .. self.last_saved) or "on disk is unchanged")
    end
  end
  -- Each data-parallel rank reads its own share of the data: every rank's
  -- position is kept (ts.dataloader stays rank 0's, so a reader that knows
  -- one rank, or a resume onto other ranks, sees a state it can check).
  -- (one per data-parallel rank: the ranks of a tensor-parallel group read
  -- the same data)
  if self.world > 1 and ts.dataloader then
    local positions = {}
    for _, p in ipairs(self.gather({ self.data_rank, ts.dataloader })) do positions[p[1] + 1] = p[2] end
    ts.dataloader_ranks = positions
  end
  if self.world > 1 then -- write each replicated box once (the lowest rank holding it)
    local mine = {}
    for i, it in ipairs(items) do mine[i] = { name = it.name, offset = it.offset, size = it.tensor:shape() } end
    local keep = require("titan.checkpoint.layout").dedup(self.gather(mine))[self.rank + 1]
    local kept = {}
    for i, it in ipairs(items) do
      if keep[i] then kept[#kept + 1] = it end
    end
    items = kept
  end
  if self.rollback_from then
    self:set_aside_after(self.rollback_from)
    self.rollback_from = nil
  end
  local final = format.step_dir(self.folder, step)
  -- Never over another run's step (this run re-saves its own: the final
  -- model-only export over the same step's full save).
  if self.last_saved ~= step and fs.exists(final) then
    fail("not saving step %d: %s already exists and this run did not write it; expected a new step (move it away, "
      .. "or resume from it)", step, final)
  end
  local token = self.gather(fs.pid())[1] -- rank 0's pid names the temporary folder
  local tmp = fs.join(self.folder, (".step-%d.tmp-%d"):format(step, token))
  if self.rank == 0 then
    fs.mkdirs(self.folder)
    if fs.exists(tmp) then fs.remove_all(tmp) end
  end
  self.barrier()
  fs.mkdirs(tmp)
  local w = format.writer(tmp, self.rank, { async = self.async })
  local ok, err = pcall(function()
    for _, it in ipairs(items) do w:add(it) end
    w:start()
  end)
  if not ok then -- nothing half-written stays behind
    w:abort()
    pcall(fs.remove_all, tmp)
    error(err, 0)
  end
  self.pending = { writer = w, step = step, tmp = tmp, final = final, ts = ts, model_only = model_only }
  if not self.async then self:wait() end
  return final
end

-- Commit the pending save (metadata on rank 0, COMPLETE, rename), then purge.
function Manager:_commit()
  local p = self.pending
  self.pending = nil
  local ok, part = pcall(p.writer.finish, p.writer)
  if not ok then
    if fs.exists(p.tmp) then pcall(fs.remove_all, p.tmp) end
    error(part, 0)
  end
  local parts = self.gather(part)
  if self.rank == 0 then
    format.commit(p.tmp, p.final, format.metadata(parts, { step = p.step, model_only = p.model_only,
      train_state = p.ts }))
    self.log(("saved step %d%s to %s"):format(p.step, p.model_only and " (model only)" or "", p.final))
  end
  self.barrier()
  self.last_saved, self.last_model_only = p.step, p.model_only
  if self.rank == 0 then self:purge() end
end

-- Non-blocking: commits an async save whose bytes are on disk. Call it once
-- per step; returns true when nothing is in flight any more.
function Manager:poll()
  if self.pending and (not self.async or self.pending.writer:done()) then self:_commit() end
  return self.pending == nil
end

-- Blocks until the save in flight (if any) is written and committed.
function Manager:wait()
  if self.pending then self:_commit() end
end

function Manager:close() self:wait() end

-- poll + save when the interval (or final) says so: the one call per step.
function Manager:maybe_save(step, parts, opts)
  self:poll()
  if self:should_save(step, opts and opts.final) or (opts and opts.force) then return self:save(step, parts, opts) end
end

-- Keep the newest keep_latest_k complete checkpoints (never the newest);
-- also clears temporary folders of processes that died (single host only).
function Manager:purge()
  local k = self.cfg.keep_latest_k
  local steps = {}
  for _, s in ipairs(format.list_steps(self.folder)) do
    if s.complete then steps[#steps + 1] = s end
  end
  if k > 0 then
    for i = 1, #steps - math.max(k, 1) do
      local s = steps[i]
      -- rename first: a crash mid-removal leaves no half-deleted step-N behind
      local doomed = fs.join(self.folder, (".purge-step-%d-%d"):format(s.step, fs.pid()))
      local ok = pcall(fs.rename, s.dir, doomed)
      if ok then pcall(fs.remove_all, doomed) end
    end
  end
  self:clean_stale()
end

-- ---- loading -------------------------------------------------------------------

-- Complete step folders in the folder; step folders without COMPLETE are
-- reported (one stderr line each) and skipped.
function Manager:complete_steps(quiet)
  local out = {}
  for _, s in ipairs(format.list_steps(self.folder)) do
    if s.complete then
      out[#out + 1] = s
    elseif not quiet then
      warn(("ignoring %s: no %s marker (an interrupted or partial save)"):format(s.dir, format.MARKER))
    end
  end
  return out
end

-- A path given by the user: a step folder, or a folder of step folders
-- (its latest complete one), or a Hugging Face folder ("hf").
local function resolve_path(path)
  if format.is_complete(path) then return path, "titan" end
  if fs.exists(fs.join(path, "config.json")) and (fs.exists(fs.join(path, "model.safetensors"))
    or fs.exists(fs.join(path, "model.safetensors.index.json"))) then
    return path, "hf"
  end
  local steps = format.list_steps(path)
  for i = #steps, 1, -1 do
    if steps[i].complete then return steps[i].dir, "titan" end
  end
  if fs.is_dir(path) and format.list_steps(path)[1] == nil and fs.exists(fs.join(path, format.METADATA)) then
    fail("%s is incomplete (no %s marker: an interrupted save); it cannot be loaded", path, format.MARKER)
  end
  fail("initial_load_path %s holds no complete checkpoint (step folder with %s, folder of step-N, or HF folder)",
    path, format.MARKER)
end

-- A rollback (load_step below the latest step): at the new run's first
-- save, the abandoned run's later steps move to <folder>/abandoned-<time>/
-- (rank 0), so that its saves neither collide with them nor get purged as
-- the older ones by keep_latest_k, and nothing is deleted.
function Manager:set_aside_after(want)
  local later = {}
  for _, s in ipairs(format.list_steps(self.folder)) do
    if s.step > want then later[#later + 1] = s end
  end
  if #later == 0 then return end
  local aside = fs.join(self.folder, "abandoned-" .. os.date("!%Y%m%d-%H%M%S"))
  if self.rank == 0 then
    fs.mkdirs(aside)
    for _, s in ipairs(later) do fs.rename(s.dir, fs.join(aside, fs.basename(s.dir))) end
    fs.sync_dir(self.folder)
    local names = {}
    for _, s in ipairs(later) do names[#names + 1] = tostring(s.step) end
    self.log(("rolling back to step %d: the later step%s %s moved to %s (nothing deleted)"):format(want,
      #later > 1 and "s" or "", table.concat(names, ", "), aside))
  end
  self.barrier()
end

-- Load what the config asks for into parts. Returns the step loaded and
-- an info table { extra =, lr_step =, path =, model_only = }, or nil when
-- there is nothing to load (train from scratch). parts.extra, when a table,
-- receives the saved extra fields.
function Manager:load(parts)
  if not self.enable then return nil end
  self:wait()
  local dir, kind, model_only, initial
  local want = self.cfg.load_step
  if want >= 0 then
    dir = format.step_dir(self.folder, want)
    if not fs.is_dir(dir) then
      local have = {}
      for _, s in ipairs(self:complete_steps(true)) do have[#have + 1] = tostring(s.step) end
      fail("checkpoint.load_step = %s but %s does not exist (complete steps: %s)", tostring(want), dir,
        #have > 0 and table.concat(have, ", ") or "none")
    end
    kind = "titan"
    self.rollback_from = want -- (later steps move aside at this run's first save: set_aside_after)
  else
    local steps = self:complete_steps()
    if #steps > 0 then dir, kind = steps[#steps].dir, "titan" end
  end
  if not dir and self.cfg.initial_load_path ~= "" then
    dir, kind = resolve_path(self.cfg.initial_load_path)
    model_only, initial = self.cfg.initial_load_model_only, true
  end
  if not dir then return nil end
  if kind == "hf" then
    require("titan.checkpoint.hf").import(dir, parts.model, { shard_of = self.shard_of, known = self.known_names })
    self.log(("loaded the model from Hugging Face folder %s"):format(dir))
    return 0, { path = dir, model_only = true, extra = {} }
  end
  local ck = format.open(dir)
  if ck.step == 0 then model_only = true end -- a seed checkpoint
  if not initial and not model_only and ck.meta.model_only
    and not (self.exclude.optimizer and self.exclude.dataloader and self.exclude.lr_scheduler) then
    local full = {}
    for _, s in ipairs(self:complete_steps(true)) do
      if s.step < ck.step then full[#full + 1] = tostring(s.step) end
    end
    fail("%s holds the model only (a final export, checkpoint.last_save_model_only): resuming from it would restart "
      .. "AdamW's moments, the data and the schedule; expected a full step (--checkpoint.load_step=N; earlier steps: "
      .. "%s), or --checkpoint.exclude_from_loading=optimizer,dataloader,lr_scheduler to go on from its weights", dir,
      #full > 0 and table.concat(full, ", ") or "none")
  end
  local ts = state.restore(ck, parts, { model_only = model_only, exclude = self.exclude, shard_of = self.shard_of,
    rank = self.data_rank, known = self.known_names })
  model_only = model_only or ck.meta.model_only
  local step = initial and 0 or ck.step
  local info = { path = dir, model_only = model_only, extra = {} }
  if not model_only then
    info.extra = ts.extra or {}
    if not self.exclude.lr_scheduler and type(ts.lr_scheduler) == "table" then info.lr_step = ts.lr_scheduler.step end
    if type(parts.extra) == "table" then
      for k, v in pairs(info.extra) do parts.extra[k] = v end
    end
  end
  if initial and model_only and ck.step > 0 then
    self.log(("loaded the model of step %d from %s; AdamW's moments, the data position and the learning-rate "
      .. "schedule start fresh at step 0 (checkpoint.initial_load_model_only)"):format(ck.step, dir))
  else
    self.log(("loaded step %d from %s%s"):format(ck.step, dir, model_only and " (model only)" or ""))
  end
  return step, info
end

return M
