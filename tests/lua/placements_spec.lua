-- lua/parallel/placements.lua against what the transforms make: on
-- simulated ranks (titan --simulate N), the trainer is built for a layout
-- and every parameter's box (global shape, offset) and local shape is
-- checked against the placements' (tests/lua/placements_worker.lua); then
-- the 8B recipe's layout on 64 ranks, offline, as the REPL shows it.
local env = require("titan.env")
local sh = dofile("tests/lua/shell.lua")
local exe = env.build_dir .. "/titan"

describe("parameter placements", function()
  local layouts = {
    { 3, "FSDP 3 (uneven rows)", { "--parallelism.dp_shard=3" } },
    { 4, "FSDP 2 x TP 2", { "--parallelism.dp_shard=2", "--parallelism.tp=2" } },
    { 4, "PP 2 Interleaved x FSDP 2", { "--parallelism.pp=2", "--parallelism.dp_shard=2",
      "--parallelism.pipeline_parallel_schedule=Interleaved1F1B", "--training.local_batch_size=4" } },
    { 4, "CP 2 x FSDP 2", { "--parallelism.cp=2", "--parallelism.dp_shard=2" } },
    { 5, "FSDP 5, MoE (empty pieces)", { "--model.flavor=debugmodel_moe", "--parallelism.dp_shard=5" } },
    { 4, "EP 2 x FSDP 4 (experts sharded over replicas)", { "--model.flavor=debugmodel_moe",
      "--parallelism.dp_shard=4", "--parallelism.expert_parallel_degree=2" } },
    { 4, "EP 2 x FSDP 2 x TP 2", { "--model.flavor=debugmodel_moe", "--parallelism.dp_shard=2",
      "--parallelism.tp=2", "--parallelism.expert_parallel_degree=2" } },
  }
  for _, l in ipairs(layouts) do
    local n, name, keys = l[1], l[2], l[3]
    it(name .. ": every parameter where the transforms put it", function()
      local args = { "--training.seq_len=32", "--training.local_batch_size=2" }
      for _, k in ipairs(keys) do args[#args + 1] = k end
      local out = sh.run_ok(("OMP_NUM_THREADS=1 %s --simulate %d tests/lua/placements_worker.lua %s 2>&1"):format(exe, n,
        table.concat(args, " ")))
      for r = 0, n - 1 do assert.truthy(out:find(("rank %d ok %%d+"):format(r)), out) end
    end)
  end

  it("lays out the 8B recipe on 64 ranks (dp_shard 8 x tp 8) offline", function()
    local config = require("titan.config")
    local cfg = config.resolve(dofile("lua/recipes/llama3_8b.lua"), { "--parallelism.dp_shard=8",
      "--parallelism.tp=8" })
    local job = require("parallel.placements").job(cfg, 64, 5)
    local wq = job.params["layers.0.attention.wq.weight"]
    assert.are.same({ 4096, 4096 }, wq.shape)
    -- tp rank 5 holds rows [2560, 3072) of wq; dp_shard rank 0 the first 64 of them
    assert.are.same({ offset = { 2560, 0 }, shape = { 64, 4096 } }, wq:box())
    local wo = job.params["layers.0.attention.wo.weight"]
    assert.are.same({ offset = { 0, 2560 }, shape = { 512, 512 } }, wo:box())
    -- every rank's pieces of wq tile it exactly once
    local seen = {}
    for r = 0, 63 do
      local b = wq:box(wq.mesh:coord_of(r)) -- (coordinates on the parameter's own mesh)
      for row = b.offset[1], b.offset[1] + b.shape[1] - 1 do
        assert.is_nil(seen[row])
        seen[row] = true
      end
    end
    local rows = 0
    for _ in pairs(seen) do rows = rows + 1 end
    assert.are.equal(4096, rows)
    -- a 64th of the 8B parameters in bf16 per rank
    local mem = job:memory()
    assert.is_true(math.abs(mem.params / (8.03e9 * 2 / 64) - 1) < 0.01, tostring(mem.params))
  end)
end)
