-- The debug model with its loss replaced in Lua: cross-entropy plus
-- PaLM's z-loss (1e-4 * mean(log Z^2)), which keeps the softmax normalizer
-- near 1. Nothing is recompiled: the loss is an ordinary Lua function.
--   ./titan lua/recipes/llama3_debugmodel_zloss.lua
local titan = require("titan")
local F = titan.F

return {
  base = "llama3_debugmodel",
  job = { description = "Llama 3 debug model with z-loss", dump_folder = "./outputs/llama3_debugmodel_zloss" },

  loss_fn = function(logits, targets, ctx)
    local V = logits:size(-1)
    local flat = logits:reshape(-1, V)
    local ce = F.cross_entropy(flat, targets:reshape(-1), { num_tokens = ctx.num_tokens })
    -- log Z per row = logsumexp; log_softmax = x - log Z, so log Z = x[0] - log_softmax[0]
    local first = flat:narrow(2, 1, 1)
    local logz = first - flat:log_softmax():narrow(2, 1, 1)
    local z = (logz * logz):sum() * (1e-4 / ctx.num_tokens)
    return ce + z
  end,
}
