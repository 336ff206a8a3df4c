-- data/progress.lua — one progress line on stderr, rewritten in place
-- (\r) at most a few times a second: MB processed, tokens, tokens/s. When
-- stderr is not a terminal (a log file, CI), whole lines instead, one every
-- ten seconds and the last: a log of \r-joined redraws reads as one line.
local ffi = require("ffi")

-- Wall clock (os.clock is CPU time) from titan.clock, the process's one
-- declaration of clock_gettime: a second one here with another struct made
-- whichever module loaded later fail (a recipe that required titan.data
-- stopped the trainer's first metrics call).
local now = require("titan.clock").now
pcall(ffi.cdef, "int isatty(int fd);")

local Progress = {}
Progress.__index = Progress

-- Whether out (a Lua file) is a terminal: stdout and stderr are asked by
-- their descriptor; anything else (a file, a test's sink) is not one.
function Progress.is_tty(out)
  local fd = (out == io.stderr and 2) or (out == io.stdout and 1) or nil
  if not fd then return false end
  local ok, r = pcall(function() return ffi.C.isatty(fd) end)
  return ok and r == 1
end

local function human(n)
  if n >= 1e9 then return ("%.2fB"):format(n / 1e9) end
  if n >= 1e6 then return ("%.2fM"):format(n / 1e6) end
  if n >= 1e3 then return ("%.1fK"):format(n / 1e3) end
  return ("%d"):format(n)
end
Progress.human = human

-- Progress.new(label, total_bytes, {out = io.stderr, quiet = false, interval = 0.2,
--   tty = (out is a terminal), log_interval = 10})
function Progress.new(label, total_bytes, opts)
  opts = opts or {}
  local t = now()
  local out = opts.out or io.stderr
  local tty = opts.tty
  if tty == nil then tty = Progress.is_tty(out) end
  return setmetatable({ label = label, total = total_bytes or 0, out = out, quiet = opts.quiet, tty = tty,
    interval = tty and (opts.interval or 0.2) or (opts.log_interval or 10), t0 = t, last = t, width = 0 }, Progress)
end

function Progress:line(bytes, tokens)
  local dt = math.max(now() - self.t0, 1e-9)
  local mb = bytes / 1e6
  local s = ("%s: %.1f MB"):format(self.label, mb)
  if self.total > 0 then s = s .. ("/%.1f MB (%d%%)"):format(self.total / 1e6, math.floor(100 * bytes / self.total)) end
  return s .. (" | %s tokens | %s tokens/s | %.1f MB/s"):format(human(tokens), human(tokens / dt), mb / dt)
end

local function show(self, s, final)
  if not self.tty then
    self.out:write(s, "\n")
  else
    local pad = self.width > #s and (" "):rep(self.width - #s) or ""
    self.width = #s
    self.out:write("\r", s, pad, final and "\n" or "")
  end
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
