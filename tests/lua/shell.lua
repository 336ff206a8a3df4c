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

-- Runs cmd, which must fail (non-zero exit) saying `text` (plain text).
function M.one_line(cmd, text)
  local out, rc = M.run(cmd)
  assert(rc ~= 0, ("exit 0 from %s:\n%s"):format(cmd, out))
  assert(out:find(text, 1, true), ("'%s' lacks '%s'"):format(out, text))
  return out
end

-- The losses of a training run's step lines, as printed (strings: compare bit for bit, or tonumber).
function M.losses(out)
  local l = {}
  for v in out:gmatch("step: +%d+  loss: +([%d.]+)") do l[#l + 1] = v end
  return l
end

-- Runs cmd; its output, or an error with the exit status and the output.
function M.run_ok(cmd)
  local out, rc = M.run(cmd)
  assert(rc == 0, ("exit %s from %s:\n%s"):format(tostring(rc), cmd, out))
  return out
end

-- The elements of list a, then those of b (nil: none).
function M.with(a, b)
  local t = {}
  for _, x in ipairs(a) do t[#t + 1] = x end
  for _, x in ipairs(b or {}) do t[#t + 1] = x end
  return t
end

-- Runs tests/lua/mpi_worker.lua as `exe --nproc n` (env: variables before
-- it) and checks that every rank passed its `per_rank` checks and the last.
function M.worker_ok(env, exe, n, per_rank)
  local out, rc = M.run(env .. exe .. " --nproc " .. n .. " tests/lua/mpi_worker.lua")
  assert(rc == 0, out)
  for r = 0, n - 1 do assert(out:find(("rank %d ok all"):format(r), 1, true), out) end
  local k = 0
  for _ in out:gmatch("rank %d ok ") do k = k + 1 end
  assert(k == n * per_rank, ("%d checks passed, expected %d:\n%s"):format(k, n * per_rank, out))
end

return M
