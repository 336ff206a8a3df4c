-- Run by tests/lua/placements_spec.lua on every rank of `titan --simulate N
-- tests/lua/placements_worker.lua --key=value ...`: builds the trainer for
-- the debug recipe with those keys, then checks that each of this rank's
-- parameters lies where lua/parallel/placements.lua says, against what the
-- transforms themselves made: FSDP's rows of TP's slice (their own boxes,
-- composed here as the trainer did before it took its boxes from the
-- placements) and the local tensors' shapes. Prints "rank R ok N" (N
-- parameters checked).
local config = require("titan.config")
local dist = require("titan.dist")
local trainer = require("titan.trainer")
local placements = require("parallel.placements")

local recipe = dofile("lua/recipes/llama3_debugmodel.lua")
local keys = { "--validation.enable=false", "--metrics.enable_jsonl=false",
  "--metrics.peak_flops=1e11", "--training.steps=1",
  "--job.dump_folder=" .. os.tmpname() .. ".d" }
for _, a in ipairs(arg) do keys[#keys + 1] = a end
local cfg = config.resolve(recipe, keys)
local env = dist.env()
local tr = trainer.new(cfg, { print = function() end })
local job = placements.job(cfg, env.world, env.rank)

local function same(a, b) return table.concat(a, ",") == table.concat(b, ",") end
-- The transforms' own box of a parameter: FSDP's rows are rows of the TP slice.
local function transforms_box(name)
  local ls, lo, gs, go
  if tr.par.fsdp then ls, lo = tr.par.fsdp.shard_of(name) end
  if tr.par.tp_plan then gs, go = tr.par.tp_plan.shard_of(name) end
  if ls and gs then
    local off = {}
    for d = 1, #gs do off[d] = go[d] + lo[d] end
    return gs, off
  end
  return gs or ls, go or lo
end
local locals = {}
for _, np in ipairs(tr.model:named_parameters()) do locals[np[1]] = np[2] end
local n = 0
for _, name in ipairs(job.names) do
  local d = job.params[name]
  local box = d:box()
  local gshape, off = nil, nil
  gshape, off = transforms_box(name)
  if not gshape then -- whole on this rank
    gshape, off = d.shape, {}
    for i = 1, #gshape do off[i] = 0 end
    assert(same(box.shape, d.shape), ("rank %d %s: the trainer holds it whole, the layout %s"):format(env.rank, name,
      tostring(d)))
  end
  assert(same(gshape, d.shape), ("rank %d %s: global %s in the trainer, %s in the layout"):format(env.rank, name,
    table.concat(gshape, "x"), table.concat(d.shape, "x")))
  assert(same(off, box.offset), ("rank %d %s: offset %s in the trainer, %s in the layout (%s)"):format(env.rank, name,
    table.concat(off, ","), table.concat(box.offset, ","), tostring(d)))
  local p = locals[name]
  if p and p:numel() > 0 and tr.par.fsdp == nil then
    assert(same(p:shape(), box.shape), ("rank %d %s: local %s, layout %s"):format(env.rank, name,
      table.concat(p:shape(), "x"), table.concat(box.shape, "x")))
  end
  n = n + 1
end
-- every local parameter is in the layout
for name in pairs(locals) do assert(job.params[name], ("rank %d: %s is not in the layout"):format(env.rank, name)) end
tr:close()
print(("rank %d ok %d"):format(env.rank, n))
