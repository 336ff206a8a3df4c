-- Tensor parallelism (lua/parallel/tp.lua) in one process through the fake
-- backend: at world 2 each rank keeps its rows (colwise) and columns
-- (rowwise) of the full initialization, with the checkpoint boxes to say
-- where; at world 1 the wrapped model gives the plain gradients bit for
-- bit; sizes that do not split are one line. Across real processes
-- (losses, checkpoints): mpi_spec.
local titan = require("titan")
local dist = require("titan.dist")
local tp = require("parallel.tp")
local llama = require("models.llama3")

local function flat(t) return t:tolist_flat() end

local ARGS = { dim = 64, n_layers = 2, n_heads = 4, n_kv_heads = 2, multiple_of = 32, vocab_size = 96,
  max_seq_len = 64 }

local function params(model)
  local out = {}
  for _, np in ipairs(model:named_parameters()) do out[np[1]] = np[2] end
  return out
end

describe("tensor parallelism (fake backend)", function()
  it("keeps each rank's rows of wq/wk/wv/w1/w3 and columns of wo/w2; the rest whole", function()
    local whole = params(llama.build(ARGS, { device = "cpu", seed = 2 }))
    local model = llama.build(ARGS, { device = "cpu", seed = 2 })
    local plan = tp.apply(model, dist.new_group({ backend = "fake", rank = 1, world = 2 }), llama.tp_plan)
    local mine = params(model)
    local want = { -- local shape, global offset (rank 1 of 2)
      ["attention.wq.weight"] = { { 32, 64 }, { 32, 0 } }, ["attention.wk.weight"] = { { 16, 64 }, { 16, 0 } },
      ["attention.wv.weight"] = { { 16, 64 }, { 16, 0 } }, ["attention.wo.weight"] = { { 64, 32 }, { 0, 32 } },
      ["feed_forward.w1.weight"] = { { 96, 64 }, { 96, 0 } }, ["feed_forward.w3.weight"] = { { 96, 64 }, { 96, 0 } },
      ["feed_forward.w2.weight"] = { { 64, 96 }, { 0, 96 } },
    }
    local n = 0
    for name, p in pairs(mine) do
      local w = want[name:gsub("^layers%.%d+%.", "")]
      if w then
        n = n + 1
        assert.are.same(w[1], p:shape(), name)
        assert.are.same({ whole[name]:shape(), w[2] }, { plan.shard_of(name) })
        local dim = w[2][1] > 0 and 1 or 2
        assert.are.same(flat(whole[name]:narrow(dim, w[2][dim] + 1, w[1][dim])), flat(p), name)
        assert.is_true(plan.sharded[p])
      else
        assert.are.same(flat(whole[name]), flat(p), name) -- replicated: the same on every rank
        assert.is_nil(plan.shard_of(name))
      end
    end
    assert.are.equal(2 * 7, n)
  end)

  it("initializes a model without memory one weight at a time, to the same slices", function()
    local ref = llama.build(ARGS, { device = "cpu", seed = 2 })
    local bytes = ref:num_parameters() * 4
    tp.apply(ref, dist.new_group({ backend = "fake", rank = 1, world = 2 }), llama.tp_plan)
    local model = llama.build(ARGS, { device = "meta" })
    model:to_empty("cpu", { params_storage = false })
    titan.reset_peak_memory("cpu")
    local base = titan.memory_stats("cpu").allocated
    tp.apply(model, dist.new_group({ backend = "fake", rank = 1, world = 2 }), llama.tp_plan,
      { init = function(names) llama.init_weights(model, 2, names) end })
    local peak = titan.memory_stats("cpu").peak_allocated - base
    -- (what a rank keeps: the whole embeddings, output and norms, half of each block; one whole weight on top)
    assert.truthy(peak < 0.75 * bytes, ("peak %d bytes for a %d-byte model"):format(peak, bytes))
    local want = params(ref)
    for name, p in pairs(params(model)) do assert.are.same(flat(want[name]), flat(p), name) end
    ref:free(); model:free()
  end)

  it("at world 1 gives the plain model's gradients bit for bit, with and without sequence parallelism", function()
    local function grads(wrap, sp)
      local model = llama.build(ARGS, { device = "cpu", seed = 2 })
      if wrap then
        local plan = tp.apply(model, dist.new_group({ backend = "fake", rank = 0, world = 1 }), llama.tp_plan,
          { sequence_parallel = sp })
        -- (the norms' weights: their gradients come from a chunk of the tokens under SP)
        local n = 0
        for _ in pairs(plan.partial or {}) do n = n + 1 end
        assert.are.equal(sp and 2 * ARGS.n_layers + 1 or 0, n)
        assert.are.equal(sp and true or nil, plan.partial and plan.partial[model.norm.weight])
      end
      local ids = titan.tensor({ { 1, 5, 9, 13, 17, 21, 25, 29 }, { 2, 4, 8, 16, 32, 64, 3, 6 } }, { dtype = "int64" })
      titan.scope(function()
        titan.F.cross_entropy(model(ids):reshape(-1, 96), ids:reshape(-1)):backward()
      end)
      local out = {}
      for name, p in pairs(params(model)) do out[name] = flat(p.grad) end
      ids:free(); model:free()
      return out
    end
    local plain = grads(false)
    assert.are.same(plain, grads(true))
    assert.are.same(plain, grads(true, true))
  end)

  it("the vocabulary-parallel loss at world 1 is cross-entropy: values, ignored targets, gradients", function()
    local g1 = dist.new_group({ backend = "fake", rank = 0, world = 1 })
    local vals = {}
    for i = 1, 5 * 7 do vals[i] = math.sin(i * 1.7) * 3 end
    local function run(parallel, reduction)
      local logits = titan.tensor(vals):reshape(5, 7)
      logits.requires_grad = true
      local targets = titan.tensor({ 3, -100, 0, 6, 2 }, { dtype = "int64" })
      local loss, n
      if parallel then
        loss, n = tp.cross_entropy(logits, targets, g1, { reduction = reduction })
      else
        loss, n = titan.F.cross_entropy(logits, targets, { reduction = reduction })
      end
      loss:backward()
      return loss:item(), n, flat(logits.grad)
    end
    for _, r in ipairs({ "mean", "sum" }) do
      local a, na, ga = run(false, r)
      local b, nb, gb = run(true, r)
      assert.are.equal(4, na)
      assert.are.equal(na, nb)
      assert.is_true(math.abs(a - b) <= 1e-6 * math.abs(a), ("%s: %.9g vs %.9g"):format(r, a, b))
      for i = 1, #ga do assert.is_true(math.abs(ga[i] - gb[i]) <= 1e-6, ("%s grad %d"):format(r, i)) end
    end
  end)

  it("sizes that do not split are one line", function()
    local model = llama.build(ARGS, { device = "meta" })
    local ok, e = pcall(tp.check, model, llama.tp_plan, 4)
    assert.is_false(ok)
    assert.truthy(tostring(e):find("tp: n_kv_heads = 2 is not a multiple of parallelism.tp = 4", 1, true), e)
    ok, e = pcall(tp.check, model, nil, 2)
    assert.truthy(tostring(e):find("has no tp_plan", 1, true), e)
  end)
end)
