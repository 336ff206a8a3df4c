-- dist.lua — process groups and collectives (the C side is engine/dist.c).
--
--   local g = dist.new_group({ backend = "fake", rank = 0, world = 1 })
--   g:all_reduce(t, "sum")                  -- in place
--   local full = g:all_gather(shard)        -- dim 0 concatenated over ranks
--   local part = g:reduce_scatter(full, "avg")
--
-- Backends: "fake" (this process stands for rank r of `world`: right
-- shapes, exact at world 1 — dry runs, memory estimates, the REPL), "mpi"
-- (CPU tensors across processes started by `titan --nproc N`, mpirun or
-- srun), "local" (the ranks of `titan --simulate N`, simulated in one
-- process: the same bits as mpi) and "nccl" (CUDA tensors; rank 0's
-- dist.unique_id() reaches the other ranks through the launcher).
--
--   local env = dist.env()                  -- { rank, world, local_rank, local_size, launcher }
--   local g = dist.world_group()            -- the mpi group of all ranks; nil in a single process
--   local all = g:gather_object(v)          -- { v of rank 0, ..., v of rank W-1 } (JSON-able values)
--   local ng = dist.nccl_world_group(dev)   -- every rank over NCCL on GPU dev (Lua values over MPI)
local tensor = require("titan.tensor")
local tffi = require("titan.ffi")
local ffi, C, check = tffi.ffi, tffi.C, tffi.check

local M = {}

local Group = {}
Group.__index = Group
M.Group = Group

local ops = { sum = C.TT_RED_SUM, avg = C.TT_RED_AVG, max = C.TT_RED_MAX, min = C.TT_RED_MIN }

local function red(op)
  local v = ops[op or "sum"]
  if not v then error("dist: unknown reduction '" .. tostring(op) .. "'; expected sum, avg, max or min", 3) end
  return v
end

local function wrap_group(ptr)
  return setmetatable({ _c = ffi.gc(ptr, C.tt_group_free) }, Group)
end

-- NCCL's unique id as a Lua string (rank 0 creates it, everyone passes it).
function M.unique_id()
  local buf, len = ffi.new("uint8_t[256]"), ffi.new("size_t[1]")
  check(C.tt_dist_unique_id(buf, 256, len), 2)
  return ffi.string(buf, len[0])
end

-- Whether this build has a backend: "fake", "mpi" (Open MPI found at
-- configure time), "nccl" (TITAN_CUDA).
function M.built(backend) return C.tt_dist_backend_built(backend) ~= 0 end

-- opts: backend ("fake"), rank (0), world (1), unique_id (string), device (0),
-- host (an mpi group of the same ranks in the same order: what an nccl
-- group's gather_object and sum_numbers, which exchange Lua values, go
-- through; its splits follow the group's).
function M.new_group(opts)
  opts = opts or {}
  local out = ffi.new("tt_group*[1]")
  local id = opts.unique_id
  check(C.tt_group_new(opts.backend or "fake", opts.rank or 0, opts.world or 1, id, id and #id or 0,
    opts.device or 0, out), 2)
  local g = wrap_group(out[0])
  if opts.host then
    if opts.host:size() ~= g:size() or opts.host:rank() ~= g:rank() then
      error(("dist: the host group is rank %d of %d, the group rank %d of %d; expected the same ranks"):format(
        opts.host:rank(), opts.host:size(), g:rank(), g:size()), 2)
    end
    g._host = opts.host
  end
  return g
end

function Group:rank() return C.tt_group_rank(self._c) end
function Group:size() return C.tt_group_size(self._c) end
function Group:backend() return ffi.string(C.tt_group_backend(self._c)) end
-- The name the collectives watchdog gives the group (engine/watchdog.c).
function Group:set_label(label)
  C.tt_group_set_label(self._c, label)
  if self._host then C.tt_group_set_label(self._host._c, label) end
end

function Group:split(color, key)
  local out = ffi.new("tt_group*[1]")
  check(C.tt_group_split(self._c, color, key or self:rank(), out), 2)
  local g = wrap_group(out[0])
  if self._host then g._host = self._host:split(color, key or self:rank()) end
  return g
end

-- The group Lua values travel through: the host group of an nccl group, else itself.
local function values_group(g, what)
  if g._host then return g._host end
  if g:backend() == "nccl" then
    error(("dist: %s on an nccl group needs its host group (new_group's opts.host: an mpi group of the same "
      .. "ranks), as it exchanges Lua values through host memory"):format(what), 3)
  end
  return g
end

function Group:all_reduce(t, op)
  check(C.tt_dist_all_reduce(self._c, tensor.cptr(t), red(op)), 2)
  return t
end

local function with_dim0(t, factor)
  local shape = t:shape()
  shape[1] = shape[1] * factor
  return tensor.empty(shape, { dtype = t:dtype(), device = t:device() })
end

function Group:all_gather(t, out)
  out = out or with_dim0(t, self:size())
  check(C.tt_dist_all_gather(self._c, tensor.cptr(t), tensor.cptr(out)), 2)
  return out
end

-- The output of reducing t over the group's ranks and keeping this rank's
-- part: dim 0 divided by the group's size (an error naming `what` when it
-- does not divide).
local function scattered(g, t, what)
  local shape = t:shape()
  if shape[1] % g:size() ~= 0 then
    error(("%s: dim 0 of %s is not divisible by %d ranks"):format(what, tensor.shape_str(shape), g:size()), 3)
  end
  shape[1] = shape[1] / g:size()
  return tensor.empty(shape, { dtype = t:dtype(), device = t:device() })
end

function Group:reduce_scatter(t, op, out)
  out = out or scattered(self, t, "reduce_scatter")
  check(C.tt_dist_reduce_scatter(self._c, tensor.cptr(t), tensor.cptr(out), red(op)), 2)
  return out
end

function Group:broadcast(t, root)
  check(C.tt_dist_broadcast(self._c, tensor.cptr(t), root or 0), 2)
  return t
end

function Group:all_to_all(t, out)
  out = out or tensor.empty(t:shape(), { dtype = t:dtype(), device = t:device() })
  check(C.tt_dist_all_to_all(self._c, tensor.cptr(t), tensor.cptr(out)), 2)
  return out
end

-- tag (default 0): tells apart messages between the same two ranks that
-- the receiver takes in another order than they were sent.
function Group:send(t, peer, tag) check(C.tt_dist_send(self._c, tensor.cptr(t), peer, tag or 0), 2) end
function Group:recv(t, peer, tag) check(C.tt_dist_recv(self._c, tensor.cptr(t), peer, tag or 0), 2); return t end
function Group:barrier() check(C.tt_dist_barrier(self._c), 2) end

-- Sends and receives that progress together (torch.distributed's
-- batch_isend_irecv): ops = { { "send" | "recv", tensor, peer, tag }, ... }.
-- What pipeline schedules use on nccl, where a lone send waits for its
-- receiver. Returns once the received values are there (on nccl: for later
-- kernels) and the sent tensors may change.
local function p2p_ops(ops, what)
  local n = #ops
  local k = math.max(n, 1)
  local is_send, ts, peers, tags = ffi.new("int[?]", k), ffi.new("tt_tensor*[?]", k), ffi.new("int[?]", k),
    ffi.new("int[?]", k)
  for i, o in ipairs(ops) do
    if o[1] ~= "send" and o[1] ~= "recv" then
      error(("%s: operation %d is '%s'; expected send or recv"):format(what, i, tostring(o[1])), 3)
    end
    is_send[i - 1], ts[i - 1], peers[i - 1], tags[i - 1] = o[1] == "send" and 1 or 0, tensor.cptr(o[2]), o[3], o[4] or 0
  end
  return n, is_send, ts, peers, tags
end

function Group:batch_p2p(ops)
  check(C.tt_dist_batch_p2p(self._c, p2p_ops(ops, "batch_p2p")), 2)
end

-- A send that returns at once (pipeline schedules: neighbours send to each
-- other at the same time). The work holds its own reference to t: free t's
-- handle whenever, but leave its values alone until work:wait().
local Work = {}
Work.__index = Work
function Group:isend(t, peer, tag)
  local out = ffi.new("tt_work*[1]")
  check(C.tt_dist_isend(self._c, tensor.cptr(t), peer, tag or 0, out), 2)
  return setmetatable({ _c = ffi.gc(out[0], C.tt_work_wait) }, Work)
end
-- The sum (or op) of t over the group, in place, started and not waited
-- for: on nccl later kernels do not wait for it until work:wait() (which
-- makes them wait, with no host wait), so it overlaps what runs meanwhile;
-- t must not be read or written until then. mpi reduces at once.
function Group:all_reduce_async(t, op)
  local out = ffi.new("tt_work*[1]")
  check(C.tt_dist_all_reduce_async(self._c, tensor.cptr(t), red(op), out), 2)
  return setmetatable({ _c = ffi.gc(out[0], C.tt_work_wait) }, Work)
end
-- A reduce-scatter and an all-gather started as all_reduce_async (FSDP's
-- overlap): they return out (made here when not given) and the work; out
-- holds the result for kernels after work:wait(), and neither t nor out may
-- be touched until then. mpi runs them at once.
function Group:reduce_scatter_async(t, op, out)
  out = out or scattered(self, t, "reduce_scatter_async")
  local w = ffi.new("tt_work*[1]")
  check(C.tt_dist_reduce_scatter_async(self._c, tensor.cptr(t), tensor.cptr(out), red(op), w), 2)
  return out, setmetatable({ _c = ffi.gc(w[0], C.tt_work_wait) }, Work)
end
function Group:all_gather_async(t, out)
  out = out or with_dim0(t, self:size())
  local w = ffi.new("tt_work*[1]")
  check(C.tt_dist_all_gather_async(self._c, tensor.cptr(t), tensor.cptr(out), w), 2)
  return out, setmetatable({ _c = ffi.gc(w[0], C.tt_work_wait) }, Work)
end
-- batch_p2p started and not waited for (a pipeline's steps on nccl): the
-- work holds every tensor of ops; leave the sent ones unchanged and the
-- received ones unread until work:wait() (on nccl it makes later kernels
-- wait for the batch, with no host wait). mpi runs the batch at once.
function Group:batch_p2p_async(ops)
  local w = ffi.new("tt_work*[1]")
  local n, is_send, ts, peers, tags = p2p_ops(ops, "batch_p2p_async")
  check(C.tt_dist_batch_p2p_async(self._c, n, is_send, ts, peers, tags, w), 2)
  return setmetatable({ _c = ffi.gc(w[0], C.tt_work_wait) }, Work)
end
function Work:wait()
  local c = self._c
  if c == nil then return end
  self._c = nil
  ffi.gc(c, nil)
  check(C.tt_work_wait(c), 2)
end

-- Any JSON-able Lua value from every rank, in rank order (two all_gathers:
-- the lengths, then the bytes padded to the longest). Numbers round-trip
-- exactly (the checkpoint's JSON writer).
function Group:gather_object(v)
  local host = values_group(self, "gather_object")
  if host ~= self then return host:gather_object(v) end
  local json = require("titan.checkpoint.json")
  local s = json.encode(v)
  local n = self:size()
  local len = tensor.tensor({ #s }, { dtype = "int64" })
  local lens = self:all_gather(len)
  local sizes = lens:tolist_flat()
  len:free(); lens:free()
  local width = 1
  for _, k in ipairs(sizes) do width = math.max(width, k) end
  local mine = tensor.zeros({ width }, { dtype = "uint8" })
  ffi.copy(C.tt_tensor_data(tensor.cptr(mine)), s, #s)
  local all = self:all_gather(mine)
  local base = ffi.cast("const char *", C.tt_tensor_data(tensor.cptr(all)))
  local out = {}
  for r = 1, n do out[r] = json.decode(ffi.string(base + (r - 1) * width, sizes[r])) end
  mine:free(); all:free()
  return out
end

-- Sums of a list of numbers over the ranks (float64), e.g. a step's loss
-- and token count.
function Group:sum_numbers(list)
  local host = values_group(self, "sum_numbers")
  if host ~= self then return host:sum_numbers(list) end
  local t = tensor.tensor(list, { dtype = "float64" })
  self:all_reduce(t, "sum")
  local out = t:tolist_flat()
  t:free()
  return out
end

-- What this rank handed to the group's collectives since it was made (or
-- reset): { calls = {kind = n}, bytes = {kind = n} }, kinds all_reduce,
-- reduce_scatter, all_gather, broadcast, all_to_all, send, recv (the
-- payload each counts: bindings/titan.h, tt_group_traffic).
local KINDS = { "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send", "recv" }
function Group:traffic()
  local calls, bytes = ffi.new("int64_t[?]", #KINDS), ffi.new("int64_t[?]", #KINDS)
  check(C.tt_group_traffic(self._c, calls, bytes, #KINDS), 2)
  local out = { calls = {}, bytes = {} }
  for i, k in ipairs(KINDS) do
    out.calls[k], out.bytes[k] = tonumber(calls[i - 1]), tonumber(bytes[i - 1])
  end
  return out
end
function Group:reset_traffic() C.tt_group_traffic_reset(self._c) end

function Group:free()
  if self._c ~= nil then
    ffi.gc(self._c, nil)
    C.tt_group_free(self._c)
    self._c = nil
  end
end

-- Where this process sits: a simulated rank (titan --simulate N), else from
-- the launcher's environment: Open MPI (mpirun, titan --nproc) or Slurm (srun).
-- getenv: for tests (default os.getenv).
function M.env(getenv)
  if not getenv and C.tt_sim_world() > 0 then
    local rank, world = C.tt_sim_rank(), C.tt_sim_world()
    return { rank = rank, world = world, local_rank = rank, local_size = world, launcher = "simulate" }
  end
  getenv = getenv or os.getenv
  local function num(name)
    local v = getenv(name)
    return v and tonumber(v)
  end
  local launchers = {
    { "mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
      "OMPI_COMM_WORLD_LOCAL_SIZE" },
    { "srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE" },
  }
  for _, l in ipairs(launchers) do
    local rank, world = num(l[2]), num(l[3])
    if rank and world then
      if world < 1 or rank < 0 or rank >= world or rank % 1 ~= 0 or world % 1 ~= 0 then
        error(("dist: %s=%s and %s=%s from the launcher; expected 0 <= rank < world"):format(l[2],
          tostring(getenv(l[2])), l[3], tostring(getenv(l[3]))), 0)
      end
      -- (local_size: the ranks on this host; Slurm may write "2(x3)": its leading count)
      local ls = tonumber((getenv(l[5]) or ""):match("^%d+") or "")
      return { rank = rank, world = world, local_rank = num(l[4]) or 0, local_size = ls or 1, launcher = l[1] }
    end
  end
  return { rank = 0, world = 1, local_rank = 0, local_size = 1, launcher = "none" }
end

local world_group
-- The group of every rank of this job over MPI, or over the simulator's
-- local backend under titan --simulate N (created once); nil when this
-- process runs alone.
function M.world_group()
  if world_group then return world_group end
  local e = M.env()
  if e.world == 1 then return nil end
  local backend = e.launcher == "simulate" and "local" or "mpi"
  local ok, g = pcall(M.new_group, { backend = backend, rank = e.rank, world = e.world })
  if not ok then error((tostring(g):gsub("^[^:]*:%d+: ", "")), 0) end -- (the reason, not this line's position)
  g:set_label(("world [0-%d]"):format(e.world - 1))
  world_group = g
  return world_group
end

-- The group of every rank over NCCL, each on its GPU `device` (an index),
-- with the MPI world group as its host group (created once per device; nil
-- in a single process). Rank 0's unique id reaches the others over MPI.
local nccl_world = {}
function M.nccl_world_group(device)
  if nccl_world[device] then return nccl_world[device] end
  local wg = M.world_group()
  if not wg then return nil end
  if wg:backend() == "local" then
    error("dist: simulated ranks (titan --simulate N) run on the CPU; NCCL needs a process per GPU "
      .. "(titan --nproc N with --training.device=cuda)", 0)
  end
  local id = wg:rank() == 0 and M.unique_id() or ""
  local len = tensor.tensor({ #id }, { dtype = "int64" })
  wg:broadcast(len, 0)
  local n = len:tolist_flat()[1]
  len:free()
  local bytes = tensor.zeros({ n }, { dtype = "uint8" })
  local data = C.tt_tensor_data(tensor.cptr(bytes))
  if wg:rank() == 0 then ffi.copy(data, id, n) end
  wg:broadcast(bytes, 0)
  id = ffi.string(data, n)
  bytes:free()
  local ok, g = pcall(M.new_group, { backend = "nccl", rank = wg:rank(), world = wg:size(), unique_id = id,
    device = device, host = wg })
  if not ok then error((tostring(g):gsub("^[^:]*:%d+: ", "")), 0) end
  nccl_world[device] = g
  return g
end

return M
