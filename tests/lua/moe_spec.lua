-- Mixture of experts (lua/models/moe.lua, the debugmodel_moe flavor of lua/models/llama3.lua): the
-- layer against a dense reference that runs every expert on every token (top 1 and top 2, sigmoid and
-- softmax, renormalized weights, a shared expert, an expert bias that steers the choice and not the
-- weights), its gradients by finite differences, the aux-loss-free balance step, what is counted
-- (training forwards, not evaluation nor a checkpointed block's recomputation), the flavor's FLOPs,
-- training, a checkpoint resumed bit for bit (the expert biases with it) and the bad layouts.
local titan = require("titan")
local moe = require("models.moe")
local gradcheck = require("titan.gradcheck")
local sh = dofile("tests/lua/shell.lua")

local function layer(m, seed)
  local l = moe.MoE(12, 20, m, { dtype = "float64" })
  for i, np in ipairs(l:named_parameters()) do
    np[2]:copy_(titan.randn(np[2]:shape(), { seed = seed * 100 + i }):to("float64") * 0.3)
  end
  return l
end

-- every expert on every token, mixed by the routing the definition gives (computed here in Lua)
local function dense(l, x)
  local m, E = l.m, l.m.num_experts
  local x2 = x:reshape(-1, 12)
  local N = x2:size(1)
  local logits = l.router(x2)
  local s = (m.score_func == "softmax" and logits:softmax() or logits:sigmoid()):tolist_flat()
  local bias = l.expert_bias:tolist_flat()
  local y = l.shared_expert and l.shared_expert(x2):tolist_flat() or {}
  for i = 1, N * 12 do y[i] = y[i] or 0 end
  local outs = {}
  for e = 0, E - 1 do outs[e] = l.experts[tostring(e)](x2):tolist_flat() end
  for t = 0, N - 1 do
    local taken, best, tot = {}, {}, 0
    for j = 1, m.top_k do
      local b
      for e = 0, E - 1 do
        local v = s[t * E + e + 1] + bias[e + 1]
        if not taken[e] and (b == nil or v > s[t * E + b + 1] + bias[b + 1]) then b = e end
      end
      taken[b], best[j] = true, b
      tot = tot + s[t * E + b + 1]
    end
    for _, e in ipairs(best) do
      local w = s[t * E + e + 1] * m.route_scale
      if m.route_norm then w = w / (tot + 1e-20) end
      for d = 1, 12 do y[t * 12 + d] = y[t * 12 + d] + w * outs[e][t * 12 + d] end
    end
  end
  return y
end

local function max_diff(a, b)
  local m = 0
  for i = 1, #b do m = math.max(m, math.abs(a[i] - b[i])) end
  return m
end

describe("mixture of experts layer", function()
  local configs = {
    { num_experts = 4, top_k = 1, score_func = "sigmoid", num_shared_experts = 1 },
    { num_experts = 5, top_k = 2, score_func = "softmax", route_norm = true, num_shared_experts = 0 },
    { num_experts = 4, top_k = 3, score_func = "sigmoid", route_scale = 2.5, num_shared_experts = 2 },
  }
  it("equals every expert run on every token and mixed by the routing (top 1, 2, 3; shared experts)", function()
    for i, m in ipairs(configs) do
      local l = layer(m, i)
      local x = titan.randn({ 2, 7, 12 }, { seed = 40 + i }):to("float64")
      assert(max_diff(l(x):tolist_flat(), dense(l, x)) < 1e-12, "config " .. i)
      -- a bias steers the choice, not the weights
      l.expert_bias:copy_(titan.tensor({ 0.3, -0.2, 0.05, 0.1, 0.0 }):narrow(1, 1, m.num_experts))
      assert(max_diff(l(x):tolist_flat(), dense(l, x)) < 1e-12, "config " .. i .. " with a bias")
    end
  end)

  it("gradients by finite differences: input, router and experts (f64)", function()
    for i, m in ipairs(configs) do
      local l = layer(m, i)
      local x = titan.randn({ 1, 5, 12 }, { seed = 50 + i }):to("float64"):requires_grad_()
      local ok, report = gradcheck(function(a) return l(a) end, { x })
      assert(ok, report)
      local w = l.router.weight
      ok, report = gradcheck(function(r) l.router.weight = r; return l(x:detach()) end, { w:detach():requires_grad_() })
      l.router.weight = w
      assert(ok, "router: " .. tostring(report))
    end
  end)

  it("counts training forwards only, and the balance step moves the biases by the counts' signs", function()
    local l = layer({ num_experts = 4, top_k = 1, load_balance_coeff = 0.01 }, 7)
    local x = titan.randn({ 3, 10, 12 }, { seed = 3 }):to("float64")
    l:eval()
    l(x)
    assert.are.same({ 0, 0, 0, 0 }, l.counts)
    l:train()
    l(x)
    local c = { unpack(l.counts) }
    assert.are.equal(30, c[1] + c[2] + c[3] + c[4])
    l:update_bias()
    assert.are.same({ 0, 0, 0, 0 }, l.counts)
    local d, dm = {}, 0
    for e = 1, 4 do
      local s = 7.5 - c[e]
      d[e] = 0.01 * (s > 0 and 1 or s < 0 and -1 or 0)
      dm = dm + d[e] / 4
    end
    local b = l.expert_bias:tolist_flat()
    for e = 1, 4 do assert(math.abs(b[e] - (d[e] - dm)) < 1e-7, ("bias %d: %g vs %g"):format(e, b[e], d[e] - dm)) end
    -- a checkpointed forward counts once (its recomputation in the backward does not)
    l(x)
    local once = { unpack(l.counts) }
    for e = 1, 4 do l.counts[e] = 0 end
    local xr = x:clone():requires_grad_()
    titan.autograd.checkpoint(function(a) return l(a) end, xr):sum():backward()
    assert.are.same(once, l.counts)
  end)
end)

describe("llama3 debugmodel_moe", function()
  local exe = "./build/titan"
  local function train(dump, extra)
    return sh.run_ok(exe .. " lua/recipes/llama3_debugmodel.lua --model.flavor=debugmodel_moe --job.dump_folder="
      .. dump .. " --training.seq_len=64 --training.local_batch_size=2 --metrics.log_freq=1"
      .. " --lr_scheduler.warmup_steps=2 --training.shuffle=false " .. (extra or ""))
  end
  local losses = sh.losses

  it("counts the active experts' FLOPs (top 1 of 8: the routed experts at 1/8)", function()
    local llama3 = require("models.llama3")
    local m = llama3.build("debugmodel_moe", { device = "meta" })
    local flops, n, n_emb = llama3.flops_per_token(m, 64)
    local a = m.args
    local expert = 3 * a.dim * a.ffn_hidden
    local inactive = a.n_layers * 8 * expert * 7 / 8
    assert.are.equal(6 * (n - n_emb - inactive) + 12 * a.n_layers * a.dim * 64, flops)
  end)

  it("trains, and a checkpoint resumes bit for bit with the experts' biases (full AC)", function()
    local straight, first, second = sh.tmpdir(), sh.tmpdir(), nil
    local ac = "--activation_checkpoint.mode=full "
    local out = train(straight, ac .. "--training.steps=4")
    local a = losses(out)
    assert.are.equal(4, #a)
    -- the busiest expert's load over the mean, on the log line and in metrics.jsonl
    assert.truthy(out:find("  moe load: [%d.]+\n"), out)
    local f = assert(io.open(straight .. "/metrics.jsonl"))
    assert.truthy(f:read("*a"):find('"moe_max_load":', 1, true))
    f:close()
    assert.is_true(tonumber(a[4]) < tonumber(a[1]))
    train(first, ac .. "--training.steps=2 --checkpoint.enable=true --checkpoint.interval=2")
    second = losses(train(first, ac .. "--training.steps=4 --checkpoint.enable=true --checkpoint.interval=2"))
    assert.are.same({ a[3], a[4] }, second)
  end)

  it("has no Hugging Face Llama names: export and import refuse it in one line", function()
    local a = require("models.llama3").args("debugmodel_moe")
    local ok, err = pcall(require("titan.checkpoint.hf").name_map, a)
    assert.is_false(ok)
    assert.are.equal("hf: the flavor has mixture-of-experts layers, which have no Hugging Face Llama names; expected "
      .. "a dense flavor", err)
  end)

  it("refuses CUDA graphs in one line (its dispatch reads the routing on the host)", function()
    sh.one_line(exe .. " lua/recipes/llama3_debugmodel.lua --model.flavor=debugmodel_moe --training.steps=1 "
      .. "--training.cuda_graphs=true", "training.cuda_graphs: not with a mixture-of-experts flavor")
  end)

  -- (the losses against one process: tests/lua/mpi_spec.lua)
  it("under tensor parallelism stays whole on every rank, its weights partial sums under sequence parallelism",
    function()
    local llama, tp = require("models.llama3"), require("parallel.tp")
    local dist = require("titan.dist")
    for _, sp in ipairs({ true, false }) do
      local model = llama.build("debugmodel_moe", { device = "cpu", overrides = { n_layers = 2 } })
      local plan = tp.apply(model, dist.new_group({ backend = "fake", rank = 1, world = 2 }), llama.tp_plan,
        { sequence_parallel = sp })
      local block = model.layers["0"]
      assert.are.same({ 128, 256 }, block.attention.wq.weight:shape()) -- split: 8 of the 16 heads
      local moe_params = block.moe:named_parameters()
      for _, np in ipairs(moe_params) do
        assert.is_nil(plan.sharded[np[2]], np[1])
        assert.are.equal(sp or nil, plan.partial and plan.partial[np[2]], np[1])
      end
      assert.are.same({ 768, 256 }, block.moe.experts["3"].w1.weight:shape()) -- whole
      model:free()
    end
  end)
end)
