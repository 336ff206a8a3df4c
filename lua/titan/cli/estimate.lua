-- titan estimate RECIPE.lua --world N [--device h100|h200|cpu] [--json] [--section.key=value ...]
--
-- Memory, FLOPs, communication and step time of a job on N ranks, worked
-- out on this machine without the hardware: the trainer's start-up and two
-- training steps on the meta device over fake process groups, one rank per
-- pipeline stage (lua/titan/estimate.lua; docs/estimate.md).
local M = {}

local usage = [[
usage: titan estimate RECIPE.lua --world N [--device h100|h200|cpu] [--json] [--section.key=value ...]
  --world N        the job's ranks (default 1)
  --device NAME    the machine each rank runs on: h100, h200 (lua/titan/devices.lua) or cpu (this one);
                   default h100 for a cuda recipe, else cpu
  --json           the report as JSON, for scripts
  --section.key=value   config overrides, as for training]]

local function fail(msg)
  io.stderr:write("titan estimate: " .. msg .. "\n")
  os.exit(1)
end

function M.main(...)
  local args = { ... }
  local recipe, world, device, json = nil, 1, nil, false
  local keys = {}
  local i = 1
  while i <= #args do
    local a = args[i]
    if a == "--help" or a == "-h" then
      print(usage)
      return
    elseif a == "--world" or a:match("^%-%-world=") then
      local v = a:match("^%-%-world=(.*)$")
      if not v then i = i + 1; v = args[i] end
      world = tonumber(v)
      if not world or world < 1 or world % 1 ~= 0 then
        fail(("--world %s; expected a positive number of ranks"):format(tostring(v)))
      end
    elseif a == "--device" or a:match("^%-%-device=") then
      local v = a:match("^%-%-device=(.*)$")
      if not v then i = i + 1; v = args[i] end
      if not v then fail("--device needs a name (h100, h200, cpu)") end
      device = v
    elseif a == "--json" then
      json = true
    elseif a:sub(1, 2) == "--" then
      keys[#keys + 1] = a
    elseif not recipe then
      recipe = a
    else
      fail(("unexpected argument '%s'\n%s"):format(a, usage))
    end
    i = i + 1
  end
  if not recipe then fail("needs a recipe\n" .. usage) end
  local config = require("titan.config")
  local ok, cfg = pcall(function() return config.resolve(config.load_recipe(recipe), keys) end)
  if not ok then fail(tostring(cfg)) end
  local est = require("titan.estimate")
  local ok2, rep = pcall(est.run, cfg, world, { device = device })
  if not ok2 then fail(tostring(rep)) end
  if json then
    local cjson = require("cjson")
    local out = { model = rep.model, world = rep.world, device = rep.device.name, roles = {} }
    for _, r in ipairs(rep.roles) do
      out.roles[#out.roles + 1] = { rank = r.rank, stage = r.stage, params = r.params, optimizer = r.optimizer,
        grads = r.grads, activations = r.activations, peak = r.peak, fits = r.fits, tokens = r.tokens,
        flops = r.time.flops, step_s = r.time.step_s, tokens_per_s = r.time.tokens_per_s, mfu = r.time.mfu,
        traffic = r.traffic, would_fit = r.would_fit }
    end
    print(cjson.encode(out))
  else
    print(est.format(rep))
  end
end

return M
