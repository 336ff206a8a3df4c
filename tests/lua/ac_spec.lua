-- Activation checkpointing: autograd.checkpoint against the plain tape
-- (same gradients, bit for bit), what it keeps and frees, the config's modes
-- (lua/parallel/ac.lua), and the Llama 3 model and trainer with it on.
local titan = require("titan")
local autograd = require("titan.autograd")
local ac = require("parallel.ac")
local config = require("titan.config")
local trainer = require("titan.trainer")
local llama = require("models.llama3")

local function flat(t) return t:tolist_flat() end

-- x -> silu(x @ w1^T) * (x @ w3^T) -> @ w2^T, with a scalar from an extra
-- argument: enough ops that recording and recomputing both matter.
local function mlp(x, w1, w2, w3, opts)
  local a = titan.F.linear(x, w1)
  local b = titan.F.linear(x, w3)
  return titan.F.linear(titan.F.swiglu(a, b), w2) * opts.scale
end

local function weights(seed)
  titan.manual_seed(seed)
  local w = {}
  for i, shape in ipairs({ { 32, 16 }, { 16, 32 }, { 32, 16 } }) do
    w[i] = titan.keep(titan.randn(shape, { std = 0.3 })):requires_grad_()
  end
  return w
end

local function free_all(ts) for _, t in ipairs(ts) do t:free() end end

describe("autograd.checkpoint", function()
  it("gives the plain tape's gradients bit for bit, for the input and the parameters inside", function()
    local results = {}
    for run, use_ckpt in ipairs({ false, true }) do
      local w = weights(1)
      local x = titan.keep(titan.randn({ 4, 5, 16 }, { std = 1 })):requires_grad_()
      titan.scope(function()
        local h = x * 2 -- an intermediate (not a leaf) feeds the checkpoint
        local y
        if use_ckpt then y = autograd.checkpoint(mlp, h, w[1], w[2], w[3], { scale = 0.5 })
        else y = mlp(h, w[1], w[2], w[3], { scale = 0.5 }) end
        y:square():sum():backward()
      end)
      results[run] = { flat(x.grad), flat(w[1].grad), flat(w[2].grad), flat(w[3].grad) }
      free_all({ x, w[1], w[2], w[3] })
    end
    assert.are.same(results[1], results[2])
  end)

  it("runs fn once in the forward and once more in the backward, and keeps only its tensor arguments", function()
    local w = weights(2)
    local calls = 0
    local function f(x, ww)
      calls = calls + 1
      return mlp(x, ww[1], ww[2], ww[3], { scale = 1 })
    end
    local x = titan.keep(titan.randn({ 64, 16 })):requires_grad_()
    titan.scope(function()
      local y = autograd.checkpoint(f, x, w)
      assert.are.equal(1, calls)
      assert.are.equal("checkpoint", y._node.name)
      -- saved: x alone (w is a plain table here, passed again as it is)
      assert.are.equal(1, #y._node.saved)
      y:sum():backward()
      assert.are.equal(2, calls)
    end)
    assert.truthy(x.grad and w[1].grad and w[2].grad and w[3].grad)
    free_all({ x, w[1], w[2], w[3] })
  end)

  it("an argument that needs no gradient gets none; without recording it is a plain call", function()
    local w = weights(3)
    local x = titan.keep(titan.randn({ 8, 16 })) -- no requires_grad
    titan.scope(function()
      local y = autograd.checkpoint(mlp, x, w[1], w[2], w[3], { scale = 1 })
      y:sum():backward()
    end)
    assert.is_nil(x.grad)
    assert.truthy(w[2].grad)
    titan.scope(function()
      local y = titan.no_grad(autograd.checkpoint, mlp, x, w[1], w[2], w[3], { scale = 1 })
      assert.is_nil(y._node)
      assert.is_not_true(y.requires_grad)
    end)
    free_all({ x, w[1], w[2], w[3] })
  end)

  it("with retain_graph, a second backward recomputes again and accumulates the same gradients", function()
    local w = weights(4)
    local x = titan.keep(titan.randn({ 8, 16 })):requires_grad_()
    local once
    titan.scope(function()
      local loss = autograd.checkpoint(mlp, x, w[1], w[2], w[3], { scale = 1 }):sum()
      loss:backward(nil, { retain_graph = true })
      once = flat(x.grad)
      loss:backward()
    end)
    local twice = flat(x.grad)
    for i = 1, #once do assert.are.equal(2 * once[i], twice[i]) end
    free_all({ x, w[1], w[2], w[3] })
  end)

  it("holds less memory after the forward, and leaves no tensor behind after the backward", function()
    local w = weights(5)
    local x = titan.keep(titan.randn({ 256, 16 })):requires_grad_()
    local live0 = titan.live_tensors()
    local held = {}
    for run, use_ckpt in ipairs({ false, true }) do
      titan.scope(function()
        local base = titan.memory_stats("cpu").allocated
        local h = x
        for _ = 1, 4 do
          local prev = h
          if use_ckpt then h = autograd.checkpoint(mlp, h, w[1], w[2], w[3], { scale = 1 })
          else h = titan.scope(mlp, h, w[1], w[2], w[3], { scale = 1 }) end
          if prev ~= x then prev:free() end
        end
        held[run] = titan.memory_stats("cpu").allocated - base
        h:sum():backward()
      end)
      for _, t in ipairs({ x, w[1], w[2], w[3] }) do t.grad:free(); t.grad = nil end
      assert.are.equal(live0, titan.live_tensors())
    end
    -- Plain: per link the two [256, 32] projections, SwiGLU's output and the
    -- input (saved); checkpointed: the input alone.
    assert.truthy(held[2] * 3 < held[1], ("checkpointed %d bytes vs plain %d"):format(held[2], held[1]))
    free_all({ x, w[1], w[2], w[3] })
  end)

  it("must return one tensor; an error inside the recomputation propagates and releases its tensors", function()
    local x = titan.keep(titan.randn({ 4, 4 })):requires_grad_()
    local ok, err = pcall(autograd.checkpoint, function() return 3 end, x)
    assert.is_false(ok)
    assert.matches("autograd.checkpoint: the function must return one tensor, got number", err, 1, true)
    local live0 = titan.live_tensors()
    local calls = 0
    titan.scope(function()
      local y = autograd.checkpoint(function(t)
        calls = calls + 1
        local s = t * 3
        if calls == 2 then error("boom in the recomputation", 0) end
        return s:exp()
      end, x)
      local ok2, err2 = pcall(function() y:sum():backward() end)
      assert.is_false(ok2)
      assert.matches("boom in the recomputation", err2, 1, true)
    end)
    assert.are.equal(live0, titan.live_tensors())
    x:free()
  end)
end)

describe("autograd.checkpoint_ops (per-op policy)", function()
  -- a = x @ w1^T is the op a policy may keep; w1 changes between the forward
  -- and the backward, so a recomputed `a` differs from the forward's.
  local function two_linears(x, w1, w2) return titan.F.linear(titan.F.linear(x, w1):silu(), w2) end
  local function w2_grad(how)
    local w = weights(6)
    local x = titan.keep(titan.randn({ 8, 16 }))
    local calls = {}
    local policy = function(kind, count)
      calls[#calls + 1] = kind .. count
      return kind == "linear" and count == 1
    end
    titan.scope(function()
      local y
      if how == "plain" then y = two_linears(x, w[1], w[2])
      elseif how == "checkpoint" then y = autograd.checkpoint(two_linears, x, w[1], w[2])
      else y = autograd.checkpoint_ops(policy, two_linears, x, w[1], w[2]) end
      titan.no_grad(function() w[1]:add_(titan.ones(w[1]:shape())) end)
      y:sum():backward()
    end)
    local g = flat(w[2].grad)
    free_all({ x, w[1], w[2], w[3] })
    return g, calls
  end

  it("takes a kept output back in the recomputation instead of computing it again", function()
    local plain = w2_grad("plain")
    local kept, calls = w2_grad("ops")
    local recomputed = w2_grad("checkpoint")
    assert.are.same(plain, kept)          -- dW2 from the forward's silu(a): the kept a
    assert.are_not.same(plain, recomputed) -- a computed again from the changed w1
    -- the policy is asked the same questions in the forward and in the recomputation
    assert.are.same({ "linear1", "linear2", "linear1", "linear2" }, calls)
  end)

  it("refuses a recomputation that takes another path than the forward", function()
    local x = titan.keep(titan.randn({ 4, 16 })):requires_grad_()
    local w = weights(7)
    local runs = 0
    local function fn(t)
      runs = runs + 1
      if runs == 1 then return titan.F.linear(t, w[1]) end
      return t * 2
    end
    titan.scope(function()
      local y = autograd.checkpoint_ops(function() return true end, fn, x)
      local ok, err = pcall(function() y:sum():backward() end)
      assert.is_false(ok)
      assert.matches("the recomputation", err, 1, true)
    end)
    free_all({ x, w[1], w[2], w[3] })
  end)
end)

describe("activation_checkpoint config", function()
  it("modes map to a plan; bad values get one line naming the key", function()
    assert.are.same({ every = 0 }, ac.plan({ mode = "none", selective_ac_option = "2" }))
    assert.are.same({ every = 1 }, ac.plan({ mode = "full", selective_ac_option = "2" }))
    assert.are.same({ every = 3 }, ac.plan({ mode = "selective", selective_ac_option = "3" }))
    assert.are.same({ every = 1, policy = ac.op_policy }, ac.plan({ mode = "selective", selective_ac_option = "op" }))
    -- TorchTitan's op policy: attention, and the 1st, 3rd, ... linear of a block
    assert.are.same({ true, false, true, false, true, false, true, true },
      { ac.op_policy("linear", 1), ac.op_policy("linear", 2), ac.op_policy("linear", 3), ac.op_policy("linear", 4),
        ac.op_policy("linear", 5), ac.op_policy("linear", 6), ac.op_policy("linear", 7), ac.op_policy("attention", 1) })
    local recipe = config.load_recipe("llama3_debugmodel")
    local cases = {
      { "--activation_checkpoint.mode=some", "activation_checkpoint.mode must be none, full or selective, got 'some'" },
      { "--activation_checkpoint.selective_ac_option=ops", "must be op or a positive integer N (every Nth block), got "
        .. "'ops'" },
      { "--activation_checkpoint.selective_ac_option=0",
        "must be op or a positive integer N (every Nth block), got '0'" },
      { "--activation_checkpoint.selective_ac_option=1.5", "got '1.5'" },
    }
    for _, c in ipairs(cases) do
      local argv = { "--activation_checkpoint.mode=selective", c[1] }
      local ok, err = pcall(config.resolve, recipe, argv)
      assert.is_false(ok, c[1])
      assert.matches("^config: ", err)
      assert.matches(c[2], err, 1, true)
      assert.is_nil(err:find("\n"), "one line: " .. err)
    end
    -- the option is read only in selective mode
    assert.truthy(config.resolve(recipe, { "--activation_checkpoint.mode=full",
      "--activation_checkpoint.selective_ac_option=x" }))
  end)

  it("wraps blocks N, 2N, ... counted from 1, as TorchTitan does", function()
    local model = llama.build("debugmodel", { device = "meta" })
    local n, total = ac.apply(model, { mode = "selective", selective_ac_option = "2" })
    assert.are.same({ 3, 6 }, { n, total })
    local marked = {}
    for i = 0, 5 do marked[#marked + 1] = rawget(model.layers[tostring(i)], "checkpointed") or false end
    assert.are.same({ false, true, false, true, false, true }, marked)
    assert.are.same({ 6, 6 }, { ac.apply(llama.build("debugmodel", { device = "meta" }), { mode = "full" }) })
    assert.are.same({ 0, 6 }, { ac.apply(llama.build("debugmodel", { device = "meta" }), { mode = "none" }) })
    local ok, err = pcall(ac.apply, titan.nn.Linear(2, 2, { device = "meta" }), { mode = "full" })
    assert.is_false(ok)
    assert.matches("the model has no `layers`", err, 1, true)
  end)
end)

describe("Llama 3 with activation checkpointing", function()
  local args = { dim = 64, n_layers = 4, n_heads = 4, n_kv_heads = 2, multiple_of = 32, vocab_size = 256,
    max_seq_len = 64 }

  local function grads_and_memory(mode, option)
    local model = llama.build(args, { device = "meta" })
    ac.apply(model, { mode = mode, selective_ac_option = option or "2" })
    model:to_empty("cpu")
    llama.init_weights(model, 7)
    local rows, r = {}, 11
    for b = 1, 2 do
      rows[b] = {}
      for t = 1, 48 do
        r = (r * 1103515245 + 12345) % 2147483648
        rows[b][t] = r % 256
      end
    end
    local ids = titan.tensor(rows, { dtype = "int64" })
    local held
    titan.scope(function()
      local base = titan.memory_stats("cpu").allocated
      local logits = model(ids)
      held = titan.memory_stats("cpu").allocated - base
      titan.F.cross_entropy(logits:reshape(-1, 256), ids:reshape(-1)):backward()
    end)
    local out = {}
    for _, np in ipairs(model:named_parameters()) do out[np[1]] = flat(np[2].grad) end
    ids:free()
    model:free()
    return out, held
  end

  it("gives the same gradients bit for bit in every mode, holding less after the forward", function()
    local g_none, m_none = grads_and_memory("none")
    local g_sel, m_sel = grads_and_memory("selective", "2")
    local g_full, m_full = grads_and_memory("full")
    local g_sel3 = grads_and_memory("selective", "3") -- a checkpointed block after a plain one, and the reverse
    local g_op, m_op = grads_and_memory("selective", "op")
    assert.are.same(g_none, g_sel)
    assert.are.same(g_none, g_full)
    assert.are.same(g_none, g_sel3)
    assert.are.same(g_none, g_op)
    assert.truthy(m_full < m_sel and m_sel < m_none, ("held after forward: full %d, selective %d, none %d")
      :format(m_full, m_sel, m_none))
    assert.truthy(m_full < m_op and m_op < m_none, ("held after forward: full %d, op %d, none %d")
      :format(m_full, m_op, m_none))
  end)

  it("trains with the plain run's losses, and the banner says how many blocks recompute", function()
    local function run(mode, option)
      local recipe = config.load_recipe("llama3_debugmodel")
      local cfg = config.resolve(recipe, { "--job.dump_folder=" .. os.tmpname() .. ".d", "--metrics.enable_jsonl=false",
        "--metrics.peak_flops=1e11", "--training.seq_len=64", "--training.local_batch_size=2",
        "--activation_checkpoint.mode=" .. mode, "--activation_checkpoint.selective_ac_option=" .. (option or "2") })
      local lines = {}
      local tr = trainer.new(cfg, { print = function(l) lines[#lines + 1] = l end })
      tr:banner()
      local ok, losses = pcall(tr.train, tr, 3)
      tr:close()
      tr.model:free()
      assert(ok, losses)
      return losses, table.concat(lines, "\n")
    end
    local plain, plain_log = run("none")
    local full, full_log = run("full")
    local op, op_log = run("selective", "op")
    assert.are.same(plain, full)
    assert.are.same(plain, op)
    assert.matches("activation checkpointing: full, 6 of 6 blocks recompute their activations", full_log, 1, true)
    assert.matches("activation checkpointing: selective, 6 of 6 blocks recompute their activations in the backward "
      .. "(per op: attention and every other linear kept)", op_log, 1, true)
    assert.is_nil(plain_log:find("activation checkpointing", 1, true))
  end)
end)
