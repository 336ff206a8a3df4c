-- Training on several GPUs, its collectives over NCCL, run here as ranks of
-- titan_cuemu (`titan_cuemu --nproc N`: each rank a process with the CUDA
-- backend emulated on the CPU, TITAN_CUEMU_DEVICES GPUs a host, cuemu's NCCL
-- across them over MPI; tests/cuemu/README.md): every collective of the nccl
-- backend at world 3; DDP, FSDP, TP, HSDP and FSDP x TP against one GPU
-- (losses and gradient norms); pipeline schedules, alone and with FSDP;
-- bf16 mixed precision under FSDP; an FSDP checkpoint resumed bit for bit;
-- and the layouts refused on GPUs. Exits 77
-- (skipped) anywhere but on cuemu; pending in a build without Open MPI.
package.path = "./tests/cuda/?.lua;./tests/cuemu/?.lua;" .. package.path
local S = require("step_helpers")
S.require_cuemu("void tt_emu_counts_get(void *out);", "tt_emu_counts_get")
local dist = require("titan.dist")
local env = require("titan.env")
local cjson = require("cjson")
local sh = dofile("tests/lua/shell.lua")

local exe = env.build_dir .. "/titan_cuemu"
local mpi = dist.built("mpi")
local NO_MPI = "titan_cuemu was built without Open MPI (libopenmpi-dev): no ranks to run"

-- The debug model, tiny; each of `nproc` ranks on its own emulated GPU.
local function train_cmd(nproc, dump, extra, env_pre)
  local args = { "lua/recipes/llama3_debugmodel.lua", "--job.dump_folder=" .. dump, "--metrics.peak_flops=1e11",
    "--metrics.log_freq=1", "--metrics.enable_jsonl=true", "--training.seq_len=32", "--validation.enable=false",
    "--training.shuffle=false", "--lr_scheduler.warmup_steps=2", "--training.device=cuda" }
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  for i, a in ipairs(args) do args[i] = sh.quote(a) end
  local pre = (env_pre or "") .. ("TITAN_CUEMU=1 TITAN_CUEMU_DEVICES=%d "):format(nproc)
    .. (nproc > 1 and ("%s --nproc %d "):format(exe, nproc) or ("OMP_NUM_THREADS=2 %s "):format(exe))
  return pre .. table.concat(args, " ")
end

local run_ok, with = sh.run_ok, sh.with

-- {loss, grad_norm} by step from metrics.jsonl (rank 0's; a resume appends).
local function curve(dump)
  local out = {}
  for line in io.lines(dump .. "/metrics.jsonl") do
    local r = cjson.decode(line)
    if r.loss then out[r.step] = { r.loss, r.grad_norm } end
    if r.validation_loss then out.val = r.validation_loss end
  end
  return out
end

-- The same losses and gradient norms up to the rounding of sums taken in
-- another order (rel: 2e-5 for float32).
local function matches(want, got, steps, rel, what)
  for s = 1, steps do
    for k, name in ipairs({ "loss", "grad_norm" }) do
      local a, b = want[s][k], got[s][k]
      assert.is_true(math.abs(a - b) <= rel * math.abs(a), ("%s step %d %s: %.9g vs %.9g"):format(what, s, name, a, b))
    end
  end
end

-- A validation at step 3 over 2 batches.
local VAL = { "--validation.enable=true", "--validation.freq=3", "--validation.steps=2" }

-- One GPU, global batch 4 x 32, 3 steps, validated at step 3 (run once per precision).
local base = {}
local function one_gpu(extra)
  local key = table.concat(extra or {}, " ")
  if not base[key] then
    base[key] = sh.tmpdir()
    run_ok(train_cmd(1, base[key], with(with(VAL, { "--training.steps=3", "--training.local_batch_size=4" }), extra)))
  end
  return curve(base[key])
end

describe("the nccl backend across processes", function()
  it("every collective at world 3, each rank on its own GPU; Lua values through the MPI host group", function()
    if not mpi then return pending(NO_MPI) end
    sh.worker_ok("TITAN_CUEMU=1 TITAN_CUEMU_DEVICES=3 TITAN_WORKER_BACKEND=nccl ", exe, 3, 61)
  end)
end)

describe("training on several GPUs over NCCL", function()
  it("DDP, FSDP, TP and CP on 2 GPUs train the losses and gradient norms of one GPU", function()
    if not mpi then return pending(NO_MPI) end
    local want = one_gpu()
    local cases = {
      -- (each block's sums started in its backward hook, the compute stream waiting only before the update)
      { "DDP", { "--training.local_batch_size=2", "--parallelism.dp_replicate=2", "--parallelism.dp_shard=1" },
        "data parallel over NCCL: 2 ranks (DDP: each block's gradients summed during the backward",
        "DDP: 6 of 6 blocks' gradient sums started during the backward" },
      { "DDP, sums after the backward", { "--training.local_batch_size=2", "--parallelism.dp_replicate=2",
        "--parallelism.dp_shard=1", "--parallelism.ddp_overlap=false" },
        "data parallel over NCCL: 2 ranks (DDP: gradients summed in ~25 MB buckets" },
      -- each stream's work queued until the host waits for it, in both orders (tests/cuemu/README.md): an
      -- update that did not wait for the sums would read the rank's own gradients in the first; two
      -- micro-batches (the hooks reduce on the last one only) and checkpointed blocks (their
      -- recomputation inside the backward hooks again)
      { "DDP, deferred streams, 2 micro-batches, full AC", { "--training.local_batch_size=1",
        "--parallelism.dp_replicate=2", "--parallelism.dp_shard=1", "--training.global_batch_tokens=128",
        "--activation_checkpoint.mode=full" }, "DDP: 6 of 6 blocks' gradient sums started during the backward",
        nil, "TITAN_CUEMU_STREAMS=deferred " },
      { "DDP, deferred streams in reverse", { "--training.local_batch_size=2", "--parallelism.dp_replicate=2",
        "--parallelism.dp_shard=1" }, "DDP: 6 of 6 blocks' gradient sums started during the backward", nil,
        "TITAN_CUEMU_STREAMS=deferred TITAN_CUEMU_ORDER=reverse " },
      { "FSDP", { "--training.local_batch_size=2" }, "data parallel over NCCL: 2 ranks, FSDP over 2 shards",
        "the next block's parameters gathered while one computes and each block's gradients reduced during the "
        .. "backward" },
      { "FSDP, collectives in line", { "--training.local_batch_size=2", "--parallelism.fsdp_overlap=false" },
        "(reshard after forward: default); tps and MFU are per rank" },
      -- the gathers prefetched and the reductions waited for at the end, with each stream's work deferred in
      -- both orders: a block that did not wait for its gather would compute with the memory the allocator
      -- gave it (cuemu: 0xff bytes), an update that did not wait for the reductions would read stale shards;
      -- reshard always (a gather before each backward too), 2 micro-batches, checkpointed blocks
      { "FSDP, deferred streams, reshard always, 2 micro-batches, full AC", { "--training.local_batch_size=1",
        "--training.global_batch_tokens=128", "--parallelism.fsdp_reshard_after_forward=always",
        "--activation_checkpoint.mode=full" }, "FSDP over 2 shards", nil, "TITAN_CUEMU_STREAMS=deferred " },
      { "FSDP, deferred streams in reverse", { "--training.local_batch_size=2" }, "FSDP over 2 shards", nil,
        "TITAN_CUEMU_STREAMS=deferred TITAN_CUEMU_ORDER=reverse " },
      { "TP", { "--training.local_batch_size=4", "--parallelism.tp=2" }, "tensor parallel: 2 ranks" },
      -- each sequence over the 2 GPUs: keys and values gathered and their gradients reduce-scattered over NCCL,
      -- with each stream's work deferred too
      -- (rank 0's two chunks attend to 8 and 32 keys: two shapes, a notice each)
      { "CP", { "--training.local_batch_size=4", "--parallelism.cp=2" },
        "context parallel over NCCL: 2 ranks per sequence, each holding 16 of its 32 tokens", notices = 2 },
      { "CP, deferred streams", { "--training.local_batch_size=4", "--parallelism.cp=2" },
        "context parallel over NCCL", nil, "TITAN_CUEMU_STREAMS=deferred ", notices = 2 },
      -- ring attention: keys and values (then their gradients) sent around the ring while a block computes,
      -- each stream's work deferred in both orders: a block that did not wait for the keys it was sent would
      -- attend to the allocator's 0xff bytes, a send that did not wait for its block would send stale sums
      -- (rank 0 runs 8 queries against 8 keys and 16 keys, causal, and 16 keys, all: three notices)
      { "CP ring, deferred streams", { "--training.local_batch_size=4", "--parallelism.cp=2",
        "--parallelism.context_parallel_rotate_method=alltoall" }, "ring attention (alltoall)", nil,
        "TITAN_CUEMU_STREAMS=deferred ", notices = 3 },
      { "CP ring, deferred streams in reverse", { "--training.local_batch_size=4", "--parallelism.cp=2",
        "--parallelism.context_parallel_rotate_method=alltoall" }, "ring attention (alltoall)", nil,
        "TITAN_CUEMU_STREAMS=deferred TITAN_CUEMU_ORDER=reverse ", notices = 3 },
    }
    for _, c in ipairs(cases) do
      local dump = sh.tmpdir()
      local out = run_ok(train_cmd(2, dump, with(c[2], { "--training.steps=3" }), c[5]))
      assert.truthy(out:find(c[3], 1, true), out)
      if c[4] then assert.truthy(out:find(c[4], 1, true), out) end
      matches(want, curve(dump), 3, 2e-5, c[1])
      -- (the attention fallback's notice comes from rank 0 alone: every rank takes the same path)
      local _, notices = out:gsub("cuDNN SDPA unavailable for forward", "")
      assert.are.equal(c.notices or 1, notices, out)
    end
    assert.is_true(want[3][1] < want[1][1]) -- it learns
  end)

  -- expert parallelism: each layer's rows sent to their experts' GPU and back (batches of sends and
  -- receives on the nccl backend), each stream's work deferred: an expert that read its rows before they
  -- arrived would compute with the allocator's 0xff bytes
  it("a mixture of experts spread over 2 GPUs (FSDP 2 x EP 2, deferred streams) trains one GPU's losses", function()
    if not mpi then return pending(NO_MPI) end
    local m = { "--model.flavor=debugmodel_moe", "--training.steps=2" }
    local one, two = sh.tmpdir(), sh.tmpdir()
    run_ok(train_cmd(1, one, with(m, { "--training.local_batch_size=4" })))
    local out = run_ok(train_cmd(2, two, with(m, { "--training.local_batch_size=2",
      "--parallelism.expert_parallel_degree=2" }), "TITAN_CUEMU_STREAMS=deferred "))
    assert.truthy(out:find("expert parallel over NCCL: each group of 2 data-parallel ranks shares the 8 experts", 1,
      true), out)
    matches(curve(one), curve(two), 2, 2e-5, "FSDP 2 x EP 2")
  end)

  it("HSDP 2 x 2 and FSDP x TP on 4 GPUs train the losses of one GPU", function()
    if not mpi then return pending(NO_MPI) end
    local want = one_gpu()
    for what, extra in pairs({ HSDP = { "--training.local_batch_size=1", "--parallelism.dp_replicate=2" },
      ["FSDP x TP"] = { "--training.local_batch_size=2", "--parallelism.tp=2" } }) do
      local dump = sh.tmpdir()
      run_ok(train_cmd(4, dump, with(extra, { "--training.steps=3" })))
      matches(want, curve(dump), 3, 2e-5, what)
    end
  end)

  -- (and bf16 ring attention: bf16 blocks folded into f32 sums, the gradients' sums in f32 too)
  it("bf16 parameters under FSDP and under CP's ring on 2 GPUs: one GPU's curve up to bf16 rounding", function()
    if not mpi then return pending(NO_MPI) end
    local bf16 = { "--training.mixed_precision_param=bfloat16" }
    local want = one_gpu(bf16)
    local layouts = { FSDP = { "--training.local_batch_size=2" }, ["CP ring"] = { "--training.local_batch_size=4",
      "--parallelism.cp=2", "--parallelism.context_parallel_rotate_method=alltoall" } }
    for what, extra in pairs(layouts) do
      local dump = sh.tmpdir()
      run_ok(train_cmd(2, dump, with(bf16, with(extra, { "--training.steps=3" }))))
      local got = curve(dump)
      for s = 1, 3 do
        -- (the loss is each rank's bf16 loss, averaged: a bf16 step at 8 is 1/32)
        assert.is_true(math.abs(want[s][1] - got[s][1]) <= 0.07, ("%s step %d loss: %.9g vs %.9g"):format(what, s,
          want[s][1], got[s][1]))
        assert.is_true(math.abs(want[s][2] - got[s][2]) <= 2e-3 * want[s][2], ("%s step %d grad_norm: %.9g vs %.9g")
          :format(what, s, want[s][2], got[s][2]))
      end
    end
  end)

  it("pipeline stages on GPUs (in steps, sends batched with receives): 1F1B, GPipe, Interleaved1F1B on 2; pp x FSDP "
    .. "on 4",
    function()
      if not mpi then return pending(NO_MPI) end
      local want = one_gpu()
      -- (validated too: the forward-only pass, stage by stage)
      local pp = with(VAL, { "--training.local_batch_size=4", "--parallelism.pp=2" })
      local cases = {
        { "1F1B", 2, pp, "pipeline parallel: 2 stages over 2 ranks (1F1B, 4 micro-batches" },
        -- (each stream's work deferred until the host needs it, in both orders: an input used before its
        -- batch is waited for reads a buffer the communication stream has not written)
        { "GPipe", 2, with(pp, { "--parallelism.pipeline_parallel_schedule=GPipe" }), "(GPipe",
          "TITAN_CUEMU_STREAMS=deferred TITAN_CUEMU_ORDER=reverse " },
        -- (4 micro-batches: two rounds, which hung when a send waited for its rank's next receive)
        { "Interleaved1F1B", 2, with(pp, { "--parallelism.pipeline_parallel_schedule=Interleaved1F1B" }),
          "4 stages over 2 ranks (Interleaved1F1B, 4 micro-batches", "TITAN_CUEMU_STREAMS=deferred " },
        { "pp x FSDP", 4, { "--training.local_batch_size=2", "--parallelism.pp=2" },
          "data parallel over NCCL: 2 ranks, FSDP over 2 shards" },
      }
      for _, c in ipairs(cases) do
        local dump = sh.tmpdir()
        local out = run_ok(train_cmd(c[2], dump, with(c[3], { "--training.steps=3" }), c[5]))
        assert.truthy(out:find(c[4], 1, true), out)
        local got = curve(dump)
        matches(want, got, 3, 2e-5, c[1])
        if c[2] == 2 then
          assert.is_true(math.abs(got.val - want.val) <= 2e-5 * want.val, ("%s validation: %.9g vs %.9g"):format(c[1],
            got.val, want.val))
        end
      end
    end)

  it("an FSDP checkpoint written by 2 GPUs resumes there bit for bit", function()
    if not mpi then return pending(NO_MPI) end
    local ck = { "--checkpoint.enable=true", "--checkpoint.interval=2", "--training.local_batch_size=2",
      "--training.steps=3" }
    local straight, resumed = sh.tmpdir(), sh.tmpdir()
    run_ok(train_cmd(2, straight, ck))
    assert.are.equal(0, select(2, sh.run(("mkdir -p %s/checkpoint && cp -r %s/checkpoint/step-2 %s/checkpoint/")
      :format(resumed, straight, resumed))))
    local out = run_ok(train_cmd(2, resumed, ck))
    assert.truthy(out:find("resumed from step 2", 1, true), out)
    local a, b = curve(straight), curve(resumed)
    assert.are.same(a[3], b[3])
  end)
end)

describe("layouts refused on GPUs", function()
  -- (the launcher's environment without the launcher: checked before any group exists)
  local function one_line(vars, extra, pattern)
    local out, rc = sh.run(("unset CUDA_VISIBLE_DEVICES; TITAN_CUEMU=1 OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2 "
      .. "%s %s lua/recipes/llama3_debugmodel.lua --metrics.peak_flops=1e11 --training.steps=1 %s"):format(vars, exe,
      extra))
    assert.are_not.equal(0, rc, out)
    assert.truthy(out:find(pattern, 1, true), ("'%s' lacks '%s'"):format(out, pattern))
    local _, lines = out:gsub("\n", "")
    assert.is_true(lines <= 2, out) -- (the line, and the rank prefix's)
  end

  it("ranks sharing a GPU, more ranks than GPUs: one line each", function()
    one_line("TITAN_CUEMU_DEVICES=2 OMPI_COMM_WORLD_LOCAL_SIZE=2", "--training.device=cuda:0",
      "training.device = cuda:0 puts the 2 ranks of this host on one GPU; expected training.device=cuda")
    one_line("TITAN_CUEMU_DEVICES=1 OMPI_COMM_WORLD_LOCAL_SIZE=2", "--training.device=cuda",
      "2 ranks on this host, but 1 GPU is visible; expected one GPU per rank")
  end)
end)
