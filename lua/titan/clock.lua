-- clock.lua — a monotonic wall clock (seconds as a double) for metrics and
-- benchmarks; one declaration of clock_gettime for the whole process.
local ffi = require("ffi")

pcall(ffi.cdef, [[
typedef struct { long tv_sec; long tv_nsec; } tt_clock_timespec;
int clock_gettime(int clk_id, tt_clock_timespec *tp);
]])

local M = {}
local ts = ffi.new("tt_clock_timespec")

function M.now()
  ffi.C.clock_gettime(1, ts) -- CLOCK_MONOTONIC
  return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
end

return M
