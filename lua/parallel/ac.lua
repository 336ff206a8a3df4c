-- ac.lua — activation checkpointing: which transformer blocks keep only
-- their input (and, per op, some outputs) during the forward and compute
-- their activations again in the backward (titan.autograd.checkpoint).
-- TorchTitan's modes:
--
--   none                       every block keeps its activations
--   full                       every block is checkpointed
--   selective, option "N"      every Nth block ("1" = full)
--   selective, option "op"     every block, keeping the outputs of its
--                              attention and of every other linear (the
--                              1st, 3rd, ... in the block), recomputing
--                              the rest: norms, RoPE, SwiGLU, the other
--                              linears
--
-- It applies to a model whose blocks are the children of `model.layers`
-- (the TorchTitan layout every model in lua/models/ follows). A wrapped
-- block is called as block(x, ...) -> one tensor; a block that takes the
-- residual stream as a fused (residual, branch) pair (forward_parts) takes
-- it added into one tensor, so the model never knows which blocks are
-- wrapped. `checkpointed = true` marks them for this file's own count.
local autograd = require("titan.autograd")

local M = {}

M.modes = { none = true, full = true, selective = true }

-- TorchTitan's per-op policy: keep what is expensive to recompute
-- (attention; half the matrix products), recompute the rest.
function M.op_policy(kind, count)
  return kind == "attention" or (kind == "linear" and count % 2 == 1)
end

-- A config section ({mode, selective_ac_option}) -> {every = N (0: none),
-- policy = per-op policy or nil}. Errors name the key and what it expects.
function M.plan(ac)
  if not M.modes[ac.mode] then
    error(("activation_checkpoint.mode must be none, full or selective, got '%s'"):format(tostring(ac.mode)), 0)
  end
  if ac.mode == "none" then return { every = 0 } end
  if ac.mode == "full" then return { every = 1 } end
  local opt = tostring(ac.selective_ac_option)
  if opt == "op" then return { every = 1, policy = M.op_policy } end
  local n = tonumber(opt)
  if not n or n < 1 or n % 1 ~= 0 then
    error(("activation_checkpoint.selective_ac_option must be op or a positive integer N (every Nth block), "
      .. "got '%s'"):format(opt), 0)
  end
  return { every = n }
end

-- Wraps the selected blocks of model.layers in place; returns the number
-- wrapped and the total. As TorchTitan counts, with frequency N the blocks
-- numbered N, 2N, ... from 1 are wrapped (0-based names N-1, 2N-1, ...).
function M.apply(model, ac)
  local plan = M.plan(ac)
  local layers = rawget(model, "layers")
  if plan.every == 0 then return 0, layers and #layers._children or 0 end
  if not layers then
    error("activation_checkpoint: the model has no `layers` (its blocks); mode must be none for it", 0)
  end
  local wrapped = 0
  for i, name in ipairs(layers._children) do
    local block = layers[name]
    -- (the model's block number: a pipeline stage holding blocks 3..5 wraps the same ones as the whole model)
    local n = tonumber(name) and tonumber(name) + 1 or i
    if n % plan.every == 0 and not rawget(block, "checkpointed") then
      local forward, policy = block.forward, plan.policy -- the class's method
      local function wrap(fn)
        return function(self, ...)
          if policy then return autograd.checkpoint_ops(policy, fn, self, ...) end
          return autograd.checkpoint(fn, self, ...)
        end
      end
      rawset(block, "forward", wrap(forward))
      -- A block that takes the residual stream as two tensors,
      -- forward_parts(x, prev, ...) -> h, f (x + prev in, h + f out: the adds
      -- fused into its norms) keeps only its input here: one tensor, so
      -- x + prev is added before it, and h + f comes out whole (f = nil).
      local parts = block.forward_parts -- the class's
      if type(parts) == "function" then
        local whole = wrap(function(self, x, ...)
          local h, f = parts(self, x, nil, ...)
          return h + f
        end)
        rawset(block, "forward_parts", function(self, x, prev, ...)
          local input = prev and x + prev or x
          local h = whole(self, input, ...)
          if input ~= x then input:free() end
          return h, nil
        end)
      end
      rawset(block, "checkpointed", true)
    end
    if rawget(block, "checkpointed") then wrapped = wrapped + 1 end
  end
  return wrapped, #layers._children
end

-- The banner's line (lua/parallel/describe.lua): par, the job laid out.
function M.describe(par)
  if par.ac_blocks <= 0 then return nil end
  -- (tflops and MFU count the model's FLOPs, not the recomputation's: as TorchTitan's)
  local ac = par.ac
  return ("activation checkpointing: %s, %d of %d blocks recompute their activations in the backward%s")
    :format(ac.mode, par.ac_blocks, par.n_blocks, (ac.mode == "selective" and ac.selective_ac_option == "op")
      and " (per op: attention and every other linear kept)" or "")
end

return M
