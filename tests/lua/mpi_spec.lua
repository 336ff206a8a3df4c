-- Data-parallel training across ranks, each parallelism against one process
-- with the same global batch. What only separate processes show runs over
-- Open MPI (`titan --nproc N`): every collective at world 3, DDP and FSDP
-- losses, checkpoints written by each process and resumed exactly (DDP onto
-- 1 rank, FSDP onto DDP), a signal to one rank, per-rank profiler traces, and
-- the launcher's and the layout's bad input; without Open MPI in the build
-- these cases report pending. The rest (HSDP, TP, PP schedules, CP, MoE,
-- float8, their combinations and the resumes across layouts) runs its ranks
-- simulated in one process (`titan --simulate N`: the bits of --nproc N,
-- tests/lua/simulate_spec.lua), which needs no Open MPI; but the
-- expert-parallel checkpoints stay over MPI, where they cost less (the
-- simulator runs one rank at a time: many small steps of 4 FSDP ranks are
-- slower than as processes sharing the cores).
local titan = require("titan")
local dist = require("titan.dist")
local env = require("titan.env")
local cjson = require("cjson")
local sh = dofile("tests/lua/shell.lua")

local exe = env.build_dir .. "/titan"
local mpi = dist.built("mpi")

local tmpdir = sh.tmpdir

-- The debug model, tiny and fast; no peak measurement, no validation, no shuffle
-- (each rank shuffles its own windows, so shuffled runs draw other batches than
-- one process would).
-- launch: "--nproc" (a process a rank, Open MPI) or "--simulate" (the ranks in one process).
local function command(launch, nproc, dump, extra)
  local args = { "lua/recipes/llama3_debugmodel.lua", "--job.dump_folder=" .. dump, "--metrics.peak_flops=1e11",
    "--metrics.log_freq=1", "--metrics.enable_jsonl=true", "--training.seq_len=32", "--validation.enable=false",
    "--training.shuffle=false", "--lr_scheduler.warmup_steps=2" }
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  for i, a in ipairs(args) do args[i] = sh.quote(a) end
  local pre = nproc > 1 and ("%s %s %d "):format(exe, launch, nproc) or ("OMP_NUM_THREADS=2 %s "):format(exe)
  return pre .. table.concat(args, " ")
end
-- nproc ranks as processes under Open MPI; 1: one process, no launcher.
local function train_cmd(nproc, dump, extra) return command("--nproc", nproc, dump, extra) end
-- nproc ranks simulated in one process; 1: one process, no launcher.
local function sim_cmd(nproc, dump, extra) return command("--simulate", nproc, dump, extra) end
-- What the banners say the ranks communicate over.
local MPI, SIM = "MPI", "simulated ranks"

-- Losses by step from metrics.jsonl (written by rank 0; a resume appends);
-- with key = "validation_loss", the validation losses.
local function losses(dump, key)
  local out = {}
  for line in io.lines(dump .. "/metrics.jsonl") do
    local r = cjson.decode(line)
    if r[key or "loss"] then out[r.step] = r[key or "loss"] end
  end
  return out
end

local run_ok = sh.run_ok

local DDP = { "--parallelism.dp_replicate=2", "--parallelism.dp_shard=1" }
-- The same loss up to float32 rounding (sums over ranks in another order).
local function close(a, b, s, what)
  assert.is_true(math.abs(a - b) <= 2e-5 * math.abs(a), ("%s step %d: %.9g vs %.9g"):format(what, s, a, b))
end
-- Settings for a validation at step 3 over 2 batches.
local VAL = { "--validation.enable=true", "--validation.freq=3", "--validation.steps=2" }
local with = sh.with

-- One process, global batch 4 x 32, 3 steps, validation at step 3: the
-- losses the DDP, TP and PP cases compare with (run once).
local base_dump
local function baseline()
  if not base_dump then
    base_dump = tmpdir()
    run_ok(train_cmd(1, base_dump, with(VAL, { "--training.steps=3", "--training.local_batch_size=4" })))
  end
  return base_dump
end

describe("mpi backend", function()
  it("every collective across 3 processes", function()
    if not mpi then return pending("titan was built without Open MPI (libopenmpi-dev)") end
    sh.worker_ok("", exe, 3, 62)
  end)
end)

describe("data parallelism over MPI", function()
  it("2 ranks train the losses of one process with the same global batch", function()
    if not mpi then return pending("titan was built without Open MPI (libopenmpi-dev)") end
    local steps = "--training.steps=3"
    -- validation at step 3 over 2 batches: each rank validates its share, the loss is over all
    local val = VAL
    local one, two, acc = baseline(), tmpdir(), tmpdir()
    local out = run_ok(train_cmd(2, two, with(DDP, with(val, { steps, "--training.local_batch_size=2" }))))
    assert.truthy(out:find("validate: step     3  loss: +[%d.]+  %(256 tokens%)"), out)
    -- (log lines once, from rank 0; the banner says how the ranks split the work)
    assert.truthy(out:find("data parallel over " .. MPI .. ": 2 ranks", 1, true), out)
    local _, nlines = out:gsub("step:%s+1 ", "")
    assert.are.equal(1, nlines, out)
    assert.truthy(out:find("x 1 accumulation = 128 tokens/step", 1, true), out)
    -- the same 4 windows per step as 2 ranks x 1 x 2 accumulation
    run_ok(train_cmd(2, acc, with(DDP, { steps, "--training.local_batch_size=1",
      "--training.global_batch_tokens=128" })))
    local a, b, c = losses(one), losses(two), losses(acc)
    for s = 1, 3 do
      -- (sums over ranks in another order: equal up to float32 rounding)
      assert.is_true(math.abs(a[s] - b[s]) <= 2e-5 * math.abs(a[s]), ("step %d: %.9g vs %.9g"):format(s, a[s], b[s]))
      assert.is_true(math.abs(a[s] - c[s]) <= 2e-5 * math.abs(a[s]), ("step %d: %.9g vs %.9g"):format(s, a[s], c[s]))
    end
    assert.is_true(a[3] < a[1]) -- it learns
    local va, vb = losses(one, "validation_loss")[3], losses(two, "validation_loss")[3]
    assert.is_true(math.abs(va - vb) <= 2e-5 * va, ("validation: %.9g vs %.9g"):format(va, vb))
  end)

  it("a signal to one rank stops every rank at the same step, saved", function()
    if not mpi then return pending("titan was built without Open MPI (libopenmpi-dev)") end
    local dump = tmpdir()
    local cmd = train_cmd(2, dump, with(DDP, { "--training.steps=100000", "--training.local_batch_size=2",
      "--checkpoint.enable=true", "--checkpoint.interval=100000" }))
    -- (rank 1 found by its environment: no pgrep in a bare image)
    -- (a rank that stopped alone would leave the other waiting in a collective:
    -- the job is bounded, and whatever is left of it is killed)
    local out, rc = sh.run(([[
timeout -s KILL 300 %s > %s/out.log 2>&1 & job=$!
for i in $(seq 1 600); do grep -qs '"step":3,' %s/metrics.jsonl && break; sleep 0.1; done
ours() {
  for d in /proc/[0-9]*; do grep -qzs "$1" $d/environ && grep -qzs 'dump_folder=%s' $d/cmdline && echo ${d#/proc/}; done
}
for p in $(ours OMPI_COMM_WORLD_RANK=1); do kill -TERM $p; done
wait $job; rc=$?
for p in $(ours OMPI_COMM_WORLD_RANK=); do kill -KILL $p; done
exit $rc]]):format(cmd, dump, dump, dump))
    local log = assert(io.open(dump .. "/out.log")):read("*a")
    assert.are.equal(0, rc, out .. log)
    local step = tonumber(log:match("trainer: SIGTERM: saved step (%d+), stopping"))
    assert.truthy(step, log)
    local f = io.open(("%s/checkpoint/step-%d/COMPLETE"):format(dump, step))
    assert.truthy(f, "step " .. step .. " is complete")
    f:close()
  end)

  it("a 2-rank checkpoint resumes exactly on 2 ranks; on 1 rank only without the data position", function()
    if not mpi then return pending("titan was built without Open MPI (libopenmpi-dev)") end
    local ck = { "--checkpoint.enable=true", "--checkpoint.interval=2", "--training.local_batch_size=2",
      "--training.shuffle=true" }
    local straight, resumed = tmpdir(), tmpdir()
    run_ok(train_cmd(2, straight, with(DDP, with(ck, { "--training.steps=4" }))))
    run_ok(train_cmd(2, resumed, with(DDP, with(ck, { "--training.steps=2" }))))
    local out = run_ok(train_cmd(2, resumed, with(DDP, with(ck, { "--training.steps=4" }))))
    assert.truthy(out:find("resumed from step 2", 1, true), out)
    local a, b = losses(straight), losses(resumed)
    for s = 1, 4 do assert.are.equal(a[s], b[s], "step " .. s) end -- bit for bit, shuffled data included
    -- every rank's data position is in the checkpoint; rank 1 wrote no replicated tensor twice
    local meta = cjson.decode(assert(io.open(resumed .. "/checkpoint/step-4/metadata.json")):read("*a"))
    assert.are.equal(2, #meta.train_state.dataloader_ranks)
    assert.are.equal(0, meta.files["rank-1.bin"].chunks)

    -- One process cannot take over two ranks' data positions: one line, nothing written.
    local before = sh.run("ls " .. resumed .. "/checkpoint")
    local bad, rc = sh.run(train_cmd(1, resumed, with(ck, { "--training.steps=6" })))
    assert.are_not.equal(0, rc)
    assert.truthy(bad:find("saved loader state has world = 2, this dataset has world = 1", 1, true), bad)
    assert.truthy(bad:find("--checkpoint.exclude_from_loading=dataloader", 1, true), bad)
    assert.are.equal(before, (sh.run("ls " .. resumed .. "/checkpoint")))
    -- ... and it resumes the weights and optimizer with the data started anew.
    out = run_ok(train_cmd(1, resumed, with(ck, { "--training.steps=6",
      "--checkpoint.exclude_from_loading=dataloader" })))
    assert.truthy(out:find("resumed from step 4", 1, true), out)
    assert.truthy(out:find("done at step 6", 1, true), out)
  end)
end)

describe("FSDP over MPI", function()
  it("2 and 3 ranks (uneven shards), and HSDP 2 x 2 (simulated), train the losses of one process in half the memory",
    function()
    if not mpi then return pending("titan was built without Open MPI (libopenmpi-dev)") end
    local steps = "--training.steps=3"
    local val = VAL
    local one, two, three, hsdp = tmpdir(), tmpdir(), tmpdir(), tmpdir()
    run_ok(train_cmd(1, one, with(val, { steps, "--training.local_batch_size=12" })))
    -- (dp_shard = -1 by default: every rank is a shard)
    local out = run_ok(train_cmd(2, two, { steps, "--training.local_batch_size=3", "--training.global_batch_tokens=384",
      "--activation_checkpoint.mode=full", "--parallelism.fsdp_reshard_after_forward=always" }))
    assert.truthy(out:find("data parallel over " .. MPI .. ": 2 ranks, FSDP over 2 shards: each rank keeps", 1, true),
      out)
    out = run_ok(train_cmd(3, three, with(val, { steps, "--training.local_batch_size=4" })))
    assert.truthy(out:find("validate: step     3  loss: +[%d.]+  %(768 tokens%)"), out)
    -- (HSDP's groups, not the processes, are its point: its 4 ranks simulated)
    out = run_ok(sim_cmd(4, hsdp, with(val, { steps, "--training.local_batch_size=3",
      "--parallelism.dp_replicate=2" })))
    assert.truthy(out:find("FSDP over 2 shards x 2 replicas (HSDP", 1, true), out)
    local a = losses(one)
    for name, dump in pairs({ two = two, three = three, hsdp = hsdp }) do
      local b = losses(dump)
      for s = 1, 3 do close(a[s], b[s], s, name) end
    end
    assert.is_true(a[3] < a[1])
    local va = losses(one, "validation_loss")[3]
    close(va, losses(three, "validation_loss")[3], 3, "validation (3 ranks)")
    close(va, losses(hsdp, "validation_loss")[3], 3, "validation (HSDP)")
    -- After a step a rank holds its shards of the weights and the optimizer state:
    -- about half of what one process holds at 2 ranks (the data's buffers come on top).
    local function mem(dump, key)
      for line in io.lines(dump .. "/metrics.jsonl") do
        local r = cjson.decode(line)
        if r.step == 3 and r[key] then return r[key] end
      end
    end
    local m1, m2 = mem(one, "memory_gib"), mem(two, "memory_gib")
    assert.is_true(m2 < 0.6 * m1, ("memory after a step: 2-rank FSDP %.4f GiB vs one process %.4f GiB"):format(m2, m1))
  end)

  it("an FSDP checkpoint resumes exactly on the same shards, and onto DDP ranks", function()
    if not mpi then return pending("titan was built without Open MPI (libopenmpi-dev)") end
    local ck = { "--checkpoint.enable=true", "--checkpoint.interval=2", "--training.local_batch_size=2" }
    local straight, resumed, ddp = tmpdir(), tmpdir(), tmpdir()
    run_ok(train_cmd(3, straight, with(ck, { "--training.steps=4" })))
    -- each rank wrote its third of every tensor (and of AdamW's moments)
    local meta = cjson.decode(assert(io.open(straight .. "/checkpoint/step-2/metadata.json")):read("*a"))
    local sizes = {}
    for r = 0, 2 do sizes[r] = meta.files[("rank-%d.bin"):format(r)].size end
    assert.is_true(sizes[1] > 0.3 * (sizes[0] + sizes[1] + sizes[2]), cjson.encode(meta.files))
    for _, dump in ipairs({ resumed, ddp }) do
      assert.are.equal(0, select(2, sh.run(("mkdir -p %s/checkpoint && cp -r %s/checkpoint/step-2 %s/checkpoint/")
        :format(dump, straight, dump))))
    end
    local out = run_ok(train_cmd(3, resumed, with(ck, { "--training.steps=4" })))
    assert.truthy(out:find("resumed from step 2", 1, true), out)
    run_ok(train_cmd(3, ddp, with(ck, { "--training.steps=4", "--parallelism.dp_replicate=3",
      "--parallelism.dp_shard=1" })))
    local a, b, c = losses(straight), losses(resumed), losses(ddp)
    for s = 3, 4 do assert.are.equal(a[s], b[s], "step " .. s) end -- bit for bit
    assert.are.equal(a[3], c[3]) -- the same weights, read back whole on each rank
    close(a[4], c[4], 4, "DDP after FSDP")
  end)
end)

describe("tensor parallelism (simulated ranks)", function()
  it("tp 2 (sequence and loss parallel, with activation checkpointing) and tp 2 x DDP 2 (neither) train the "
    .. "losses of one process", function()
    local steps = "--training.steps=3"
    local val = VAL
    local one, tp2, tpdp = baseline(), tmpdir(), tmpdir()
    -- (the ranks of a tp group read the same data: batch 4 each, 4 per step)
    local out = run_ok(sim_cmd(2, tp2, with(val, { steps, "--training.local_batch_size=4", "--parallelism.tp=2",
      "--activation_checkpoint.mode=full" })))
    assert.truthy(out:find("tensor parallel: 2 ranks per replica", 1, true), out)
    assert.truthy(out:find("x 1 accumulation = 128 tokens/step", 1, true), out)
    assert.truthy(out:find("(sequence parallel: norms and the residual stream split along the sequence", 1, true), out)
    assert.truthy(out:find("; loss parallel: the output layer split by vocabulary, the loss from the slices)", 1, true),
      out)
    out = run_ok(sim_cmd(4, tpdp, with(val, { steps, "--training.local_batch_size=2", "--parallelism.tp=2",
      "--parallelism.dp_replicate=2", "--parallelism.dp_shard=1", "--parallelism.sequence_parallel=false",
      "--parallelism.loss_parallel=false" })))
    assert.truthy(out:find("(two all-reduces of the activations per block each way; the embedding split by "
      .. "vocabulary)", 1, true), out)
    assert.truthy(out:find("data parallel over " .. SIM .. ": 2 ranks (DDP", 1, true), out)
    -- a recipe's own loss_fn takes whole logits: loss parallelism steps aside, and says so
    local z = tmpdir()
    out = run_ok(exe .. " --simulate 2 lua/recipes/llama3_debugmodel_zloss.lua --parallelism.tp=2 --training.steps=1 "
      .. "--training.seq_len=32 --metrics.peak_flops=1e11 --job.dump_folder=" .. z)
    assert.truthy(out:find("; loss parallel off: the recipe's loss_fn takes whole logits)", 1, true), out)
    local a = losses(one)
    for name, dump in pairs({ tp2 = tp2, tpdp = tpdp }) do
      local b = losses(dump)
      for s = 1, 3 do close(a[s], b[s], s, name) end
      close(losses(one, "validation_loss")[3], losses(dump, "validation_loss")[3], 3, name .. " validation")
    end
  end)

  it("FSDP x TP (2D) on 4 ranks trains the losses of one process; its checkpoint resumes on TP x DDP", function()
    local one, twod, ddp = baseline(), tmpdir(), tmpdir()
    local ck = { "--checkpoint.enable=true", "--checkpoint.interval=2", "--training.steps=3" }
    -- (dp_shard = -1: the 2 data-parallel ranks shard each rank's tp slices)
    local out = run_ok(sim_cmd(4, twod, with(ck, { "--training.local_batch_size=2", "--parallelism.tp=2" })))
    -- (the data-parallel ranks are the 2 tp groups)
    assert.truthy(out:find("data parallel over " .. SIM .. ": 2 ranks, FSDP over 2 shards", 1, true), out)
    assert.truthy(out:find("tensor parallel: 2 ranks", 1, true), out)
    local a, b = losses(one), losses(twod)
    for s = 1, 3 do close(a[s], b[s], s, "2D") end
    -- the same weights read back through the composed boxes: step 3 again, bit for bit
    assert.are.equal(0, select(2, sh.run(("mkdir -p %s/checkpoint && cp -r %s/checkpoint/step-2 %s/checkpoint/")
      :format(ddp, twod, ddp))))
    run_ok(sim_cmd(4, ddp, with(ck, { "--training.local_batch_size=2", "--parallelism.tp=2",
      "--parallelism.dp_replicate=2", "--parallelism.dp_shard=1" })))
    assert.are.equal(b[3], losses(ddp)[3])
  end)

  it("a tp checkpoint resumes exactly on tp ranks, and in one process", function()
    local ck = { "--checkpoint.enable=true", "--checkpoint.interval=2", "--training.local_batch_size=2" }
    local TP = { "--parallelism.tp=2" }
    local straight, resumed, single = tmpdir(), tmpdir(), tmpdir()
    run_ok(sim_cmd(2, straight, with(TP, with(ck, { "--training.steps=4" }))))
    for _, dump in ipairs({ resumed, single }) do
      assert.are.equal(0, select(2, sh.run(("mkdir -p %s/checkpoint && cp -r %s/checkpoint/step-2 %s/checkpoint/")
        :format(dump, straight, dump))))
    end
    local out = run_ok(sim_cmd(2, resumed, with(TP, with(ck, { "--training.steps=4" }))))
    assert.truthy(out:find("resumed from step 2", 1, true), out)
    -- (one data-parallel rank saved it: one process takes its data position too)
    out = run_ok(train_cmd(1, single, with(ck, { "--training.steps=4" })))
    assert.truthy(out:find("resumed from step 2", 1, true), out)
    local a, b, c = losses(straight), losses(resumed), losses(single)
    for s = 3, 4 do
      assert.are.equal(a[s], b[s], "step " .. s) -- bit for bit
      close(a[s], c[s], s, "one process after tp")
    end
  end)
end)

describe("pipeline parallelism over MPI", function()
  it("pp 2 x DDP 2 on 4 processes trains the losses of one process; each rank writes its own profiler trace, of its "
    .. "own stage's blocks", function()
    if not mpi then return pending("titan was built without Open MPI (libopenmpi-dev)") end
    local steps = "--training.steps=3"
    local one, ppdp = baseline(), tmpdir()
    -- (profiled at step 2: every rank writes its own trace, of its own stage's blocks)
    local out = run_ok(train_cmd(4, ppdp, { steps, "--training.local_batch_size=2", "--parallelism.pp=2",
      "--parallelism.dp_replicate=-1", "--parallelism.dp_shard=1", "--profiling.enable_profiling",
      "--profiling.profile_freq=2" }))
    assert.truthy(out:find("data parallel over " .. MPI .. ": 2 ranks (DDP", 1, true), out)
    assert.truthy(out:find("profiler: step 2 took", 1, true), out)
    for rank = 0, 3 do
      local f = assert(io.open(("%s/profile_traces/iteration_2/rank%d_trace.json"):format(ppdp, rank)))
      local doc = cjson.decode(f:read("*a"))
      f:close()
      local seen = {}
      for _, e in ipairs(doc.traceEvents) do seen[e.cat .. " " .. e.name] = true end
      assert.are.equal(rank, doc.otherData.rank)
      for _, want in ipairs({ "step step 2", "step gradient reduction", "step optimizer" }) do
        assert.truthy(seen[want], ("rank %d: %s"):format(rank, want))
      end
      -- blocks 0-2 on the first stage (ranks 0, 1), 3-5 on the second
      local mine, other = rank < 2 and "layers.0" or "layers.5", rank < 2 and "layers.5" or "layers.0"
      assert.truthy(seen["module " .. mine .. ".feed_forward.w2"], ("rank %d: %s"):format(rank, mine))
      assert.truthy(seen["backward " .. mine .. ".feed_forward.w2 linear"], ("rank %d: its backward"):format(rank))
      assert.is_nil(seen["module " .. other .. ".feed_forward.w2"], ("rank %d: %s"):format(rank, other))
    end
    local a, b = losses(one), losses(ppdp)
    for s = 1, 3 do close(a[s], b[s], s, "ppdp") end
  end)
end)

describe("pipeline parallelism (simulated ranks)", function()
  it("pp 2 under 1F1B, GPipe (with AC) and Interleaved1F1B, pp 2 x HSDP 2 x 2 and pp x FSDP x TP (3D) train the "
    .. "losses of one process", function()
    local steps = "--training.steps=3"
    local one, f1b, gpipe, inter, threed = baseline(), tmpdir(), tmpdir(), tmpdir(), tmpdir()
    local pphsdp = tmpdir()
    -- (every stage reads the same data: batch 4 each, 4 micro-batches of one row)
    local out = run_ok(sim_cmd(2, f1b, with(VAL, { steps, "--training.local_batch_size=4", "--parallelism.pp=2" })))
    assert.truthy(out:find("pipeline parallel: 2 stages over 2 ranks (1F1B, 4 micro-batches of 1 rows per batch); "
      .. "blocks by stage: 0-2 | 3-5", 1, true), out)
    assert.truthy(out:find("x 1 accumulation = 128 tokens/step", 1, true), out)
    out = run_ok(sim_cmd(2, gpipe, { steps, "--training.local_batch_size=4", "--parallelism.pp=2",
      "--parallelism.pipeline_parallel_schedule=GPipe", "--parallelism.pipeline_parallel_microbatch_size=2",
      "--activation_checkpoint.mode=selective" }))
    -- (blocks 1, 3 and 5 of the whole model, over both stages)
    assert.truthy(out:find("selective, 3 of 6 blocks recompute", 1, true), out)
    out = run_ok(sim_cmd(2, inter, with(VAL, { steps, "--training.local_batch_size=4", "--parallelism.pp=2",
      "--parallelism.pipeline_parallel_schedule=Interleaved1F1B" })))
    assert.truthy(out:find("4 stages over 2 ranks (Interleaved1F1B", 1, true), out)
    -- HSDP under PP on 8 ranks: 2 stages x 2 replicas x 2 shards, one row per rank
    out = run_ok(sim_cmd(8, pphsdp, { steps, "--training.local_batch_size=1", "--parallelism.pp=2",
      "--parallelism.dp_replicate=2", "--parallelism.dp_shard=2" }))
    assert.truthy(out:find("FSDP over 2 shards x 2 replicas (HSDP", 1, true), out)
    -- 3D on 8 ranks: 2 stages x (dp_shard = -1: FSDP over 2) x tp 2; two stages per rank, each its own FSDP and
    -- TP, micro-batches in flight between a unit's forward and backward, and blocks recomputed
    out = run_ok(sim_cmd(8, threed, with(VAL, { steps, "--training.local_batch_size=2", "--parallelism.pp=2",
      "--parallelism.tp=2", "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
      "--activation_checkpoint.mode=full" })))
    assert.truthy(out:find("data parallel over " .. SIM .. ": 2 ranks, FSDP over 2 shards", 1, true), out)
    assert.truthy(out:find("tensor parallel: 2 ranks", 1, true), out)
    local a = losses(one)
    for name, dump in pairs({ f1b = f1b, gpipe = gpipe, inter = inter, threed = threed, pphsdp = pphsdp }) do
      local b = losses(dump)
      for s = 1, 3 do close(a[s], b[s], s, name) end
    end
    for name, dump in pairs({ f1b = f1b, inter = inter, threed = threed }) do
      close(losses(one, "validation_loss")[3], losses(dump, "validation_loss")[3], 3, name .. " validation")
    end
  end)

  it("a pp checkpoint resumes in one process and on other stages; a 3D one exactly on its own layout",
    function()
    local ck = { "--checkpoint.enable=true", "--checkpoint.interval=2", "--training.steps=3" }
    local PP3 = { "--parallelism.pp=3", "--training.local_batch_size=4" }
    -- (8 ranks: 4 stages, two per rank, each FSDP over 2 x TP 2; the checkpoint's boxes add the shard's and the
    -- slice's offsets)
    local PPF = { "--parallelism.pp=2", "--parallelism.tp=2", "--training.local_batch_size=2",
      "--parallelism.pipeline_parallel_schedule=Interleaved1F1B" }
    local straight, single, inter, ppf, ppf2 = tmpdir(), tmpdir(), tmpdir(), tmpdir(), tmpdir()
    run_ok(sim_cmd(3, straight, with(PP3, ck)))
    -- each stage wrote its own blocks
    local meta = cjson.decode(assert(io.open(straight .. "/checkpoint/step-2/metadata.json")):read("*a"))
    for r = 0, 2 do assert.is_true(meta.files[("rank-%d.bin"):format(r)].size > 0, cjson.encode(meta.files)) end
    run_ok(sim_cmd(8, ppf, with(PPF, ck)))
    local function copy(from, to)
      assert.are.equal(0, select(2, sh.run(("mkdir -p %s/checkpoint && cp -r %s/checkpoint/step-2 %s/checkpoint/")
        :format(to, from, to))))
    end
    copy(straight, single)
    copy(straight, inter)
    copy(ppf, ppf2)
    run_ok(train_cmd(1, single, with(ck, { "--training.local_batch_size=4" })))
    run_ok(sim_cmd(2, inter, with(ck, { "--parallelism.pp=2", "--training.local_batch_size=4",
      "--parallelism.pipeline_parallel_schedule=Interleaved1F1B" })))
    local out = run_ok(sim_cmd(8, ppf2, with(PPF, ck)))
    assert.truthy(out:find("resumed from step 2", 1, true), out)
    local a = losses(straight)
    close(a[3], losses(single)[3], 3, "one process after pp 3")
    close(a[3], losses(inter)[3], 3, "Interleaved1F1B pp 2 after pp 3")
    assert.are.equal(losses(ppf)[3], losses(ppf2)[3]) -- bit for bit
    close(a[3], losses(ppf)[3], 3, "3D")
  end)

  it("a Hugging Face folder loads onto 3D ranks: each reads its stage's tensors and takes its piece", function()
    -- (the weights of a short run, so that a wrong piece shows in the loss)
    local src, hf, one, threed = tmpdir(), tmpdir() .. "/hf", tmpdir(), tmpdir()
    run_ok(train_cmd(1, src, { "--checkpoint.enable=true", "--training.steps=2", "--training.local_batch_size=4" }))
    run_ok(("%s ckpt convert --to hf --model-flavor debugmodel %s/checkpoint/step-2 %s"):format(exe, src, hf))
    local load = { "--checkpoint.enable=true", "--checkpoint.initial_load_path=" .. hf, "--training.steps=1" }
    run_ok(train_cmd(1, one, with(load, { "--training.local_batch_size=4" })))
    local out = run_ok(sim_cmd(8, threed, with(load, { "--training.local_batch_size=2", "--parallelism.pp=2",
      "--parallelism.tp=2", "--parallelism.pipeline_parallel_schedule=Interleaved1F1B" })))
    assert.truthy(out:find("loaded the model from Hugging Face folder", 1, true), out)
    close(losses(one)[1], losses(threed)[1], 1, "3D from HF")
  end)
end)

describe("context parallelism (simulated ranks)", function()
  local RING = "--parallelism.context_parallel_rotate_method=alltoall"
  it("cp 2 alone, with FSDP (and AC), HSDP, TP and PP x TP, and the ring (cp 4, cp 2 x FSDP) train the losses of "
    .. "one process", function()
    local steps = "--training.steps=3"
    local one = baseline()
    -- each sequence of 32 tokens split over 2 ranks (chunks 0 and 3, 1 and 2 of 4); 4 sequences a step
    local cases = {
      { "cp 2", 2, { "--training.local_batch_size=4" },
        "context parallel over " .. SIM .. ": 2 ranks per sequence, each holding 16 of its 32 tokens" },
      { "cp 2 x FSDP 2, AC", 4, { "--training.local_batch_size=2", "--activation_checkpoint.mode=full" },
        "data parallel over " .. SIM .. ": 2 ranks, FSDP over 4 shards" },
      -- 2 replicas of 2 shards, each shard over 2 cp ranks (the groups' arithmetic)
      { "cp 2 x HSDP 2 x 2", 8, { "--training.local_batch_size=1", "--parallelism.dp_replicate=2",
        "--parallelism.dp_shard=2" }, "FSDP over 4 shards x 2 replicas (HSDP" },
      -- (sequence parallelism splits each rank's chunks again, over its tp group)
      { "cp 2 x tp 2", 4, { "--training.local_batch_size=4", "--parallelism.tp=2" }, "tensor parallel: 2 ranks" },
      { "pp 2 x cp 2 x tp 2", 8, { "--training.local_batch_size=4", "--parallelism.tp=2", "--parallelism.pp=2" },
        "pipeline parallel: 2 stages" },
      -- ring attention: keys and values passed around the cp ranks (and, with full AC, again in the recompute)
      { "cp 4, ring", 4, { "--training.local_batch_size=4", RING, "--parallelism.cp=4" },
        "context parallel over " .. SIM .. ": 4 ranks per sequence, each holding 8 of its 32 tokens (of 8 chunks" },
      { "cp 2, ring x FSDP 2, AC", 4, { "--training.local_batch_size=2", RING, "--activation_checkpoint.mode=full" },
        "ring attention (alltoall): keys and values passed around the cp ranks" },
      { "cp 2, ring x tp 2", 4, { "--training.local_batch_size=4", RING, "--parallelism.tp=2" },
        "tensor parallel: 2 ranks" },
    }
    local a, va = losses(one), losses(one, "validation_loss")[3]
    for _, c in ipairs(cases) do
      local dump = tmpdir()
      local out = run_ok(sim_cmd(c[2], dump, with(VAL, with({ steps, "--parallelism.cp=2" }, c[3]))))
      assert.truthy(out:find(c[4], 1, true), out)
      assert.truthy(out:find("context parallel over " .. SIM .. ": %d ranks per sequence"), out)
      assert.truthy(out:find("validate: step     3  loss: +[%d.]+  %(256 tokens%)"), out)
      local b = losses(dump)
      for s = 1, 3 do close(a[s], b[s], s, c[1]) end
      close(va, losses(dump, "validation_loss")[3], 3, c[1] .. " validation")
    end
  end)
end)

describe("float8 (simulated ranks)", function()
  it("FSDP 2 trains float8 linears to one process's float8 curve, within the ranks' own activation scales; "
    .. "gathering the weights in fp8 gives the same bits", function()
      -- (tensorwise scaling takes each rank's activations' own largest value, as TorchTitan's: not bit for bit)
      local f8 = { "--training.steps=3", "--model.converters=float8" }
      local one, two, two8 = tmpdir(), tmpdir(), tmpdir()
      run_ok(train_cmd(1, one, with(f8, { "--training.local_batch_size=4" })))
      local out = run_ok(sim_cmd(2, two, with(f8, { "--training.local_batch_size=2" })))
      assert.truthy(out:find("FSDP over 2 shards", 1, true), out)
      assert.truthy(out:find("float8: 42 Linear layers multiply in fp8", 1, true), out)
      -- each shard cast with the whole weight's scale: the bits of casting the gathered weight
      out = run_ok(sim_cmd(2, two8, with(f8, { "--training.local_batch_size=2",
        "--float8.enable_fsdp_float8_all_gather=true" })))
      assert.truthy(out:find("FSDP gathers the converted weights in fp8", 1, true), out)
      local a, b, c = losses(one), losses(two), losses(two8)
      for s = 1, 3 do
        assert.is_true(math.abs(a[s] - b[s]) <= 2e-3, ("step %d: %.6f vs %.6f"):format(s, a[s], b[s]))
        assert.are.equal(b[s], c[s], "fp8 all-gather, step " .. s)
      end
    end)

  it("TP 2 (sequence parallel) casts as one process: each scale from every rank's shard", function()
    -- (the same tokens on both ranks, so the activations' scales are the whole batch's: up to the
    -- order of the f32 sums, the casts are one process's)
    local f8 = { "--training.steps=3", "--model.converters=float8", "--training.local_batch_size=4" }
    local one, two = tmpdir(), tmpdir()
    run_ok(train_cmd(1, one, f8))
    local out = run_ok(sim_cmd(2, two, with(f8, { "--parallelism.tp=2" })))
    assert.truthy(out:find("tensor parallel: 2 ranks", 1, true), out)
    local a, b = losses(one), losses(two)
    -- (a flipped fp8 rounding moves the third step's loss by ~1e-5 of it; tests/lua/mpi_worker.lua checks
    -- the group's casts bit for bit)
    for s = 1, 3 do
      assert.is_true(math.abs(a[s] - b[s]) <= 1e-4 * a[s], ("step %d: %.9g vs %.9g"):format(s, a[s], b[s]))
    end
  end)
end)

describe("mixture of experts (simulated ranks; the expert-parallel checkpoints over MPI)", function()
  -- 8 tokens a rank for 8 experts: some rank's tokens miss some expert that another rank's reach (its gradient
  -- is zeros there, never missing from a sum: DDP's buckets would not match up, FSDP would drop the other
  -- rank's part, without the zeros)
  local m = { "--model.flavor=debugmodel_moe", "--training.seq_len=8" }
  local one -- one process's 4 steps of 4 x 8 tokens (run once)
  local function moe_baseline()
    if not one then
      one = tmpdir()
      run_ok(train_cmd(1, one, with(m, { "--training.local_batch_size=4", "--training.steps=4" })))
    end
    return losses(one)
  end
  local EP2 = "--parallelism.expert_parallel_degree=2"

  it("DDP 2, FSDP 2, PP 2, CP 2 (ring), TP 2 (sequence parallel), expert parallelism over CP 2, TP 2 x EP 2 and "
    .. "DDP 4 x EP 2 train debugmodel_moe to one process's losses (the experts' counts summed over the data-parallel, "
    .. "context-parallel and tp ranks)", function()
    local a = moe_baseline()
    local DDP_ = { "--parallelism.dp_shard=1" }
    for _, c in ipairs({
      { "DDP 2", 2, with(DDP_, { "--training.local_batch_size=2", "--parallelism.dp_replicate=2" }) },
      { "FSDP 2", 2, { "--training.local_batch_size=2" } },
      { "PP 2", 2, { "--training.local_batch_size=4", "--parallelism.pp=2" } },
      { "CP 2 ring", 2, { "--training.local_batch_size=4", "--parallelism.cp=2",
        "--parallelism.context_parallel_rotate_method=alltoall" } },
      { "TP 2", 2, { "--training.local_batch_size=4", "--parallelism.tp=2" } },
      { "EP 2 over CP 2", 2, { "--training.local_batch_size=4", "--parallelism.cp=2", EP2 } },
      -- (without sequence parallelism the MoE layer runs on the same tokens on both tp ranks)
      { "TP 2 x EP 2", 4, { "--training.local_batch_size=2", "--parallelism.tp=2", EP2,
        "--parallelism.sequence_parallel=false" } },
      { "DDP 4 x EP 2", 4, with(DDP_, { "--training.local_batch_size=1", "--parallelism.dp_replicate=4", EP2 }) },
    }) do
      local dump = tmpdir()
      local out = run_ok(sim_cmd(c[2], dump, with(m, with(c[3], { "--training.steps=3" }))))
      local b = losses(dump)
      for s = 1, 3 do close(a[s], b[s], s, "moe " .. c[1]) end
      if c[1] == "EP 2 over CP 2" then
        assert.truthy(out:find("expert parallel over " .. SIM .. ": each group of 2 data-parallel ranks shares the 8 "
          .. "experts of each of 6 MoE layers, 4 per rank", 1, true), out)
      end
      if c[1] == "DDP 4 x EP 2" then
        assert.truthy(out:find("the experts' gradients summed over the 2 ranks holding the same ones", 1, true), out)
      end
    end
  end)

  -- 2 tokens a rank: in some block no token of an ep group reaches a rank's 4 experts, while the ranks
  -- holding the same experts in the other group got some; the experts' FSDP (sharded over those two ranks)
  -- must reduce there all the same (it waited for ever)
  it("FSDP 4 x EP 2 with 2 tokens a rank trains one process's losses", function()
    local tiny = with(m, { "--training.seq_len=2", "--training.steps=3" })
    local base, four = tmpdir(), tmpdir()
    run_ok(train_cmd(1, base, with(tiny, { "--training.local_batch_size=4" })))
    run_ok("timeout 120 " .. sim_cmd(4, four, with(tiny, { "--training.local_batch_size=1", EP2 })))
    local a, b = losses(base), losses(four)
    for s = 1, 3 do close(a[s], b[s], s, "moe FSDP 4 x EP 2, 2 tokens a rank") end
  end)

  -- (tests/lua/recipes/uneven_val.lua: rank 0's validation data ends after one batch, rank 1's after three;
  -- rank 1 went on into the next batch's exchanges and waited there for ever)
  it("the data-parallel ranks stop validating together when one rank's validation data ends first", function()
    local dump = tmpdir()
    local cmd = sim_cmd(2, dump, with(m, { "--training.local_batch_size=1", "--training.steps=1", EP2,
      "--validation.enable=true", "--validation.freq=1", "--validation.steps=10" }))
    cmd = cmd:gsub("lua/recipes/llama3_debugmodel.lua", "tests/lua/recipes/uneven_val.lua")
    local out = run_ok("timeout 120 " .. cmd)
    assert.truthy(out:find("validate: step +1 +loss: +[%d.]+ +%(16 tokens%)"), out) -- one batch of 8 on each rank
  end)

  it("expert parallelism: FSDP 4 x EP 2 (each expert sharded over the two ranks holding it) and FSDP 2 x EP 2 "
    .. "(each rank's experts whole) train one process's losses; their checkpoints hold each expert once, and resume "
    .. "exactly on EP 2 and without expert parallelism", function()
    -- (over MPI: simulated, its 4-rank FSDP runs cost more than as processes, ~23-26 s against ~20 s on 2 cores)
    if not mpi then return pending("titan was built without Open MPI (libopenmpi-dev)") end
    local a = moe_baseline()
    local function expert5(dump) -- the chunks of one expert's weight in the step-2 checkpoint
      local meta = cjson.decode(assert(io.open(dump .. "/checkpoint/step-2/metadata.json")):read("*a"))
      return assert(meta.tensors["layers.0.moe.experts.5.w1.weight"], "expert 5 saved").chunks
    end
    local function from_step2(src)
      local dump = tmpdir()
      assert.are.equal(0, select(2, sh.run(("mkdir -p %s/checkpoint && cp -r %s/checkpoint/step-2 %s/checkpoint/")
        :format(dump, src, dump))))
      return dump
    end
    local ck = with(m, { "--checkpoint.enable=true", "--checkpoint.interval=2", "--training.steps=4" })
    -- 4 ranks: experts 4-7 on ranks 1 and 3, each holding half of their rows; resumed without EP
    local four = tmpdir()
    local out = run_ok(train_cmd(4, four, with(ck, { "--training.local_batch_size=1", EP2 })))
    assert.truthy(out:find("FSDP shards them over the 2 ranks holding the same ones", 1, true), out)
    local chunks = expert5(four)
    assert.are.equal(2, #chunks, cjson.encode(chunks))
    local four_dense = from_step2(four)
    out = run_ok(train_cmd(4, four_dense, with(ck, { "--training.local_batch_size=1" })))
    assert.truthy(out:find("resumed from step 2", 1, true), out)
    -- 2 ranks: each rank's experts whole, written once; resumed on EP 2 bit for bit
    local two = tmpdir()
    run_ok(train_cmd(2, two, with(ck, { "--training.local_batch_size=2", EP2 })))
    assert.are.equal(1, #expert5(two))
    local two_again = from_step2(two)
    run_ok(train_cmd(2, two_again, with(ck, { "--training.local_batch_size=2", EP2 })))
    local b, c, d, e = losses(four), losses(four_dense), losses(two), losses(two_again)
    for s = 1, 4 do
      close(a[s], b[s], s, "moe FSDP 4 x EP 2")
      close(a[s], d[s], s, "moe FSDP 2 x EP 2")
    end
    for s = 3, 4 do
      close(b[s], c[s], s, "FSDP 4 x EP 2 checkpoint resumed without EP")
      assert.are.equal(d[s], e[s], "step " .. s) -- bit for bit
    end
  end)
end)

describe("context parallelism checkpoints (simulated ranks)", function()
  it("a cp 2 checkpoint resumes exactly on cp 2, and in one process (the same data position)", function()
    local base = { "--checkpoint.enable=true", "--checkpoint.interval=2", "--training.local_batch_size=2",
      "--training.shuffle=true" }
    local ck = with(base, { "--parallelism.cp=2" })
    local straight, resumed, single = tmpdir(), tmpdir(), tmpdir()
    run_ok(sim_cmd(2, straight, with(ck, { "--training.steps=4" })))
    run_ok(sim_cmd(2, resumed, with(ck, { "--training.steps=2" })))
    assert.are.equal(0, os.execute(("cp -r %s/. %s"):format(resumed, single)))
    local out = run_ok(sim_cmd(2, resumed, with(ck, { "--training.steps=4" })))
    assert.truthy(out:find("resumed from step 2", 1, true), out)
    local a, b = losses(straight), losses(resumed)
    for s = 1, 4 do assert.are.equal(a[s], b[s], "step " .. s) end -- bit for bit, shuffled data included
    -- the cp ranks read one data position: one process takes it over
    out = run_ok(train_cmd(1, single, with(base, { "--training.steps=4" })))
    assert.truthy(out:find("resumed from step 2", 1, true), out)
    local c = losses(single)
    for s = 3, 4 do close(a[s], c[s], s, "cp 2 resumed in one process") end
  end)
end)

describe("launcher and layout errors", function()
  local one_line = sh.one_line

  it("--nproc takes a count and something to run", function()
    one_line(exe .. " --nproc 0 x.lua", "--nproc '0': expected a number of processes from 1 to 4096")
    one_line(exe .. " --nproc=two x.lua", "--nproc 'two': expected a number of processes")
    one_line(exe .. " --nproc 2", "--nproc 2 needs what to run")
    one_line(exe .. " --nproc", "--nproc '': expected a number")
    -- --nproc 1 runs the command in this process, no mpirun
    local out, rc = sh.run(exe .. [[ --nproc 1 -e 'print(require("titan.dist").env().world)']])
    assert.are.equal(0, rc, out)
    assert.are.equal("1\n", out)
  end)

  -- (the launcher's environment without the launcher: the layout is checked
  -- before any process group exists)
  local fake = "OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2 "
  it("the degrees must fit the ranks, and the ones not built are refused", function()
    local base = "lua/recipes/llama3_debugmodel.lua --metrics.peak_flops=1e11 --training.steps=1 "
    -- (the line says which rank: with several, only some may fail)
    one_line(fake .. exe .. " " .. base .. "--parallelism.dp_replicate=3 --parallelism.dp_shard=1",
      "titan (rank 0 of 2): trainer: parallelism.dp_replicate x dp_shard = 3 x 1, but the job has 2 rank(s)")
    -- a -1 that would leave a fraction of a rank (3 replicas of 2 ranks; 2 ranks into shards of 4)
    one_line(fake .. exe .. " " .. base .. "--parallelism.dp_replicate=3",
      "dp_replicate x dp_shard = 3 x -1, but the job has 2 rank(s)")
    one_line(fake .. exe .. " " .. base .. "--parallelism.dp_replicate=-1 --parallelism.dp_shard=4",
      "dp_replicate x dp_shard = -1 x 4, but the job has 2 rank(s)")
    one_line(fake .. exe .. " " .. base .. "--parallelism.dp_replicate=-1 --parallelism.dp_shard=-1",
      "both -1")
    -- (GPU ranks: tests/cuemu/multi_gpu_spec.lua; without one, the device is what is missing)
    if titan.cuda_device_count() == 0 then
      one_line(fake .. exe .. " " .. base .. "--parallelism.dp_replicate=2 --parallelism.dp_shard=1 "
        .. "--training.device=cuda", "training.device = cuda, but no CUDA device is visible")
    end
    -- every rank on a host holds the whole model: the debug model's ~0.1 GB, 4096 times, exceed any host here
    one_line("OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=4096 OMPI_COMM_WORLD_LOCAL_SIZE=4096 " .. exe .. " " .. base
      .. "--parallelism.dp_replicate=-1 --parallelism.dp_shard=1", "on each of the 4096 ranks on this host")
    if mpi then -- a launcher's variables that MPI does not share: one line, not a hang
      one_line(fake .. exe .. " " .. base .. "--parallelism.dp_replicate=2 --parallelism.dp_shard=1",
        "mpi: this process is rank 0 of 1 in MPI_COMM_WORLD, but the group was asked for rank 0 of 2")
    end
    one_line(exe .. " " .. base .. "--parallelism.tp=2", "parallelism.tp = 2, but the job has 1 rank(s); expected tp "
      .. "to divide the number of ranks")
    one_line(exe .. " " .. base .. "--parallelism.pp=2", "parallelism.pp = 2, but the job has 1 rank(s); expected pp "
      .. "to divide the number of ranks")
    local two, four = fake, "OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=4 "
    one_line(two .. exe .. " " .. base .. "--parallelism.tp=2 --training.seq_len=33", "training.seq_len = 33 does "
      .. "not split into parallelism.tp = 2 chunks (sequence parallelism); expected a multiple of 2, or "
      .. "--parallelism.sequence_parallel=false")
    one_line(two .. exe .. " " .. base .. "--parallelism.pp=2 --parallelism.tp=2", "parallelism.tp x pp = 2 x 2, but "
      .. "the job has 2 rank(s); expected their product to divide the number of ranks")
    one_line(four .. exe .. " " .. base .. "--parallelism.pp=4 "
      .. "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
      "pp: parallelism.pp = 4 with 2 stage(s) per rank makes 8 stages, more than the model's 6 blocks")
    one_line(two .. exe .. " " .. base .. "--parallelism.pp=2 --parallelism.pipeline_parallel_schedule=Interleaved1F1B "
      .. "--training.local_batch_size=3", "micro-batches in groups of pp = 2, but local_batch_size / "
      .. "pipeline_parallel_microbatch_size = 3 / 1 = 3 micro-batches; expected a multiple of 2")
    one_line(two .. exe .. " " .. base .. "--parallelism.pp=2 --model.flavor=1B",
      "parallelism.pp = 2, but llama3 1B: the flavor ties the output layer to the embedding")
    one_line(exe .. " " .. base .. "--parallelism.pipeline_parallel_microbatch_size=3",
      "pipeline_parallel_microbatch_size = 3 must be a positive divisor of training.local_batch_size")
    one_line(exe .. " " .. base .. "--parallelism.pipeline_parallel_layers_per_stage=0",
      "pipeline_parallel_layers_per_stage = 0; expected a positive number of blocks or -1")
    one_line(exe .. " " .. base .. "--parallelism.pipeline_parallel_schedule=1f1b",
      "pipeline_parallel_schedule must be GPipe, 1F1B or Interleaved1F1B, got '1f1b'")
    -- (checked before any process group: one line, from the launcher's variables alone)
    one_line("OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=3 " .. exe .. " " .. base .. "--parallelism.tp=3",
      "tp: n_kv_heads = 16 is not a multiple of parallelism.tp = 3 (each rank takes whole heads)")
    one_line(fake .. exe .. " " .. base .. "--parallelism.tp=2 --parallelism.dp_replicate=2",
      "parallelism.dp_replicate x dp_shard x tp = 2 x -1 x 2, but the job has 2 rank(s)")
    one_line(exe .. " " .. base .. "--parallelism.fsdp_reshard_after_forward=yes",
      "parallelism.fsdp_reshard_after_forward must be default, always or never, got 'yes'")
    one_line(exe .. " " .. base .. "--parallelism.dp_replicate=0", "parallelism.dp_replicate = 0; expected a positive")
    one_line(exe .. " " .. base .. "--parallelism.cp=2", "parallelism.cp = 2, but the job has 1 rank(s); expected cp "
      .. "to divide the number of ranks")
    one_line(two .. exe .. " " .. base .. "--parallelism.cp=2 --parallelism.tp=2", "parallelism.cp x tp x pp = "
      .. "2 x 2 x 1, but the job has 2 rank(s); expected their product to divide the number of ranks")
    one_line(exe .. " " .. base .. "--parallelism.cp=2 --training.seq_len=30", "training.seq_len = 30 does not split "
      .. "into 2 x parallelism.cp = 2 chunks; expected a multiple of 4")
    one_line(exe .. " " .. base .. "--parallelism.context_parallel_rotate_method=ring",
      "parallelism.context_parallel_rotate_method = 'ring'; expected allgather or alltoall")
    one_line(exe .. " " .. base .. "--parallelism.cp=0", "parallelism.cp = 0; expected a positive degree")
    -- expert parallelism: a flavor with experts, a degree dividing them and the data-parallel ranks
    local three = "OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=3 "
    one_line(two .. exe .. " " .. base .. "--parallelism.expert_parallel_degree=2",
      "parallelism.expert_parallel_degree = 2, but llama3 debugmodel has no mixture-of-experts layers; expected 1, or "
      .. "a flavor with experts")
    one_line(exe .. " " .. base .. "--parallelism.expert_parallel_degree=0",
      "parallelism.expert_parallel_degree = 0; expected a positive degree")
    one_line(three .. exe .. " " .. base .. "--model.flavor=debugmodel_moe --parallelism.expert_parallel_degree=3",
      "expert_parallel_degree = 3 does not divide the 8 experts of llama3 debugmodel_moe's MoE layers")
    one_line(exe .. " " .. base .. "--model.flavor=debugmodel_moe --parallelism.expert_parallel_degree=2",
      "the data-parallel ranks (dp_replicate x dp_shard x cp) are 1 x 1 x 1 = 1; expected a divisor of 1 (the experts "
      .. "are spread over data-parallel ranks), or more ranks (titan --nproc N)")
  end)

  it("dist.env reads mpirun's and srun's variables and checks them", function()
    local function from(vars) return dist.env(function(k) return vars[k] end) end
    local e = from({ OMPI_COMM_WORLD_RANK = "1", OMPI_COMM_WORLD_SIZE = "4", OMPI_COMM_WORLD_LOCAL_RANK = "1",
      OMPI_COMM_WORLD_LOCAL_SIZE = "2" })
    assert.are.same({ rank = 1, world = 4, local_rank = 1, local_size = 2, launcher = "mpirun" }, e)
    e = from({ SLURM_PROCID = "3", SLURM_NTASKS = "8", SLURM_LOCALID = "0", SLURM_NTASKS_PER_NODE = "4(x2)" })
    assert.are.same({ rank = 3, world = 8, local_rank = 0, local_size = 4, launcher = "srun" }, e)
    assert.are.same({ rank = 0, world = 1, local_rank = 0, local_size = 1, launcher = "none" }, from({}))
    local ok, err = pcall(from, { OMPI_COMM_WORLD_RANK = "4", OMPI_COMM_WORLD_SIZE = "4" })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("expected 0 <= rank < world", 1, true), err)
  end)
end)
