-- Run by tests/lua/dtensor_spec.lua on every rank of `titan --simulate N` or
-- `titan --nproc N` (Open MPI): DTensor's redistribute between every pair of
-- placements on a 1-D mesh of all ranks and a 2 x N/2 mesh, against the
-- pieces cut from the whole tensor, bit for bit. Prints "rank R ok K" (K
-- pairs checked).
local titan = require("titan")
local dist = require("titan.dist")
local meshlib = require("titan.mesh")
local dt = require("titan.dtensor")

local g = assert(dist.world_group(), "dtensor_worker: expected several ranks")
local r, n = g:rank(), g:size()
-- 5 x 7 distinct small integers: sums over ranks stay exact in float32
local full = titan.arange(35):reshape(5, 7):contiguous()
local kinds = { dt.Replicate(), dt.Shard(1), dt.Shard(2), dt.Partial("sum") }

local meshes = { meshlib.new({ "a" }, { n }, { group = g }) }
if n % 2 == 0 and n > 2 then meshes[2] = meshlib.new({ "a", "b" }, { 2, n / 2 }, { group = g }) end

local function same(a, b, what)
  local x, y = a:tolist_flat(), b:tolist_flat()
  assert(#x == #y, ("rank %d %s: %d values, expected %d"):format(r, what, #x, #y))
  for i = 1, #x do
    assert(x[i] == y[i], ("rank %d %s: element %d is %s, expected %s"):format(r, what, i, x[i], y[i]))
  end
end

local k = 0
for _, mesh in ipairs(meshes) do
  local nd = #mesh:names()
  -- every combination of placements over the mesh dims, from and to
  local combos = {}
  local function gen(i, acc)
    if i > nd then combos[#combos + 1] = { unpack(acc) }; return end
    for _, p in ipairs(kinds) do acc[i] = p; gen(i + 1, acc) end
  end
  gen(1, {})
  for _, from in ipairs(combos) do
    for _, to in ipairs(combos) do
      do
        local what = ("%s -> %s on %s"):format(dt.DTensor.placements_str({ mesh = mesh, placements = from }),
          dt.DTensor.placements_str({ mesh = mesh, placements = to }), table.concat(mesh:shape(), "x"))
        local x = dt.distribute(full, mesh, from):redistribute(to)
        local partial = false
        for _, p in ipairs(to) do partial = partial or p.kind == "partial" end
        if partial then
          same(x:full_tensor(), full, what)
        else
          same(x:to_local(), dt.distribute(full, mesh, to):to_local(), what)
        end
        k = k + 1
      end
    end
  end
end
print(("rank %d ok %d"):format(r, k))
