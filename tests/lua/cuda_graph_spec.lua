-- CUDA graphs on a machine without a GPU: capture is refused on the CPU with
-- a clear reason, training.cuda_graphs on the CPU says so and trains as
-- before, and — through the emulated graph (cuda_graph.emulate), which
-- replays the captured function instead of recorded kernels — the trainer's
-- graph step gives bit-identical losses and parameters to the eager step,
-- with gradient accumulation, a changing batch shape and a recipe's own
-- train_step. The real capture is checked by tests/cuda/graph_spec.lua.
local titan = require("titan")
local config = require("titan.config")
local trainer = require("titan.trainer")
local cuda_graph = require("titan.cuda_graph")

local function cfg_of(overrides)
  local recipe = config.load_recipe("llama3_debugmodel")
  local argv = { "--job.dump_folder=" .. os.tmpname() .. ".d", "--metrics.enable_jsonl=false",
    "--metrics.peak_flops=1e11", "--metrics.log_freq=1000", "--validation.enable=false",
    "--training.seq_len=32", "--training.local_batch_size=2", "--lr_scheduler.warmup_steps=2" }
  for _, a in ipairs(overrides or {}) do argv[#argv + 1] = a end
  return recipe, argv
end

-- Trains `steps` steps; returns the losses, the log lines and the final weights.
-- setup(tr), if given, runs before training.
local function run(recipe, argv, steps, setup)
  local cfg = config.resolve(recipe, argv)
  local lines = {}
  local tr = trainer.new(cfg, { print = function(l) lines[#lines + 1] = l end })
  if setup then setup(tr) end
  local ok, losses = pcall(tr.train, tr, steps)
  local weights = {}
  if ok then
    for _, np in ipairs(tr.model:named_parameters()) do weights[np[1]] = np[2]:tolist_flat() end
  end
  tr:close()
  tr.model:free()
  assert(ok, losses)
  return losses, lines, weights
end

local function log_has(lines, pattern)
  for _, l in ipairs(lines) do
    if l:find(pattern) then return l end
  end
  return nil
end

local function same_weights(a, b)
  for name, v in pairs(a) do
    local w = b[name]
    assert(w and #w == #v, name)
    for i = 1, #v do
      if v[i] ~= w[i] then error(("%s[%d]: %.17g vs %.17g"):format(name, i, v[i], w[i]), 2) end
    end
  end
end

describe("cuda graphs without a GPU", function()
  after_each(function() cuda_graph.emulate = false end)

  it("capture on the cpu is refused with the reason", function()
    local g, why = cuda_graph.capture("cpu", function() return titan.ones(2) end)
    assert.is_nil(g)
    assert.truthy(why:find("need a cuda device, not cpu", 1, true), why)
  end)

  it("training.cuda_graphs on the cpu says so and trains exactly as before", function()
    local r, a = cfg_of()
    local eager = run(r, a, 3)
    local r2, a2 = cfg_of({ "--training.cuda_graphs=true" })
    local losses, lines = run(r2, a2, 3)
    assert.truthy(log_has(lines, "cuda graphs: they need a cuda device %(training.device = cpu%)"), table.concat(lines, "\n"))
    assert.are.same(eager, losses)
  end)

  it("the graph step (emulated) matches the eager step bit for bit, with accumulation", function()
    local base = { "--training.global_batch_tokens=128" } -- 2 micro-batches of 2 x 32
    local r, a = cfg_of(base)
    local eager, _, w_eager = run(r, a, 5)
    cuda_graph.emulate = true
    local r2, a2 = cfg_of({ "--training.global_batch_tokens=128", "--training.cuda_graphs=true" })
    local graphed, lines, w_graphed = run(r2, a2, 5)
    local l = log_has(lines, "captured forward %+ backward of one micro%-batch")
    assert.truthy(l, table.concat(lines, "\n"))
    assert.truthy(l:find("2x32 int64 | 2x32 int64 | 128", 1, true), l)
    assert.truthy(log_has(lines, "captured the update of %d+ gradients"), table.concat(lines, "\n"))
    assert.are.same(eager, graphed)
    same_weights(w_eager, w_graphed)
  end)

  -- The update graph reads the step's scalars from device memory: with
  -- clipping that bites at every step and a warm-up that changes the
  -- learning rate at every step, the losses, logged gradient norms and
  -- weights still match the eager step. (bf16 parameters, which the CPU
  -- cannot train, are checked op by op in optim_dev_spec.lua and on a GPU
  -- by tests/cuda/graph_spec.lua.)
  for _, dtype in ipairs({ "float32" }) do
    it("the update graph (emulated) clips and steps as the eager update, " .. dtype .. " params", function()
      local opts = { "--training.max_norm=0.05", "--lr_scheduler.warmup_steps=4", "--metrics.log_freq=1",
        "--training.mixed_precision_param=" .. dtype }
      local r, a = cfg_of(opts)
      local eager, lines_e, w_eager = run(r, a, 6)
      cuda_graph.emulate = true
      local r2, a2 = cfg_of(opts)
      a2[#a2 + 1] = "--training.cuda_graphs=true"
      local graphed, lines, w_graphed = run(r2, a2, 6)
      assert.truthy(log_has(lines, "captured the update of %d+ gradients"), table.concat(lines, "\n"))
      assert.are.same(eager, graphed)
      same_weights(w_eager, w_graphed)
      local function norms(ls)
        local out = {}
        for _, l in ipairs(ls) do
          local v = l:match("grad_norm:%s+([%d%.e+-]+)")
          if v then out[#out + 1] = v end
        end
        return out
      end
      local ne = norms(lines_e)
      assert.are.equal(6, #ne, table.concat(lines_e, "\n"))
      assert.are.same(ne, norms(lines))
      assert.is_true(tonumber(ne[6]) > 0.05) -- clipping was active
    end)
  end

  -- What a GPU's eager step does (no graph): the update through the device
  -- path, with no host wait for the clip coefficient. Forced on the CPU,
  -- whose backend has the same ops, it matches the host path bit for bit.
  it("the eager update through the device path matches the host path, clipping active", function()
    local opts = { "--training.max_norm=0.05", "--lr_scheduler.warmup_steps=4", "--metrics.log_freq=1",
      "--training.global_batch_tokens=128" }
    local r, a = cfg_of(opts)
    local host, lines_h, w_host = run(r, a, 5, function(tr) tr.device_update = false end)
    local r2, a2 = cfg_of(opts)
    local used = 0
    local dev, lines_d, w_dev = run(r2, a2, 5, function(tr)
      tr.device_update = true
      local inner = tr.update_on_device
      tr.update_on_device = function(self, params)
        local norm = inner(self, params)
        if norm then used = used + 1 end
        return norm
      end
    end)
    assert.are.equal(5, used)
    assert.are.same(host, dev)
    same_weights(w_host, w_dev)
    local function norms(ls)
      local out = {}
      for _, l in ipairs(ls) do out[#out + 1] = l:match("grad_norm:%s+([%d%.e+-]+)") end
      return out
    end
    assert.are.same(norms(lines_h), norms(lines_d))
    -- float64 parameters: the host path, said once
    local r3, a3 = cfg_of({ "--training.mixed_precision_param=float64" })
    local _, lines3 = run(r3, a3, 2, function(tr) tr.device_update = true end)
    local said = 0
    for _, l in ipairs(lines3) do
      if l:find("the optimizer step stays on the host: float64", 1, true) then said = said + 1 end
    end
    assert.are.equal(1, said, table.concat(lines3, "\n"))
  end)

  it("float64 parameters keep the eager update, said once, and still train the same", function()
    local opts = { "--training.mixed_precision_param=float64" }
    local r, a = cfg_of(opts)
    local eager = run(r, a, 3)
    cuda_graph.emulate = true
    local r2, a2 = cfg_of(opts)
    a2[#a2 + 1] = "--training.cuda_graphs=true"
    local graphed, lines = run(r2, a2, 3)
    assert.truthy(log_has(lines, "the update %(clip, optimizer step, zero_grad%) stays eager: float64"),
      table.concat(lines, "\n"))
    assert.are.same(eager, graphed)
  end)

  it("a batch of another shape runs eagerly (said once) and the run still matches", function()
    -- The data source hands out 2 x 32 batches, then a short 1 x 32 one.
    local function recipe_with_short_batch()
      local r, a = cfg_of()
      r.build_data = function(cfg, tok)
        local d = require("titan.data").build(cfg, tok, { rank = 0, world = 1 })
        local n, inner = 0, d.train
        d.train = setmetatable({ next = function(self)
          n = n + 1
          local b = inner:next()
          if n == 4 then
            local i, t = b.inputs:narrow(1, 1, 1):clone(), b.targets:narrow(1, 1, 1):clone()
            b.inputs:free(); b.targets:free()
            b = { inputs = i, targets = t }
          end
          return b
        end }, { __index = inner })
        return d
      end
      return r, a
    end
    local r, a = recipe_with_short_batch()
    local eager = run(r, a, 5)
    cuda_graph.emulate = true
    local r2, a2 = recipe_with_short_batch()
    a2[#a2 + 1] = "--training.cuda_graphs=true"
    local graphed, lines = run(r2, a2, 5)
    local l = log_has(lines, "differ from the captured ones")
    assert.truthy(l and l:find("step 4's batches %(1x32"), table.concat(lines, "\n"))
    assert.are.same(eager, graphed)
  end)

  it("the graph step (emulated) across a checkpoint restart matches 12 straight eager steps", function()
    local dump = os.tmpname()
    os.remove(dump)
    os.execute("mkdir -p " .. dump)
    local ck = { "--checkpoint.enable=true", "--checkpoint.interval=6", "--training.steps=12",
      "--training.global_batch_tokens=128" }
    local r, a = cfg_of({ "--training.steps=12", "--training.global_batch_tokens=128" })
    local straight = run(r, a, 12)
    cuda_graph.emulate = true
    local function graphed(until_step)
      local r2, a2 = cfg_of(ck)
      a2[#a2 + 1] = "--training.cuda_graphs=true"
      a2[#a2 + 1] = "--job.dump_folder=" .. dump
      return run(r2, a2, until_step)
    end
    local first = graphed(6)
    local second, lines = graphed(12) -- resumes at 6, warms up and captures again
    assert.are.equal(6, #first)
    assert.are.equal(6, #second) -- steps 7..12 only: it resumed
    assert.truthy(log_has(lines, "captured forward %+ backward"), table.concat(lines, "\n"))
    for i = 1, 6 do assert.are.equal(straight[i], first[i], "step " .. i) end
    for i = 1, 6 do assert.are.equal(straight[6 + i], second[i], "step " .. (6 + i)) end
  end)

  it("a recipe's own train_step is never captured", function()
    cuda_graph.emulate = true
    local r, a = cfg_of({ "--training.cuda_graphs=true" })
    r.train_step = trainer.train_step
    local _, lines = run(r, a, 2)
    assert.truthy(log_has(lines, "the recipe replaces train_step, which is never captured"), table.concat(lines, "\n"))
    assert.is_nil(log_has(lines, "captured forward"))
  end)

  it("the emulated graph keeps its outputs and refreshes them at each replay", function()
    cuda_graph.emulate = true
    local x = titan.keep(titan.ones(3))
    local g = cuda_graph.capture("cpu", function() return { y = x * 2 } end)
    assert.is_nil(g.outputs) -- nothing runs at capture
    g:replay()
    local y = g.outputs.y
    assert.are.same({ 2, 2, 2 }, y:tolist())
    x:fill_(5)
    g:replay()
    assert.are.equal(y, g.outputs.y) -- the same tensor, new values
    assert.are.same({ 10, 10, 10 }, y:tolist())
    g:free()
    x:free()
  end)
end)
