-- data/progress.lua — one progress line on stderr, rewritten in place
-- (\r) at most a few times a second: MB processed, tokens, tokens/s.
local ffi = require("ffi")

-- Wall clock through clock_gettime (os.clock is CPU time). The cdefs are
-- guarded: another module may have declared them already.
pcall(ffi.cdef, "struct timespec { long tv_sec; long tv_nsec; };")
pcall(ffi.cdef, "int clock_gettime(int clk_id, struct timespec *tp);")
local ts_ok, ts = pcall(ffi.new, "struct timespec")
local CLOCK_MONOTONIC = 1

local function now()
  if ts_ok and ffi.C.clock_gettime(CLOCK_MONOTONIC, ts) == 0 then
    return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
  end
  return os.time()
end

local Progress = {}
Progress.__index = Progress

local function human(n)
  if n >= 1e9 then return ("%.2fB"):format(n / 1e9) end
  if n >= 1e6 then return ("%.2fM"):format(n / 1e6) end
  if n >= 1e3 then return ("%.1fK"):format(n / 1e3) end
  return ("%d"):format(n)
end
Progress.human = human

-- Progress.new(label, total_bytes, {out = io.stderr, quiet = false, interval = 0.2})
function Progress.new(label, total_bytes, opts)
  opts = opts or {}
  local t = now()
  return setmetatable({ label = label, total = total_bytes or 0, out = opts.out or io.stderr,
    quiet = opts.quiet, interval = opts.interval or 0.2, t0 = t, last = t, width = 0 }, Progress)
end

function Progress:line(bytes, tokens)
  local dt = math.max(now() - self.t0, 1e-9)
  local mb = bytes / 1e6
  local s = ("%s: %.1f MB"):format(self.label, mb)
  if self.total > 0 then s = s .. ("/%.1f MB (%d%%)"):format(self.total / 1e6, math.floor(100 * bytes / self.total)) end
  return s .. (" | %s tokens | %s tokens/s | %.1f MB/s"):format(human(tokens), human(tokens / dt), mb / dt)
end

local function show(self, s, final)
  local pad = self.width > #s and (" "):rep(self.width - #s) or ""
  self.width = #s
  self.out:write("\r", s, pad, final and "\n" or "")
  self.out:flush()
end

-- Cheap to call per document: redraws only every `interval` seconds.
function Progress:update(bytes, tokens)
  if self.quiet then return end
  local t = now()
  if t - self.last < self.interval then return end
  self.last = t
  show(self, self:line(bytes, tokens), false)
end

function Progress:finish(bytes, tokens)
  self.seconds = now() - self.t0
  if self.quiet then return end
  show(self, self:line(bytes, tokens) .. (" | %.1fs"):format(self.seconds), true)
end

return Progress
