-- pretty.lua — Lua values as text a person reads: what the REPL prints.
--
--   pretty.format({ 3, 1, name = "x", sub = { a = true } })
--     --> { 3, 1, name = "x", sub = { a = true } }
--
-- Tables print nested: on one line when they fit, else one entry a line,
-- indented (array parts packed several to a line). Keys are sorted (numbers
-- in order, then strings, then the rest), so the same table always prints the
-- same. Values that know how to print themselves (a __tostring metamethod:
-- tensors, meshes, DTensors) and cdata print through tostring.
local M = {}

M.defaults = {
  depth = 4,      -- tables nested deeper print as {...}
  max_items = 100, -- entries shown per table before "... (N more)"
  width = 80,     -- a table goes on one line when it fits in this many columns
  indent = "  ",
}

local KEYWORDS = {}
for w in ([[and break do else elseif end false for function goto if in local nil not or repeat
            return then true until while]]):gmatch("%a+") do KEYWORDS[w] = true end

-- s in double quotes with escapes, as %q would write it but on one line:
-- control characters as \n, \t, \r or \ddd (three digits, so a digit after
-- one cannot be read as part of it); bytes over 127 (UTF-8 text) as they are.
local ESCAPES = { ['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\t"] = "\\t", ["\r"] = "\\r" }
function M.quote(s)
  return '"' .. s:gsub('[%c"\\]', function(c) return ESCAPES[c] or ("\\%03d"):format(c:byte()) end) .. '"'
end

-- The shortest of %.14g (what tostring writes) .. %.17g that reads back as
-- the same number: 0.1 stays 0.1, 0.1 + 0.2 shows its last digit, and 2^53
-- is not rounded to 9.007199254741e+15.
local function number(x)
  if x ~= x then return "nan" end
  if x == math.huge then return "inf" end
  if x == -math.huge then return "-inf" end
  for digits = 14, 17 do
    local s = ("%." .. digits .. "g"):format(x)
    if tonumber(s) == x or digits == 17 then return s end
  end
end

-- tostring, and what it raised if a __tostring failed.
local function safe_tostring(v)
  local ok, s = pcall(tostring, v)
  if ok then return tostring(s) end
  return "<tostring error: " .. tostring(s) .. ">"
end

local TYPE_ORDER = { number = 1, string = 2, boolean = 3 }

local function key_less(a, b)
  local ta, tb = type(a), type(b)
  if ta ~= tb then
    local oa, ob = TYPE_ORDER[ta] or 4, TYPE_ORDER[tb] or 4
    if oa ~= ob then return oa < ob end
    return ta < tb
  end
  if ta == "number" or ta == "string" then return a < b end
  if ta == "boolean" then return not a and b end
  return safe_tostring(a) < safe_tostring(b)
end

local format_value

-- `name = `, or `[key] = ` when key is not an identifier.
local function key_text(k, o, level, seen)
  if type(k) == "string" and k:match("^[%a_][%w_]*$") and not KEYWORDS[k] then return k .. " = " end
  return "[" .. format_value(k, o, level, seen, 0) .. "] = "
end

-- t's entries as text: the array part first (t[1] .. t[n], no keys), then
-- the other keys sorted. Returns the items and how many were left out.
local function items_of(t, o, level, seen)
  local n = 0
  while rawget(t, n + 1) ~= nil do n = n + 1 end
  local keys = {}
  for k in next, t do
    if not (type(k) == "number" and k >= 1 and k <= n and k % 1 == 0) then keys[#keys + 1] = k end
  end
  table.sort(keys, key_less)
  local items, total = {}, n + #keys
  local shown = math.min(total, o.max_items)
  local pad = #o.indent * level
  for i = 1, math.min(n, shown) do
    items[#items + 1] = { array = true, text = format_value(rawget(t, i), o, level, seen, pad) }
  end
  for i = 1, shown - n do
    local k = keys[i]
    local prefix = key_text(k, o, level, seen)
    items[#items + 1] = { text = prefix .. format_value(rawget(t, k), o, level, seen, pad + #prefix) }
  end
  return items, total - shown
end

local function format_table(t, o, level, seen, col)
  if next(t) == nil then return "{}" end
  if seen[t] then return "<cycle>" end
  if level >= o.depth then return "{...}" end
  seen[t] = true
  local items, more = items_of(t, o, level + 1, seen)
  seen[t] = nil
  if more > 0 then items[#items + 1] = { text = ("... (%d more)"):format(more) } end

  -- One line when every entry is one line and the whole fits.
  local texts, multiline = {}, false
  for i, it in ipairs(items) do
    texts[i] = it.text
    multiline = multiline or it.text:find("\n", 1, true) ~= nil
  end
  local flat = "{ " .. table.concat(texts, ", ") .. " }"
  if not multiline and col + #flat <= o.width then return flat end

  -- Else one entry a line, runs of short array values packed into lines.
  local pad = o.indent:rep(level + 1)
  local lines, run = {}, nil
  for i, it in ipairs(items) do
    local sep = i < #items and "," or ""
    local packable = it.array and not it.text:find("\n", 1, true)
    if packable and run and #run + 1 + #it.text + #sep <= o.width then
      run = run .. " " .. it.text .. sep
    else
      if run then lines[#lines + 1] = run end
      run = pad .. it.text .. sep
      if not packable then lines[#lines + 1] = run; run = nil end
    end
  end
  if run then lines[#lines + 1] = run end
  return "{\n" .. table.concat(lines, "\n") .. "\n" .. o.indent:rep(level) .. "}"
end

-- v as text; level: how deep in tables it sits (0: the top), seen: the
-- tables being printed around it (a table met again inside itself is a
-- cycle), col: the column it starts at.
function format_value(v, o, level, seen, col)
  local tv = type(v)
  if tv == "string" then return M.quote(v) end
  if tv == "number" then return number(v) end
  if tv == "table" then
    local mt = debug.getmetatable(v)
    if mt and mt.__tostring then return safe_tostring(v) end
    return format_table(v, o, level, seen, col)
  end
  return safe_tostring(v) -- nil, booleans, functions, cdata (its __tostring when it has one), ...
end

-- v as text. opts (all optional): depth (4: tables deeper than this print as
-- {...}), max_items (100 entries a table, then "... (N more)"), width (80
-- columns), indent ("  ").
function M.format(v, opts)
  local o = M.defaults
  if opts then
    o = setmetatable({}, { __index = M.defaults })
    for k, x in pairs(opts) do o[k] = x end
  end
  return format_value(v, o, 0, {}, 0)
end

return M
