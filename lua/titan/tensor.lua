-- tensor.lua — the tensor face: a Lua object around a C tt_tensor*, with
-- creation functions, shape queries, views, copies and printing. The
-- differentiable operators (+, @, sum, ...) are attached by functional.lua.
local tffi = require("titan.ffi")
local memory = require("titan.memory")
local ffi, C, check = tffi.ffi, tffi.C, tffi.check

local Tensor = {}
Tensor.__index = Tensor

local M = { Tensor = Tensor }

-- ---- dtypes and devices -------------------------------------------------

local dtypes = {
  float32 = C.TT_F32, f32 = C.TT_F32, float = C.TT_F32,
  float64 = C.TT_F64, f64 = C.TT_F64, double = C.TT_F64,
  bfloat16 = C.TT_BF16, bf16 = C.TT_BF16,
  float16 = C.TT_F16, f16 = C.TT_F16, half = C.TT_F16,
  int32 = C.TT_I32, i32 = C.TT_I32,
  int64 = C.TT_I64, i64 = C.TT_I64, long = C.TT_I64,
  uint8 = C.TT_U8, u8 = C.TT_U8,
  bool = C.TT_BOOL,
  float8_e4m3fn = C.TT_F8E4M3, f8e4m3 = C.TT_F8E4M3,
  float8_e5m2 = C.TT_F8E5M2, f8e5m2 = C.TT_F8E5M2,
}
M.dtypes = dtypes

function M.dtype_of(name)
  if name == nil then return C.TT_F32 end
  if type(name) == "number" then return name end
  local d = dtypes[name]
  if not d then
    local valid = {}
    for k in pairs(dtypes) do valid[#valid + 1] = k end
    table.sort(valid)
    error("unknown dtype '" .. tostring(name) .. "'; expected one of " .. table.concat(valid, ", "), 3)
  end
  return d
end

function M.dtype_name(d) return ffi.string(C.tt_dtype_name(d)) end

local device_t = ffi.typeof("tt_device")

-- "cuda" is this process's GPU: cuda:(local rank mod visible devices), the
-- local rank coming from the launcher (LOCAL_RANK as torchrun sets it, Open
-- MPI's OMPI_COMM_WORLD_LOCAL_RANK, Slurm's SLURM_LOCALID), so every rank of
-- a host lands on its own GPU, also when each rank sees only its own one.
-- M.set_default_cuda(n) overrides it.
local default_cuda
function M.local_cuda_index(getenv, count)
  local v = getenv("LOCAL_RANK") or getenv("OMPI_COMM_WORLD_LOCAL_RANK") or getenv("SLURM_LOCALID")
  local lr = tonumber(v or "0")
  if not lr or lr < 0 or lr % 1 ~= 0 then
    error(("the local rank '%s' (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK or SLURM_LOCALID) is not a number >= 0"):format(v), 0)
  end
  return count > 0 and lr % count or 0
end
local launcher_cuda -- read once: the launcher's variables do not change under a process
function M.default_cuda()
  if default_cuda then return default_cuda end
  launcher_cuda = launcher_cuda or M.local_cuda_index(os.getenv, C.tt_cuda_device_count())
  return launcher_cuda
end
function M.set_default_cuda(n) default_cuda = n end

function M.device_of(spec)
  if spec == nil or spec == "cpu" then return device_t(C.TT_CPU, 0) end
  if ffi.istype(device_t, spec) then return spec end
  if spec == "meta" then return device_t(C.TT_META, 0) end
  if spec == "cuda" then return device_t(C.TT_CUDA, M.default_cuda()) end
  local idx = type(spec) == "string" and spec:match("^cuda:(%d+)$")
  if idx then return device_t(C.TT_CUDA, tonumber(idx)) end
  error("unknown device '" .. tostring(spec) .. "'; expected cpu, meta, cuda or cuda:N", 3)
end

function M.device_name(dev)
  if dev.type == C.TT_CPU then return "cpu" end
  if dev.type == C.TT_META then return "meta" end
  return "cuda:" .. tonumber(dev.index)
end

-- ---- wrapping ------------------------------------------------------------

-- Take ownership of one reference to a C tensor.
local function wrap(ptr)
  local t = setmetatable({ _c = ffi.gc(ptr, C.tt_tensor_release) }, Tensor)
  memory.register(t)
  return t
end
M.wrap = wrap

local outp = ffi.new("tt_tensor*[1]")

-- Run a C call that produces a tensor through `tt_tensor **out`.
function M.call_out(fn, ...)
  outp[0] = nil
  local args = { ... }
  args[#args + 1] = outp
  check(fn(unpack(args)), 3)
  return wrap(outp[0])
end

-- Release the tensor's memory now. Safe to call twice.
function Tensor:free()
  local c = self._c
  if c ~= nil then
    ffi.gc(c, nil)
    C.tt_tensor_release(c)
    self._c = nil
    self._freed = true
  end
  if self.grad and self.grad._scope == nil then
    -- a leaf's .grad belongs to the leaf
    self.grad:free()
    self.grad = nil
  end
end

-- FSDP's reshard and unshard: the memory of the tensor's storage goes back
-- to the allocator and comes back (uninitialized), while the tensor, its
-- views and the references autograd nodes hold stay valid. An op given the
-- tensor in between fails with a message that says so.
function Tensor:free_storage() check(C.tt_tensor_storage_free(self._c), 2); return self end
function Tensor:alloc_storage() check(C.tt_tensor_storage_alloc(self._c), 2); return self end
function Tensor:has_storage() return C.tt_tensor_has_storage(self._c) ~= 0 end

local function cptr(t)
  local c = t._c
  if c == nil then
    error("tensor was already freed (by :free() or by the titan.scope it was created in)", 3)
  end
  return c
end
M.cptr = cptr

function Tensor:ptr() return cptr(self) end

-- Work queued on another stream of the device ("comm": collectives) that the
-- compute stream does not wait for also uses this memory: when it is freed,
-- the allocator reuses it only after that work (tt_tensor_record_stream).
local STREAMS = { compute = 0, comm = 1 }
function Tensor:record_stream(stream)
  local s = STREAMS[stream]
  if not s then error(("record_stream: unknown stream '%s'; expected 'compute' or 'comm'"):format(tostring(stream)), 2) end
  check(C.tt_tensor_record_stream(cptr(self), s), 2)
  return self
end

-- ---- shape and properties ------------------------------------------------

function Tensor:dim() return cptr(self).ndim end

function Tensor:size(d)
  local c = cptr(self)
  if d == nil then return self:shape() end
  if d < 0 then d = d + c.ndim + 1 end
  if d < 1 or d > c.ndim then error(("size: dim %d out of range for %d dims"):format(d, c.ndim), 2) end
  return tonumber(c.shape[d - 1])
end

function Tensor:shape()
  local c, s = cptr(self), {}
  for i = 0, c.ndim - 1 do s[i + 1] = tonumber(c.shape[i]) end
  return s
end

function Tensor:stride()
  local c, s = cptr(self), {}
  for i = 0, c.ndim - 1 do s[i + 1] = tonumber(c.strides[i]) end
  return s
end

function Tensor:numel() return tonumber(C.tt_tensor_numel(cptr(self))) end
function Tensor:dtype() return M.dtype_name(cptr(self).dtype) end
function Tensor:device() return M.device_name(cptr(self).device) end
function Tensor:is_contiguous() return C.tt_tensor_is_contiguous(cptr(self)) ~= 0 end
function Tensor:is_meta() return cptr(self).device.type == C.TT_META end
function Tensor:nbytes() return self:numel() * tonumber(C.tt_dtype_size(cptr(self).dtype)) end

local function shape_str(s) return "[" .. table.concat(s, ", ") .. "]" end
M.shape_str = shape_str

-- ---- creation ----------------------------------------------------------------

-- Accepts (2, 3), ({2, 3}) or ({2, 3}, opts); returns shape table and opts.
local function parse_shape(...)
  local a = ...
  local shape, opts
  if type(a) == "table" and getmetatable(a) == nil and (a[1] ~= nil or next(a) == nil) then
    shape, opts = a, select(2, ...)
  else
    shape = {}
    local n = select("#", ...)
    for i = 1, n do
      local v = select(i, ...)
      if type(v) == "number" then shape[#shape + 1] = v
      elseif type(v) == "table" and i == n then opts = v
      elseif v ~= nil then error("shape: expected sizes as numbers, got " .. type(v), 3) end
    end
  end
  return shape, opts or {}
end
M.parse_shape = parse_shape

local shape_buf = ffi.new("int64_t[8]")

local function fill_shape(shape)
  if #shape > 8 then error("at most 8 dims are supported, got " .. #shape, 4) end
  for i = 1, #shape do
    local v = shape[i]
    if type(v) ~= "number" or v ~= math.floor(v) then
      error("shape: sizes must be integers, got " .. shape_str(shape), 4)
    end
    shape_buf[i - 1] = v
  end
  return shape_buf
end
M.fill_shape = fill_shape

function M.empty(...)
  local shape, opts = parse_shape(...)
  local t = M.call_out(C.tt_tensor_empty, #shape, fill_shape(shape), M.dtype_of(opts.dtype), M.device_of(opts.device))
  if opts.requires_grad then t.requires_grad = true end
  return t
end

function M.full(shape, value, opts)
  local t = M.empty(shape, opts)
  check(C.tt_tensor_fill(t._c, value), 2)
  return t
end

function M.zeros(...)
  local shape, opts = parse_shape(...)
  return M.full(shape, 0, opts)
end

function M.ones(...)
  local shape, opts = parse_shape(...)
  return M.full(shape, 1, opts)
end

function M.zeros_like(t, opts)
  opts = opts or {}
  return M.zeros(t:shape(), { dtype = opts.dtype or t:dtype(), device = opts.device or t:device() })
end

function M.empty_like(t, opts)
  opts = opts or {}
  return M.empty(t:shape(), { dtype = opts.dtype or t:dtype(), device = opts.device or t:device() })
end

-- arange(stop) | arange(start, stop[, step][, opts])
function M.arange(a, b, c, d)
  local start, stop, step, opts
  if type(b) ~= "number" then start, stop, step, opts = 0, a, 1, b
  elseif type(c) ~= "number" then start, stop, step, opts = a, b, 1, c
  else start, stop, step, opts = a, b, c, d end
  opts = opts or {}
  if step == 0 then error("arange: step must be nonzero", 2) end
  local n = math.max(0, math.ceil((stop - start) / step))
  local t = M.empty({ n }, { dtype = opts.dtype or "float32", device = opts.device })
  check(C.tt_tensor_arange(t._c, start, step), 2)
  return t
end

-- tensor({{1, 2}, {3, 4}}, {dtype=...}) from nested Lua tables (or a number).
function M.tensor(data, opts)
  opts = opts or {}
  local shape, flat = {}, {}
  if type(data) == "number" then
    flat[1] = data
  else
    local d = data
    while type(d) == "table" do
      shape[#shape + 1] = #d
      d = d[1]
    end
    local function walk(x, depth)
      if depth > #shape then
        if type(x) ~= "number" then error("tensor: expected numbers, got " .. type(x), 4) end
        flat[#flat + 1] = x
        return
      end
      if type(x) ~= "table" or #x ~= shape[depth] then
        error("tensor: ragged nested table (expected " .. shape[depth] .. " items at depth " .. depth .. ")", 4)
      end
      for i = 1, #x do walk(x[i], depth + 1) end
    end
    walk(data, 1)
  end
  local t = M.empty(shape, { dtype = opts.dtype, device = opts.device })
  if M.dry_run and t:is_meta() then -- (a dry run's: the shape, not the values)
    if opts.requires_grad then t.requires_grad = true end
    return t
  end
  local buf = ffi.new("double[?]", math.max(#flat, 1), flat)
  check(C.tt_tensor_from_f64(t._c, buf, #flat), 2)
  if opts.requires_grad then t.requires_grad = true end
  return t
end

-- Seeded random tensors: counter-based, so a given (seed, offset) gives the
-- same numbers on any device and thread count.
local default_seed = 0
local draw_offset = 0
function M.manual_seed(seed) default_seed, draw_offset = seed, 0 end

-- The default stream's position, for checkpoints: {seed, offset}.
function M.rng_state() return { seed = default_seed, offset = draw_offset } end
function M.set_rng_state(s) default_seed, draw_offset = s.seed, s.offset end

local function rng_opts(opts)
  opts = opts or {}
  local seed = opts.seed or default_seed
  local offset = opts.offset
  return seed, offset
end

local function random(kind, shape, opts, p0, p1, p2, p3)
  local t = M.empty(shape, opts)
  local seed, offset = rng_opts(opts)
  if offset == nil then
    offset = draw_offset
    draw_offset = draw_offset + t:numel()
  end
  local st
  if kind == 0 then st = C.tt_rng_uniform(t._c, seed, offset, p0, p1)
  elseif kind == 1 then st = C.tt_rng_normal(t._c, seed, offset, p0, p1)
  else st = C.tt_rng_trunc_normal(t._c, seed, offset, p0, p1, p2, p3) end
  check(st, 3)
  if opts and opts.requires_grad then t.requires_grad = true end
  return t
end

function M.rand(...) local s, o = parse_shape(...); return random(0, s, o, o.low or 0, o.high or 1) end
function M.randn(...) local s, o = parse_shape(...); return random(1, s, o, o.mean or 0, o.std or 1) end
function M.trunc_normal(shape, opts)
  opts = opts or {}
  local std = opts.std or 1
  return random(2, shape, opts, opts.mean or 0, std, opts.a or -2, opts.b or 2)
end

-- In-place initializers on an existing tensor (used by nn init rules).
function Tensor:uniform_(low, high, seed, offset)
  check(C.tt_rng_uniform(cptr(self), seed or default_seed, offset or 0, low, high), 2); return self
end
function Tensor:normal_(mean, std, seed, offset)
  check(C.tt_rng_normal(cptr(self), seed or default_seed, offset or 0, mean, std), 2); return self
end
function Tensor:trunc_normal_(mean, std, a, b, seed, offset)
  check(C.tt_rng_trunc_normal(cptr(self), seed or default_seed, offset or 0, mean, std, a, b), 2); return self
end
function Tensor:fill_(v) check(C.tt_tensor_fill(cptr(self), v), 2); return self end
function Tensor:zero_() return self:fill_(0) end

function Tensor:copy_(src)
  check(C.tt_tensor_copy(cptr(self), cptr(src)), 2)
  return self
end

-- A new tensor in another dtype and/or device (self when nothing changes).
function Tensor:to(spec)
  local dtype, device
  if type(spec) == "table" then dtype, device = spec.dtype, spec.device
  elseif spec == "cpu" or spec == "meta" or (type(spec) == "string" and spec:match("^cuda")) then device = spec
  else dtype = spec end
  local c = cptr(self)
  local d = dtype and M.dtype_of(dtype) or c.dtype
  local dev = device and M.device_of(device) or c.device
  if d == c.dtype and dev.type == c.device.type and dev.index == c.device.index then return self end
  local out = M.empty(self:shape(), { dtype = d, device = dev })
  check(C.tt_tensor_copy(out._c, c), 2)
  return out
end

function Tensor:float() return self:to("float32") end
function Tensor:double() return self:to("float64") end

-- ---- reading values --------------------------------------------------------------

-- M.dry_run: set while titan estimate runs a step on the meta device, where
-- a value read from a tensor (a loss, a count) reads as 0; otherwise
-- reading a meta tensor is an error (it has no data).
M.dry_run = false

function Tensor:tolist_flat()
  local n = self:numel()
  if M.dry_run and self:is_meta() then
    local out = {}
    for i = 1, n do out[i] = 0 end
    return out
  end
  local buf = ffi.new("double[?]", math.max(n, 1))
  check(C.tt_tensor_to_f64(cptr(self), buf, n), 2)
  local out = {}
  for i = 0, n - 1 do out[i + 1] = buf[i] end
  return out
end

function Tensor:item()
  if self:numel() ~= 1 then
    error("item: tensor of shape " .. shape_str(self:shape()) .. " has " .. self:numel() .. " elements; expected 1", 2)
  end
  if M.dry_run and self:is_meta() then return 0 end
  local buf = ffi.new("double[1]")
  check(C.tt_tensor_to_f64(cptr(self), buf, 1), 2)
  return buf[0]
end

function Tensor:tolist()
  local flat, shape = self:tolist_flat(), self:shape()
  if #shape == 0 then return flat[1] end
  local pos = 0
  local function build(d)
    local r = {}
    for i = 1, shape[d] do
      if d == #shape then pos = pos + 1; r[i] = flat[pos] else r[i] = build(d + 1) end
    end
    return r
  end
  return build(1)
end

-- ---- printing (PyTorch's layout) -----------------------------------------------

local function fmt_values(vals, is_float)
  local all_int, maxabs, minabs = true, 0, math.huge
  for _, v in ipairs(vals) do
    if v ~= v or v == math.huge or v == -math.huge then
      all_int = false
    else
      if v ~= math.floor(v) then all_int = false end
      local a = math.abs(v)
      if a > maxabs then maxabs = a end
      if a > 0 and a < minabs then minabs = a end
    end
  end
  local function f(v)
    if v ~= v then return "nan" end
    if v == math.huge then return "inf" end
    if v == -math.huge then return "-inf" end
    if not is_float then return ("%d"):format(v) end
    if all_int and maxabs < 1e8 then return ("%d."):format(v) end
    if maxabs >= 1e8 or (minabs < 1e-4 and minabs ~= math.huge) or (maxabs / minabs > 1e6 and minabs ~= math.huge) then
      return ("%.4e"):format(v)
    end
    return ("%.4f"):format(v)
  end
  local out, width = {}, 0
  for i, v in ipairs(vals) do
    out[i] = f(v)
    if #out[i] > width then width = #out[i] end
  end
  for i, s in ipairs(out) do out[i] = (" "):rep(width - #s) .. s end
  return out
end

function Tensor:__tostring()
  if self._c == nil then return "tensor(<freed>)" end
  local c = self._c
  local shape = self:shape()
  local suffix = ("shape=%s, dtype=%s, device=%s"):format(shape_str(shape), self:dtype(), self:device())
  if self.requires_grad then suffix = suffix .. ", requires_grad=true" end
  if c.device.type == C.TT_META then return "tensor(..., " .. suffix .. ")" end
  local n = self:numel()
  local summarize = n > 1000
  local edge = 3
  local flat = self:tolist_flat()
  local is_float = C.tt_dtype_is_float(c.dtype) ~= 0
  -- Strides of the packed layout, to index flat values.
  local pstride, s = {}, 1
  for d = #shape, 1, -1 do pstride[d] = s; s = s * shape[d] end
  -- Which indices are shown per dim.
  local function shown(d)
    local len = shape[d]
    if summarize and len > 2 * edge then
      local idx = {}
      for i = 1, edge do idx[#idx + 1] = i end
      idx[#idx + 1] = false
      for i = len - edge + 1, len do idx[#idx + 1] = i end
      return idx
    end
    local idx = {}
    for i = 1, len do idx[i] = i end
    return idx
  end
  -- Collect the shown values first so they share one width.
  local vals = {}
  local function gather(d, base)
    if d > #shape then vals[#vals + 1] = flat[base + 1]; return end
    for _, i in ipairs(shown(d)) do if i then gather(d + 1, base + (i - 1) * pstride[d]) end end
  end
  if #shape == 0 then vals[1] = flat[1] else gather(1, 0) end
  local strs = fmt_values(vals, is_float)
  local k = 0
  local indent = 7
  local function render(d, base)
    if d > #shape then k = k + 1; return strs[k] end
    local parts = {}
    for _, i in ipairs(shown(d)) do
      if i then parts[#parts + 1] = render(d + 1, base + (i - 1) * pstride[d]) else parts[#parts + 1] = "..." end
    end
    if d == #shape then return "[" .. table.concat(parts, ", ") .. "]" end
    local sep = "," .. ("\n"):rep(#shape - d) .. (" "):rep(indent + d)
    return "[" .. table.concat(parts, sep) .. "]"
  end
  local body = #shape == 0 and strs[1] or render(1, 0)
  return "tensor(" .. body .. ", " .. suffix .. ")"
end

return M
