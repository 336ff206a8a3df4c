-- mesh.lua — TorchTitan's DeviceMesh: named dims laid over the ranks,
-- row-major (the last dim fastest), and a process group per dim, per
-- flattened set of dims and per view.
--
--   local mesh = require("titan.mesh")
--   local m = mesh.new{ dims = { "pp", "dp_replicate", "dp_shard", "cp", "tp" }, shape = { 1, 1, 2, 1, 2 },
--                       rank = r, group = dist.world_group() }
--   m:size("tp"), m:local_rank({ "dp_shard", "cp" }), m:ranks("tp")   -- arithmetic, works offline
--   m:flatten({ "dp_replicate", "dp_shard", "cp" }, "dp_cp")          -- a name usable like a dim
--   m:ep_views(2)                                                     -- "ep" and "ep_replica"
--   local tp = m:group("tp")                                          -- split of the root group (collective)
--   print(m)                                                          -- the layout, for humans
--
-- Which ranks share a group is pure arithmetic: everything but m:group()
-- works without any process group (REPL, estimates), and only m:group()
-- communicates. m:group() splits the root group (opts.group), which is
-- collective over the root's ranks: every rank must ask for the same groups
-- in the same order (SPMD), including dims of size 1 (MPI's split gives no
-- way to make a group without every rank taking part). Groups are cached,
-- so asking again costs nothing and returns the same group.
--
-- A selector (`dims` below) is a dim name ("tp"), a view name ("dp_cp",
-- "ep"), or a list of dim and flattened-view names in mesh order
-- ({ "dp_shard", "cp" }); nil means the whole mesh. Ranks are the mesh's:
-- 0 .. world-1 (a sub-mesh counts its own; m:global_rank maps them back to
-- the root mesh's).
local M = {}

local floor = math.floor

local Mesh = {}
M.Mesh = Mesh

local function fail(fmt, ...)
  error("mesh: " .. (select("#", ...) > 0 and fmt:format(...) or fmt), 0)
end

local function copy(t)
  local out = {}
  for i, v in ipairs(t) do out[i] = v end
  return out
end

local function is_int(v) return type(v) == "number" and v == floor(v) and v > -math.huge and v < math.huge end

-- Dim names resolve through __index (m.tp is m:sub("tp")) after the
-- methods: a dim named like a method ("size") is reached with m:sub only.
-- Instance fields all start with "_", so they never hide a dim.
local meta = {}
meta.__index = function(self, k)
  local method = Mesh[k]
  if method ~= nil then return method end
  if type(k) == "string" and k:sub(1, 1) ~= "_" and self:has(k) then return self:sub(k) end
  return nil
end
meta.__tostring = function(self) return self:summary() end
M.meta = meta

-- A mesh with validated names, shape and rank (sub-meshes come this way too).
local function make(names, shape, rank)
  local self = setmetatable({}, meta)
  self._names, self._shape, self._index, self._stride = copy(names), copy(shape), {}, {}
  for i, n in ipairs(names) do self._index[n] = i end
  local s = 1
  for i = #shape, 1, -1 do
    self._stride[i] = s
    s = s * shape[i]
  end
  self._world, self._rank = s, rank
  -- views: name -> { name, dims = {i...} } (flattened) or { name, size, color, key, groups } (add_view)
  self._views, self._view_order = {}, {}
  self._groups, self._subs = {}, {}       -- caches: process groups by selector key, sub-meshes by selector
  return self
end

-- mesh.new{ dims = names, shape = sizes, rank = r, group = root, fake = bool }
-- or mesh.new(names, shape, opts). rank defaults to the root group's rank
-- (0 without one: an offline mesh). group: the process group of all the
-- mesh's ranks, in mesh rank order, that m:group() splits; without it
-- m:group() errors, unless fake = true (fake-backend groups of the right
-- sizes: estimates, the REPL).
function M.new(a, shape, opts)
  local names
  if type(a) == "table" and a.dims ~= nil then
    opts, names, shape = a, a.dims, a.shape
  else
    names, opts = a, opts or {}
  end
  if type(names) ~= "table" or #names == 0 then
    fail("dims is %s; expected a list of dim names, e.g. { \"dp_shard\", \"tp\" }", type(names) == "table" and
      "an empty list" or tostring(names))
  end
  if type(shape) ~= "table" then
    fail("shape is %s; expected a list of %d sizes, one per dim", tostring(shape), #names)
  end
  if #shape ~= #names then
    fail("%d dims (%s) but %d sizes; expected one size per dim", #names, table.concat(names, ", "), #shape)
  end
  local seen = {}
  for i, n in ipairs(names) do
    if type(n) ~= "string" or n == "" or n:sub(1, 1) == "_" then
      fail("dim %d is named %s; expected a non-empty string not starting with '_'", i,
        type(n) == "string" and ("'" .. n .. "'") or tostring(n))
    end
    if seen[n] then fail("dims %d and %d are both named '%s'; expected unique names", seen[n], i, n) end
    seen[n] = i
    local s = shape[i]
    if not is_int(s) or s < 1 then fail("dim '%s' has size %s; expected a positive integer", n, tostring(s)) end
  end
  local world = 1
  for _, s in ipairs(shape) do world = world * s end
  local group = opts.group
  local rank = opts.rank
  if group ~= nil then
    if group:size() ~= world then
      fail("the root group has %d ranks, the mesh %s = %d; expected a group of all %d ranks", group:size(),
        table.concat(shape, " x "), world, world)
    end
    if rank ~= nil and rank ~= group:rank() then
      fail("rank = %s, but this process is rank %d of the root group; expected the same rank", tostring(rank),
        group:rank())
    end
    rank = group:rank()
  end
  rank = rank or 0
  if not is_int(rank) or rank < 0 or rank >= world then
    fail("rank %s is outside the %d ranks of the mesh; expected 0 <= rank < %d", tostring(rank), world, world)
  end
  local self = make(names, shape, rank)
  self._group, self._fake = group, opts.fake and true or false
  return self
end

-- TorchTitan's mesh from parallel degrees p = { pp, dp_replicate, dp_shard,
-- cp, tp, ep } (missing ones are 1): [pp, dp_replicate, dp_shard, cp, tp],
-- with TorchTitan's flattened views dp (dp_replicate x dp_shard: data
-- loading), dp_shard_cp (FSDP's shards), dp_cp (the loss and DDP's sums:
-- the trainer's data-parallel group) and, when ep > 1, the ep views.
-- world: the number of ranks (checked against the degrees; nil: their
-- product). opts: as mesh.new's (group, fake).
function M.from_parallelism(p, world, rank, opts)
  opts = opts or {}
  local dims = { "pp", "dp_replicate", "dp_shard", "cp", "tp" }
  local shape = {}
  for i, d in ipairs(dims) do shape[i] = p[d] or 1 end
  local n = 1
  for _, s in ipairs(shape) do n = n * (is_int(s) and s or 0 / 0) end
  if world ~= nil and n ~= world then
    fail("from_parallelism: pp x dp_replicate x dp_shard x cp x tp = %s = %s, but the job has %s rank(s); expected "
      .. "their product to equal the number of ranks", table.concat(shape, " x "), tostring(n), tostring(world))
  end
  local m = M.new{ dims = dims, shape = shape, rank = rank, group = opts.group, fake = opts.fake }
  m:flatten({ "dp_replicate", "dp_shard" }, "dp")
  m:flatten({ "dp_shard", "cp" }, "dp_shard_cp")
  m:flatten({ "dp_replicate", "dp_shard", "cp" }, "dp_cp")
  local ep = p.ep or 1
  if ep ~= 1 then m:ep_views(ep) end
  return m
end

---------------------------------------------------------------------------
-- Selectors

function Mesh:_known()
  local out = table.concat(self._names, ", ")
  if #self._view_order > 0 then out = out .. " (or a view: " .. table.concat(self._view_order, ", ") .. ")" end
  return out
end

local function dims_key(dims) return "d" .. table.concat(dims, ",") end

-- A selector as { dims = {mesh dim indices, increasing}, key } or { view, key }.
function Mesh:_resolve(sel)
  if sel == nil then
    local all = {}
    for i = 1, #self._names do all[i] = i end
    return { dims = all, key = dims_key(all) }
  end
  if type(sel) == "string" then
    local i = self._index[sel]
    if i then return { dims = { i }, key = dims_key({ i }) } end
    local v = self._views[sel]
    if v and v.dims then return { dims = v.dims, key = dims_key(v.dims) } end
    if v then return { view = v, key = "v:" .. sel } end
    fail("unknown dim '%s'; expected one of %s", sel, self:_known())
  end
  if type(sel) ~= "table" or #sel == 0 then
    fail("dims are %s; expected a dim name or a list of them, e.g. { \"dp_shard\", \"cp\" }",
      type(sel) == "table" and "an empty list" or tostring(sel))
  end
  if #sel == 1 then return self:_resolve(sel[1]) end
  local dims, from = {}, {}
  for _, name in ipairs(sel) do
    if type(name) ~= "string" then fail("dims list holds %s; expected dim names", tostring(name)) end
    local r = self:_resolve(name)
    if r.view then
      fail("view '%s' cannot be combined with other dims; expected it alone, or dims and flattened views", name)
    end
    for _, i in ipairs(r.dims) do
      if from[i] then
        fail("dims { %s } name dim '%s' twice (%s and %s); expected each dim once", table.concat(sel, ", "),
          self._names[i], from[i], name)
      end
      from[i] = name
      dims[#dims + 1] = i
    end
  end
  for k = 2, #dims do
    if dims[k] < dims[k - 1] then
      local sorted = copy(dims)
      table.sort(sorted)
      local want = {}
      for j, i in ipairs(sorted) do want[j] = self._names[i] end
      fail("dims { %s } are not in mesh order; expected { %s }", table.concat(sel, ", "), table.concat(want, ", "))
    end
  end
  return { dims = dims, key = dims_key(dims) }
end

-- The dims not in s.dims, in mesh order.
local function complement(self, dims)
  local inside, out = {}, {}
  for _, i in ipairs(dims) do inside[i] = true end
  for i = 1, #self._names do if not inside[i] then out[#out + 1] = i end end
  return out
end

local function product(self, dims)
  local n = 1
  for _, i in ipairs(dims) do n = n * self._shape[i] end
  return n
end

local function coord(self, r)
  local c = {}
  for i = 1, #self._shape do c[i] = floor(r / self._stride[i]) % self._shape[i] end
  return c
end

-- The row-major index of coordinates c over dims.
local function index_over(self, c, dims)
  local idx = 0
  for _, i in ipairs(dims) do idx = idx * self._shape[i] + c[i] end
  return idx
end

-- The rank whose coordinates over dims are those of index k (row-major)
-- and elsewhere those of base (whose coordinates over dims are 0).
local function place(self, dims, k, base)
  local r = base
  for j = #dims, 1, -1 do
    local i = dims[j]
    local s = self._shape[i]
    r = r + (k % s) * self._stride[i]
    k = floor(k / s)
  end
  return r
end

local function check_rank(self, r, what)
  if not is_int(r) or r < 0 or r >= self._world then
    fail("%s: rank %s is outside the %d ranks of the mesh; expected 0 <= rank < %d", what, tostring(r), self._world,
      self._world)
  end
end

-- The group of r under s (its ranks in group order), the index of that
-- group among all of s's (color) and r's index inside it (key).
local function locate(self, s, r)
  if s.view then
    local v = s.view
    local gi = v.color[r]
    return v.groups[gi + 1], gi, v.key[r]
  end
  local c = coord(self, r)
  local base = r
  for _, i in ipairs(s.dims) do base = base - c[i] * self._stride[i] end
  local ranks = {}
  for k = 0, product(self, s.dims) - 1 do ranks[k + 1] = place(self, s.dims, k, base) end
  return ranks, index_over(self, c, complement(self, s.dims)), index_over(self, c, s.dims)
end

local function ngroups(self, s)
  if s.view then return #s.view.groups end
  return self._world / product(self, s.dims)
end

-- Group gi (0-based) of s, as a list of ranks.
local function group_at(self, s, gi)
  if s.view then return copy(s.view.groups[gi + 1]) end
  local base = place(self, complement(self, s.dims), gi, 0)
  local ranks = {}
  for k = 0, product(self, s.dims) - 1 do ranks[k + 1] = place(self, s.dims, k, base) end
  return ranks
end

---------------------------------------------------------------------------
-- Shape and coordinates

function Mesh:world() return self._world end
function Mesh:rank() return self._rank end
function Mesh:ndim() return #self._names end
function Mesh:names() return copy(self._names) end
function Mesh:shape() return copy(self._shape) end

-- Whether name is a dim or a view of this mesh.
function Mesh:has(name) return self._index[name] ~= nil or self._views[name] ~= nil end

-- The views' names, in the order they were added.
function Mesh:views() return copy(self._view_order) end

-- The number of ranks along dims (nil: the whole mesh).
function Mesh:size(dims)
  local s = self:_resolve(dims)
  if s.view then return s.view.size end
  return product(self, s.dims)
end

-- This rank's coordinates (0-based), by dim index.
function Mesh:coord() return coord(self, self._rank) end

function Mesh:coord_of(r)
  check_rank(self, r, "coord_of")
  return coord(self, r)
end

-- The rank at coordinates c: a list by dim index, or a table by dim name.
function Mesh:rank_of(c)
  if type(c) ~= "table" then fail("rank_of: coordinates are %s; expected a table of %d", tostring(c), #self._names) end
  local r = 0
  for i, n in ipairs(self._names) do
    local v = c[i]
    if v == nil then v = c[n] end
    if not is_int(v) or v < 0 or v >= self._shape[i] then
      fail("rank_of: coordinate %s of dim '%s' is %s; expected 0 <= it < %d", i, n, tostring(v), self._shape[i])
    end
    r = r + v * self._stride[i]
  end
  return r
end

-- This rank's index along dims (a dim, a flattened set, a view).
function Mesh:local_rank(dims)
  local _, _, key = locate(self, self:_resolve(dims), self._rank)
  return key
end

-- The ranks of the group along dims that holds rank r (default this rank),
-- in group order (row-major over the dims: the order of group ranks).
function Mesh:ranks(dims, r)
  local s = self:_resolve(dims)
  if r == nil then r = self._rank end
  check_rank(self, r, "ranks")
  return copy((locate(self, s, r)))
end

-- Every group along dims, as lists of ranks; group i is the one whose color
-- in m:group's split is i - 1 (ordered by their first rank).
function Mesh:groups(dims)
  local s = self:_resolve(dims)
  local out = {}
  for gi = 0, ngroups(self, s) - 1 do out[gi + 1] = group_at(self, s, gi) end
  return out
end

-- Rank r of this mesh (default this rank) as a rank of the root mesh.
function Mesh:global_rank(r)
  if r == nil then r = self._rank end
  check_rank(self, r, "global_rank")
  if self._parent then return self._parent:global_rank(self._parent_ranks[r + 1]) end
  return r
end

---------------------------------------------------------------------------
-- Views

function Mesh:_add(name, v)
  if type(name) ~= "string" or name == "" or name:sub(1, 1) == "_" then
    fail("a view is named %s; expected a non-empty string not starting with '_'", tostring(name))
  end
  if self:has(name) then
    fail("'%s' is already a %s of the mesh; expected a new name", name, self._index[name] and "dim" or "view")
  end
  v.name = name
  self._views[name] = v
  self._view_order[#self._view_order + 1] = name
  self._subs = {} -- (sub-meshes inherit the flattened views they hold: make them afresh)
end

-- A named view of dims flattened into one (TorchTitan's _flatten): usable
-- wherever a dim name is, its groups the same as the dims'. name defaults
-- to the dim names joined by "_". Returns the view's 1-D sub-mesh.
function Mesh:flatten(dims, name)
  local s = self:_resolve(dims)
  if s.view then fail("flatten: '%s' is a view of its own; expected dims or flattened views", s.view.name) end
  if name == nil then
    local parts = {}
    for j, i in ipairs(s.dims) do parts[j] = self._names[i] end
    name = table.concat(parts, "_")
  end
  self:_add(name, { dims = s.dims })
  return self:sub(name)
end

-- A view whose groups any function gives: fn(r, mesh) returns the ranks of
-- the group that holds rank r, in group order. The groups must partition
-- the ranks and have one size. It is called once per group (for the first
-- rank of each group not yet placed), here; the view keeps the groups.
function Mesh:add_view(name, fn)
  if type(fn) ~= "function" then fail("add_view '%s': %s; expected a function(rank, mesh) -> ranks", tostring(name),
    tostring(fn)) end
  local color, key, groups, size = {}, {}, {}, nil
  for r = 0, self._world - 1 do
    if color[r] == nil then
      local g = fn(r, self)
      if type(g) ~= "table" or #g == 0 then
        fail("view '%s': the group of rank %d is %s; expected a list of ranks", tostring(name), r, tostring(g))
      end
      size = size or #g
      if #g ~= size then
        fail("view '%s': the group of rank %d has %d ranks, an earlier one %d; expected groups of one size",
          tostring(name), r, #g, size)
      end
      local gi = #groups
      for k, q in ipairs(g) do
        check_rank(self, q, ("view '%s'"):format(tostring(name)))
        if color[q] ~= nil then
          fail("view '%s': rank %d is in the group of rank %d and in that of rank %d; expected groups that do not "
            .. "overlap", tostring(name), q, r, groups[color[q] + 1][1])
        end
        color[q], key[q] = gi, k - 1
      end
      if color[r] == nil then
        fail("view '%s': the group of rank %d leaves it out; expected a list holding rank %d", tostring(name), r, r)
      end
      groups[gi + 1] = copy(g)
    end
  end
  self:_add(name, { size = size, color = color, key = key, groups = groups })
  return self
end

-- Expert parallelism's views, as the trainer groups them: the data-parallel
-- ranks (opts.dims, default those of dp_replicate, dp_shard, cp the mesh
-- has, flattened in that order) fall into runs of ep consecutive ones
-- ("ep": the ranks sharing one MoE layer's experts), and the ranks at the
-- same place of every run hold the same experts ("ep_replica"; of size 1
-- when one run covers them all: the trainer's nil ep_replicas). Names:
-- opts.names (default { "ep", "ep_replica" }).
function Mesh:ep_views(ep, opts)
  opts = opts or {}
  local base = opts.dims
  if base == nil then
    base = {}
    for _, d in ipairs({ "dp_replicate", "dp_shard", "cp" }) do if self:has(d) then base[#base + 1] = d end end
    if #base == 0 then
      fail("ep_views: the mesh has none of dp_replicate, dp_shard, cp; expected opts.dims, the data-parallel dims")
    end
  end
  local nd = self:size(base)
  if not is_int(ep) or ep < 1 or nd % ep ~= 0 then
    fail("ep_views: ep = %s, but the data-parallel ranks (%s) are %d; expected a divisor of %d", tostring(ep),
      type(base) == "table" and table.concat(base, " x ") or base, nd, nd)
  end
  local names = opts.names or { "ep", "ep_replica" }
  self:add_view(names[1], function(r)
    local dp, at = self:ranks(base, r), 0
    for k, q in ipairs(dp) do if q == r then at = k - 1 end end
    local out, first = {}, floor(at / ep) * ep
    for k = 1, ep do out[k] = dp[first + k] end
    return out
  end)
  self:add_view(names[2], function(r)
    local dp, at = self:ranks(base, r), 0
    for k, q in ipairs(dp) do if q == r then at = k - 1 end end
    local out = {}
    for k = at % ep, nd - 1, ep do out[#out + 1] = dp[k + 1] end
    return out
  end)
  return self
end

---------------------------------------------------------------------------
-- Sub-meshes

-- The mesh of the group along dims that holds this rank (TorchTitan's
-- mesh["tp"], mesh["dp_shard", "cp"]): one dim per name given, each with
-- its size (a flattened view becomes one dim), ranks counted 0 .. n-1 in
-- group order. Its groups are this mesh's (the same cached objects); the
-- flattened views of this mesh that its dims hold carry over. Also m.tp,
-- m.dp_cp for names that are not methods.
function Mesh:sub(dims)
  if dims == nil then fail("sub: no dims; expected a dim name or a list of them") end
  local ckey = type(dims) == "table" and table.concat(dims, "\0") or dims
  local cached = self._subs[ckey]
  if cached then return cached end
  local s = self:_resolve(dims)
  local list = type(dims) == "string" and { dims } or dims
  local shape, pdims = {}, {}
  for j, name in ipairs(list) do
    shape[j] = self:size(name)
    pdims[j] = self:_resolve(name).dims -- (nil for a view: it stays whole)
  end
  local _, _, key = locate(self, s, self._rank)
  local sub = make(list, shape, key)
  sub._parent, sub._parent_ranks, sub._fake = self, self:ranks(dims), self._fake
  -- Flattened views of this mesh whose dims are whole dims of the sub.
  for _, vname in ipairs(self._view_order) do
    local v = self._views[vname]
    if v.dims and not sub._index[vname] then
      local want, got, js = {}, 0, {}
      for _, i in ipairs(v.dims) do want[i] = true end
      local ok = true
      for j, pd in ipairs(pdims) do
        if pd then
          local n = 0
          for _, i in ipairs(pd) do if want[i] then n = n + 1 end end
          if n == #pd then js[#js + 1] = j; got = got + n elseif n > 0 then ok = false end
        end
      end
      if ok and got == #v.dims then sub:_add(vname, { dims = js }) end
    end
  end
  self._subs[ckey] = sub
  return sub
end

---------------------------------------------------------------------------
-- Process groups

local function fake_group(rank, size)
  return require("titan.dist").new_group({ backend = "fake", rank = rank, world = size })
end

local function is_fake(g) return type(g.backend) == "function" and g:backend() == "fake" end

-- The group of all this mesh's ranks: the root group, or the parent's group
-- of this sub-mesh's dims; a fake one when offline with fake = true.
function Mesh:_root()
  if self._parent then return self._parent:group(self._names) end
  if self._group then return self._group end
  if self._fake then
    self._fake_root = self._fake_root or fake_group(self._rank, self._world)
    return self._fake_root
  end
  fail("group: this mesh has no process group to split (made without opts.group: an offline mesh); expected "
    .. "opts.group = the group of its %d ranks, or opts.fake = true for fake groups (estimates, the REPL)", self._world)
end

-- This rank's process group along dims (nil: the whole mesh), made once by
-- splitting the root group with color = the index of this rank's group
-- among m:groups(dims) and key = its index inside it. Collective over the
-- root group: every rank asks for the same groups in the same order. Over a
-- fake root (or offline with fake = true), a fake group of the group's size
-- with this rank's index (the fake backend's own split knows no other rank,
-- and gives groups of one).
function Mesh:group(dims)
  local s = self:_resolve(dims)
  if self._parent and s.dims then
    -- (the parent's group of the same dims: one communicator, cached there)
    local names = {}
    for j, i in ipairs(s.dims) do names[j] = self._names[i] end
    return self._parent:group(names)
  end
  local g = self._groups[s.key]
  if g then return g end
  if s.dims and #s.dims == #self._names then
    g = self:_root()
  else
    local root = self:_root()
    local _, color, key = locate(self, s, self._rank)
    if is_fake(root) then
      g = fake_group(key, s.view and s.view.size or product(self, s.dims))
    else
      g = root:split(color, key)
      if g.set_label then -- (the watchdog's name for it: dims and the job's ranks)
        local ranks = {}
        for i, r in ipairs((locate(self, s, self._rank))) do ranks[i] = self:global_rank(r) end
        local name = s.dims and table.concat(self:_names_of(s.dims), " x ") or s.key:gsub("^v:", "")
        g:set_label(("%s [%s]"):format(name, table.concat(ranks, ",")))
      end
    end
  end
  self._groups[s.key] = g
  return g
end

-- The process groups this mesh has made so far, each with a label naming
-- the dims it spans ("tp", "dp_shard_cp", "dp_replicate x dp_shard", "ep";
-- "world" for the whole mesh): { { label =, group = }, ... } in a fixed order.
function Mesh:made_groups()
  local out = {}
  for k, g in pairs(self._groups) do
    local label
    local views = self._views
    if k:sub(1, 2) == "v:" then label = k:sub(3) end
    if not label then
      local idx = k:match("^d(.*)$")
      if idx then
        local names = {}
        for i in idx:gmatch("%d+") do names[#names + 1] = self._names[tonumber(i)] end
        label = #names == #self._names and "world" or table.concat(names, " x ")
        -- (a flattened view spanning exactly these dims is named by it)
        for _, vname in ipairs(self._view_order) do
          local v = views[vname]
          if v.dims and dims_key(v.dims) == k then label = vname end
        end
      else
        label = k
      end
    end
    out[#out + 1] = { label = label, group = g }
  end
  table.sort(out, function(a, b) return a.label < b.label end)
  return out
end

-- Frees the groups this mesh made (not the root group it was given); its
-- sub-meshes' groups are this mesh's. A later m:group() makes them again.
function Mesh:free()
  for k, g in pairs(self._groups) do
    if g ~= self._group and g.free then g:free() end
    self._groups[k] = nil
  end
  for _, sub in pairs(self._subs) do sub:free() end
  if self._fake_root then self._fake_root:free(); self._fake_root = nil end
end

---------------------------------------------------------------------------
-- Printing

-- Ranks as text: runs of 3 or more consecutive ranks as a-b; with `limit`,
-- more than limit pieces show the first three, "...", and the last.
local function fmt_ranks(ranks, limit)
  local parts, i, n = {}, 1, #ranks
  while i <= n do
    local j = i
    while j < n and ranks[j + 1] == ranks[j] + 1 do j = j + 1 end
    if j - i >= 2 then
      parts[#parts + 1] = ranks[i] .. "-" .. ranks[j]
    else
      for k = i, j do parts[#parts + 1] = tostring(ranks[k]) end
    end
    i = j + 1
  end
  if limit and #parts > limit then
    parts = { parts[1], parts[2], parts[3], "...", parts[#parts] }
  end
  return "[" .. table.concat(parts, ",") .. "]"
end
M.fmt_ranks = fmt_ranks

-- The groups of s on one line: all of them, or the first three, "..." and
-- the last.
local function fmt_groups(self, s, short)
  local n = ngroups(self, s)
  local idx = {}
  if short and n > 4 then
    idx = { 0, 1, 2, false, n - 1 }
  else
    for gi = 0, n - 1 do idx[#idx + 1] = gi end
  end
  local parts = {}
  for _, gi in ipairs(idx) do
    parts[#parts + 1] = gi and fmt_ranks(group_at(self, s, gi), short and 5 or nil) or "..."
  end
  return table.concat(parts, " ")
end

local function plural(n, word) return n .. " " .. word .. (n == 1 and "" or "s") end

function Mesh:_header(all)
  local dims, here = {}, {}
  local c = coord(self, self._rank)
  local big = 0
  for _, s in ipairs(self._shape) do if s > 1 then big = big + 1 end end
  for i, n in ipairs(self._names) do
    if all or big == 0 or self._shape[i] > 1 then
      dims[#dims + 1] = n .. " " .. self._shape[i]
      here[#here + 1] = n .. " " .. c[i]
    end
  end
  return ("DeviceMesh %s: %s (this rank %d: %s)"):format(plural(self._world, "rank"), table.concat(dims, " x "),
    self._rank, table.concat(here, ", "))
end

-- The groups line of a flattened view: its dims of size > 1, joined by x.
function Mesh:_view_dims(v)
  local big = {}
  for _, i in ipairs(v.dims) do if self._shape[i] > 1 then big[#big + 1] = self._names[i] end end
  return big
end

-- Short: the header, the dims of size 1, then per dim and view of size > 1
-- its groups (the first three and the last; flattened views that group the
-- ranks as one dim does are named on one line). A few lines whatever the size.
function Mesh:summary()
  local lines = { self:_header(false) }
  local ones = {}
  for i, n in ipairs(self._names) do if self._shape[i] == 1 then ones[#ones + 1] = n end end
  if #ones > 0 and #ones < #self._names then lines[#lines + 1] = "  size 1: " .. table.concat(ones, ", ") end
  if self._parent then lines[#lines + 1] = "  ranks of the parent mesh: " .. fmt_ranks(self._parent_ranks, 5) end
  local function line(label, s)
    lines[#lines + 1] = ("  %s (%s of %s): %s"):format(label, plural(ngroups(self, s), "group"),
      plural(s.view and s.view.size or product(self, s.dims), "rank"), fmt_groups(self, s, true))
  end
  for i, n in ipairs(self._names) do
    if self._shape[i] > 1 then line(n .. " groups", { dims = { i } }) end
  end
  local same = {}
  for _, vname in ipairs(self._view_order) do
    local v = self._views[vname]
    if v.dims then
      local big = self:_view_dims(v)
      if #big == 1 then
        same[big[1]] = same[big[1]] or {}
        table.insert(same[big[1]], vname)
      elseif #big > 1 then
        line(("%s = %s groups"):format(vname, table.concat(big, " x ")), { dims = v.dims })
      end
    elseif v.size > 1 then
      line(vname .. " (view) groups", { view = v })
    end
  end
  for _, n in ipairs(self._names) do
    if same[n] then lines[#lines + 1] = ("  %s: the %s groups"):format(table.concat(same[n], ", "), n) end
  end
  return table.concat(lines, "\n")
end

function Mesh:_names_of(dims)
  local out = {}
  for j, i in ipairs(dims) do out[j] = self._names[i] end
  return out
end

-- Lines of at most ~100 characters from pieces, each continued line indented.
local function wrap(prefix, pieces, indent)
  local lines, cur = {}, prefix
  for _, p in ipairs(pieces) do
    if #cur + 1 + #p > 100 and cur ~= prefix then
      lines[#lines + 1] = cur
      cur = indent .. p
    else
      cur = cur .. (cur == prefix and "" or " ") .. p
    end
  end
  lines[#lines + 1] = cur
  return lines
end

-- Long: every dim (size, stride, this rank's index) and every group of
-- every dim and view, in full. For small meshes (it grows with the ranks).
function Mesh:describe()
  local lines = { self:_header(true) }
  if self._parent then lines[#lines + 1] = "  ranks of the parent mesh: " .. fmt_ranks(self._parent_ranks) end
  local function groups_of(label, s, size)
    if size == 1 then
      lines[#lines + 1] = label .. " every rank alone"
      return
    end
    lines[#lines + 1] = label
    local pieces = {}
    for gi = 0, ngroups(self, s) - 1 do pieces[#pieces + 1] = fmt_ranks(group_at(self, s, gi)) end
    for _, l in ipairs(wrap("    ", pieces, "    ")) do lines[#lines + 1] = l end
  end
  local c = coord(self, self._rank)
  for i, n in ipairs(self._names) do
    groups_of(("  %s: size %d, stride %d, this rank %d; groups:"):format(n, self._shape[i], self._stride[i], c[i]),
      { dims = { i } }, self._shape[i])
  end
  for _, vname in ipairs(self._view_order) do
    local v = self._views[vname]
    local s = v.dims and { dims = v.dims } or { view = v }
    local size = v.dims and product(self, v.dims) or v.size
    local what = v.dims and ("= " .. table.concat(self:_names_of(v.dims), " x ")) or "(view)"
    local _, _, key = locate(self, s, self._rank)
    groups_of(("  %s %s: size %d, this rank %d; groups:"):format(vname, what, size, key), s, size)
  end
  return table.concat(lines, "\n")
end

return M
