-- The whole model on the GPU against the CPU: the same seeded weights on
-- both devices, the gradients of a small Llama 3 (grouped-query heads) from
-- CUDA autograd against CPU autograd, the debug model's loss curve over a
-- few AdamW steps in f32 (tight) and with bf16 parameters (loose), and no
-- device memory growth from step to step. Exits 77 without a GPU (see
-- helpers.lua).
package.path = "./tests/cuda/?.lua;" .. package.path
local H = require("helpers")
H.require_device()

local titan = require("titan")
local llama3 = require("models.llama3")

-- A small Llama 3 with GQA and odd-ish sizes: dim 128, 4 heads of 32 over 2 kv heads.
local SMALL = { dim = 128, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = 512, multiple_of = 64,
  max_seq_len = 128 }

local batches, free_model, loss_of, train = H.batches, H.free_model, H.loss_of, H.train
-- The debug model's batches: shorter on cuemu (the CPU emulation), where the fallback attention is slow.
local DB, DT = H.EMULATED and 2 or 4, H.EMULATED and 32 or 128

local function curve_str(xs)
  local s = {}
  for i, v in ipairs(xs) do s[i] = ("%.5f"):format(v) end
  return table.concat(s, " ")
end

describe("cuda model", function()
  it("seeded initialization gives the same weights on the device as on the CPU", H.scoped(function()
    local cpu = llama3.build("debugmodel", { device = "cpu", seed = 0, overrides = SMALL })
    local gpu = llama3.build("debugmodel", { device = H.DEV, seed = 0, overrides = SMALL })
    local pc, pg = cpu:named_parameters(), gpu:named_parameters()
    assert.are.equal(#pc, #pg)
    for i = 1, #pc do H.check(pg[i][2], pc[i][2], 1e-7, pg[i][1]) end
    free_model(cpu)
    free_model(gpu)
  end))

  it("gradients of a small Llama 3 (GQA) from CUDA autograd match CPU autograd (f32)", H.scoped(function()
    local bs = batches(1, 2, 64, SMALL.vocab_size, 100)
    local grads, losses = {}, {}
    for i, device in ipairs({ "cpu", H.DEV }) do
      local model = llama3.build("debugmodel", { device = device, seed = 0, overrides = SMALL })
      losses[i] = titan.scope(function()
        local loss = loss_of(model, bs[1], device)
        loss:backward()
        return loss:item()
      end)
      grads[i] = {}
      for _, np in ipairs(model:named_parameters()) do
        assert(np[2].grad, np[1] .. " has no gradient on " .. device)
        grads[i][#grads[i] + 1] = { np[1], titan.keep(np[2].grad:to("cpu"):clone()) }
      end
      free_model(model)
    end
    assert(math.abs(losses[2] - losses[1]) <= 1e-5 * math.abs(losses[1]),
      ("loss %.9g on the device, %.9g on the CPU"):format(losses[2], losses[1]))
    for j = 1, #grads[1] do
      H.check(grads[2][j][2], grads[1][j][2], 1e-4, "grad of " .. grads[1][j][1])
      grads[1][j][2]:free()
      grads[2][j][2]:free()
    end
    for _, b in ipairs(bs) do b.inputs:free(); b.targets:free() end
  end))

  it("the debug model trains on the device with the CPU's loss curve (f32)", H.scoped(function()
    local bs = batches(4, DB, DT, 2048, 200)
    local cl, cn = train("debugmodel", { device = "cpu", seed = 0 }, bs, 12)
    local gl, gn = train("debugmodel", { device = H.DEV, seed = 0 }, bs, 12)
    io.stderr:write("\n  debugmodel f32 losses, cpu:    " .. curve_str(cl) .. "\n  debugmodel f32 losses, device: " .. curve_str(gl) .. "\n")
    for i = 1, #cl do
      assert(math.abs(gl[i] - cl[i]) <= 1e-3 * math.abs(cl[i]),
        ("step %d: loss %.6f on the device, %.6f on the CPU\n  cpu:    %s\n  device: %s"):format(i, gl[i], cl[i],
          curve_str(cl), curve_str(gl)))
      assert(math.abs(gn[i] - cn[i]) <= 1e-2 * math.abs(cn[i]),
        ("step %d: grad norm %.6f on the device, %.6f on the CPU"):format(i, gn[i], cn[i]))
    end
    assert(gl[#gl] < gl[1] - 0.5, "the loss must fall: " .. curve_str(gl))
    for _, b in ipairs(bs) do b.inputs:free(); b.targets:free() end
  end))

  it("the debug model trains with bf16 parameters (f32 master weights) close to the CPU's f32 curve", H.scoped(function()
    local bs = batches(4, DB, DT, 2048, 200)
    local cl = train("debugmodel", { device = "cpu", seed = 0 }, bs, 12)
    local gl = train("debugmodel", { device = H.DEV, seed = 0, dtype = "bfloat16" }, bs, 12)
    io.stderr:write("\n  debugmodel losses, cpu f32:     " .. curve_str(cl) .. "\n  debugmodel losses, device bf16: " .. curve_str(gl) .. "\n")
    for i = 1, #cl do
      assert(math.abs(gl[i] - cl[i]) <= 5e-2 * math.abs(cl[i]),
        ("step %d: bf16 loss %.5f on the device, f32 %.5f on the CPU\n  cpu f32:     %s\n  device bf16: %s"):format(
          i, gl[i], cl[i], curve_str(cl), curve_str(gl)))
    end
    assert(gl[#gl] < gl[1] - 0.5, "the loss must fall: " .. curve_str(gl))
    for _, b in ipairs(bs) do b.inputs:free(); b.targets:free() end
  end))

  it("device memory does not grow from step to step, and is returned when the model is freed", H.scoped(function()
    local dev_name = H.ON_GPU and "cuda:0" or "cpu"
    local bs = batches(2, 2, 64, SMALL.vocab_size, 300)
    -- Whatever an earlier failed test left to the garbage collector goes now,
    -- and the collector stays out of the measurement.
    collectgarbage("collect")
    collectgarbage("stop")
    local before = titan.memory_stats(dev_name).allocated
    local live = titan.live_tensors()
    local okt, err, _, mem = pcall(train, "debugmodel", { device = H.DEV, seed = 0, overrides = SMALL }, bs, 6)
    if not okt then
      collectgarbage("restart")
      error(err, 0)
    end
    -- step 1 creates the optimizer state; from step 2 on the footprint is constant
    for i = 3, #mem do
      assert(mem[i] == mem[2], ("allocated after step %d: %d bytes, after step 2: %d"):format(i, mem[i], mem[2]))
    end
    local after, live_after = titan.memory_stats(dev_name).allocated, titan.live_tensors()
    collectgarbage("restart")
    assert.are.equal(before, after)
    assert.are.equal(live, live_after)
    for _, b in ipairs(bs) do b.inputs:free(); b.targets:free() end
  end))
end)
