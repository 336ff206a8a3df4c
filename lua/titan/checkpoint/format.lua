-- checkpoint/format.lua — the on-disk format (docs/checkpoint_format.md):
-- one folder per step; per rank one data file with its chunks of every
-- tensor; metadata.json listing each tensor's global shape, dtype and
-- chunks (global box, file, byte offset, size, CRC-32C); COMPLETE written
-- last, then the temporary folder is renamed into place.
--
-- Writing: w = format.writer(tmp, rank, {async}); w:add(item)...; w:start();
-- part = w:finish(); meta = format.metadata({part, ...}, info);
-- format.commit(tmp, final, meta). Reading: ck = format.open(dir);
-- reads = ck:plan(name, want); ck:read(name, reads, dst).
local tffi = require("titan.ffi")
local tensor = require("titan.tensor")
local json = require("titan.checkpoint.json")
local layout = require("titan.checkpoint.layout")
local fs = require("titan.checkpoint.fs")
local ffi, C = tffi.ffi, tffi.C

-- Engine failures become one-line errors (no Lua position: they name the file).
local function check(st)
  if st ~= 0 then error(ffi.string(C.tt_last_error()), 0) end
end

local M = {}

M.FORMAT = "titan-checkpoint"
M.VERSION = 1
M.METADATA = "metadata.json"
M.MARKER = "COMPLETE"

local shape_str = tensor.shape_str

function M.data_file(rank) return ("rank-%d.bin"):format(rank) end
function M.step_dir(folder, step) return fs.join(folder, ("step-%d"):format(step)) end

local function fail(fmt, ...) error(("checkpoint: " .. fmt):format(...), 0) end

local function copy_list(t)
  local out = json.array({})
  for i = 1, #t do out[i] = t[i] end
  return out
end

local function i64s(t)
  local a = ffi.new("int64_t[?]", math.max(#t, 1))
  for i = 1, #t do a[i - 1] = t[i] end
  return a
end

-- ---- writing -------------------------------------------------------------------

local Writer = {}
Writer.__index = Writer

-- A rank's data file inside folder `dir`. opts.async: the bytes are written
-- by a background thread (tensors are snapshotted to host memory by add).
function M.writer(dir, rank, opts)
  opts = opts or {}
  local file = M.data_file(rank)
  local wp = ffi.new("tt_ckpt_writer*[1]")
  check(C.tt_ckpt_writer_open(fs.join(dir, file), rank, wp))
  return setmetatable({ c = ffi.gc(wp[0], C.tt_ckpt_writer_free), file = file, rank = rank, async = opts.async,
    chunks = {} }, Writer)
end

local off_p, nb_p = ffi.new("uint64_t[1]"), ffi.new("uint64_t[1]")

-- item: { name, tensor, dtype (stored dtype name; default the tensor's),
-- global_shape (default the tensor's shape), offset (0-based, default 0s) }.
function Writer:add(item)
  local t = item.tensor
  local shape = t:shape()
  local dt = item.dtype and tensor.dtype_of(item.dtype) or t:ptr().dtype
  check(C.tt_ckpt_writer_add(self.c, t:ptr(), dt, self.async and 1 or 0, off_p, nb_p))
  local offset = item.offset or {}
  if not item.offset then for d = 1, #shape do offset[d] = 0 end end
  self.chunks[#self.chunks + 1] = {
    name = item.name, dtype = tensor.dtype_name(dt), global_shape = item.global_shape or shape,
    offset = offset, size = shape, file = self.file, byte_offset = tonumber(off_p[0]), nbytes = tonumber(nb_p[0]),
  }
end

function Writer:start() check(C.tt_ckpt_writer_start(self.c, self.async and 1 or 0)) end
function Writer:done() return C.tt_ckpt_writer_done(self.c) ~= 0 end

-- Waits for the bytes; returns this rank's part of the metadata:
-- { file, rank, size, chunks = { {name, dtype, global_shape, offset, size, byte_offset, nbytes, crc32c} } }.
function Writer:finish()
  local st = C.tt_ckpt_writer_wait(self.c)
  local part
  if st == 0 then
    for i, ch in ipairs(self.chunks) do ch.crc32c = ("%08x"):format(C.tt_ckpt_writer_crc(self.c, i - 1)) end
    part = { file = self.file, rank = self.rank, size = tonumber(C.tt_ckpt_writer_size(self.c)), chunks = self.chunks }
  end
  local c = self.c
  ffi.gc(c, nil)
  C.tt_ckpt_writer_free(c)
  self.c = nil
  check(st)
  return part
end

-- Drop the writer (joins its thread); nothing is committed.
function Writer:abort()
  if self.c then
    local c = self.c
    ffi.gc(c, nil)
    C.tt_ckpt_writer_free(c)
    self.c = nil
  end
end

-- Every rank's part + { step, model_only, train_state } -> the metadata table.
function M.metadata(parts, info)
  local tensors, files = {}, {}
  for _, part in ipairs(parts) do
    files[part.file] = { rank = part.rank, size = part.size, chunks = #part.chunks }
    for _, ch in ipairs(part.chunks) do
      local e = tensors[ch.name]
      if not e then
        e = { dtype = ch.dtype, shape = copy_list(ch.global_shape), chunks = json.array({}) }
        tensors[ch.name] = e
      elseif e.dtype ~= ch.dtype or shape_str(e.shape) ~= shape_str(ch.global_shape) then
        fail("tensor %s is saved as %s %s by one rank and %s %s by another", ch.name, e.dtype, shape_str(e.shape),
          ch.dtype, shape_str(ch.global_shape))
      end
      e.chunks[#e.chunks + 1] = { offset = copy_list(ch.offset), size = copy_list(ch.size), file = ch.file,
        byte_offset = ch.byte_offset, nbytes = ch.nbytes, crc32c = ch.crc32c }
    end
  end
  for _, e in pairs(tensors) do
    table.sort(e.chunks, function(a, b)
      for d = 1, #a.offset do
        if a.offset[d] ~= b.offset[d] then return a.offset[d] < b.offset[d] end
      end
      return false
    end)
  end
  return {
    format = M.FORMAT, version = M.VERSION, step = info.step, world_size = #parts,
    titan_version = ffi.string(C.tt_version()), model_only = info.model_only and true or false,
    files = files, tensors = tensors, train_state = info.train_state or {},
  }
end

-- metadata.json, then COMPLETE, fsync'ed; then tmp is renamed to final
-- (swapped with it, when final exists, and the old one removed).
function M.commit(tmp, final, meta)
  fs.write_file(fs.join(tmp, M.METADATA), json.encode(meta, 1) .. "\n")
  fs.write_file(fs.join(tmp, M.MARKER), json.encode({ step = meta.step, format = M.FORMAT, version = M.VERSION }) .. "\n")
  fs.sync_dir(tmp)
  if fs.exists(final) then
    fs.exchange(tmp, final)
    fs.sync_dir(fs.dirname(final))
    fs.remove_all(tmp)
  else
    fs.rename(tmp, final)
  end
  fs.sync_dir(fs.dirname(final))
end

-- A whole checkpoint from in-process ranks: ranks[r + 1] = items of rank r
-- (a box held by several ranks is written once, by the lowest). Written to
-- a temporary folder beside `dir`, then renamed to `dir`.
function M.write(dir, ranks, info)
  local parent = fs.dirname(dir)
  fs.mkdirs(parent)
  local tmp = fs.join(parent, ("." .. fs.basename(dir) .. ".tmp-%d"):format(fs.pid()))
  if fs.exists(tmp) then fs.remove_all(tmp) end
  fs.mkdirs(tmp)
  local plans = {}
  for r = 1, #ranks do
    plans[r] = {}
    for i, it in ipairs(ranks[r]) do
      local shape = it.tensor:shape()
      local off = it.offset
      if not off then
        off = {}
        for d = 1, #shape do off[d] = 0 end
      end
      plans[r][i] = { name = it.name, offset = off, size = shape }
    end
  end
  local keep = layout.dedup(plans)
  local parts = {}
  -- (a failure part-way, a full disk: no temporary folder is left behind)
  local ok, err = pcall(function()
    for r = 1, #ranks do
      local w = M.writer(tmp, r - 1, {})
      for i, it in ipairs(ranks[r]) do
        if keep[r][i] then w:add(it) end
      end
      w:start()
      parts[r] = w:finish()
    end
    M.commit(tmp, dir, M.metadata(parts, info or {}))
  end)
  if not ok then
    pcall(fs.remove_all, tmp)
    error(err, 0)
  end
end

-- ---- finding step folders --------------------------------------------------------

function M.is_complete(dir) return fs.size(fs.join(dir, M.MARKER)) ~= nil end

-- Step folders in `folder`, sorted by step: { step, dir, complete }.
function M.list_steps(folder)
  local out = {}
  if not fs.is_dir(folder) then return out end
  for _, name in ipairs(fs.list(folder)) do
    local n = name:match("^step%-(%d+)$")
    if n then
      local dir = fs.join(folder, name)
      if fs.is_dir(dir) then out[#out + 1] = { step = tonumber(n), dir = dir, complete = M.is_complete(dir) } end
    end
  end
  table.sort(out, function(a, b) return a.step < b.step end)
  return out
end

-- ---- reading ------------------------------------------------------------------------

local Checkpoint = {}
Checkpoint.__index = Checkpoint
M.Checkpoint = Checkpoint

local function is_int_list(t, n)
  if type(t) ~= "table" or (n and #t ~= n) then return false end
  for i = 1, #t do
    if type(t[i]) ~= "number" or t[i] ~= math.floor(t[i]) or t[i] < 0 then return false end
  end
  return true
end

-- Validate metadata against itself: one line naming what is wrong.
local function validate(dir, meta)
  local where = fs.join(dir, M.METADATA)
  if type(meta) ~= "table" or meta.format ~= M.FORMAT then
    fail("%s is not titan checkpoint metadata (format field is %s)", where, tostring(type(meta) == "table" and meta.format))
  end
  if type(meta.version) ~= "number" or meta.version > M.VERSION then
    fail("%s has format version %s; this titan reads version %d and older (upgrade titan)", where,
      tostring(meta.version), M.VERSION)
  end
  if type(meta.tensors) ~= "table" or type(meta.files) ~= "table" then fail("%s lists no tensors or files", where) end
  for name, e in pairs(meta.tensors) do
    local ok, dt = pcall(tensor.dtype_of, e.dtype)
    if not ok then fail("%s: tensor %s has an unknown dtype '%s'", where, name, tostring(e.dtype)) end
    e.dtype_id = dt
    if not is_int_list(e.shape) then fail("%s: tensor %s has a malformed shape", where, name) end
    if type(e.chunks) ~= "table" or #e.chunks == 0 then fail("%s: tensor %s has no chunks", where, name) end
    local es = tonumber(C.tt_dtype_size(dt))
    local vol = 0
    for i, c in ipairs(e.chunks) do
      if not is_int_list(c.offset, #e.shape) or not is_int_list(c.size, #e.shape)
        or not layout.inside(c.offset, c.size, e.shape) then
        fail("%s: tensor %s chunk %d lies outside its shape %s", where, name, i, shape_str(e.shape))
      end
      if type(c.byte_offset) ~= "number" or c.nbytes ~= layout.volume(c.size) * es then
        fail("%s: tensor %s chunk %d says %s bytes but %s %s holds %d", where, name, i, tostring(c.nbytes),
          e.dtype, shape_str(c.size), layout.volume(c.size) * es)
      end
      local f = meta.files[c.file]
      if type(f) ~= "table" or type(f.size) ~= "number" then
        fail("%s: tensor %s chunk %d names file %s, which metadata does not list", where, name, i, tostring(c.file))
      end
      if c.byte_offset + c.nbytes > f.size then
        fail("%s: tensor %s chunk %d ends at byte %d, past the end of %s (%d bytes)", where, name, i,
          c.byte_offset + c.nbytes, c.file, f.size)
      end
      local crc = type(c.crc32c) == "string" and tonumber(c.crc32c, 16)
      if not crc then fail("%s: tensor %s chunk %d has no crc32c", where, name, i) end
      c.crc = crc
      vol = vol + layout.volume(c.size)
    end
    if vol ~= layout.volume(e.shape) then
      fail("%s: the chunks of tensor %s hold %d elements, its shape %s has %d (overlapping or missing chunks)", where,
        name, vol, shape_str(e.shape), layout.volume(e.shape))
    end
  end
end

-- Open a complete step folder (metadata validated, nothing read yet).
function M.open(dir)
  local kind = fs.size(dir)
  if kind == nil then fail("%s does not exist", dir) end
  if kind ~= "dir" then fail("%s is not a folder", dir) end
  if not M.is_complete(dir) then
    fail("%s is incomplete (no %s marker: an interrupted save); it cannot be loaded", dir, M.MARKER)
  end
  local text = fs.read_file(fs.join(dir, M.METADATA))
  if not text then fail("%s has no %s", dir, M.METADATA) end
  local meta = json.decode(text, "checkpoint: " .. fs.join(dir, M.METADATA))
  validate(dir, meta)
  -- (a step folder renamed or copied over another: loading it as its name
  -- says would resume the wrong step, and the next save would overwrite)
  local named = tonumber(fs.basename(dir):match("^step%-(%d+)$"))
  if named and named ~= meta.step then
    fail("%s holds step %s by its metadata: a step folder renamed or copied; expected step-%s", dir,
      tostring(meta.step), tostring(meta.step))
  end
  return setmetatable({ dir = dir, meta = meta, step = meta.step, verified = {}, files_checked = {} }, Checkpoint)
end

function Checkpoint:names()
  local out = {}
  for name in pairs(self.meta.tensors) do out[#out + 1] = name end
  table.sort(out)
  return out
end

function Checkpoint:has(name) return self.meta.tensors[name] ~= nil end
function Checkpoint:entry(name) return self.meta.tensors[name] end

-- The data files behind `names` (default all) against the metadata: magic,
-- version, and the size on disk. The first tensor stored in a bad file is
-- named in the error.
function Checkpoint:check_files(names)
  local first = {}
  for _, name in ipairs(names or self:names()) do
    for _, c in ipairs(self.meta.tensors[name].chunks) do
      local f = first[c.file]
      if not f or c.byte_offset + c.nbytes > f.byte_offset + f.nbytes then
        -- remember the chunk reaching furthest: it is the first to be cut by truncation
        first[c.file] = { name = name, byte_offset = c.byte_offset, nbytes = c.nbytes }
      end
    end
  end
  local version, rank, n = ffi.new("uint32_t[1]"), ffi.new("uint32_t[1]"), ffi.new("uint64_t[1]")
  local size_field, actual = ffi.new("uint64_t[1]"), ffi.new("uint64_t[1]")
  local files = {}
  for file in pairs(first) do files[#files + 1] = file end
  table.sort(files)
  for _, file in ipairs(files) do
    if not self.files_checked[file] then
      local path = fs.join(self.dir, file)
      local want = self.meta.files[file].size
      local who = first[file]
      if C.tt_ckpt_file_header(path, version, rank, n, size_field, actual) ~= 0 then
        fail("%s (tensor %s)", (ffi.string(C.tt_last_error()):gsub("^checkpoint: ", "")), who.name)
      end
      local got = tonumber(actual[0])
      if got ~= want then
        fail("%s is %d bytes but %s says %d (%s; tensor %s)", path, got, M.METADATA, want,
          got < want and "truncated" or "the file does not match its metadata", who.name)
      end
      if tonumber(size_field[0]) ~= want or version[0] > M.VERSION then
        fail("%s has a header that disagrees with %s (size %d, version %d; tensor %s)", path, M.METADATA,
          tonumber(size_field[0]), version[0], who.name)
      end
      self.files_checked[file] = true
    end
  end
end

-- The reads filling `want` = { global_shape, offset (0-based), size } of
-- tensor `name`; errors name the tensor and what differs.
function Checkpoint:plan(name, want)
  local e = self.meta.tensors[name]
  if not e then fail("%s has no tensor %s (a checkpoint of another model?)", self.dir, name) end
  if shape_str(e.shape) ~= shape_str(want.global_shape) then
    fail("%s: tensor %s has shape %s in the checkpoint but %s here (a checkpoint of another model shape?)", self.dir,
      name, shape_str(e.shape), shape_str(want.global_shape))
  end
  local reads, covered = layout.plan_reads(e.chunks, want.offset, want.size)
  local need = layout.volume(want.size)
  if covered ~= need then
    fail("%s: tensor %s: the stored chunks cover %d of the %d elements wanted at %s", self.dir, name, covered, need,
      shape_str(want.offset))
  end
  return reads
end

-- Execute reads into dst (any dtype/device: converted on the way). Each
-- chunk's checksum is checked once: during the read when it is read whole,
-- else by one streamed pass first. opts.verify = false skips checksums.
function Checkpoint:read(name, reads, dst, opts)
  local e = self.meta.tensors[name]
  local verify = not (opts and opts.verify == false)
  local dptr = dst:ptr()
  for _, r in ipairs(reads) do
    local c = r.chunk
    local path = fs.join(self.dir, c.file)
    local check_now = 0
    if verify and not self.verified[c] then
      if r.whole then
        check_now = 1
      else
        check(C.tt_ckpt_verify(path, c.byte_offset, c.nbytes, c.crc, name))
      end
      self.verified[c] = true
    end
    check(C.tt_ckpt_read(path, c.byte_offset, e.dtype_id, #e.shape, i64s(c.size), i64s(r.start), i64s(r.count), dptr,
      i64s(r.dst), check_now, c.crc, name))
  end
end

-- Read tensor `name` whole into a new tensor (dtype: stored, or opts.dtype).
function Checkpoint:load_tensor(name, opts)
  opts = opts or {}
  local e = self.meta.tensors[name]
  if not e then fail("%s has no tensor %s", self.dir, name) end
  local zeros = {}
  for d = 1, #e.shape do zeros[d] = 0 end
  local reads = self:plan(name, { global_shape = e.shape, offset = zeros, size = e.shape })
  local t = tensor.empty(e.shape, { dtype = opts.dtype or e.dtype, device = opts.device })
  self:read(name, reads, t, opts)
  return t
end

return M
