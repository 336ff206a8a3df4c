-- The simulator: `titan --simulate N` runs the N ranks of a job in one
-- process (engine/sim.c, the local collectives backend). Every collective
-- against the values each rank can work out (the mpi worker, on the local
-- backend), then the same recipe and keys under --simulate N and under
-- --nproc N (Open MPI): the losses, gradient norms and rank 0's peak memory
-- of every step equal bit for bit, for each parallelism and some of their
-- combinations; then the simulator's own bad input (deadlocks, mismatched
-- collectives, a failing rank).
local dist = require("titan.dist")
local env = require("titan.env")
local cjson = require("cjson")
local sh = dofile("tests/lua/shell.lua")

local exe = env.build_dir .. "/titan"
local mpi = dist.built("mpi")

local BASE = { "lua/recipes/llama3_debugmodel.lua", "--metrics.peak_flops=1e11", "--metrics.log_freq=1",
  "--training.seq_len=32", "--validation.enable=false", "--training.shuffle=false", "--lr_scheduler.warmup_steps=2",
  "--training.steps=3" }

-- Without address-space randomization where the system allows it: a rank's
-- peak memory depends on the address-space layout (under ASLR, about one run
-- in ten of EP 2 x FSDP 4 peaks 3 KB lower at step 1, simulated or over MPI
-- alike, at this session's first commit too: some choice follows addresses,
-- not yet found); with one layout both give the same bits, run after run.
local NO_ASLR = select(2, sh.run("setarch -R true")) == 0 and "setarch -R " or ""

local function cmd(launch, n, dump, keys)
  local args = {}
  for _, a in ipairs(sh.with(BASE, keys)) do args[#args + 1] = sh.quote(a) end
  args[#args + 1] = sh.quote("--job.dump_folder=" .. dump)
  return ("OMP_NUM_THREADS=1 %s%s %s %d %s"):format(NO_ASLR, exe, launch, n, table.concat(args, " "))
end

-- Each step's record of metrics.jsonl (rank 0's), by step.
local function records(dump)
  local out = {}
  for line in io.lines(dump .. "/metrics.jsonl") do
    local r = cjson.decode(line)
    if r.loss then out[r.step] = r end
  end
  return out
end

describe("titan --simulate", function()
  it("runs every collective of the mpi worker on 3 simulated ranks", function()
    local out, rc = sh.run(exe .. " --simulate 3 tests/lua/mpi_worker.lua 2>&1")
    assert.are.equal(0, rc, out)
    local k = 0
    for _ in out:gmatch("rank %d ok ") do k = k + 1 end
    for r = 0, 2 do assert.truthy(out:find(("rank %d ok all"):format(r), 1, true), out) end
    assert.are.equal(3 * 62, k, out)
  end)

  -- name, ranks, keys
  local layouts = {
    { "DDP 3", 3, { "--parallelism.dp_replicate=3", "--parallelism.dp_shard=1", "--training.local_batch_size=2" } },
    { "FSDP 3", 3, { "--parallelism.dp_shard=3", "--training.local_batch_size=2" } },
    { "HSDP 2 x 2", 4, { "--parallelism.dp_replicate=2", "--parallelism.dp_shard=2", "--training.local_batch_size=2" } },
    { "TP 2 with SP", 2, { "--parallelism.tp=2", "--training.local_batch_size=4" } },
    { "PP 2 GPipe", 2, { "--parallelism.pp=2", "--parallelism.pipeline_parallel_schedule=GPipe",
      "--training.local_batch_size=4" } },
    { "PP 2 1F1B", 2, { "--parallelism.pp=2", "--parallelism.pipeline_parallel_schedule=1F1B",
      "--training.local_batch_size=4" } },
    { "PP 2 Interleaved1F1B x FSDP 2", 4, { "--parallelism.pp=2", "--parallelism.dp_shard=2",
      "--parallelism.pipeline_parallel_schedule=Interleaved1F1B", "--training.local_batch_size=4" } },
    { "CP 2 all-gather", 2, { "--parallelism.cp=2", "--training.local_batch_size=2" } },
    { "CP 2 ring", 2, { "--parallelism.cp=2", "--parallelism.context_parallel_rotate_method=alltoall",
      "--training.local_batch_size=2" } },
    { "EP 2 x FSDP 4 (MoE)", 4, { "--model.flavor=debugmodel_moe", "--parallelism.dp_shard=4",
      "--parallelism.expert_parallel_degree=2", "--training.local_batch_size=2" } },
    { "FSDP 2 x TP 2", 4, { "--parallelism.dp_shard=2", "--parallelism.tp=2", "--training.local_batch_size=2" } },
    { "PP 2 x TP 2", 4, { "--parallelism.pp=2", "--parallelism.tp=2", "--training.local_batch_size=4" } },
    { "CP 2 ring x TP 2", 4, { "--parallelism.cp=2", "--parallelism.tp=2",
      "--parallelism.context_parallel_rotate_method=alltoall", "--training.local_batch_size=2" } },
  }
  for _, l in ipairs(layouts) do
    local name, n, keys = l[1], l[2], l[3]
    it(name .. ": the losses of titan --nproc " .. n .. ", bit for bit", function()
      if not mpi then return pending("titan was built without Open MPI (libopenmpi-dev): nothing to compare with") end
      local sim, real = sh.tmpdir(), sh.tmpdir()
      local out = sh.run_ok(cmd("--simulate", n, sim, keys) .. " 2>&1")
      if name:find("^DDP") then assert.truthy(out:find("data parallel over simulated ranks: 3 ranks", 1, true), out) end
      sh.run_ok(cmd("--nproc", n, real, keys) .. " 2>&1")
      local a, b = records(sim), records(real)
      for s = 1, 3 do
        assert.truthy(a[s] and b[s], ("step %d missing"):format(s))
        for _, k in ipairs({ "loss", "grad_norm", "memory_peak_gib" }) do
          assert.are.equal(b[s][k], a[s][k], ("%s step %d %s: %.17g simulated, %.17g over MPI"):format(name, s, k,
            a[s][k], b[s][k]))
        end
      end
    end)
  end

  it("refuses bad counts and a missing command in one line", function()
    sh.one_line(exe .. " --simulate 0 x.lua", "expected a number of ranks from 1 to 4096")
    sh.one_line(exe .. " --simulate two x.lua", "expected a number of ranks from 1 to 4096")
    sh.one_line(exe .. " --simulate 2", "needs what to run")
  end)

  -- Runs a script body on n simulated ranks (g: the world group, r: the
  -- rank); it must fail, and the output is returned for its line.
  local function fails(n, body)
    local path = os.tmpname() .. ".lua"
    local f = assert(io.open(path, "w"))
    f:write("local titan = require('titan')\nlocal dist = require('titan.dist')\nlocal g = dist.world_group()\n",
      "local r = g:rank()\n", body)
    f:close()
    local out, rc = sh.run(exe .. " --simulate " .. n .. " " .. path .. " 2>&1")
    os.remove(path)
    assert.are_not.equal(0, rc, out)
    return out
  end

  it("reports a deadlock with what each rank waits for, and exits 1", function()
    local out = fails(2, "if r == 0 then g:all_reduce(titan.ones({ 2 })) end\n")
    assert.truthy(out:find("simulate: deadlock: no rank can go on (rank 0 waits in all_reduce on the group of ranks "
      .. "[0,1]; rank 1 has finished)", 1, true), out)
  end)

  it("names both sides of mismatched collectives", function()
    local out = fails(2, "if r == 0 then g:all_reduce(titan.ones({ 2 })) else g:all_gather(titan.ones({ 2 })) end\n")
    assert.truthy(out:find("titan (rank 1 of 2): ", 1, true), out)
    assert.truthy(out:find("all_gather: simulated rank 1 calls all_gather on the group of ranks [0,1] while other "
      .. "ranks of it wait in all_reduce", 1, true), out)
    -- sizes that differ between ranks
    out = fails(2, "g:all_reduce(titan.ones({ 2 + r }))\n")
    assert.truthy(out:find("all_reduce: group rank 1 gave [3] float32 but group rank 0 gave [2] float32", 1, true), out)
  end)

  it("stops the job when one rank fails, naming it", function()
    local out = fails(3, "g:barrier()\nif r == 2 then error('rank two gives up', 0) end\ng:barrier()\n")
    assert.truthy(out:find("titan (rank 2 of 3): rank two gives up", 1, true), out)
  end)

  it("refuses NCCL (a process per GPU) in one line", function()
    local out = fails(2, "dist.nccl_world_group(0)\n")
    assert.truthy(out:find("simulated ranks (titan --simulate N) run on the CPU", 1, true), out)
  end)
end)
