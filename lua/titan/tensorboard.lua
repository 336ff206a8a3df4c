-- tensorboard.lua — TensorBoard event files (metrics.enable_tensorboard):
-- the scalars of each logged step, written as TensorFlow's event files so
-- `tensorboard --logdir <dump_folder>/tb` plots them. No TensorFlow or
-- protobuf library: the format is small.
--
-- A file is a sequence of records:
--   uint64 length, uint32 masked_crc32c(length bytes), data, uint32 masked_crc32c(data)
-- (little-endian; masked crc = rotate right by 15, plus 0xa282ead8), each
-- record an Event protocol buffer: wall_time (1, double), step (2, int64),
-- file_version (3, string; the first record says "brain.Event:2"),
-- summary (5) holding Values of tag (1, string) and simple_value (2, float).
--
--   local w = tensorboard.Writer("/run/tb/20261205-0130")
--   w:scalars(10, { ["loss_metrics/global_avg_loss"] = 3.2, lr = 3e-4 })
--   w:close()
--   tensorboard.read(w.path)   -- { {wall_time, step, file_version | values = {tag = value}}, ... }
local ffi = require("ffi")
local bit = require("bit")

local M = {}

-- CRC-32C (Castagnoli, reflected polynomial 0x82f63b78), a table a byte.
local crc_table = {}
for i = 0, 255 do
  local c = i
  for _ = 1, 8 do
    if bit.band(c, 1) ~= 0 then c = bit.bxor(bit.rshift(c, 1), 0x82f63b78) else c = bit.rshift(c, 1) end
  end
  crc_table[i] = c
end

-- The CRC-32C of a string, as a number in [0, 2^32).
function M.crc32c(s)
  local c = bit.bnot(0)
  for i = 1, #s do
    c = bit.bxor(crc_table[bit.band(bit.bxor(c, s:byte(i)), 0xff)], bit.rshift(c, 8))
  end
  c = bit.bnot(c)
  return c < 0 and c + 2 ^ 32 or c
end

local function masked_crc(s)
  local c = M.crc32c(s)
  local r = bit.bor(bit.rshift(c, 15), bit.lshift(c, 17))
  return (r + 0xa282ead8) % 2 ^ 32
end

-- ---- little-endian fields and protocol-buffer encoding ----------------------------------------

local u32 = ffi.new("uint32_t[1]")
local u64 = ffi.new("uint64_t[1]")
local f32 = ffi.new("float[1]")
local f64 = ffi.new("double[1]")
local little = ffi.abi("le")

local function bytes_of(cdata, n)
  local s = ffi.string(cdata, n)
  return little and s or s:reverse()
end

local function fixed32(v) u32[0] = v; return bytes_of(u32, 4) end
local function fixed64(v) u64[0] = v; return bytes_of(u64, 8) end

local function varint(n) -- n: a non-negative integer below 2^53
  local out = {}
  repeat
    local b = n % 128
    n = (n - b) / 128
    out[#out + 1] = string.char(n > 0 and b + 128 or b)
  until n == 0
  return table.concat(out)
end

local function key(field, wire) return varint(field * 8 + wire) end
local function len_field(field, s) return key(field, 2) .. varint(#s) .. s end
local function double_field(field, v) f64[0] = v; return key(field, 1) .. bytes_of(f64, 8) end
local function float_field(field, v) f32[0] = v; return key(field, 5) .. bytes_of(f32, 4) end

-- The bytes of one Event: ev = { wall_time, step, file_version | values = { {tag, value}, ... } }.
function M.encode_event(ev)
  local parts = { double_field(1, ev.wall_time) }
  if ev.step and ev.step ~= 0 then parts[#parts + 1] = key(2, 0) .. varint(ev.step) end
  if ev.file_version then parts[#parts + 1] = len_field(3, ev.file_version) end
  if ev.values then
    local vals = {}
    for i, tv in ipairs(ev.values) do vals[i] = len_field(1, len_field(1, tv[1]) .. float_field(2, tv[2])) end
    parts[#parts + 1] = len_field(5, table.concat(vals))
  end
  return table.concat(parts)
end

-- One framed record of the file.
function M.record(data)
  local len = fixed64(#data)
  return len .. fixed32(masked_crc(len)) .. data .. fixed32(masked_crc(data))
end

-- ---- the writer ---------------------------------------------------------------------------------

local Writer = {}
Writer.__index = Writer

local function hostname()
  local f = io.open("/proc/sys/kernel/hostname")
  local h = f and f:read("*l")
  if f then f:close() end
  return (h and h ~= "") and h or "localhost"
end

-- A new event file in `folder` (which must exist): events.out.tfevents.<time>.<host>.<n>,
-- never one already there. opts.now: seconds since the epoch (default os.time,
-- with the monotonic clock's fraction).
function M.Writer(folder, opts)
  opts = opts or {}
  local clock = require("titan.clock")
  local t0, c0 = os.time(), clock.now()
  local now = opts.now or function() return t0 + (clock.now() - c0) end
  local base = ("%s/events.out.tfevents.%d.%s"):format(folder, t0, hostname())
  local path
  for n = 0, 999 do
    local p = ("%s.%d"):format(base, n)
    local f = io.open(p, "r")
    if not f then path = p break end
    f:close()
  end
  if not path then error("tensorboard: no free event file name in " .. folder, 0) end
  local f, err = io.open(path, "wb")
  if not f then error(("tensorboard: cannot create %s: %s"):format(path, tostring(err)), 0) end
  local self = setmetatable({ path = path, file = f, now = now }, Writer)
  self:write({ wall_time = now(), file_version = "brain.Event:2" })
  return self
end

function Writer:write(ev)
  if not self.file then error("tensorboard: write after close of " .. self.path, 2) end
  -- (checked: a full disk stops the job with one line; a crashed run keeps what it logged)
  local ok, err = self.file:write(M.record(M.encode_event(ev)))
  if ok then ok, err = self.file:flush() end
  if not ok then error(("tensorboard: cannot write %s: %s"):format(self.path, tostring(err)), 0) end
end

-- The scalars of one step: values = { tag = number, ... } (written in tag
-- order; non-finite values are kept: TensorBoard shows NaN and inf).
function Writer:scalars(step, values)
  local tags = {}
  for tag, v in pairs(values) do
    if type(v) == "number" then tags[#tags + 1] = tag end
  end
  if #tags == 0 then return end
  table.sort(tags)
  local list = {}
  for i, tag in ipairs(tags) do list[i] = { tag, values[tag] } end
  self:write({ wall_time = self.now(), step = step, values = list })
end

function Writer:close()
  if self.file then self.file:close(); self.file = nil end
end

-- ---- the reader (for tests and inspection) ------------------------------------------------------

local function le_number(s, i, n) -- unsigned little-endian n bytes at i
  local v = 0
  for k = n - 1, 0, -1 do v = v * 256 + s:byte(i + k) end
  return v
end

local function read_varint(s, i)
  local v, mul = 0, 1
  while true do
    local b = s:byte(i)
    if not b then error("tensorboard: truncated varint", 0) end
    v, i, mul = v + (b % 128) * mul, i + 1, mul * 128
    if b < 128 then return v, i end
  end
end

local function fields(s) -- field number -> list of raw values (numbers or strings)
  local out, i = {}, 1
  while i <= #s do
    local k
    k, i = read_varint(s, i)
    local field, wire = math.floor(k / 8), k % 8
    local v
    if wire == 0 then v, i = read_varint(s, i)
    elseif wire == 1 then v, i = s:sub(i, i + 7), i + 8
    elseif wire == 5 then v, i = s:sub(i, i + 3), i + 4
    elseif wire == 2 then
      local n
      n, i = read_varint(s, i)
      v, i = s:sub(i, i + n - 1), i + n
    else error(("tensorboard: wire type %d of field %d is not used by events"):format(wire, field), 0) end
    out[field] = out[field] or {}
    table.insert(out[field], v)
  end
  return out
end

local function as(box, raw)
  ffi.copy(box, little and raw or raw:reverse(), #raw)
  return tonumber(box[0])
end

-- Every event of a file, checked record by record: a list of
-- { wall_time, step, file_version, values = { tag = value } }.
function M.read(path)
  local f, err = io.open(path, "rb")
  if not f then error(("tensorboard: cannot open %s: %s"):format(path, tostring(err)), 0) end
  local s = f:read("*a")
  f:close()
  local events, i = {}, 1
  while i <= #s do
    local n = #events + 1
    if i + 11 > #s then error(("tensorboard: %s: record %d is truncated (its header)"):format(path, n), 0) end
    local lenb = s:sub(i, i + 7)
    if le_number(s, i + 8, 4) ~= masked_crc(lenb) then
      error(("tensorboard: %s: record %d: the length's CRC does not match"):format(path, n), 0)
    end
    local len = le_number(s, i, 8)
    local data = s:sub(i + 12, i + 11 + len)
    if #data < len or i + 15 + len > #s then
      error(("tensorboard: %s: record %d is truncated (%d data bytes expected)"):format(path, n, len), 0)
    end
    if le_number(s, i + 12 + len, 4) ~= masked_crc(data) then
      error(("tensorboard: %s: record %d: the data's CRC does not match"):format(path, n), 0)
    end
    i = i + 16 + len
    local fl = fields(data)
    local ev = { wall_time = fl[1] and as(f64, fl[1][1]), step = fl[2] and fl[2][1] or 0,
      file_version = fl[3] and fl[3][1] }
    if fl[5] then
      ev.values = {}
      for _, vs in ipairs(fields(fl[5][1])[1] or {}) do
        local vf = fields(vs)
        ev.values[vf[1][1]] = vf[2] and as(f32, vf[2][1])
      end
    end
    events[n] = ev
  end
  return events
end

return M
