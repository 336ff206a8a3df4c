-- device_clock.lua — marks timed where a device's work runs (tt_timer in
-- bindings/titan.h): on a GPU each mark is an event on the compute stream,
-- recorded with no host wait, and read() waits once for all of them; on the
-- CPU it is the host's monotonic clock. The profiler's clock on a GPU.
--
--   local dc = device_clock.new("cuda:0")
--   dc:mark(); model(x); dc:mark()
--   local s = dc:read()       -- s[1] = 0, s[2] = the seconds the forward took on the device
--   dc:clear()                -- the next round reuses the events
local tffi = require("titan.ffi")
local tensor = require("titan.tensor")
local ffi, C = tffi.ffi, tffi.C

local M = {}

local Clock = {}
Clock.__index = Clock

function M.new(device)
  local out = ffi.new("tt_timer*[1]")
  tffi.check(C.tt_timer_new(tensor.device_of(device), out), 2)
  return setmetatable({ _c = ffi.gc(out[0], C.tt_timer_free), device = device }, Clock)
end

-- Records the next mark; returns its number (1 for the first since clear).
function Clock:mark()
  tffi.check(C.tt_timer_mark(self._c), 2)
  return tonumber(C.tt_timer_count(self._c))
end

function Clock:count() return tonumber(C.tt_timer_count(self._c)) end

-- Waits for the marks; the seconds from the first mark to each, as a list.
function Clock:read()
  local n = self:count()
  local buf = ffi.new("double[?]", math.max(n, 1))
  tffi.check(C.tt_timer_read(self._c, buf, n), 2)
  local out = {}
  for i = 1, n do out[i] = buf[i - 1] end
  return out
end

function Clock:clear() C.tt_timer_clear(self._c) end

function Clock:free()
  if self._c ~= nil then
    C.tt_timer_free(ffi.gc(self._c, nil))
    self._c = nil
  end
end

return M
