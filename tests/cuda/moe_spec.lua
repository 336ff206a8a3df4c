-- The mixture-of-experts layer (lua/models/moe.lua) on the GPU against the CPU: the same weights and
-- input give the same routing, outputs and gradients (f32; top 2 of 4 with softmax scores and a shared
-- expert; top 1 with sigmoid scores and an expert bias), and the same token counts. Exits 77 without a
-- GPU (helpers.lua).
package.path = "./tests/cuda/?.lua;" .. package.path
local H = require("helpers")
H.require_device()

local titan = require("titan")
local moe = require("models.moe")

local function run(m, device, bias)
  local l = moe.MoE(64, 96, m, { device = device })
  for i, np in ipairs(l:named_parameters()) do
    np[2]:copy_(H.randn(np[2]:shape(), 100 + i, "float32", 0.2):to(device))
  end
  if bias then l.expert_bias:copy_(titan.tensor(bias):to(device)) end
  local x = H.randn({ 2, 24, 64 }, 7, "float32"):to(device):requires_grad_()
  local y = l(x)
  y:backward(H.randn({ 2, 24, 64 }, 8, "float32"):to(device))
  return y:detach(), x.grad, l.router.weight.grad, l.experts["1"].w2.weight.grad, { unpack(l.counts) }
end

describe("cuda mixture of experts", function()
  for _, c in ipairs({
    { "top 2 of 4, softmax, shared expert", { num_experts = 4, top_k = 2, score_func = "softmax" } },
    { "top 1 of 4, sigmoid, expert bias", { num_experts = 4, top_k = 1, num_shared_experts = 0 },
      { 0.02, -0.01, 0.0, 0.01 } },
  }) do
    it(c[1] .. ": the CPU's routing, outputs and gradients", H.scoped(function()
      local want = { run(c[2], "cpu", c[3]) }
      local got = { run(c[2], H.DEV, c[3]) }
      assert.are.same(want[5], got[5]) -- the same tokens went to the same experts
      H.check(got[1], want[1], 1e-5, "out")
      H.check(got[2], want[2], 1e-5, "dx")
      H.check(got[3], want[3], 1e-5, "router dW")
      H.check(got[4], want[4], 1e-5, "expert 1 w2 dW")
    end))
  end
end)
