-- pp.lua — pipeline parallelism: the model's blocks split into stages held
-- by different ranks, and the schedules that run micro-batches through
-- them (TorchTitan's pipelining: GPipe, 1F1B, Interleaved1F1B).
--
--   local layout = pp.layout(n_layers, { pp = P, schedule = "1F1B", layers_per_stage = -1 })
--   local stages = pp.split(build, plan, layout, rank)   -- this rank's stages, each a pruned model
--   local pipe = pp.pipeline(stages, group, layout, { dim = hidden_size })
--   local loss_sum = pipe:step(microbatches, loss_fn, ctx)   -- forward + backward of every micro-batch
--
-- A stage is a copy of the model built on meta and pruned to its blocks
-- (the first stage keeps the embedding, the last the final norm and the
-- output: the model family's `pp_plan`). Parameter names stay the whole
-- model's ("layers.5.attention.wq.weight"), so the name-keyed
-- initialization gives every layout the same weights and a checkpoint of
-- one layout loads onto any other.
--
-- A schedule is a list of actions per rank: { op = "F" | "B", stage = s,
-- mb = m } (0-based stage ids and micro-batches). Communication follows from
-- it: a forward on stage s > 0 receives its input from stage s - 1, one
-- before the last sends its output on; a backward receives the output's
-- gradient from stage s + 1 and sends its input's gradient back. Sends do
-- not wait (isend) and receives do, so a schedule runs when every receive
-- is eventually matched: M.check proves that by running all ranks' lists
-- against each other before the first step, so a schedule that would hang
-- is one line at start-up, not a job that never moves.
local titan = require("titan")
local memory = require("titan.memory")
local nn = titan.nn

local M = {}

-- name -> { stages per rank by default, build(rank, P, V, M) -> actions }
M.schedules = {}

local function F(stage, mb) return { op = "F", stage = stage, mb = mb } end
local function B(stage, mb) return { op = "B", stage = stage, mb = mb } end

-- GPipe: every forward, then every backward (most activation memory: all
-- M micro-batches' at once). With several stages per rank, stage by stage.
M.schedules.GPipe = { per_rank = 1, build = function(r, P, V, nmb)
  local out = {}
  for v = 0, V - 1 do
    for m = 0, nmb - 1 do out[#out + 1] = F(r + v * P, m) end
  end
  for v = V - 1, 0, -1 do
    for m = 0, nmb - 1 do out[#out + 1] = B(r + v * P, m) end
  end
  return out
end }

-- 1F1B (PipeDream-flush): stage r runs P - 1 - r warm-up forwards, then
-- alternates one forward and one backward, then drains the backwards; at
-- most P - r micro-batches' activations are alive at once.
M.schedules["1F1B"] = { per_rank = 1, build = function(r, P, V, nmb)
  assert(V == 1, "1F1B: one stage per rank")
  local out = {}
  local warm = math.min(P - 1 - r, nmb)
  for m = 0, warm - 1 do out[#out + 1] = F(r, m) end
  for i = 0, nmb - warm - 1 do
    out[#out + 1] = F(r, warm + i)
    out[#out + 1] = B(r, i)
  end
  for m = nmb - warm, nmb - 1 do out[#out + 1] = B(r, m) end
  return out
end }

-- Interleaved 1F1B (Megatron-LM's virtual pipeline): each rank holds V
-- stages, looping (rank r holds stages r, r + P, ...). The k-th forward of a
-- rank runs its stage (k // P) % V on micro-batch (k // (P V)) P + k % P, so
-- micro-batches go round in groups of P; backwards mirror it from the last
-- stage. Warm-up is 2 (P - 1 - r) + (V - 1) P forwards. The bubble shrinks
-- V-fold against 1F1B. Needs M a multiple of P.
M.schedules.Interleaved1F1B = { per_rank = 2, build = function(r, P, V, nmb)
  local total = nmb * V
  local function at(k, backward)
    local chunk = math.floor(k / P) % V
    if backward then chunk = V - 1 - chunk end
    return r + chunk * P, math.floor(k / (P * V)) * P + k % P
  end
  local out = {}
  local warm = math.min((P - 1 - r) * 2 + (V - 1) * P, total)
  for k = 0, warm - 1 do out[#out + 1] = F(at(k)) end
  for i = 0, total - warm - 1 do
    out[#out + 1] = F(at(warm + i))
    out[#out + 1] = B(at(i, true))
  end
  for k = total - warm, total - 1 do out[#out + 1] = B(at(k, true)) end
  return out
end }

local function fail(fmt, ...) error("pp: " .. fmt:format(...), 0) end

local function names()
  local out = {}
  for k in pairs(M.schedules) do out[#out + 1] = k end
  table.sort(out)
  return table.concat(out, ", ")
end

-- The stages and who holds them. opts: pp (ranks), schedule (name),
-- layers_per_stage (-1: the schedule's stages per rank), n_microbatches.
-- Returns { P, V (stages per rank), S (stages), ranges = { [s] = {lo, hi} }
-- (0-based blocks lo..hi-1), schedule }.
function M.layout(n_layers, opts)
  local P = opts.pp
  local sched = M.schedules[opts.schedule]
  if not sched then
    fail("parallelism.pipeline_parallel_schedule = %s; expected one of %s", tostring(opts.schedule), names())
  end
  local S
  local lps = opts.layers_per_stage or -1
  if lps and lps > 0 then
    if n_layers % lps ~= 0 or (n_layers / lps) % P ~= 0 then
      fail("parallelism.pipeline_parallel_layers_per_stage = %d makes %s stages of the model's %d blocks; expected "
        .. "a whole number of stages that is a multiple of parallelism.pp = %d", lps, tostring(n_layers / lps),
        n_layers, P)
    end
    S = n_layers / lps
  else
    S = P * sched.per_rank
  end
  local V = S / P
  if V > 1 and sched.per_rank == 1 and opts.schedule ~= "GPipe" then
    fail("the %s schedule runs one stage per rank, but pipeline_parallel_layers_per_stage makes %d per rank; "
      .. "expected Interleaved1F1B or GPipe for several", opts.schedule, V)
  end
  if S > n_layers then
    fail("parallelism.pp = %d with %d stage(s) per rank makes %d stages, more than the model's %d blocks",
      P, V, S, n_layers)
  end
  local ranges = {}
  for s = 0, S - 1 do
    -- balanced: the stages differ by at most one block
    ranges[s] = { math.floor(s * n_layers / S), math.floor((s + 1) * n_layers / S) }
  end
  return { P = P, V = V, S = S, ranges = ranges, schedule = opts.schedule }
end

-- The stages rank r holds (looping: r, r + P, ...).
function M.stage_ids(layout, r)
  local out = {}
  for v = 0, layout.V - 1 do out[#out + 1] = r + v * layout.P end
  return out
end

-- This rank's stages: build() gives a fresh model on meta each time; each
-- is pruned to one stage's blocks (and the plan's first / last modules).
-- Returns a list of { id, model, first, last, lo, hi }.
function M.split(build, plan, layout, r)
  local out = {}
  for _, s in ipairs(M.stage_ids(layout, r)) do
    local model = build()
    local lo, hi = layout.ranges[s][1], layout.ranges[s][2]
    local layers = model[plan.layers]
    for _, nl in ipairs(layers:named_children()) do
      local i = tonumber(nl[1])
      if i < lo or i >= hi then layers:remove(nl[1]) end
    end
    local first, last = s == 0, s == layout.S - 1
    if not first then for _, name in ipairs(plan.first) do model:remove(name) end end
    if not last then for _, name in ipairs(plan.last) do model:remove(name) end end
    out[#out + 1] = { id = s, model = model, first = first, last = last, lo = lo, hi = hi }
  end
  return out
end

-- Every rank's actions for P ranks, V stages each, nmb micro-batches.
function M.actions(layout, nmb)
  local sched = M.schedules[layout.schedule]
  local all = {}
  for r = 0, layout.P - 1 do all[r] = sched.build(r, layout.P, layout.V, nmb) end
  return all
end

-- Run every rank's list against the others (sends never wait, a receive
-- waits for its message, messages of one kind into one stage come in
-- micro-batch order) and check that all of it runs: each forward and
-- backward of every stage and micro-batch exactly once, a backward after
-- its forward. Returns nil, or a line saying what would go wrong.
-- nccl: also as the batches of Pipeline:step run on NCCL (M.check_nccl).
function M.check(layout, all, nmb, nccl)
  local P, S = layout.P, layout.S
  local owner = function(s) return s % P end
  local sent = {} -- [tag] = list of micro-batches sent, in order; tag "F:s" = into stage s
  local taken = {}
  local pos, done = {}, {}
  for r = 0, P - 1 do pos[r] = 1 end
  local function ready(tag, mb)
    local q, k = sent[tag] or {}, (taken[tag] or 0) + 1
    if q[k] == nil then return false end
    if q[k] ~= mb then return nil, ("%s: micro-batch %d arrives where %d is expected"):format(tag, q[k], mb) end
    return true
  end
  local function push(tag, mb)
    sent[tag] = sent[tag] or {}
    sent[tag][#sent[tag] + 1] = mb
  end
  local left = 0
  for r = 0, P - 1 do left = left + #all[r] end
  while left > 0 do
    local moved = false
    for r = 0, P - 1 do
      local a = all[r][pos[r]]
      while a do
        if owner(a.stage) ~= r then
          return ("rank %d runs stage %d, which rank %d holds"):format(r, a.stage, owner(a.stage))
        end
        local key = a.op .. a.stage .. ":" .. a.mb
        if done[key] then return ("rank %d runs %s of stage %d micro-batch %d twice"):format(r, a.op, a.stage, a.mb) end
        local tag
        if a.op == "F" then
          tag = a.stage > 0 and ("F:" .. a.stage) or nil
        else
          if not done["F" .. a.stage .. ":" .. a.mb] then
            return ("rank %d runs the backward of stage %d micro-batch %d before its forward"):format(r, a.stage, a.mb)
          end
          tag = a.stage < S - 1 and ("B:" .. a.stage) or nil
        end
        if tag then
          local ok, why = ready(tag, a.mb)
          if ok == nil then return why end
          if not ok then break end
          taken[tag] = (taken[tag] or 0) + 1
        end
        done[key] = true
        if a.op == "F" and a.stage < S - 1 then push("F:" .. (a.stage + 1), a.mb) end
        if a.op == "B" and a.stage > 0 then push("B:" .. (a.stage - 1), a.mb) end
        pos[r], left, moved = pos[r] + 1, left - 1, true
        a = all[r][pos[r]]
      end
    end
    if not moved then
      local at = {}
      for r = 0, P - 1 do
        local a = all[r][pos[r]]
        if a then at[#at + 1] = ("rank %d at %s%d:%d"):format(r, a.op, a.stage, a.mb) end
      end
      return "the schedule would hang: " .. table.concat(at, ", ")
    end
  end
  for s = 0, S - 1 do
    for m = 0, nmb - 1 do
      if not (done["F" .. s .. ":" .. m] and done["B" .. s .. ":" .. m]) then
        return ("stage %d micro-batch %d is never run both ways"):format(s, m)
      end
    end
  end
  if nccl then return M.check_nccl(layout, all) end
end

-- The same lists run as Pipeline:step runs them on NCCL: a rank's sends
-- wait until its next receive and are posted with it as one batch (the
-- rest at the end), and a batch completes only when each of its operations
-- has met its partner, the sends too; a receive meets the first message
-- not yet taken that its sender posted to it (NCCL matches a pair of ranks'
-- messages in order, not by tag). Returns nil, or a line saying what would
-- go wrong. (A check that passes on MPI, whose sends never wait, may not
-- pass here: a rank blocked on its batch waits for its sends' receivers.)
function M.check_nccl(layout, all)
  local P, S = layout.P, layout.S
  local owner = function(s) return s % P end
  local posted = {} -- [from .. ">" .. to] = { sends = {op...}, recvs = {op...} } in the order posted
  local function pair(from, to)
    local k = from .. ">" .. to
    posted[k] = posted[k] or { sends = {}, recvs = {} }
    return posted[k]
  end
  -- op: { send = bool, peer, tag, mb, index in its pair's list }
  local function post(r, op)
    local q = op.send and pair(r, op.peer) or pair(op.peer, r)
    local list = op.send and q.sends or q.recvs
    list[#list + 1] = op
    op.q, op.k, op.rank = q, #list, r
  end
  local function met(op)
    local other = (op.send and op.q.recvs or op.q.sends)[op.k]
    if not other then return false end
    local s, rv = op.send and op or other, op.send and other or op
    if s.tag ~= rv.tag or s.mb ~= rv.mb then
      return nil, ("rank %d's receive of %s micro-batch %d from rank %d would take %s micro-batch %d (NCCL matches a "
        .. "pair's messages in the order sent)"):format(rv.rank, rv.tag, rv.mb, s.rank, s.tag, s.mb)
    end
    return true
  end
  local pos, pending, batch, finished, got = {}, {}, {}, {}, {}
  for r = 0, P - 1 do pos[r], pending[r] = 1, {} end
  local function issue(r, recv)
    local ops = pending[r]
    pending[r] = {}
    if recv then ops[#ops + 1] = recv end
    for _, op in ipairs(ops) do post(r, op) end
    batch[r] = ops
  end
  local left = P
  while left > 0 do
    local moved = false
    for r = 0, P - 1 do
      while not finished[r] do
        if batch[r] then
          for _, op in ipairs(batch[r]) do
            local ok, why = met(op)
            if ok == nil then return why end
            if not ok then goto blocked end
          end
          batch[r], moved = nil, true
          if pos[r] > #all[r] then finished[r], left = true, left - 1 end
        end
        local a = all[r][pos[r]]
        if not a then
          if #pending[r] > 0 then issue(r) else finished[r], left, moved = true, left - 1, true end
        else
          local wants = a.op == "F" and a.stage > 0 or a.op == "B" and a.stage < S - 1
          local tag = a.op == "F" and "F:" .. a.stage or "B:" .. a.stage
          if wants and not got[r] then
            got[r] = true -- (the action runs once its batch completes)
            issue(r, { send = false, peer = owner(a.op == "F" and a.stage - 1 or a.stage + 1), tag = tag, mb = a.mb })
          else
            got[r] = nil
            if a.op == "F" and a.stage < S - 1 then
              local p = pending[r]
              p[#p + 1] = { send = true, peer = owner(a.stage + 1), tag = "F:" .. (a.stage + 1), mb = a.mb }
            elseif a.op == "B" and a.stage > 0 then
              local p = pending[r]
              p[#p + 1] = { send = true, peer = owner(a.stage - 1), tag = "B:" .. (a.stage - 1), mb = a.mb }
            end
            pos[r], moved = pos[r] + 1, true
          end
        end
      end
      ::blocked::
    end
    if not moved then
      local at = {}
      for r = 0, P - 1 do
        local a = all[r][pos[r]]
        if not finished[r] then
          at[#at + 1] = a and ("rank %d at %s%d:%d"):format(r, a.op, a.stage, a.mb)
            or ("rank %d at its last sends"):format(r)
        end
      end
      return "the schedule would hang on NCCL (a batch waits for its sends' receivers): " .. table.concat(at, ", ")
    end
  end
end

-- ---- the module a rank's stages make ------------------------------------------
-- One module whose parameters are those of every stage this rank holds,
-- under the whole model's names (no prefix): what the optimizer, the
-- gradient clipping and the checkpoint see.
local Stages = nn.Module:extend("PipelineStages")
function Stages:init(stages)
  self._stages = stages
  self.args = stages[1].model.args
end
for _, method in ipairs({ "named_parameters", "named_buffers", "named_modules" }) do
  Stages[method] = function(self, prefix, out)
    out = out or {}
    for _, st in ipairs(self._stages) do st.model[method](st.model, prefix, out) end
    return out
  end
end
function Stages:forward() error("pp: a pipeline's stages run through Pipeline:step, not as one model", 2) end
M.Stages = Stages

-- ---- running a schedule --------------------------------------------------------

local Pipeline = {}
Pipeline.__index = Pipeline
M.Pipeline = Pipeline

-- stages: this rank's (M.split); group: the pp group (rank = pp rank);
-- opts.dim: the hidden size (what crosses a stage boundary); opts.seq_shards:
-- into how many chunks the sequence is split there (tensor parallelism's
-- sequence parallelism: each rank sends its chunk).
function M.pipeline(stages, group, layout, opts)
  local by_id = {}
  for _, st in ipairs(stages) do by_id[st.id] = st end
  return setmetatable({ stages = stages, by_id = by_id, group = group, layout = layout, dim = opts.dim,
    seq_shards = opts.seq_shards or 1, rank = group:rank(), cache = {}, batched = group:backend() == "nccl",
    pending = {} }, Pipeline)
end

-- Sends and receives. On mpi a send is an isend (its work in `works`). On
-- nccl a lone send waits for its receiver and neighbours send to each other
-- at once, so there a rank's sends wait, holding their tensors, for its next
-- receive and go with it as one batch (batch_p2p): a send is held back over
-- this rank's own computation only, which waits for nobody, so no rank waits
-- for anything it would not have waited for anyway. flush() sends what is left.
function Pipeline:send(t, peer, tag, works)
  if self.batched then
    -- (a handle of its own, kept from the scope that made it: freed once sent)
    self.pending[#self.pending + 1] = { "send", memory.keep(t:detach()), peer, tag }
  else
    works[#works + 1] = self.group:isend(t, peer, tag)
  end
end

function Pipeline:recv(buf, peer, tag)
  if not self.batched then return self.group:recv(buf, peer, tag) end
  self:flush({ "recv", buf, peer, tag })
  return buf
end

function Pipeline:flush(recv)
  local ops = self.pending
  self.pending = {}
  if recv then ops[#ops + 1] = recv end
  if #ops == 0 then return end
  self.group:batch_p2p(ops)
  for _, o in ipairs(ops) do
    if o[1] == "send" then o[2]:free() end
  end
end

-- This rank's actions for nmb micro-batches (checked once per count).
function Pipeline:actions(nmb)
  local a = self.cache[nmb]
  if not a then
    local all = M.actions(self.layout, nmb)
    local why = M.check(self.layout, all, nmb, self.batched)
    if why then fail("the %s schedule with %d micro-batches: %s", self.layout.schedule, nmb, why) end
    a = all[self.rank]
    self.cache[nmb] = a
  end
  return a
end

-- The tags of the two flows into stage s: activations, gradients.
function Pipeline:tag_f(s) return s end
function Pipeline:tag_b(s) return self.layout.S + s end

function Pipeline:boundary(mb, dtype, device)
  return titan.empty({ mb.inputs:size(1), mb.inputs:size(2) / self.seq_shards, self.dim },
    { dtype = dtype, device = device })
end

-- Forward and backward of every micro-batch (a list of { inputs, targets }
-- that every rank has) through this rank's stages, in the schedule's order.
-- The last stage computes loss_fn(logits, targets, ctx) per micro-batch and
-- backpropagates it; the losses are summed there (0 on the other ranks).
-- Gradients accumulate in the parameters' .grad.
function Pipeline:step(mbs, loss_fn, ctx)
  local P = self.layout.P
  local actions = self:actions(#mbs)
  local w = self.stages[1].model:parameters()[1]
  local dtype, device = w:dtype(), w:device()
  local ins, outs, works = {}, {}, {}
  local loss_sum = 0
  local function owner(s) return s % P end
  titan.scope(function()
    for _, a in ipairs(actions) do
      local st, mb, key = self.by_id[a.stage], mbs[a.mb + 1], a.stage .. ":" .. a.mb
      if a.op == "F" then
        local x = mb.inputs
        if not st.first then
          x = self:recv(self:boundary(mb, dtype, device), owner(a.stage - 1), self:tag_f(a.stage))
          x.requires_grad = true
          ins[key] = x
        end
        local out = titan.scope(function()
          local y = st.model(x)
          if st.last then y = loss_fn(y, mb.targets, ctx) end
          return y
        end)
        if st.last then
          loss_sum = loss_sum + out:item()
        else
          self:send(out, owner(a.stage + 1), self:tag_f(a.stage + 1), works)
        end
        outs[key] = out
      else
        local out = outs[key]
        outs[key] = nil
        titan.scope(function()
          if st.last then
            out:backward()
          else
            local g = self:recv(self:boundary(mb, dtype, device), owner(a.stage + 1), self:tag_b(a.stage))
            out:backward(g)
          end
        end)
        out:free()
        local x = ins[key]
        if x then
          ins[key] = nil
          self:send(x.grad, owner(a.stage - 1), self:tag_b(a.stage - 1), works)
          x:free() -- (and its .grad: the send holds its own reference)
        end
      end
    end
    self:flush()
    for _, wk in ipairs(works) do wk:wait() end
  end)
  return loss_sum
end

-- A forward without gradients of every micro-batch (validation): the last
-- stage calls f(logits, targets) for each.
function Pipeline:forward_only(mbs, f)
  local P = self.layout.P
  local w = self.stages[1].model:parameters()[1]
  local dtype, device = w:dtype(), w:device()
  titan.no_grad(function()
    titan.scope(function()
      local works = {}
      -- stage by stage of this rank, micro-batch by micro-batch: the order
      -- every rank agrees on without a schedule (a forward never waits on a
      -- later stage)
      for _, st in ipairs(self.stages) do
        for _, mb in ipairs(mbs) do
          titan.scope(function()
            local x = mb.inputs
            if not st.first then
              x = self:recv(self:boundary(mb, dtype, device), (st.id - 1) % P, self:tag_f(st.id))
            end
            local y = st.model(x)
            if st.last then
              f(y, mb.targets)
            else
              self:send(y, (st.id + 1) % P, self:tag_f(st.id + 1), works)
            end
            if x ~= mb.inputs then x:free() end
            y:free()
          end)
        end
      end
      self:flush()
      for _, wk in ipairs(works) do wk:wait() end
    end)
  end)
end

return M
