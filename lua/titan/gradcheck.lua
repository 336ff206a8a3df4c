-- gradcheck.lua — compare autograd's gradients with central finite
-- differences (as torch.autograd.gradcheck does). Inputs should be float64
-- CPU tensors; the check perturbs each element in place, so keep them small.
--
--   local ok, report = gradcheck(function(x, w) return F.linear(x, w) end, {x, w})
local tensor = require("titan.tensor")
local autograd = require("titan.autograd")
local memory = require("titan.memory")
local tffi = require("titan.ffi")
local ffi, C = tffi.ffi, tffi.C

local function f64_ptr(t)
  assert(t:dtype() == "float64" and t:device() == "cpu" and t:is_contiguous(),
    "gradcheck: inputs must be contiguous float64 cpu tensors")
  return ffi.cast("double*", C.tt_tensor_data(tensor.cptr(t)))
end

-- <fn(inputs), r>: the output projected on the fixed random tensor r.
local function projected(fn, inputs, r)
  return memory.scope(function() return (fn(unpack(inputs)) * r):sum():item() end)
end

-- opts: eps (1e-6), atol (1e-8), rtol (1e-5). Checks every input with requires_grad.
local function gradcheck(fn, inputs, opts)
  opts = opts or {}
  local eps, atol, rtol = opts.eps or 1e-6, opts.atol or 1e-8, opts.rtol or 1e-5
  -- analytic
  for _, x in ipairs(inputs) do
    if type(x) == "table" and x.grad then x.grad:free(); x.grad = nil end
  end
  local r
  memory.scope(function()
    local out = fn(unpack(inputs))
    r = memory.keep(tensor.randn(out:shape(), { dtype = "float64", seed = 12345, offset = 0 }))
    local l = (out * r):sum()
    l:backward()
  end)
  local worst, report = 0, {}
  for k, x in ipairs(inputs) do
    if type(x) == "table" and x.requires_grad then
      local p = f64_ptr(x)
      local g = x.grad and x.grad:tolist_flat() or nil
      local n = x:numel()
      for i = 0, n - 1 do
        local orig = p[i]
        p[i] = orig + eps
        local fp = autograd.no_grad(projected, fn, inputs, r)
        p[i] = orig - eps
        local fm = autograd.no_grad(projected, fn, inputs, r)
        p[i] = orig
        local num = (fp - fm) / (2 * eps)
        local ana = g and g[i + 1] or 0
        local err = math.abs(num - ana)
        local tol = atol + rtol * math.abs(num)
        if err > tol then
          report[#report + 1] = ("input %d element %d: analytic %.10g, numeric %.10g"):format(k, i, ana, num)
        end
        local rel = err / math.max(math.abs(num), 1e-3)
        if rel > worst then worst = rel end
      end
    end
  end
  r:free()
  return #report == 0, table.concat(report, "\n", 1, math.min(#report, 10)), worst
end

return gradcheck
