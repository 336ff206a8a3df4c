-- autograd.lua — reverse-mode differentiation as a tape of Lua nodes; the
-- math of every backward is a C entry point.
--
-- An op that sees an input requiring grad records a node on its output:
--   node = { name, inputs = {...}, backward = fn(ctx, gout) -> grads, saved = {...} }
-- backward() orders the nodes reachable from the root, runs them in reverse
-- and routes each returned gradient to its input: a leaf accumulates into
-- .grad, an intermediate into its node's pending gradient. A backward may
-- also accumulate straight into a leaf's .grad (ctx:accum(i)), which is how
-- weight gradients cost no extra pass and gradient accumulation is free.
-- Saved tensors and intermediate gradients are released as soon as their
-- node has run, not when the garbage collector gets to them.
local tensor = require("titan.tensor")
local memory = require("titan.memory")
local profiler = require("titan.profiler")
local tffi = require("titan.ffi")
local C, check = tffi.C, tffi.check

local M = {}

local enabled = true

function M.is_enabled() return enabled end

local function restore(prev, ok, ...)
  enabled = prev
  if not ok then error((...), 0) end
  return ...
end

-- Run fn(...) without recording (evaluation, optimizer updates, init).
function M.no_grad(fn, ...)
  local prev = enabled
  enabled = false
  return restore(prev, pcall(fn, ...))
end

function M.set_enabled(on)
  local prev = enabled
  enabled = on and true or false
  return prev
end

-- Does any of these values need a gradient?
function M.needs(...)
  if not enabled then return false end
  for i = 1, select("#", ...) do
    local t = select(i, ...)
    if type(t) == "table" and t.requires_grad then return true end
  end
  return false
end

-- A second owner of t's memory for a node: a new handle with its own C
-- reference and no scope, so the scope that frees t's handle leaves the
-- memory to the node, which releases it after its backward has run.
local function share(t)
  local c = tensor.cptr(t)
  C.tt_tensor_retain(c)
  local s = tensor.wrap(c)
  memory.keep(s)
  return s
end
M.share = share

-- Attach a node to `out`. inputs: array (may hold non-tensors; n = count).
function M.record(name, out, inputs, n, backward, saved)
  local owned = {}
  if saved then
    for i, t in ipairs(saved) do owned[i] = share(t) end
  end
  out.requires_grad = true
  out._node = { name = name, inputs = inputs, n = n or #inputs, backward = backward, saved = owned }
  -- (a profiled step names each backward by the module whose forward made it)
  if profiler.active then out._node.where = profiler.active:current() end
  return out
end

local Ctx = {}
Ctx.__index = Ctx

-- Input i needs a gradient.
function Ctx:needs(i)
  local t = self.node.inputs[i]
  return type(t) == "table" and t.requires_grad == true
end

-- The .grad of leaf input i to accumulate into directly (created as zeros
-- on first use), or nil when input i is not a leaf that needs a gradient.
-- A caller that writes every element (a weight-gradient GEMM) passes
-- `overwrite`: a .grad made now is then left uninitialized and the second
-- result is true, write rather than add (beta = 0). The first micro-batch
-- after zero_grad so costs no memset of the gradients and no read of them.
function Ctx:accum(i, overwrite)
  local t = self.node.inputs[i]
  if type(t) ~= "table" or not t.requires_grad or t._node then return nil end
  if not t.grad then
    if overwrite then
      t.grad = memory.keep(tensor.empty_like(t))
      return t.grad, true
    end
    t.grad = memory.keep(tensor.zeros_like(t))
  end
  return t.grad, false
end

-- The gradient already waiting for intermediate input i (another consumer's
-- backward ran first), or nil. A backward may accumulate into it in place
-- and return nil for i: the memory pass of a separate add is saved. It is
-- packed and owned by the tape, as every pending gradient.
function Ctx:pending_grad(i)
  local t = self.node.inputs[i]
  if type(t) ~= "table" or not t._node or not t.requires_grad then return nil end
  return self._pending[t._node]
end

function Ctx:saved(i) return self.node.saved[i] end

local function topo_order(root_node)
  local order, visited = {}, {}
  local stack = { { root_node, 1 } }
  visited[root_node] = true
  while #stack > 0 do
    local top = stack[#stack]
    local node, i = top[1], top[2]
    if i <= node.n then
      top[2] = i + 1
      local inp = node.inputs[i]
      local child = type(inp) == "table" and inp._node
      if child and not visited[child] then
        visited[child] = true
        stack[#stack + 1] = { child, 1 }
      end
    else
      stack[#stack] = nil
      order[#order + 1] = node -- post-order: children before parents
    end
  end
  return order
end

local function release_node(node)
  for _, s in ipairs(node.saved) do s:free() end
  node.saved = nil
  node.released = true
end

local depth = 0       -- backward passes running now (a checkpointed block's recomputation nests one)
local callbacks = {}  -- to run when the outermost one ends

-- True while a backward pass runs (a checkpointed block's recomputation
-- runs its forward inside one): what a forward counts once per step (MoE's
-- tokens per expert) skips the recomputation.
function M.in_backward() return depth > 0 end

-- fn() runs once, when the outermost backward pass running now (or the
-- next one) has finished every node (as torch's queue_callback): FSDP's
-- final reduce-scatter of what no hook of a block caught. A pass that
-- fails drops them.
function M.queue_callback(fn) callbacks[#callbacks + 1] = fn end

-- backward(root[, grad[, opts]]): opts.retain_graph keeps saved tensors.
function M.backward(root, grad, opts)
  opts = opts or {}
  if not root.requires_grad then
    error("backward: the tensor does not require grad (no input of its graph has requires_grad = true)", 2)
  end
  local user_grad = grad ~= nil
  if not grad then
    if root:numel() ~= 1 then
      error("backward: grad can be implicit only for a scalar; got shape " .. tensor.shape_str(root:shape()), 2)
    end
    grad = tensor.full(root:shape(), 1, { dtype = root:dtype(), device = root:device() })
  end
  local prev = enabled
  enabled = false -- backward math is not itself recorded
  local pending, holder = {}, {}
  depth = depth + 1
  local ok, err = pcall(function()
    if not root._node then -- a leaf
      if root.grad then
        check(C.tt_op_axpy(root.grad._c, 1, grad._c))
      else
        root.grad = memory.keep(user_grad and grad:clone() or grad)
        if not user_grad then grad = nil end
      end
      if grad and not user_grad then grad:free() end
      return
    end
    pending[root._node] = grad -- gradient waiting for each node
    holder[grad] = true        -- gradient tensors currently stored somewhere
    local order = topo_order(root._node)
    for k = #order, 1, -1 do
      local node = order[k]
      local g = pending[node]
      if g then
        if node.released then
          error("backward: the graph through " .. node.name ..
                " was already used by a backward (pass {retain_graph = true} to backward twice)", 0)
        end
        pending[node] = nil
        holder[g] = nil
        local ctx = setmetatable({ node = node, _pending = pending }, Ctx)
        local grads
        local prof = profiler.active
        if prof then
          grads = prof:region(node.where and (node.where .. " " .. node.name) or node.name, "backward", node.backward,
            ctx, g) or {}
        else
          grads = node.backward(ctx, g) or {}
        end
        for i = 1, node.n do
          local gi, inp = grads[i], node.inputs[i]
          if gi and type(inp) == "table" and inp.requires_grad then
            -- A gradient is accumulated into in place later, so whoever
            -- stores it must own packed memory no one else holds.
            if holder[gi] then
              gi = gi:clone()
            elseif not gi:is_contiguous() then
              local packed = gi:clone()
              if gi ~= g then gi:free() end
              gi = packed
            end
            if inp._node then
              local acc = pending[inp._node]
              if acc then
                check(C.tt_op_axpy(acc._c, 1, gi._c))
                if gi ~= g then gi:free() end
              else
                pending[inp._node] = gi
                holder[gi] = true
              end
            else
              if inp.grad then
                check(C.tt_op_axpy(inp.grad._c, 1, gi._c))
                if gi ~= g then gi:free() end
              else
                inp.grad = memory.keep(gi)
                holder[gi] = true
              end
            end
          elseif gi and gi ~= g and not holder[gi] then
            gi:free()
          end
        end
        if not holder[g] and not (user_grad and g == grad) then g:free() end
      end
      if not opts.retain_graph then release_node(node) end
    end
  end)
  enabled = prev
  depth = depth - 1
  if depth == 0 and #callbacks > 0 then
    local run = callbacks
    callbacks = {}
    for _, fn in ipairs(ok and run or {}) do
      ok, err = pcall(fn)
      if not ok then break end
    end
  end
  if not ok then
    -- Leave nothing behind: pending gradients die with the failed pass.
    for _, g in pairs(pending) do
      if not (user_grad and g == grad) then g:free() end
    end
    error(err, 2)
  end
end

-- ---- activation checkpointing ----------------------------------------------
--
--   local y = autograd.checkpoint(fn, x, ...)      -- as fn(x, ...)
--
-- Runs fn without recording, inside its own memory scope, so of everything
-- fn computes only its result stays; the node keeps fn's tensor arguments.
-- Its backward runs fn again with recording on, from those arguments
-- detached, and backpropagates through that copy: fn's activations exist
-- only during its own backward, for the price of a second forward.
-- Parameters used inside fn are leaves, so their .grad accumulates in the
-- recomputation's backward. fn must return one tensor, and give the same
-- values when run again (no fresh random draws). Non-tensor arguments
-- (modules, tables, numbers) are passed again as they are.
--
--   local y = autograd.checkpoint_ops(policy, fn, x, ...)
--
-- The same with a per-op policy (TorchTitan's selective "op" mode): ops
-- that offer their outputs (F.linear as "linear", F.attention as
-- "attention") ask policy(kind, count) -- count: the how-manieth op of
-- that kind in this call of fn -- and the outputs of those it says yes to
-- are kept from the forward and taken back in the recomputation instead of
-- computed again.

local sac -- the per-op policy state of the checkpointed forward or recomputation running now

-- For an op that can be saved: the outputs the forward kept for it when
-- this is a recomputation (fresh handles in the current scope), else nil;
-- then the op computes and calls sac_store with its outputs.
function M.sac_lookup(kind)
  local s = sac
  if not s then return nil end
  local c = (s.counts[kind] or 0) + 1
  s.counts[kind] = c
  s.want = s.policy(kind, c) and kind or nil
  if not s.want or not s.replay then return nil end
  s.next = s.next + 1
  local entry = s.entries[s.next]
  if not entry or entry.kind ~= kind then
    error(("autograd.checkpoint_ops: the recomputation asked for %s #%d, which the forward did not keep (fn took "
      .. "another path the second time)"):format(kind, c), 0)
  end
  local out = {}
  for i = 1, #entry do out[i] = entry[i]:detach() end
  s.want = nil
  return out
end

function M.sac_store(...)
  local s = sac
  if not s or not s.want or s.replay then return end
  local entry = { kind = s.want }
  for i = 1, select("#", ...) do entry[i] = share((select(i, ...))) end
  s.entries[#s.entries + 1] = entry
  s.want = nil
end

-- Run f(...) with the policy state st active (restored after, also on error).
local function with_sac(st, f, ...)
  local prev = sac
  sac = st
  local r = { pcall(f, ...) }
  sac = prev
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, table.maxn(r))
end

local function checkpoint(policy, fn, ...)
  if not enabled then return with_sac(nil, memory.scope, fn, ...) end -- nothing to record: only the result outlives fn
  local n = select("#", ...)
  local args = { ... }
  local inputs, slots = {}, {} -- the tensor arguments (the node's inputs) and their positions
  for i = 1, n do
    if getmetatable(args[i]) == tensor.Tensor then
      inputs[#inputs + 1] = args[i]
      slots[#slots + 1] = i
      args[i] = nil -- recomputed from the node's saved copy, not from this handle
    end
  end
  local st = policy and { policy = policy, counts = {}, entries = {} } or nil
  enabled = false
  local ok, out = pcall(with_sac, st, memory.scope, fn, ...)
  enabled = true
  local kept = {} -- what the policy kept: after the inputs in the node's saved list
  for _, entry in ipairs(st and st.entries or {}) do
    for i = 1, #entry do kept[#kept + 1] = entry[i] end
  end
  local function drop() for _, t in ipairs(kept) do t:free() end end
  if not ok then drop(); error(out, 0) end
  if getmetatable(out) ~= tensor.Tensor then
    drop()
    error("autograd.checkpoint: the function must return one tensor, got " .. type(out), 3)
  end
  for _, t in ipairs(inputs) do
    if rawequal(out, t) then drop(); return out end -- nothing computed, nothing to recompute
  end
  local saved = {}
  for k, t in ipairs(inputs) do saved[k] = t end
  for _, t in ipairs(kept) do saved[#saved + 1] = t end
  M.record("checkpoint", out, inputs, #inputs, function(ctx, g)
    return memory.scope(function()
      local again, leaves = {}, {}
      for i = 1, n do again[i] = args[i] end
      for k, slot in ipairs(slots) do
        local d = ctx:saved(k):detach()
        if ctx:needs(k) then d.requires_grad = true end
        again[slot], leaves[k] = d, d
      end
      local replay
      if policy then -- the kept outputs, from the node's saved list, in the forward's order
        local entries, j = {}, #inputs
        for e, entry in ipairs(st.entries) do
          entries[e] = { kind = entry.kind }
          for i = 1, #entry do
            j = j + 1
            entries[e][i] = ctx:saved(j)
          end
        end
        replay = { policy = policy, counts = {}, entries = entries, replay = true, next = 0 }
      end
      local prev = enabled
      enabled = true
      local ok2, y = pcall(with_sac, replay, fn, unpack(again, 1, n))
      enabled = prev
      if not ok2 then error(y, 0) end
      if replay and replay.next < #replay.entries then
        error(("autograd.checkpoint_ops: the recomputation used %d of the %d outputs the forward kept (fn took "
          .. "another path the second time)"):format(replay.next, #replay.entries), 0)
      end
      -- Nothing inside needed a gradient (no parameter, no input): none to pass on.
      if y.requires_grad then M.backward(y, g) end
      local grads = {}
      for k, d in ipairs(leaves) do
        grads[k], d.grad = d.grad, nil
      end
      return grads
    end)
  end, saved)
  drop() -- the node holds its own references now
  return out
end

function M.checkpoint(fn, ...) return checkpoint(nil, fn, ...) end
function M.checkpoint_ops(policy, fn, ...) return checkpoint(policy, fn, ...) end

-- ---- user-defined differentiable functions ---------------------------------
--
--   local Square = autograd.Function {
--     forward = function(ctx, x) ctx:save_for_backward(x); return x * x end,
--     backward = function(ctx, g) local x = ctx.saved_tensors[1]; return g * x * 2 end,
--   }
--   local y = Square(x)
--
-- backward returns one gradient per argument of forward (nil for arguments
-- that need none). forward runs without recording.

local FnCtx = {}
FnCtx.__index = FnCtx

function FnCtx:save_for_backward(...)
  self._to_save = { ... }
end

function M.Function(def)
  assert(type(def.forward) == "function" and type(def.backward) == "function",
    "autograd.Function needs forward and backward functions")
  local fn = {}
  local function apply(...)
    local n = select("#", ...)
    local args = { ... }
    local ctx = setmetatable({}, FnCtx)
    local prev = enabled
    enabled = false
    local ok, out = pcall(def.forward, ctx, ...)
    enabled = prev
    if not ok then error(out, 2) end
    if M.needs(unpack(args, 1, n)) then
      local saved = ctx._to_save or {}
      ctx._to_save = nil
      M.record(def.name or "Function", out, args, n, function(node_ctx, g)
        ctx.saved_tensors = node_ctx.node.saved
        return { def.backward(ctx, g) }
      end, saved)
    end
    return out
  end
  fn.apply = apply
  return setmetatable(fn, { __call = function(_, ...) return apply(...) end })
end

return M
