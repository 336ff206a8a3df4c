-- nn.lua — modules: named parameters, buffers and children; state dicts;
-- train/eval; and the basic layers Linear, Embedding, RMSNorm.
--
--   local Net = nn.Module:extend("Net")
--   function Net:init(d) self.fc = nn.Linear(d, d) end      -- children by assignment
--   function Net:forward(x) return self.fc(x):relu() end
--   local net = Net(16)
--
-- Parameters live outside every titan.scope (they are kept); their .grad
-- is owned by the parameter and freed by zero_grad().
local tensor = require("titan.tensor")
local memory = require("titan.memory")
local F = require("titan.functional")
local profiler = require("titan.profiler")
local tffi = require("titan.ffi")
local C = tffi.C

local M = {}

local Module = {}
Module.__index = Module
Module.__name = "Module"
M.Module = Module

local function is_tensor(v) return type(v) == "table" and getmetatable(v) == tensor.Tensor end
local function is_module(v)
  if type(v) ~= "table" then return false end
  -- instance -> class -> (class's metatable).__index = parent class ...
  local cls = getmetatable(v)
  while cls do
    if cls == Module then return true end
    local meta = getmetatable(cls)
    cls = meta and rawget(meta, "__index")
  end
  return false
end
M.is_module = is_module

-- A subclass: its instances are built by calling it, which runs :init(...).
function Module:extend(name)
  local cls = {}
  cls.__index = cls
  cls.__name = name
  cls.__call = Module.__call
  cls.__tostring = Module.__tostring
  return setmetatable(cls, {
    __index = self,
    __call = function(c, ...)
      local obj = setmetatable({ _params = {}, _buffers = {}, _children = {}, training = true }, c)
      obj:init(...)
      return obj
    end,
  })
end

function Module:init() end

-- (A profiler, while one is active, times each forward as a region.)
function Module:__call(...)
  local p = profiler.active
  if p then return p:module_call(self, self.forward, ...) end
  return self:forward(...)
end

-- self:<method>(...) for an entry point other than forward that a model
-- calls itself (a norm's fused add_forward, a block's forward_parts): a
-- profiler, while one is active, times it as this module's region, as it
-- times a call, so that no module's work goes unnamed in a profile.
function Module:call(method, ...)
  local fn = self[method]
  local p = profiler.active
  if p then return p:module_call(self, fn, ...) end
  return fn(self, ...)
end

-- Registration by assignment keeps declaration order (for state dicts and
-- a fixed gradient-norm order): use these, or plain assignment in init via
-- the __newindex-free helpers below.
function Module:param(name, t)
  t.requires_grad = true
  memory.keep(t)
  if rawget(self, name) == nil then self._params[#self._params + 1] = name end
  rawset(self, name, t)
  return t
end

function Module:buffer(name, t)
  if t then memory.keep(t) end
  if rawget(self, name) == nil then self._buffers[#self._buffers + 1] = name end
  rawset(self, name, t)
  return t
end

function Module:child(name, m)
  if rawget(self, name) == nil then self._children[#self._children + 1] = name end
  rawset(self, name, m)
  return m
end

-- Children assigned as plain fields are found too (in sorted order after
-- the declared ones), so `self.fc = nn.Linear(...)` just works.
local function children(self)
  local out, seen = {}, {}
  for _, name in ipairs(self._children) do
    out[#out + 1] = name
    seen[name] = true
  end
  local extra = {}
  for k, v in pairs(self) do
    if type(k) == "string" and not seen[k] and k:sub(1, 1) ~= "_" and is_module(v) then extra[#extra + 1] = k end
  end
  table.sort(extra, function(a, b)
    local na, nb = tonumber(a), tonumber(b)
    if na and nb then return na < nb end
    return a < b
  end)
  for _, k in ipairs(extra) do out[#out + 1] = k end
  return out
end

-- Ordered list of {name, module} of the direct children.
function Module:named_children()
  local out = {}
  for _, name in ipairs(children(self)) do out[#out + 1] = { name, self[name] } end
  return out
end

-- Drop a child, parameter or buffer (torch's `del module.name`): a pipeline
-- stage keeps only its own layers of the model. Frees nothing: a meta
-- model holds no memory, and a caller that drops a real one frees it first.
function Module:remove(name)
  for _, list in ipairs({ self._children, self._params, self._buffers }) do
    for i = #list, 1, -1 do
      if list[i] == name then table.remove(list, i) end
    end
  end
  rawset(self, name, nil)
  return self
end

-- Ordered list of {name, tensor} for every parameter, depth first.
function Module:named_parameters(prefix, out)
  out = out or {}
  prefix = prefix or ""
  for _, name in ipairs(self._params) do
    local p = rawget(self, name)
    if p then out[#out + 1] = { prefix .. name, p } end
  end
  for _, name in ipairs(children(self)) do
    self[name]:named_parameters(prefix .. name .. ".", out)
  end
  return out
end

function Module:parameters()
  local out = {}
  for i, np in ipairs(self:named_parameters()) do out[i] = np[2] end
  return out
end

function Module:named_buffers(prefix, out)
  out = out or {}
  prefix = prefix or ""
  for _, name in ipairs(self._buffers) do
    local b = rawget(self, name)
    if b then out[#out + 1] = { prefix .. name, b } end
  end
  for _, name in ipairs(children(self)) do self[name]:named_buffers(prefix .. name .. ".", out) end
  return out
end

function Module:named_modules(prefix, out)
  out = out or {}
  prefix = prefix or ""
  out[#out + 1] = { prefix, self }
  for _, name in ipairs(children(self)) do
    self[name]:named_modules(prefix == "" and name or prefix .. "." .. name, out)
  end
  return out
end

function Module:num_parameters()
  local n = 0
  for _, p in ipairs(self:parameters()) do n = n + p:numel() end
  return n
end

-- state_dict(): { names = {ordered}, tensors = {name -> tensor} } of the
-- module's own tensors (not copies). Buffers marked persistent=false skip.
function Module:state_dict()
  local names, tensors = {}, {}
  for _, np in ipairs(self:named_parameters()) do
    names[#names + 1] = np[1]
    tensors[np[1]] = np[2]
  end
  for _, nb in ipairs(self:named_buffers()) do
    names[#names + 1] = nb[1]
    tensors[nb[1]] = nb[2]
  end
  return { names = names, tensors = tensors }
end

-- Copies values in; shapes must match. strict (default true): missing or
-- unexpected names are errors that list them.
function Module:load_state_dict(sd, strict)
  if strict == nil then strict = true end
  local src = sd.tensors or sd
  local own = self:state_dict()
  local missing, unexpected = {}, {}
  for _, name in ipairs(own.names) do
    local t = src[name]
    if t == nil then
      missing[#missing + 1] = name
    else
      local dst = own.tensors[name]
      local ds, ss = dst:shape(), t:shape()
      if tensor.shape_str(ds) ~= tensor.shape_str(ss) then
        error(("load_state_dict: %s has shape %s in the source but %s in the model"):format(
          name, tensor.shape_str(ss), tensor.shape_str(ds)), 2)
      end
      dst:copy_(t)
    end
  end
  for name in pairs(src) do
    if type(name) == "string" and own.tensors[name] == nil then unexpected[#unexpected + 1] = name end
  end
  table.sort(unexpected)
  if strict and (#missing > 0 or #unexpected > 0) then
    error(("load_state_dict: missing keys: [%s]; unexpected keys: [%s]"):format(
      table.concat(missing, ", "), table.concat(unexpected, ", ")), 2)
  end
  return { missing = missing, unexpected = unexpected }
end

function Module:train(mode)
  if mode == nil then mode = true end
  for _, nm in ipairs(self:named_modules()) do nm[2].training = mode end
  return self
end

function Module:eval() return self:train(false) end

-- fn(module, name) on every module, children first.
function Module:apply(fn)
  local mods = self:named_modules()
  for i = #mods, 1, -1 do fn(mods[i][2], mods[i][1]) end
  return self
end

function Module:zero_grad()
  for _, p in ipairs(self:parameters()) do
    if p.grad then
      p.grad:free()
      p.grad = nil
    end
  end
end

-- Give every parameter and buffer real memory on `device` (values
-- undefined; follow with init_weights). Used after building on meta.
-- opts.params_storage = false: parameters become tensors of `device` whose
-- storage is freed (tensor:free_storage()), one at a time, so that FSDP
-- brings memory to one block at a time (lua/parallel/fsdp.lua).
function Module:to_empty(device, opts)
  local keep_storage = not opts or opts.params_storage ~= false
  for _, nm in ipairs(self:named_modules()) do
    local m = nm[2]
    for _, name in ipairs(m._params) do
      local p = rawget(m, name)
      local q = tensor.empty(p:shape(), { dtype = p:dtype(), device = device })
      if not keep_storage then q:free_storage() end
      p:free()
      m:param(name, q)
    end
    for _, name in ipairs(m._buffers) do
      local b = rawget(m, name)
      if b then
        local q = tensor.empty(b:shape(), { dtype = b:dtype(), device = device })
        b:free()
        m:buffer(name, q)
      end
    end
  end
  return self
end

-- Name-keyed initialization: every parameter draws from the counter-based
-- RNG keyed by (seed, its fully-qualified name), so the values do not
-- depend on the layout, device, or construction order.
function M.name_key(seed, name)
  return C.tt_hash_string(("%d:%s"):format(seed or 0, name))
end

function Module:init_weights(seed)
  for _, nm in ipairs(self:named_modules()) do
    local prefix, m = nm[1], nm[2]
    if m.reset_parameters then
      m:reset_parameters(function(pname) return M.name_key(seed, prefix == "" and pname or prefix .. "." .. pname) end)
    end
  end
  return self
end

-- Free every parameter and buffer now (the module is unusable after).
function Module:free()
  for _, np in ipairs(self:named_parameters()) do np[2]:free() end
  for _, nb in ipairs(self:named_buffers()) do nb[2]:free() end
end

function Module:__tostring()
  local lines = {}
  local function render(m, name, indent)
    local extra = m.extra_repr and m:extra_repr() or ""
    local kids = children(m)
    local head = (" "):rep(indent) .. (name ~= "" and "(" .. name .. "): " or "") .. (getmetatable(m).__name or "Module")
    if #kids == 0 then
      lines[#lines + 1] = head .. "(" .. extra .. ")"
    else
      lines[#lines + 1] = head .. "(" .. extra
      for _, k in ipairs(kids) do render(m[k], k, indent + 2) end
      lines[#lines + 1] = (" "):rep(indent) .. ")"
    end
  end
  render(self, "", 0)
  return table.concat(lines, "\n")
end

-- Construction-time initialization draws from the global stream (like
-- torch.manual_seed); init_weights(seed) re-draws keyed by names.
local draw = 0
local function fresh_key()
  draw = draw + 1
  return C.tt_hash_string("construct:" .. draw)
end

-- ---- layers ------------------------------------------------------------------

local Linear = Module:extend("Linear")
M.Linear = Linear

-- opts: bias (default false, as in Llama), dtype, device
function Linear:init(in_features, out_features, opts)
  opts = opts or {}
  self.in_features, self.out_features = in_features, out_features
  self:param("weight", tensor.empty({ out_features, in_features }, opts))
  if opts.bias then self:param("bias", tensor.empty({ out_features }, opts)) end
  self.init_std = opts.init_std or 0.02
  if not self.weight:is_meta() then self:reset_parameters(function() return fresh_key() end) end
end

function Linear:reset_parameters(key)
  local std = self.init_std
  -- a = -2, b = 2 absolute, as nn.init.trunc_normal_'s defaults
  self.weight:trunc_normal_(0, std, -2, 2, key("weight"), 0)
  if self.bias then self.bias:zero_() end
end

function Linear:forward(x) return F.linear(x, self.weight, self.bias) end

function Linear:extra_repr()
  return ("in_features=%d, out_features=%d, bias=%s"):format(self.in_features, self.out_features, tostring(self.bias ~= nil))
end

local Embedding = Module:extend("Embedding")
M.Embedding = Embedding

function Embedding:init(num, dim, opts)
  opts = opts or {}
  self.num_embeddings, self.embedding_dim = num, dim
  self:param("weight", tensor.empty({ num, dim }, opts))
  if not self.weight:is_meta() then self:reset_parameters(function() return fresh_key() end) end
end

function Embedding:reset_parameters(key) self.weight:normal_(0, 1, key("weight"), 0) end

function Embedding:forward(ids) return F.embedding(self.weight, ids) end

function Embedding:extra_repr() return ("%d, %d"):format(self.num_embeddings, self.embedding_dim) end

local RMSNorm = Module:extend("RMSNorm")
M.RMSNorm = RMSNorm

function RMSNorm:init(dim, opts)
  opts = opts or {}
  self.dim, self.eps = dim, opts.eps or 1e-6
  self:param("weight", tensor.empty({ dim }, opts))
  if not self.weight:is_meta() then self:reset_parameters() end
end

function RMSNorm:reset_parameters() self.weight:fill_(1) end

function RMSNorm:forward(x) return F.rms_norm(x, self.weight, self.eps) end

-- h = x + residual and the norm of h, fused (F.add_rms_norm): returns h, norm(h).
function RMSNorm:add_forward(x, residual) return F.add_rms_norm(x, residual, self.weight, self.eps) end

function RMSNorm:extra_repr() return ("%d, eps=%g"):format(self.dim, self.eps) end

return M
