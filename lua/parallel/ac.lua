-- ac.lua — activation checkpointing: which transformer blocks keep only
-- their input during the forward and compute their activations again in
-- the backward (titan.autograd.checkpoint). TorchTitan's modes:
--
--   none       every block keeps its activations
--   full       every block is checkpointed
--   selective  every Nth block (selective_ac_option = "N"; "1" = full)
--
-- It applies to a model whose blocks are the children of `model.layers`
-- (the TorchTitan layout every model in lua/models/ follows). A wrapped
-- block is called as block(x, ...) -> one tensor, and carries
-- `checkpointed = true` so the model's forward feeds it one tensor rather
-- than its fused (residual, branch) pair.
local autograd = require("titan.autograd")

local M = {}

M.modes = { none = true, full = true, selective = true }

-- The checkpoint frequency of a config section ({mode, selective_ac_option}):
-- 0 (none) or N (every Nth block). Errors name the key and what it expects.
function M.frequency(ac)
  if not M.modes[ac.mode] then
    error(("activation_checkpoint.mode must be none, full or selective, got '%s'"):format(tostring(ac.mode)), 0)
  end
  if ac.mode == "none" then return 0 end
  if ac.mode == "full" then return 1 end
  local opt = tostring(ac.selective_ac_option)
  if opt == "op" then
    error("activation_checkpoint.selective_ac_option = op (per-op selective checkpointing) is not available; "
      .. "expected a block frequency N (every Nth block is checkpointed), or activation_checkpoint.mode=full", 0)
  end
  local n = tonumber(opt)
  if not n or n < 1 or n % 1 ~= 0 then
    error(("activation_checkpoint.selective_ac_option must be a positive integer N (every Nth block), got '%s'")
      :format(opt), 0)
  end
  return n
end

-- Wraps the selected blocks of model.layers in place; returns the number
-- wrapped and the total. As TorchTitan counts, with frequency N the blocks
-- numbered N, 2N, ... from 1 are wrapped (0-based names N-1, 2N-1, ...).
function M.apply(model, ac)
  local freq = M.frequency(ac)
  local layers = rawget(model, "layers")
  if freq == 0 then return 0, layers and #layers._children or 0 end
  if not layers then
    error("activation_checkpoint: the model has no `layers` (its blocks); mode must be none for it", 0)
  end
  local wrapped = 0
  for i, name in ipairs(layers._children) do
    local block = layers[name]
    if i % freq == 0 and not rawget(block, "checkpointed") then
      local forward = block.forward -- the class's method
      rawset(block, "forward", function(self, ...) return autograd.checkpoint(forward, self, ...) end)
      rawset(block, "checkpointed", true)
      wrapped = wrapped + 1
    elseif rawget(block, "checkpointed") then
      wrapped = wrapped + 1
    end
  end
  return wrapped, #layers._children
end

return M
