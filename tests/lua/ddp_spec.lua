-- DDP's backward hooks (lua/parallel/ddp.lua) in one process through the
-- fake backend, whose all-reduce sums N copies of this rank's tensor (N x
-- the local values): at world 1 the gradients are the plain model's bit for
-- bit, at world 2 exactly twice them, so a parameter summed twice (4x) or
-- never (1x) shows. Every block's sums start in its hook on the step's last
-- micro-batch only, also with checkpointed blocks (whose recomputation in
-- the backward hooks again). Across processes on GPUs: multi_gpu_spec.
local titan = require("titan")
local dist = require("titan.dist")
local ddp = require("parallel.ddp")
local ac = require("parallel.ac")
local llama = require("models.llama3")
local nn = require("titan.nn")

local tiny = dofile("tests/lua/tiny_llama.lua")
local ARGS = tiny.ARGS
local function ids_batch() return tiny.ids_batch(7) end

-- Gradients by name after `micro` micro-batches (the hooks armed for the
-- last, as the trainer does), and the DDP state (nil: no hooks).
local function grads(opts)
  local model = llama.build(ARGS, { device = "meta" })
  if opts.ac then ac.apply(model, opts.ac) end
  model:to_empty("cpu")
  llama.init_weights(model, 3)
  local d = opts.world and ddp.attach(model, dist.new_group({ backend = "fake", rank = 0, world = opts.world }))
  local ids = ids_batch()
  local started = {}
  local micro = opts.micro or 1
  for i = 1, micro do
    if d and i == micro then d:arm() end
    titan.scope(function()
      local logits = model(ids)
      titan.F.cross_entropy(logits:reshape(-1, 96), ids:reshape(-1)):backward()
    end)
    started[i] = d and d.stats.in_backward
  end
  local params = {}
  for _, np in ipairs(model:named_parameters()) do params[#params + 1] = np[2] end
  if d then d:finish(params) end
  local out = {}
  for _, np in ipairs(model:named_parameters()) do out[np[1]] = np[2].grad:tolist_flat() end
  ids:free()
  return out, d, started
end

local function scaled(g, k)
  local out = {}
  for i, v in ipairs(g) do out[i] = v * k end
  return out
end

describe("DDP's backward hooks (fake backend)", function()
  for _, mode in ipairs({ "none", "full", "selective 2", "selective op" }) do
    it("every block's sums start in its backward hook; world 1: the plain gradients, world 2: twice them ("
      .. mode .. " activation checkpointing)", function()
      local m, opt = mode:match("^(%S+) ?(%S*)$")
      local ac_mode = m ~= "none" and { mode = m, selective_ac_option = opt } or nil
      local plain = grads({ ac = ac_mode })
      for _, world in ipairs({ 1, 2 }) do
        local got, d = grads({ ac = ac_mode, world = world })
        assert.are.equal(ARGS.n_layers, d.nblocks)
        assert.are.equal(ARGS.n_layers, d.stats.last_in_backward, "blocks reduced during the backward")
        assert.are.equal(0, #d.works, "works left after finish")
        for name, g in pairs(plain) do assert.are.same(scaled(g, world), got[name], name) end
      end
    end)
  end

  it("two micro-batches: the first backward's hooks sum nothing, the last one's every block", function()
    local plain = grads({ micro = 2 })
    local got, d, started = grads({ micro = 2, world = 2 })
    assert.are.same({ 0, ARGS.n_layers }, started)
    assert.are.equal(ARGS.n_layers, d.stats.last_in_backward)
    for name, g in pairs(plain) do assert.are.same(scaled(g, 2), got[name], name) end
  end)

  -- After a backward none of whose hooks summed anything: finish() sums every gradient, once (twice
  -- the values at world 2), and says no block was summed during the backward.
  local function finish_sums_all(model, d)
    local params, before = {}, {}
    for _, np in ipairs(model:named_parameters()) do
      params[#params + 1] = np[2]
      before[np[1]] = np[2].grad:tolist_flat()
    end
    assert.are.equal(0, d:finish(params))
    for _, np in ipairs(model:named_parameters()) do
      assert.are.same(scaled(before[np[1]], 2), np[2].grad:tolist_flat(), np[1])
    end
  end

  it("a backward that was not armed: finish sums every gradient after it, once", function()
    local model = llama.build(ARGS, { device = "meta" })
    model:to_empty("cpu")
    llama.init_weights(model, 3)
    local d = ddp.attach(model, dist.new_group({ backend = "fake", rank = 0, world = 2 }))
    local ids = ids_batch()
    titan.scope(function()
      titan.F.cross_entropy(model(ids):reshape(-1, 96), ids:reshape(-1)):backward()
    end)
    finish_sums_all(model, d)
    ids:free()
  end)

  it("a model without `layers`: no hooks; finish sums every gradient after the backward", function()
    local model = nn.Linear(4, 3)
    local d = ddp.attach(model, dist.new_group({ backend = "fake", rank = 0, world = 2 }))
    assert.are.equal(0, d.nblocks)
    d:arm()
    titan.scope(function() model(titan.ones({ 2, 4 })):sum():backward() end)
    finish_sums_all(model, d)
  end)
end)
