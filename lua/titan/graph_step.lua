-- graph_step.lua — the trainer's default step, replayed from a CUDA graph
-- (training.cuda_graphs = true).
--
-- A small model's step is thousands of short kernels, and launching them
-- one by one from Lua costs more than running them. Here the forward and
-- backward of one micro-batch are captured once into a CUDA graph; every
-- micro-batch after that is a copy of its tokens into the graph's static
-- inputs and one replay, which accumulates into the same .grad buffers as
-- the eager step. The update after it (gradient norm and clipping, AdamW,
-- zeroing the gradients) is a second graph: its kernels read the learning
-- rate, bias corrections and clip coefficient from device memory, which
-- the host rewrites before each replay (AdamW:prepare_device_step), so
-- one capture serves every step and the norm is read back only for the
-- steps that log it. Both give the eager step's bits.
--
--   step 1            eager: cuDNN plans, cuBLASLt algorithms, .grad
--                     buffers and optimizer state are created (none of
--                     that can be captured)
--   step 2            capture both, then replay every micro-batch and
--                     the update
--   later steps       replay
-- A micro-batch whose shapes (or the step's token count, which the loss
-- divides by) differ from the captured ones runs eagerly, as does every
-- step when the capture was impossible — each said once on the log.
-- What the loss function reads from its ctx besides num_tokens (ctx.step)
-- is frozen at the captured step; a recipe's own train_step is never
-- captured.
local titan = require("titan")
local memory = require("titan.memory")
local cuda_graph = require("titan.cuda_graph")
local ops = require("titan.ops")

local M = {}

local function signature(b, num_tokens)
  return ("%s %s | %s %s | %d"):format(table.concat(b.inputs:shape(), "x"), b.inputs:dtype(),
    table.concat(b.targets:shape(), "x"), b.targets:dtype(), num_tokens)
end

local function say_once(gs, key, line)
  if gs.said[key] then return end
  gs.said[key] = true
  gs.print("trainer: cuda graphs: " .. line)
end

local function capture(tr, gs, b, ctx, sig)
  -- The eager step's activations, cached by the shared allocator, would
  -- otherwise sit beside the graph's own pool for the rest of the run.
  titan.empty_cache(tr.device)
  gs.inputs = memory.keep(b.inputs:clone())
  gs.targets = memory.keep(b.targets:clone())
  local frozen = { num_tokens = ctx.num_tokens, step = ctx.step, trainer = tr }
  local static = { inputs = gs.inputs, targets = gs.targets }
  local trainer = require("titan.trainer")
  local g, why = cuda_graph.capture(tr.device, function()
    return { loss = trainer.forward_backward(tr, static, frozen) }
  end)
  if not g then
    gs.failed = true
    gs.inputs:free(); gs.targets:free()
    gs.inputs, gs.targets = nil, nil
    say_once(gs, "failed", "capture impossible, training eagerly: " .. why)
    return
  end
  gs.graph, gs.sig = g, sig
  local pool = g:memory_stats()
  say_once(gs, "captured", ("captured forward + backward of one micro-batch (%s): %d nodes, %.1f MiB private pool")
    :format(sig, g.num_nodes, pool.reserved / 2 ^ 20))
end

-- Replays every micro-batch; returns the summed loss (one read-back for the
-- whole step, summed in the eager step's order).
local function replay(gs, batches)
  local g, n = gs.graph, #batches
  return titan.scope(function()
    local losses
    for i, b in ipairs(batches) do
      gs.inputs:copy_(b.inputs)
      gs.targets:copy_(b.targets)
      b.inputs:free()
      b.targets:free()
      batches[i] = nil
      g:replay()
      local loss = g.outputs.loss
      losses = losses or titan.empty({ n }, { dtype = loss:dtype(), device = loss:device() })
      losses:narrow(1, i, 1):copy_(loss:reshape(1))
    end
    local sum = 0
    for _, v in ipairs(losses:tolist_flat()) do sum = sum + v end
    return sum
  end)
end

-- The train_step the trainer calls.
function M.step(tr, step)
  local trainer = require("titan.trainer")
  local gs = tr.graph_state
  local batches, num_tokens = trainer.next_batches(tr)
  local ctx = { num_tokens = num_tokens, step = step, trainer = tr }
  local sig = signature(batches[1], num_tokens)
  for i = 2, #batches do
    if signature(batches[i], num_tokens) ~= sig then sig = "mixed" end
  end
  if not gs.graph and not gs.failed and sig ~= "mixed" then
    if gs.warm ~= sig then
      gs.warm = sig -- this step runs eagerly and prepares what capture cannot create
    else
      capture(tr, gs, batches[1], ctx, sig)
    end
  end
  if gs.graph and sig == gs.sig then return replay(gs, batches), num_tokens end
  if gs.graph then
    say_once(gs, "other", ("step %d's batches (%s) differ from the captured ones (%s): such steps run eagerly")
      :format(step, sig, gs.sig))
  end
  return trainer.run_micro_batches(tr, batches, ctx), num_tokens
end

-- ---- the update graph ----------------------------------------------------

local function grads_of(params)
  local grads = {}
  for _, p in ipairs(params) do
    if p.grad then grads[#grads + 1] = p.grad end
  end
  return grads
end

local function drop_update(gs)
  if gs.update then gs.update:free() end
  if gs.plan then gs.optimizer:free_device_plan(gs.plan) end
  if gs.norm_clip then gs.norm_clip:free() end
  gs.update, gs.plan, gs.norm_clip = nil, nil, nil
end

local function capture_update(tr, gs, params)
  local opt = tr.optimizer
  local function fail(why)
    drop_update(gs)
    gs.update_failed = true
    say_once(gs, "update failed", "the update (clip, optimizer step, zero_grad) stays eager: " .. why)
  end
  if type(opt.device_plan) ~= "function" then return fail("the optimizer has no device step") end
  local grads = grads_of(params)
  if #grads == 0 then return fail("no parameter has a gradient") end
  gs.optimizer = opt
  local plan, why = opt:device_plan()
  if not plan then return fail(why) end
  gs.plan = plan
  gs.norm_clip = memory.keep(titan.zeros({ 3 }, { dtype = "float64", device = tr.device })) -- (+ NaN/inf count)
  local max_norm = tr.cfg.training.max_norm
  local clip = max_norm and max_norm > 0
  local g
  g, why = cuda_graph.capture(tr.device, function()
    ops.global_norm_dev_(grads, clip and max_norm or 0, gs.norm_clip)
    opt:launch_device_step(plan, gs.norm_clip) -- (always: a NaN/inf norm skips the step in the kernels)
    ops.fill_multi_(grads, 0)
  end)
  if not g then return fail(why) end
  gs.update, gs.ngrads = g, #grads
  say_once(gs, "update captured", ("captured the update of %d gradients: %d nodes"):format(#grads, g.num_nodes))
end

-- The trainer's update (Trainer:update) from the second graph: returns a
-- function that reads this step's gradient norm back.
function M.update(tr, params)
  local gs = tr.graph_state
  if gs.update and #grads_of(params) ~= gs.ngrads then
    say_once(gs, "update other", "the set of parameters with gradients changed: the update runs eagerly from now on")
    drop_update(gs)
    gs.update_failed = true
  end
  if not gs.update and not gs.update_failed then
    if not gs.update_warm then
      gs.update_warm = true -- this step's eager update creates the optimizer state
    else
      capture_update(tr, gs, params)
    end
  end
  if not gs.update then return getmetatable(tr).update(tr, params) end
  tr.optimizer:prepare_device_step(gs.plan)
  gs.update:replay()
  return function()
    local v = gs.norm_clip:tolist_flat()
    return v[1], v[3]
  end
end

-- Called by the trainer when training.cuda_graphs is on.
function M.enable(tr, cfg)
  local say = function(line) tr.print("trainer: cuda graphs: " .. line) end
  if cfg.train_step then
    say("the recipe replaces train_step, which is never captured: training eagerly")
  elseif tr.world > 1 then
    -- (a step's collectives and the host's exchanges between them are not captured)
    say(("one process only today (this job has %d ranks): training eagerly"):format(tr.world))
  elseif not tr.device:match("^cuda") and not cuda_graph.emulate then
    say(("they need a cuda device (training.device = %s): training eagerly"):format(tr.device))
  else
    tr.graph_state = { said = {}, print = tr.print }
    tr.train_step = M.step
    tr.update = M.update
  end
end

function M.release(tr)
  local gs = tr.graph_state
  if gs.graph then gs.graph:free() end
  if gs.inputs then gs.inputs:free(); gs.targets:free() end
  gs.graph, gs.inputs, gs.targets = nil, nil, nil
  drop_update(gs)
end

return M
