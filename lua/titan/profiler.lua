-- profiler.lua — where a training step's time goes: nested regions (the
-- trainer's phases, every module's forward, every backward node), each
-- timed with its own regions' time taken out.
--
-- Two clocks. With opts.device_clock (titan.device_clock on a GPU: marks
-- on the compute stream, read once at stop) a region's time is what the
-- device spent between its edges, and the step runs as it does unprofiled,
-- the host queueing ahead; each region's host time is kept next to it (a
-- region whose host time exceeds its device time is bound by launching).
-- Without one, the host's clock, with opts.sync called at each region's
-- edges (on a GPU, a device sync: a region's time is then that of its own
-- kernels, and the syncs slow the step down, more on small models). The
-- other steps are untouched: the hooks in nn and autograd cost one table
-- read while no profiler is active.
--
--   local p = profiler.new({ device_clock = require("titan.device_clock").new("cuda:0") })
--   p:start()
--   profiler.region("forward", "step", model, x)   -- fn(...) inside a region
--   p:stop()
--   p:write_trace("trace.json", { rank = 0 })      -- Chrome trace: chrome://tracing, ui.perfetto.dev
--   print(p:summary_text(15))                       -- the heaviest regions by their own time
--
-- The trainer runs it every profiling.profile_freq steps (docs/profiling.md).
local M = {}

-- The profiler timing right now, or nil: what the hooks read.
M.active = nil

local Profiler = {}
Profiler.__index = Profiler

-- opts.clock: seconds (default: the monotonic clock); opts.sync: a function
-- that waits for the device (default: none, as on the CPU); opts.device_clock:
-- an object with mark() (returns the mark's number, 1 after clear), read()
-- (the seconds from mark 1 to each) and clear(), which then times the
-- regions instead of clock and sync; opts.memory: a function giving the
-- device's allocated bytes (default: none), read at each region's edges:
-- what a region leaves allocated (a forward, its activations; a backward,
-- minus what it frees) and a memory track in the trace.
function M.new(opts)
  opts = opts or {}
  return setmetatable({
    clock = opts.clock or require("titan.clock").now,
    sync = opts.sync or function() end,
    device_clock = opts.device_clock,
    memory = opts.memory,
    samples = {},
    names = setmetatable({}, { __mode = "k" }), -- module -> its name in the model
    events = {},
    stack = {},
  }, Profiler)
end

-- Name the model's modules ("layers.3.attention.wq"; the root "model", or
-- `prefix`) for the regions of their forwards; others show their class.
function Profiler:name_modules(model, prefix)
  for _, nm in ipairs(model:named_modules()) do
    local name = nm[1]
    if prefix and prefix ~= "" then name = name == "" and prefix or (prefix .. "." .. name) end
    self.names[nm[2]] = name == "" and "model" or name
  end
end

-- Now, on the profiler's clock: host seconds, or the number of a device
-- mark that stop() turns into seconds. (The host's own time is read apart.)
function Profiler:now()
  if self.device_clock then return self.device_clock:mark() end
  self.sync()
  return self.clock()
end

function Profiler:start()
  if M.active then error("profiler: another profiler is already active", 2) end
  self.events, self.stack, self.samples, self.t1, self.host1, self.wall = {}, {}, {}, nil, nil, nil
  if self.device_clock then self.device_clock:clear() end
  self.host0 = self.clock()
  self.t0 = self:now()
  self:sample(self.t0)
  M.active = self
end

-- Stops timing; regions left open by an error are closed here. With a
-- device clock this waits for the device to reach the last mark.
function Profiler:stop()
  while #self.stack > 0 do self:pop() end
  M.active = nil
  self.t1 = self:now()
  self.host1 = self.clock()
  local at -- clock reading -> seconds since start
  if self.device_clock then
    local s = self.device_clock:read()
    at = function(mark) return s[mark] - s[self.t0] end
  else
    at = function(t) return t - self.t0 end
  end
  for _, e in ipairs(self.events) do
    e.ts, e.dur = at(e.a), at(e.b) - at(e.a)
  end
  for _, e in ipairs(self.events) do -- (every dur is known now: a region's own is its total less its children's)
    local inner, inner_host = 0, 0
    for _, c in ipairs(e.children) do inner, inner_host = inner + c.dur, inner_host + c.host end
    e.self, e.host_self = e.dur - inner, e.host - inner_host
  end
  for _, m in ipairs(self.samples) do m.ts = at(m.at) end
  self.wall = at(self.t1)
end

-- The allocated bytes at clock reading t (a memory track), returned; nil without opts.memory.
function Profiler:sample(t)
  if not self.memory then return nil end
  local bytes = self.memory()
  self.samples[#self.samples + 1] = { at = t, bytes = bytes }
  return bytes
end

function Profiler:push(name, cat)
  local t = self:now()
  self.stack[#self.stack + 1] = { name = name, cat = cat, t = t, host = self.clock(), children = {},
    mem = self:sample(t) }
end

function Profiler:pop()
  local now = self:now()
  local host = self.clock()
  local e = table.remove(self.stack)
  local mem = self:sample(now)
  local ev = { name = e.name, cat = e.cat, a = e.t, b = now, host = host - e.host, depth = #self.stack,
    children = e.children, mem = mem and e.mem and (mem - e.mem) or nil }
  self.events[#self.events + 1] = ev
  local parent = self.stack[#self.stack]
  if parent then parent.children[#parent.children + 1] = ev end
end

-- The innermost open region's name (a backward node records the module it
-- was made in), or nil.
function Profiler:current()
  local top = self.stack[#self.stack]
  return top and top.name
end

local function close(p, ok, ...)
  p:pop()
  if not ok then error((...), 0) end
  return ...
end

function Profiler:region(name, cat, fn, ...)
  self:push(name, cat)
  return close(self, pcall(fn, ...))
end

-- fn(...) inside a region of the active profiler; just fn(...) without one.
function M.region(name, cat, fn, ...)
  local p = M.active
  if not p then return fn(...) end
  return p:region(name, cat, fn, ...)
end

-- fn(m, ...) as module m's region: its forward (nn.Module's __call while a
-- profiler is active) or another of its entry points (nn.Module:call).
function Profiler:module_call(m, fn, ...)
  return self:region(self.names[m] or m.__name or "module", "module", fn, m, ...)
end

-- ---- reading the results -----------------------------------------------------------

-- Regions grouped by category and name, with the index of a repeated
-- block ("layers.3.") written "layers.*.", so the 16 layers of a model
-- make one row: { cat, name, calls, total, self, mem, host } sorted by self
-- time (mem: the bytes its regions left allocated, summed; nil without
-- opts.memory; host: the host's own seconds in them, with a device clock).
function Profiler:summary()
  local rows, by = {}, {}
  for _, e in ipairs(self.events) do
    local name = e.name:gsub("%.%d+%.", ".*."):gsub("%.%d+$", ".*"):gsub("^%d+%.", "*.")
    local key = e.cat .. "\0" .. name
    local r = by[key]
    if not r then
      r = { cat = e.cat, name = name, calls = 0, total = 0, self = 0, mem = e.mem and 0 or nil,
        host = self.device_clock and 0 or nil }
      by[key] = r
      rows[#rows + 1] = r
    end
    r.calls, r.total, r.self = r.calls + 1, r.total + e.dur, r.self + e.self
    if e.mem then r.mem = (r.mem or 0) + e.mem end
    if r.host then r.host = r.host + e.host_self end
  end
  table.sort(rows, function(a, b)
    if a.self ~= b.self then return a.self > b.self end
    return a.cat .. a.name < b.cat .. b.name
  end)
  return rows
end

-- Seconds from start to stop.
function Profiler:elapsed()
  if self.wall then return self.wall end
  return self.clock() - self.host0 -- (still running: the host's time so far)
end

-- Host seconds from start to stop: with a device clock, how long the host
-- took to queue the step (less than elapsed() when the device is the bound).
function Profiler:host_elapsed() return (self.host1 or self.clock()) - self.host0 end

-- The summary as a table, the `top` rows with the most self time (all
-- when top is nil); self time is a region's own, its inner regions' taken out.
function Profiler:summary_text(top)
  local rows, wall = self:summary(), self:elapsed()
  local mem, host = self.memory ~= nil, self.device_clock ~= nil
  local lines = { ("%-8s %-52s %7s %11s %11s %7s%s%s"):format("kind", "region", "calls", "total ms", "self ms",
    "self %", host and "  host ms" or "", mem and "   mem MiB" or "") }
  for i, r in ipairs(rows) do
    if top and i > top then
      lines[#lines + 1] = ("(%d more rows)"):format(#rows - top)
      break
    end
    local name = #r.name > 52 and ("..." .. r.name:sub(-49)) or r.name
    lines[#lines + 1] = ("%-8s %-52s %7d %11.3f %11.3f %6.1f%%%s%s"):format(r.cat, name, r.calls, r.total * 1e3,
      r.self * 1e3, 100 * r.self / math.max(wall, 1e-12), host and ("%9.3f"):format((r.host or 0) * 1e3) or "",
      mem and ("%+10.1f"):format((r.mem or 0) / 2 ^ 20) or "")
  end
  return table.concat(lines, "\n")
end

-- The events as a Chrome trace (the JSON Object Format's complete events:
-- chrome://tracing and ui.perfetto.dev open it); meta.rank is the process
-- id, the rest of meta goes into otherData.
function Profiler:trace(meta)
  meta = meta or {}
  local ev = {}
  for i, e in ipairs(self.events) do
    ev[i] = { name = e.name, cat = e.cat, ph = "X", ts = e.ts * 1e6, dur = e.dur * 1e6, pid = meta.rank or 0, tid = 0,
      args = self.device_clock and { host_ms = e.host * 1e3 } or nil }
  end
  -- outer regions first where two start together (pop order is inner first)
  table.sort(ev, function(a, b)
    if a.ts ~= b.ts then return a.ts < b.ts end
    return a.dur > b.dur
  end)
  for _, m in ipairs(self.samples) do -- the memory track (a counter)
    ev[#ev + 1] = { name = "allocated", cat = "memory", ph = "C", ts = m.ts * 1e6, pid = meta.rank or 0,
      args = { MiB = m.bytes / 2 ^ 20 } }
  end
  local other = {}
  for k, v in pairs(meta) do other[k] = v end
  return { traceEvents = ev, displayTimeUnit = "ms", otherData = other }
end

function Profiler:write_trace(path, meta)
  local text = require("cjson").encode(self:trace(meta))
  local f, err = io.open(path, "w")
  if not f then error(("profiler: cannot write the trace %s: %s"):format(path, tostring(err)), 0) end
  local ok, werr = f:write(text, "\n")
  local closed, cerr = f:close()
  if not ok or not closed then -- (a full disk: one line, not a torn trace taken for a whole one)
    os.remove(path)
    error(("profiler: cannot write the trace %s: %s"):format(path, tostring(werr or cerr)), 0)
  end
end

return M
