-- Async checkpoints of CUDA tensors: the snapshot is an asynchronous copy
-- into pinned host memory (no host wait), yet it holds the values of the
-- moment save was called — parameters and optimizer state changed on the
-- GPU right after save (an AdamW step, a fill) do not reach the files, which
-- hold the bytes a sync save writes (f32 and bf16 parameters; a stored dtype
-- other than the tensor's and a strided view, packed on the device first).
-- A second save reuses the pinned buffers of the first. Exits 77 without a
-- GPU (see helpers.lua).
package.path = "./tests/cuda/?.lua;" .. package.path
local H = require("helpers")
H.require_device()

local titan = require("titan")
local llama3 = require("models.llama3")
local optim = require("titan.optim")
local ckpt = require("titan.checkpoint")
local format = require("titan.checkpoint.format")
local fs = require("titan.checkpoint.fs")

local SMALL = { dim = 128, n_layers = 2, n_heads = 4, n_kv_heads = 2, vocab_size = 512, multiple_of = 64,
  max_seq_len = 128 }

-- A fresh folder of this run, removed at the end.
local root = ("/tmp/titan_cuda_ckpt_spec.%d"):format(fs.pid())
local function folder(name)
  local d = root .. "/" .. name
  fs.mkdirs(d)
  return d
end

local function manager(dump, async, extra)
  local cfg = { enable = true, async_mode = async and "async" or "disabled", keep_latest_k = 0 }
  for k, v in pairs(extra or {}) do cfg[k] = v end
  return ckpt.Manager(cfg, { dump_folder = dump, log = function() end })
end

local function data_file(dump, step) return fs.read_file(("%s/checkpoint/step-%d/rank-0.bin"):format(dump, step)) end

-- Host copies of the model's state dict: { {name, tensor} } (kept).
local function host_state(model)
  local sd, out = model:state_dict(), {}
  for _, name in ipairs(sd.names) do out[#out + 1] = { name, titan.keep(sd.tensors[name]:to("cpu"):clone()) } end
  return out
end

local function pinned_delta(s0, s1)
  return { allocs = s1.num_allocs - s0.num_allocs, hits = s1.num_cache_hits - s0.num_cache_hits,
    reserved = s1.reserved - s0.reserved, allocated = s1.allocated - s0.allocated }
end

describe("cuda async checkpoints", function()
  teardown(function() pcall(fs.remove_all, root) end)

  for _, dtype in ipairs({ "float32", "bfloat16" }) do
    it("an async save holds the values of the moment it was called, in a sync save's bytes; a second save reuses "
      .. "the pinned buffers (" .. dtype .. ")", H.scoped(function()
      local model = llama3.build("debugmodel", { device = H.DEV, seed = 0, dtype = dtype, overrides = SMALL })
      local opt = optim.AdamW(model:named_parameters(), { lr = 1e-2 })
      local bs = H.batches(1, 2, 64, SMALL.vocab_size, 700)
      local function step()
        titan.scope(function() H.loss_of(model, bs[1], H.DEV):backward() end)
        opt:step()
        opt:zero_grad()
      end
      step() -- the optimizer state exists (f32 master weights for bf16)
      local old = host_state(model)
      local state = { model = model, optimizer = opt, extra = { step = 1 } }
      local sync_dump, async_dump = folder(dtype .. "-sync"), folder(dtype .. "-async")
      manager(sync_dump, false):save(1, state, { force = true })

      local p0 = titan.memory_stats("pinned")
      local mgr = manager(async_dump, true)
      mgr:save(1, state, { force = true })
      -- Training goes on at once: these kernels are queued behind the snapshot's copies.
      step()
      titan.no_grad(function()
        for _, p in ipairs(model:parameters()) do p:fill_(7) end
      end)
      mgr:wait()
      local p1 = titan.memory_stats("pinned")

      assert(data_file(async_dump, 1) == data_file(sync_dump, 1), "the async save's rank-0.bin differs from the sync save's")
      -- Every CUDA tensor went through pinned memory (the CPU's, in the
      -- harness self-test, never do), and every buffer came back once written.
      local pinned = H.ON_GPU and #format.open(async_dump .. "/checkpoint/step-1"):names() or 0
      local d1 = pinned_delta(p0, p1)
      assert.are.equal(pinned, d1.allocs)
      assert.are.equal(0, d1.allocated)

      local cpu = llama3.build("debugmodel", { device = "cpu", seed = 1, overrides = SMALL })
      ckpt.load(async_dump .. "/checkpoint/step-1", { model = cpu }, { model_only = true })
      local sd = cpu:state_dict()
      for _, e in ipairs(old) do
        H.check_exact(sd.tensors[e[1]], e[2], e[1] .. " loaded from the async save")
        e[2]:free()
      end
      H.free_model(cpu)

      -- The second save has the same sizes: all of it from the cache.
      mgr:save(2, { model = model, optimizer = opt, extra = { step = 2 } }, { force = true })
      mgr:close()
      local d2 = pinned_delta(p1, titan.memory_stats("pinned"))
      assert.are.equal(pinned, d2.allocs)
      assert.are.equal(pinned, d2.hits)
      assert.are.equal(0, d2.reserved)
      assert.are.equal(0, d2.allocated)
      assert.are.equal(7, format.open(async_dump .. "/checkpoint/step-2"):load_tensor("norm.weight"):tolist_flat()[1])
      H.free_model(model, opt)
      for _, b in ipairs(bs) do b.inputs:free(); b.targets:free() end
    end))
  end

  it("a model-only final save in export_dtype (bf16 from f32, converted on the device) matches the sync one",
    H.scoped(function()
      local model = llama3.build("debugmodel", { device = H.DEV, seed = 0, overrides = SMALL })
      local extra = { last_save_model_only = true, export_dtype = "bfloat16" }
      local state = { model = model, extra = { step = 3 } }
      local sync_dump, async_dump = folder("export-sync"), folder("export-async")
      manager(sync_dump, false, extra):save(3, state, { final = true })
      local mgr = manager(async_dump, true, extra)
      mgr:save(3, state, { final = true })
      titan.no_grad(function()
        for _, p in ipairs(model:parameters()) do p:fill_(-3) end
      end)
      mgr:close()
      assert(data_file(async_dump, 3) == data_file(sync_dump, 3), "the async save's rank-0.bin differs from the sync save's")
      H.free_model(model)
    end))

  it("a strided view stored in another dtype: the async writer's bytes are the sync writer's", H.scoped(function()
    local t = H.randn({ 64, 96 }, 5, "float32"):to(H.DEV)
    local function write(async, after_add)
      local dir = folder(async and "view-async" or "view-sync")
      local w = format.writer(dir, 0, { async = async })
      w:add({ name = "x", tensor = t:transpose(1, 2), dtype = "bfloat16" })
      w:add({ name = "y", tensor = t })
      if after_add then after_add() end
      w:start()
      w:finish()
      return fs.read_file(dir .. "/" .. format.data_file(0))
    end
    local sync = write(false)
    local async = write(true, function() t:fill_(1) end) -- right after the snapshots
    assert(sync and async == sync, "the async writer's file differs from the sync writer's")
  end))
end)
