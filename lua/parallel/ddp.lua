-- DDP on GPUs: the gradients' sum over the data-parallel ranks overlapped
-- with the backward (as PyTorch DDP's bucket hooks).
--
-- Without it the trainer sums the gradients after the backward, in ~25 MB
-- buckets (Trainer:reduce_gradients), and the GPU computes nothing while
-- they cross the wire. With it each block of model.layers gets a hook on
-- its inputs, an identity in the tape (as FSDP's post-backward hook): it
-- runs after the block's last backward node, when the gradients of the
-- block's parameters are complete. On the step's last micro-batch (arm())
-- the hook starts their all-reduce at once (group:all_reduce_async: on the
-- communication stream, after the kernels that produced them) and the
-- compute stream goes on with the blocks before it. finish() starts the
-- rest (the parameters outside the blocks, and those of a block whose hook
-- did not run) and has the compute stream wait for every one of them, so
-- the optimizer reads the sums; the host waits for nothing.
--
-- The same sums as the buckets (each element summed over the ranks), in
-- place: no copy and no buffer. Every rank starts the collectives in the
-- same order (the backward's order, then the parameters'), as NCCL needs.
-- A block's gradients must not change after its hook: they don't, the
-- parameters of a block are used only by that block (and the step's last
-- micro-batch is the last to add to them).
local autograd = require("titan.autograd")
local tensor = require("titan.tensor")

local M = {}

local function is_tensor(v) return type(v) == "table" and getmetatable(v) == tensor.Tensor end
local function pack(...) return { n = select("#", ...), ... } end

local DDP = {}
DDP.__index = DDP

-- The hook: an identity whose backward counts the call's inputs down and
-- starts the block's reductions after the last one (a call's own count, so
-- a forward whose graph is never run back leaves nothing behind).
local Post = autograd.Function {
  name = "ddp_post_backward",
  forward = function(ctx, x, call)
    ctx.call = call
    return x:detach()
  end,
  backward = function(ctx, g)
    local call = ctx.call
    call.left = call.left - 1
    if call.left == 0 then call.ddp:block_done(call.block) end
    return g
  end,
}

-- Starts the sum of p's gradient (once a step); true if it did.
function DDP:start(p)
  if self.started[p] or not p.grad then return false end
  self.started[p] = true
  self.works[#self.works + 1] = self.group:all_reduce_async(p.grad, "sum")
  return true
end

-- (A checkpointed block's recomputation, inside the backward, gets hooks of
-- its own, which run first: the block is then reduced once, earlier.)
function DDP:block_done(block)
  if not self.armed then return end
  local any = false
  for _, p in ipairs(self.block_params[block]) do any = self:start(p) or any end
  if any then self.stats.in_backward = self.stats.in_backward + 1 end
end

-- The next backward is the step's last micro-batch's: its hooks reduce.
function DDP:arm()
  self.armed = true
end

-- After the backward: the parameters not reduced yet, in order, then the
-- compute stream waits for every reduction. Returns the number of blocks
-- reduced during the backward.
function DDP:finish(params)
  for _, p in ipairs(params) do self:start(p) end
  local works, n = self.works, self.stats.in_backward
  self.works, self.started, self.armed = {}, {}, false
  self.stats.in_backward = 0
  for _, w in ipairs(works) do w:wait() end
  self.stats.last_in_backward = n
  return n
end

-- After a failed step: waits for the reductions started and forgets them,
-- so that the next step (or the exit) starts clean.
function DDP:drop()
  local works = self.works
  self.works, self.started, self.armed = {}, {}, false
  self.stats.in_backward = 0
  for _, w in ipairs(works) do pcall(w.wait, w) end
end

-- model.layers' blocks get the hook (forward and forward_parts, the outer
-- call only); returns the DDP state for the trainer. A model without
-- `layers` gets no hooks: finish() then sums everything after the backward.
function M.attach(model, group)
  local d = setmetatable({ group = group, block_params = {}, works = {}, started = {}, armed = false, nblocks = 0,
    stats = { in_backward = 0, last_in_backward = 0 } }, DDP)
  local layers = rawget(model, "layers")
  for _, nl in ipairs(layers and layers:named_children() or {}) do
    local block = nl[2]
    d.nblocks = d.nblocks + 1
    local ps = {}
    for _, np in ipairs(block:named_parameters()) do ps[#ps + 1] = np[2] end
    d.block_params[block] = ps
    local busy = false
    for _, m in ipairs({ "forward", "forward_parts" }) do
      local fn = block[m]
      if type(fn) == "function" then
        rawset(block, m, function(self, ...)
          if busy or not autograd.is_enabled() then return fn(self, ...) end
          local args = pack(...)
          local call = { ddp = d, block = block, left = 0 }
          for i = 1, args.n do
            local a = args[i]
            if is_tensor(a) and a.requires_grad then
              args[i] = Post(a, call)
              call.left = call.left + 1
            end
          end
          busy = true
          local ok, res = pcall(function() return pack(fn(self, unpack(args, 1, args.n))) end)
          busy = false
          if not ok then error(res, 0) end
          return unpack(res, 1, res.n)
        end)
      end
    end
  end
  return d
end

-- The banner's line (lua/parallel/describe.lua) for data parallelism
-- without FSDP: par, the job laid out.
function M.describe(par)
  local say = require("parallel.describe")
  return ("data parallel over %s: %d ranks (DDP: %s)%s; tps and MFU are per rank"):format(say.over(par),
    par.dims.dp_size, par.ddp and "each block's gradients summed during the backward, on the communication stream"
    or "gradients summed in ~25 MB buckets each step", say.each(par))
end

return M
