-- The debug model where rank TITAN_FAULT_RANK (default 1) stops itself
-- (SIGSTOP, as a frozen process or a hung device) at step TITAN_FAULT_STEP
-- (default 3), inside its loss: the other ranks then wait in the step's
-- gradient sums (tests/faults/jobs_spec.lua).
local titan = require("titan")
local F = titan.F
local at = tonumber(os.getenv("TITAN_FAULT_STEP") or "3")
local who = tonumber(os.getenv("TITAN_FAULT_RANK") or "1")

return {
  base = "llama3_debugmodel",
  loss_fn = function(logits, targets, ctx)
    if ctx.step == at and require("titan.dist").env().rank == who then
      os.execute("kill -STOP " .. require("titan.checkpoint.fs").pid())
    end
    local V = logits:size(-1)
    return F.cross_entropy(logits:reshape(-1, V), targets:reshape(-1), { num_tokens = ctx.num_tokens })
  end,
}
