-- Run by tests/lua/mpi_spec.lua on every rank of `titan --nproc N` (and by
-- tests/lua/simulate_spec.lua under `titan --simulate N`, on the local
-- backend): each collective of the mpi backend against the values every
-- rank can work out for itself. A mismatch is an error (the rank exits non-zero); each
-- check passed prints "rank R ok NAME". With TITAN_WORKER_BACKEND=nccl
-- (tests/cuemu/multi_gpu_spec.lua, ranks of titan_cuemu) the same on the
-- nccl backend's world group, each rank's tensors on its own GPU.
local titan = require("titan")
local dist = require("titan.dist")
local tensor = require("titan.tensor")

local nccl = os.getenv("TITAN_WORKER_BACKEND") == "nccl"
assert(dist.world_group(), "mpi_worker: expected to run under titan --nproc N (N > 1)")
local g = nccl and dist.nccl_world_group(tensor.default_cuda()) or dist.world_group()
local r, n = g:rank(), g:size()
-- tensor options on this rank's device
local dev = nccl and "cuda" or "cpu"
local function on(opts)
  opts = opts or {}
  opts.device = dev
  return opts
end

local function same(name, got, want, tol)
  assert(#got == #want, ("%s: %d values, expected %d"):format(name, #got, #want))
  for i = 1, #want do
    if math.abs(got[i] - want[i]) > (tol or 0) then
      error(("rank %d %s: element %d is %s, expected %s"):format(r, name, i, tostring(got[i]), tostring(want[i])), 0)
    end
  end
  print(("rank %d ok %s"):format(r, name))
end

-- all_reduce: every op and the float and integer dtypes
local function sum_of(f) local s = 0; for q = 0, n - 1 do s = s + f(q) end; return s end
for _, dt in ipairs({ "float32", "float64", "int64", "int32" }) do
  local t = titan.tensor({ r + 1, -(r + 1), 7 }, on({ dtype = dt }))
  g:all_reduce(t, "sum")
  same("all_reduce sum " .. dt, t:tolist_flat(), { sum_of(function(q) return q + 1 end),
    -sum_of(function(q) return q + 1 end), 7 * n })
  t = titan.tensor({ r + 1, -(r + 1) }, on({ dtype = dt }))
  g:all_reduce(t, "max")
  same("all_reduce max " .. dt, t:tolist_flat(), { n, -1 })
  t = titan.tensor({ r + 1, -(r + 1) }, on({ dtype = dt }))
  g:all_reduce(t, "min")
  same("all_reduce min " .. dt, t:tolist_flat(), { 1, -n })
end
local t = titan.tensor({ 2 * r, 1 }, on({ dtype = "float32" }))
g:all_reduce(t, "avg")
same("all_reduce avg float32", t:tolist_flat(), { n - 1, 1 }, 1e-6)

-- all_reduce_async (DDP's overlap): started, another collective meanwhile,
-- then waited; and one whose group is freed before the wait (the group
-- stays until its last work is waited for)
local a = titan.tensor({ r + 1, 2 }, on({ dtype = "float32" }))
local wa = g:all_reduce_async(a, "sum")
local b = titan.tensor({ r }, on({ dtype = "float32" }))
g:all_reduce(b, "sum")
wa:wait()
same("all_reduce_async", { a:tolist_flat()[1], a:tolist_flat()[2], b:item() },
  { sum_of(function(q) return q + 1 end), 2 * n, sum_of(function(q) return q end) })
local sub = g:split(0, r)
local c = titan.tensor({ r }, on({ dtype = "float32" }))
local wc = sub:all_reduce_async(c, "sum")
sub:free()
wc:wait()
same("all_reduce_async, its group freed first", c:tolist_flat(), { sum_of(function(q) return q end) })

-- all_gather (also bfloat16: moved as bytes, not converted)
local mine = titan.tensor({ { r, 10 * r } }, on({ dtype = "float32" }))
local want = {}
for q = 0, n - 1 do want[#want + 1] = q; want[#want + 1] = 10 * q end
same("all_gather float32", g:all_gather(mine):tolist_flat(), want)
same("all_gather bfloat16", g:all_gather(mine:to("bfloat16")):to("float32"):tolist_flat(), want)

-- reduce_scatter: rank r holds full[q] = q + r for every chunk q
local full = {}
for q = 0, n - 1 do full[#full + 1] = { q + r, 1 } end
local part = g:reduce_scatter(titan.tensor(full, on({ dtype = "float64" })), "sum")
same("reduce_scatter sum", part:tolist_flat(), { n * r + sum_of(function(q) return q end), n })
part = g:reduce_scatter(titan.tensor(full, on({ dtype = "float32" })), "avg")
same("reduce_scatter avg", part:tolist_flat(), { r + sum_of(function(q) return q end) / n, 1 }, 1e-6)

-- all_gather_async and reduce_scatter_async (FSDP's overlap): started, another collective meanwhile, then
-- waited for
local gathered, wg = g:all_gather_async(mine)
local scattered, wr = g:reduce_scatter_async(titan.tensor(full, on({ dtype = "float32" })), "sum")
local between = titan.tensor({ r }, on({ dtype = "float32" }))
g:all_reduce(between, "sum")
wg:wait()
wr:wait()
same("all_gather_async", gathered:tolist_flat(), want)
same("reduce_scatter_async", { scattered:tolist_flat()[1], scattered:tolist_flat()[2], between:item() },
  { n * r + sum_of(function(q) return q end), n, sum_of(function(q) return q end) })

-- broadcast from the last rank
local b = titan.tensor({ r, r, r }, on({ dtype = "int64" }))
g:broadcast(b, n - 1)
same("broadcast", b:tolist_flat(), { n - 1, n - 1, n - 1 })

-- all_to_all: rank r sends 100 r + q to rank q
local out = {}
for q = 0, n - 1 do out[#out + 1] = 100 * r + q end
local got = g:all_to_all(titan.tensor(out, on({ dtype = "int32" })))
want = {}
for q = 0, n - 1 do want[#want + 1] = 100 * q + r end
same("all_to_all", got:tolist_flat(), want)

-- send/recv around a ring (even ranks send first, so no rank waits on itself)
local nxt, prv = (r + 1) % n, (r - 1 + n) % n
local box = titan.zeros({ 4 }, on({ dtype = "float32" }))
local msg = titan.full({ 4 }, r + 0.5, on({ dtype = "float32" }))
if r % 2 == 0 then g:send(msg, nxt); g:recv(box, prv) else g:recv(box, prv); g:send(msg, nxt) end
same("send/recv", box:tolist_flat(), { prv + 0.5, prv + 0.5, prv + 0.5, prv + 0.5 })

-- batch_p2p: every rank sends to the next and takes from the previous at once (on NCCL, lone sends would each
-- wait for their receiver all around the ring)
local ahead = titan.full({ 3 }, r + 0.25, on({ dtype = "float32" }))
local back = titan.zeros({ 3 }, on({ dtype = "float32" }))
g:batch_p2p({ { "send", ahead, nxt, 3 }, { "recv", back, prv, 3 } })
same("batch_p2p", back:tolist_flat(), { prv + 0.25, prv + 0.25, prv + 0.25 })

-- batch_p2p_async: the same ring, the handles freed before the wait (the work holds the tensors) and the
-- received values read after it; on nccl a missing wait reads zeros when cuemu defers the comm stream
local ahead2 = titan.full({ 5 }, r + 0.75, on({ dtype = "float32" }))
local back2 = titan.zeros({ 5 }, on({ dtype = "float32" }))
local work = g:batch_p2p_async({ { "send", ahead2, nxt, 4 }, { "recv", back2, prv, 4 } })
ahead2:free()
work:wait()
work:wait() -- (a second wait does nothing)
same("batch_p2p_async", (back2 * 2):tolist_flat(), { 2 * prv + 1.5, 2 * prv + 1.5, 2 * prv + 1.5, 2 * prv + 1.5,
  2 * prv + 1.5 })

-- isend with tags (pipeline schedules): every rank sends two 4 MB messages to
-- the next at once and takes its neighbour's in the other order; blocking
-- sends of that size would wait on each other all around the ring. (Not on
-- NCCL, where a send waits for its receiver and messages match in order:
-- pipeline stages there use batch_p2p_async.)
if not nccl then
  local big = 2 ^ 20
  local m1, m2 = titan.full({ big }, r + 1, { dtype = "float32" }), titan.full({ big }, -(r + 1), { dtype = "float32" })
  local w1, w2 = g:isend(m1, nxt, 7), g:isend(m2, nxt, 8)
  m1:free() -- (the work holds its own reference until the send completes)
  local in2, in1 = g:recv(titan.zeros({ big }), prv, 8), g:recv(titan.zeros({ big }), prv, 7)
  w1:wait(); w2:wait()
  same("isend/recv by tag", { in1:sum():item(), in1:narrow(1, big, 1):item(), in2:sum():item() },
    { big * (prv + 1), prv + 1, -big * (prv + 1) })
end

-- split: one group of everyone ordered backwards, and singletons
local rev = g:split(0, n - 1 - r)
assert(rev:rank() == n - 1 - r and rev:size() == n, "split: reversed ranks")
local s = titan.tensor({ rev:rank() }, on({ dtype = "float64" }))
rev:broadcast(s, 0) -- rank 0 of the reversed group is world rank n - 1
same("split", s:tolist_flat(), { 0 })
local alone = g:split(r, 0)
assert(alone:size() == 1 and alone:rank() == 0, "split: a color per rank")
print(("rank %d ok split singletons"):format(r))

-- Lua values and sums (what the trainer and the checkpoint manager use)
local objs = g:gather_object({ rank = r, big = 2 ^ 53 - r, name = "r" .. r })
for q = 0, n - 1 do
  assert(objs[q + 1].rank == q and objs[q + 1].big == 2 ^ 53 - q and objs[q + 1].name == "r" .. q, "gather_object")
end
print(("rank %d ok gather_object"):format(r))
same("sum_numbers", g:sum_numbers({ r, 0.25 }), { sum_of(function(q) return q end), 0.25 * n })

-- Context parallelism's attention (lua/parallel/cp.lua): each rank's chunks of q, k, v (grouped-query
-- heads, two sequences) give its chunks of the whole sequence's causal attention and of its gradients,
-- computed here whole from the same seeded values.
do
  local cp, F = require("parallel.cp"), titan.F
  local B, T, Hq, Hkv, D = 2, 4 * n, 4, 2, 8
  local function seeded(shape, seed) return titan.randn(shape, { seed = seed }):to(dev) end
  local q, k, v = seeded({ B, T, Hq, D }, 11), seeded({ B, T, Hkv, D }, 12), seeded({ B, T, Hkv, D }, 13)
  local dout = seeded({ B, T, Hq, D }, 14)
  local qw, kw, vw = q:clone():requires_grad_(), k:clone():requires_grad_(), v:clone():requires_grad_()
  local ow = F.attention(qw, kw, vw, { causal = true })
  ow:mul(dout):sum():backward()
  local function mine(t) return cp.shard(t, r, n):to("cpu"):tolist_flat() end
  for _, method in ipairs({ "allgather", "alltoall" }) do -- (all keys at once; the ring)
    local ql = cp.shard(q, r, n):requires_grad_()
    local kl, vl = cp.shard(k, r, n):requires_grad_(), cp.shard(v, r, n):requires_grad_()
    local ol = cp.context(g, { rotate_method = method }):attention(ql, kl, vl)
    ol:mul(cp.shard(dout, r, n)):sum():backward()
    local what = "cp attention " .. method
    same(what, ol:to("cpu"):tolist_flat(), mine(ow:detach()), 1e-5)
    same(what .. " dq", ql.grad:to("cpu"):tolist_flat(), mine(qw.grad), 1e-5)
    same(what .. " dk", kl.grad:to("cpu"):tolist_flat(), mine(kw.grad), 1e-5)
    same(what .. " dv", vl.grad:to("cpu"):tolist_flat(), mine(vw.grad), 1e-5)
  end
end

-- Float8 under tensor parallelism (lua/parallel/float8.lua): a weight split by rows over the ranks,
-- cast with the group's largest magnitude, gives each rank the fp8 bits of its rows of the whole
-- weight's cast, and the same inverse scale.
do
  local f8 = require("parallel.float8")
  local w = titan.randn({ 4 * n, 16 }, { seed = 31 }) * (titan.arange(4 * n):reshape(4 * n, 1) + 1)
  local whole8, whole_s = f8.to_float8(w, "float8_e5m2")
  local mine8, mine_s = f8.to_float8(w:narrow(1, 4 * r + 1, 4):contiguous():to(dev), "float8_e5m2", g)
  assert(mine_s:to("cpu"):item() == whole_s:item(), "float8 group scale")
  local a, b = mine8:to("cpu"):tolist_flat(), whole8:narrow(1, 4 * r + 1, 4):contiguous():tolist_flat()
  for i = 1, #b do assert(a[i] == b[i], ("float8 group cast: element %d %g vs %g"):format(i, a[i], b[i])) end
  print(("rank %d ok float8 group cast"):format(r))
end

-- Expert parallelism (lua/parallel/ep.lua): a mixture of experts of 2 n experts, 2 per rank, top 2,
-- each rank routing its own rows: its outputs and input gradients are its rows of one layer run on
-- every rank's rows, its experts' gradients those experts' whole ones, the router's summed over the
-- ranks the whole one's. Then every row sent to expert 0 (a bias): the other ranks' experts get no
-- rows, and the exchanges' backward still meets on every rank.
do
  local moe, ep, nn = require("models.moe"), require("parallel.ep"), titan.nn
  local E, N, D = 2 * n, 5, 8
  for _, case in ipairs({ "spread", "all to expert 0" }) do
    local m = { num_experts = E, top_k = case == "spread" and 2 or 1, num_shared_experts = 1 }
    titan.manual_seed(7)
    local ref = moe.MoE(D, 16, m, { device = dev })
    local wrap = nn.Module:extend("Wrap")()
    wrap:child("moe", moe.MoE(D, 16, m, { device = dev }))
    local plan = ep.apply(wrap, g)
    assert(plan.local_experts == 2 and #wrap.moe.experts:named_children() == 2, "ep keeps 2 experts per rank")
    titan.no_grad(function()
      for _, np in ipairs(wrap.moe:named_parameters()) do np[2]:copy_(ref:state_dict().tensors[np[1]]) end
      if case ~= "spread" then
        for _, b in ipairs({ ref.expert_bias, wrap.moe.expert_bias }) do b:narrow(1, 1, 1):fill_(100) end
      end
    end)
    local x = titan.randn({ n * N, D }, { seed = 41 }):to(dev)
    local dout = titan.randn({ n * N, D }, { seed = 42 }):to(dev)
    local xw = x:clone():requires_grad_()
    ref(xw):mul(dout):sum():backward()
    local xl = x:narrow(1, r * N + 1, N):contiguous():requires_grad_()
    local yl = wrap.moe(xl)
    yl:mul(dout:narrow(1, r * N + 1, N)):sum():backward()
    local function rows(t) return t:narrow(1, r * N + 1, N):contiguous():to("cpu"):tolist_flat() end
    local what = "ep " .. case
    same(what .. " out", yl:detach():to("cpu"):tolist_flat(), rows(ref(x):detach()), 1e-5)
    same(what .. " dx", xl.grad:to("cpu"):tolist_flat(), rows(xw.grad), 1e-5)
    local router = wrap.moe.router.weight.grad:clone()
    g:all_reduce(router, "sum")
    same(what .. " router grad", router:to("cpu"):tolist_flat(), ref.router.weight.grad:to("cpu"):tolist_flat(), 1e-5)
    for e = 2 * r, 2 * r + 1 do
      for _, w in ipairs({ "w1", "w2", "w3" }) do
        local mine, want = wrap.moe.experts[tostring(e)][w].weight.grad, ref.experts[tostring(e)][w].weight.grad
        if want then
          same(("%s expert %d %s grad"):format(what, e, w), mine:to("cpu"):tolist_flat(), want:to("cpu"):tolist_flat(),
            1e-5)
        else
          assert(mine == nil or mine:abs():max():item() == 0, what .. ": an expert with no rows has a gradient")
          print(("rank %d ok %s expert %d %s no rows"):format(r, what, e, w))
        end
      end
    end
  end
end

-- misuse: one clear line each
local function fails(name, fn, pattern)
  local ok, err = pcall(fn)
  assert(not ok, name .. ": expected an error")
  assert(tostring(err):find(pattern), ("%s: error '%s' lacks '%s'"):format(name, tostring(err), pattern))
  print(("rank %d ok error %s"):format(r, name))
end
if nccl then
  -- (NCCL reduces bfloat16: the gradients of bf16 parameters)
  local h = titan.tensor({ r + 1, 0.5 }, on({ dtype = "bfloat16" }))
  g:all_reduce(h, "sum")
  same("all_reduce sum bfloat16", h:to("float32"):tolist_flat(), { sum_of(function(q) return q + 1 end), 0.5 * n })
  fails("host tensor", function() g:all_reduce(titan.ones({ 2 })) end, "the nccl backend needs CUDA tensors")
  fails("no host group", function() dist.new_group({ backend = "nccl", rank = 0, world = 1,
    unique_id = dist.unique_id(), device = tensor.default_cuda() }):sum_numbers({ 1 }) end, "needs its host group")
else
  fails("bf16 reduction", function() g:all_reduce(titan.ones({ 2 }, { dtype = "bfloat16" })) end,
    "bfloat16 cannot be reduced")
  fails("meta tensor", function() g:all_reduce(titan.empty({ 2 }, { device = "meta" })) end, "needs CPU tensors")
  if g:backend() == "local" then
    fails("wrong rank", function() dist.new_group({ backend = "local", rank = 0, world = n + 1 }) end,
      "but this is simulated rank %d+ of %d+")
  else
    fails("wrong rank", function() dist.new_group({ backend = "mpi", rank = 0, world = n + 1 }) end,
      "rank %d+ of %d+ in MPI_COMM_WORLD")
  end
end

g:barrier()
print(("rank %d ok all"):format(r))
