-- repl.lua — `titan repl`: an interactive prompt with the library loaded as
-- `titan` (and `T` for short). Expressions print their values (pretty.lua),
-- several values side by side; `_` holds the first value last printed. An
-- error is one line on stderr and the prompt goes on; an incomplete
-- statement continues on the next line. Line editing, history and tab
-- completion come from lineedit.lua when stdin is a terminal; piped input is
-- read plainly, with no banner or prompts, so the output is only the results.
local lineedit = require("titan.lineedit")
local pretty = require("titan.pretty")

local M = {}

local CHUNK = "=repl" -- positions read `repl:2:`, not `[string "..."]:2:`

local function default_prompt(more) return more and ">> " or "> " end

-- An error value as one message: strings as they are, the rest printed.
local function message(err)
  if type(err) == "string" then return err end
  return pretty.format(err, { width = math.huge })
end

local function report(err)
  io.stdout:flush() -- what the statement printed before it failed comes first
  io.stderr:write("error: ", err, "\n")
end

-- The chunk for the lines read so far: as an expression list when it is one,
-- else as statements. nil and the error when it does not compile.
local function compile(code)
  if loadstring("return " .. code, CHUNK) then
    -- Run as the arguments of a call, not as `return f(x)`: that is a tail
    -- call, and error("boom") called so loses its `repl:1:` position. The
    -- newline ends a trailing comment; line numbers are unchanged.
    return assert(loadstring("return (function(...) return ... end)(" .. code .. "\n)", CHUNK))
  end
  return loadstring(code, CHUNK)
end

-- Prints a statement's results: each through pretty.format, tab-separated
-- like print, or one a line when any takes several lines.
local function show(env, n, ...)
  if n == 0 then return end
  local parts, tall = {}, false
  for i = 1, n do
    parts[i] = pretty.format((select(i, ...)))
    tall = tall or parts[i]:find("\n", 1, true) ~= nil
  end
  env._ = (...)
  io.write(table.concat(parts, tall and "\n" or "\t"), "\n")
end

local function traceback_wanted()
  local tb = os.getenv("TITAN_TRACEBACK")
  return tb and tb ~= "" and tb ~= "0"
end

-- Runs one complete chunk in env and prints its results or its error.
local function evaluate(chunk, env)
  setfenv(chunk, env)
  local handler = traceback_wanted() and function(e) return debug.traceback(message(e), 2) end or message
  local function results(ok, ...)
    if not ok then return report((...)) end
    local shown, err = pcall(show, env, select("#", ...), ...)
    if not shown then report(message(err)) end
  end
  results(xpcall(chunk, handler))
  io.stdout:flush()
end

-- Tab completion: the names that can replace `word` (before: the line up to
-- it). `a.b.c.pre` offers the fields of a.b.c, `x:pre` its methods (through
-- its metatables' __index tables: a tensor's methods), a bare word the
-- globals and keywords. nil inside a string: the line editor completes file
-- names there instead.
local KEYWORDS = { "and", "break", "do", "else", "elseif", "end", "false", "for", "function", "goto", "if",
  "in", "local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while" }

local function in_string(before)
  local quote, i = nil, 1
  while i <= #before do
    local c = before:sub(i, i)
    if quote then
      if c == "\\" then i = i + 1 elseif c == quote then quote = nil end
    elseif c == '"' or c == "'" then
      quote = c
    end
    i = i + 1
  end
  return quote ~= nil
end

local function is_name(s) return s:match("^[%a_][%w_]*$") ~= nil end

local function callable(x)
  if type(x) == "function" then return true end
  local mt = debug.getmetatable(x)
  return mt ~= nil and mt.__call ~= nil
end

-- The names of v's fields into `out`: its own (a table's) and those its
-- metatables' __index tables provide; methods_only: only callable ones.
local function fields(v, methods_only, out, seen)
  if seen[v] then return end
  seen[v] = true
  if type(v) == "table" then
    for k, x in next, v do
      if type(k) == "string" and is_name(k) and (not methods_only or callable(x)) then out[k] = true end
    end
  end
  local mt = debug.getmetatable(v)
  if mt and type(mt.__index) == "table" then fields(mt.__index, methods_only, out, seen) end
end

local function completer(env)
  return function(word, before)
    if in_string(before) then return nil end
    local path, sep, part = word:match("^(.*)([.:])([%w_]*)$")
    local names = {}
    if path then
      local v = env
      for name in (path .. "."):gmatch("(.-)%.") do
        if not is_name(name) then return {} end
        local ok, x = pcall(function() return v[name] end)
        if not ok or x == nil then return {} end
        v = x
      end
      fields(v, sep == ":", names, {})
    else
      if word ~= "" and not is_name(word) then return {} end
      path, sep, part = "", "", word
      fields(env, false, names, {})
      for _, k in ipairs(KEYWORDS) do names[k] = true end
    end
    local words = {}
    for name in pairs(names) do
      -- _private names only when asked for by their underscore
      if name:sub(1, #part) == part and (part:sub(1, 1) == "_" or name:sub(1, 1) ~= "_") then
        words[#words + 1] = path .. sep .. name
      end
    end
    table.sort(words)
    return words
  end
end

-- Runs the prompt until the end of input (Ctrl-D). opts (all optional):
--   env    a table of extra globals (on top of `titan` and `T`)
--   banner the line printed at the start instead of the version banner
--   prompt a function(more) returning the prompt; more is true on the
--          continuation lines of an unfinished statement
-- The banner and the prompts show only when stdin is a terminal.
function M.run(opts)
  opts = opts or M.job_opts(rawget(_G, "arg") or {}) or {}
  local titan = require("titan")
  -- (opts.env itself is the prompt's globals, so what its functions later
  -- set there, e.g. rank(r)'s new params, is what the next line sees)
  local env = setmetatable(opts.env or {}, { __index = _G })
  env.titan, env.T = titan, titan
  local prompt = opts.prompt or default_prompt
  local reader = lineedit.open({ complete = completer(env) })
  if reader.interactive then
    io.write(opts.banner or ("titan %s (LuaJIT) — `titan` is loaded; Ctrl-D exits"):format(titan.version()), "\n")
  end
  local code -- the lines of an unfinished statement, or nil
  while true do
    local line = reader:read(reader.interactive and prompt(code ~= nil) or "")
    if not line then break end
    if code or line:find("%S") then
      code = code and code .. "\n" .. line or line:gsub("^%s*=", "return ", 1) -- `=x`: Lua 5.1's `return x`
      local chunk, err = compile(code)
      if chunk then
        code = nil
        evaluate(chunk, env)
      elseif not err:match("<eof>'?$") then -- an error, not just unfinished: drop the statement
        code = nil
        report(err)
      end
    end
  end
  -- Input ended inside a statement: say so rather than drop it silently.
  if code then report(select(2, compile(code))) end
  if reader.interactive then io.write("\n") end
  reader:close()
end

-- `titan repl [--world N] [RECIPE.lua] [--key=value ...]`: the options of
-- M.run for a job's layout. With a recipe, the job's config is resolved (the
-- trainer's one-line errors for keys the world cannot satisfy) and its
-- model laid out on the meta device for every rank as the trainer lays it
-- out (lua/parallel/placements.lua), without weights or devices: `mesh`,
-- `model` (this rank's part), `params` (this rank's parameters by name, as
-- DTensors), `memory()` (this rank's bytes), `rank(r)` (act as rank r).
-- With --world alone: a mesh of N ranks to try placements on. Neither:
-- nil (the plain prompt).
function M.job_opts(argv)
  local world, recipe, keys = nil, nil, {}
  local i = 1
  while argv[i] do
    local a = argv[i]
    if a == "--world" or a:match("^%-%-world=") then
      local v = a:match("^%-%-world=(.*)$")
      if not v then
        i = i + 1
        v = argv[i]
      end
      world = tonumber(v)
      if not world or world < 1 or world % 1 ~= 0 then
        error(("repl: --world %s; expected a number of ranks >= 1"):format(tostring(v)), 0)
      end
    elseif a:match("^%-%-") then
      keys[#keys + 1] = a
    elseif not recipe then
      recipe = a
    else
      error(("repl: '%s' after the recipe %s; expected --key=value overrides"):format(a, recipe), 0)
    end
    i = i + 1
  end
  if not world and not recipe then
    if #keys > 0 then error(("repl: %s without a recipe; expected titan repl [--world N] RECIPE.lua [--key=value ...]")
      :format(keys[1]), 0) end
    return nil
  end
  world = world or 1
  local dt = require("titan.dtensor")
  local env = { dtensor = dt, Shard = dt.Shard, Replicate = dt.Replicate, Partial = dt.Partial }
  local current = 0
  local function prompt(more) return more and ">> " or ("rank %d> "):format(current) end
  -- rank(r): the prompt acts as rank r from now on (at(r) sets its globals)
  local function switcher(at)
    return function(r)
      if type(r) ~= "number" or r < 0 or r >= world or r % 1 ~= 0 then
        error(("rank(%s): expected a rank from 0 to %d"):format(tostring(r), world - 1), 2)
      end
      at(r)
      return r
    end
  end
  if not recipe then
    local meshlib = require("titan.mesh")
    local function at(r)
      env.mesh = meshlib.new({ "world" }, { world }, { rank = r, fake = true })
      current = r
    end
    at(0)
    env.rank = switcher(at)
    return { env = env, prompt = prompt, banner = ("titan repl: %d simulated ranks (rank(r) switches); `mesh`, "
      .. "Shard, Replicate, Partial, dtensor are loaded; Ctrl-D exits"):format(world) }
  end
  local config = require("titan.config")
  local cfg = config.resolve(config.load_recipe(recipe), keys)
  -- (the layout comes from the model family's parallel layer: lua/parallel/placements.lua)
  local parallel = require("models." .. cfg.model.name).parallel()
  local function at(r)
    local job = parallel.layout(cfg, world, r)
    env.job, env.mesh, env.model, env.params, env.cfg = job, job.mesh, job.model, job.params, cfg
    current = r
  end
  at(0)
  env.rank = switcher(at)
  -- this rank's bytes of parameters, gradients and optimizer state, in GiB
  env.memory = function()
    local m = env.job:memory()
    return { params_gib = m.params / 2 ^ 30, grads_gib = m.grads / 2 ^ 30, optimizer_gib = m.optimizer / 2 ^ 30,
      total_gib = m.total / 2 ^ 30 }
  end
  return { env = env, prompt = prompt, banner = ("titan repl: %s %s laid out on %d rank(s), rank 0 (rank(r) switches); "
    .. "mesh, model, params, memory() are loaded; Ctrl-D exits"):format(cfg.model.name, cfg.model.flavor, world) }
end

return M
