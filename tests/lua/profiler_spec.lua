-- The profiler (lua/titan/profiler.lua): regions and their self/total
-- times on a clock the spec controls, the summary's grouping, the Chrome
-- trace, errors inside regions, a Llama 3 model's blocks and norms (the fused
-- ones too); then a profiled training step through the CLI: its files, its
-- printed table, and the same losses as without it.
local titan = require("titan")
local profiler = require("titan.profiler")
local nn = titan.nn
local env = require("titan.env")
local cjson = require("cjson")

-- A clock that moves only when told; sync counts its calls.
local function fake()
  local c = { t = 100, syncs = 0 }
  c.clock = function() return c.t end
  c.sync = function() c.syncs = c.syncs + 1 end
  c.advance = function(dt) c.t = c.t + dt end
  return c
end

describe("profiler regions", function()
  after_each(function() profiler.active = nil end)

  it("nest: a region's self time is its total less its inner regions'; the device syncs at every edge", function()
    local c = fake()
    local p = profiler.new({ clock = c.clock, sync = c.sync })
    p:start()
    local r = { p:region("outer", "step", function(a, b)
      c.advance(1)
      profiler.region("inner", "module", function() c.advance(2) end)
      profiler.region("inner", "module", function() c.advance(3) end)
      c.advance(4)
      return a + b, "two"
    end, 20, 22) }
    p:stop()
    assert.are.same({ 42, "two" }, r) -- every result of fn comes back
    assert.are.equal(10, p:elapsed())
    assert.are.equal(1 + 2 * 3 + 1, c.syncs) -- start, both edges of three regions, stop
    local rows = {}
    for _, row in ipairs(p:summary()) do rows[row.cat .. " " .. row.name] = row end
    assert.are.same({ cat = "step", name = "outer", calls = 1, total = 10, self = 5 }, rows["step outer"])
    assert.are.same({ cat = "module", name = "inner", calls = 2, total = 5, self = 5 }, rows["module inner"])
    assert.is_nil(profiler.active)
  end)

  it("with a device clock: regions timed by its marks, the host's own time beside them, no sync", function()
    -- A device that runs 10x slower than the host queues: each mark is
    -- read back at 10x the host clock's reading when it was made.
    local c = fake()
    local marks = {}
    local dc = {
      mark = function() marks[#marks + 1] = c.t; return #marks end,
      read = function()
        local s = {}
        for i, t in ipairs(marks) do s[i] = 10 * (t - marks[1]) end
        return s
      end,
      clear = function() marks = {} end,
    }
    local p = profiler.new({ clock = c.clock, sync = c.sync, device_clock = dc })
    p:start()
    p:region("outer", "step", function()
      c.advance(1)
      profiler.region("inner", "module", function() c.advance(2) end)
      c.advance(4)
    end)
    c.advance(0.5)
    p:stop()
    assert.are.equal(0, c.syncs, "no host sync with a device clock")
    assert.are.equal(1 + 2 * 2 + 1, #marks) -- start, both edges of two regions, stop
    assert.are.equal(75, p:elapsed()) -- the device's 7.5 x 10
    assert.are.equal(7.5, p:host_elapsed())
    local rows = {}
    for _, row in ipairs(p:summary()) do rows[row.name] = row end
    assert.are.same({ cat = "step", name = "outer", calls = 1, total = 70, self = 50, host = 5 }, rows.outer)
    assert.are.same({ cat = "module", name = "inner", calls = 1, total = 20, self = 20, host = 2 }, rows.inner)
    local text = p:summary_text()
    assert.truthy(text:find("self %%%s+host ms\n"), text)
    assert.truthy(text:find("inner%s+1%s+20000%.000%s+20000%.000%s+26%.7%%%s+2000%.000"), text)
    local ev = p:trace().traceEvents
    assert.are.equal("inner", ev[2].name)
    assert.are.equal(10 * 1e6, ev[2].ts) -- inner starts 1 s of host clock after start, x10
    assert.are.equal(7000, ev[1].args.host_ms)
    -- a second round starts the marks again
    p:start()
    p:region("again", "step", function() c.advance(1) end)
    p:stop()
    assert.are.equal(4, #marks)
    assert.are.equal(10, p:elapsed())
  end)

  it("titan.device_clock on the CPU: the host's clock, read in order; bad use gets one clear error", function()
    local device_clock = require("titan.device_clock")
    local dc = device_clock.new("cpu")
    assert.are.equal(1, dc:mark())
    local x = titan.randn({ 64, 64 })
    for _ = 1, 20 do x = titan.matmul(x, x):scale(1e-2) end
    assert.are.equal(2, dc:mark())
    local s = dc:read()
    assert.are.equal(2, #s)
    assert.are.equal(0, s[1])
    assert.truthy(s[2] > 0 and s[2] < 60, tostring(s[2]))
    dc:clear()
    assert.are.equal(0, dc:count())
    assert.are.same({}, dc:read())
    dc:free()
    dc:free() -- twice is fine
    local ok, err = pcall(device_clock.new, "meta")
    assert.is_false(ok)
    assert.truthy(tostring(err):find("timer: meta runs no work to time (expected cpu or cuda:N)", 1, true), err)
    -- reading more marks than were made (the C API's bound)
    local ffi, C = titan.ffi, titan.C
    local t = ffi.new("tt_timer*[1]")
    assert.are.equal(0, C.tt_timer_new(require("titan.tensor").device_of("cpu"), t))
    assert.are.equal(0, C.tt_timer_mark(t[0]))
    local buf = ffi.new("double[2]")
    assert.are_not.equal(0, C.tt_timer_read(t[0], buf, 2))
    assert.truthy(ffi.string(C.tt_last_error()):find("timer: read of 2 marks, but 1 were made", 1, true))
    C.tt_timer_free(t[0])
    if not titan.cuda_available() then
      ok, err = pcall(device_clock.new, "cuda:0")
      assert.is_false(ok)
      assert.truthy(tostring(err):find("timer: cuda:0 is not available", 1, true), err)
    end
  end)

  it("without an active profiler a region is the plain call, and a module call is its forward", function()
    local calls = 0
    assert.are.equal(7, profiler.region("x", "step", function(v) calls = calls + 1; return v end, 7))
    assert.are.equal(1, calls)
    local lin = nn.Linear(4, 3)
    local y = lin(titan.ones({ 2, 4 }))
    assert.are.same({ 2, 3 }, y:shape())
  end)

  it("an error inside a region closes it and reaches the caller unchanged; stop closes what is left open", function()
    local c = fake()
    local p = profiler.new({ clock = c.clock, sync = c.sync })
    p:start()
    local ok, err = pcall(p.region, p, "fails", "step", function()
      c.advance(2)
      error("the original message", 0)
    end)
    assert.is_false(ok)
    assert.are.equal("the original message", err)
    p:push("left open", "step")
    c.advance(1)
    p:stop()
    assert.is_nil(profiler.active)
    local names = {}
    for _, e in ipairs(p.events) do names[e.name] = e.dur end
    assert.are.same({ fails = 2, ["left open"] = 1 }, names)
    -- one profiler at a time
    local q = profiler.new({ clock = c.clock })
    q:start()
    assert.has_error(function() profiler.new({ clock = c.clock }):start() end,
      "profiler: another profiler is already active")
    q:stop()
  end)

  it("names the model's modules, rolls repeated blocks into one row, and backward nodes carry their module",
    function()
      local Block = nn.Module:extend("Block")
      function Block:init() self.fc = nn.Linear(4, 4) end
      function Block:forward(x) return self.fc(x):relu() end
      local Net = nn.Module:extend("Net")
      function Net:init()
        self.layers = nn.Module:extend("ModuleList")() -- numbered children, as lua/models/llama3.lua
        for i = 0, 2 do self.layers:child(tostring(i), Block()) end
      end
      function Net:forward(x)
        for _, nb in ipairs(self.layers:named_children()) do x = nb[2](x) end
        return x:sum()
      end
      local net = Net()
      local p = profiler.new()
      p:name_modules(net)
      p:start()
      local loss = profiler.region("forward", "step", net, titan.randn({ 2, 4 }))
      profiler.region("backward", "step", function() loss:backward() end)
      p:stop()
      local seen = {}
      for _, e in ipairs(p.events) do seen[e.cat .. " " .. e.name] = (seen[e.cat .. " " .. e.name] or 0) + 1 end
      assert.are.equal(1, seen["module model"], "the root module is 'model'")
      for i = 0, 2 do
        assert.are.equal(1, seen["module layers." .. i .. ".fc"], cjson.encode(seen))
        -- the linear's backward is named by the module whose forward recorded it
        assert.are.equal(1, seen["backward layers." .. i .. ".fc linear"], cjson.encode(seen))
      end
      local rows = {}
      for _, r in ipairs(p:summary()) do rows[r.cat .. " " .. r.name] = r end
      assert.are.equal(3, rows["module layers.*.fc"].calls)
      assert.are.equal(3, rows["module layers.*"].calls)
      assert.are.equal(3, rows["backward layers.*.fc linear"].calls)
    end)

  it("m:call(method, ...) is m:method(...), timed as m's region while a profiler is active", function()
    local Two = nn.Module:extend("Two")
    function Two:init() self.fc = nn.Linear(4, 4) end
    function Two:forward(x) return self.fc(x) end
    function Two:both(x, y) return self.fc(x), y end
    local m = Two()
    local x = titan.ones({ 2, 4 })
    local a, b = m:call("both", x, 7) -- no profiler: the plain call, every result back
    assert.are.same(m(x):tolist(), a:tolist())
    assert.are.equal(7, b)
    local p = profiler.new()
    p:name_modules(m, "two")
    p:start()
    a, b = m:call("both", x, 7)
    p:stop()
    assert.are.equal(7, b)
    local names = {}
    for _, e in ipairs(p.events) do names[#names + 1] = e.cat .. " " .. e.name end
    assert.are.same({ "module two.fc", "module two" }, names) -- (inner first: the order regions close)
  end)

  -- The blocks take the residual stream as two tensors and its adds are
  -- fused into the norms (forward_parts, add_forward): neither is a
  -- forward, and both must still be regions.
  it("a Llama 3 model: a region per block (layers.N) and per RMSNorm, the fused ones too; the same logits",
    function()
      local llama3 = require("models.llama3")
      local flavor = { dim = 32, n_layers = 3, n_heads = 4, n_kv_heads = 2, multiple_of = 16, vocab_size = 61,
        max_seq_len = 32 }
      local ids = titan.tensor({ { 3, 1, 4, 1, 5, 9, 2, 6 } }, { dtype = "int64" })
      local function flat(t) return table.concat(t:tolist_flat(), ",") end
      for _, ac in ipairs({ "none", "full" }) do
        local m = llama3.build(flavor, { seed = 3 })
        require("parallel.ac").apply(m, { mode = ac })
        local plain = flat(m(ids))
        local p = profiler.new()
        p:name_modules(m)
        p:start()
        local y = profiler.region("forward", "step", m, ids)
        profiler.region("backward", "step", function() y:sum():backward() end)
        p:stop()
        assert.are.equal(plain, flat(y), "profiling changes no logit (activation checkpointing " .. ac .. ")")
        local seen, by_name = {}, {}
        for _, e in ipairs(p.events) do
          local key = e.cat .. " " .. e.name
          seen[key] = (seen[key] or 0) + 1
          if e.cat == "module" then by_name[e.name] = e end
        end
        local norms, blocks = 0, 0
        for _, nm in ipairs(m:named_modules()) do
          local class = nm[2].__name
          if class == "RMSNorm" or class == "TransformerBlock" then
            assert.truthy(seen["module " .. nm[1]], nm[1] .. " has a region (" .. ac .. "): " .. cjson.encode(seen))
            if class == "RMSNorm" then norms = norms + 1 else blocks = blocks + 1 end
          end
        end
        assert.are.equal(2 * 3 + 1, norms)
        assert.are.equal(3, blocks)
        -- a block's region holds its own modules' (the fused norm's too)
        local inner = {}
        for _, c in ipairs(by_name["layers.1"].children) do inner[#inner + 1] = c.name end
        assert.are.same({ "layers.1.attention_norm", "layers.1.attention", "layers.1.ffn_norm",
          "layers.1.feed_forward" }, inner)
        for i = 0, 2 do
          assert.truthy(seen["backward layers." .. i .. ".ffn_norm rms_norm"], cjson.encode(seen))
        end
        local rows = {}
        for _, r in ipairs(p:summary()) do rows[r.cat .. " " .. r.name] = r end
        -- (a checkpointed block runs its modules again in the backward; the block itself once)
        local runs = ac == "full" and 2 or 1
        assert.are.equal(3, rows["module layers.*"].calls)
        assert.are.equal(3 * runs, rows["module layers.*.attention_norm"].calls)
        assert.are.equal(3 * runs, rows["module layers.*.ffn_norm"].calls)
        assert.are.equal(1, rows["module norm"].calls)
        m:free()
      end
    end)

  it("with a memory reader: what each region left allocated, per row, and a memory track in the trace", function()
    local c, bytes = fake(), 0
    local p = profiler.new({ clock = c.clock, memory = function() return bytes end })
    p:start()
    p:region("forward", "step", function()
      profiler.region("layers.0", "module", function() bytes = bytes + 3 * 2 ^ 20 end) -- keeps 3 MiB
      profiler.region("layers.1", "module", function() bytes = bytes + 2 ^ 20 end)
    end)
    p:region("backward", "step", function() bytes = bytes - 4 * 2 ^ 20 end)
    p:stop()
    local rows = {}
    for _, r in ipairs(p:summary()) do rows[r.name] = r end
    assert.are.equal(4 * 2 ^ 20, rows["forward"].mem)
    assert.are.equal(4 * 2 ^ 20, rows["layers.*"].mem) -- both blocks in one row
    assert.are.equal(-4 * 2 ^ 20, rows["backward"].mem)
    local text = p:summary_text()
    assert.truthy(text:find("mem MiB", 1, true), text)
    assert.truthy(text:find("backward%s.-%-4%.0\n") or text:find("backward%s.-%-4%.0$"), text)
    local counters = {}
    for _, e in ipairs(p:trace().traceEvents) do
      if e.ph == "C" then counters[#counters + 1] = e.args.MiB end
    end
    -- start, then both edges of 4 regions
    assert.are.same({ 0, 0, 0, 3, 3, 4, 4, 4, 0 }, counters)
  end)

  it("writes a Chrome trace: complete events in microseconds, outer before inner, the rank as pid", function()
    local c = fake()
    local p = profiler.new({ clock = c.clock })
    p:start()
    p:region("step 3", "step", function()
      c.advance(0.001)
      p:region("forward", "step", function() c.advance(0.002) end)
    end)
    p:stop()
    local path = os.tmpname()
    p:write_trace(path, { rank = 5, step = 3 })
    local f = assert(io.open(path))
    local doc = cjson.decode(f:read("*a"))
    f:close()
    os.remove(path)
    assert.are.equal(2, #doc.traceEvents)
    local outer, inner = doc.traceEvents[1], doc.traceEvents[2]
    assert.are.equal("step 3", outer.name)
    assert.are.equal("forward", inner.name)
    assert.are.equal("X", outer.ph)
    assert.are.equal(5, outer.pid)
    assert.is_true(math.abs(outer.dur - 3000) < 1e-6, tostring(outer.dur))
    assert.is_true(math.abs(inner.ts - 1000) < 1e-6 and math.abs(inner.dur - 2000) < 1e-6)
    assert.are.equal(3, doc.otherData.step)
    assert.has_error(function() p:write_trace("/nonexistent-dir/trace.json") end)
  end)
end)

describe("profiling a training step (profiling.* keys)", function()
  local exe = env.build_dir .. "/titan"
  local function run(args)
    local p = io.popen(exe .. " lua/recipes/llama3_debugmodel.lua --training.steps=3 --validation.enable=false "
      .. "--training.seq_len=64 --training.local_batch_size=2 --metrics.peak_flops=1e11 --metrics.log_freq=1 "
      .. args .. " 2>&1; echo rc=$?")
    local out = p:read("*a")
    p:close()
    return out, tonumber(out:match("rc=(%d+)%s*$"))
  end
  local function losses(out)
    local t = {}
    for v in out:gmatch("loss:%s+([%d%.]+)") do t[#t + 1] = v end
    return t
  end

  it("every profile_freq-th step writes a trace and a summary, prints the heaviest regions, changes no loss",
    function()
      local dump = os.tmpname()
      os.remove(dump)
      local plain, rc0 = run("--job.dump_folder=" .. dump .. "-plain")
      assert.are.equal(0, rc0, plain)
      local out, rc = run("--job.dump_folder=" .. dump .. " --profiling.enable_profiling --profiling.profile_freq=2")
      assert.are.equal(0, rc, out)
      assert.are.same(losses(plain), losses(out))
      assert.are.equal(3, #losses(out))
      assert.is_nil(io.open(dump .. "-plain/profile_traces"), "no traces without enable_profiling")
      -- step 2 only
      local dir = dump .. "/profile_traces/iteration_2"
      assert.truthy(out:find("profiler: step 2 took [%d%.]+ ms timed region by region"), out)
      assert.truthy(out:find(dir .. "/rank0_trace.json", 1, true), out)
      assert.truthy(out:find("kind%s+region%s+calls%s+total ms%s+self ms%s+self %%%s+mem MiB"), out)
      assert.is_nil(io.open(dump .. "/profile_traces/iteration_1"))
      assert.is_nil(io.open(dump .. "/profile_traces/iteration_3"))
      local f = assert(io.open(dir .. "/rank0_trace.json"))
      local doc = cjson.decode(f:read("*a"))
      f:close()
      local names = {}
      for _, e in ipairs(doc.traceEvents) do
        local key = e.cat .. " " .. e.name
        names[key] = (names[key] or 0) + 1
      end
      for _, want in ipairs({ "step step 2", "step data", "step forward", "step loss", "step backward",
        "step gradient reduction", "step optimizer", "module model", "module layers.0.attention",
        "module layers.5.feed_forward.w2", "backward layers.5.feed_forward.w2 linear",
        "backward layers.0.attention attention", "module layers.0", "module layers.5", "module layers.0.attention_norm",
        "module layers.3.attention_norm", "module layers.5.ffn_norm", "module norm",
        "backward layers.3.attention_norm rms_norm" }) do
        assert.truthy(names[want], want .. " in the trace")
      end
      assert.are.equal(1, names["step step 2"])
      assert.truthy(names["memory allocated"], "the memory track")
      f = assert(io.open(dir .. "/rank0_summary.txt"))
      local summary = f:read("*a")
      f:close()
      assert.truthy(summary:find("^step 2, rank 0, [%d%.]+ ms timed region by region\n"), summary)
      assert.truthy(summary:find("layers.*.feed_forward.w2", 1, true), summary)
      assert.truthy(summary:find("\nmodule%s+layers%.%*%s+6%s"), summary) -- the six blocks, one row
      assert.truthy(summary:find("\nmodule%s+layers%.%*%.ffn_norm%s+6%s"), summary)
      os.execute("rm -rf '" .. dump .. "' '" .. dump .. "-plain'")
    end)
end)
