-- Modules: parameters, state dicts, train/eval, apply, meta construction and
-- name-keyed initialization; custom autograd functions; no_grad.
local titan = require("titan")
local nn = titan.nn

local Block = nn.Module:extend("Block")
function Block:init(d, opts)
  self.norm = nn.RMSNorm(d, opts)
  self.proj = nn.Linear(d, d, opts)
end
function Block:forward(x) return x + self.proj(self.norm(x)) end

local Net = nn.Module:extend("Net")
function Net:init(vocab, d, opts)
  self.tok = nn.Embedding(vocab, d, opts)
  self.layers = nn.Module:extend("Layers")()
  for i = 1, 2 do self.layers:child(tostring(i - 1), Block(d, opts)) end
  self.out = nn.Linear(d, vocab, opts)
end
function Net:forward(ids)
  local h = self.tok(ids)
  for i = 0, 1 do h = self.layers[tostring(i)](h) end
  return self.out(h)
end

-- Plain SGD on module's parameters for `steps` steps of loss_fn(); returns
-- the first and the last loss.
local function sgd_fit(module, steps, lr, loss_fn)
  local first, last
  for step = 1, steps do
    local loss = titan.scope(function()
      local l = loss_fn()
      l:backward()
      return l:item()
    end)
    titan.no_grad(function()
      for _, p in ipairs(module:parameters()) do p:add_(p.grad, -lr) end
    end)
    module:zero_grad()
    if step == 1 then first = loss end
    last = loss
  end
  return first, last
end

describe("nn", function()
  it("names parameters in declaration order and counts them", function()
    local net = Net(11, 4)
    local names = {}
    for i, np in ipairs(net:named_parameters()) do names[i] = np[1] end
    assert.are.same({ "layers.0.norm.weight", "layers.0.proj.weight", "layers.1.norm.weight", "layers.1.proj.weight",
      "out.weight", "tok.weight" }, names)
    assert.are.equal(11 * 4 * 2 + 2 * (4 + 16), net:num_parameters())
    assert.truthy(tostring(net):find("Linear%(in_features=4, out_features=11"))
  end)

  it("state_dict / load_state_dict round-trip, and strict mode reports keys", function()
    local a, b = Net(11, 4), Net(11, 4)
    b:load_state_dict(a:state_dict())
    local ids = titan.tensor({ { 1, 2, 3 } }, { dtype = "int64" })
    assert.are.same(a(ids):tolist(), b(ids):tolist())
    local sd = a:state_dict()
    sd.tensors["extra.weight"] = titan.ones(1)
    local ok, err = pcall(function() b:load_state_dict(sd) end)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("unexpected keys: %[extra.weight%]"))
    sd.tensors["extra.weight"] = nil
    sd.tensors["out.weight"] = titan.ones(3, 3)
    ok, err = pcall(function() b:load_state_dict(sd) end)
    assert.truthy(tostring(err):find("out.weight has shape %[3, 3%]"))
  end)

  it("train/eval and apply reach every module", function()
    local net = Net(5, 4)
    net:eval()
    local count = 0
    net:apply(function(m)
      assert.is_false(m.training)
      count = count + 1
    end)
    assert.are.equal(1 + 1 + 1 + 2 * 3 + 1, count)
    net:train()
    assert.is_true(net.layers["1"].proj.training)
  end)

  it("builds on meta, materializes and initializes by name independent of construction order", function()
    collectgarbage("stop") -- a finalizer of an earlier test's tensor must not run in between
    local before = titan.memory_stats().allocated
    local m = Net(13, 8, { device = "meta" })
    for _, np in ipairs(m:named_parameters()) do assert.is_true(np[2]:is_meta()) end
    assert.are.equal(before, titan.memory_stats().allocated)
    collectgarbage("restart")
    m:to_empty("cpu"):init_weights(42)
    local r = Net(13, 8) -- constructed with other draws
    r:init_weights(42)
    for _, np in ipairs(m:named_parameters()) do
      assert.are.same(np[2]:tolist_flat(), r:state_dict().tensors[np[1]]:tolist_flat())
    end
    local other = Net(13, 8):init_weights(43)
    assert.are_not.same(other.out.weight:tolist_flat(), r.out.weight:tolist_flat())
    -- linear weights follow trunc-normal(0.02)
    local w = r.out.weight
    assert.truthy(math.abs(w:square():mean():item() ^ 0.5 - 0.02) < 0.01)
    assert.are.same({ 1, 1, 1, 1, 1, 1, 1, 1 }, r.layers["0"].norm.weight:tolist())
  end)

  it("a tiny network trains: loss falls with SGD on a fixed batch", function()
    titan.manual_seed(0)
    local net = Net(7, 16)
    local ids = titan.tensor({ { 1, 2, 3, 4, 5, 6 } }, { dtype = "int64" })
    local targets = titan.tensor({ 2, 3, 4, 5, 6, 0 }, { dtype = "int64" })
    local first, last = sgd_fit(net, 60, 0.5, function()
      return titan.F.cross_entropy(net(ids):reshape(-1, 7), targets)
    end)
    assert.truthy(first > 1.5)
    assert.truthy(last < 0.1, "final loss " .. last)
  end)

  it("Linear with a bias: torch-like names, zero init, and a tiny regression fits weight and bias", function()
    local lin = nn.Linear(3, 2, { bias = true })
    local names = {}
    for i, np in ipairs(lin:named_parameters()) do names[i] = np[1] end
    assert.are.same({ "weight", "bias" }, names)
    assert.are.same({ 0, 0 }, lin.bias:tolist_flat())
    assert.is_nil(nn.Linear(3, 2).bias) -- default unchanged: no bias, as in Llama
    -- y = x @ W^T + b for a fixed W, b; 8 samples, plain SGD on the mean squared error
    local x = titan.randn({ 8, 3 }, { seed = 31, offset = 0 })
    local wt = titan.tensor({ { 0.5, -1, 2 }, { 1.5, 0.25, -0.75 } })
    local bt = titan.tensor({ 3, -2 })
    local y = titan.no_grad(function() return titan.F.linear(x, wt, bt) end)
    local first, last = sgd_fit(lin, 300, 0.1, function()
      local d = lin(x) - y
      return (d * d):mean()
    end)
    assert.truthy(first > 1, "first loss " .. first)
    assert.truthy(last < 1e-6, "final loss " .. last)
    local bf = lin.bias:tolist_flat()
    assert.truthy(math.abs(bf[1] - 3) < 1e-3 and math.abs(bf[2] + 2) < 1e-3, "bias " .. bf[1] .. ", " .. bf[2])
  end)

  it("no_grad stops recording; detach cuts the graph", function()
    local x = titan.ones(3):requires_grad_()
    local y = titan.no_grad(function() return x * 2 end)
    assert.is_nil(y.requires_grad)
    local z = (x * 2):detach()
    assert.is_nil(z._node)
  end)

  it("custom autograd.Function in Lua", function()
    local Cube = titan.autograd.Function({
      forward = function(ctx, x)
        ctx:save_for_backward(x)
        return x * x * x
      end,
      backward = function(ctx, g)
        local x = ctx.saved_tensors[1]
        return g * x * x * 3
      end,
    })
    local x = titan.tensor({ 1, 2, 3 }, { dtype = "float64" }):requires_grad_()
    Cube(x):sum():backward()
    assert.are.same({ 3, 12, 27 }, x.grad:tolist())
    local ok = require("titan.gradcheck")(function(t) return Cube(t) end, { x })
    assert.is_true(ok)
  end)
end)

describe("weight gradients", function()
  -- autograd's ctx:accum(i, overwrite): the first gradient of a weight after zero_grad is the GEMM's
  -- output (beta = 0) in a buffer nobody zeroed; later ones add into it (beta = 1).
  it("a Linear's (and a matmul's) first weight gradient is written, not added to zeros; the next adds",
    function()
      titan.scope(function()
        local tensor = require("titan.tensor")
        local lin = nn.Linear(8, 4, { dtype = "float64" })
        local w = titan.randn({ 8, 3 }, { seed = 7, dtype = "float64" }):requires_grad_()
        local x = titan.randn({ 5, 8 }, { seed = 3, dtype = "float64" })
        local zeros_like, zeroed = tensor.zeros_like, 0
        tensor.zeros_like = function(...)
          zeroed = zeroed + 1
          return zeros_like(...)
        end
        local fine, err = pcall(function()
          lin(x):sum():backward()
          x:matmul(w):sum():backward()
        end)
        tensor.zeros_like = zeros_like
        if not fine then error(err, 0) end
        assert.are.equal(0, zeroed, "a weight gradient started from a zero-filled buffer")
        -- d/dW of sum(x @ W^T) = ones^T x: each row of W's gradient is x's column sums; of sum(x @ w) = x^T ones
        local cols = x:sum(1):tolist()
        for i = 1, 4 do
          local row = lin.weight.grad:narrow(1, i, 1):reshape(8):tolist()
          for j = 1, 8 do assert.is_true(math.abs(row[j] - cols[j]) < 1e-12) end
        end
        local gw = w.grad:tolist()
        for j = 1, 8 do
          for k = 1, 3 do assert.is_true(math.abs(gw[j][k] - cols[j]) < 1e-12) end
        end
        lin(x):sum():backward()
        local row = lin.weight.grad:narrow(1, 2, 1):reshape(8):tolist()
        for j = 1, 8 do assert.is_true(math.abs(row[j] - 2 * cols[j]) < 1e-12, "the second backward added") end
      end)
    end)
end)

describe("optimizer primitives", function()
  it("adamw_ follows torch.optim.AdamW's arithmetic (reference in double)", function()
    local p0 = { 0.5, -1.25, 2.0, 0.0 }
    local grads = { { 0.1, -0.2, 0.3, -0.4 }, { -0.05, 0.5, 0.25, 1.0 }, { 0.2, 0.2, -0.1, 0.0 } }
    local lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    local p = titan.tensor(p0)
    local m, v = titan.zeros(4), titan.zeros(4)
    local rp, rm, rv = { unpack(p0) }, { 0, 0, 0, 0 }, { 0, 0, 0, 0 }
    for step, g in ipairs(grads) do
      titan.adamw_(p, titan.tensor(g), m, v, { lr = lr, betas = { b1, b2 }, eps = eps, weight_decay = wd, step = step })
      for i = 1, 4 do
        rp[i] = rp[i] * (1 - lr * wd)
        rm[i] = b1 * rm[i] + (1 - b1) * g[i]
        rv[i] = b2 * rv[i] + (1 - b2) * g[i] * g[i]
        local bc1, bc2 = 1 - b1 ^ step, 1 - b2 ^ step
        rp[i] = rp[i] - lr / bc1 * rm[i] / (math.sqrt(rv[i]) / math.sqrt(bc2) + eps)
      end
    end
    local got = p:tolist()
    for i = 1, 4 do assert(math.abs(got[i] - rp[i]) < 1e-6, ("param %d: %g vs %g"):format(i, got[i], rp[i])) end
  end)

  it("adamw_multi_ equals adamw_ per tensor bit for bit, and checks every tensor before touching any", function()
    local function state(seed, n, bf16)
      local function draw(f, k) return f({ n }, { seed = seed + k, offset = 0 }) end
      local p = draw(titan.randn, 0)
      local e = { p = bf16 and p:to("bfloat16") or p, g = draw(titan.randn, 1), m = draw(titan.randn, 2),
        v = draw(titan.rand, 3) }
      if bf16 then e.master = p:clone(); e.g = e.g:to("bfloat16") end
      return e
    end
    local hp = { lr = 2e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }
    local a, b, entries = {}, {}, {}
    for i = 1, 7 do
      local n, bf16 = ({ 1, 5, 64, 300 })[(i - 1) % 4 + 1], i % 3 == 0
      a[i], b[i] = state(10 * i, n, bf16), state(10 * i, n, bf16)
      titan.adamw_(a[i].p, a[i].g, a[i].m, a[i].v, { lr = hp.lr, betas = hp.betas, eps = hp.eps,
        weight_decay = hp.weight_decay, step = i }, a[i].master)
      entries[i] = { b[i].p, b[i].g, b[i].m, b[i].v, b[i].master, i }
    end
    titan.ops.adamw_multi_(entries, hp)
    for i = 1, 7 do
      assert.are.same(a[i].p:float():tolist(), b[i].p:float():tolist())
      assert.are.same(a[i].m:tolist(), b[i].m:tolist())
      assert.are.same(a[i].v:tolist(), b[i].v:tolist())
      if a[i].master then assert.are.same(a[i].master:tolist(), b[i].master:tolist()) end
    end
    -- a bad third tensor: one line naming it, and the first two untouched
    local before = b[1].p:tolist()
    local bad = { entries[1], entries[2], { b[3].p, titan.zeros(2), b[3].m, b[3].v, b[3].master, 1 } }
    local ok, err = pcall(titan.ops.adamw_multi_, bad, hp)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("adamw_multi: tensor 2", 1, true), err)
    assert.are.same(before, b[1].p:tolist())
  end)

  it("scale_multi_ and fill_multi_ equal mul_ and fill_ per tensor; bad input names the tensor", function()
    local a, b = {}, {}
    for i = 1, 5 do
      a[i] = titan.randn({ i * 7 }, { seed = i, offset = 0 })
      b[i] = a[i]:clone()
    end
    titan.ops.scale_multi_(b, 0.37)
    for i = 1, 5 do assert.are.same(a[i]:mul_(0.37):tolist(), b[i]:tolist()) end
    titan.ops.fill_multi_(b, 0)
    for i = 1, 5 do assert.are.same(titan.zeros({ i * 7 }):tolist(), b[i]:tolist()) end
    local ok, err = pcall(titan.ops.scale_multi_, { b[1], titan.ones(4, 4):transpose(1, 2) }, 2)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("scale_multi: tensor 1", 1, true), err)
    ok, err = pcall(titan.ops.fill_multi_, { b[1], titan.zeros({ 3 }, { dtype = "int64" }) }, 1)
    assert.is_false(ok)
    assert.truthy(tostring(err):find("fill_multi: tensor 1", 1, true), err)
    assert.are.same(titan.zeros({ 7 }):tolist(), b[1]:tolist()) -- nothing written before the check failed
  end)

  it("the device-scalar update names what is wrong with its inputs and changes nothing", function()
    local p, g, m, v = titan.ones(4), titan.ones(4), titan.zeros(4), titan.zeros(4)
    local e = { { p, g, m, v, nil, 1 } }
    local hp = { lr = 1e-3, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0 }
    local function fails(fn, text)
      local ok, err = pcall(fn)
      assert.is_false(ok)
      assert.truthy(tostring(err):find(text, 1, true), tostring(err))
    end
    fails(function() titan.ops.adamw_multi_dev_(e, hp, titan.zeros(2)) end,
      "adamw_multi_dev: scalars is float32 with 2 elements; expected float32 with at least 3")
    fails(function() titan.ops.adamw_multi_dev_(e, hp, titan.ops.adamw_scalars(e, hp), titan.zeros(2)) end,
      "adamw_multi_dev: norm_clip is float32 with 2 elements; expected float64 with at least 2")
    local d = { { titan.ones(4, { dtype = "float64" }), titan.ones(4, { dtype = "float64" }), m, v, nil, 1 } }
    fails(function() titan.ops.adamw_multi_dev_(d, hp, titan.ops.adamw_scalars(d, hp)) end,
      "adamw_multi_dev: tensor 0: float64 params and grads take tt_op_adamw_multi")
    fails(function() titan.ops.global_norm_dev_({ g }, 1, titan.zeros(1, { dtype = "float64" })) end,
      "global_norm_dev: out is float64 with 1 elements; expected float64 with at least 2")
    fails(function() titan.ops.adamw_scalars({ { p, g, m, v, nil, 0 } }, hp) end,
      "adamw_scalars: tensor 0: step counts from 1, got 0")
    assert.are.same({ 1, 1, 1, 1 }, p:tolist())
    assert.are.same({ 0, 0, 0, 0 }, m:tolist())
  end)

  it("adamw_ with f32 master weights for a bf16 parameter", function()
    local master = titan.tensor({ 1.001, -2.003 })
    local p = master:to("bfloat16")
    local m, v = titan.zeros(2), titan.zeros(2)
    titan.adamw_(p, titan.tensor({ 0.5, -0.5 }), m, v, { lr = 1e-3, step = 1 }, master)
    assert.are.same(master:to("bfloat16"):float():tolist(), p:float():tolist())
    assert.truthy(math.abs(master:tolist()[1] - (1.001 - 1e-3)) < 1e-6)
  end)

  it("global_norm over many tensors", function()
    local a, b = titan.tensor({ 3, 4 }), titan.tensor({ { 12 } }, { dtype = "float64" })
    assert.are.equal(13, titan.global_norm({ a, b }))
    assert.are.equal(0, titan.global_norm({}))
  end)
end)
