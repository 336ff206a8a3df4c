-- Exact resume through checkpoints: the losses after a restart equal the
-- uninterrupted run's, bit for bit; with async saving; after kill -9 at
-- random points of a run that saves every step.
local titan = require("titan")
local config = require("titan.config")
local trainer = require("titan.trainer")
local env = require("titan.env")
local cjson = require("cjson")

local function tmpdir()
  local d = os.tmpname()
  os.remove(d)
  os.execute("mkdir -p " .. d)
  return d
end

local function small(dump, extra)
  local argv = { "--job.dump_folder=" .. dump, "--metrics.peak_flops=1e11", "--metrics.log_freq=1",
    "--training.seq_len=32", "--training.local_batch_size=2", "--training.steps=20", "--validation.enable=false",
    "--lr_scheduler.warmup_steps=3" }
  for _, a in ipairs(extra or {}) do argv[#argv + 1] = a end
  return argv
end

local function train(argv, until_step)
  local cfg = config.resolve(config.load_recipe("llama3_debugmodel"), argv)
  local tr = trainer.new(cfg, { print = function() end })
  local start = tr.step
  local losses = tr:train(until_step)
  tr:close()
  tr.model:free()
  return losses, start
end

local function read_jsonl_losses(path)
  local out = {}
  for line in io.lines(path) do
    local r = cjson.decode(line)
    if r.loss then out[r.step] = r.loss end
  end
  return out
end

describe("resume", function()
  for _, mode in ipairs({ "disabled", "async" }) do
    it("20 straight steps == 10 steps + restart + 10 steps, bit for bit (async_mode = " .. mode .. ")", function()
      local straight = train(small(tmpdir()))
      local dump = tmpdir()
      local ck = { "--checkpoint.enable=true", "--checkpoint.interval=10", "--checkpoint.async_mode=" .. mode }
      local first = train(small(dump, ck), 10)
      local second, start = train(small(dump, ck))
      assert.are.equal(10, start)
      assert.are.equal(10, #first)
      assert.are.equal(10, #second)
      for i = 1, 10 do assert.are.equal(straight[i], first[i]) end
      for i = 1, 10 do assert.are.equal(straight[10 + i], second[i], "step " .. (10 + i)) end
    end)
  end

  it("kill -9 at random points while saving every step: the next start resumes and matches", function()
    local straight_dump = tmpdir()
    local straight = train(small(straight_dump))
    local dump = tmpdir()
    local exe = env.build_dir .. "/titan"
    local args = table.concat(small(dump, { "--checkpoint.enable=true", "--checkpoint.interval=1",
      "--checkpoint.keep_latest_k=2" }), " ")
    math.randomseed(12345)
    for round = 1, 4 do
      -- run in the background, kill -9 after a random delay
      local delay = 0.3 + math.random() * 1.2
      os.execute(("(%s lua/recipes/llama3_debugmodel.lua %s >/dev/null 2>&1 & pid=$!; sleep %.2f; kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null) >/dev/null 2>&1")
        :format(exe, args, delay))
      _ = round
    end
    -- a final uninterrupted start finishes the run from the last complete checkpoint
    local rc = os.execute(("%s lua/recipes/llama3_debugmodel.lua %s >/dev/null 2>&1"):format(exe, args))
    assert.truthy(rc == 0 or rc == true)
    local got = read_jsonl_losses(dump .. "/metrics.jsonl")
    -- every step logged (by any of the runs, the last write wins) equals the straight run
    local seen = 0
    for step, loss in pairs(got) do
      assert.are.equal(straight[step], loss, "step " .. step)
      seen = seen + 1
    end
    assert.truthy(got[20], "the run reached step 20")
    assert.truthy(seen >= 10)
  end)
end)

describe("preemption", function()
  -- Trains the debug recipe in the background, sends `signal` once the first
  -- step has been logged (the handler is installed by then), however slow the
  -- machine is, and waits: the exit status and the log.
  local function signalled(dump, extra, signal)
    local args = table.concat(small(dump, extra), " ")
    local log = dump .. "/run.log"
    local rc = os.execute((("%s/titan lua/recipes/llama3_debugmodel.lua %s > %s 2>&1 & pid=$!; "
      .. "for i in $(seq 1 600); do grep -q '^step:' %s 2>/dev/null && break; sleep 0.2; done; "
      .. "kill -%s $pid; wait $pid")):format(env.build_dir, args, log, log, signal))
    return rc, assert(io.open(log)):read("*a")
  end

  it("SIGTERM saves at the next step boundary and exits 0; the next start resumes there", function()
    local dump = tmpdir()
    local rc, text = signalled(dump, { "--checkpoint.enable=true", "--checkpoint.interval=1000",
      "--training.steps=100000" }, "TERM")
    assert.truthy(rc == 0 or rc == true, "exit status after SIGTERM")
    local step = tonumber(text:match("SIGTERM: saved step (%d+), stopping"))
    assert.truthy(step and step >= 1, text)
    local f = io.open(("%s/checkpoint/step-%d/metadata.json"):format(dump, step))
    if not f then
      -- the metadata file name is the format's business; the step folder must be complete
      local ckfmt = require("titan.checkpoint.format")
      assert.is_true(ckfmt.is_complete(("%s/checkpoint/step-%d"):format(dump, step)))
    else
      f:close()
    end
    local _, start = train(small(dump, { "--checkpoint.enable=true", "--checkpoint.interval=1000",
      "--training.steps=" .. (step + 2) }))
    assert.are.equal(step, start)
  end)

  it("SIGINT with checkpoints off stops at the step boundary and says nothing was saved", function()
    local dump = tmpdir()
    local rc, text = signalled(dump, { "--checkpoint.enable=false", "--training.steps=100000" }, "INT")
    assert.truthy(rc == 0 or rc == true, "exit status after SIGINT")
    assert.truthy(text:find("trainer: SIGINT: stopping at step %d+; nothing saved %(checkpoint.enable is false%)"), text)
    assert.falsy(text:find("saved step", 1, true), text)
    local fs = require("titan.checkpoint.fs")
    assert.is_false(fs.exists(dump .. "/checkpoint"))
  end)
end)
