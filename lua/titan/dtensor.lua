-- dtensor.lua — DTensor: a local tensor, a device mesh (mesh.lua), one
-- placement per mesh dim, and the global shape it is a piece of.
--
--   local dt = require("titan.dtensor")
--   local w = dt.distribute(full, mesh, { dt.Shard(1), dt.Replicate() })   -- this rank's rows
--   local x = dt.from_local(piece, mesh, { dt.Partial("sum") }, { shape = { 8, 4 } })
--   x = x:redistribute({ dt.Shard(2) })          -- a reduce-scatter over the mesh's dim
--   local t = x:full_tensor()                    -- the whole tensor on every rank
--   print(w)                                     -- global shape, placements, this rank's piece
--   print(w:describe())                          -- every rank's piece
--
-- Placements (DTensor's): Shard(d) cuts tensor dim d into torch.chunk
-- pieces along a mesh dim (uneven: 10 rows over 4 ranks are 3, 3, 3, 1, and
-- ranks past the end hold empty pieces), Replicate() keeps the whole on
-- each coordinate, Partial(op) holds parts whose sum (avg, max) is the
-- tensor. Tensor dims are 1-based as everywhere in Titan's Lua API:
-- Shard(1) is TorchTitan's Shard(0).
--
-- Placements are metadata on an ordinary local tensor, not a tensor
-- subclass: the model's ops run on x:to_local() at full speed, and the
-- placements drive what must know the layout (checkpoints, gradient sums,
-- the norm, the REPL). The arithmetic lives once, in C (engine/dtensor.c):
-- a rank's box, who holds a box, and redistribute planned as collectives.
-- A DTensor may also have no local tensor (dt.meta): a layout to look at,
-- as the REPL and the estimator do, without memory.
--
-- Several mesh dims sharding one tensor dim nest in mesh order: the first
-- cuts the tensor, the next cuts that piece. opts.order (mesh dim names)
-- changes that: { "tp", "dp_shard" } lets tp cut first and dp_shard cut the
-- tp slice (FSDP's rows of a TP slice, TorchTitan's strided sharding).
local tensor = require("titan.tensor")
local tffi = require("titan.ffi")
local ffi, C, check = tffi.ffi, tffi.C, tffi.check

local M = {}

-- Placements ------------------------------------------------------------------

local Placement = {}
Placement.__index = Placement
Placement.__tostring = function(p)
  if p.kind == "shard" then return ("Shard(%d)"):format(p.dim) end
  if p.kind == "partial" then return ("Partial(%s)"):format(p.op) end
  return "Replicate()"
end
Placement.__eq = function(a, b) return a.kind == b.kind and a.dim == b.dim and a.op == b.op end

function M.Shard(dim)
  if type(dim) ~= "number" or dim < 1 or dim % 1 ~= 0 then
    error(("Shard(%s): expected a tensor dim >= 1 (dims are 1-based)"):format(tostring(dim)), 2)
  end
  return setmetatable({ kind = "shard", dim = dim }, Placement)
end
function M.Replicate() return setmetatable({ kind = "replicate" }, Placement) end
local ops = { sum = C.TT_RED_SUM, avg = C.TT_RED_AVG, max = C.TT_RED_MAX }
function M.Partial(op)
  op = op or "sum"
  if not ops[op] then error(("Partial('%s'): expected sum, avg or max"):format(tostring(op)), 2) end
  return setmetatable({ kind = "partial", op = op }, Placement)
end
function M.is_placement(p) return getmetatable(p) == Placement end

-- The C view of a mesh, placements and order (kept alive with the returned table).
local function c_args(mesh, placements, order, what)
  local names, shape = mesh:names(), mesh:shape()
  local n = #names
  if type(placements) ~= "table" or #placements ~= n then
    error(("%s: %s placements for a mesh of %d dims (%s); expected one per mesh dim"):format(what,
      type(placements) == "table" and tostring(#placements) or tostring(placements), n, table.concat(names, ", ")), 3)
  end
  local c = { n = n, shape = ffi.new("int[?]", n), pl = ffi.new("tt_placement[?]", n) }
  for i = 1, n do
    local p = placements[i]
    if not M.is_placement(p) then
      error(("%s: placement %d (%s) is %s; expected Shard(d), Replicate() or Partial(op)"):format(what, i, names[i],
        tostring(p)), 3)
    end
    c.shape[i - 1] = shape[i]
    c.pl[i - 1].kind = p.kind == "shard" and C.TT_PLACE_SHARD or p.kind == "partial" and C.TT_PLACE_PARTIAL
      or C.TT_PLACE_REPLICATE
    c.pl[i - 1].dim = p.kind == "shard" and p.dim - 1 or 0
    c.pl[i - 1].op = p.kind == "partial" and ops[p.op] or 0
  end
  if order then
    -- the dims named first, then the others in mesh order
    c.order = ffi.new("int[?]", n)
    local at, used = 0, {}
    local function put(i)
      if not used[i] then c.order[at], used[i], at = i - 1, true, at + 1 end
    end
    for _, name in ipairs(order) do
      local i
      for j, nm in ipairs(names) do if nm == name then i = j end end
      if not i then
        error(("%s: order names '%s', not a dim of the mesh (%s)"):format(what, tostring(name),
          table.concat(names, ", ")), 3)
      end
      put(i)
    end
    for i = 1, n do put(i) end
  end
  return c
end

local function shape_arr(shape)
  local a = ffi.new("int64_t[?]", math.max(#shape, 1))
  for i, v in ipairs(shape) do a[i - 1] = v end
  return a
end

local function coord_arr(coord, n)
  local a = ffi.new("int[?]", n)
  for i = 1, n do a[i - 1] = coord[i] end
  return a
end

-- The box of global `shape` that mesh coordinate `coord` (0-based, by mesh
-- dim index) holds: { offset = {...}, shape = {...} } (offsets 0-based).
function M.local_box(shape, mesh, placements, coord, order)
  local c = c_args(mesh, placements, order, "local_box")
  local box = ffi.new("tt_box")
  check(C.tt_dtensor_local_box(#shape, shape_arr(shape), c.n, c.shape, coord_arr(coord, c.n), c.pl, c.order, box), 2)
  local out = { offset = {}, shape = {} }
  for i = 1, #shape do out.offset[i], out.shape[i] = tonumber(box.offset[i - 1]), tonumber(box.shape[i - 1]) end
  return out
end

-- Who holds which part of box `want` ({ offset, shape }, default the whole
-- tensor): a list of { rank = r, box = { offset, shape } } in rank order;
-- unique: only the first holder of each piece (coordinate 0 along the
-- Replicate and Partial dims).
function M.owners(shape, mesh, placements, want, opts)
  opts = opts or {}
  local c = c_args(mesh, placements, opts.order, "owners")
  local w = ffi.new("tt_box")
  for i = 1, #shape do
    w.offset[i - 1] = want and want.offset[i] or 0
    w.shape[i - 1] = want and want.shape[i] or shape[i]
  end
  local count = ffi.new("int[1]")
  local sh = shape_arr(shape)
  check(C.tt_dtensor_owners(#shape, sh, c.n, c.shape, c.pl, c.order, w, opts.unique and 1 or 0, 0, nil, nil, count), 2)
  local k = count[0]
  local ranks, boxes = ffi.new("int[?]", math.max(k, 1)), ffi.new("tt_box[?]", math.max(k, 1))
  check(C.tt_dtensor_owners(#shape, sh, c.n, c.shape, c.pl, c.order, w, opts.unique and 1 or 0, k, ranks, boxes,
    count), 2)
  local out = {}
  for i = 0, k - 1 do
    local b = { offset = {}, shape = {} }
    for d = 1, #shape do b.offset[d], b.shape[d] = tonumber(boxes[i].offset[d - 1]), tonumber(boxes[i].shape[d - 1]) end
    out[#out + 1] = { rank = ranks[i], box = b }
  end
  return out
end

-- The collectives that take placements `from` to `to`: a list of
-- { kind = "all_gather" | "reduce_scatter" | "all_reduce" | "all_to_all" | "chunk" | "partial", mesh_dim = name,
--   dim = d, dim2 = d2, op = "sum" }.
local kinds = { [0] = "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "chunk", "partial" }
local op_names = { [0] = "sum", "avg", "max", "min" }
function M.plan(mesh, from, to, order)
  local a = c_args(mesh, from, order, "redistribute")
  local b = c_args(mesh, to, nil, "redistribute")
  local cap = 4 * a.n + 4
  local steps, count = ffi.new("tt_redist_step[?]", cap), ffi.new("int[1]")
  check(C.tt_dtensor_redistribute_plan(a.n, a.pl, b.pl, a.order, cap, steps, count), 2)
  local names, out = mesh:names(), {}
  for i = 0, math.min(count[0], cap) - 1 do
    local s = steps[i]
    out[#out + 1] = { kind = kinds[s.kind], mesh_dim = names[s.mesh_dim + 1], dim = s.dim + 1, dim2 = s.dim2 + 1,
      op = op_names[s.op] }
  end
  return out
end

-- DTensor ---------------------------------------------------------------------

local DTensor = {}
DTensor.__index = DTensor
M.DTensor = DTensor

local function norm_placements(mesh, placements)
  -- a table keyed by dim name is allowed: { tp = Shard(1) } (the rest Replicate)
  if placements and placements[1] == nil and next(placements) ~= nil then
    local out = {}
    for i, name in ipairs(mesh:names()) do out[i] = placements[name] or M.Replicate() end
    for k in pairs(placements) do
      if not mesh:has(k) then
        error(("dtensor: placements name '%s', not a dim of the mesh (%s)"):format(tostring(k),
          table.concat(mesh:names(), ", ")), 3)
      end
    end
    return out
  end
  return placements
end

local function new(loc, mesh, placements, shape, opts)
  local self = setmetatable({ mesh = mesh, placements = norm_placements(mesh, placements), shape = shape,
    order = opts and opts.order, _local = loc, dtype = opts and opts.dtype or (loc and loc:dtype()) }, DTensor)
  local box = self:box()
  if loc then
    local ls = loc:shape()
    for d = 1, #shape do
      if ls[d] ~= box.shape[d] then
        error(("dtensor: the local tensor is %s but this rank's piece of %s under %s is %s"):format(
          tensor.shape_str(ls), tensor.shape_str(shape), self:placements_str(), tensor.shape_str(box.shape)), 3)
      end
    end
  end
  return self
end

-- A DTensor from this rank's piece. opts.shape: the global shape (needed
-- when the pieces are uneven; default: the local shape times the mesh dims
-- that shard it, as torch's from_local assumes); opts.order: see above.
function M.from_local(t, mesh, placements, opts)
  opts = opts or {}
  placements = norm_placements(mesh, placements)
  local shape = opts.shape
  if not shape then
    shape = t:shape()
    for i, p in ipairs(placements) do
      if p.kind == "shard" then shape[p.dim] = shape[p.dim] * mesh:shape()[i] end
    end
  end
  return new(t, mesh, placements, shape, opts)
end

-- A layout without data: global shape and dtype, this rank's box only.
function M.meta(shape, dtype, mesh, placements, opts)
  opts = opts or {}
  return new(nil, mesh, placements, shape, { order = opts.order, dtype = dtype or "float32" })
end

-- This rank's piece of `full` (the whole tensor, the same on every rank):
-- its box, copied; under Partial(sum) coordinate 0 holds the values and the
-- others zeros (avg and max: the values everywhere).
function M.distribute(full, mesh, placements, opts)
  opts = opts or {}
  placements = norm_placements(mesh, placements)
  local shape = full:shape()
  local box = M.local_box(shape, mesh, placements, mesh:coord(), opts.order)
  local piece = full
  for d = 1, #shape do
    if box.shape[d] ~= shape[d] then piece = piece:narrow(d, box.offset[d] + 1, box.shape[d]) end
  end
  local loc = piece:clone() -- (its own memory: a row range of full would be a view of it)
  local coord = mesh:coord()
  for i, p in ipairs(placements) do
    if p.kind == "partial" and p.op == "sum" and coord[i] ~= 0 then loc:fill_(0) end
  end
  return new(loc, mesh, placements, shape, opts)
end

function DTensor:to_local() return self._local end

-- This rank's box: { offset, shape } (coord: another rank's, 0-based by mesh dim).
function DTensor:box(coord)
  return M.local_box(self.shape, self.mesh, self.placements, coord or self.mesh:coord(), self.order)
end

function DTensor:numel_local(coord)
  local n = 1
  for _, s in ipairs(self:box(coord).shape) do n = n * s end
  return n
end

local dtype_bytes = { float32 = 4, float64 = 8, bfloat16 = 2, float16 = 2, int64 = 8, int32 = 4, uint8 = 1, bool = 1,
  float8_e4m3 = 1, float8_e5m2 = 1 }
function DTensor:bytes_local(coord) return self:numel_local(coord) * (dtype_bytes[self.dtype] or 4) end

-- The same values under other placements: the plan's collectives over the
-- mesh's groups (every rank of the mesh calls it, in the same order).
function DTensor:redistribute(placements)
  placements = norm_placements(self.mesh, placements)
  if not self._local then error("dtensor: redistribute needs a local tensor (this DTensor is a layout only)", 2) end
  local mesh, n = self.mesh, #self.placements
  local a = c_args(mesh, self.placements, self.order, "redistribute")
  local b = c_args(mesh, placements, nil, "redistribute")
  local groups = ffi.new("tt_group*[?]", n)
  local names = mesh:names()
  for _, s in ipairs(M.plan(mesh, self.placements, placements, self.order)) do
    if s.kind ~= "chunk" and s.kind ~= "partial" then
      for i = 1, n do
        if names[i] == s.mesh_dim and groups[i - 1] == nil then groups[i - 1] = mesh:group(names[i])._c end
      end
    end
  end
  local out = ffi.new("tt_tensor*[1]")
  check(C.tt_dtensor_redistribute(groups, #self.shape, shape_arr(self.shape), n, a.shape, coord_arr(mesh:coord(), n),
    a.pl, b.pl, a.order, tensor.cptr(self._local), out), 2)
  return new(tensor.wrap(out[0]), mesh, placements, self.shape, { order = self.order })
end

-- The whole tensor on this rank (every rank of the mesh calls it).
function DTensor:full_tensor()
  local all = {}
  for i = 1, #self.placements do all[i] = M.Replicate() end
  return self:redistribute(all):to_local()
end

function DTensor:placements_str()
  local parts, names = {}, self.mesh:names()
  for i, p in ipairs(self.placements) do
    if self.mesh:shape()[i] > 1 or p.kind ~= "replicate" then parts[#parts + 1] = names[i] .. ": " .. tostring(p) end
  end
  if #parts == 0 then return "(replicated)" end
  return "(" .. table.concat(parts, ", ") .. ")"
end

local function box_str(b) return ("%s at offset %s"):format(tensor.shape_str(b.shape), tensor.shape_str(b.offset)) end

DTensor.__tostring = function(self)
  local b = self:box()
  return ("DTensor(shape=%s, dtype=%s, placements=%s%s; rank %d holds %s%s)"):format(tensor.shape_str(self.shape),
    self.dtype, self:placements_str(), self.order and (", order " .. table.concat(self.order, " > ")) or "",
    self.mesh:rank(), box_str(b), self._local and "" or ", no data")
end

-- Every rank's piece, one line a rank (ranks holding the same box on one line).
function DTensor:describe()
  local lines, by, order = { tostring(self) }, {}, {}
  for r = 0, self.mesh:world() - 1 do
    local key = box_str(self:box(self.mesh:coord_of(r)))
    if not by[key] then by[key], order[#order + 1] = {}, key end
    table.insert(by[key], r)
  end
  for _, key in ipairs(order) do
    local ranks = by[key]
    local list = #ranks <= 8 and table.concat(ranks, ",") or ("%d ranks: %s,...,%d"):format(#ranks,
      table.concat({ ranks[1], ranks[2], ranks[3] }, ","), ranks[#ranks])
    lines[#lines + 1] = ("  ranks [%s]: %s"):format(list, key)
  end
  return table.concat(lines, "\n")
end

return M
