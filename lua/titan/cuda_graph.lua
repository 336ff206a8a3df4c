-- cuda_graph.lua — record the kernels a function queues on a GPU once, then
-- replay them with one launch.
--
--   local cuda_graph = require("titan.cuda_graph")
--   local x = titan.randn(64, 64):to("cuda")           -- a static input
--   local g, why = cuda_graph.capture("cuda", function()
--     return { y = (x @ w):silu():sum() }               -- its outputs
--   end)
--   x:copy_(next_x); g:replay(); print(g.outputs.y:item())
--
-- While fn runs under capture nothing executes on the GPU: fn's Lua code
-- runs once, and its kernels are recorded with the addresses they saw. So:
--   * inputs are tensors that outlive the graph; new data is copied into
--     them before a replay;
--   * fn returns its outputs (tensors, or plain tables of them), which the
--     graph keeps: after each replay they hold that replay's values;
--   * fn must not read device values on the host (:item(), printing a
--     tensor) or synchronize: capture then fails, capture() returns nil and
--     the reason, and the device is as it was;
--   * host numbers fn uses (shapes, scalars, a learning rate) are frozen
--     into the graph;
--   * run fn once eagerly before capturing it (as PyTorch asks too): first
--     launches load kernels and make library plans (a cuDNN attention plan
--     is never made during a capture: the fallback kernel is recorded).
-- Every tensor fn allocates comes from the graph's private memory pool and
-- stays the graph's until g:free().
--
-- M.emulate = true makes capture() return a stand-in that runs fn again at
-- every replay (on any device): specs use it on machines without a GPU to
-- check the bookkeeping of code built on graphs. It executes nothing at
-- capture, exactly as a real capture does.
local tensor = require("titan.tensor")
local memory = require("titan.memory")
local tffi = require("titan.ffi")
local ffi, C = tffi.ffi, tffi.C

local M = { emulate = false }

local Graph = {}
Graph.__index = Graph
M.Graph = Graph

local function each_tensor(v, fn, depth)
  depth = depth or 0
  if type(v) ~= "table" or depth > 3 then return end
  if v._c ~= nil then return fn(v) end
  if getmetatable(v) == nil then
    for _, x in pairs(v) do each_tensor(x, fn, depth + 1) end
  end
end

local function free_outputs(v) each_tensor(v, function(t) t:free() end) end

local function last_error() return ffi.string(C.tt_last_error()) end

-- Copy the values of `src` (the same structure) into the kept outputs.
local function copy_into(dst, src, depth)
  depth = depth or 0
  if type(dst) ~= "table" or depth > 3 then return end
  if dst._c ~= nil then
    tffi.check(C.tt_tensor_copy(dst._c, src._c), 3)
    return
  end
  for k, x in pairs(dst) do copy_into(x, src[k], depth + 1) end
end

local function capture_emulated(device, fn)
  return setmetatable({ device = device, fn = fn, emulated = true, num_nodes = 0 }, Graph)
end

-- capture(device, fn) -> graph, or nil and why the capture was impossible.
-- Errors in fn itself (a shape mismatch, ...) are raised as usual.
function M.capture(device, fn)
  local dev = tensor.device_of(device)
  if M.emulate then return capture_emulated(device, fn) end
  if dev.type ~= C.TT_CUDA then
    return nil, ("CUDA graphs need a cuda device, not %s"):format(tensor.device_name(dev))
  end
  local pbox = ffi.new("tt_mempool*[1]")
  tffi.check(C.tt_mempool_new(dev, pbox), 2)
  local pool = pbox[0]
  -- Work queued before the capture must not end up in the graph.
  local st = C.tt_device_synchronize(dev)
  if st == 0 then st = C.tt_graph_capture_begin(dev, pool) end
  if st ~= 0 then
    local why = last_error()
    C.tt_mempool_free(pool)
    return nil, why
  end
  local ok, outs = pcall(memory.scope, fn)
  local gbox = ffi.new("tt_graph*[1]")
  st = C.tt_graph_capture_end(dev, gbox)
  if st ~= 0 then
    -- The capture was refused (usually fn waited for the device, and its
    -- error says where): nothing ran, nothing is kept.
    local why = last_error()
    if ok then free_outputs(outs) end
    C.tt_mempool_free(pool)
    if not ok then why = why .. "; the captured function stopped at: " .. tostring(outs) end
    return nil, why
  end
  if not ok then -- fn failed for a reason of its own, with the capture healthy
    C.tt_graph_free(gbox[0])
    C.tt_mempool_free(pool)
    error(outs, 0)
  end
  each_tensor(outs, memory.keep)
  return setmetatable({
    device = device, outputs = outs, _g = gbox[0], _pool = pool,
    num_nodes = tonumber(C.tt_graph_num_nodes(gbox[0])),
  }, Graph)
end

-- Queue the recorded work again (asynchronously, like any kernel launch).
function Graph:replay()
  if self.freed then error("cuda_graph: replay of a freed graph", 2) end
  if self.emulated then
    local r = memory.scope(self.fn)
    if self.outputs then
      copy_into(self.outputs, r)
      free_outputs(r)
    else
      each_tensor(r, memory.keep)
      self.outputs = r
    end
    return
  end
  tffi.check(C.tt_graph_replay(self._g), 2)
end

-- The private pool's statistics (bytes the graph holds), as titan.memory_stats.
function Graph:memory_stats()
  if self.emulated or self.freed then return { allocated = 0, reserved = 0 } end
  local s = ffi.new("tt_mem_stats")
  tffi.check(C.tt_mempool_stats(self._pool, s), 2)
  return { allocated = tonumber(s.allocated), reserved = tonumber(s.reserved), num_allocs = tonumber(s.num_allocs) }
end

-- Releases the graph, its outputs and its pool (kernels already queued
-- still finish: the device is synchronized first).
function Graph:free()
  if self.freed then return end
  self.freed = true
  if self.outputs then free_outputs(self.outputs) end
  self.outputs = nil
  if not self.emulated then
    -- The wait also reports an index error the last replays met: raised
    -- once everything is released.
    local st = C.tt_device_synchronize(tensor.device_of(self.device))
    local why = st ~= 0 and last_error() or nil
    C.tt_graph_free(self._g)
    C.tt_mempool_free(self._pool)
    self._g, self._pool = nil, nil
    if why then error(why, 2) end
  end
end

return M
