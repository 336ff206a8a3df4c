-- lr_scheduler.lua — warmup, then a stable phase, then decay (WSD), as a
-- pure function of the step, so resuming needs only the step number.
--
--   factor(s) = s / warmup                               for s <= warmup
--             = 1                                        during the stable phase
--             = min + (1 - min) * curve(p)               while decaying, p in (0, 1]
--   curve: linear 1 - p | sqrt 1 - sqrt(p) | cosine (1 + cos(pi p)) / 2
--
-- decay_ratio = -1 decays over every step after the warmup (no stable phase).
local M = {}

function M.new(cfg, steps)
  local warmup = math.max(0, math.floor(cfg.warmup_steps))
  local decay
  if cfg.decay_ratio and cfg.decay_ratio >= 0 then
    decay = math.floor(cfg.decay_ratio * steps + 0.5)
  else
    decay = steps - warmup
  end
  decay = math.max(0, math.min(decay, steps - warmup))
  local stable = math.max(0, steps - warmup - decay)
  local min = cfg.min_lr_factor or 0
  local kind = cfg.decay_type or "linear"
  local curves = {
    linear = function(p) return 1 - p end,
    sqrt = function(p) return 1 - math.sqrt(p) end,
    cosine = function(p) return 0.5 * (1 + math.cos(math.pi * p)) end,
  }
  local curve = curves[kind]
  if not curve then error("lr_scheduler: unknown decay_type '" .. tostring(kind) .. "'", 2) end
  local self = { warmup = warmup, stable = stable, decay = decay }
  -- The multiplier of the base learning rate at step s (1-based).
  function self.factor(s)
    if s <= warmup then return s / warmup end
    if s <= warmup + stable or decay == 0 then return 1 end
    local p = math.min(1, (s - warmup - stable) / decay)
    return min + (1 - min) * curve(p)
  end
  return self
end

return M
