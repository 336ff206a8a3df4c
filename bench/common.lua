-- common.lua — helpers shared by the benchmarks: a monotonic clock, a
-- best-of-N timer and a table printer. Benchmarks print figures; they never
-- assert on time.
local M = {}
M.now = require("titan.clock").now

-- Best (minimum) seconds per call of fn over `reps` timed calls after
-- `warmup` untimed ones: the minimum is the least noisy estimate on a
-- shared machine.
function M.best_time(fn, reps, warmup)
  for _ = 1, warmup or 1 do fn() end
  local best = math.huge
  for _ = 1, reps or 5 do
    local t0 = M.now()
    fn()
    local dt = M.now() - t0
    if dt < best then best = dt end
  end
  return best
end

-- print_table({"col1", "col2"}, {{...}, {...}})
function M.print_table(header, rows)
  local widths = {}
  for i, h in ipairs(header) do widths[i] = #h end
  for _, r in ipairs(rows) do
    for i, v in ipairs(r) do
      local s = tostring(v)
      if #s > widths[i] then widths[i] = #s end
    end
  end
  local function line(cells)
    local out = {}
    for i, v in ipairs(cells) do out[i] = (" "):rep(widths[i] - #tostring(v)) .. tostring(v) end
    print("| " .. table.concat(out, " | ") .. " |")
  end
  line(header)
  local sep = {}
  for i = 1, #header do sep[i] = ("-"):rep(widths[i]) end
  print("|-" .. table.concat(sep, "-|-") .. "-|")
  for _, r in ipairs(rows) do line(r) end
end

return M
