-- data/loader.lua — batches of windows as tensors.
--
-- Each batch is {inputs = [B, T], targets = [B, T]} (int64 unless asked
-- otherwise) on the chosen device: B windows of T + 1 tokens are written
-- into a kept int32 staging tensor [B, T + 1] (one C call per window for a
-- binary file), and the two shifted views of it are copied out by the
-- engine (dtype and device conversion in one tt_tensor_copy each). The
-- batch tensors are ordinary tensors: registered in the enclosing
-- titan.scope, or freed by the caller.
local tffi = require("titan.ffi")
local tensor = require("titan.tensor")
local memory = require("titan.memory")
local ffi, C, check = tffi.ffi, tffi.C, tffi.check

local Loader = {}
Loader.__index = Loader

local function narrow(t, dim, start, len)
  return tensor.call_out(C.tt_view_narrow, t._c, dim, start, len)
end

-- Loader.new(dataset, {batch_size, device = "cpu", dtype = "int64", drop_last = false})
--   dataset: anything with seq_len, next_window(dst), state_dict(),
--   load_state_dict(s) (data.TextDataset, data.TokenDataset, data.Mixture,
--   data.ShuffleBuffer, or a recipe's own).
function Loader.new(ds, opts)
  opts = opts or {}
  local B = opts.batch_size
  if type(B) ~= "number" or B < 1 or B ~= math.floor(B) then
    error("Loader: batch_size must be an integer >= 1, got " .. tostring(B), 2)
  end
  if type(ds) ~= "table" or type(ds.next_window) ~= "function" or type(ds.seq_len) ~= "number" then
    error("Loader: expected a dataset (with seq_len and next_window)", 2)
  end
  local T = ds.seq_len
  local self = setmetatable({
    dataset = ds, batch_size = B, seq_len = T, device = opts.device or "cpu", dtype = opts.dtype or "int64",
    drop_last = opts.drop_last or false, batches = 0,
  }, Loader)
  tensor.device_of(self.device) -- validates the name
  self.staging = memory.keep(tensor.empty({ B, T + 1 }, { dtype = "int32" }))
  self.ptr = ffi.cast("int32_t*", C.tt_tensor_data(self.staging._c))
  self.view_inputs = memory.keep(narrow(self.staging, 1, 0, T))
  self.view_targets = memory.keep(narrow(self.staging, 1, 1, T))
  return self
end

local function take(self, view, rows)
  local src = rows == self.batch_size and view or narrow(view, 0, 0, rows)
  local out = tensor.empty({ rows, self.seq_len }, { dtype = self.dtype, device = self.device })
  local st = C.tt_tensor_copy(out._c, src._c)
  if src ~= view then src:free() end
  check(st, 3)
  return out
end

-- The next batch, or nil when a finite dataset has ended its epoch (the
-- last batch of an epoch may hold fewer rows unless drop_last).
function Loader:next()
  if self.staging == nil then error("Loader: used after close()", 2) end
  if self.at_end then
    -- The epoch ended inside the previous (short) batch: report the end now.
    self.at_end = false
    return nil
  end
  local B, row, rows = self.batch_size, self.seq_len + 1, 0
  while rows < B do
    if not self.dataset:next_window(self.ptr + rows * row) then
      self.at_end = rows > 0
      break
    end
    rows = rows + 1
  end
  if rows == 0 or (rows < B and self.drop_last) then
    self.at_end = false
    return nil
  end
  self.batches = self.batches + 1
  return { inputs = take(self, self.view_inputs, rows), targets = take(self, self.view_targets, rows) }
end

-- for batch in loader:iter() do ... end (ends only for finite datasets)
function Loader:iter()
  return function() return self:next() end
end

function Loader:state_dict()
  return { version = 1, batches = self.batches, batch_size = self.batch_size, at_end = self.at_end or false,
    dataset = self.dataset:state_dict() }
end

function Loader:load_state_dict(s)
  if type(s) ~= "table" or s.version ~= 1 then
    error("Loader: expected a loader state of version 1, got " .. (type(s) == "table" and tostring(s.version) or type(s)), 2)
  end
  -- Positions count windows, not batches: a new batch_size resumes at the same window.
  self.dataset:load_state_dict(s.dataset)
  self.batches, self.at_end = s.batches, s.at_end or false
end

-- Back to the start of epoch 0.
function Loader:reset()
  self.dataset:reset()
  self.batches, self.at_end = 0, false
end

function Loader:close()
  for _, k in ipairs({ "view_inputs", "view_targets", "staging" }) do
    if self[k] then self[k]:free() end
    self[k] = nil
  end
end

return Loader
