-- Deterministic mode on the GPU (debug.deterministic, titan.set_deterministic):
-- the debug model trained twice from the same seed gives bit-identical
-- losses and parameters, in f32 and with bf16 parameters (where attention
-- takes the cuDNN path); and the bf16 attention backward — whose cuDNN
-- engines may accumulate dQ with atomics outside this mode — gives the same
-- dq, dk, dv bits on every call. Exits 77 without a GPU (see helpers.lua).
package.path = "./tests/cuda/?.lua;" .. package.path
local H = require("helpers")
H.require_device()

local titan = require("titan")
local C = titan.C
local box, ok, take, poison, dev = H.box, H.ok, H.take, H.poison, H.dev

describe("cuda deterministic mode", function()
  setup(function() titan.set_deterministic(true) end)
  teardown(function() titan.set_deterministic(false) end)

  for _, dtype in ipairs({ "float32", "bfloat16" }) do
    it("two runs of the debug model from one seed give the same losses and weights, bit for bit (" .. dtype .. ")",
      H.scoped(function()
        assert.is_true(titan.deterministic())
        -- shorter sequences on cuemu (the CPU emulation), where the fallback attention is slow
        local bs = H.EMULATED and H.batches(3, 2, 32, 2048, 500) or H.batches(3, 4, 128, 2048, 500)
        local opts = { device = H.DEV, seed = 0, dtype = dtype }
        local l1, _, _, w1 = H.train("debugmodel", opts, bs, 6, true)
        local l2, _, _, w2 = H.train("debugmodel", opts, bs, 6, true)
        for i = 1, #l1 do
          assert(l1[i] == l2[i], ("step %d: loss %.17g, then %.17g"):format(i, l1[i], l2[i]))
        end
        assert.are.equal(#w1, #w2)
        for i = 1, #w1 do
          assert.are.equal(w1[i][1], w2[i][1])
          H.check_exact(w2[i][2], w1[i][2], dtype .. " " .. w1[i][1] .. " after 6 steps (second run)")
          w1[i][2]:free()
          w2[i][2]:free()
        end
        for _, b in ipairs(bs) do b.inputs:free(); b.targets:free() end
      end))
  end

  it("repeated bf16 attention backward calls give bit-identical dq, dk, dv (GQA, causal and not)", H.scoped(function()
    local B, T, Hq, Hkv, D = 2, 1024, 8, 2, 128
    if H.EMULATED then T, D = 64, 64 end
    local scale = 1 / math.sqrt(D)
    for _, causal in ipairs({ 1, 0 }) do
      local q = dev(H.randn({ B, T, Hq, D }, 11, "bfloat16"))
      local k = dev(H.randn({ B, T, Hkv, D }, 12, "bfloat16"))
      local v = dev(H.randn({ B, T, Hkv, D }, 13, "bfloat16"))
      local dout = dev(H.randn({ B, T, Hq, D }, 14, "bfloat16"))
      local ob, lb = box(), box()
      ok(C.tt_op_attention(q._c, k._c, v._c, causal, scale, ob, lb), "attention")
      local o, lse = take(ob), take(lb)
      local first
      for run = 1, 4 do
        local g = { poison({ B, T, Hq, D }, "bfloat16"), poison({ B, T, Hkv, D }, "bfloat16"),
          poison({ B, T, Hkv, D }, "bfloat16") }
        ok(C.tt_op_attention_backward(q._c, k._c, v._c, o._c, lse._c, dout._c, causal, scale, box(g[1]), box(g[2]),
          box(g[3])), "attention backward")
        if run == 1 then
          first = g
        else
          for j, name in ipairs({ "dq", "dk", "dv" }) do
            H.check_exact(g[j], first[j], ("%s (call %d vs call 1, causal %d)"):format(name, run, causal))
          end
        end
      end
    end
  end))
end)
