-- titan estimate (lua/titan/estimate.lua): for each layout the estimate of
-- rank 0 (its start-up and two steps run on the meta device over fake
-- groups, in this process) against a real run of the same keys on
-- simulated ranks (tests/lua/estimate_worker.lua): the peak within 10% of
-- what the allocator reported, and the bytes each mesh dim's collectives
-- carried in a step equal, kind by kind (8 layouts here; bench/RESULTS.md has 14). Then the command itself: the 8B
-- and 70B recipes in seconds, and bad input in one line.
local cjson = require("cjson")
local env = require("titan.env")
local config = require("titan.config")
local estimate = require("titan.estimate")
local sh = dofile("tests/lua/shell.lua")

local exe = env.build_dir .. "/titan"
local BASE = { "--training.seq_len=64", "--validation.enable=false", "--checkpoint.enable=false", "--training.steps=2" }

local function args(list)
  local out = {}
  for _, a in ipairs(list) do out[#out + 1] = sh.quote(a) end
  return table.concat(out, " ")
end

local layouts = {
  { "1 rank", 1, {} },
  { "FSDP 2", 2, { "--parallelism.dp_shard=2", "--training.local_batch_size=2" } },
  { "TP 2 with SP", 2, { "--parallelism.tp=2", "--training.local_batch_size=4" } },
  { "PP 2 1F1B", 2, { "--parallelism.pp=2", "--parallelism.pipeline_parallel_schedule=1F1B",
    "--training.local_batch_size=4" } },
  { "PP 2 Interleaved1F1B", 2, { "--parallelism.pp=2", "--parallelism.pipeline_parallel_schedule=Interleaved1F1B",
    "--training.local_batch_size=4" } },
  { "CP 2", 2, { "--parallelism.cp=2", "--training.local_batch_size=2" } },
  { "EP 2 (MoE)", 2, { "--model.flavor=debugmodel_moe", "--parallelism.dp_shard=2",
    "--parallelism.expert_parallel_degree=2", "--training.local_batch_size=2" } },
  { "AC full", 1, { "--activation_checkpoint.mode=full" } },
}

describe("titan estimate", function()
  for _, l in ipairs(layouts) do
    local name, n, keys = l[1], l[2], sh.with(BASE, l[3])
    it(name .. ": rank 0's peak within 10% of a real run's, and the same bytes over each mesh dim", function()
      local out = sh.run_ok(("OMP_NUM_THREADS=1 %s --simulate %d tests/lua/estimate_worker.lua %s 2>&1"):format(exe, n,
        args(keys)))
      local real = cjson.decode(out:match("(%b{})%s*$"))
      local cfg = config.resolve(config.load_recipe("lua/recipes/llama3_debugmodel.lua"), keys)
      local est = estimate.run(cfg, n, { device = "h100", roles = { 0 } }).roles[1]
      local ratio = est.peak / real.peak
      assert.is_true(ratio > 0.9 and ratio < 1.1, ("%s: estimated peak %d, real %d (%.3f)"):format(name, est.peak,
        real.peak, ratio))
      local labels = 0
      for label, bytes in pairs(real.traffic) do
        labels = labels + 1
        local e = est.traffic[label]
        assert.truthy(e, ("%s: the real run used the %s group, the estimate did not"):format(name, label))
        for kind, b in pairs(bytes) do
          -- (the rows each rank sends its experts depend on the routing, which the estimate takes as balanced)
          if not (label == "ep" and (kind == "all_to_all" or kind == "send" or kind == "recv")) then
            assert.are.equal(b, e.bytes[kind], ("%s: %s over %s"):format(name, kind, label))
          end
        end
      end
      for label in pairs(est.traffic) do
        assert.truthy(real.traffic[label], ("%s: the estimate used the %s group, the real run did not"):format(name,
          label))
      end
      if n > 1 then assert.is_true(labels > 0, out) end
    end)
  end

  it("lays out Llama 3 8B on 8 H100s and 70B on 256 (FSDP 32 x TP 8) in seconds", function()
    local out = sh.run_ok(exe .. " estimate lua/recipes/llama3_8b.lua --world 8 --device h100 "
      .. "--training.local_batch_size=2 2>&1")
    assert.truthy(out:find("estimate: llama3 8B on 8 rank(s) of NVIDIA H100", 1, true), out)
    assert.truthy(out:find("comm over dp_cp (8 ranks)", 1, true), out)
    assert.truthy(out:match("peak %d+%.%d+ GiB"), out)
    -- (a layout that does not fit says by how much, and which keys would make it fit: each estimated again)
    out = sh.run_ok(exe .. " estimate lua/recipes/llama3_8b.lua --world 8 --device h100 --training.local_batch_size=8 "
      .. "--activation_checkpoint.mode=none 2>&1")
    assert.truthy(out:find("-- does not fit, by", 1, true), out)
    assert.truthy(out:find("would fit with --activation_checkpoint.mode=full: peak", 1, true), out)
    local js = cjson.decode(sh.run_ok(exe .. " estimate lua/recipes/llama3_70b.lua --world 256 --device h100 --json "
      .. "--parallelism.dp_shard=32 --parallelism.tp=8 --training.local_batch_size=16 --model.converters=float8"))
    assert.are.equal(256, js.world)
    local r = js.roles[1]
    assert.truthy(r.traffic.tp and r.traffic.dp_cp, cjson.encode(r.traffic))
    assert.is_true(r.peak > 30 * 2 ^ 30 and r.peak < 120 * 2 ^ 30, tostring(r.peak))
  end)

  it("says in one line what was wrong", function()
    sh.one_line(exe .. " estimate lua/recipes/llama3_debugmodel.lua --world 3 --parallelism.tp=2",
      "parallelism.tp = 2, but the job has 3 rank(s)")
    sh.one_line(exe .. " estimate lua/recipes/llama3_debugmodel.lua --world 2 --device tpu",
      "--device tpu; expected one of h100, h200, cpu")
    sh.one_line(exe .. " estimate lua/recipes/llama3_debugmodel.lua --world zero", "--world zero; expected a positive")
    sh.one_line(exe .. " estimate", "needs a recipe")
  end)

  it("--dry-run checks the whole start-up and prints the banner and the estimate, writing nothing", function()
    local dir = sh.tmpdir()
    local out = sh.run_ok(("%s --simulate 2 lua/recipes/llama3_debugmodel.lua --dry-run --parallelism.dp_shard=2 "
      .. "--metrics.peak_flops=1e11 --checkpoint.enable=true --job.dump_folder=%s/run 2>&1"):format(exe, dir))
    assert.truthy(out:find("titan .* | llama3 debugmodel: 6,163,712 parameters"), out)
    assert.truthy(out:find("peak 100.0 GFLOP/s (configured)", 1, true), out)
    assert.truthy(out:find("data parallel over a dry run's fake groups: 2 ranks, FSDP over 2 shards", 1, true), out)
    assert.truthy(out:find("checkpoint: none in " .. dir .. "/run/checkpoint; the job would start from scratch", 1,
      true), out)
    assert.truthy(out:find("estimate: llama3 debugmodel on 2 rank(s)", 1, true), out)
    assert.truthy(out:find("comm over dp_cp (2 ranks)", 1, true), out)
    assert.is_nil(out:find("step:%s+%d+%s+loss:"), out) -- (no training step line)
    assert.is_false(require("titan.checkpoint.fs").exists(dir .. "/run"))
    -- a configuration error is found the same way
    sh.one_line(exe .. " --simulate 2 lua/recipes/llama3_debugmodel.lua --dry-run --parallelism.tp=2 "
      .. "--training.seq_len=33", "training.seq_len = 33 does not split into parallelism.tp = 2 chunks")
    os.execute("rm -rf " .. sh.quote(dir))
  end)

  it("the trainer refuses a layout that cannot fit once, with each rank's figures", function()
    if not require("titan.dist").built("mpi") then return pending("no Open MPI in this build") end
    -- (8B in float32 over 4 ranks of one host: ~30 GiB a rank; on a host too big to refuse it, 70B)
    local total = require("titan.metrics").device_memory_bytes("cpu") or 0
    local flavor = total < 100 * 2 ^ 30 and "8B" or "70B"
    local out, rc = sh.run(("%s --nproc 4 lua/recipes/llama3_8b.lua --model.flavor=%s --training.device=cpu "
      .. "--training.mixed_precision_param=float32 --parallelism.dp_shard=4 2>&1"):format(exe, flavor))
    assert.are_not.equal(0, rc, out)
    local _, n = out:gsub("needs ~", "")
    assert.are.equal(1, n, out)
    assert.truthy(out:find("on each of the 4 ranks on this host (parameters", 1, true), out)
    assert.truthy(out:find("together, but this machine has", 1, true), out)
    assert.truthy(out:find("more ranks on this host do not help", 1, true), out)
  end)
end)
