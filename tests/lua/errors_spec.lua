-- Bad input raises one clear Lua error naming the op and the shapes.
local titan = require("titan")
local F = titan.F

local function err_of(fn)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error")
  return tostring(err)
end

local function assert_mentions(msg, ...)
  for i = 1, select("#", ...) do
    local s = select(i, ...)
    assert(msg:find(s, 1, true), ("error message %q does not mention %q"):format(msg, s))
  end
  assert.is_nil(msg:find("\n"), "one line: " .. msg)
end

describe("bad input", function()
  it("mismatched shapes name the op and both shapes", function()
    local a, b = titan.ones(2, 3), titan.ones(4, 5)
    assert_mentions(err_of(function() return a:matmul(b) end), "matmul", "[2, 3]", "[4, 5]")
    assert_mentions(err_of(function() return a + titan.ones(4, 3) end), "add", "[2, 3]", "[4, 3]")
    assert_mentions(err_of(function() return a * titan.ones(2, 2) end), "mul", "[2, 3]", "[2, 2]")
    assert_mentions(err_of(function() return F.rms_norm(a, titan.ones(4)) end), "rmsnorm", "[2, 3]", "[4]")
    assert_mentions(err_of(function() return F.swiglu(a, titan.ones(3, 2)) end), "swiglu", "[2, 3]", "[3, 2]")
    assert_mentions(err_of(function()
      return F.attention(titan.ones(1, 4, 3, 8), titan.ones(1, 4, 2, 8), titan.ones(1, 4, 2, 8))
    end), "attention", "[1, 4, 3, 8]", "[1, 4, 2, 8]")
    assert_mentions(err_of(function()
      return F.cross_entropy(titan.ones(4, 10), titan.tensor({ 1, 2 }, { dtype = "int64" }))
    end), "cross_entropy", "[4, 10]", "[2]")
    assert_mentions(err_of(function() return a:reshape(4, 2) end), "reshape", "[4, 2]", "[2, 3]")
    assert_mentions(err_of(function() return titan.cat({ a, titan.ones(3, 4) }, 1) end), "cat", "[3, 4]", "[2, 3]")
  end)

  it("a linear layer's bias of the wrong length, dtype or device gets one line", function()
    local x, w = titan.ones(2, 3), titan.ones(4, 3)
    assert_mentions(err_of(function() return F.linear(x, w, titan.ones(5)) end), "linear", "bias [5]", "[4, 3]",
      "expected bias [4]")
    assert_mentions(err_of(function() return F.linear(x, w, titan.ones(1, 4)) end), "linear", "bias [1, 4]",
      "expected bias [4]")
    assert_mentions(err_of(function() return F.linear(x, w, titan.ones({ 4 }, { dtype = "int64" })) end), "linear",
      "bias [4]", "int64", "float32")
    assert_mentions(err_of(function() return F.linear(x, w, titan.ones({ 4 }, { device = "meta" })) end), "linear",
      "bias [4]", "meta", "cpu")
    assert_mentions(err_of(function() return F.linear(x, titan.ones(4, 2), titan.ones(4)) end), "linear", "[2, 3]",
      "[4, 2]")
  end)

  it("wrong dtypes name the op, the shapes and the dtypes", function()
    local a, b = titan.ones(2, 3), titan.ones({ 3, 2 }, { dtype = "float64" })
    assert_mentions(err_of(function() return a:matmul(b) end), "matmul", "[2, 3]", "[3, 2]", "float32", "float64")
    assert_mentions(err_of(function() return a + titan.ones({ 2, 3 }, { dtype = "float64" }) end), "add", "float32",
      "float64")
    local ids_f = titan.ones(2)
    assert_mentions(err_of(function() return F.embedding(titan.ones(5, 4), ids_f) end), "embedding", "[2]", "float32",
      "int64")
    assert_mentions(err_of(function() return titan.ones({ 2 }, { dtype = "int32" }):exp() end), "exp", "[2]", "int32")
    assert_mentions(err_of(function() return titan.ones({ 2 }, { dtype = "nope" }) end), "unknown dtype", "nope")
  end)

  it("out-of-range indices name the op, the index and the range", function()
    local w = titan.ones(5, 4)
    assert_mentions(err_of(function() return F.embedding(w, titan.tensor({ 1, 7 }, { dtype = "int64" })) end),
      "embedding", "index 7", "[0, 5)")
    assert_mentions(err_of(function()
      return titan.index_select(w, 1, titan.tensor({ -1 }, { dtype = "int64" }))
    end), "index_select", "index -1", "[0, 5)")
    assert_mentions(err_of(function()
      return F.cross_entropy(titan.ones(2, 3), titan.tensor({ 0, 3 }, { dtype = "int64" }))
    end), "cross_entropy", "index 3", "[0, 3)")
    assert_mentions(err_of(function() return w:narrow(1, 4, 3) end), "narrow", "[5, 4]")
    assert_mentions(err_of(function() return w:sum(3) end), "sum", "[5, 4]")
  end)

  it("a non-contiguous tensor where a kernel needs contiguity", function()
    local x = titan.ones(4, 6):t() -- [6, 4], strided
    assert_mentions(err_of(function() return F.rms_norm(x, titan.ones(4)) end), "rmsnorm", "[6, 4]", "contiguous")
    assert_mentions(err_of(function() return F.swiglu(x, x) end), "swiglu", "[6, 4]", "contiguous")
    assert_mentions(err_of(function() return x:softmax() end), "softmax", "[6, 4]", "contiguous")
    local q = titan.ones(1, 3, 2, 4):transpose(2, 3) -- [1, 2, 3, 4] strided
    assert_mentions(err_of(function() return F.attention(q, q, q) end), "attention", "[1, 2, 3, 4]", "contiguous")
    assert_mentions(err_of(function()
      return F.cross_entropy(titan.ones(3, 2):t(), titan.tensor({ 0, 1 }, { dtype = "int64" }))
    end), "cross_entropy", "[2, 3]", "contiguous")
    -- ops that handle strides say nothing and compute the right thing
    assert.are.equal(48, (x + 1):sum():item())
  end)

  it("a freed tensor and unknown devices are reported, not crashed on", function()
    local t = titan.ones(2)
    t:free()
    assert.truthy(err_of(function() return t + 1 end):find("freed"))
    assert.truthy(err_of(function() return titan.ones({ 2 }, { device = "tpu" }) end):find("unknown device"))
    -- (on a GPU machine cuda:0 exists: a device number past the last one is the bad input there)
    local dev = titan.cuda_available() and "cuda:999" or "cuda:0"
    local msg = err_of(function() return titan.ones({ 2 }, { device = dev }) end)
    assert.truthy(msg:find(dev, 1, true) and msg:find("not available"), msg)
  end)
end)

describe("dtypes a backend does not implement", function()
  it("bf16 on the CPU's fused kernels names the op, the dtype and the backend", function()
    local x = titan.ones({ 2, 4 }, { dtype = "bfloat16" })
    local ok, err = pcall(titan.F.rms_norm, x, titan.ones({ 4 }, { dtype = "bfloat16" }))
    assert.is_false(ok)
    assert.truthy(tostring(err):find("rmsnorm: dtype bfloat16 is not implemented by the cpu backend", 1, true), err)
    -- matmul computes bf16 in f32 on the CPU instead
    assert.are.same({ 2, 2 }, x:matmul(x:t()):shape())
  end)
end)
