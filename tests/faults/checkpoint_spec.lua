-- Checkpoints that must never be lost, overwritten or half-used: a
-- rollback (load_step) with keep_latest_k, a step folder renamed or copied
-- over another, a save over a step this run did not write, a checkpoint
-- missing its optimizer tensors or train state, a model-only final save,
-- and bad load_step values.
local F = dofile("tests/faults/faults.lua")
local sh = F.sh
local cjson = require("cjson")

local function ck(extra) return sh.with({ "--checkpoint.enable=true", "--checkpoint.interval=1" }, extra) end

-- Rewrites dump/checkpoint/step-N/metadata.json through edit(meta).
local function edit_meta(dir, edit)
  local path = dir .. "/metadata.json"
  local f = assert(io.open(path))
  local meta = cjson.decode(f:read("*a"))
  f:close()
  edit(meta)
  f = assert(io.open(path, "w"))
  f:write(cjson.encode(meta))
  f:close()
end

local function copy_dump(src)
  local dst = sh.tmpdir()
  sh.run_ok(("cp -r %s/checkpoint %s/"):format(src, dst))
  return dst
end

describe("a rollback with checkpoint.load_step", function()
  it("keeps the checkpoints it makes and moves the abandoned later ones aside, whole", function()
    local dump = sh.tmpdir()
    sh.run_ok(F.train_cmd(dump, ck({ "--training.steps=6", "--checkpoint.keep_latest_k=3" })))
    assert.are.same({ 4, 5, 6 }, F.checkpoints(dump))
    local out = sh.run_ok(F.train_cmd(dump, ck({ "--training.steps=8", "--checkpoint.keep_latest_k=3",
      "--checkpoint.load_step=4" })))
    assert.truthy(out:find("loaded step 4", 1, true), out)
    assert.truthy(out:find("rolling back to step 4: the later steps 5, 6 moved to " .. dump .. "/checkpoint/abandoned-",
      1, true), out)
    assert.are.same({ 6, 7, 8 }, F.checkpoints(dump))
    local aside = out:match("moved to (%S+) %(nothing deleted%)")
    for _, s in ipairs({ 5, 6 }) do
      local v = sh.run_ok(("%s ckpt verify %s/step-%d"):format(F.exe, aside, s))
      assert.truthy(v:find("every checksum matches", 1, true), v)
    end
  end)
end)

describe("a step folder", function()
  it("whose name and metadata disagree is refused, and the real later step stays", function()
    local dump = sh.tmpdir()
    sh.run_ok(F.train_cmd(dump, ck({ "--training.steps=4", "--checkpoint.interval=2" })))
    sh.run_ok(("cp -r %s/checkpoint/step-2 %s/checkpoint/step-6"):format(dump, dump))
    F.fails(F.train_cmd(dump, ck({ "--training.steps=8", "--checkpoint.interval=2" })),
      ("%s/checkpoint/step-6 holds step 2 by its metadata: a step folder renamed or copied; expected step-2"):format(
        dump))
    sh.run_ok(("rm -r %s/checkpoint/step-6"):format(dump))
    assert.are.same({ 2, 4 }, F.checkpoints(dump))
  end)

  it("this run did not write is never saved over", function()
    local titan = require("titan")
    local ckpt = require("titan.checkpoint")
    local dump = sh.tmpdir()
    local lin = titan.nn.Linear(4, 3)
    ckpt.Manager({ enable = true, interval = 1 }, { dump_folder = dump, log = function() end })
      :save(4, { model = lin, extra = { step = 4 } })
    local before = sh.run_ok(("cat %s/checkpoint/step-4/metadata.json"):format(dump))
    local other = ckpt.Manager({ enable = true, interval = 1 }, { dump_folder = dump, log = function() end })
    local ok, err = pcall(other.save, other, 4, { model = lin, extra = { step = 4 } })
    assert.is_false(ok)
    assert.are.equal(("checkpoint: not saving step 4: %s/checkpoint/step-4 already exists and this run did not write "
      .. "it; expected a new step (move it away, or resume from it)"):format(dump), err)
    assert.are.equal(before, sh.run_ok(("cat %s/checkpoint/step-4/metadata.json"):format(dump)))
  end)
end)

describe("a resume", function()
  local base
  local function saved()
    if not base then
      base = sh.tmpdir()
      sh.run_ok(F.train_cmd(base, ck({ "--training.steps=2" })))
    end
    return copy_dump(base)
  end
  local more = ck({ "--training.steps=3" })

  for _, c in ipairs({
    { "optimizer tensors", function(m) m.tensors["optimizer.state.output.weight.exp_avg_sq"] = nil end,
      "lacks AdamW's moments of 1 parameter(s) it trained (optimizer.state.output.weight.exp_avg_sq)" },
    { "train state", function(m) m.train_state = nil end,
      "lacks its train state (metadata.json has no train_state table: the optimizer's step count" },
    { "garbled train state", function(m) m.train_state = "garbage" end, "lacks its train state" },
    { "optimizer step count", function(m) m.train_state.optimizer.step_count = "two" end,
      "lacks the optimizer's step count (train_state.optimizer)" },
    { "data position", function(m)
      m.train_state.dataloader = nil
      m.train_state.dataloader_ranks = nil
    end, "lacks the data position (train_state.dataloader)" },
    { "schedule", function(m) m.train_state.lr_scheduler = nil end,
      "lacks the learning-rate schedule's step (train_state.lr_scheduler)" },
  }) do
    it("refuses a checkpoint missing its " .. c[1] .. ", unless told what to restart", function()
      local dump = saved()
      edit_meta(dump .. "/checkpoint/step-2", c[2])
      F.fails(F.train_cmd(dump, more), ("checkpoint: %s/checkpoint/step-2 %s"):format(dump, c[3]))
      local out = F.fails(F.train_cmd(dump, more), "expected a whole checkpoint, or name what to restart "
        .. "(--checkpoint.exclude_from_loading=optimizer,dataloader,lr_scheduler)")
      assert.falsy(out:find("step:", 1, true), out)
      assert.are.same({ 1, 2 }, F.checkpoints(dump))
      out = sh.run_ok(F.train_cmd(dump, sh.with(more, {
        "--checkpoint.exclude_from_loading=optimizer,dataloader,lr_scheduler" })))
      assert.truthy(out:find("step:     3", 1, true), out)
    end)
  end

  it("refuses a model-only final save, and says what a weights-only start re-initializes", function()
    local dump = sh.tmpdir()
    sh.run_ok(F.train_cmd(dump, ck({ "--training.steps=3", "--checkpoint.interval=2",
      "--checkpoint.last_save_model_only=true" })))
    assert.are.same({ 2, 3 }, F.checkpoints(dump))
    F.fails(F.train_cmd(dump, ck({ "--training.steps=5", "--checkpoint.interval=2" })),
      ("checkpoint: %s/checkpoint/step-3 holds the model only (a final export, checkpoint.last_save_model_only): "
        .. "resuming from it would restart AdamW's moments, the data and the schedule; expected a full step "
        .. "(--checkpoint.load_step=N; earlier steps: 2), or --checkpoint.exclude_from_loading=optimizer,dataloader,"
        .. "lr_scheduler to go on from its weights"):format(dump))
    local fresh = sh.tmpdir()
    local out = sh.run_ok(F.train_cmd(fresh, ck({ "--training.steps=1", "--checkpoint.initial_load_path=" .. dump
      .. "/checkpoint/step-3" })))
    assert.truthy(out:find(("loaded the model of step 3 from %s/checkpoint/step-3; AdamW's moments, the data position "
      .. "and the learning-rate schedule start fresh at step 0 (checkpoint.initial_load_model_only)"):format(dump), 1,
      true), out)
  end)

  it("takes load_step -1 or a step number, nothing else", function()
    for _, v in ipairs({ "-5", "2.5", "1e300" }) do
      F.fails(F.train_cmd(sh.tmpdir(), ck({ "--training.steps=1", "--checkpoint.load_step=" .. v })),
        ("checkpoint.load_step = %s; expected -1 (the latest step) or a step number"):format(
          tostring(tonumber(v))))
    end
  end)
end)

describe("a resume with another run's settings", function()
  it("says what changed: the step count, the corpus", function()
    local dump = sh.tmpdir()
    local corpus = os.tmpname()
    local f = assert(io.open(corpus, "w"))
    for i = 1, 400 do f:write(("line %d of a small corpus, repeated to have some tokens\n"):format(i)) end
    f:close()
    local data = { "--training.dataset=text", "--training.dataset_path=" .. corpus }
    sh.run_ok(F.train_cmd(dump, ck(sh.with(data, { "--training.steps=2" }))))
    f = assert(io.open(corpus, "a"))
    f:write("one more line\n")
    f:close()
    local out = sh.run_ok(F.train_cmd(dump, ck(sh.with(data, { "--training.steps=3" }))))
    assert.truthy(out:find("checkpoint: resuming with training.steps = 3; the checkpoint's run had 2 (the "
      .. "learning-rate schedule now runs to the new last step)", 1, true), out)
    assert.truthy(out:find("checkpoint: resuming with the corpus text " .. corpus .. ":", 1, true), out)
    assert.truthy(out:find("(the data position may point elsewhere in it)", 1, true), out)
    out = sh.run_ok(F.train_cmd(dump, ck(sh.with(data, { "--training.steps=4" }))))
    assert.falsy(out:find("resuming with the corpus", 1, true), out)
    os.remove(corpus)
  end)
end)

describe("FSDP with empty pieces", function()
  -- (torch.chunk's rule: a router's 8 rows over 5 ranks are 2, 2, 2, 2 and none)
  it("saves, resumes exactly on the same 5 ranks, and reshards onto 2", function()
    local dump = sh.tmpdir()
    local keys = ck({ "--model.flavor=debugmodel_moe", "--training.local_batch_size=1", "--checkpoint.interval=2",
      "--training.shuffle=false" })
    local function sim(n, extra) return F.train_cmd(dump, sh.with(keys, extra)):gsub("(/titan) ", "%1 --simulate " .. n
      .. " ", 1) end
    local straight = sh.run_ok(sim(5, { "--training.steps=3" }))
    sh.run_ok(("rm -r %s/checkpoint/step-3"):format(dump))
    local resumed = sh.run_ok(sim(5, { "--training.steps=3" }))
    assert.truthy(resumed:find("loaded step 2", 1, true), resumed)
    assert.are.same(sh.losses(straight)[3], sh.losses(resumed)[1])
    sh.run_ok(("rm -r %s/checkpoint/step-3"):format(dump))
    local two = sh.run_ok(sim(2, { "--training.steps=3", "--checkpoint.exclude_from_loading=dataloader" }))
    assert.truthy(two:find("loaded step 2", 1, true) and two:find("step:     3", 1, true), two)
    sh.run_ok("rm -rf " .. dump) -- (800 MB of MoE checkpoints)
  end)
end)
