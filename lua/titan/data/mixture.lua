-- data/mixture.lua — a weighted mixture of datasets.
--
-- Each window comes from one component, drawn with probability proportional
-- to its weight. Draw n depends only on (seed, n) (data/random.lua), so the
-- state is the draw count plus each component's own state. The draw is
-- plain Lua in :choose: a recipe replaces it (a schedule over steps, a
-- curriculum) by assigning mix.choose = function(self, n) ... end.
local random = require("titan.data.random")

local Mixture = {}
Mixture.__index = Mixture

-- The random stream mixtures draw from (distinct from window shuffles).
local STREAM = 0x6d6978

-- Mixture.new({ {ds_a, weight_a}, {ds_b, weight_b}, ... }, seed)
function Mixture.new(parts, seed)
  if type(parts) ~= "table" or #parts == 0 then error("Mixture: expected a list of {dataset, weight} pairs", 2) end
  seed = seed or 0
  if type(seed) ~= "number" or seed < 0 or seed ~= math.floor(seed) then
    error("Mixture: seed must be an integer >= 0, got " .. tostring(seed), 2)
  end
  local self = setmetatable({ components = {}, weights = {}, cumulative = {}, seed = seed, draws = 0 }, Mixture)
  local total = 0
  for i, p in ipairs(parts) do
    local ds, w = p[1], p[2]
    if type(ds) ~= "table" or type(ds.next_window) ~= "function" then
      error(("Mixture: part %d is not a dataset (expected {dataset, weight})"):format(i), 2)
    end
    if type(w) ~= "number" or not (w > 0) or w == math.huge then
      error(("Mixture: part %d (%s) has weight %s; expected a positive number"):format(i, tostring(ds.name), tostring(w)), 2)
    end
    if ds.seq_len ~= parts[1][1].seq_len then
      error(("Mixture: part %d (%s) has seq_len %s but part 1 (%s) has %s"):format(i, tostring(ds.name),
        tostring(ds.seq_len), tostring(parts[1][1].name), tostring(parts[1][1].seq_len)), 2)
    end
    self.components[i], self.weights[i] = ds, w
    total = total + w
  end
  local acc = 0
  for i, w in ipairs(self.weights) do
    acc = acc + w / total
    self.cumulative[i] = acc
  end
  self.cumulative[#self.cumulative] = 1
  self.seq_len = parts[1][1].seq_len
  self.name = "mixture"
  return self
end

-- Which component draw n (0-based) reads from.
function Mixture:choose(n)
  local u = random.uniform(self.seed, STREAM, n)
  local c = self.cumulative
  for i = 1, #c do
    if u < c[i] then return i end
  end
  return #c
end

-- next_window(dst): true, window index (within its component) and the
-- component's number; false when a finite component ends its epoch.
function Mixture:next_window(dst)
  local i = self:choose(self.draws)
  self.draws = self.draws + 1
  self.last = i
  local ok, id = self.components[i]:next_window(dst)
  if not ok then return false end
  return true, id, i
end

function Mixture:state_dict()
  local comps = {}
  for i, ds in ipairs(self.components) do comps[i] = ds:state_dict() end
  return { kind = "mixture", seed = self.seed, draws = self.draws, n = #self.components, components = comps }
end

function Mixture:load_state_dict(s)
  require("titan.data.args").state(self.name, s, "mixture", { seed = self.seed, n = #self.components })
  self.draws = s.draws
  for i, ds in ipairs(self.components) do ds:load_state_dict(s.components[i]) end
end

function Mixture:reset()
  self.draws = 0
  for _, ds in ipairs(self.components) do ds:reset() end
end

return Mixture
