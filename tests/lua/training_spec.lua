-- End-to-end training checks on the debug model: overfitting a fixed batch,
-- bit-identical reruns, a golden loss curve, recipe hooks and bad recipes.
local titan = require("titan")
local config = require("titan.config")
local trainer = require("titan.trainer")
local env = require("titan.env")
local cjson = require("cjson")

local GOLDEN = env.root .. "/tests/golden/llama3_debugmodel_20steps.json"

local function quiet_cfg(overrides)
  local recipe = config.load_recipe("llama3_debugmodel")
  local argv = { "--job.dump_folder=" .. os.tmpname() .. ".d", "--metrics.enable_jsonl=false",
    "--metrics.peak_flops=1e11", "--metrics.log_freq=1000" }
  for _, a in ipairs(overrides or {}) do argv[#argv + 1] = a end
  return recipe, argv
end

local function run(recipe, argv, steps)
  local cfg = config.resolve(recipe, argv)
  local tr = trainer.new(cfg, { print = function() end })
  local ok, losses = pcall(tr.train, tr, steps)
  tr:close()
  assert(ok, losses)
  tr.model:free()
  return losses, tr
end

describe("training", function()
  it("overfits one fixed batch: loss below 0.05", function()
    local recipe, argv = quiet_cfg({ "--training.seq_len=32", "--training.local_batch_size=2",
      "--lr_scheduler.warmup_steps=5", "--optimizer.lr=3e-3", "--training.steps=60", "--validation.enable=false" })
    local batch
    recipe.build_data = function(cfg, tok)
      local ids = tok:encode_table("The quick brown fox jumps over the lazy dog. " ..
        "Pack my box with five dozen liquor jugs, and sphinx of black quartz, judge my vow!", { bos = true })
      local T = cfg.training.seq_len
      local rows_in, rows_tg = {}, {}
      for b = 1, 2 do
        rows_in[b], rows_tg[b] = {}, {}
        for t = 1, T do
          rows_in[b][t] = ids[(b - 1) * 5 + t]
          rows_tg[b][t] = ids[(b - 1) * 5 + t + 1]
        end
      end
      batch = { titan.keep(titan.tensor(rows_in, { dtype = "int64" })), titan.keep(titan.tensor(rows_tg, { dtype = "int64" })) }
      return { train = { next = function() return { inputs = batch[1]:clone(), targets = batch[2]:clone() } end } }
    end
    local losses = run(recipe, argv, 60)
    assert.truthy(losses[1] > 7, "first loss " .. losses[1])
    assert.truthy(losses[#losses] < 0.05, "final loss " .. losses[#losses])
  end)

  it("the same seed gives bit-identical losses in two runs", function()
    local recipe, argv = quiet_cfg({ "--training.seq_len=64", "--training.local_batch_size=2", "--validation.enable=false" })
    local a = run(recipe, argv, 4)
    local b = run(recipe, argv, 4)
    assert.are.same(a, b)
    local recipe2, argv2 = quiet_cfg({ "--training.seq_len=64", "--training.local_batch_size=2",
      "--validation.enable=false", "--training.seed=1" })
    assert.are_not.same(a, run(recipe2, argv2, 4))
  end)

  it("gradient accumulation matches one big batch", function()
    local base = { "--training.seq_len=32", "--validation.enable=false", "--training.shuffle=false",
      "--lr_scheduler.warmup_steps=1" }
    local r1, a1 = quiet_cfg(base)
    a1[#a1 + 1] = "--training.local_batch_size=4"
    local r2, a2 = quiet_cfg(base)
    a2[#a2 + 1] = "--training.local_batch_size=2"
    a2[#a2 + 1] = "--training.global_batch_tokens=128"
    local big = run(r1, a1, 3)
    local acc = run(r2, a2, 3)
    for i = 1, 3 do
      assert(math.abs(big[i] - acc[i]) <= 1e-5 * math.abs(big[i]), ("step %d: %g vs %g"):format(i, big[i], acc[i]))
    end
  end)

  it("the first 20 steps of the debug recipe follow the golden loss curve", function()
    local recipe, argv = quiet_cfg({ "--validation.enable=false" })
    local losses = run(recipe, argv, 20)
    if os.getenv("TITAN_UPDATE_GOLDEN") == "1" then
      local f = assert(io.open(GOLDEN, "w"))
      f:write(cjson.encode({ recipe = "llama3_debugmodel", steps = 20, losses = losses,
        note = "regenerate with TITAN_UPDATE_GOLDEN=1 ./titan test -R training" }), "\n")
      f:close()
    end
    local f = assert(io.open(GOLDEN, "r"), "missing golden file " .. GOLDEN)
    local golden = cjson.decode(f:read("*a"))
    f:close()
    assert.are.equal(20, #golden.losses)
    -- Same machine kind: the kernels are deterministic; the tolerance covers
    -- another BLAS core type rounding matmuls differently.
    for i = 1, 20 do
      local g = golden.losses[i]
      assert(math.abs(losses[i] - g) <= 2e-3 * math.abs(g), ("step %d: loss %.6f, golden %.6f"):format(i, losses[i], g))
    end
    assert.truthy(losses[20] < losses[1] - 1, "the loss must fall over 20 steps")
  end)

  it("a recipe's loss_fn replaces the loss (z-loss recipe)", function()
    local recipe = config.load_recipe("llama3_debugmodel_zloss")
    local _, argv = quiet_cfg({ "--training.seq_len=32", "--training.local_batch_size=2", "--validation.enable=false" })
    local z = run(recipe, argv, 2)
    local plain_recipe, plain_argv = quiet_cfg({ "--training.seq_len=32", "--training.local_batch_size=2",
      "--validation.enable=false" })
    local plain = run(plain_recipe, plain_argv, 2)
    assert.truthy(z[1] > plain[1], "z-loss adds a positive term")
    assert.truthy(z[1] - plain[1] < 0.1)
  end)

  it("the mixture recipe trains from two weighted datasets", function()
    local recipe = config.load_recipe("llama3_debugmodel_mix")
    local _, argv = quiet_cfg({ "--training.seq_len=32", "--training.local_batch_size=2", "--validation.enable=false" })
    local losses = run(recipe, argv, 2)
    assert.are.equal(2, #losses)
  end)

  -- In this process the trainer's modules are loaded before any recipe; a
  -- fresh titan loads the recipe's own requires first (the mixture recipe's
  -- titan.data once declared clock_gettime its own way and stopped the
  -- trainer's first metrics call).
  it("every CPU recipe trains from the command line", function()
    for _, name in ipairs({ "llama3_debugmodel", "llama3_debugmodel_mix", "llama3_debugmodel_zloss" }) do
      local dump = os.tmpname() .. ".recipe"
      local p = io.popen(("%s/titan lua/recipes/%s.lua --job.dump_folder=%s --metrics.peak_flops=1e11 "
        .. "--training.seq_len=32 --training.local_batch_size=2 --training.steps=2 --validation.enable=false 2>&1; "
        .. "echo rc=$?"):format(env.build_dir, name, dump))
      local out = p:read("*a")
      p:close()
      os.execute("rm -rf '" .. dump .. "'")
      assert.truthy(out:find("trainer: done at step 2", 1, true) and out:find("rc=0", 1, true), name .. ":\n" .. out)
    end
  end)
end)

describe("the run's last line", function()
  it("says where training ended, the rate, the last losses and the last checkpoint", function()
    local dump = os.tmpname() .. ".done"
    local function last_line(steps)
      local p = io.popen(("%s/titan lua/recipes/llama3_debugmodel.lua --job.dump_folder=%s --metrics.peak_flops=1e11 "
        .. "--training.seq_len=32 --training.local_batch_size=2 --training.steps=%d --validation.freq=2 "
        .. "--validation.steps=1 --checkpoint.enable --checkpoint.interval=3 2>&1; echo rc=$?"):format(env.build_dir,
        dump, steps))
      local out = p:read("*a")
      p:close()
      assert.truthy(out:find("rc=0", 1, true), out)
      return out:match("([^\n]*)\nrc=0")
    end
    local last = last_line(4)
    assert.truthy(last:find("^trainer: done at step 4 | 4 steps in [%d.]+s %([%d,]+ tokens/s%) | loss [%d.]+ | "
      .. "validation loss [%d.]+ | checkpoint " .. dump:gsub("%p", "%%%0") .. "/checkpoint/step%-4$"), last)
    -- resumed at or past training.steps: says so
    last = last_line(2)
    -- metrics.jsonl: both runs appended, each from a start record
    local starts, steps = {}, 0
    for line in io.lines(dump .. "/metrics.jsonl") do
      local r = cjson.decode(line)
      if r.event == "start" then starts[#starts + 1] = r.step; assert.truthy(r.time > 1.7e9, line) end
      if r.loss then steps = steps + 1 end
    end
    os.execute("rm -rf '" .. dump .. "'")
    assert.are.equal("trainer: done at step 4 | nothing to train: training.steps = 2", last)
    assert.are.same({ 0, 4 }, starts)
    assert.are.equal(2, steps) -- the debug recipe's log_freq 10: step 1 and the last, 4
  end)
end)

describe("model.tokenizer paths", function()
  it("a relative path is the working directory's file when it is there, else the source tree's", function()
    local fs = require("titan.checkpoint.fs")
    assert.are.equal("/abs/tok.json", config.resolve_file("/abs/tok.json"))
    assert.are.equal(env.root .. "/nonexistent/tok.json", config.resolve_file("nonexistent/tok.json"))
    -- a user's tokenizer beside their data, run from that folder
    local dir = os.tmpname() .. ".tokdir"
    fs.mkdirs(dir)
    local Tokenizer = require("titan.tokenizer")
    local small = Tokenizer.train({ vocab_size = 300, texts = { ("a fox and a dog. "):rep(40) } })
    small:save(dir .. "/tok.json")
    local n = small.vocab_size
    small:free()
    local p = io.popen(("cd '%s' && %s/titan %s/lua/recipes/llama3_debugmodel.lua --model.tokenizer=tok.json "
      .. "--training.steps=0 --metrics.peak_flops=1e11 --job.dump_folder=out 2>&1; echo rc=$?"):format(dir,
      env.build_dir, env.root))
    local out = p:read("*a")
    p:close()
    -- and the shipped recipes' assets/... path still works from there
    local p2 = io.popen(("cd '%s' && %s/titan %s/lua/recipes/llama3_debugmodel.lua --training.steps=0 "
      .. "--metrics.peak_flops=1e11 --job.dump_folder=out2 2>&1; echo rc=$?"):format(dir, env.build_dir, env.root))
    local out2 = p2:read("*a")
    p2:close()
    os.execute("rm -rf '" .. dir .. "'")
    assert.truthy(out:find("rc=0", 1, true), out)
    assert.truthy(out:find(("vocab 2048 (the tokenizer uses %d)"):format(n), 1, true), out)
    assert.truthy(out2:find("rc=0", 1, true), out2)
    assert.truthy(out2:find("vocab 2048 |", 1, true), out2)
  end)
end)

describe("a loss that is not a number", function()
  it("stops the run at that step with one line naming it and the last checkpoint; nothing of it is saved", function()
    local dump = os.tmpname() .. ".nan"
    local recipe, argv = quiet_cfg({ "--training.seq_len=32", "--training.local_batch_size=2", "--training.steps=6",
      "--validation.enable=false", "--checkpoint.enable", "--checkpoint.interval=2", "--job.dump_folder=" .. dump })
    recipe.loss_fn = function(logits, targets, ctx)
      local l = trainer.loss_fn(logits, targets, ctx)
      if ctx.step == 3 then return l * (0 / 0) end
      return l
    end
    local cfg = config.resolve(recipe, argv)
    local tr = trainer.new(cfg, { print = function() end })
    local ok, err = pcall(tr.train, tr)
    tr:close()
    -- the weights are still step 2's (the update did not run), as saved
    local m2 = require("models.llama3").build("debugmodel", { seed = 99 })
    require("titan.checkpoint").load(dump .. "/checkpoint/step-2", { model = m2 })
    local saved = m2:state_dict().tensors
    for _, np in ipairs(tr.model:named_parameters()) do
      assert.are.same(saved[np[1]]:tolist_flat(), np[2]:tolist_flat(), np[1])
      assert.is_nil(np[2].grad, np[1] .. " has no gradient left")
    end
    m2:free()
    tr.model:free()
    assert.is_false(ok)
    assert.truthy(tostring(err):find("^trainer: loss is NaN at step 3; nothing from this step was saved %(the last "
      .. "checkpoint is step 2%); lower optimizer.lr"), tostring(err))
    local fs = require("titan.checkpoint.fs")
    assert.is_true(fs.exists(dump .. "/checkpoint/step-2"))
    assert.is_false(fs.exists(dump .. "/checkpoint/step-3"))
    assert.are.equal(3, tr.step + 1) -- the step counter did not move past the last good step
    os.execute("rm -rf '" .. dump .. "'")
  end)
end)

describe("bad recipes", function()
  local exe = env.build_dir .. "/titan"
  local function titan_run(args)
    local p = io.popen(exe .. " " .. args .. " 2>&1; echo \"rc=$?\"")
    local out = p:read("*a")
    p:close()
    return out:gsub("rc=%d+%s*$", ""), tonumber(out:match("rc=(%d+)%s*$"))
  end
  local function write(text)
    local path = os.tmpname() .. ".lua"
    local f = assert(io.open(path, "w"))
    f:write(text)
    f:close()
    return path
  end

  it("each fails with one clear line and exit 1", function()
    local cases = {
      { write("return { training = { steps = 'ten' } }"), "training.steps expects a number" },
      { write("return { training = { stpes = 10 } }"), "unknown key 'training.stpes' in the recipe; nearest valid keys: training.steps" },
      { write("return { training = { steps = 10 }"), "expected", at = true }, -- truncated: a syntax error, at its line
      { write("return { base = 'no_such_recipe' }"), "cannot load recipe" },
      { write("return { model = { flavor = 'XXL' } }"), "unknown flavor 'XXL'" },
      { write("return { model = { tokenizer = '/nonexistent/tok.json' } }"), "/nonexistent/tok.json" },
      { write("return { training = { dataset_path = '/nonexistent' } }"),
        "the fortunes corpus is missing (/nonexistent/fortunes)" },
    }
    -- a plain file where a folder must be made: mkdir fails for root too
    local file = os.tmpname()
    local debug = "lua/recipes/llama3_debugmodel.lua "
    local cmdline = {
      { debug .. "--parallelism.tp=2", "parallelism.tp = 2, but the job has 1 rank(s); expected tp to divide" },
      { debug .. "--parallelism.pp=4", "parallelism.pp = 4, but the job has 1 rank(s); expected pp to divide" },
      { debug .. "--checkpoint.initial_load_path=/some/run", "checkpoint.initial_load_path = /some/run, but "
        .. "checkpoint.enable is false, so nothing would be loaded; expected --checkpoint.enable=true" },
      { debug .. "--parallelism.dp_shard=8", "dp_replicate x dp_shard = 1 x 8, but the job has 1 rank(s)" },
      { debug .. "--model.flavor=405B", "llama3 405B has 405.85B parameters and needs ~6048 GiB" },
      { debug .. "--training.mixed_precision_param=bfloat16", "bfloat16 needs training.device=cuda" },
      -- values the trainer used to take silently (or stop on with a Lua source position, after the banner)
      { debug .. "--training.device=gpu", "training.device must be cpu, cuda or cuda:N, got 'gpu'" },
      { debug .. "--validation.freq=0", "validation.freq must be a positive integer, got 0" },
      { debug .. "--validation.split=2", "validation.split must be in [0, 1), got 2" },
      { debug .. "--lr_scheduler.warmup_steps=-5", "lr_scheduler.warmup_steps must be a non-negative integer" },
      { debug .. "--lr_scheduler.decay_ratio=3", "lr_scheduler.decay_ratio must be in [0, 1], or -1" },
      { debug .. "--optimizer.beta1=2", "optimizer.beta1 must be in [0, 1), got 2" },
      { debug .. "--optimizer.weight_decay=-0.1", "optimizer.weight_decay must be >= 0" },
      { debug .. "--training.max_norm=-1", "training.max_norm must be >= 0 (0: no clipping)" },
      { debug .. "--training.threads=0", "training.threads must be -1 (OMP_NUM_THREADS or all cores) or a positive" },
      { debug .. "--model.name=gpt2", "model.name: no model family 'gpt2'; expected one of llama3" },
      { debug .. "--profiling.profile_freq=0", "profiling.profile_freq = 0; expected a positive number of steps" },
      { debug .. "--profiling.region_timing=events", "profiling.region_timing = 'events'; expected device or sync" },
      { debug .. "--profiling.enable_profiling --training.cuda_graphs", "profiling.enable_profiling: not with "
        .. "training.cuda_graphs (a step replayed from a graph has no regions to time)" },
      { debug .. "--profiling.enable_profiling --profiling.save_traces_folder=" .. file .. "/traces",
        "profiling.save_traces_folder: cannot create folder " .. file .. "/traces" },
      { debug .. "--job.dump_folder=" .. file .. "/out", "job.dump_folder: cannot create folder " .. file .. "/out" },
      { debug .. "--checkpoint.enable --checkpoint.folder=" .. file .. "/ckpt",
        "checkpoint: cannot create folder " .. file .. "/ckpt" }, -- at start-up, before any step
    }
    for _, c in ipairs(cmdline) do cases[#cases + 1] = { c[1], c[2], keep = true } end
    for _, c in ipairs(cases) do
      local args = c[1] .. " --job.dump_folder=/tmp/titan-bad-recipe --metrics.peak_flops=1e11"
      if c[1]:find("dump_folder", 1, true) then args = c[1] end
      local out, rc = titan_run(args)
      if not c.keep then os.remove(c[1]) end
      assert.are.equal(1, rc, out)
      assert.truthy(out:find(c[2], 1, true), ("expected %q in %q"):format(c[2], out))
      local lines = select(2, out:gsub("\n", ""))
      assert.are.equal(1, lines, "one line: " .. out)
      if not c.at then assert.falsy(out:find("%.lua:%d+:"), "no Lua source position: " .. out) end
    end
    os.remove(file)
    local out, rc = titan_run("lua/recipes/llama3_debugmodel.lua --training.steps=x")
    assert.are.equal(1, rc)
    assert.truthy(out:find("training.steps expects a number, got 'x'", 1, true))
    out, rc = titan_run("lua/recipes/llama3_8b.lua --print-config")
    assert.are.equal(0, rc)
    assert.truthy(out:find('flavor = "8B"', 1, true))
  end)

  it("--help lists every key with the recipe's value and its meaning, and trains nothing", function()
    local config = require("titan.config")
    local out, rc = titan_run("lua/recipes/llama3_debugmodel.lua --training.steps=7 --help")
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("^usage: titan lua/recipes/llama3_debugmodel.lua %[%-%-section.key=value"), out)
    assert.falsy(out:find("step:", 1, true), out)
    for _, sec in ipairs(config.sections) do
      for k in pairs(config.defaults[sec]) do
        assert.truthy(out:find("--" .. sec .. "." .. k .. "=", 1, true), sec .. "." .. k .. " in --help")
      end
    end
    -- the recipe's values and the command line's, quoted where a shell would split them
    assert.truthy(out:find("--training.steps=7 ", 1, true), out)
    assert.truthy(out:find("--lr_scheduler.decay_type=cosine ", 1, true), out)
    assert.truthy(out:find('--job.description="Llama 3 debug model', 1, true), out)
    assert.truthy(out:find("--training.seq_len=512%s+tokens per sequence"), out)
    -- a bad override is still reported, not hidden by --help
    out, rc = titan_run("lua/recipes/llama3_debugmodel.lua --help --training.stpes=7")
    assert.are.equal(1, rc, out)
    assert.truthy(out:find("unknown key 'training.stpes'", 1, true), out)
  end)

  it("every key has a one-line description and a row in docs/recipes.md", function()
    local config = require("titan.config")
    local f = assert(io.open(env.root .. "/docs/recipes.md"))
    local doc = f:read("*a")
    f:close()
    local seen = {}
    for _, sec in ipairs(config.sections) do
      seen[sec] = true
      assert.truthy(config.defaults[sec], sec)
      for k in pairs(config.defaults[sec]) do
        local full = sec .. "." .. k
        local d = config.descriptions[full]
        assert.truthy(type(d) == "string" and #d > 0 and not d:find("\n"), full .. " has a description")
        -- a row names the key itself, or starts with `section.first` and lists `key` after it
        local found = doc:find("`" .. full .. "`", 1, true) ~= nil
        for line in doc:gmatch("[^\n]+") do
          if line:find("^| `" .. sec .. "%.") and line:find("`" .. k .. "`", 1, true) then found = true end
        end
        assert.truthy(found, full .. " in docs/recipes.md")
      end
    end
    for sec in pairs(config.defaults) do assert.truthy(seen[sec], sec .. " in config.sections") end
    for full in pairs(config.descriptions) do
      local sec, k = full:match("^([%w_]+)%.([%w_]+)$")
      assert.truthy(sec and config.defaults[sec] and config.defaults[sec][k] ~= nil, full .. " is a key")
    end
  end)
end)

describe("debug.deterministic", function()
  it("resolves, is typed, is printed, and the trainer sets the engine's mode from it", function()
    local recipe, argv = quiet_cfg({ "--training.seq_len=32", "--training.local_batch_size=2",
      "--validation.enable=false" })
    assert.is_false(config.resolve(recipe, argv).debug.deterministic)
    local on = { unpack(argv) }
    on[#on + 1] = "--debug.deterministic"
    local cfg = config.resolve(recipe, on)
    assert.is_true(cfg.debug.deterministic)
    assert.truthy(config.dump(cfg):find("debug = {\n    deterministic = true,", 1, true))
    local bad = { unpack(argv) }
    bad[#bad + 1] = "--debug.deterministic=maybe"
    local ok, err = pcall(config.resolve, recipe, bad)
    assert.is_false(ok)
    assert.truthy(err:find("debug.deterministic expects true or false, got 'maybe'", 1, true), err)
    ok, err = pcall(config.resolve, { base = recipe, debug = { deterministic = 1 } }, argv)
    assert.is_false(ok)
    assert.truthy(err:find("debug.deterministic expects a boolean, got number", 1, true), err)
    ok, err = pcall(config.resolve, recipe, { "--debug.determinstic" })
    assert.is_false(ok)
    assert.truthy(err:find("nearest valid keys: debug.deterministic", 1, true), err)

    assert.are.equal(0, titan.C.tt_deterministic())
    local tr = trainer.new(cfg, { print = function() end })
    assert.are.equal(1, titan.C.tt_deterministic())
    assert.is_true(titan.deterministic())
    tr:close()
    tr.model:free()
    tr = trainer.new(config.resolve(recipe, argv), { print = function() end })
    assert.are.equal(0, titan.C.tt_deterministic())
    tr:close()
    tr.model:free()
  end)
end)

describe("optimizer groups and sampling", function()
  it("a recipe's optimizer_groups reach AdamW, first match wins", function()
    local recipe = config.load_recipe("llama3_debugmodel")
    recipe.optimizer_groups = { { pattern = "^tok_embeddings", lr = 0 } }
    local cfg = config.resolve(recipe, { "--job.dump_folder=" .. os.tmpname() .. ".d", "--metrics.peak_flops=1e11",
      "--training.seq_len=32", "--training.local_batch_size=2", "--validation.enable=false",
      "--metrics.enable_jsonl=false" })
    local tr = trainer.new(cfg, { print = function() end })
    local before = tr.model.tok_embeddings.weight:tolist_flat()
    local wq = tr.model.layers["0"].attention.wq.weight:tolist_flat()
    tr:train(2)
    tr:close()
    assert.are.same(before, tr.model.tok_embeddings.weight:tolist_flat()) -- lr 0, no weight decay effect
    assert.are_not.same(wq, tr.model.layers["0"].attention.wq.weight:tolist_flat())
    tr.model:free()
  end)

  for _, key in ipairs({ "allow_tf32", "gemm_autotune" }) do
    it("training." .. key .. " sets the process-wide switch at start; the CPU's losses do not move", function()
      local function losses(flag)
        local recipe = config.load_recipe("llama3_debugmodel")
        local cfg = config.resolve(recipe, { "--job.dump_folder=" .. os.tmpname() .. ".d", "--metrics.peak_flops=1e11",
          "--training.seq_len=32", "--training.local_batch_size=2", "--validation.enable=false",
          "--metrics.enable_jsonl=false", "--training." .. key .. "=" .. tostring(flag) })
        local printed = {}
        local tr = trainer.new(cfg, { print = function(line) printed[#printed + 1] = line end })
        assert.are.equal(flag, titan[key]())
        if key == "gemm_autotune" then
          tr:banner()
          local said = table.concat(printed, "\n"):find("gemm autotune: ignored on the CPU", 1, true)
          assert.are.equal(flag, said ~= nil, table.concat(printed, "\n"))
        end
        local l = tr:train(2)
        tr:close()
        tr.model:free()
        return l
      end
      local on = losses(true)
      assert.are.same(losses(false), on) -- OpenBLAS has no TF32 and one algorithm: f32 stays exact
      assert.is_false(titan[key]())
    end)
  end

  it("sampling: greedy, top-k = 1 and a tiny top-p all pick the argmax; the seed fixes the draw", function()
    local sampling = require("titan.sampling")
    local logits = titan.tensor({ 0.1, 2.5, -1, 2.4, 0 })
    assert.are.equal(1, sampling.sample(logits, { temperature = 0 }))
    assert.are.equal(1, sampling.sample(logits, { top_k = 1 }))
    assert.are.equal(1, sampling.sample(logits, { top_p = 1e-6 }))
    local seen = {}
    for i = 1, 200 do
      local r = i / 201
      seen[sampling.sample(logits, { top_k = 2, rng = function() return r end })] = true
    end
    assert.are.same({ [1] = true, [3] = true }, seen)
  end)

  it("titan generate samples from a trained checkpoint, reproducibly", function()
    local exe = env.build_dir .. "/titan"
    local dump = os.tmpname() .. ".gen"
    local common = ("--job.dump_folder=%s --metrics.peak_flops=1e11 --training.seq_len=32 "
      .. "--training.local_batch_size=2 --validation.enable=false"):format(dump)
    assert.truthy(os.execute(("%s lua/recipes/llama3_debugmodel.lua %s --training.steps=3 --checkpoint.enable=true "
      .. "--checkpoint.interval=3 >/dev/null 2>&1"):format(exe, common)))
    local function gen(extra)
      local p = io.popen(("%s generate lua/recipes/llama3_debugmodel.lua %s --prompt 'Once upon a time' "
        .. "--max-new-tokens 8 %s 2>&1; echo rc=$?"):format(exe, common, extra))
      local out = p:read("*a")
      p:close()
      return out
    end
    local a, b = gen("--seed 3"), gen("--seed 3")
    assert.truthy(a:find("rc=0"), a)
    assert.truthy(a:find("^Once upon a time"), a)
    assert.are.equal(a, b)
    assert.is_nil(a:find("no checkpoint found"), a)
    local bad = gen("--top-k x")
    assert.truthy(bad:find("titan generate: %-%-top%-k expects a number, got 'x'"), bad)
    assert.truthy(bad:find("rc=1"), bad)
    -- a checkpoint named on the command line must exist: no silent random weights
    local p = io.popen(("%s generate /nonexistent/ckpt --recipe lua/recipes/llama3_debugmodel.lua --prompt hi 2>&1; "
      .. "echo rc=$?"):format(exe))
    local missing = p:read("*a")
    p:close()
    assert.truthy(missing:find("titan generate: /nonexistent/ckpt holds no complete checkpoint", 1, true), missing)
    assert.truthy(missing:find("rc=1", 1, true), missing)
    -- a tokenizer smaller than the model's vocabulary: only ids it can decode are sampled
    -- (untrained weights put most of the mass on the 2048 - 300 ids it lacks)
    local Tokenizer = require("titan.tokenizer")
    local small = Tokenizer.train({ vocab_size = 300, texts = { ("Once upon a time there was a fox. "):rep(50) } })
    local tok_path = dump .. ".tok.json"
    small:save(tok_path)
    small:free()
    local untrained = gen(("--model.tokenizer=%s --job.dump_folder=%s.none --temperature 1 --top-p 1"):format(
      tok_path, dump))
    os.remove(tok_path)
    assert.truthy(untrained:find("no checkpoint found; sampling from the initial", 1, true), untrained)
    assert.truthy(untrained:find("rc=0", 1, true), untrained)
    os.execute("rm -rf '" .. dump .. "'")
  end)
end)
