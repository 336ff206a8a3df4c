-- checkpoint/fs.lua — the file-system steps of a crash-safe commit, over
-- the engine's tt_fs_* calls (no shell, no os.execute): folders, listings,
-- durable small files, atomic renames, removal.
local tffi = require("titan.ffi")
local ffi, C = tffi.ffi, tffi.C

local function check(st)
  if st ~= 0 then error(ffi.string(C.tt_last_error()), 0) end
end

local M = {}

function M.join(a, b)
  if b:sub(1, 1) == "/" then return b end
  if a == "" or a == "." then return b end
  return (a:gsub("/+$", "")) .. "/" .. b
end

function M.basename(p) return (p:gsub("/+$", ""):match("([^/]*)$")) end
function M.dirname(p)
  local d = p:gsub("/+$", ""):match("^(.*)/[^/]*$")
  if d == nil then return "." end
  if d == "" then return "/" end
  return d
end

function M.mkdirs(path) check(C.tt_fs_mkdirs(path)) end

-- Size in bytes, or nil when missing; "dir" for a folder.
function M.size(path)
  local n = tonumber(C.tt_fs_size(path))
  if n == -1 then return nil end
  if n == -2 then return "dir" end
  return n
end

function M.exists(path) return M.size(path) ~= nil end
function M.is_dir(path) return M.size(path) == "dir" end

-- Sorted names in a folder.
function M.list(dir)
  local len = ffi.new("size_t[1]")
  local cap = 65536
  while true do
    local buf = ffi.new("char[?]", cap)
    check(C.tt_fs_list(dir, buf, cap, len))
    if tonumber(len[0]) < cap then
      local names = {}
      for name in ffi.string(buf, len[0]):gmatch("([^\n]+)\n") do names[#names + 1] = name end
      table.sort(names)
      return names
    end
    cap = tonumber(len[0]) + 1
  end
end

-- A new file (never replaces one), written and fsync'ed.
function M.write_file(path, data) check(C.tt_fs_write_file(path, data, #data)) end

function M.read_file(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("*a")
  f:close()
  return s
end

function M.sync_dir(path) check(C.tt_fs_sync_dir(path)) end

-- rename(from, to): fails when `to` exists. exchange(a, b): swap atomically.
function M.rename(from, to) check(C.tt_fs_rename(from, to, 0)) end
function M.exchange(a, b) check(C.tt_fs_rename(a, b, 1)) end

function M.remove_all(path) check(C.tt_fs_remove_all(path)) end

function M.pid() return tonumber(C.tt_process_id()) end

-- Is process `pid` alive on this host?
function M.alive(pid) return M.size("/proc/" .. tostring(pid)) ~= nil end

-- An exclusive lock on file `path` (flock: released when this process
-- ends, however it ends), with `note` written into it. Returns a handle
-- (:release()), or nil and the holder's note. Locked twice by one process
-- (two trainers in one Lua state): the same lock, counted.
local held = {}
local fd_out = ffi.new("int[1]")
local holder = ffi.new("char[512]")
function M.lock(path, note)
  local h = held[path]
  if not h then
    if C.tt_fs_lock(path, note, fd_out, holder, 512) ~= 0 then
      local who = ffi.string(holder)
      return nil, who ~= "" and who or ffi.string(C.tt_last_error())
    end
    h = { fd = fd_out[0], count = 0, path = path }
    function h.release()
      h.count = h.count - 1
      if h.count == 0 then
        C.tt_fs_unlock(h.fd)
        held[path] = nil
      end
    end
    held[path] = h
  end
  h.count = h.count + 1
  return h
end

return M
