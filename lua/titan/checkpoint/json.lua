-- checkpoint/json.lua — JSON for checkpoint metadata: cjson decodes; the
-- encoder is ours because lua-cjson 2.1 prints at most 14 significant
-- digits (byte offsets, RNG offsets and learning-rate factors need 17 to
-- round-trip), cannot write an empty array, and orders keys by hash. Here
-- numbers round-trip exactly, keys are sorted (the same state gives the same
-- bytes), and json.array(t) marks a table that must be an array even empty.
local cjson = require("cjson")

local M = {}

local array_mt = { __json_array = true }

function M.array(t) return setmetatable(t or {}, array_mt) end

-- json.float(x): x written with a decimal point even when integral (8.0,
-- not 8), for readers that check the type (transformers' rope_scaling).
local float_mt = { __json_float = true }
function M.float(x) return setmetatable({ value = x }, float_mt) end

local escapes = { ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f", ["\n"] = "\\n", ["\r"] = "\\r",
  ["\t"] = "\\t" }

local function quote(s)
  return '"' .. s:gsub('[%c"\\]', function(c) return escapes[c] or ("\\u%04x"):format(c:byte()) end) .. '"'
end

local function number(x)
  if x ~= x or x == math.huge or x == -math.huge then
    error("json: cannot encode " .. tostring(x) .. " (JSON has no NaN or infinity)", 0)
  end
  if x == math.floor(x) and math.abs(x) < 2 ^ 53 then return ("%d"):format(x) end
  local s = ("%.15g"):format(x)
  if tonumber(s) ~= x then s = ("%.17g"):format(x) end
  return s
end

local function is_array(t)
  if getmetatable(t) == array_mt then return true end
  local n = #t
  if n == 0 then return false end
  local count = 0
  for _ in pairs(t) do count = count + 1 end
  return count == n
end

local function encode(v, out, indent, depth)
  local tv = type(v)
  if tv == "nil" or v == cjson.null then
    out[#out + 1] = "null"
  elseif tv == "boolean" then
    out[#out + 1] = tostring(v)
  elseif tv == "number" then
    out[#out + 1] = number(v)
  elseif tv == "string" then
    out[#out + 1] = quote(v)
  elseif tv == "cdata" then -- 64-bit integers: exact, as a string
    out[#out + 1] = quote((tostring(v):gsub("U?LL$", "")))
  elseif tv == "table" and getmetatable(v) == float_mt then
    local s = number(v.value)
    if not s:find("[%.eEn]") then s = s .. ".0" end
    out[#out + 1] = s
  elseif tv == "table" then
    if depth > 64 then error("json: table nested too deeply (a cycle?)", 0) end
    local nl = indent and ("\n" .. (" "):rep(indent * (depth + 1))) or ""
    local close = indent and ("\n" .. (" "):rep(indent * depth)) or ""
    local sep = indent and ": " or ":"
    if is_array(v) then
      if #v == 0 then
        out[#out + 1] = "[]"
        return
      end
      -- short arrays of numbers stay on one line (shapes, offsets)
      local flat = #v <= 16
      for i = 1, #v do
        if type(v[i]) == "table" then flat = false end
      end
      out[#out + 1] = "["
      for i = 1, #v do
        if i > 1 then out[#out + 1] = flat and ", " or "," end
        if not flat then out[#out + 1] = nl end
        encode(v[i], out, indent, depth + 1)
      end
      if not flat then out[#out + 1] = close end
      out[#out + 1] = "]"
    else
      local keys = {}
      for k in pairs(v) do
        if type(k) ~= "string" and type(k) ~= "number" then error("json: keys must be strings, got " .. type(k), 0) end
        keys[#keys + 1] = tostring(k)
      end
      table.sort(keys)
      if #keys == 0 then
        out[#out + 1] = "{}"
        return
      end
      out[#out + 1] = "{"
      for i, k in ipairs(keys) do
        if i > 1 then out[#out + 1] = "," end
        out[#out + 1] = nl
        out[#out + 1] = quote(k)
        out[#out + 1] = sep
        local val = v[k]
        if val == nil then val = v[tonumber(k)] end
        encode(val, out, indent, depth + 1)
      end
      out[#out + 1] = close
      out[#out + 1] = "}"
    end
  else
    error("json: cannot encode a " .. tv, 0)
  end
end

-- encode(value[, indent]) -> string
function M.encode(v, indent)
  local out = {}
  encode(v, out, indent, 0)
  return table.concat(out)
end

-- decode(string[, what]) -> value; a malformed document is one error line naming `what`.
function M.decode(s, what)
  local ok, v = pcall(cjson.decode, s)
  if not ok then error(("%s is not valid JSON (%s)"):format(what or "document", tostring(v)), 0) end
  return v
end

M.null = cjson.null

return M
