-- optim.lua — AdamW with parameter groups, and gradient clipping by the
-- global norm. The update itself is one fused C call per parameter.
--
--   local opt = optim.AdamW(model:named_parameters(), {
--     lr = 8e-4, betas = {0.9, 0.95}, eps = 1e-8, weight_decay = 0.1,
--     groups = { { pattern = "norm%.weight$", weight_decay = 0 } },  -- first match wins
--   })
--   opt:step(); opt:zero_grad()
local tensor = require("titan.tensor")
local memory = require("titan.memory")
local ops = require("titan.ops")

local M = {}

local AdamW = {}
AdamW.__index = AdamW
M.AdamW = AdamW

local HP = { "lr", "betas", "eps", "weight_decay" }

-- named: ordered {name, tensor} pairs (Module:named_parameters()) or a plain
-- list of tensors (named "param.1", ...).
function M.AdamW(named, cfg)
  cfg = cfg or {}
  local self = setmetatable({ params = {}, state = {}, groups = {}, step_count = 0 }, AdamW)
  local defaults = {
    lr = cfg.lr or 1e-3, betas = cfg.betas or { 0.9, 0.999 }, eps = cfg.eps or 1e-8,
    weight_decay = cfg.weight_decay or 0.01,
  }
  local patterns = cfg.groups or {}
  for i, g in ipairs(patterns) do
    local grp = { pattern = g.pattern }
    for _, k in ipairs(HP) do grp[k] = g[k] == nil and defaults[k] or g[k] end
    self.groups[i] = grp
  end
  self.groups[#patterns + 1] = defaults -- everything else
  for i, np in ipairs(named) do
    local name, p = np, nil
    if type(np) == "table" and np[2] then name, p = np[1], np[2] else name, p = "param." .. i, np end
    local gi = #self.groups
    for k, g in ipairs(patterns) do
      if name:match(g.pattern) then gi = k break end
    end
    self.params[#self.params + 1] = { name = name, param = p, group = gi }
  end
  return self
end

-- The learning rate of every group scaled by `factor` (what a schedule sets).
function AdamW:set_lr_factor(factor) self.lr_factor = factor end

function AdamW:lr(group)
  return self.groups[group or #self.groups].lr * (self.lr_factor or 1)
end

-- The parameters that have a gradient, batched as one step updates them:
-- a group's parameters on one device form one multi-tensor update, in
-- parameter order. Optimizer state (f32 moments; an f32 master copy for
-- bf16 parameters) is created on first use and kept outside every scope.
-- Each entry is {param, grad, exp_avg, exp_avg_sq, master, step}, and
-- entries.states[i] the state whose step it reads.
function AdamW:batches()
  local batches, order = {}, {}
  for _, e in ipairs(self.params) do
    local p = e.param
    if p.grad then
      local st = self.state[e.name]
      if not st then
        st = {
          exp_avg = memory.keep(tensor.zeros(p:shape(), { dtype = "float32", device = p:device() })),
          exp_avg_sq = memory.keep(tensor.zeros(p:shape(), { dtype = "float32", device = p:device() })),
          step = 0,
        }
        if p:dtype() == "bfloat16" then st.master = memory.keep(p:to("float32")) end
        self.state[e.name] = st
      end
      local key = e.group .. "|" .. p:device()
      local b = batches[key]
      if not b then
        b = { group = e.group, device = p:device(), states = {} }
        batches[key] = b
        order[#order + 1] = b
      end
      b[#b + 1] = { p, p.grad, st.exp_avg, st.exp_avg_sq, st.master, st.step }
      b.states[#b] = st
    end
  end
  return order
end

-- Counts a step: the optimizer's and each batched parameter's.
local function count_step(self, order)
  self.step_count = self.step_count + 1
  for _, b in ipairs(order) do
    for i, st in ipairs(b.states) do
      st.step = st.step + 1
      b[i][6] = st.step
    end
  end
end

-- A step that updates nothing (a NaN or inf gradient norm, trainer.lua):
-- counted all the same, as on the device, where the kernels decide it.
function AdamW:skip_step() count_step(self, self:batches()) end

function AdamW:group_hp(b)
  local g = self.groups[b.group]
  return { lr = g.lr * (self.lr_factor or 1), betas = g.betas, eps = g.eps, weight_decay = g.weight_decay }
end

-- One step over every parameter that has a gradient: a few kernel launches
-- per group and device.
function AdamW:step()
  local order = self:batches()
  count_step(self, order)
  for _, b in ipairs(order) do ops.adamw_multi_(b, self:group_hp(b)) end
end

-- The same step split for a CUDA graph (titan.graph_step), with the same
-- bits: device_plan() fixes the batches and gives each a device tensor for
-- its scalars; each step, prepare_device_step(plan) counts the step and
-- writes this step's learning rates and bias corrections there (host), and
-- launch_device_step(plan, norm_clip) queues the kernels, which read them
-- from there (capturable). norm_clip: global_norm_dev_'s output, to clip
-- by, or nil. Returns nil and why when a parameter's dtypes need the host
-- step (float64).
function AdamW:device_plan()
  local order = self:batches()
  for _, b in ipairs(order) do
    for _, e in ipairs(b) do
      for _, t in ipairs({ e[1], e[2] }) do
        if t:dtype() == "float64" then return nil, "float64 parameters or gradients take the host step" end
      end
    end
    b.scalars = memory.keep(tensor.empty({ 1 + 2 * #b }, { dtype = "float32", device = b.device }))
  end
  return { batches = order, nparams = #self.params }
end

function AdamW:prepare_device_step(plan)
  count_step(self, plan.batches)
  memory.scope(function()
    for _, b in ipairs(plan.batches) do b.scalars:copy_(ops.adamw_scalars(b, self:group_hp(b))) end
  end)
end

function AdamW:launch_device_step(plan, norm_clip)
  for _, b in ipairs(plan.batches) do ops.adamw_multi_dev_(b, self:group_hp(b), b.scalars, norm_clip) end
end

-- One step through the device path without a graph (what the trainer's
-- eager update does on a GPU: no host wait for the clip coefficient). nil
-- and why when a parameter needs the host step.
function AdamW:step_on_device(norm_clip)
  local plan, why = self:device_plan()
  if not plan then return nil, why end
  self:prepare_device_step(plan)
  self:launch_device_step(plan, norm_clip)
  -- Queued on the compute stream, which also orders the reuse of these.
  self:free_device_plan(plan)
  return true
end

function AdamW:free_device_plan(plan)
  for _, b in ipairs(plan.batches) do
    if b.scalars then b.scalars:free() end
    b.scalars = nil
  end
end

-- opts.set_to_none (default true) frees the gradients, as PyTorch does;
-- false zeroes them in place (a CUDA graph keeps accumulating into them).
function AdamW:zero_grad(opts)
  local to_none = not opts or opts.set_to_none ~= false
  local grads = {}
  for _, e in ipairs(self.params) do
    local p = e.param
    if p.grad then
      if to_none then
        p.grad:free()
        p.grad = nil
      else
        grads[#grads + 1] = p.grad
      end
    end
  end
  if #grads > 0 then ops.fill_multi_(grads, 0) end
end

-- Releases the optimizer state (moments, masters) now; the next step
-- creates it again.
function AdamW:free_state()
  for _, st in pairs(self.state) do
    st.exp_avg:free()
    st.exp_avg_sq:free()
    if st.master then st.master:free() end
  end
  self.state = {}
end

-- State for checkpoints: {step_count, lr_factor, per-name {step, exp_avg, exp_avg_sq, master}}.
function AdamW:state_dict()
  return { step_count = self.step_count, lr_factor = self.lr_factor, state = self.state }
end

function AdamW:load_state_dict(sd)
  self.step_count = sd.step_count or 0
  self.lr_factor = sd.lr_factor
  for name, s in pairs(sd.state or {}) do
    local own = self.state[name]
    if own then
      own.exp_avg:copy_(s.exp_avg)
      own.exp_avg_sq:copy_(s.exp_avg_sq)
      if own.master and s.master then own.master:copy_(s.master) end
      own.step = s.step
    else
      self.state[name] = s
    end
  end
end

-- Scale every gradient so their global L2 norm is at most max_norm (as
-- torch.nn.utils.clip_grad_norm_). Returns the norm before clipping.
-- opts.sum_squares(x): the sum over the ranks of each one's sum of squares,
-- when each holds a share of the gradients (FSDP); every rank must call it.
-- opts.sharded: the set of parameters held in shares (TP); the others are
-- whole on every rank and counted once. opts.sum_total(x, own): then the sum
-- of the total over other ranks (FSDP's shards of TP's slices: 2D), with
-- own, the sum of squares of opts.own's gradients (a set of parameters
-- other ranks hold others of: expert parallelism's experts), added where
-- they sum (without sum_total: added to the total).
-- The gradients of params: all of them, those of the split weights, those
-- of the whole ones (sharded: the set of split parameters; nil: all are
-- split) and those of own's parameters (in neither of the others).
function M.grads_by_share(params, sharded, own)
  local grads, split, whole, mine = {}, {}, {}, {}
  for _, p in ipairs(params) do
    if p.grad then
      grads[#grads + 1] = p.grad
      if own and own[p] then mine[#mine + 1] = p.grad
      elseif sharded and not sharded[p] then whole[#whole + 1] = p.grad
      else split[#split + 1] = p.grad end
    end
  end
  return grads, split, whole, mine
end

function M.clip_grad_norm(params, max_norm, opts)
  opts = opts or {}
  local grads, split, whole, mine = M.grads_by_share(params, opts.sharded, opts.own)
  local function sq(ts)
    local n = #ts > 0 and ops.global_norm(ts) or 0
    return n * n
  end
  local norm
  if opts.sum_squares then
    local total = opts.sum_squares(sq(split)) + sq(whole)
    norm = math.sqrt(opts.sum_total and opts.sum_total(total, sq(mine)) or total + sq(mine))
  else
    norm = #grads > 0 and ops.global_norm(grads) or 0
  end
  if max_norm and max_norm > 0 and norm > max_norm then
    ops.scale_multi_(grads, max_norm / (norm + 1e-6))
  end
  return norm
end

return M
