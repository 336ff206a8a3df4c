-- checkpoint/safetensors.lua — read and write Hugging Face safetensors
-- files: the JSON header is built and parsed here, the bytes move in C
-- (tt_safetensors_write, tt_ckpt_read).
--
--   safetensors.write(path, { {name, tensor}, ... }, { format = "pt" })
--   local f = safetensors.open(path); f:names(); f:entry(name) -> {dtype, shape}
--   f:read(name, dst[, box])      -- into any dtype/device (converted on the way)
local tffi = require("titan.ffi")
local tensor = require("titan.tensor")
local json = require("titan.checkpoint.json")
local layout = require("titan.checkpoint.layout")
local ffi, C = tffi.ffi, tffi.C

local M = {}

local function check(st)
  if st ~= 0 then error(ffi.string(C.tt_last_error()), 0) end
end

local function fail(fmt, ...) error(("safetensors: " .. fmt):format(...), 0) end

-- safetensors dtype names <-> ours.
M.to_st = { float32 = "F32", float64 = "F64", bfloat16 = "BF16", float16 = "F16", int32 = "I32", int64 = "I64",
  uint8 = "U8", bool = "BOOL", float8_e4m3fn = "F8_E4M3", float8_e5m2 = "F8_E5M2" }
M.from_st = {}
for k, v in pairs(M.to_st) do M.from_st[v] = k end

-- entries: ordered { {name, tensor}, ... } (any dtype, strides, device; the
-- packed bytes of each tensor are written). opts.metadata: string map for
-- __metadata__; opts.shapes[name]: the shape to record when it differs
-- from the tensor's (a permuted view written as the 2-D weight it packs to).
function M.write(path, entries, opts)
  opts = opts or {}
  local header = { __metadata__ = opts.metadata or { format = "pt" } }
  local ts = ffi.new("tt_tensor*[?]", math.max(#entries, 1))
  local pos = 0
  for i, e in ipairs(entries) do
    local name, t = e[1], e[2]
    local st = M.to_st[t:dtype()]
    if not st then fail("%s: tensor %s has dtype %s, which safetensors cannot hold", path, name, t:dtype()) end
    if header[name] then fail("%s: tensor %s is listed twice", path, name) end
    local shape = (opts.shapes and opts.shapes[name]) or t:shape()
    if layout.volume(shape) ~= t:numel() then fail("%s: tensor %s: shape does not match its elements", path, name) end
    local n = t:nbytes()
    header[name] = { dtype = st, shape = json.array(shape), data_offsets = json.array({ pos, pos + n }) }
    pos = pos + n
    ts[i - 1] = t:ptr()
  end
  local text = json.encode(header)
  check(C.tt_safetensors_write(path, text, #text, #entries, ts))
end

local File = {}
File.__index = File

function M.open(path)
  local len, start = ffi.new("size_t[1]"), ffi.new("uint64_t[1]")
  check(C.tt_safetensors_header(path, nil, 0, len, start))
  local n = tonumber(len[0])
  local buf = ffi.new("char[?]", n + 1)
  check(C.tt_safetensors_header(path, buf, n + 1, len, start))
  local header = json.decode(ffi.string(buf, n), "safetensors: the header of " .. path)
  local size = tonumber(C.tt_fs_size(path))
  local data_start = tonumber(start[0])
  if type(header) ~= "table" then fail("%s: the header is not a JSON object", path) end
  for name, e in pairs(header) do
    if name ~= "__metadata__" then
      local dt = type(e) == "table" and M.from_st[e.dtype]
      if not dt then fail("%s: tensor %s has an unsupported dtype %s", path, name, tostring(type(e) == "table" and e.dtype)) end
      e.our_dtype = dt
      local off = e.data_offsets
      if type(e.shape) ~= "table" or type(off) ~= "table" or type(off[1]) ~= "number" or type(off[2]) ~= "number" then
        fail("%s: tensor %s has a malformed entry", path, name)
      end
      local want = layout.volume(e.shape) * tonumber(C.tt_dtype_size(tensor.dtype_of(dt)))
      if off[2] - off[1] ~= want then
        fail("%s: tensor %s spans %d bytes but %s %s needs %d", path, name, off[2] - off[1], e.dtype,
          tensor.shape_str(e.shape), want)
      end
      if data_start + off[2] > size then
        fail("%s is truncated: tensor %s ends at byte %d, the file has %d", path, name, data_start + off[2], size)
      end
    end
  end
  return setmetatable({ path = path, header = header, data_start = data_start }, File)
end

function File:names()
  local out = {}
  for name in pairs(self.header) do
    if name ~= "__metadata__" then out[#out + 1] = name end
  end
  table.sort(out)
  return out
end

function File:entry(name) return name ~= "__metadata__" and self.header[name] or nil end

local function i64s(t)
  local a = ffi.new("int64_t[?]", math.max(#t, 1))
  for i = 1, #t do a[i - 1] = t[i] end
  return a
end

-- Copy tensor `name` (or the box {start, count} of it, into dst at
-- dst_start) into dst. opts.shape: read the stored bytes as this shape
-- (same element count), e.g. [H, 2, hd/2, in] to land in a permuted view.
function File:read(name, dst, opts)
  opts = opts or {}
  local e = self:entry(name)
  if not e then fail("%s has no tensor %s", self.path, name) end
  local shape = opts.shape or e.shape
  if layout.volume(shape) ~= layout.volume(e.shape) then fail("%s: tensor %s: bad reinterpretation", self.path, name) end
  local start, count, at = opts.start, opts.count or shape, opts.dst_start
  if not start then
    start, at = {}, {}
    for d = 1, #shape do start[d], at[d] = 0, 0 end
  end
  if tensor.shape_str(count) ~= tensor.shape_str(dst:shape()) and not opts.count then
    fail("%s: tensor %s has shape %s, the destination %s", self.path, name, tensor.shape_str(shape),
      tensor.shape_str(dst:shape()))
  end
  check(C.tt_ckpt_read(self.path, self.data_start + e.data_offsets[1], tensor.dtype_of(e.our_dtype), #shape,
    i64s(shape), i64s(start), i64s(count), dst:ptr(), i64s(at), 0, 0, name))
end

return M
