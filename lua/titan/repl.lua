-- repl.lua — `titan repl`: an interactive prompt with the library loaded as
-- `titan` (and `T` for short). Expressions print their values; errors are
-- reported and the prompt goes on; an incomplete statement continues on
-- the next line.
local M = {}

local function show(ok, ...)
  if not ok then
    io.stderr:write("error: ", tostring((...)), "\n")
    return
  end
  local n = select("#", ...)
  for i = 1, n do
    local v = select(i, ...)
    io.write(tostring(v), i < n and "\t" or "\n")
  end
end

function M.run()
  local titan = require("titan")
  local env = setmetatable({ titan = titan, T = titan }, { __index = _G })
  io.write(("titan %s (LuaJIT) — `titan` is loaded; Ctrl-D exits\n"):format(titan.version()))
  local buffer = ""
  while true do
    io.write(buffer == "" and "> " or ">> ")
    io.flush()
    local line = io.read("*l")
    if not line then io.write("\n"); break end
    buffer = buffer == "" and line or buffer .. "\n" .. line
    local chunk, err = loadstring("return " .. buffer, "=repl")
    if not chunk then chunk, err = loadstring(buffer, "=repl") end
    if chunk then
      setfenv(chunk, env)
      buffer = ""
      show(pcall(chunk))
    elseif err and err:match("<eof>'?$") then
      -- incomplete: keep reading
    else
      io.stderr:write("syntax error: ", tostring(err), "\n")
      buffer = ""
    end
  end
end

return M
