-- fsdp.lua — fully sharded data parallelism, as FSDP2 (TorchTitan's
-- fully_shard): each of the dp_shard ranks keeps 1/N of every parameter,
-- of its gradient and of its optimizer state; a block's full parameters
-- exist only while the block runs.
--
--   local fsdp = require("parallel.fsdp")
--   local sharded = fsdp.apply(model, shard_group, { replicate = group | nil, reshard_after_forward = "default" })
--   optimizer over sharded:named_parameters(); checkpoint with sharded:state_model() and sharded.shard_of
--
-- Units: each block of model.layers, and the root (the parameters outside
-- the blocks: embeddings, final norm, output). A parameter is split along
-- dim 0 as torch.chunk does (ceil(d0 / N) rows per rank, the last ranks
-- fewer or none); a unit's shards live in one flat buffer, padded to the
-- same size on every rank, so unsharding is one all-gather and the
-- gradient reduction one reduce-scatter per unit.
--
-- A unit's life in a step (the model's own forward is unchanged: the
-- hooks wrap the block's methods):
--   forward     all-gather its parameters into their (kept) tensors; run;
--               free that memory again (reshard after forward), except
--               the last block under "default" and the root.
--   backward    an identity on the block's outputs brings the parameters
--               back before the block's first backward node runs (the
--               pre-backward hook); an identity on its inputs runs after
--               its last one (post-backward): the full gradients are
--               reduce-scattered (summed) into the shards' .grad and freed,
--               and so are the parameters. A final callback of the
--               backward pass does the root and whatever no hook caught.
-- Under a pipeline schedule (lua/parallel/pp.lua) each micro-batch's
-- backward is a pass of its own, whose final callback reduces and reshards
-- every unit; a later micro-batch's forward or backward gathers again. A
-- rank's stages are each sharded on their own (M.combine makes them one).
-- The memory goes with tensor:free_storage(): the tensor objects, and the
-- references autograd nodes hold to them, stay; the memory comes back at
-- the same addresses of the same storage objects (tensor:alloc_storage()).
--
-- HSDP: with a replicate group, the shards' gradients are then summed over
-- the replicas (all-reduce), which hold the same shards.
--
-- Overlap (opts.overlap; the trainer's on nccl unless
-- parallelism.fsdp_overlap = false), as FSDP2's: a block starting its forward starts gathering the next block's
-- parameters (prefetch), and a block starting its backward the previous
-- block's, so each all-gather runs while the GPU computes the block before
-- it; a block's reduce-scatter is started at its post-backward and waited
-- for by the backward's final callback, which then adds the shards'
-- gradients (on nccl the collectives run on the communication stream and
-- the compute stream waits for them only there: tt_dist_*_async). Memory:
-- one more block's full parameters while a gather is in flight, and each
-- block's reduced shard until the backward ends. Backends without
-- asynchronous collectives (mpi, fake) run them at once (the same sums;
-- nothing overlaps, so the trainer leaves it off there).
local autograd = require("titan.autograd")
local memory = require("titan.memory")
local tensor = require("titan.tensor")

local M = {}

M.policies = { default = true, always = true, never = true }

local function is_tensor(v) return type(v) == "table" and getmetatable(v) == tensor.Tensor end

-- ---- one unit ------------------------------------------------------------

local Unit = {}
Unit.__index = Unit

-- Rows of a dim-0 size d0 that rank r holds with chunks of c rows.
local function rows_of(d0, c, r) return math.max(0, math.min(c, d0 - r * c)) end

-- params: ordered {name, full tensor}. Copies this rank's rows of each into
-- the unit's flat buffer, then frees the full parameters' memory. With
-- fsdp.init, parameters without memory get it here and init(names) fills
-- them: one unit's full parameters at a time, never the whole model.
local function new_unit(fsdp, name, params, reshard_after_forward)
  local W, rank = fsdp.group:size(), fsdp.group:rank()
  local self = setmetatable({ fsdp = fsdp, name = name, params = {}, S = 0, unsharded = true, phase = "idle",
    waiting = 0, reshard_after_forward = reshard_after_forward }, Unit)
  local dtype, device
  -- (the weights gathered in fp8, opts.fp8, go last: the rest of the flat
  -- buffer, [0, S_reg), is what the ordinary all-gather moves)
  local fp8 = fsdp.fp8 and fsdp.fp8.params or {}
  local ordered = {}
  for _, np in ipairs(params) do
    if not fp8[np[2]] then ordered[#ordered + 1] = np end
  end
  local n_reg = #ordered
  for _, np in ipairs(params) do
    if fp8[np[2]] then ordered[#ordered + 1] = np end
  end
  params = ordered
  self.S_fp8 = 0
  for i, np in ipairs(params) do
    if i == n_reg + 1 then self.S_reg = self.S end
    local full = np[2]
    local shape = full:shape()
    local d0 = #shape > 0 and shape[1] or 1
    local numel = full:numel()
    local rs = d0 > 0 and numel / d0 or 0
    local c = math.ceil(d0 / W)
    if dtype and (full:dtype() ~= dtype or full:device() ~= device) then
      error(("fsdp: %s is %s on %s but the other parameters of %s are %s on %s; expected one dtype and device per "
        .. "block"):format(np[1], full:dtype(), full:device(), name, dtype, device), 0)
    end
    dtype, device = full:dtype(), full:device()
    local e = { name = np[1], full = full, shape = shape, d0 = d0, rs = rs, c = c, off = self.S,
      rows = rows_of(d0, c, rank), row0 = rank * c }
    if i > n_reg then
      e.fp8, e.off8 = true, self.S_fp8
      self.S_fp8 = self.S_fp8 + c * rs
    end
    self.params[#self.params + 1] = e
    self.S = self.S + c * rs
  end
  self.S_reg = self.S_reg or self.S
  self.dtype, self.device = dtype, device
  -- Parameters without memory: with opts.init_shard each rank initializes
  -- its rows alone (the full parameter never exists); with opts.init the
  -- full one is materialized and initialized, and its rows copied.
  local fresh, own_rows = {}, {}
  for _, e in ipairs(self.params) do
    if not e.full:has_storage() then
      if fsdp.init_shard then
        own_rows[e] = true
      elseif not fsdp.init then
        error(("fsdp: %s has no memory; expected materialized parameters, or opts.init to initialize them")
          :format(e.name), 0)
      else
        e.full:alloc_storage()
        fresh[e.name] = true
      end
    end
  end
  if next(fresh) then fsdp.init(fresh) end
  self.flat = memory.keep(tensor.zeros({ math.max(self.S, 1) }, { dtype = dtype, device = device }))
  autograd.no_grad(function()
    for _, e in ipairs(self.params) do
      if e.rows > 0 then
        local sshape = { e.rows }
        for d = 2, #e.shape do sshape[d] = e.shape[d] end
        e.shard = memory.keep(memory.scope(function()
          return self.flat:narrow(1, e.off + 1, e.rows * e.rs):reshape(sshape)
        end))
        if own_rows[e] then
          fsdp.init_shard(e.name, e.shard, e.row0 * e.rs)
        else
          memory.scope(function()
            e.shard:copy_(e.full:reshape(e.d0, e.rs):narrow(1, e.row0 + 1, e.rows):reshape(sshape))
          end)
        end
      end
    end
  end)
  self:reshard()
  return self
end

-- Starts gathering the full parameters without waiting for them (the next
-- block's while this one computes): unshard() then waits and unpacks. A
-- no-op when they are there or on their way, or without overlap.
function Unit:prefetch()
  if self.unsharded or self.gather or not self.fsdp.overlap or #self.params == 0 or self.S_fp8 > 0 then return end
  local g = self.fsdp.group
  local all = memory.keep(tensor.empty({ g:size() * self.flat:numel() }, { dtype = self.dtype, device = self.device }))
  local _, work = g:all_gather_async(self.flat, all)
  self.gather = { all = all, work = work }
  self.fsdp.stats.prefetches = self.fsdp.stats.prefetches + 1
end

-- A gather started and never used (its block did not run): waited for and
-- released.
function Unit:drop_prefetch()
  local pre = self.gather
  if not pre then return end
  self.gather = nil
  pre.work:wait()
  pre.all:free()
end

-- The full parameters, from every rank's shards (one all-gather; the
-- prefetched one when there is one).
function Unit:unshard()
  if self.unsharded then return end
  if #self.params == 0 then -- (a root with no parameters of its own: opts.only)
    self.unsharded = true
    return
  end
  local g, W, S = self.fsdp.group, self.fsdp.group:size(), self.S
  local pre = self.gather
  self.gather = nil
  if self.S_fp8 > 0 then -- (the ordinary part of the flat buffer only; its stride is S_reg)
    S = self.S_reg
    self:unshard_fp8()
  end
  autograd.no_grad(memory.scope, function()
    local all
    if pre then
      pre.work:wait()
      all = pre.all
    elseif S == 0 then
      all = nil
    else
      all = g:all_gather(S == self.S and self.flat or self.flat:narrow(1, 1, S))
    end
    if all then self.fsdp.stats.gathered_bytes = self.fsdp.stats.gathered_bytes + all:nbytes() end
    for _, e in ipairs(self.params) do
      if e.fp8 then goto next_param end
      e.full:alloc_storage()
      local full2 = e.full:reshape(e.d0, e.rs)
      for r = 0, W - 1 do
        local n = rows_of(e.d0, e.c, r)
        if n > 0 then
          full2:narrow(1, r * e.c + 1, n):copy_(all:narrow(1, r * S + e.off + 1, n * e.rs):reshape(n, e.rs))
        end
      end
      ::next_param::
    end
    if pre then pre.all:free() end
  end)
  self.unsharded = true
  self.fsdp.stats.all_gathers = self.fsdp.stats.all_gathers + 1
end

-- The weights gathered in fp8 (opts.fp8; torchao's FSDP float8 all-gather):
-- each one's scale from the largest magnitude over every rank's shard (one
-- all-reduce of a number per weight, in one tensor), each shard cast with
-- it, and the fp8 bytes gathered (a quarter of f32's, half of bf16's): the
-- same bits as casting the gathered full weight. The full fp8 weights go
-- to opts.fp8.publish(param, w8, scale_inv) for the layers to multiply
-- with (they never cast their weight then); the full parameters stay
-- without memory, and their gradients arrive and are reduced as the others'.
function Unit:unshard_fp8()
  local f = self.fsdp
  local g, W, cb = f.group, f.group:size(), f.fp8
  local list = {}
  for _, e in ipairs(self.params) do
    if e.fp8 then list[#list + 1] = e end
  end
  autograd.no_grad(memory.scope, function()
    local amax = tensor.zeros({ #list }, { dtype = "float32", device = self.device })
    for i, e in ipairs(list) do
      if e.shard then amax:narrow(1, i, 1):copy_(cb.amax(e.shard):reshape(1)) end
    end
    g:all_reduce(amax, "max")
    local packed = tensor.zeros({ math.max(self.S_fp8, 1) }, { dtype = cb.dtype, device = self.device })
    local scales = {}
    for i, e in ipairs(list) do
      local x = e.shard or tensor.empty({ 0 }, { dtype = self.dtype, device = self.device })
      local x8, s = cb.cast(x:reshape(x:numel()), amax:narrow(1, i, 1))
      if e.rows > 0 then packed:narrow(1, e.off8 + 1, e.rows * e.rs):copy_(x8) end
      scales[i] = memory.keep(s)
    end
    local all = g:all_gather(packed)
    f.stats.gathered_bytes = f.stats.gathered_bytes + all:nbytes()
    for i, e in ipairs(list) do
      local w8 = memory.keep(tensor.empty({ e.d0, e.rs }, { dtype = cb.dtype, device = self.device }))
      for r = 0, W - 1 do
        local n = rows_of(e.d0, e.c, r)
        if n > 0 then
          w8:narrow(1, r * e.c + 1, n):copy_(all:narrow(1, r * self.S_fp8 + e.off8 + 1, n * e.rs):reshape(n, e.rs))
        end
      end
      local full = memory.keep(w8:view(e.shape))
      w8:free()
      e.w8, e.s8 = full, scales[i]
      cb.publish(e.full, full, scales[i])
    end
  end)
end

-- The full parameters' memory goes back to the allocator (and a gather
-- on its way, if any); the fp8 ones are released (a layer's backward that
-- kept one keeps it).
function Unit:reshard()
  self:drop_prefetch()
  if not self.unsharded then return end
  for _, e in ipairs(self.params) do
    e.full:free_storage()
    if e.w8 then
      self.fsdp.fp8.publish(e.full, nil)
      e.w8:free(); e.s8:free()
      e.w8, e.s8 = nil, nil
    end
  end
  self.unsharded = false
end

-- The reduced shard -> the shards' .grad (an all-reduce over the replicas
-- first under HSDP).
function Unit:add_reduced(mine, with_grad)
  local f = self.fsdp
  autograd.no_grad(memory.scope, function()
    if f.replicate then f.replicate:all_reduce(mine, "sum") end
    for _, e in ipairs(with_grad) do
      local piece = mine:narrow(1, e.off + 1, e.rows * e.rs):reshape(e.shard:shape())
      if e.shard.grad then e.shard.grad:add_(piece) else e.shard.grad = memory.keep(piece:clone()) end
    end
  end)
end

-- A reduce-scatter started by reduce_grads under overlap: waited for, and
-- its shard added (the backward's final callback).
function Unit:finish_reduce()
  local red = self.reducing
  if not red then return end
  self.reducing = nil
  red.work:wait()
  self:add_reduced(red.mine, red.with_grad)
  red.mine:free()
end

-- Full gradients -> summed shards (one reduce-scatter; an all-reduce over
-- the replicas under HSDP), accumulated into the shards' .grad; the full
-- gradients are freed. Every rank runs the same code, so every rank calls
-- the collective, or none does. Under overlap the reduce-scatter is only
-- started: finish_reduce completes it.
function Unit:reduce_grads()
  self:finish_reduce() -- (a second backward before the final callback: the first one's in order)
  if #self.params == 0 then return end -- (a root with no parameters of its own: opts.only)
  local any = false
  for _, e in ipairs(self.params) do any = any or e.full.grad ~= nil end
  -- (a unit the backward reached reduces even without a gradient here: every
  -- rank's backward reaches it, and another rank may have some (the experts
  -- an expert-parallel rank's tokens all missed); one the backward did not
  -- reach, on no rank, has nothing to reduce)
  if not any and self.phase ~= "backward" then return end
  local f = self.fsdp
  local W, S = f.group:size(), self.S
  autograd.no_grad(memory.scope, function()
    local packed = tensor.zeros({ W * math.max(S, 1) }, { dtype = self.dtype, device = self.device })
    for _, e in ipairs(self.params) do
      local grad = e.full.grad
      if grad then
        local g2 = grad:reshape(e.d0, e.rs)
        for r = 0, W - 1 do
          local n = rows_of(e.d0, e.c, r)
          if n > 0 then
            packed:narrow(1, r * S + e.off + 1, n * e.rs):copy_(g2:narrow(1, r * e.c + 1, n):reshape(n * e.rs))
          end
        end
      end
    end
    -- (every shard gets its reduced rows: a parameter this rank had no
    -- gradient for, a mixture of experts' expert its tokens missed, may
    -- have one from another rank; one no rank had gets zeros)
    local with_grad = {}
    for _, e in ipairs(self.params) do
      if e.shard then with_grad[#with_grad + 1] = e end
    end
    if f.overlap then
      local mine = memory.keep(tensor.empty({ math.max(S, 1) }, { dtype = self.dtype, device = self.device }))
      local _, work = f.group:reduce_scatter_async(packed, "sum", mine)
      self.reducing = { mine = mine, with_grad = with_grad, work = work }
    else
      self:add_reduced(f.group:reduce_scatter(packed, "sum"), with_grad)
    end
  end)
  for _, e in ipairs(self.params) do
    if e.full.grad then
      e.full.grad:free()
      e.full.grad = nil
    end
  end
  f.stats.reduce_scatters = f.stats.reduce_scatters + 1
end

-- After the unit's last backward node: reduce, reshard, done.
function Unit:post_backward()
  self:reduce_grads()
  self:reshard()
  self.phase = "idle"
  self.waiting = 0
end

-- ---- the hooks -------------------------------------------------------------

-- An identity in the tape whose backward first calls on_grad(state): the
-- hooks are nodes of the graph, which run in its order (no C callbacks).
local function hook(name, on_grad)
  return autograd.Function {
    name = name,
    forward = function(ctx, x, state)
      ctx.state = state
      return x:detach()
    end,
    backward = function(ctx, g)
      on_grad(ctx.state)
      return g
    end,
  }
end

-- On a block's outputs: runs before the block's first backward node (its
-- outputs' gradients arrive).
local PreBackward = hook("fsdp_pre_backward", function(u)
  if u.phase ~= "backward" then
    u.phase = "backward"
    u:unshard()
    if u.prev then u.prev:prefetch() end -- the block whose backward comes next
  end
end)

-- On a block's inputs: runs after its last backward node, when every one of
-- its inputs' gradients is complete (a node runs after all the nodes that
-- consume its output).
local PostBackward = hook("fsdp_post_backward", function(u)
  u.waiting = u.waiting - 1
  if u.waiting == 0 and u.phase == "backward" then u:post_backward() end
end)

-- On the root's outputs: their gradients start the backward pass, whose end
-- reduces what is left (the root's gradients; a block none of whose inputs
-- needed a gradient).
local RootBackward = hook("fsdp_root_backward", function(f)
  if f.root.phase ~= "backward" then
    f.root.phase = "backward"
    f.root:unshard()
    if #f.units > 1 then f.units[#f.units - 1]:prefetch() end -- the last block
    autograd.queue_callback(function() f:finish_backward() end)
  end
end)

local function pack(...) return { n = select("#", ...), ... } end

-- A block method run as a unit: unshard, hook the tensors in and out,
-- reshard. Nested calls (forward -> forward_parts) and the recomputation
-- of a checkpointed block inside the backward pass run as they are.
local function unit_method(unit, fn)
  return function(self, ...)
    if unit.busy or unit.phase == "backward" then return fn(self, ...) end
    unit:unshard()
    if unit.next then unit.next:prefetch() end -- gathered while this block computes
    local hooks = autograd.is_enabled()
    local args = pack(...)
    if hooks then
      -- (counted until the backward: a second recorded forward before it
      -- adds its inputs, and the last of them runs after both graphs' nodes)
      for i = 1, args.n do
        local a = args[i]
        if is_tensor(a) and a.requires_grad then
          args[i] = PostBackward(a, unit)
          unit.waiting = unit.waiting + 1
        end
      end
    end
    unit.busy = true
    local ok, res = pcall(function() return pack(fn(self, unpack(args, 1, args.n))) end)
    unit.busy = false
    if not ok then error(res, 0) end
    if hooks then
      for i = 1, res.n do
        local r = res[i]
        if is_tensor(r) and r.requires_grad then res[i] = PreBackward(r, unit) end
      end
    end
    -- Without recording no backward comes: nothing would bring the memory back.
    if unit.reshard_after_forward or not hooks then unit:reshard() end
    return unpack(res, 1, res.n)
  end
end

-- ---- the sharded model -----------------------------------------------------

local FSDP = {}
FSDP.__index = FSDP

-- Every unit the backward pass left unreduced or unsharded, root last;
-- then every reduce-scatter still in flight is waited for and added, and a
-- gather no block used is dropped.
function FSDP:finish_backward()
  for _, u in ipairs(self.units) do
    if u.phase == "backward" or u.unsharded then u:post_backward() end
  end
  for _, u in ipairs(self.units) do
    u:finish_reduce()
    u:drop_prefetch()
  end
end

-- Ordered {name, shard} of the parameters this rank holds rows of: what the
-- optimizer updates and the checkpoint saves.
function FSDP:named_parameters()
  local out = {}
  for _, e in ipairs(self.order) do
    if e.shard then out[#out + 1] = { e.name, e.shard } end
  end
  return out
end

function FSDP:parameters()
  local out = {}
  for i, np in ipairs(self:named_parameters()) do out[i] = np[2] end
  return out
end

-- For the checkpoint: the shards under the parameters' names, and the
-- model's buffers (replicated, whole).
function FSDP:state_model()
  local f = self
  return {
    args = f.model.args, -- (what an HF import checks the folder against)
    state_dict = function()
      local names, tensors = {}, {}
      for _, np in ipairs(f:named_parameters()) do
        names[#names + 1] = np[1]
        tensors[np[1]] = np[2]
      end
      for _, nb in ipairs(f.buffers and f.model:named_buffers() or {}) do
        names[#names + 1] = nb[1]
        tensors[nb[1]] = nb[2]
      end
      return { names = names, tensors = tensors }
    end,
  }
end

-- The shards of the parameters in `set` (a set of full tensors), as a set.
function FSDP:shards_of(set)
  local out = {}
  for _, e in ipairs(self.order) do
    if e.shard and set[e.full] then out[e.shard] = true end
  end
  return out
end

-- x summed over the shard ranks (the gradient norm's squares).
function FSDP:sum_over_shards(x) return self.group:sum_numbers({ x })[1] end

-- Bytes of parameters this rank holds at rest (its shards, padding included).
function FSDP:sharded_bytes()
  local n = 0
  for _, u in ipairs(self.units) do n = n + u.flat:nbytes() end
  return n
end

-- Releases the shards, their gradients and the flat buffers now (the
-- model's own tensors stay the model's: model:free()).
function FSDP:free()
  for _, u in ipairs(self.units) do
    for _, e in ipairs(u.params) do
      if e.shard then
        if e.shard.grad then e.shard.grad:free(); e.shard.grad = nil end
        e.shard:free()
        e.shard = nil
      end
    end
    u.flat:free()
  end
end

-- Several sharded models (a rank's pipeline stages) as one: the same
-- methods over all of them, in order.
function M.combine(list)
  if #list == 1 then return list[1] end
  local c = setmetatable({ parts = list, group = list[1].group }, { __index = FSDP })
  local function concat(method)
    return function()
      local out = {}
      for _, f in ipairs(list) do
        for _, v in ipairs(f[method](f)) do out[#out + 1] = v end
      end
      return out
    end
  end
  c.named_parameters, c.parameters = concat("named_parameters"), concat("parameters")
  function c:state_model()
    local models = {}
    for i, f in ipairs(list) do models[i] = f:state_model() end
    return { args = list[1].model.args, state_dict = function()
      local names, tensors = {}, {}
      for _, m in ipairs(models) do
        local sd = m.state_dict()
        for _, n in ipairs(sd.names) do
          names[#names + 1] = n
          tensors[n] = sd.tensors[n]
        end
      end
      return { names = names, tensors = tensors }
    end }
  end
  function c:shards_of(set)
    local out = {}
    for _, f in ipairs(list) do
      for k in pairs(f:shards_of(set)) do out[k] = true end
    end
    return out
  end
  function c:sharded_bytes()
    local n = 0
    for _, f in ipairs(list) do n = n + f:sharded_bytes() end
    return n
  end
  function c:free() for _, f in ipairs(list) do f:free() end end
  function c.shard_of(name)
    for _, f in ipairs(list) do
      local shape, off = f.shard_of(name)
      if shape then return shape, off end
    end
  end
  return c
end

-- group: the dp_shard ranks. opts.replicate: the dp_replicate group (HSDP)
-- or nil; opts.reshard_after_forward: "default" (every block but the last;
-- never the root), "always" or "never"; opts.overlap: prefetch the gathers
-- and leave the reductions in flight until the backward ends (above). The model's parameters are either
-- materialized and initialized (the same on every rank), or tensors without
-- memory (model:to_empty(device, {params_storage = false})) and
-- opts.init(names) initializes the named ones (a set) the same on every
-- rank, a unit at a time; or opts.init_shard(name, shard, offset) fills
-- each rank's rows alone (offset: the shard's first element in the whole
-- parameter; a counter-based initialization gives the same values), so no
-- rank materializes a full parameter (kept ones excepted). opts.keep: a set of parameters left whole on this
-- rank, neither gathered nor reduced (expert parallelism's experts: each
-- rank holds its own); they are in named_parameters and the checkpoint as
-- whole tensors, and their gradients are the caller's to reduce.
-- opts.skip: a set of parameters this FSDP leaves alone (not listed: another
-- one shards them); opts.only: shard only these (blocks without any get no
-- unit). Expert parallelism with more data-parallel ranks than ep shards
-- the experts over the ranks holding the same ones (TorchTitan's
-- dp_shard_mod_ep) with an FSDP of its own: skip for one, only for the other.
-- opts.buffers = false: state_model() lists the parameters only.
-- opts.fp8 = { params = set, dtype, amax(t), cast(t, amax), publish(param,
-- w8, scale_inv) }: those weights are gathered in fp8 (Unit:unshard_fp8).
function M.apply(model, group, opts)
  opts = opts or {}
  local policy = opts.reshard_after_forward or "default"
  if not M.policies[policy] then
    error(("fsdp: reshard_after_forward = '%s'; expected default, always or never"):format(tostring(policy)), 0)
  end
  local layers = rawget(model, "layers")
  if not layers then error("fsdp: the model has no `layers` (its blocks) to shard one by one", 0) end
  local self = setmetatable({ model = model, group = group, replicate = opts.replicate, units = {}, order = {},
    policy = policy, stats = { all_gathers = 0, reduce_scatters = 0, prefetches = 0, gathered_bytes = 0 },
    init = opts.init,
    init_shard = opts.init_shard, fp8 = opts.fp8,
    overlap = opts.overlap == true, buffers = opts.buffers ~= false }, FSDP)
  local in_block, by_name = {}, {}
  local keep, kept = opts.keep or {}, {}
  local skip, only = opts.skip, opts.only
  local function mine(p) return not (skip and skip[p]) and (not only or only[p]) end
  local names = layers._children
  for i, name in ipairs(names) do
    local block = layers[name]
    local prefix = "layers." .. name .. "."
    local params = {}
    for _, np in ipairs(block:named_parameters()) do
      if keep[np[2]] then
        kept[#kept + 1] = { prefix .. np[1], np[2] }
      elseif mine(np[2]) then
        params[#params + 1] = { prefix .. np[1], np[2] }
      end
      in_block[np[2]] = true
    end
    if not only or #params > 0 then -- (a block with none of the only ones gets no unit)
      local reshard = policy == "always" or (policy == "default" and i < #names)
      local u = new_unit(self, prefix:sub(1, -2), params, reshard)
      local before = self.units[#self.units]
      if before then before.next, u.prev = u, before end
      self.units[#self.units + 1] = u
      for _, e in ipairs(u.params) do by_name[e.name] = e end
      for _, m in ipairs({ "forward", "forward_parts" }) do
        local fn = block[m]
        if type(fn) == "function" then rawset(block, m, unit_method(u, fn)) end
      end
    end
  end
  local rest = {}
  for _, np in ipairs(model:named_parameters()) do
    if not in_block[np[2]] and mine(np[2]) then rest[#rest + 1] = np end
  end
  self.root = new_unit(self, "root", rest, false)
  self.units[#self.units + 1] = self.root
  for _, e in ipairs(self.root.params) do by_name[e.name] = e end
  -- The kept parameters: whole on this rank, materialized here if they were not.
  local fresh = {}
  for _, np in ipairs(kept) do
    by_name[np[1]] = { name = np[1], full = np[2], shard = np[2], kept = true }
    if not np[2]:has_storage() then
      if not self.init then
        error(("fsdp: %s has no memory; expected materialized parameters, or opts.init to initialize them")
          :format(np[1]), 0)
      end
      np[2]:alloc_storage()
      fresh[np[1]] = true
    end
  end
  if next(fresh) then self.init(fresh) end
  for _, np in ipairs(model:named_parameters()) do self.order[#self.order + 1] = by_name[np[1]] end -- (nil: not ours)
  -- The root: unshard when the model's forward starts; the backward pass's
  -- first node arms the final callback.
  local forward, f = model.forward, self
  rawset(model, "forward", function(m, ...)
    f.root:unshard()
    if #f.units > 1 then f.units[1]:prefetch() end -- the first block's, during the embedding
    local hooks = autograd.is_enabled()
    local res = pack(forward(m, ...))
    for i = 1, res.n do
      local r = res[i]
      if hooks and is_tensor(r) and r.requires_grad then res[i] = RootBackward(r, f) end
    end
    if not hooks then
      for _, u in ipairs(f.units) do u:reshard() end
    end
    return unpack(res, 1, res.n)
  end)
  -- The checkpoint's boxes: a shard is rows [row0, row0 + rows) of its parameter.
  function self.shard_of(name)
    local e = by_name[name]
    if not e or e.kept then return nil end
    local off = { e.row0 }
    for d = 2, #e.shape do off[d] = 0 end
    return e.shape, off
  end
  return self
end

-- The banner's line (lua/parallel/describe.lua): par, the job laid out.
function M.describe(par)
  local d, say = par.dims, require("parallel.describe")
  local rep = d.dp_replicate > 1 and (" x %d replicas (HSDP: shard gradients then summed over the replicas)")
    :format(d.dp_replicate) or ""
  return ("data parallel over %s: %d ranks, FSDP over %d shards%s: each rank keeps %s of the parameters (and "
    .. "that share of gradients and optimizer state), a block's full parameters only while it runs (reshard "
    .. "after forward: %s)%s%s; tps and MFU are per rank"):format(say.over(par), d.dp_size, d.dp_shard * d.cp, rep,
    ("%.1f MiB"):format(par.fsdp:sharded_bytes() / 2 ^ 20), par.cfg.parallelism.fsdp_reshard_after_forward,
    par.fsdp_overlap and ("; on the communication stream, the next block's parameters gathered while one "
      .. "computes and each block's gradients reduced during the backward") or "", say.each(par))
end

return M
