-- FSDP (lua/parallel/fsdp.lua) in one process through the fake backend: at
-- world 1 the sharded model's gradients are the plain model's bit for bit
-- (the all-gather and the reduce-scatter are copies there); the hooks bring
-- a block's parameters back and free them when FSDP2 does; a parameter
-- used while it is sharded is one clear error; at world 4 the shards are
-- torch.chunk's rows, uneven ones too. The storage primitives under it.
-- Across real processes (losses, checkpoints, memory): mpi_spec.
local titan = require("titan")
local autograd = require("titan.autograd")
local dist = require("titan.dist")
local nn = require("titan.nn")
local fsdp = require("parallel.fsdp")
local ac = require("parallel.ac")
local llama = require("models.llama3")

local function flat(t) return t:tolist_flat() end

local function err(fn)
  local ok, e = pcall(fn)
  assert.is_false(ok)
  return tostring(e)
end

describe("tensor storage free / alloc", function()
  it("frees the memory, keeps the tensor and its views, and ops say so until it comes back", function()
    local w = titan.keep(titan.tensor({ { 1, 2 }, { 3, 4 } })):requires_grad_()
    local x = titan.keep(titan.tensor({ { 1, 1 }, { 2, 2 } }))
    local row = titan.keep(w:narrow(1, 2, 1))
    local big = titan.keep(titan.ones(256, 1024))
    local before = titan.memory_stats("cpu").allocated
    big:free_storage()
    assert.are.equal(before - 2 ^ 20, titan.memory_stats("cpu").allocated)
    big:alloc_storage()
    assert.are.equal(before, titan.memory_stats("cpu").allocated)
    big:free()
    titan.scope(function()
      local y = titan.F.linear(x, w) -- the node holds w for its backward
      w:free_storage()
      assert.is_false(w:has_storage())
      assert.truthy(err(function() return w:sum() end):find("has no memory: its storage was freed", 1, true))
      assert.truthy(err(function() return row:tolist() end):find("has no memory", 1, true))
      assert.truthy(err(function() w:fill_(0) end):find("has no memory", 1, true))
      w:alloc_storage()
      titan.no_grad(function() w:copy_(titan.tensor({ { 5, 6 }, { 7, 8 } })) end)
      assert.are.same({ 7, 8 }, flat(row)) -- the view sees the memory that came back
      y:sum():backward()
    end)
    -- d(sum(x w^T))/dw = column sums of x, whatever w holds; x's grad would read w: check the forward used the old w
    assert.are.same({ 3, 3, 3, 3 }, flat(w.grad))
    row:free(); w:free(); x:free()
  end)
end)

local tiny = dofile("tests/lua/tiny_llama.lua")
local ARGS = tiny.ARGS
local function ids_batch() return tiny.ids_batch(5) end

-- The plain model's gradients, or FSDP's at world 1 (fake backend), by name.
local function grads(opts)
  local model = llama.build(ARGS, { device = "meta" })
  if opts.ac then ac.apply(model, { mode = opts.ac }) end
  model:to_empty("cpu")
  llama.init_weights(model, 3)
  local sharded
  if opts.fsdp then
    sharded = fsdp.apply(model, dist.new_group({ backend = "fake", rank = 0, world = 1 }),
      { reshard_after_forward = opts.fsdp, overlap = opts.overlap })
  end
  local ids = ids_batch()
  for _ = 1, opts.micro or 1 do -- gradient accumulation: the shards' .grad adds up
    titan.scope(function()
      local logits = model(ids)
      titan.F.cross_entropy(logits:reshape(-1, 96), ids:reshape(-1)):backward()
    end)
  end
  local out = {}
  local named = sharded and sharded:named_parameters() or model:named_parameters()
  for _, np in ipairs(named) do out[np[1]] = flat(np[2].grad) end
  ids:free()
  return out, sharded, model
end

describe("FSDP at world 1 (fake backend)", function()
  it("gives the plain model's gradients bit for bit, under every reshard policy, with AC, accumulated", function()
    local plain = grads({})
    for _, policy in ipairs({ "default", "always", "never" }) do
      local g, sharded, model = grads({ fsdp = policy })
      assert.are.same(plain, g, policy)
      sharded:free(); model:free()
    end
    local g_ac, sharded, model = grads({ fsdp = "default", ac = "full" })
    assert.are.same(plain, g_ac)
    sharded:free(); model:free()
    -- (accumulated, the sums round differently: the plain tape's GEMMs add each
    -- micro-batch's products into .grad, FSDP adds the reduced full gradients)
    local plain2 = grads({ micro = 2 })
    g_ac, sharded, model = grads({ fsdp = "always", micro = 2 })
    local worst = 0
    for name, v in pairs(plain2) do
      assert.are.equal(#v, #g_ac[name], name)
      for i = 1, #v do worst = math.max(worst, math.abs(v[i] - g_ac[name][i]) / (math.abs(v[i]) + 1e-3)) end
    end
    assert.truthy(worst < 1e-5, "accumulated gradients differ by " .. worst)
    assert.are_not.same(plain, plain2) -- (the accumulation did add up)
    sharded:free(); model:free()
  end)

  it("gathers each block for its forward and again for its backward only when it was resharded", function()
    for policy, gathers in pairs({ default = 4 + 2, always = 4 + 3, never = 4 }) do
      local _, sharded, model = grads({ fsdp = policy })
      -- forward: the root and 3 blocks; backward: the blocks freed after their forward
      assert.are.equal(gathers, sharded.stats.all_gathers, policy)
      assert.are.equal(4, sharded.stats.reduce_scatters, policy) -- one per unit
      for _, np in ipairs(model:named_parameters()) do
        assert.is_false(np[2]:has_storage(), np[1]) -- every unit resharded after the backward
        assert.is_nil(np[2].grad, np[1]) -- the full gradients went into the shards
      end
      sharded:free(); model:free()
    end
  end)

  -- Overlap (the trainer's on nccl): the fake backend runs the asynchronous collectives at once, so
  -- this checks the bookkeeping (which gathers are prefetched and consumed, the reductions finished by
  -- the final callback); multi_gpu_spec checks the streams.
  it("with overlap: the same gradients bit for bit; each gather prefetched once, none left in flight", function()
    local plain = grads({})
    -- forward: the root starts block 0's gather, blocks 0 and 1 the next one's; backward: the root the
    -- last block's, blocks 2 and 1 the one before (each only when that block was resharded)
    for policy, want in pairs({ default = { 4 + 2, 3 + 2 }, always = { 4 + 3, 3 + 3 }, never = { 4, 3 } }) do
      local g, sharded, model = grads({ fsdp = policy, overlap = true })
      assert.are.same(plain, g, policy)
      assert.are.equal(want[1], sharded.stats.all_gathers, policy)
      assert.are.equal(want[2], sharded.stats.prefetches, policy)
      assert.are.equal(4, sharded.stats.reduce_scatters, policy)
      for _, u in ipairs(sharded.units) do
        assert.is_nil(u.gather, u.name .. ": a gather left in flight")
        assert.is_nil(u.reducing, u.name .. ": a reduction left in flight")
      end
      for _, np in ipairs(model:named_parameters()) do assert.is_false(np[2]:has_storage(), np[1]) end
      sharded:free(); model:free()
    end
    local g_ac, sharded, model = grads({ fsdp = "default", ac = "full", overlap = true })
    assert.are.same(plain, g_ac, "full AC")
    sharded:free(); model:free()
    local plain2 = grads({ fsdp = "always", micro = 2 })
    local g2
    g2, sharded, model = grads({ fsdp = "always", micro = 2, overlap = true })
    assert.are.same(plain2, g2, "2 micro-batches")
    -- without recording: every block's gather consumed or dropped, every parameter freed again
    local ids = ids_batch()
    titan.no_grad(function() titan.scope(function() return model(ids) end) end)
    for _, u in ipairs(sharded.units) do assert.is_nil(u.gather, u.name) end
    for _, np in ipairs(model:named_parameters()) do assert.is_false(np[2]:has_storage(), np[1]) end
    ids:free(); sharded:free(); model:free()
  end)

  it("without recording, the forward frees every parameter again; a sharded one used outside is an error", function()
    local _, sharded, model = grads({ fsdp = "never" })
    local ids = ids_batch()
    titan.no_grad(function() titan.scope(function() return model(ids) end) end)
    for _, np in ipairs(model:named_parameters()) do assert.is_false(np[2]:has_storage(), np[1]) end
    local e = err(function() return model.layers["0"].attention.wq.weight:sum() end)
    assert.truthy(e:find("has no memory: its storage was freed (a parameter that FSDP keeps sharded", 1, true), e)
    assert.truthy(err(function() fsdp.apply(model, sharded.group, { reshard_after_forward = "sometimes" }) end)
      :find("reshard_after_forward = 'sometimes'; expected default, always or never", 1, true))
    ids:free(); sharded:free(); model:free()
  end)

  it("initializes a model without memory one block at a time, to the weights a whole initialization gives", function()
    local whole = llama.build(ARGS, { device = "cpu", seed = 3 })
    local bytes = whole:num_parameters() * 4
    -- opts.init: a block's full parameters initialized, then their rows kept; opts.init_shard: each rank's rows
    -- drawn alone (the counter-based RNG at their places), no full parameter ever
    for _, case in ipairs({ { 0, "init" }, { 3, "init" }, { 0, "init_shard" }, { 3, "init_shard" } }) do
      local rank = case[1]
      local model = llama.build(ARGS, { device = "meta" })
      model:to_empty("cpu", { params_storage = false })
      for _, np in ipairs(model:named_parameters()) do assert.is_false(np[2]:has_storage()) end
      titan.reset_peak_memory("cpu")
      local base = titan.memory_stats("cpu").allocated
      local opts = { init = function(names) llama.init_weights(model, 3, names) end }
      if case[2] == "init_shard" then
        opts.init_shard = function(name, t, offset) llama.init_param(model.args, 3, name, t, offset) end
      end
      local sharded = fsdp.apply(model, dist.new_group({ backend = "fake", rank = rank, world = 4 }), opts)
      local peak = titan.memory_stats("cpu").peak_allocated - base
      -- a quarter of the model kept, one block's full parameters at a time on top (init), or none (init_shard)
      local most = case[2] == "init" and 0.75 or 0.3
      assert.truthy(peak < most * bytes, ("%s: peak %d bytes while sharding a %d-byte model"):format(case[2], peak,
        bytes))
      local full = {}
      for _, np in ipairs(whole:named_parameters()) do full[np[1]] = np[2] end
      for _, np in ipairs(sharded:named_parameters()) do
        local g, off = sharded.shard_of(np[1])
        local rows = np[2]:size(1)
        assert.are.same(flat(full[np[1]]:narrow(1, off[1] + 1, rows)), flat(np[2]), np[1])
        assert.are.same(g, full[np[1]]:shape())
      end
      sharded:free(); model:free()
    end
    whole:free()
    -- (materialized parameters are the other way in; neither is an error that says so)
    local model = llama.build(ARGS, { device = "meta" })
    model:to_empty("cpu", { params_storage = false })
    assert.truthy(err(function() fsdp.apply(model, dist.new_group({ backend = "fake", rank = 0, world = 2 })) end)
      :find("fsdp: layers.0.[%w_.]+ has no memory; expected materialized parameters, or opts.init"))
    model:free()
  end)

  -- (expert parallelism's experts: each rank keeps its own whole, lua/parallel/ep.lua)
  it("keeps the parameters it is told to keep whole: initialized, never freed, listed, without a box", function()
    local whole = llama.build(ARGS, { device = "cpu", seed = 3 })
    local model = llama.build(ARGS, { device = "meta" })
    model:to_empty("cpu", { params_storage = false })
    local w2 = model.layers["1"].feed_forward.w2.weight
    local sharded = fsdp.apply(model, dist.new_group({ backend = "fake", rank = 1, world = 4 }),
      { init = function(names) llama.init_weights(model, 3, names) end, keep = { [w2] = true } })
    local name = "layers.1.feed_forward.w2.weight"
    assert.are.same(flat(whole.layers["1"].feed_forward.w2.weight), flat(w2)) -- initialized whole
    assert.is_nil(sharded.shard_of(name)) -- (the checkpoint writes it whole)
    local listed
    for _, np in ipairs(sharded:named_parameters()) do
      if np[1] == name then listed = np[2] end
    end
    assert.are.equal(w2, listed)
    -- a forward without recording frees every unit's gathered parameters, not the kept one
    local ids = ids_batch()
    titan.no_grad(function() titan.scope(function() model(ids) end) end)
    assert.is_true(w2:has_storage())
    assert.is_false(model.layers["1"].feed_forward.w1.weight:has_storage())
    ids:free(); sharded:free(); model:free(); whole:free()
  end)

  -- (float8.enable_fsdp_float8_all_gather; across real ranks: mpi_spec)
  it("gathers float8 layers' weights in fp8: the gradients of gathering them whole, a fraction of the bytes",
    function()
    local f8 = require("parallel.float8")
    local function run(fp8, world)
      local model = llama.build(ARGS, { device = "cpu", seed = 3 })
      f8.apply(model, {})
      local sharded = fsdp.apply(model, dist.new_group({ backend = "fake", rank = 0, world = world }),
        { fp8 = fp8 and f8.fsdp_fp8(model) or nil })
      local ids = ids_batch()
      titan.scope(function() titan.F.cross_entropy(model(ids):reshape(-1, 96), ids:reshape(-1)):backward() end)
      local out = {}
      for _, np in ipairs(sharded:named_parameters()) do out[np[1]] = flat(np[2].grad) end
      assert.is_nil(next(f8.gathered), "an fp8 weight left published after the backward")
      ids:free()
      return out, sharded.stats.gathered_bytes, function() sharded:free(); model:free() end
    end
    for _, world in ipairs({ 1, 4 }) do
      local want, bytes, free1 = run(false, world)
      local got, bytes8, free2 = run(true, world)
      assert.are.same(want, got)
      -- the 21 converted weights (92% of the parameters) at 1 byte instead of 4: 0.29 of the bytes
      assert.truthy(bytes8 < 0.45 * bytes, ("world %d: %d bytes gathered in fp8, %d without"):format(world, bytes8,
        bytes))
      free1(); free2()
    end
  end)

  it("a model without blocks is refused", function()
    local m = nn.Linear(4, 4)
    assert.truthy(err(function() fsdp.apply(m, dist.new_group({ backend = "fake", rank = 0, world = 1 })) end)
      :find("the model has no `layers`", 1, true))
    m:free()
  end)
end)

describe("FSDP shards at world 4 (fake backend)", function()
  local Net = nn.Module:extend("Net")
  function Net:init()
    self.layers = nn.Module:extend("Blocks")()
    self.layers:child("0", nn.Linear(4, 5)) -- 5 rows over 4 ranks: 2, 2, 1, 0
    self.head = nn.Linear(5, 12)            -- 12 rows: 3 each
  end
  function Net:forward(x) return self.head(self.layers["0"](x)) end

  it("are torch.chunk's rows, a rank past the end holds none, and the checkpoint boxes say where", function()
    local want = {
      [2] = { w0 = { 1, 4 }, off0 = { 4, 0 }, head = { 3, 5 }, offh = { 6, 0 } },
      [3] = { head = { 3, 5 }, offh = { 9, 0 } },
    }
    for rank, w in pairs(want) do
      local net = Net()
      local sharded = fsdp.apply(net, dist.new_group({ backend = "fake", rank = rank, world = 4 }))
      local shapes = {}
      for _, np in ipairs(sharded:named_parameters()) do shapes[np[1]] = np[2]:shape() end
      assert.are.same(w.w0, shapes["layers.0.weight"], "rank " .. rank)
      assert.are.same(w.head, shapes["head.weight"])
      local g, off = sharded.shard_of("head.weight")
      assert.are.same({ { 12, 5 }, w.offh }, { g, off })
      if w.off0 then assert.are.same({ { 5, 4 }, w.off0 }, { sharded.shard_of("layers.0.weight") }) end
      -- padded to 2 + 3 rows on every rank, so one all-gather serves all
      assert.are.equal((2 * 4 + 3 * 5) * 4, sharded:sharded_bytes())
      sharded:free(); net:free()
    end
  end)
end)
