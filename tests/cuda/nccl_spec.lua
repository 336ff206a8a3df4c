-- The nccl backend at world size 1 on one GPU (exits 77 — skipped — without one).
local titan = require("titan")
if not titan.cuda_available() then
  io.stderr:write("no CUDA device (or built without TITAN_CUDA): skipped\n")
  os.exit(77)
end
local dist = require("titan.dist")

describe("nccl at world 1", function()
  it("creates a communicator and runs every collective exactly", function()
    local g = dist.new_group({ backend = "nccl", rank = 0, world = 1, unique_id = dist.unique_id(), device = 0 })
    local t = titan.tensor({ 1, 2, 3, 4 }):to("cuda")
    assert.are.same({ 1, 2, 3, 4 }, g:all_reduce(t, "sum"):to("cpu"):tolist())
    assert.are.same({ 1, 2, 3, 4 }, g:all_gather(t):to("cpu"):tolist())
    assert.are.same({ 1, 2, 3, 4 }, g:reduce_scatter(t, "avg"):to("cpu"):tolist())
    assert.are.same({ 1, 2, 3, 4 }, g:broadcast(t, 0):to("cpu"):tolist())
    assert.are.same({ 1, 2, 3, 4 }, g:all_to_all(t):to("cpu"):tolist())
    local b = titan.tensor({ 1.5, -2 }):to("bfloat16"):to("cuda")
    assert.are.same({ 1.5, -2 }, g:all_reduce(b, "sum"):to("cpu"):float():tolist())
    g:barrier()
    local sub = g:split(0, 0)
    assert.are.equal(1, sub:size())
    sub:free()
    g:free()
  end)

  -- The collectives run on the communication stream: each must wait for
  -- the compute work queued before it (its input is computed right before)
  -- and the compute stream for it (its input is overwritten right after,
  -- its output read). On cuemu with TITAN_CUEMU_STREAMS=deferred a missing
  -- fence either way shows here.
  it("orders each collective between the compute work before and after it", function()
    local g = dist.new_group({ backend = "nccl", rank = 0, world = 1, unique_id = dist.unique_id(), device = 0 })
    local x = titan.tensor({ 1, 2, 3, 4 }):to("cuda")
    local ops = {
      all_gather = function(y) return g:all_gather(y) end,
      reduce_scatter = function(y) return g:reduce_scatter(y, "sum") end,
      all_to_all = function(y) return g:all_to_all(y) end,
    }
    for _, name in ipairs({ "all_gather", "reduce_scatter", "all_to_all" }) do
      local y = x * 2
      local out = ops[name](y)
      y:fill_(-1)
      assert.are.same({ 2, 4, 6, 8 }, out:to("cpu"):tolist(), name)
    end
    g:free()
  end)

  it("refuses host tensors with one line", function()
    local g = dist.new_group({ backend = "nccl", rank = 0, world = 1, unique_id = dist.unique_id(), device = 0 })
    local ok, err = pcall(function() g:all_reduce(titan.ones(2)) end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("needs CUDA tensors", 1, true))
    g:free()
  end)
end)
