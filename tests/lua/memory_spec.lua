-- Memory is released deterministically: by titan.scope, by autograd after
-- each node's backward, and by :free() — never left to the garbage collector.
local titan = require("titan")
local nn, F = titan.nn, titan.F

local Net = nn.Module:extend("TwoLayer")
function Net:init(d_in, d_hidden, d_out)
  self.fc1 = nn.Linear(d_in, d_hidden, { bias = true })
  self.norm = nn.RMSNorm(d_hidden)
  self.fc2 = nn.Linear(d_hidden, d_out)
end
function Net:forward(x) return self.fc2(self.norm(self.fc1(x)):silu()) end

local function step(net, x, targets)
  return titan.scope(function()
    local logits = net(x)
    local loss = F.cross_entropy(logits, targets)
    loss:backward()
    return loss:item()
  end)
end

describe("memory", function()
  -- Keep the garbage collector out of it: nothing below may rely on it.
  setup(function() collectgarbage("stop") end)
  teardown(function() collectgarbage("restart") end)

  it("a forward+backward inside titan.scope returns allocated bytes to the baseline", function()
    local net = Net(32, 64, 10)
    local x = titan.randn({ 16, 32 })
    local targets = titan.tensor({ 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6 }, { dtype = "int64" })
    -- The first step creates the parameters' .grad (they persist, by design).
    step(net, x, targets)
    net:zero_grad()
    local base = titan.memory_stats().allocated
    local live = titan.live_tensors()
    step(net, x, targets)
    net:zero_grad()
    assert.are.equal(base, titan.memory_stats().allocated)
    assert.are.equal(live, titan.live_tensors())
  end)

  it("100 repeated steps do not grow allocated memory or live tensors", function()
    local net = Net(32, 64, 10)
    local x = titan.randn({ 16, 32 })
    local targets = titan.tensor({ 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6 }, { dtype = "int64" })
    step(net, x, targets) -- grads exist from here on and are accumulated into
    local base, live = titan.memory_stats().allocated, titan.live_tensors()
    for _ = 1, 100 do step(net, x, targets) end
    assert.are.equal(base, titan.memory_stats().allocated)
    assert.are.equal(live, titan.live_tensors())
    net:free()
  end)

  it("the gradient is accumulated, not replaced, across steps", function()
    local net = Net(4, 8, 3)
    local x = titan.randn({ 2, 4 })
    local targets = titan.tensor({ 0, 2 }, { dtype = "int64" })
    step(net, x, targets)
    local g1 = net.fc1.weight.grad:tolist_flat()
    step(net, x, targets)
    local g2 = net.fc1.weight.grad:tolist_flat()
    for i = 1, #g1 do assert(math.abs(g2[i] - 2 * g1[i]) <= 1e-5 * math.max(1, math.abs(g1[i]))) end
  end)

  it("scope returns its results to the caller and frees the rest", function()
    local base = titan.memory_stats().allocated
    local kept, t2
    local a = titan.scope(function()
      local x = titan.ones(100, 100)
      local y = x * 2
      kept = y
      t2 = x
      return y
    end)
    assert.are.equal(a, kept)
    assert.is_nil(t2._c) -- freed by the scope
    local held = titan.memory_stats().allocated - base -- one 40000-byte tensor, rounded to its size class
    assert.truthy(held >= 40000 and held <= 40000 * 1.25)
    assert.has_error(function() return t2 + 1 end, nil)
    a:free()
    assert.are.equal(base, titan.memory_stats().allocated)
  end)

  it("an error inside a scope frees everything and propagates", function()
    local base = titan.memory_stats().allocated
    local ok, err = pcall(titan.scope, function()
      local x = titan.ones(64, 64)
      local _ = x:matmul(titan.ones(3, 3))
    end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("matmul"))
    assert.are.equal(base, titan.memory_stats().allocated)
  end)

  it("saved tensors are released right after their node's backward", function()
    titan.scope(function()
      local w = titan.randn({ 256, 256 }):requires_grad_()
      local x = titan.randn({ 256, 256 })
      local y = (x:matmul(w)):silu():sum()
      local before = titan.memory_stats().allocated
      y:backward()
      -- x and w themselves remain (the scope holds them), the silu input
      -- saved by the graph does too (scope), but nothing the graph held extra
      -- survives: a second backward is refused.
      assert.has_error(function() y:backward() end)
      -- only w.grad (256 x 256 f32) was added
      assert.are.equal(before + 256 * 256 * 4, titan.memory_stats().allocated)
      w.grad:free()
      w.grad = nil
    end)
  end)

  it("building on the meta device allocates nothing", function()
    local base = titan.memory_stats().allocated
    local net = nn.Linear(4096, 4096, { device = "meta" })
    assert.are.equal(base, titan.memory_stats().allocated)
    assert.is_true(net.weight:is_meta())
    local y = net(titan.empty({ 8, 4096 }, { device = "meta" }))
    assert.are.same({ 8, 4096 }, y:shape())
    assert.are.equal(base, titan.memory_stats().allocated)
  end)

  it("the pinned host cache (async snapshots of CUDA tensors) reports statistics and empties", function()
    titan.empty_cache("pinned")
    local s = titan.memory_stats("pinned")
    assert.are.equal(0, s.reserved)
    assert.are.equal(0, s.allocated)
    assert.truthy(s.num_allocs >= s.num_cache_hits)
  end)

  it("the caching allocator reuses freed blocks and reports statistics", function()
    titan.reset_peak_memory()
    local s0 = titan.memory_stats()
    local t = titan.empty({ 1000 })
    t:free()
    local t2 = titan.empty({ 1000 })
    local s1 = titan.memory_stats()
    assert.truthy(s1.num_cache_hits > s0.num_cache_hits)
    assert.truthy(s1.peak_allocated >= s1.allocated)
    assert.truthy(s1.reserved >= s1.allocated)
    t2:free()
  end)

  -- malloc overcommits: without the allocator's own check, a block larger
  -- than the host can back is handed out, and the OOM killer ends the job
  -- when its pages are touched, with nothing said.
  it("a host block beyond the available memory is an out-of-memory error with the numbers, not a kill", function()
    local free, total = titan.memory_info("cpu")
    assert.truthy(total > 0 and free > 0 and free <= total, ("free %d of %d"):format(free, total))
    local s0 = titan.memory_stats("cpu")
    -- more than is available, less than the host has (before the size
    -- class's rounding): malloc may grant it or not; the check refuses first
    local n = math.floor((free + 0.9 * (total - free) + 2 ^ 20) / 4)
    local ok, err = pcall(titan.empty, { n })
    assert.falsy(ok)
    assert.truthy(tostring(err):find("out of memory on cpu: tried to allocate", 1, true), tostring(err))
    -- refused by the allocator's check, not by malloc (which would grant it)
    assert.truthy(tostring(err):find("more than the host's [%d.]+ MiB available %(of [%d.]+ MiB%)"), tostring(err))
    local s1 = titan.memory_stats("cpu")
    assert.are.equal(s0.num_ooms + 1, s1.num_ooms)
    assert.are.equal(s0.allocated, s1.allocated)
    -- and the allocator goes on serving what fits
    local t = titan.empty({ 2 ^ 24 })
    t:free()
  end)

  -- The CPU has one stream: record_stream changes nothing there (the GPU
  -- side is tests/cuda/backend_spec.lua); a stream it does not know is one line.
  it("record_stream on the CPU frees as usual; an unknown stream name is an error", function()
    local s0 = titan.memory_stats("cpu")
    local t = titan.empty({ 1000 }):record_stream("comm")
    t:free()
    local s1 = titan.memory_stats("cpu")
    assert.are.equal(0, s1.pending)
    assert.are.equal(s0.allocated, s1.allocated)
    local ok, err = pcall(function() titan.empty({ 4 }):record_stream("copy") end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("record_stream: unknown stream 'copy'; expected 'compute' or 'comm'", 1, true), err)
  end)
end)
