-- Numbers that must never reach the weights: keys set to inf or NaN, and a
-- step whose loss is finite while its gradients are NaN (stopped, or skipped
-- with training.on_nonfinite_grad=skip, on the host path and the device
-- path); no checkpoint is ever written with a NaN or inf in it, and `titan
-- ckpt verify` finds one that was.
local F = dofile("tests/faults/faults.lua")
local sh = F.sh
local cjson = require("cjson")
local NAN = "tests/faults/recipes/nan_grad.lua"

describe("keys that take numbers", function()
  it("refuse inf and NaN, on the command line and in a recipe", function()
    local dump = sh.tmpdir()
    for _, kv in ipairs({ "optimizer.lr=inf", "optimizer.lr=1e400", "optimizer.weight_decay=inf",
      "optimizer.eps=nan", "training.max_norm=-inf", "lr_scheduler.min_lr_factor=nan",
      "lr_scheduler.warmup_steps=inf", "checkpoint.interval=inf", "metrics.peak_flops=inf" }) do
      local key = kv:match("^[^=]+")
      F.fails(F.train_cmd(dump, { "--" .. kv, "--training.steps=1" }),
        ("config: %s = "):format(key))
      local out = F.fails(F.train_cmd(dump, { "--" .. kv, "--training.steps=1" }), "expected a finite number")
      assert.falsy(out:find("step:", 1, true), out)
    end
    local recipe = os.tmpname() .. ".lua"
    local f = assert(io.open(recipe, "w"))
    f:write('return { base = "llama3_debugmodel", optimizer = { lr = 1 / 0 } }\n')
    f:close()
    F.fails(F.train_cmd(dump, { "--training.steps=1" }, recipe), "config: optimizer.lr = inf; expected a finite number")
    os.remove(recipe)
    assert.are.same({}, F.checkpoints(dump))
  end)

  it("need '=': a value after a space is refused, not read as true", function()
    F.fails(F.train_cmd(sh.tmpdir(), { "--training.steps", "30" }),
      "config: --training.steps has no value; expected --training.steps=VALUE (with '=', not a space)")
    F.fails(F.train_cmd(sh.tmpdir(), { "--optimizer.lr" }), "config: --optimizer.lr has no value")
  end)
end)

describe("a NaN gradient under a finite loss", function()
  local ck = { "--checkpoint.enable=true", "--checkpoint.interval=2", "--training.steps=5" }

  it("stops the job before its update: the checkpoints and metrics lines before it are whole", function()
    local dump = sh.tmpdir()
    local out = F.fails(F.train_cmd(dump, ck, NAN), "trainer: the gradient norm is NaN at step 3")
    assert.truthy(out:find("its update was skipped and nothing from this step was saved (the last checkpoint is "
      .. "step 2)", 1, true), out)
    assert.are.same({ 2 }, F.checkpoints(dump))
    local m, n = F.metrics(dump)
    assert.are.equal(3, n) -- (the start event, steps 1 and 2)
    assert.truthy(m[1] and m[2] and not m[3])
  end)

  it("is skipped with training.on_nonfinite_grad=skip: training goes on from the same weights, every save finite",
    function()
      local dump, clean = sh.tmpdir(), sh.tmpdir()
      local out = sh.run_ok(F.train_cmd(dump, sh.with(ck, { "--training.on_nonfinite_grad=skip" }), NAN))
      assert.truthy(out:find("trainer: step 3: the gradient norm is NaN (loss ", 1, true), out)
      assert.truthy(out:find("its update was skipped, 1 so far (training.on_nonfinite_grad = skip)", 1, true), out)
      assert.truthy(out:find("1 step skipped (NaN/inf gradients)", 1, true), out)
      assert.are.same({ 2, 4, 5 }, F.checkpoints(dump))
      local m = F.metrics(dump)
      assert.is_true(m[3].grad_norm == nil or m[3].grad_norm == cjson.null) -- (NaN: null in JSON)
      for s = 4, 5 do assert.is_true(type(m[s].loss) == "number" and type(m[s].grad_norm) == "number") end
      -- (without the fault, the same steps 1-2 and another step 4)
      sh.run_ok(F.train_cmd(clean, { "--training.steps=5" }, NAN, "TITAN_FAULT_STEP=0 "))
      local c = F.metrics(clean)
      assert.are.equal(c[2].loss, m[2].loss)
      assert.are_not.equal(c[4].loss, m[4].loss)
    end)

  -- (the norm is the job's: every rank skips the same step, whichever rank's gradients went bad)
  it("on one rank of an FSDP job is skipped by every rank, and the job goes on whole", function()
    local dump = sh.tmpdir()
    local cmd = F.train_cmd(dump, sh.with(ck, { "--training.on_nonfinite_grad=skip" }), NAN, "TITAN_FAULT_RANK=1 ")
      :gsub("(/titan) ", "%1 --simulate 2 ", 1)
    local out = sh.run_ok(cmd)
    local _, n = out:gsub("step 3: the gradient norm is NaN", "")
    assert.are.equal(1, n, out) -- (rank 0 prints for the job)
    assert.truthy(out:find("1 step skipped (NaN/inf gradients)", 1, true), out)
    assert.are.same({ 2, 4, 5 }, F.checkpoints(dump))
  end)

  -- In this process: the weights and AdamW's moments after the skipped step
  -- are those before it, bit for bit, whether the update ran on the host or
  -- through the device path (the kernels skip it: forced on the CPU, whose
  -- backend has the same ops as a GPU's).
  for _, device in ipairs({ false, true }) do
    it(("leaves the weights and moments as they were (%s path)"):format(device and "device" or "host"), function()
      local config, trainer = require("titan.config"), require("titan.trainer")
      local cfg = config.resolve(config.load_recipe(NAN), { "--job.dump_folder=" .. sh.tmpdir(),
        "--metrics.enable_jsonl=false", "--metrics.peak_flops=1e11", "--training.seq_len=16",
        "--training.local_batch_size=2", "--validation.enable=false", "--training.on_nonfinite_grad=skip",
        "--training.steps=4" })
      local lines = {}
      local tr = trainer.new(cfg, { print = function(l) lines[#lines + 1] = l end })
      tr.device_update = device
      local function snapshot()
        local out = {}
        for _, np in ipairs(tr.model:named_parameters()) do out[np[1]] = np[2]:tolist_flat() end
        for name, st in pairs(tr.optimizer.state) do
          out[name .. ".exp_avg"] = st.exp_avg:tolist_flat()
          out[name .. ".exp_avg_sq"] = st.exp_avg_sq:tolist_flat()
        end
        return out
      end
      tr:train(2)
      local before = snapshot()
      local count = tr.optimizer.step_count
      tr:train(3)
      assert.truthy(table.concat(lines, "\n"):find("step 3: the gradient norm is NaN", 1, true))
      assert.are.same(before, snapshot())
      assert.are.equal(count + 1, tr.optimizer.step_count) -- (counted, as the device must)
      local losses = tr:train(4)
      assert.is_true(losses[1] == losses[1])
      assert.are_not.same(before, snapshot())
      tr:close()
      tr.model:free()
    end)
  end
end)

describe("a checkpoint", function()
  it("is never written with a NaN or inf in it, and the one before stays; ckpt verify finds one that was", function()
    local titan = require("titan")
    local ckpt = require("titan.checkpoint")
    local state = require("titan.checkpoint.state")
    local dump = sh.tmpdir()
    local lin = titan.nn.Linear(4, 3)
    local mgr = ckpt.Manager({ enable = true, interval = 1 }, { dump_folder = dump, log = function() end })
    mgr:save(1, { model = lin, extra = { step = 1 } })
    lin.weight:fill_(0 / 0)
    local ok, err = pcall(mgr.save, mgr, 2, { model = lin, extra = { step = 2 } })
    assert.is_false(ok)
    assert.are.equal("checkpoint: not saving step 2: weight holds NaN or inf values; the last checkpoint is step 1",
      err)
    ok, err = pcall(ckpt.save, dump .. "/other", { model = lin })
    assert.is_false(ok)
    assert.truthy(err:find("checkpoint: not saving " .. dump .. "/other: weight holds NaN or inf values", 1, true))
    assert.are.same({ 1 }, F.checkpoints(dump))
    -- written around the guard (an older titan, another tool): the checksums match, the values do not
    local items, ts = state.collect({ model = lin, extra = { step = 3 } })
    local dir = dump .. "/checkpoint/step-3"
    require("titan.checkpoint.format").write(dir, { items }, { step = 3, train_state = ts })
    F.fails(("%s ckpt verify %s"):format(F.exe, dir), ("checkpoint: %s holds NaN or inf values in 1 tensor(s): "
      .. "weight (12 of 12 values); its checksums match (they were saved so): resume from an earlier step"):format(dir))
  end)
end)
