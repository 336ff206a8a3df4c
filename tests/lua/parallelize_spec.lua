-- A recipe's own parallelize function (lua/recipes/llama3_debugmodel_whole_output.lua:
-- the family's steps with the output layer left whole by TP) changes the
-- layout, on simulated ranks: the output layer whole on each tp rank (and
-- in the placements checkpoints save by), and the same training, bit for
-- bit, as the family's parallelize with --parallelism.loss_parallel=false.
local env = require("titan.env")
local cjson = require("cjson")
local sh = dofile("tests/lua/shell.lua")

local exe = env.build_dir .. "/titan"
local KEYS = { "--parallelism.tp=2", "--training.seq_len=32", "--training.local_batch_size=4",
  "--metrics.peak_flops=1e11", "--metrics.log_freq=1", "--validation.enable=false", "--training.shuffle=false",
  "--lr_scheduler.warmup_steps=2", "--training.steps=3", "--checkpoint.enable=false" }

local function args(list)
  local out = {}
  for _, a in ipairs(list) do out[#out + 1] = sh.quote(a) end
  return table.concat(out, " ")
end

local function records(dump)
  local out = {}
  for line in io.lines(dump .. "/metrics.jsonl") do
    local r = cjson.decode(line)
    if r.loss then out[#out + 1] = r end
  end
  return out
end

describe("a recipe's parallelize", function()
  it("keeps the output layer whole under TP where the family's splits it by vocabulary", function()
    local function layout(recipe)
      return sh.run_ok(("OMP_NUM_THREADS=1 %s --simulate 2 tests/lua/parallelize_worker.lua %s %s 2>&1"):format(exe,
        recipe, args({ "--parallelism.tp=2", "--training.seq_len=32" })))
    end
    local mine = layout("lua/recipes/llama3_debugmodel_whole_output.lua")
    local family = layout("lua/recipes/llama3_debugmodel.lua")
    for r = 0, 1 do
      -- debugmodel: vocab 2048, dim 256; the embedding stays split by vocabulary in both
      assert.truthy(mine:find(("rank %d output 2048x256 embedding 1024x256 layout 2048x256 loss_parallel false")
        :format(r), 1, true), mine)
      assert.truthy(family:find(("rank %d output 1024x256 embedding 1024x256 layout 1024x256 loss_parallel true")
        :format(r), 1, true), family)
    end
  end)

  it("trains as the family's does with loss parallelism off, bit for bit, and says so in the banner", function()
    local dir = sh.tmpdir()
    local out = sh.run_ok(("OMP_NUM_THREADS=1 %s --simulate 2 lua/recipes/llama3_debugmodel_whole_output.lua %s "
      .. "--job.dump_folder=%s/a 2>&1"):format(exe, args(KEYS), dir))
    assert.truthy(out:find("loss parallel off: the parallelize function keeps the output layer whole", 1, true), out)
    sh.run_ok(("OMP_NUM_THREADS=1 %s --simulate 2 lua/recipes/llama3_debugmodel.lua %s "
      .. "--parallelism.loss_parallel=false --job.dump_folder=%s/b 2>&1"):format(exe, args(KEYS), dir))
    local a, b = records(dir .. "/a"), records(dir .. "/b")
    assert.are.equal(3, #a)
    for s = 1, 3 do
      assert.are.equal(b[s].loss, a[s].loss)
      assert.are.equal(b[s].grad_norm, a[s].grad_norm)
    end
    os.execute("rm -rf " .. sh.quote(dir))
  end)

  -- The gradient norm (lua/parallel/grads.lua) reads each gradient's Shard dims: the same tree of
  -- sums on the host and on the device path (f64 tensors; the CPU backend runs it too).
  local norm_layouts = {
    { 4, { "--parallelism.tp=2", "--parallelism.dp_shard=2", "--training.local_batch_size=2" } },
  }
  for _, l in ipairs(norm_layouts) do
    it("gives the same gradient norms on the host and the device path: " .. table.concat(l[2], " "), function()
      local out = sh.run_ok(("OMP_NUM_THREADS=1 %s --simulate %d tests/lua/grads_worker.lua %s 2>&1"):format(exe, l[1],
        args(l[2])))
      local host, dev = out:match("host ([^\n]+)"), out:match("device ([^\n]+)")
      assert.truthy(host and dev, out)
      assert.are.equal(2, select(2, host:gsub("%S+", "")), out)
      assert.are.equal(host, dev)
    end)
  end
end)
