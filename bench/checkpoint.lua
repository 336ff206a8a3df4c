-- bench/checkpoint.lua — what a checkpoint save costs the training step, for
-- the debug recipe: step time of the steps that save vs those that do not,
-- with synchronous and with async saving, side by side.
--
--   ./titan bench/checkpoint.lua [STEPS] [INTERVAL]
package.path = "./bench/?.lua;" .. package.path
local config = require("titan.config")
local trainer = require("titan.trainer")
local common = require("common")

local steps, interval = tonumber(arg[1] or 24), tonumber(arg[2] or 4)

local function run(mode)
  local dump = os.tmpname()
  os.remove(dump)
  local cfg = config.resolve(config.load_recipe("llama3_debugmodel"), {
    "--job.dump_folder=" .. dump, "--metrics.peak_flops=1e11", "--metrics.enable_jsonl=false",
    "--validation.enable=false", "--checkpoint.enable=" .. tostring(mode ~= "none"),
    "--checkpoint.interval=" .. interval, "--checkpoint.async_mode=" .. (mode == "none" and "disabled" or mode),
    "--checkpoint.keep_latest_k=2", "--training.steps=" .. (steps + 1),
  })
  local tr = trainer.new(cfg, { print = function() end })
  tr:train(1) -- warm-up step (allocator cache, optimizer state)
  local save_t, plain_t = {}, {}
  for s = 2, steps + 1 do
    local t0 = common.now()
    tr:train(s)
    local dt = common.now() - t0
    if mode ~= "none" and s % interval == 0 then save_t[#save_t + 1] = dt else plain_t[#plain_t + 1] = dt end
  end
  tr:close() -- waits for a pending async write
  tr.model:free()
  os.execute("rm -rf '" .. dump .. "'")
  local function mean(t)
    local s = 0
    for _, v in ipairs(t) do s = s + v end
    return #t > 0 and s / #t or 0 / 0
  end
  return mean(plain_t), mean(save_t), #save_t
end

local rows = {}
local base = run("none")
rows[#rows + 1] = { "no checkpoint", ("%.3f"):format(base), "-", "-", "-" }
for _, mode in ipairs({ "disabled", "async" }) do
  local plain, save, n = run(mode)
  rows[#rows + 1] = { mode == "disabled" and "sync save" or "async save", ("%.3f"):format(plain),
    ("%.3f"):format(save), tostring(n), ("%+.1f%%"):format(100 * (save / plain - 1)) }
end
print(("debug recipe (8 x 512 tokens/step), %d steps, a save every %d"):format(steps, interval))
common.print_table({ "mode", "step s (no save)", "step s (with save)", "saves", "save-step overhead" }, rows)
