-- memory.lua — deterministic release of tensor memory.
--
-- Every tensor created while a scope is open is registered with it; when
-- the scope's function returns, every registered tensor that is not among
-- its results (or explicitly kept) is released on the spot. Memory never
-- waits for the Lua garbage collector (whose ffi.gc finalizers are only a
-- safety net for tensors created outside any scope).
local M = {}

local stack = {}

function M.register(t)
  local top = stack[#stack]
  if top then
    top[#top + 1] = t
    t._scope = top
  end
end

-- t is owned by something longer-lived (a parameter's .grad, optimizer
-- state, a module's buffer): no scope frees it.
function M.keep(t)
  if t then t._scope = nil end
  return t
end

function M.depth() return #stack end

local function collect(v, into, depth)
  if type(v) ~= "table" or depth > 3 then return end
  if v._c ~= nil or v._freed then
    into[v] = true
    return
  end
  if getmetatable(v) == nil then -- plain tables of results, e.g. {loss=..., logits=...}
    for _, x in pairs(v) do collect(x, into, depth + 1) end
  end
end

local function finish(list, ok, ...)
  stack[#stack] = nil
  local keep = {}
  if ok then
    for i = 1, select("#", ...) do collect((select(i, ...)), keep, 0) end
  end
  for i = 1, #list do
    local t = list[i]
    if t._scope == list and not keep[t] then t:free() end
  end
  for t in pairs(keep) do
    if t._scope == list then
      t._scope = nil
      M.register(t) -- results now belong to the enclosing scope
    end
  end
  if not ok then error((...), 0) end
  return ...
end

-- titan.scope(fn, ...): runs fn(...) and releases every tensor it created
-- except those it returns (directly or inside plain tables).
function M.scope(fn, ...)
  local list = {}
  stack[#stack + 1] = list
  return finish(list, xpcall(fn, function(e)
    if type(e) == "string" and os.getenv("TITAN_TRACEBACK") then return debug.traceback(e, 2) end
    return e
  end, ...))
end

return M
