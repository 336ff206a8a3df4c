-- DeviceMesh (lua/titan/mesh.lua): the arithmetic against brute force and
-- against the trainer's own groups, the printed layout, the errors, and the
-- process groups through fake roots and a recording stub (no MPI).
local mesh = require("titan.mesh")
local dist = require("titan.dist")

local function err(fn)
  local ok, e = pcall(fn)
  assert.is_false(ok, "expected an error")
  e = tostring(e)
  assert.is_nil(e:find("\n"), "expected one line: " .. e)
  return e
end

local function has(text, piece)
  assert.truthy(text:find(piece, 1, true), ("expected %q in %q"):format(piece, text))
end

-- Every subset of {1..n}, each as an increasing list.
local function subsets(n)
  local out = {}
  for bits = 1, 2 ^ n - 1 do
    local s = {}
    for i = 1, n do if math.floor(bits / 2 ^ (i - 1)) % 2 == 1 then s[#s + 1] = i end end
    out[#out + 1] = s
  end
  return out
end

-- The trainer's groups (lua/titan/trainer.lua: M.new), as global rank lists
-- of rank r, each in its split's key order: pp_group, tp_group, cp_group,
-- dp (dp_replicate x dp_shard x cp), FSDP's shard and replicate groups
-- under HSDP, ep_group and ep_replicas.
local function trainer_groups(p, r)
  local world = p.pp * p.dp_replicate * p.dp_shard * p.cp * p.tp
  local function place(q)
    local inner = world / p.pp
    local t = { pp_rank = math.floor(q / inner), stage_rank = q % inner }
    t.dp_rank = math.floor(t.stage_rank / (p.tp * p.cp))
    t.dp_size = inner / (p.tp * p.cp)
    t.cp_rank = math.floor(t.stage_rank / p.tp) % p.cp
    t.at = t.dp_rank * p.cp + t.cp_rank
    return t
  end
  local me = place(r)
  local nd = me.dp_size * p.cp
  -- (color, key) of each group as the trainer splits; nil: no such group
  local function same_stage(a, b) return a.pp_rank == b.pp_rank end
  local function in_dp(a, b) return same_stage(a, b) and a.stage_rank % p.tp == b.stage_rank % p.tp end
  local rules = {
    pp = { function(a, b) return a.stage_rank == b.stage_rank end, function(t) return t.pp_rank end },
    tp = { function(a, b) return same_stage(a, b) and math.floor(a.stage_rank / p.tp) == math.floor(b.stage_rank / p.tp) end,
      function(t) return t.stage_rank end },
    cp = { function(a, b)
      return same_stage(a, b) and a.dp_rank * p.tp + a.stage_rank % p.tp == b.dp_rank * p.tp + b.stage_rank % p.tp
    end, function(t) return t.stage_rank end },
    dp = { in_dp, function(t) return t.stage_rank end },
    shard = { function(a, b)
      return in_dp(a, b) and math.floor(a.dp_rank / p.dp_shard) == math.floor(b.dp_rank / p.dp_shard)
    end, function(t) return t.at end },
    replicate = { function(a, b)
      return in_dp(a, b) and a.dp_rank % p.dp_shard * p.cp + a.cp_rank == b.dp_rank % p.dp_shard * p.cp + b.cp_rank
    end, function(t) return t.at end },
    ep = { function(a, b) return in_dp(a, b) and math.floor(a.at / p.ep) == math.floor(b.at / p.ep) end,
      function(t) return t.at end },
    ep_replicas = { function(a, b) return in_dp(a, b) and a.at % p.ep == b.at % p.ep end, function(t) return t.at end },
  }
  local out = {}
  for name, rule in pairs(rules) do
    local members = {}
    for q = 0, world - 1 do
      local t = place(q)
      if rule[1](me, t) then members[#members + 1] = { rule[2](t), q } end
    end
    table.sort(members, function(x, y) return x[1] < y[1] end)
    local list = {}
    for i, m in ipairs(members) do list[i] = m[2] end
    out[name] = list
  end
  if nd <= p.ep then out.ep_replicas = { r } end -- (the trainer makes none: every rank holds its own experts)
  return out
end

-- A root group that records its splits (what MPI_Comm_split would see).
local function stub_root(rank, world, log)
  local g = { _rank = rank, _world = world }
  function g:rank() return self._rank end
  function g:size() return self._world end
  function g:backend() return "stub" end
  function g:split(color, key)
    log[#log + 1] = { color = color, key = key }
    return { color = color, key = key, size = function() return -1 end }
  end
  return g
end

describe("mesh", function()
  it("coordinates round-trip for every rank of a 2x3x4 mesh, row-major", function()
    local m = mesh.new({ "a", "b", "c" }, { 2, 3, 4 }, { rank = 17 })
    assert.are.equal(24, m:world())
    assert.are.equal(3, m:ndim())
    assert.are.same({ "a", "b", "c" }, m:names())
    assert.are.same({ 2, 3, 4 }, m:shape())
    assert.are.equal(17, m:rank())
    for r = 0, 23 do
      local c = m:coord_of(r)
      assert.are.same({ math.floor(r / 12), math.floor(r / 4) % 3, r % 4 }, c)
      assert.are.equal(r, m:rank_of(c))
      assert.are.equal(r, m:rank_of({ a = c[1], b = c[2], c = c[3] }))
    end
    assert.are.same({ 1, 1, 1 }, m:coord())
    assert.are.equal(1, m:local_rank("b"))
    assert.are.equal(1 * 4 + 1, m:local_rank({ "b", "c" }))
    assert.are.equal(17, m:local_rank())
    assert.are.equal(12, m:size({ "b", "c" }))
    assert.are.equal(24, m:size())
  end)

  it("ranks, local ranks and groups of every dim and flattened set match brute force", function()
    local names, shape = { "a", "b", "c", "d" }, { 2, 3, 1, 4 }
    for _, dims in ipairs(subsets(4)) do
      local sel = {}
      for j, i in ipairs(dims) do sel[j] = names[i] end
      local inside = {}
      for _, i in ipairs(dims) do inside[i] = true end
      local m0 = mesh.new({ dims = names, shape = shape })
      local seen, expect_groups = {}, {}
      for r = 0, m0:world() - 1 do
        local m = mesh.new({ dims = names, shape = shape, rank = r })
        local cr = m:coord()
        local brute = {}
        for q = 0, m:world() - 1 do
          local cq, same = m:coord_of(q), true
          for i = 1, 4 do if not inside[i] and cq[i] ~= cr[i] then same = false end end
          if same then brute[#brute + 1] = q end -- (ascending = row-major over the dims)
        end
        assert.are.same(brute, m:ranks(sel))
        assert.are.same(brute, m0:ranks(sel, r))
        if #sel == 1 then assert.are.same(brute, m:ranks(sel[1])) end
        for k, q in ipairs(brute) do if q == r then assert.are.equal(k - 1, m:local_rank(sel)) end end
        assert.are.equal(#brute, m:size(sel))
        if not seen[brute[1]] then
          seen[brute[1]] = true
          expect_groups[#expect_groups + 1] = brute
        end
      end
      table.sort(expect_groups, function(x, y) return x[1] < y[1] end)
      assert.are.same(expect_groups, m0:groups(sel))
    end
  end)

  it("a flattened view is a dim name everywhere", function()
    local m = mesh.new{ dims = { "pp", "dp_replicate", "dp_shard", "cp", "tp" }, shape = { 2, 2, 2, 2, 2 }, rank = 13 }
    local flat = m:flatten({ "dp_replicate", "dp_shard", "cp" }, "dp_cp")
    assert.are.same(m:ranks({ "dp_replicate", "dp_shard", "cp" }), m:ranks("dp_cp"))
    assert.are.same(m:groups({ "dp_replicate", "dp_shard", "cp" }), m:groups("dp_cp"))
    assert.are.equal(8, m:size("dp_cp"))
    assert.are.equal(m:local_rank({ "dp_replicate", "dp_shard", "cp" }), m:local_rank("dp_cp"))
    assert.are.same(m:ranks({ "pp", "dp_replicate", "dp_shard", "cp" }), m:ranks({ "pp", "dp_cp" }))
    assert.are.same({ "dp_cp" }, flat:names())
    assert.are.equal(flat, m.dp_cp)
    m:flatten({ "dp_shard", "cp" }) -- (default name: the dims joined by _)
    assert.are.same(m:ranks({ "dp_shard", "cp" }), m:ranks("dp_shard_cp"))
    assert.are.same({ "dp_cp", "dp_shard_cp" }, m:views())
  end)

  it("sub-meshes: m.tp, m:sub{...}, their ranks and the parent's", function()
    local m = mesh.from_parallelism({ pp = 2, dp_replicate = 1, dp_shard = 2, cp = 2, tp = 2 }, 16, 11)
    local tp = m.tp
    assert.are.equal(tp, m:sub("tp"))
    assert.are.same({ "tp" }, tp:names())
    assert.are.equal(1, tp:rank())
    assert.are.equal(10, tp:global_rank(0))
    assert.are.equal(11, tp:global_rank())
    assert.is_function(m.size) -- (methods win over dim names)
    assert.is_nil(m.nonexistent)
    local sc = m:sub({ "dp_shard", "cp" })
    assert.are.same({ 2, 2 }, sc:shape())
    assert.are.same(m:coord_of(11), m:coord())
    assert.are.equal(m:local_rank({ "dp_shard", "cp" }), sc:rank())
    for k, q in ipairs(m:ranks({ "dp_shard", "cp" })) do assert.are.equal(q, sc:global_rank(k - 1)) end
    -- (the parent's flattened views held by the sub's dims carry over)
    assert.is_true(sc:has("dp_shard_cp"))
    assert.is_false(sc:has("dp_cp")) -- (dp_replicate is not one of its dims)
    assert.are.same({ 0, 1, 2, 3 }, sc:ranks("dp_shard_cp"))
    -- a sub of a sub
    local c = sc.cp
    assert.are.equal(m:global_rank(m:ranks("cp")[c:rank() + 1]), c:global_rank())
    assert.are.same(m:ranks("cp"), { c:global_rank(0), c:global_rank(1) })
  end)

  it("the ep views are the trainer's ep and ep_replicas groups; the others its other groups", function()
    local cases = {
      { pp = 1, dp_replicate = 1, dp_shard = 4, cp = 1, tp = 1, ep = 2 },
      { pp = 1, dp_replicate = 1, dp_shard = 4, cp = 1, tp = 1, ep = 4 },
      { pp = 1, dp_replicate = 2, dp_shard = 2, cp = 1, tp = 2, ep = 2 },
      { pp = 1, dp_replicate = 1, dp_shard = 2, cp = 2, tp = 1, ep = 4 },
      { pp = 1, dp_replicate = 2, dp_shard = 2, cp = 2, tp = 1, ep = 2 },
      { pp = 2, dp_replicate = 2, dp_shard = 3, cp = 2, tp = 2, ep = 3 },
      { pp = 2, dp_replicate = 3, dp_shard = 1, cp = 2, tp = 1, ep = 6 },
      { pp = 1, dp_replicate = 2, dp_shard = 4, cp = 1, tp = 2, ep = 8 },
    }
    for _, p in ipairs(cases) do
      local world = p.pp * p.dp_replicate * p.dp_shard * p.cp * p.tp
      for r = 0, world - 1 do
        local m = mesh.from_parallelism(p, world, r)
        local t = trainer_groups(p, r)
        local what = ("pp %d dp_replicate %d dp_shard %d cp %d tp %d ep %d, rank %d"):format(p.pp, p.dp_replicate,
          p.dp_shard, p.cp, p.tp, p.ep, r)
        assert.are.same(t.ep, m:ranks("ep"), what .. ": ep")
        assert.are.same(t.ep_replicas, m:ranks("ep_replica"), what .. ": ep_replica")
        assert.are.same(t.pp, m:ranks("pp"), what .. ": pp")
        assert.are.same(t.tp, m:ranks("tp"), what .. ": tp")
        assert.are.same(t.cp, m:ranks("cp"), what .. ": cp")
        assert.are.same(t.dp, m:ranks("dp_cp"), what .. ": dp")
        assert.are.same(t.shard, m:ranks("dp_shard_cp"), what .. ": fsdp shard")
        assert.are.same(t.replicate, m:ranks("dp_replicate"), what .. ": hsdp replicate")
      end
    end
  end)

  it("add_view checks that its groups partition the ranks", function()
    local m = mesh.new({ "x" }, { 4 })
    m:add_view("pairs", function(r) return { r - r % 2, r - r % 2 + 1 } end)
    assert.are.same({ { 0, 1 }, { 2, 3 } }, m:groups("pairs"))
    has(err(function() m:add_view("bad", function(r) return { 0, 1 } end) end),
      "view 'bad': rank 0 is in the group of rank 2 and in that of rank 0; expected groups that do not overlap")
    has(err(function() m:add_view("odd", function(r) return r == 0 and { 0 } or { 1, 2 } end) end),
      "view 'odd': the group of rank 1 has 2 ranks, an earlier one 1; expected groups of one size")
    has(err(function() m:add_view("out", function(r) return { (r + 1) % 4 } end) end),
      "view 'out': the group of rank 0 leaves it out")
    has(err(function() m:add_view("x", function(r) return { r } end) end), "'x' is already a dim of the mesh")
    has(err(function() m:sub({ "x", "pairs" }) end), "view 'pairs' cannot be combined with other dims")
  end)

  it("prints the 8x8 mesh in a few lines naming its groups", function()
    local m = mesh.new{ dims = { "dp_shard", "tp" }, shape = { 8, 8 }, rank = 5 }
    local text = tostring(m)
    local lines = {}
    for l in text:gmatch("[^\n]+") do lines[#lines + 1] = l end
    assert.are.equal(3, #lines, text)
    assert.are.equal("DeviceMesh 64 ranks: dp_shard 8 x tp 8 (this rank 5: dp_shard 0, tp 5)", lines[1])
    assert.are.equal("  dp_shard groups (8 groups of 8 ranks): [0,8,16,...,56] [1,9,17,...,57] [2,10,18,...,58] ... "
      .. "[7,15,23,...,63]", lines[2])
    assert.are.equal("  tp groups (8 groups of 8 ranks): [0-7] [8-15] [16-23] ... [56-63]", lines[3])
    local d = m:describe()
    has(d, "[0,8,16,24,32,40,48,56] [1,9,17,25,33,41,49,57]")
    has(d, "[0-7] [8-15] [16-23] [24-31] [32-39] [40-47] [48-55] [56-63]")
    -- the 5-D mesh of 256 ranks, every view: still short
    local big = mesh.from_parallelism({ pp = 2, dp_replicate = 2, dp_shard = 4, cp = 2, tp = 4, ep = 4 }, 256 / 2, 77)
    local n = select(2, tostring(big):gsub("\n", "")) + 1
    assert.is_true(n < 20, tostring(big))
    local b2 = mesh.from_parallelism({ pp = 4, dp_replicate = 2, dp_shard = 4, cp = 2, tp = 4, ep = 2 }, 256, 200)
    local t2 = tostring(b2)
    assert.is_true(select(2, t2:gsub("\n", "")) + 1 < 20, t2)
    has(t2, "DeviceMesh 256 ranks: pp 4 x dp_replicate 2 x dp_shard 4 x cp 2 x tp 4")
    has(t2, "  tp groups (64 groups of 4 ranks): [0-3] [4-7] [8-11] ... [252-255]")
    has(t2, "  ep (view) groups (")
    -- all dims of size 1: all named
    local one = mesh.from_parallelism({}, 1, 0)
    assert.are.equal("DeviceMesh 1 rank: pp 1 x dp_replicate 1 x dp_shard 1 x cp 1 x tp 1 (this rank 0: pp 0, "
      .. "dp_replicate 0, dp_shard 0, cp 0, tp 0)", tostring(one))
    -- flattened views that group as one dim does are named on one line
    local fsdp = mesh.from_parallelism({ dp_shard = 4 }, 4, 1)
    has(tostring(fsdp), "  size 1: pp, dp_replicate, cp, tp")
    has(tostring(fsdp), "  dp, dp_shard_cp, dp_cp: the dp_shard groups")
    assert.are.equal("[0-3,8,10,12,14,16,18,20]", mesh.fmt_ranks({ 0, 1, 2, 3, 8, 10, 12, 14, 16, 18, 20 }))
    assert.are.equal("[0-3,8,10,...,20]", mesh.fmt_ranks({ 0, 1, 2, 3, 8, 10, 12, 14, 16, 18, 20 }, 5))
    assert.are.equal("[0,1]", mesh.fmt_ranks({ 0, 1 }))
  end)

  it("bad input is one line naming what was wrong and what was expected", function()
    has(err(function() mesh.new{ dims = { "dp", "tp", "dp" }, shape = { 1, 2, 2 } } end),
      "mesh: dims 1 and 3 are both named 'dp'; expected unique names")
    has(err(function() mesh.new{ dims = { "dp", "tp" }, shape = { 2, 0 } } end),
      "mesh: dim 'tp' has size 0; expected a positive integer")
    has(err(function() mesh.new{ dims = { "dp", "tp" }, shape = { 2.5, 2 } } end),
      "mesh: dim 'dp' has size 2.5; expected a positive integer")
    has(err(function() mesh.new{ dims = { "dp", "tp" }, shape = { 2 } } end),
      "mesh: 2 dims (dp, tp) but 1 sizes; expected one size per dim")
    has(err(function() mesh.new{ dims = {}, shape = {} } end), "mesh: dims is an empty list; expected a list of dim names")
    has(err(function() mesh.new{ dims = { "dp", 3 }, shape = { 2, 2 } } end), "mesh: dim 2 is named 3; expected a")
    has(err(function() mesh.new{ dims = { "dp", "tp" }, shape = { 2, 2 }, rank = 4 } end),
      "mesh: rank 4 is outside the 4 ranks of the mesh; expected 0 <= rank < 4")
    has(err(function() mesh.new{ dims = { "dp", "tp" }, shape = { 2, 2 }, rank = -1 } end), "rank -1 is outside")
    local m = mesh.new{ dims = { "pp", "dp_shard", "cp", "tp" }, shape = { 1, 2, 2, 2 } }
    has(err(function() m:ranks("ep") end), "mesh: unknown dim 'ep'; expected one of pp, dp_shard, cp, tp")
    has(err(function() m:ranks({ "cp", "dp_shard" }) end),
      "mesh: dims { cp, dp_shard } are not in mesh order; expected { dp_shard, cp }")
    has(err(function() m:ranks({ "cp", "cp" }) end), "name dim 'cp' twice")
    has(err(function() m:ranks({}) end), "dims are an empty list; expected a dim name or a list of them")
    has(err(function() m:ranks("tp", 8) end), "ranks: rank 8 is outside the 8 ranks of the mesh")
    has(err(function() m:coord_of(9) end), "coord_of: rank 9 is outside")
    has(err(function() m:rank_of({ 0, 2, 0, 0 }) end), "rank_of: coordinate 2 of dim 'dp_shard' is 2; expected 0 <= it < 2")
    has(err(function() m:flatten({ "dp_shard", "cp" }, "tp") end), "'tp' is already a dim of the mesh; expected a new name")
    has(err(function() m:ep_views(3) end),
      "ep_views: ep = 3, but the data-parallel ranks (dp_shard x cp) are 4; expected a divisor of 4")
    has(err(function() mesh.from_parallelism({ dp_shard = 2, tp = 2 }, 8, 0) end),
      "from_parallelism: pp x dp_replicate x dp_shard x cp x tp = 1 x 1 x 2 x 1 x 2 = 4, but the job has 8 rank(s)")
    has(err(function() m:group("tp") end), "group: this mesh has no process group to split")
    has(err(function() m:group("tp") end), "expected opts.group = the group of its 8 ranks, or opts.fake = true")
    local root = dist.new_group({ backend = "fake", rank = 1, world = 4 })
    has(err(function() mesh.new{ dims = { "dp" }, shape = { 8 }, group = root } end),
      "the root group has 4 ranks, the mesh 8 = 8; expected a group of all 8 ranks")
    has(err(function() mesh.new{ dims = { "dp" }, shape = { 4 }, group = root, rank = 2 } end),
      "rank = 2, but this process is rank 1 of the root group")
  end)

  it("offline with fake = true: fake groups of the right size and rank, cached", function()
    local m = mesh.from_parallelism({ dp_shard = 4, cp = 2, tp = 2, ep = 4 }, 16, 13, { fake = true })
    local tp = m:group("tp")
    assert.are.equal("fake", tp:backend())
    assert.are.equal(2, tp:size())
    assert.are.equal(m:local_rank("tp"), tp:rank())
    assert.are.equal(tp, m:group("tp"))
    assert.are.equal(tp, m.tp:group())
    local dp = m:group("dp_cp")
    assert.are.equal(8, dp:size())
    assert.are.equal(m:local_rank("dp_cp"), dp:rank())
    assert.are.equal(dp, m:group({ "dp_replicate", "dp_shard", "cp" }))
    local ep = m:group("ep")
    assert.are.equal(4, ep:size())
    assert.are.equal(m:local_rank("ep"), ep:rank())
    assert.are.equal(2, m:group("ep_replica"):size())
    local all = m:group()
    assert.are.equal(16, all:size())
    assert.are.equal(13, all:rank())
    assert.are.equal(1, m:group("pp"):size())
    -- a view of a sub-mesh splits the sub's group of all its ranks
    local sc = m:sub({ "dp_shard", "cp" })
    sc:add_view("halves", function(r) return r < 4 and { 0, 1, 2, 3 } or { 4, 5, 6, 7 } end)
    assert.are.equal(4, sc:group("halves"):size())
    m:free()
  end)

  it("a fake-backend root: groups of the right size, the root for the whole mesh", function()
    local root = dist.new_group({ backend = "fake", rank = 5, world = 8 })
    local m = mesh.new{ dims = { "dp_shard", "tp" }, shape = { 2, 4 }, group = root }
    assert.are.equal(5, m:rank())
    local tp = m:group("tp")
    assert.are.equal(4, tp:size())
    assert.are.equal(1, tp:rank())
    assert.are.equal(2, m:group("dp_shard"):size())
    assert.are.equal(root, m:group())
    -- and a real split of a fake root does not error (the fake backend's split gives groups of one)
    assert.are.equal(1, root:split(m:local_rank("dp_shard"), m:local_rank("tp")):size())
    m:free()
    assert.are.equal(8, root:size()) -- (the root is not the mesh's to free)
  end)

  it("splits the root with color = the group's index and key = the rank's index, once per group", function()
    local p = { pp = 2, dp_replicate = 1, dp_shard = 2, cp = 2, tp = 2, ep = 2 }
    local world = 16
    local asks = { "tp", "cp", { "dp_shard", "cp" }, "dp_cp", "ep", "ep_replica", "pp", "tp" }
    local sequences = {}
    for r = 0, world - 1 do
      local log = {}
      local m = mesh.from_parallelism(p, world, nil, { group = stub_root(r, world, log) })
      assert.are.equal(r, m:rank())
      for _, a in ipairs(asks) do
        local g = m:group(a)
        local groups = m:groups(a)
        -- (the group of color c is groups[c + 1]; the key is this rank's place in it)
        assert.are.equal(r, groups[g.color + 1][g.key + 1])
        assert.are.same(m:ranks(a), groups[g.color + 1])
      end
      assert.are.equal(m:group("tp"), m.tp:group())
      assert.are.equal(m:group("dp_shard_cp"), m:sub({ "dp_shard", "cp" }):group())
      assert.are.equal(m:group("cp"), m:sub({ "dp_shard", "cp" }):group("cp"))
      assert.are.equal(7, #log) -- (tp asked twice, and { dp_shard, cp } is dp_shard_cp: made once each)
      sequences[r + 1] = #log
    end
    for r = 2, world do assert.are.equal(sequences[1], sequences[r]) end
  end)
end)
