-- Run by parallelize_spec.lua as `titan --simulate N tests/lua/grads_worker.lua KEYS...`:
-- trains the debug model 2 steps twice on these ranks, with the gradient
-- norm and update on the host and then on the device path (which the CPU
-- backend runs too), and prints rank 0's norms of both as %.17g.
local config = require("titan.config")
local dist = require("titan.dist")
local trainer = require("titan.trainer")

local keys = { "--validation.enable=false", "--metrics.enable_jsonl=false",
  "--metrics.peak_flops=1e11", "--training.steps=2",
  "--checkpoint.enable=false", "--training.seq_len=32", "--training.max_norm=0.5", "--metrics.log_freq=1",
  "--lr_scheduler.warmup_steps=2", "--training.shuffle=false" }
for _, a in ipairs(arg) do keys[#keys + 1] = a end
local function norms(device)
  local cfg = config.resolve(config.load_recipe("lua/recipes/llama3_debugmodel.lua"),
    { "--job.dump_folder=" .. os.tmpname() .. ".d", unpack(keys) })
  local tr = trainer.new(cfg, { print = function() end })
  tr.device_update = device
  local out = {}
  local log = tr.logger.log_step
  tr.logger.log_step = function(self, rec)
    local n = rec.grad_norm
    out[#out + 1] = ("%.17g"):format(type(n) == "function" and n() or n)
    return log(self, rec)
  end
  tr:train()
  tr:close()
  return table.concat(out, " ")
end
local host, dev = norms(false), norms(true)
if dist.env().rank == 0 then print("host " .. host); print("device " .. dev) end
