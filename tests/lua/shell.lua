-- What the specs that run commands share (not a spec: ctest runs *_spec.lua).
-- Load with dofile("tests/lua/shell.lua"): specs run from the source root.
local M = {}

-- Runs cmd under sh, stderr joined to stdout: the output and the exit status.
function M.run(cmd)
  local p = assert(io.popen("(" .. cmd .. ") 2>&1; echo \"__rc=$?\""))
  local out = p:read("*a")
  p:close()
  return (out:gsub("__rc=%d+%s*$", "")), tonumber(out:match("__rc=(%d+)%s*$"))
end

-- A new empty directory under /tmp.
function M.tmpdir()
  local d = os.tmpname()
  os.remove(d)
  os.execute("mkdir -p " .. d)
  return d
end

-- s as one single-quoted shell word.
function M.quote(s) return "'" .. (tostring(s):gsub("'", "'\\''")) .. "'" end

return M
