-- Run by parallelize_spec.lua as `titan --simulate 2 tests/lua/parallelize_worker.lua RECIPE KEYS...`:
-- builds the trainer of RECIPE on this rank and prints, per rank, the
-- local and global shapes of the output layer and the embedding, and the
-- layout's placements of the output layer (what checkpoints save by).
local config = require("titan.config")
local dist = require("titan.dist")
local trainer = require("titan.trainer")

local recipe = config.load_recipe(arg[1])
local keys = { "--validation.enable=false", "--metrics.enable_jsonl=false",
  "--metrics.peak_flops=1e11", "--training.steps=0",
  "--checkpoint.enable=false", "--job.dump_folder=" .. os.tmpname() .. ".d" }
for i = 2, #arg do keys[#keys + 1] = arg[i] end
local cfg = config.resolve(recipe, keys)
local env = dist.env()
local tr = trainer.new(cfg, { print = function() end })
local shapes = {}
for _, np in ipairs(tr.model:named_parameters()) do shapes[np[1]] = table.concat(np[2]:shape(), "x") end
local d = tr.par.layout.params["output.weight"]
print(("rank %d output %s embedding %s layout %s loss_parallel %s"):format(env.rank, shapes["output.weight"],
  shapes["tok_embeddings.weight"], table.concat(d:box().shape, "x"), tostring(tr.par.loss_parallel or false)))
tr:close()
