-- CUDA graphs on the GPU: a captured function replayed on new inputs gives
-- exactly the eager results; a capture that waits for the device fails
-- cleanly (nil and the reason) and leaves the device usable and its memory
-- as it was; a small Llama 3's forward + backward replayed accumulates the
-- eager gradients bit for bit; replays do not grow memory and freeing the
-- graph returns its pool; the trainer with training.cuda_graphs (forward +
-- backward and the update, clipping active, each a graph) gives the eager
-- run's losses (f32 exactly; bf16 exactly in deterministic mode), with
-- activation checkpointing too (the recomputation inside the capture).
-- Exits 77 without a GPU (helpers.lua); the graph step's bookkeeping is also
-- checked without a GPU by tests/lua/cuda_graph_spec.lua.
package.path = "./tests/cuda/?.lua;" .. package.path
local H = require("helpers")
H.require_device()

local titan = require("titan")
local cuda_graph = require("titan.cuda_graph")
local config = require("titan.config")
local trainer = require("titan.trainer")
local llama3 = require("models.llama3")
local F = titan.F

local DEV = H.DEV
local DEV_STATS = DEV == "cuda" and "cuda:0" or DEV
-- TITAN_GPU_SPEC_DEVICE=cpu (the harness self-test) replays through the
-- emulated graph; what only a real capture has (refusals, pools) is pending.
if not H.ON_GPU then cuda_graph.emulate = true end
local real_it = H.ON_GPU and it or pending
-- On cuemu the trainer runs shorter sequences and fewer steps (still past
-- the capture at step 2 and into replays).
local EMU_ARGS = { "--training.seq_len=32", "--training.local_batch_size=2", "--training.global_batch_tokens=64" }
local STEPS = H.EMULATED and 4 or 6

local SMALL = { dim = 128, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = 512, multiple_of = 64,
  max_seq_len = 128 }

local function small_model()
  local m = llama3.build("debugmodel", { device = DEV, seed = 0, overrides = SMALL })
  return m
end

local function free_model(m)
  if m._rope then m._rope.cos:free(); m._rope.sin:free(); m._rope = nil end
  m:free()
end

local function loss_of(model, x, y)
  local logits = model(x)
  local V = logits:size(-1)
  return F.cross_entropy(logits:reshape(-1, V), y:reshape(-1), { num_tokens = y:numel() })
end

describe("cuda graphs", function()
  it("a captured function replayed on new inputs gives the eager results exactly", H.scoped(function()
    local x = titan.keep(H.dev(H.randn({ 64, 96 }, 1, "float32")))
    local w = titan.keep(H.dev(H.randn({ 80, 96 }, 2, "float32", 0.1)))
    local function f() return { y = titan.softmax(F.linear(x, w):silu()), s = F.linear(x, w):sum() } end
    titan.scope(f) -- once eagerly first, as docs/cuda.md asks: kernels load, library plans are made
    local g, why = cuda_graph.capture(DEV, f)
    assert(g, why)
    assert.truthy(g.num_nodes > 0 or g.emulated)
    for seed = 10, 12 do
      x:copy_(H.dev(H.randn({ 64, 96 }, seed, "float32")))
      g:replay()
      local ref = f()
      H.check_exact(g.outputs.y, ref.y, "softmax(silu(x @ w^T)) replayed, seed " .. seed)
      H.check_exact(g.outputs.s, ref.s, "sum replayed, seed " .. seed)
    end
    g:free()
    x:free(); w:free()
  end))

  real_it("a capture that reads a value back fails cleanly and leaves the device usable", H.scoped(function()
    local x = titan.keep(H.dev(H.randn({ 32, 32 }, 3, "float32")))
    titan.synchronize(DEV)
    local before = titan.memory_stats(DEV_STATS)
    local g, why = cuda_graph.capture(DEV, function()
      local y = x * 2
      return { v = y:sum():item() } -- waits for the device: not capturable
    end)
    assert.is_nil(g)
    assert.truthy(why:find("capture", 1, true), why)
    local after = titan.memory_stats(DEV_STATS)
    assert.are.equal(before.allocated, after.allocated)
    -- the device still computes correctly
    local y = x * 2
    H.check_exact(y, x:to("cpu") * 2, "x * 2 after a failed capture")
    x:free()
  end))

  real_it("a small Llama 3's forward + backward replayed accumulates the eager gradients exactly", H.scoped(function()
    local ids = H.ids({ 2, 65 }, SMALL.vocab_size, 7)
    local x = titan.keep(ids:narrow(2, 1, 64):contiguous():to(DEV))
    local y = titan.keep(ids:narrow(2, 2, 64):contiguous():to(DEV))
    -- eager reference
    local ref = small_model()
    titan.scope(function() loss_of(ref, x, y):backward() end)
    local model = small_model()
    -- warm up (plans, rope tables), then zero the gradients in place
    titan.scope(function() loss_of(model, x, y):backward() end)
    for _, p in ipairs(model:parameters()) do p.grad:zero_() end
    local g, why = cuda_graph.capture(DEV, function() local l = loss_of(model, x, y); l:backward(); return { loss = l } end)
    assert(g, why)
    g:replay()
    local pr, pm = ref:named_parameters(), model:named_parameters()
    for i = 1, #pr do H.check_exact(pm[i][2].grad, pr[i][2].grad, "grad of " .. pr[i][1]) end
    -- a second replay accumulates as a second eager backward does (not
    -- exactly twice the gradient: the embedding's rows add onto the waiting
    -- gradient one id at a time)
    g:replay()
    titan.scope(function() loss_of(ref, x, y):backward() end)
    for i = 1, #pr do H.check_exact(pm[i][2].grad, pr[i][2].grad, "accumulated grad of " .. pr[i][1]) end
    -- replays do not grow memory; freeing the graph returns its pool
    titan.synchronize(DEV)
    local m0 = titan.memory_stats(DEV_STATS)
    for _ = 1, 5 do g:replay() end
    titan.synchronize(DEV)
    local m1 = titan.memory_stats(DEV_STATS)
    assert.are.equal(m0.allocated, m1.allocated)
    assert.are.equal(m0.reserved, m1.reserved)
    local pool = g:memory_stats().reserved
    assert.truthy(pool > 0)
    g:free()
    local m2 = titan.memory_stats(DEV_STATS)
    assert.are.equal(m1.reserved - pool, m2.reserved)
    free_model(ref); free_model(model)
    x:free(); y:free()
  end))

  local function train(extra, steps)
    local recipe = config.load_recipe("llama3_debugmodel")
    local argv = { "--job.dump_folder=" .. os.tmpname() .. ".d", "--metrics.enable_jsonl=false",
      "--metrics.peak_flops=1e15", "--metrics.log_freq=1000", "--validation.enable=false",
      "--training.device=" .. DEV, "--training.seq_len=128", "--training.local_batch_size=4",
      "--training.global_batch_tokens=1024", "--lr_scheduler.warmup_steps=2" }
    if H.EMULATED then for _, a in ipairs(EMU_ARGS) do argv[#argv + 1] = a end end
    for _, a in ipairs(extra) do argv[#argv + 1] = a end
    local lines = {}
    local tr = trainer.new(config.resolve(recipe, argv), { print = function(l) lines[#lines + 1] = l end })
    local ok, losses = pcall(tr.train, tr, steps)
    tr:close()
    free_model(tr.model)
    assert(ok, losses)
    return losses, table.concat(lines, "\n")
  end

  local eager_f32 -- the plain f32 run's losses, shared by the tests below
  local function eager_losses() eager_f32 = eager_f32 or train({}, STEPS); return eager_f32 end

  it("the trainer with training.cuda_graphs gives the eager losses (f32, exactly)", function()
    local eager = eager_losses()
    local graphed, log = train({ "--training.cuda_graphs=true" }, STEPS)
    io.stderr:write("\n  " .. log:gsub("\n", "\n  ") .. "\n")
    assert.truthy(log:find("captured forward + backward", 1, true), log)
    assert.truthy(log:find("captured the update of", 1, true), log) -- clip + AdamW + zero_grad: a graph too
    assert.are.same(eager, graphed)
  end)

  it("activation checkpointing gives the plain losses, eager and replayed from CUDA graphs (f32, exactly)", function()
    -- (recomputation adds no cross-stream work: the deferred-stream runs of
    -- this spec leave it to the plain cuemu run and the GPU)
    if os.getenv("TITAN_CUEMU_STREAMS") == "deferred" then
      return pending("no work across streams here; run by cuemu/graph_spec and on a GPU")
    end
    local plain = eager_losses()
    local ac = train({ "--activation_checkpoint.mode=full" }, STEPS)
    assert.are.same(plain, ac)
    -- per op (attention's output and statistics kept from the forward), the
    -- recomputation inside the captured backward
    local graphed, log = train({ "--activation_checkpoint.mode=selective",
      "--activation_checkpoint.selective_ac_option=op", "--training.cuda_graphs=true" }, STEPS)
    assert.truthy(log:find("captured forward + backward", 1, true), log)
    assert.are.same(plain, graphed)
  end)

  real_it("the trainer with training.cuda_graphs gives the eager losses (bf16, deterministic mode)", function()
    local extra = { "--training.mixed_precision_param=bfloat16", "--debug.deterministic=true" }
    local eager = train(extra, STEPS)
    local with = { "--training.cuda_graphs=true" }
    for _, a in ipairs(extra) do with[#with + 1] = a end
    local graphed, log = train(with, STEPS)
    assert.truthy(log:find("captured forward + backward", 1, true), log)
    assert.truthy(log:find("captured the update of", 1, true), log) -- clip + AdamW + zero_grad: a graph too
    assert.are.same(eager, graphed)
  end)
end)
