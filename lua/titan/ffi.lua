-- ffi.lua — binds libtitan: reads the declarations of bindings/titan.h
-- (the block between TT_CDEF_BEGIN and TT_CDEF_END) into ffi.cdef and
-- returns { C = library namespace, ffi = ffi, check = error raiser }.
local ffi = require("ffi")

local env_ok, env = pcall(require, "titan.env")
if not env_ok then
  -- Running under a plain luajit: locate the tree from this file's path.
  local here = debug.getinfo(1, "S").source:match("^@(.*)/lua/titan/ffi%.lua$") or "."
  env = { root = os.getenv("TITAN_HOME") or here, build_dir = (os.getenv("TITAN_HOME") or here) .. "/build" }
end

local function read_header()
  local path = env.root .. "/bindings/titan.h"
  local f, err = io.open(path, "r")
  if not f then error("titan: cannot read the C API header " .. path .. ": " .. tostring(err), 0) end
  local text = f:read("*a")
  f:close()
  local block = text:match("/%* TT_CDEF_BEGIN %*/(.-)/%* TT_CDEF_END %*/")
  if not block then error("titan: " .. path .. " has no TT_CDEF_BEGIN/TT_CDEF_END block", 0) end
  return block
end

ffi.cdef(read_header())

local function load_library()
  -- Inside the titan executable libtitan is already linked: use it.
  local ok = pcall(function() return ffi.C.tt_version end)
  if ok then return ffi.C end
  local path = os.getenv("TITAN_LIB") or (env.build_dir .. "/libtitan.so")
  return ffi.load(path)
end

local C = load_library()

local M = { C = C, ffi = ffi, env = env }

-- Turn a failed status into a Lua error carrying the engine's message.
function M.check(status, level)
  if status ~= 0 then
    error(ffi.string(C.tt_last_error()), (level or 1) + 1)
  end
end

return M
