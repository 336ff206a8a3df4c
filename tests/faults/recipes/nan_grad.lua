-- The debug model with a loss that stays finite at step TITAN_FAULT_STEP
-- (default 3) while every gradient of that step is NaN: 0 * sum(sqrt(z)) at
-- z = 0 adds 0 to the loss and 0 * inf = NaN to the gradients
-- (tests/faults/numerics_spec.lua). TITAN_FAULT_RANK: only on that rank.
local titan = require("titan")
local F = titan.F
local at = tonumber(os.getenv("TITAN_FAULT_STEP") or "3")
local who = tonumber(os.getenv("TITAN_FAULT_RANK") or "-1")

return {
  base = "llama3_debugmodel",
  loss_fn = function(logits, targets, ctx)
    local V = logits:size(-1)
    local ce = F.cross_entropy(logits:reshape(-1, V), targets:reshape(-1), { num_tokens = ctx.num_tokens })
    if ctx.step ~= at or (who >= 0 and require("titan.dist").env().rank ~= who) then return ce end
    return ce + (logits - logits):sqrt():sum() * 0
  end,
}
