-- lua/titan/dtensor.lua: placements, boxes and printing in one process on
-- an offline mesh, then redistribute between every pair of placements on 1-
-- and 2-D meshes of simulated ranks and of Open MPI processes
-- (tests/lua/dtensor_worker.lua), bit for bit against the pieces of the
-- whole tensor.
local titan = require("titan")
local dist = require("titan.dist")
local env = require("titan.env")
local meshlib = require("titan.mesh")
local dt = require("titan.dtensor")
local sh = dofile("tests/lua/shell.lua")
local exe = env.build_dir .. "/titan"

describe("DTensor", function()
  it("cuts uneven and empty pieces as torch.chunk does, and prints them", function()
    local m = meshlib.new({ "dp" }, { 4 }, { rank = 3, fake = true })
    local sizes = {}
    for r = 0, 3 do sizes[#sizes + 1] = dt.local_box({ 10, 2 }, m, { dt.Shard(1) }, { r }).shape[1] end
    assert.are.same({ 3, 3, 3, 1 }, sizes)
    local m8 = meshlib.new({ "dp" }, { 8 }, { rank = 6, fake = true })
    assert.are.same({ offset = { 5 }, shape = { 0 } }, dt.local_box({ 5 }, m8, { dt.Shard(1) }, { 6 }))
    local d = dt.meta({ 10, 4 }, "float32", m, { dt.Shard(1) })
    assert.are.equal("DTensor(shape=[10, 4], dtype=float32, placements=(dp: Shard(1)); rank 3 holds [1, 4] at offset "
      .. "[9, 0], no data)", tostring(d))
    assert.truthy(d:describe():find("ranks [2]: [3, 4] at offset [6, 0]", 1, true))
    assert.are.equal(16, d:bytes_local())
  end)

  it("nests shards in mesh order or in the order given", function()
    local m = meshlib.new({ "dp", "tp" }, { 2, 2 }, { rank = 1, fake = true })
    local pl = { dt.Shard(1), dt.Shard(1) }
    assert.are.same({ offset = { 3 }, shape = { 2 } }, dt.local_box({ 10 }, m, pl, { 0, 1 }))
    assert.are.same({ offset = { 5 }, shape = { 3 } }, dt.local_box({ 10 }, m, pl, { 0, 1 }, { "tp", "dp" }))
  end)

  it("finds who holds a box, and distributes a tensor into pieces", function()
    local m = meshlib.new({ "dp" }, { 3 }, { rank = 1, fake = true })
    local owners = dt.owners({ 7, 2 }, m, { dt.Shard(1) }, { offset = { 2, 0 }, shape = { 4, 2 } })
    assert.are.equal(2, #owners)
    assert.are.same({ rank = 0, box = { offset = { 2, 0 }, shape = { 1, 2 } } }, owners[1])
    assert.are.same({ rank = 1, box = { offset = { 3, 0 }, shape = { 3, 2 } } }, owners[2])
    local full = titan.arange(14):reshape(7, 2):contiguous()
    local x = dt.distribute(full, m, { dt.Shard(1) })
    assert.are.same({ 6, 7, 8, 9, 10, 11 }, x:to_local():tolist_flat())
    local p = dt.distribute(full, m, { dt.Partial("sum") })
    assert.are.same({ 0, 0, 0, 0 }, { unpack(p:to_local():tolist_flat(), 1, 4) }) -- (rank 1: zeros)
    assert.are.same({ 0, 1, 2, 3 }, { unpack(full:tolist_flat(), 1, 4) })           -- (full untouched)
    local plan = dt.plan(m, { dt.Partial("sum") }, { dt.Shard(2) })
    assert.are.equal("reduce_scatter", plan[1].kind)
    assert.are.equal(2, plan[1].dim)
  end)

  it("says what is wrong in one line", function()
    local m = meshlib.new({ "dp", "tp" }, { 2, 2 }, { rank = 0, fake = true })
    local ok, err = pcall(dt.meta, { 4 }, "float32", m, { dt.Shard(1) })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("1 placements for a mesh of 2 dims (dp, tp); expected one per mesh dim", 1, true),
      err)
    ok, err = pcall(dt.Shard, 0)
    assert.truthy(tostring(err):find("expected a tensor dim >= 1 (dims are 1-based)", 1, true), err)
    ok, err = pcall(dt.meta, { 4 }, "float32", m, { tq = dt.Shard(1) })
    assert.truthy(tostring(err):find("placements name 'tq', not a dim of the mesh (dp, tp)", 1, true), err)
    ok, err = pcall(dt.plan, m, { dt.Partial("sum"), dt.Replicate() }, { dt.Partial("max"), dt.Replicate() })
    assert.is_false(ok)
  end)

  local function worker(launch, n)
    local out = sh.run_ok(("OMP_NUM_THREADS=1 %s %s %d tests/lua/dtensor_worker.lua 2>&1"):format(exe, launch, n))
    for r = 0, n - 1 do assert.truthy(out:find(("rank %d ok %d"):format(r, n == 4 and 272 or 16), 1, true), out) end
  end
  it("redistributes every pair on 3 and 2 x 2 simulated ranks, bit for bit", function()
    worker("--simulate", 3)
    worker("--simulate", 4)
  end)
  it("redistributes every pair on 4 processes over Open MPI, bit for bit", function()
    if not dist.built("mpi") then return pending("titan was built without Open MPI (libopenmpi-dev)") end
    worker("--nproc", 4)
  end)
end)
