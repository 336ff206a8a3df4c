-- checkpoint.lua — the face of checkpoints (docs/checkpoint.md):
--
--   local ckpt = require("titan.checkpoint")
--   local mgr = ckpt.Manager(cfg.checkpoint, { dump_folder = cfg.job.dump_folder, rank = 0, world = 1 })
--   mgr:load(state); mgr:maybe_save(step, state, { final = ... }); mgr:close()
--   ckpt.save(dir, state, { step = }) / ckpt.load(dir, state)     -- one folder, no manager
--   ckpt.open(dir) -> reader; ckpt.inspect(dir) -> text; ckpt.hf.export / import
--   ckpt.install_signal_handlers(); ckpt.signal_pending() -> "SIGTERM" | "SIGINT" | nil
--
-- The pieces: checkpoint/layout.lua (reshard math), format.lua (files and
-- metadata), state.lua (train state <-> tensors + JSON), manager.lua,
-- safetensors.lua, hf.lua, json.lua, fs.lua. Bytes move in engine/checkpoint.c.
require("titan") -- the whole tensor face: checkpoints convert, view and copy tensors
local tffi = require("titan.ffi")
local format = require("titan.checkpoint.format")
local state = require("titan.checkpoint.state")
local manager = require("titan.checkpoint.manager")
local layout = require("titan.checkpoint.layout")
local fs = require("titan.checkpoint.fs")
local ffi, C = tffi.ffi, tffi.C

local M = {
  format = format, layout = layout, state = state, defaults = manager.defaults,
  open = format.open, list_steps = format.list_steps, step_dir = format.step_dir,
}

setmetatable(M, { __index = function(t, k) -- HF and safetensors load on first use
  if k == "hf" or k == "safetensors" then
    local mod = require("titan.checkpoint." .. k)
    rawset(t, k, mod)
    return mod
  end
end })

function M.Manager(cfg, opts) return manager.new(cfg, opts) end

-- Save parts into folder `dir` (a new step folder, written crash-safe).
-- opts: step (default parts.extra.step or 0), model_only, dtype (of the model tensors).
function M.save(dir, parts, opts)
  opts = opts or {}
  local step = opts.step or (parts.extra and parts.extra.step) or 0
  local items, ts = state.collect(parts, { model_only = opts.model_only, dtype = opts.dtype, shard_of = opts.shard_of })
  local bad = state.first_nonfinite(items)
  if bad then error(("checkpoint: not saving %s: %s holds NaN or inf values"):format(dir, bad), 0) end
  format.write(dir, { items }, { step = step, model_only = opts.model_only, train_state = ts })
  return dir
end

-- Load step folder `dir` into parts; returns the step and the saved train state.
-- opts: model_only, exclude = { optimizer = true, ... }, shard_of, verify, strict.
function M.load(dir, parts, opts)
  local ck = format.open(dir)
  local ts = state.restore(ck, parts, opts)
  if type(parts.extra) == "table" and not (opts and opts.model_only) then
    for k, v in pairs(ts.extra or {}) do parts.extra[k] = v end
  end
  return ck.step, ts
end

-- Load only the model weights from a step folder, or from the latest
-- complete step in a checkpoint folder. Returns the step, or nil when there
-- is nothing to load (path missing or holding no complete step).
function M.load_model(model, path)
  if format.is_complete(path) then
    return (M.load(path, { model = model }, { model_only = true }))
  end
  local latest
  for _, s in ipairs(format.list_steps(path)) do
    if s.complete then latest = s end
  end
  if not latest then return nil end
  return (M.load(latest.dir, { model = model }, { model_only = true }))
end

-- ---- inspection ------------------------------------------------------------------

local function human(n)
  local units = { "B", "KiB", "MiB", "GiB", "TiB" }
  local i = 1
  while n >= 1024 and i < #units do
    n, i = n / 1024, i + 1
  end
  return i == 1 and ("%d B"):format(n) or ("%.1f %s"):format(n, units[i])
end
M.human_bytes = human

local function describe_step(dir, lines)
  if not format.is_complete(dir) then
    lines[#lines + 1] = ("%s: INCOMPLETE (no %s marker: an interrupted save; it is ignored at load)"):format(dir,
      format.MARKER)
    return
  end
  local ck = format.open(dir)
  local meta = ck.meta
  local bytes, nfiles = 0, 0
  for _, f in pairs(meta.files) do
    bytes, nfiles = bytes + f.size, nfiles + 1
  end
  lines[#lines + 1] = ("%s: complete, step %d, format version %d, %d rank(s), %d file(s), %s%s"):format(dir, meta.step,
    meta.version, meta.world_size or nfiles, nfiles, human(bytes), meta.model_only and ", model only" or "")
  local ts, parts = meta.train_state or {}, {}
  if type(ts.optimizer) == "table" then parts[#parts + 1] = ("optimizer (step_count %s)"):format(tostring(ts.optimizer.step_count)) end
  if type(ts.dataloader) == "table" then parts[#parts + 1] = "dataloader" end
  if type(ts.lr_scheduler) == "table" and ts.lr_scheduler.step then parts[#parts + 1] = ("lr_scheduler (step %s)"):format(tostring(ts.lr_scheduler.step)) end
  if type(ts.extra) == "table" and type(ts.extra.rng) == "table" then
    parts[#parts + 1] = ("rng (seed %s, offset %s)"):format(tostring(ts.extra.rng.seed), tostring(ts.extra.rng.offset))
  end
  if #parts > 0 then lines[#lines + 1] = "train state: " .. table.concat(parts, ", ") end
  local names = ck:names()
  local w = 4
  for _, n in ipairs(names) do w = math.max(w, #n) end
  lines[#lines + 1] = ("tensors (%d):"):format(#names)
  lines[#lines + 1] = ("  %-" .. w .. "s  %-9s  %-18s  %6s  %10s"):format("name", "dtype", "shape", "chunks", "bytes")
  for _, n in ipairs(names) do
    local e = ck:entry(n)
    local b = 0
    for _, c in ipairs(e.chunks) do b = b + c.nbytes end
    lines[#lines + 1] = ("  %-" .. w .. "s  %-9s  %-18s  %6d  %10s"):format(n, e.dtype, "[" .. table.concat(e.shape, ", ") .. "]",
      #e.chunks, human(b))
  end
end

-- A human summary of a step folder, a folder of step folders, or an HF folder.
function M.inspect(dir)
  local lines = {}
  local kind = fs.size(dir)
  if kind == nil then error("checkpoint: " .. dir .. " does not exist", 0) end
  if kind ~= "dir" then error("checkpoint: " .. dir .. " is not a folder", 0) end
  local is_hf = fs.exists(fs.join(dir, "model.safetensors")) or fs.exists(fs.join(dir, "model.safetensors.index.json"))
  if format.is_complete(dir) or fs.exists(fs.join(dir, format.METADATA)) or fs.exists(fs.join(dir, format.data_file(0))) then
    describe_step(dir, lines)
  elseif is_hf then
    local files = {}
    for _, name in ipairs(fs.list(dir)) do
      if name:match("%.safetensors$") then files[#files + 1] = name end
    end
    lines[#lines + 1] = ("%s: Hugging Face folder, %d safetensors file(s)"):format(dir, #files)
    for _, name in ipairs(files) do
      local f = M.safetensors.open(fs.join(dir, name))
      for _, n in ipairs(f:names()) do
        local e = f:entry(n)
        lines[#lines + 1] = ("  %-48s %-5s [%s]  %s"):format(n, e.dtype, table.concat(e.shape, ", "), name)
      end
    end
  else
    local steps = format.list_steps(dir)
    local latest
    for _, s in ipairs(steps) do
      lines[#lines + 1] = ("step %d: %s (%s)"):format(s.step, s.complete and "complete" or "INCOMPLETE, ignored at load", s.dir)
      if s.complete then latest = s end
    end
    for _, name in ipairs(fs.list(dir)) do
      local n = name:match("^%.step%-(%d+)%.tmp%-%d+$")
      if n then lines[#lines + 1] = ("step %s: interrupted or in-progress save, never loaded (%s)"):format(n, fs.join(dir, name)) end
    end
    if #lines == 0 then error("checkpoint: " .. dir .. " holds no step-N folders, metadata or safetensors", 0) end
    if latest then
      lines[#lines + 1] = ""
      describe_step(latest.dir, lines)
    end
  end
  return table.concat(lines, "\n")
end

-- Read every chunk of every tensor once and check its CRC-32C, and that no
-- float holds a NaN or an infinity (a checksum only says the bytes are the
-- ones saved). Returns the number of chunks.
function M.verify(dir)
  local ck = format.open(dir)
  ck:check_files()
  local n, bad, count = 0, {}, ffi.new("int64_t[1]")
  for _, name in ipairs(ck:names()) do
    local e, k = ck:entry(name), 0
    for _, c in ipairs(e.chunks) do
      if C.tt_ckpt_verify_values(fs.join(dir, c.file), c.byte_offset, c.nbytes, c.crc, e.dtype_id, count, name) ~= 0
      then
        error(ffi.string(C.tt_last_error()), 0)
      end
      k = k + tonumber(count[0])
      n = n + 1
    end
    if k > 0 then bad[#bad + 1] = ("%s (%d of %d values)"):format(name, k, require("titan.checkpoint.layout").volume(e.shape)) end
  end
  if #bad > 0 then
    error(("checkpoint: %s holds NaN or inf values in %d tensor(s): %s%s; its checksums match (they were saved "
      .. "so): resume from an earlier step"):format(dir, #bad, table.concat(bad, ", ", 1, math.min(3, #bad)),
      #bad > 3 and ", ..." or ""), 0)
  end
  return n
end

-- ---- signals -----------------------------------------------------------------------

local SIGNAMES = { [2] = "SIGINT", [15] = "SIGTERM" }

-- SIGTERM/SIGINT set a flag instead of killing the process (a second one
-- kills as usual); poll it at step boundaries, save, and stop.
function M.install_signal_handlers()
  if C.tt_signal_install() ~= 0 then error(ffi.string(C.tt_last_error()), 0) end
end

-- "SIGTERM" / "SIGINT" (or "signal N") when one arrived, else nil; second value: the number.
function M.signal_pending()
  local s = C.tt_signal_pending()
  if s == 0 then return nil end
  return SIGNAMES[s] or ("signal " .. s), s
end

function M.clear_signal() C.tt_signal_clear() end

return M
