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
-- is one line at start-up, not a job that never moves. On NCCL, whose
-- sends wait for their receivers, the lists run in steps every rank counts
-- alike (M.steps), each message sent and received in one step.
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
-- nccl: also in the steps Pipeline:step runs on NCCL (M.steps).
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
  if nccl then return M.check_steps(layout, M.steps(layout, all)) end
end

-- The message an action sends (nil for none): { to = rank, stage = s (the
-- stage it goes into), op = "F" | "B", mb }, and the one it receives.
local function outgoing(layout, a)
  if a.op == "F" and a.stage < layout.S - 1 then return { to = (a.stage + 1) % layout.P, stage = a.stage + 1 } end
  if a.op == "B" and a.stage > 0 then return { to = (a.stage - 1) % layout.P, stage = a.stage - 1 } end
end
local function incoming(layout, a)
  if a.op == "F" and a.stage > 0 then return (a.stage - 1) % layout.P end
  if a.op == "B" and a.stage < layout.S - 1 then return (a.stage + 1) % layout.P end
end

-- The lists in steps that every rank counts alike, as Pipeline:step runs
-- them on NCCL (PyTorch's multi-stage schedules do the same). NCCL's sends
-- wait for their receivers and a pair of ranks' messages match in the order
-- sent, so each message is sent and received in the same step: an action
-- runs at the first step after this rank's previous action and after the
-- step its input was sent in; after it, the rank posts one batch with the
-- message it sends (at most one) and the receives of the messages its
-- neighbours send in that step (at most one from each), long before it may
-- need them. A batch of step t completes once every rank has posted its
-- batch of step t, and a rank posts that after its action of step t, whose
-- input came in a batch of an earlier step: so, by induction on t, every
-- batch completes and no schedule that runs at all (M.check) hangs.
-- Returns [r] = list of { t, action (or nil), send = { to, tag, mb } or nil,
-- recvs = list of { from, tag, mb } }, in step order; tags are "F:s" / "B:s"
-- (into stage s), as in M.check.
function M.steps(layout, all)
  local P = layout.P
  local sent_at, last, pos, at = {}, {}, {}, {}
  for r = 0, P - 1 do last[r], pos[r], at[r] = -1, 1, {} end
  local function step_of(r, t)
    local st = at[r][t]
    if not st then
      st = { t = t, recvs = {} }
      at[r][t] = st
    end
    return st
  end
  local left = 0
  for r = 0, P - 1 do left = left + #all[r] end
  while left > 0 do
    local moved = false
    for r = 0, P - 1 do
      local a = all[r][pos[r]]
      while a do
        local t = last[r] + 1
        if incoming(layout, a) then
          local s = sent_at[a.op .. ":" .. a.stage .. ":" .. a.mb]
          if not s then break end
          t = math.max(t, s + 1)
        end
        step_of(r, t).action = a
        local out = outgoing(layout, a)
        if out then
          local tag = a.op .. ":" .. out.stage
          sent_at[tag .. ":" .. a.mb] = t
          step_of(r, t).send = { to = out.to, tag = tag, mb = a.mb }
          local rv = step_of(out.to, t).recvs
          rv[#rv + 1] = { from = r, tag = tag, mb = a.mb }
        end
        last[r], pos[r], left, moved = t, pos[r] + 1, left - 1, true
        a = all[r][pos[r]]
      end
    end
    if not moved then return nil end -- (M.check says where)
  end
  local out = {}
  for r = 0, P - 1 do
    local list = {}
    for _, st in pairs(at[r]) do list[#list + 1] = st end
    table.sort(list, function(x, y) return x.t < y.t end)
    out[r] = list
  end
  return out
end

-- What the induction in M.steps rests on, checked on its result: every
-- receive meets a send of the same step, pair, tag and micro-batch and the
-- other way round, no pair of ranks exchanges two messages one way in a
-- step (they would match in the order posted), and an action's input came
-- in an earlier step. Returns nil, or a line saying what would go wrong.
function M.check_steps(layout, steps)
  if not steps then return "the schedule would hang" end
  local P = layout.P
  local sends, recvs, got = {}, {}, {}
  for r = 0, P - 1 do
    for _, st in ipairs(steps[r]) do
      if st.send then
        local k = st.t .. ":" .. r .. ">" .. st.send.to
        if sends[k] then return ("rank %d sends rank %d two messages in step %d"):format(r, st.send.to, st.t) end
        sends[k] = st.send.tag .. ":" .. st.send.mb
      end
      for _, rv in ipairs(st.recvs) do
        local k = st.t .. ":" .. rv.from .. ">" .. r
        if recvs[k] then return ("rank %d takes two messages from rank %d in step %d"):format(r, rv.from, st.t) end
        recvs[k] = rv.tag .. ":" .. rv.mb
        got[r .. ":" .. rv.tag .. ":" .. rv.mb] = st.t
      end
    end
  end
  for k, v in pairs(sends) do
    if recvs[k] ~= v then return ("step %s: %s is sent and %s received"):format(k, v, tostring(recvs[k])) end
  end
  for k, v in pairs(recvs) do
    if sends[k] ~= v then return ("step %s: %s is received and never sent"):format(k, v) end
  end
  for r = 0, P - 1 do
    for _, st in ipairs(steps[r]) do
      local a = st.action
      if a and incoming(layout, a) then
        local t = got[r .. ":" .. a.op .. ":" .. a.stage .. ":" .. a.mb]
        if not t or t >= st.t then
          return ("rank %d runs %s%d:%d in step %d before its input is there"):format(r, a.op, a.stage, a.mb, st.t)
        end
      end
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

-- Sends and receives. On mpi a send is an isend (its work in `works`) and
-- a receive waits for its message. On nccl the lists run in steps
-- (M.steps): a send waits, holding its tensor, for the end of its step, and
-- goes in the step's batch with the receives of what the neighbours send in
-- that step (batch_p2p_async); an action takes its input from those (take),
-- waiting for the batch then.
function Pipeline:send(t, peer, tag, works)
  if self.batched then
    -- (a handle of its own, kept from the scope that made it: freed once posted)
    self.pending[#self.pending + 1] = { "send", memory.keep(t:detach()), peer, tag }
  else
    works[#works + 1] = self.group:isend(t, peer, tag)
  end
end

-- The batch of step st (nccl): the held send, and a buffer for each
-- message coming in, kept in self.inbox under its tag and micro-batch with
-- the batch's place in self.posted.
function Pipeline:post(st, mbs, dtype, device)
  local ops = self.pending
  self.pending = {}
  for _, rv in ipairs(st.recvs) do
    local buf = self:boundary(mbs[rv.mb + 1], dtype, device)
    ops[#ops + 1] = { "recv", buf, rv.from, self:tag_of(rv.tag) }
    self.inbox[rv.tag .. ":" .. rv.mb] = { buf = buf, batch = self.nposted + 1 }
  end
  if #ops == 0 then return end
  -- (counted: waited batches leave holes at the front of self.posted, where # is no count)
  self.nposted = self.nposted + 1
  self.posted[self.nposted] = self.group:batch_p2p_async(ops)
  for _, o in ipairs(ops) do
    if o[1] == "send" then o[2]:free() end -- (the work holds it)
  end
end

-- Waits for the batches up to the k-th (all of them without k): later
-- kernels wait for them. The communication stream runs the batches in
-- order, so the earlier ones are done when the k-th is: waiting for them
-- costs nothing and frees the tensors they sent.
function Pipeline:wait_posted(k)
  for i = self.waited + 1, k or self.nposted do
    self.posted[i]:wait()
    self.posted[i] = nil
    self.waited = i
  end
end

-- The message tagged tag ("F:s" / "B:s") for micro-batch mb (0-based),
-- received in an earlier step (nccl).
function Pipeline:take(tag, mb)
  local key = tag .. ":" .. mb
  local e = self.inbox[key]
  self.inbox[key] = nil
  self:wait_posted(e.batch)
  return e.buf
end

-- This rank's actions for nmb micro-batches (checked once per count), and
-- on nccl its steps.
function Pipeline:actions(nmb)
  local a = self.cache[nmb]
  if not a then
    local all = M.actions(self.layout, nmb)
    local why = M.check(self.layout, all, nmb, self.batched)
    if why then fail("the %s schedule with %d micro-batches: %s", self.layout.schedule, nmb, why) end
    a = { list = all[self.rank], steps = self.batched and M.steps(self.layout, all)[self.rank] or nil }
    self.cache[nmb] = a
  end
  return a
end

-- The forward-only lists (validation): stage by stage of each rank, micro-
-- batch by micro-batch, an order every rank agrees on without a schedule (a
-- forward never waits on a later stage); on nccl in steps too, as
-- Pipeline:step's (sends held until the rank's next receive could hang
-- there: a rank's first stage sends every micro-batch before its second
-- stage receives).
function Pipeline:forward_actions(nmb)
  local key = "forward:" .. nmb
  local a = self.cache[key]
  if not a then
    local all = {}
    for r = 0, self.layout.P - 1 do
      local list = {}
      for _, s in ipairs(M.stage_ids(self.layout, r)) do
        for m = 0, nmb - 1 do list[#list + 1] = { op = "F", stage = s, mb = m } end
      end
      all[r] = list
    end
    local steps = self.batched and M.steps(self.layout, all) or nil
    local why = self.batched and M.check_steps(self.layout, steps)
    if why then fail("the forward-only pass with %d micro-batches: %s", nmb, why) end
    a = { list = all[self.rank], steps = steps and steps[self.rank] }
    self.cache[key] = a
  end
  return a
end

-- The tags of the two flows into stage s: activations, gradients.
function Pipeline:tag_f(s) return s end
function Pipeline:tag_b(s) return self.layout.S + s end
function Pipeline:tag_of(name)
  local op, s = name:match("^(%u):(%d+)$")
  return op == "F" and self:tag_f(tonumber(s)) or self:tag_b(tonumber(s))
end

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
  local sched = self:actions(#mbs)
  local w = self.stages[1].model:parameters()[1]
  local dtype, device = w:dtype(), w:device()
  local ins, outs = {}, {}
  local loss_sum = 0
  local function owner(s) return s % P end
  -- an input from stage `from`'s rank: received now (mpi) or taken from an earlier step's batch (nccl)
  local function input(a, mb, from, tag)
    if self.batched then return self:take(a.op .. ":" .. a.stage, a.mb) end
    return self.group:recv(self:boundary(mb, dtype, device), owner(from), tag)
  end
  local function run(a, works)
    local st, mb, key = self.by_id[a.stage], mbs[a.mb + 1], a.stage .. ":" .. a.mb
    if a.op == "F" then
      local x = mb.inputs
      if not st.first then
        x = input(a, mb, a.stage - 1, self:tag_f(a.stage))
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
      local out, g = outs[key], nil
      outs[key] = nil
      titan.scope(function()
        if st.last then
          out:backward()
        else
          g = input(a, mb, a.stage + 1, self:tag_b(a.stage))
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
      -- (after the send: x.grad may be g itself, passed through by an add's backward)
      if g then g:free() end
    end
  end
  titan.scope(function() self:run_actions(sched, mbs, dtype, device, run) end)
  return loss_sum
end

-- run(action, works) for each of this rank's actions (sched: Pipeline:actions'
-- or forward_actions'): on nccl step by step, each step's batch posted after
-- its action, every batch waited for at the end; on mpi in the list's order,
-- then the sends' works.
function Pipeline:run_actions(sched, mbs, dtype, device, run)
  local works = {}
  if self.batched then
    self.inbox, self.posted, self.nposted, self.waited = {}, {}, 0, 0
    for _, st in ipairs(sched.steps) do
      if st.action then run(st.action, works) end
      self:post(st, mbs, dtype, device)
    end
    self:wait_posted()
  else
    for _, a in ipairs(sched.list) do run(a, works) end
    for _, wk in ipairs(works) do wk:wait() end
  end
end

-- A forward without gradients of every micro-batch (validation): the last
-- stage calls f(logits, targets) for each.
function Pipeline:forward_only(mbs, f)
  local P = self.layout.P
  local w = self.stages[1].model:parameters()[1]
  local dtype, device = w:dtype(), w:device()
  local function run(a, works)
    local st, mb = self.by_id[a.stage], mbs[a.mb + 1]
    titan.scope(function()
      local x = mb.inputs
      if not st.first then
        x = self.batched and self:take("F:" .. a.stage, a.mb)
          or self.group:recv(self:boundary(mb, dtype, device), (a.stage - 1) % P, self:tag_f(a.stage))
      end
      local y = st.model(x)
      if st.last then
        f(y, mb.targets)
      else
        self:send(y, (a.stage + 1) % P, self:tag_f(a.stage + 1), works)
      end
      if x ~= mb.inputs then x:free() end
      y:free()
    end)
  end
  titan.no_grad(function()
    titan.scope(function() self:run_actions(self:forward_actions(#mbs), mbs, dtype, device, run) end)
  end)
end

-- The banner's line (lua/parallel/describe.lua): par, the job laid out.
function M.describe(par)
  if not par.pipe then return nil end
  local L, parts = par.pipe.layout, {}
  for s = 0, L.S - 1 do
    local r = L.ranges[s]
    parts[#parts + 1] = r[2] - r[1] > 1 and ("%d-%d"):format(r[1], r[2] - 1) or tostring(r[1])
  end
  return ("pipeline parallel: %d stages over %d ranks (%s, %d micro-batches of %d rows per batch); blocks "
    .. "by stage: %s; stage s runs on pipeline rank s mod %d; tps and MFU are per rank"):format(L.S, par.dims.pp,
    L.schedule, par.dims.n_microbatches, par.cfg.parallelism.pipeline_parallel_microbatch_size,
    table.concat(parts, " | "), par.dims.pp)
end

return M
