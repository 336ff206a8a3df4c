-- The tensor face: creation, dtypes, views, copies, printing, RNG.
local titan = require("titan")

describe("tensors", function()
  it("creation functions give the right shapes and values", function()
    assert.are.same({ 2, 3 }, titan.zeros(2, 3):shape())
    assert.are.same({ 4 }, titan.ones({ 4 }):shape())
    assert.are.same({ 7, 7, 7 }, titan.full({ 3 }, 7):tolist())
    assert.are.same({ 1, 3, 5 }, titan.arange(1, 6, 2):tolist())
    assert.are.same({ { 1, 2 }, { 3, 4 } }, titan.tensor({ { 1, 2 }, { 3, 4 } }):tolist())
    assert.are.equal(5, titan.tensor(5):item())
    assert.are.same({}, titan.tensor(5):shape())
    assert.has_error(function() titan.tensor({ { 1, 2 }, { 3 } }) end)
  end)

  it("dtypes round-trip through casts (bf16, f16, f8, ints)", function()
    local x = titan.tensor({ 1, -2.5, 3.140625, 65504, 1e-3 })
    assert.are.same({ 1, -2.5, 3.140625, 65504, 0.0010004043579101562 }, x:to("float16"):float():tolist())
    local b = x:to("bfloat16"):float():tolist()
    assert.are.same({ 1, -2.5, 3.140625, 65536, 0.00099945068359375 }, b)
    assert.are.same({ 1, -2, 3, 65504, 0 }, x:to("int32"):tolist())
    local e4 = titan.tensor({ 1, 0.5, 448, 1000, -0.0625 }):to("float8_e4m3fn"):float():tolist()
    assert.are.same({ 1, 0.5, 448, 448, -0.0625 }, e4) -- saturates at 448
    local e5 = titan.tensor({ 1, 0.5, 57344, -3 }):to("float8_e5m2"):float():tolist()
    assert.are.same({ 1, 0.5, 57344, -3 }, e5)
    -- every finite value each fp8 format can hold comes back unchanged,
    -- signed zeros and subnormals included, and zeros() of fp8 is zero
    for _, f in ipairs({ { "float8_e4m3fn", 3, 7, 15 }, { "float8_e5m2", 2, 15, 30 } }) do
      local name, mbits, bias, emax = f[1], f[2], f[3], f[4]
      local vals = {}
      for e = 0, emax do
        for m = 0, 2 ^ mbits - 1 do
          if not (name == "float8_e4m3fn" and e == 15 and m == 7) then -- e4m3fn's NaN
            local v = e == 0 and m * 2 ^ (1 - bias - mbits) or (m + 2 ^ mbits) * 2 ^ (e - bias - mbits)
            vals[#vals + 1] = v
            vals[#vals + 1] = -v
          end
        end
      end
      local back = titan.tensor(vals):to(name):float():tolist()
      for i, v in ipairs(vals) do
        assert(back[i] == v and 1 / back[i] == 1 / v, ("%s: %.9g came back as %.9g"):format(name, v, back[i]))
      end
      assert.are.same({ 0, 0, 0 }, titan.zeros({ 3 }, { dtype = name }):float():tolist())
    end
    assert.are.equal("bfloat16", x:to("bfloat16"):dtype())
    -- f16 subnormals (below 6.1e-5) round to multiples of 2^-24
    local sub = titan.tensor({ 1e-5, 3e-8, 2 ^ -24, 2 ^ -25 }):to("float16"):float():tolist()
    assert.are.same({ 168 * 2 ^ -24, 2 ^ -24, 2 ^ -24, 0 }, sub)
  end)

  it("views share storage; reshape copies only when it must", function()
    local x = titan.arange(12):reshape(3, 4)
    local v = x:view(4, 3)
    v:fill_(1)
    assert.are.equal(12, x:sum():item())
    local t = x:t()
    assert.is_false(t:is_contiguous())
    assert.has_error(function() t:view(12) end)
    assert.are.same({ 12 }, t:reshape(12):shape())
    local n = titan.arange(10):narrow(1, 3, 4)
    assert.are.same({ 2, 3, 4, 5 }, n:tolist())
    local e = titan.tensor({ { 1 }, { 2 } }):expand(2, 3)
    assert.are.same({ { 1, 1, 1 }, { 2, 2, 2 } }, e:tolist())
    assert.are.same({ 0, 0 }, e:stride() and { e:stride()[2], 0 })
    local parts = titan.arange(10):chunk(3)
    assert.are.equal(3, #parts)
    assert.are.same({ 8, 9 }, parts[3]:tolist())
    assert.are.same({ 4, 4, 2 }, { parts[1]:numel(), parts[2]:numel(), parts[3]:numel() })
  end)

  it("copy_ converts dtypes and handles strided destinations", function()
    local x = titan.zeros(3, 2)
    x:t():copy_(titan.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }, { dtype = "float64" }))
    assert.are.same({ { 1, 4 }, { 2, 5 }, { 3, 6 } }, x:tolist())
  end)

  it("prints like PyTorch with shape, dtype and device, and truncates", function()
    local s = tostring(titan.ones(2, 3))
    assert.are.equal("tensor([[1., 1., 1.],\n        [1., 1., 1.]], shape=[2, 3], dtype=float32, device=cpu)", s)
    assert.are.equal("tensor([0.5000, 1.2500], shape=[2], dtype=float64, device=cpu)",
      tostring(titan.tensor({ 0.5, 1.25 }, { dtype = "float64" })))
    local big = tostring(titan.zeros(100, 100))
    assert.truthy(big:find("...", 1, true))
    assert.truthy(#big < 1000)
    assert.truthy(tostring(titan.empty({ 3 }, { device = "meta" })):find("device=meta"))
    assert.truthy(tostring(titan.tensor({ 1, 2 }, { dtype = "int64" })):find("tensor%(%[1, 2%]"))
  end)

  it("counter-based RNG: same (seed, offset) gives the same numbers; offsets address the stream", function()
    local a = titan.randn({ 1000 }, { seed = 7, offset = 0 })
    local b = titan.randn({ 1000 }, { seed = 7, offset = 0 })
    assert.are.same(a:tolist(), b:tolist())
    -- a shard drawn at its global offset equals the slice of the whole
    local tail = titan.randn({ 400 }, { seed = 7, offset = 600 })
    assert.are.same(a:narrow(1, 601, 400):contiguous():tolist(), tail:tolist())
    local c = titan.randn({ 1000 }, { seed = 8, offset = 0 })
    assert.are_not.same(a:tolist(), c:tolist())
    -- moments
    local big = titan.randn({ 200000 }, { seed = 1, dtype = "float64" })
    assert.truthy(math.abs(big:mean():item()) < 0.01)
    assert.truthy(math.abs(big:square():mean():item() - 1) < 0.02)
    local u = titan.rand({ 100000 }, { seed = 2, dtype = "float64" })
    assert.truthy(math.abs(u:mean():item() - 0.5) < 0.01)
    assert.truthy(u:max():item() < 1)
    local tn = titan.trunc_normal({ 100000 }, { seed = 3, std = 1, a = -1, b = 1, dtype = "float64" })
    assert.truthy(tn:abs():max():item() <= 1)
    -- truncated to [-1, 1], a standard normal has variance ~0.2911
    assert.truthy(math.abs(tn:square():mean():item() - 0.2911) < 0.01)
  end)

  it("the same numbers regardless of thread count", function()
    local n = titan.num_threads()
    local a = titan.randn({ 100000 }, { seed = 5, offset = 0 }):sum():item()
    titan.set_num_threads(1)
    local b = titan.randn({ 100000 }, { seed = 5, offset = 0 }):sum():item()
    titan.set_num_threads(n)
    assert.are.equal(a, b)
  end)
  it("'cuda' names cuda:(local rank mod visible devices), from the launcher's variables", function()
    local tensor = require("titan.tensor")
    local function env(t) return function(k) return t[k] end end
    assert.are.equal(0, tensor.local_cuda_index(env({}), 8))
    assert.are.equal(3, tensor.local_cuda_index(env({ LOCAL_RANK = "3" }), 8))
    assert.are.equal(1, tensor.local_cuda_index(env({ OMPI_COMM_WORLD_LOCAL_RANK = "5" }), 4))
    assert.are.equal(2, tensor.local_cuda_index(env({ SLURM_LOCALID = "2" }), 8))
    assert.are.equal(0, tensor.local_cuda_index(env({ LOCAL_RANK = "6" }), 1)) -- each rank sees its own GPU only
    assert.are.equal(0, tensor.local_cuda_index(env({ LOCAL_RANK = "6" }), 0)) -- no GPU: resolved, then refused at use
    local ok, err = pcall(tensor.local_cuda_index, env({ LOCAL_RANK = "x1" }), 8)
    assert.is_false(ok)
    assert.truthy(err:find("local rank 'x1'", 1, true), err)
    tensor.set_default_cuda(5)
    assert.are.equal(5, tensor.device_of("cuda").index)
    tensor.set_default_cuda(nil)
    assert.are.equal(tensor.local_cuda_index(os.getenv, titan.cuda_device_count()), tensor.device_of("cuda").index)
  end)
end)
