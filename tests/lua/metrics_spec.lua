-- The training log's throughput figures (lua/titan/metrics.lua): MFU against
-- the peak, and a measured peak that read low being measured again once.
local metrics = require("titan.metrics")

-- A logger whose lines land in `lines`; `probes` lists what successive
-- re-measurements return (nil: no re-measuring, as for a configured peak).
local function logger(peak, probes)
  local lines, calls = {}, 0
  local remeasure = probes and function()
    calls = calls + 1
    return probes[calls]
  end or nil
  local log = metrics.Logger({ device = "cpu", peak_flops = peak, flops_per_token = 1e6,
    print = function(line) lines[#lines + 1] = line end, remeasure_peak = remeasure })
  return log, lines, function() return calls end
end

local function step(log, tokens)
  log:add_tokens(tokens)
  log:log_step({ step = 1, loss = 1, grad_norm = 1, lr = 1e-3 })
end

local function mfu_of(line) return tonumber(line:match("mfu: ([%d.]+)%%")) end

describe("metrics.Logger", function()
  it("reports MFU as model FLOP/s over the peak", function()
    local log, lines = logger(1e30, nil)
    step(log, 1000)
    assert.equal(1, #lines)
    assert.truthy(lines[1]:match("^step:%s+1 "))
    assert.is_true(mfu_of(lines[1]) < 1)
  end)

  it("measures a low measured peak once more when MFU passes 100%, and keeps the higher", function()
    -- 1e6 tokens of 1e6 FLOPs in well under a second: far above a 1 FLOP/s peak.
    local log, lines, calls = logger(1, { 1e30, 1e30 })
    step(log, 1e6)
    assert.equal(1, calls())
    assert.equal(2, #lines)
    assert.truthy(lines[1]:find("mfu above 100% against the peak measured at start", 1, true))
    assert.truthy(lines[1]:find("used from here on", 1, true))
    assert.is_true(mfu_of(lines[2]) < 1, lines[2]) -- the step line uses the new peak
    step(log, 1e6)
    assert.equal(1, calls()) -- once per run
    assert.equal(3, #lines)
  end)

  it("keeps the first peak when the second reading is not higher, and says how to set it", function()
    local log, lines, calls = logger(1, { 0.5 })
    step(log, 1e6)
    step(log, 1e6)
    assert.equal(1, calls())
    assert.equal(3, #lines)
    assert.truthy(lines[1]:find("the first kept (metrics.peak_flops sets this machine's peak)", 1, true))
    assert.is_true(mfu_of(lines[2]) > 100)
  end)

  it("never re-measures a configured peak", function()
    local log, lines = logger(1, nil)
    step(log, 1e6)
    assert.equal(1, #lines)
    assert.is_true(mfu_of(lines[1]) > 100)
  end)
end)
