-- The debug model trained on a weighted mixture of two datasets, with the
-- sampling written in Lua: each micro-batch comes from dataset A with
-- probability 0.7 and from dataset B otherwise (here the fortunes corpus
-- split into its "offensive"-free part and the rest, so it runs anywhere).
--   ./titan lua/recipes/llama3_debugmodel_mix.lua
local data = require("titan.data")

return {
  base = "llama3_debugmodel",
  job = { description = "Llama 3 debug model, weighted data mixture", dump_folder = "./outputs/llama3_debugmodel_mix" },

  build_data = function(cfg, tokenizer, dp)
    return data.build_mixture(cfg, tokenizer, dp, {
      { name = "fortunes-a", weight = 0.7, files = data.fortune_files({ from = "a", to = "l" }) },
      { name = "fortunes-b", weight = 0.3, files = data.fortune_files({ from = "m", to = "z" }) },
    })
  end,
}
