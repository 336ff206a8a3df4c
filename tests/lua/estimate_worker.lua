-- Run by estimate_spec.lua as `titan --simulate N tests/lua/estimate_worker.lua KEYS...`:
-- trains the debug model 2 steps for real on these ranks; rank 0 prints, as
-- JSON, its allocator's peak over the run and what each of its mesh's
-- process groups carried in step 2, by kind (what titan estimate predicts).
local cjson = require("cjson")
local config = require("titan.config")
local dist = require("titan.dist")
local titan = require("titan")
local trainer = require("titan.trainer")

local keys = { "--validation.enable=false", "--metrics.enable_jsonl=false",
  "--metrics.peak_flops=1e11", "--checkpoint.enable=false",
  "--training.steps=2", "--job.dump_folder=" .. os.tmpname() .. ".d" }
for _, a in ipairs(arg) do keys[#keys + 1] = a end
local cfg = config.resolve(config.load_recipe("lua/recipes/llama3_debugmodel.lua"), keys)
local tr = trainer.new(cfg, { print = function() end })
tr:train(1)
local groups = tr.par.mesh:made_groups()
for _, e in ipairs(groups) do e.group:reset_traffic() end
tr:train(2)
local traffic = {}
for _, e in ipairs(groups) do traffic[e.label] = e.group:traffic().bytes end
if dist.env().rank == 0 then
  print(cjson.encode({ peak = titan.memory_stats("cpu").peak_allocated, traffic = traffic }))
end
tr:close()
