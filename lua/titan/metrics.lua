-- metrics.lua — one log line per step (TorchTitan's fixed names: loss,
-- grad_norm, lr, memory, tps, tflops, mfu) and a JSONL file of the same.
local titan = require("titan")

local M = {}

M.now = require("titan.clock").now

-- The device's total memory in bytes (the host's for cpu), for the memory
-- percentage; nil where it cannot be read.
function M.device_memory_bytes(device)
  local ok, _, total = pcall(titan.memory_info, device)
  return ok and total or nil
end

-- Peak FLOP/s of this CPU, measured: the best of a few 2048^3 sgemm calls
-- through the engine (the rate a dense model's matmuls can reach here).
function M.measure_cpu_peak_flops()
  local n = 2048
  return titan.scope(function()
    local a, b = titan.randn({ n, n }, { seed = 1 }), titan.randn({ n, n }, { seed = 2 })
    local best = math.huge
    for _ = 1, 4 do
      local t0 = M.now()
      titan.scope(function() titan.ops.raw_matmul(a, b) end)
      best = math.min(best, M.now() - t0)
    end
    return 2 * n ^ 3 / best
  end)
end

local Logger = {}
Logger.__index = Logger

-- opts: jsonl_path (or nil), tensorboard (a titan.tensorboard Writer, or
-- nil: it gets each logged step's scalars), device, peak_flops, flops_per_token, rank,
-- print (where lines go; default: stdout), remeasure_peak (or nil: a
-- function giving a fresh peak estimate, for a peak that was measured; see
-- Logger:log_step)
function M.Logger(opts)
  local self = setmetatable({ opts = opts, t_start = M.now(), t_last = M.now(), tokens_since = 0 }, Logger)
  self.print = opts.print or function(line) io.stdout:write(line, "\n"); io.stdout:flush() end
  self.mem_total = M.device_memory_bytes(opts.device or "cpu")
  if opts.jsonl_path then
    local f, err = io.open(opts.jsonl_path, "a")
    if not f then error("metrics: cannot open " .. opts.jsonl_path .. ": " .. tostring(err), 0) end
    f:close()
    self.jsonl = opts.jsonl_path
  end
  return self
end

-- Account tokens processed since the last log (for tps).
function Logger:add_tokens(n) self.tokens_since = self.tokens_since + n end

local function json_value(v)
  if type(v) == "number" then
    if v ~= v or v == math.huge or v == -math.huge then return "null" end
    return ("%.17g"):format(v) -- round-trips the exact double
  end
  if type(v) == "string" then return ("%q"):format(v) end
  return tostring(v)
end

function Logger:write_jsonl(rec)
  if not self.jsonl then return end
  local keys = {}
  for k in pairs(rec) do keys[#keys + 1] = k end
  table.sort(keys)
  local parts = {}
  for i, k in ipairs(keys) do parts[i] = ("%q:%s"):format(k, json_value(rec[k])) end
  -- One write a record, checked: a full disk stops the job with one line,
  -- and a record half written is cut off (never a torn line).
  local line = "{" .. table.concat(parts, ",") .. "}\n"
  local C = require("titan.ffi").C
  if C.tt_fs_append(self.jsonl, line, #line) ~= 0 then
    error("metrics: " .. require("titan.ffi").ffi.string(C.tt_last_error()) .. "; the job stops (its metrics so far "
      .. "and its checkpoints are whole)", 0)
  end
end

-- rec: step, loss, grad_norm, lr (+ anything else for the JSONL file).
function Logger:log_step(rec)
  local now = M.now()
  local dt = now - self.t_last
  local tps = dt > 0 and self.tokens_since / dt or 0
  local flops = tps * (self.opts.flops_per_token or 0)
  local mfu = self.opts.peak_flops and self.opts.peak_flops > 0 and 100 * flops / self.opts.peak_flops or 0
  -- Above 100%, a measured peak read low: on a shared host a busy moment
  -- during the start-up probe halves it. Measure once more (a peak is a
  -- maximum, so the higher reading stands) and say so; the probe's time is
  -- left out of the next interval's tokens/s.
  local probed_at
  if mfu > 100 and self.opts.remeasure_peak and not self.peak_remeasured then
    self.peak_remeasured = true
    local old = self.opts.peak_flops
    local new = self.opts.remeasure_peak()
    if new > old then
      self.opts.peak_flops = new
      mfu = 100 * flops / new
    end
    self.print(("metrics: mfu above 100%% against the peak measured at start (%.1f GFLOP/s; a busy host then?); "
      .. "measured again: %.1f GFLOP/s, %s"):format(old / 1e9, new / 1e9, new > old and "used from here on"
      or "the first kept (metrics.peak_flops sets this machine's peak)"))
    probed_at = M.now()
  end
  local mem = titan.memory_stats(self.opts.device)
  local gib = mem.allocated / 2 ^ 30
  local peak_gib = mem.peak_allocated / 2 ^ 30
  local pct = self.mem_total and 100 * mem.peak_allocated / self.mem_total or 0
  rec.tps, rec.tflops, rec.mfu = tps, flops / 1e12, mfu
  rec.memory_gib, rec.memory_peak_gib, rec.memory_pct = gib, peak_gib, pct
  rec.elapsed = now - self.t_start
  self.print(("step: %5d  loss: %7.4f  grad_norm: %7.4f  lr: %.2e  memory: %5.2fGiB (peak %.2fGiB, %.2f%%)  "
    .. "tps: %s  tflops: %.3f  mfu: %.2f%%  elapsed: %s%s"):format(
      rec.step, rec.loss, rec.grad_norm or 0, rec.lr or 0, gib, peak_gib, pct, M.commas(tps), flops / 1e12, mfu,
      M.duration(rec.elapsed), rec.moe_max_load and ("  moe load: %.2f"):format(rec.moe_max_load) or ""))
  self:write_jsonl(rec)
  if self.opts.tensorboard then
    local tags = {}
    for field, tag in pairs(M.tensorboard_tags) do tags[tag] = rec[field] end
    self.opts.tensorboard:scalars(rec.step, tags)
  end
  self.t_last, self.tokens_since = probed_at or now, 0
end

-- A step record's fields and their TensorBoard tags (TorchTitan's where it has them).
M.tensorboard_tags = {
  loss = "loss_metrics/global_avg_loss", grad_norm = "grad_norm", lr = "lr", tps = "throughput(tps)",
  tflops = "tflops", mfu = "mfu(%)", memory_gib = "memory/allocated(GiB)",
  memory_peak_gib = "memory/peak_allocated(GiB)", memory_pct = "memory/peak_allocated(%)",
  elapsed = "time_metrics/elapsed(s)", moe_max_load = "moe/max_load",
}

function Logger:log_validation(step, loss, ntok)
  self.print(("validate: step %5d  loss: %7.4f  (%d tokens)"):format(step, loss, ntok))
  self:write_jsonl({ step = step, validation_loss = loss, validation_tokens = ntok })
  if self.opts.tensorboard then self.opts.tensorboard:scalars(step, { ["validation_metrics/loss"] = loss }) end
end

function Logger:close()
  self.jsonl = nil
  if self.opts.tensorboard then self.opts.tensorboard:close() end
end

function M.commas(x)
  local s = ("%d"):format(math.floor(x + 0.5))
  local out = s:reverse():gsub("(%d%d%d)", "%1,"):reverse()
  return (out:gsub("^,", ""))
end

function M.duration(s)
  if s < 60 then return ("%.1fs"):format(s) end
  if s < 3600 then return ("%dm%02ds"):format(math.floor(s / 60), math.floor(s % 60)) end
  return ("%dh%02dm"):format(math.floor(s / 3600), math.floor(s % 3600 / 60))
end

return M
