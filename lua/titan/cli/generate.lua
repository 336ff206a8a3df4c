-- titan generate CHECKPOINT_OR_RECIPE --prompt TEXT [options]
--
-- Samples text from a model: a recipe (its model, tokenizer and, when one
-- exists, the latest complete checkpoint in its dump folder) or a
-- checkpoint step directory (with --recipe naming the model's recipe).
local titan = require("titan")
local config = require("titan.config")
local sampling = require("titan.sampling")

local M = {}

local usage = [[
usage: titan generate RECIPE.lua|CHECKPOINT_DIR --prompt TEXT [options]
  --recipe FILE          the recipe of a checkpoint's model (with a CHECKPOINT_DIR)
  --max-new-tokens N     (default 100)
  --temperature T        (default 0.8; 0 = greedy)
  --top-k K              (default 0 = off)
  --top-p P              (default 0.95)
  --seed S               (default 0)
  --section.key=value    config overrides, as for training]]

local function fail(msg)
  io.stderr:write("titan generate: " .. msg .. "\n")
  os.exit(1)
end

function M.main(...)
  local args = { ... }
  local opts = { max_new_tokens = 100, temperature = 0.8, top_k = 0, top_p = 0.95, seed = 0 }
  local target, recipe_path, prompt
  local overrides = {}
  local i = 1
  local function value(name)
    i = i + 1
    if args[i] == nil then fail(name .. " needs a value") end
    return args[i]
  end
  local function number(name)
    local v = tonumber(value(name))
    if not v then fail(name .. " expects a number, got '" .. args[i] .. "'") end
    return v
  end
  while i <= #args do
    local a = args[i]
    if a == "--help" or a == "-h" then print(usage); return end
    if a == "--prompt" then prompt = value(a)
    elseif a == "--recipe" then recipe_path = value(a)
    elseif a == "--max-new-tokens" then opts.max_new_tokens = number(a)
    elseif a == "--temperature" then opts.temperature = number(a)
    elseif a == "--top-k" then opts.top_k = number(a)
    elseif a == "--top-p" then opts.top_p = number(a)
    elseif a == "--seed" then opts.seed = number(a)
    elseif a:match("^%-%-[%w_]+%.[%w_]+") then overrides[#overrides + 1] = a
    elseif a:sub(1, 2) == "--" then fail("unknown option " .. a .. "\n" .. usage)
    elseif not target then target = a
    else fail("unexpected argument '" .. a .. "'\n" .. usage) end
    i = i + 1
  end
  if not target then fail("name a recipe or a checkpoint directory\n" .. usage) end
  if not prompt then fail("--prompt is required") end

  local ckpt_dir
  if target:match("%.lua$") then
    recipe_path = target
  else
    ckpt_dir = target
    if not recipe_path then fail("a checkpoint needs --recipe FILE naming its model's recipe") end
  end
  local ok, recipe = pcall(config.load_recipe, recipe_path)
  if not ok then fail(tostring(recipe)) end
  local ok_cfg, cfg = pcall(config.resolve, recipe, overrides)
  if not ok_cfg then fail(tostring(cfg)) end
  local dev = cfg.training.device
  if dev:match("^cuda") and not titan.cuda_available() then
    fail(("training.device = %s, but no CUDA device is visible (or titan was built without TITAN_CUDA); "
      .. "expected --training.device=cpu"):format(dev))
  end
  local family = require("models." .. cfg.model.name)
  local model = family.build(cfg.model.flavor, { device = cfg.training.device, seed = cfg.training.seed })
  local loaded = false
  local has_ckpt, ckpt = pcall(require, "titan.checkpoint")
  if has_ckpt and ckpt.load_model then
    loaded = ckpt.load_model(model, ckpt_dir or (cfg.job.dump_folder .. "/" .. cfg.checkpoint.folder))
  elseif ckpt_dir then
    fail("checkpoints cannot be read by this build")
  end
  if not loaded then
    -- A checkpoint named on the command line must be there: random weights
    -- in its place would look like a broken model.
    if ckpt_dir then fail(("%s holds no complete checkpoint (a step-N folder, or a folder of them)"):format(ckpt_dir)) end
    io.stderr:write("titan generate: no checkpoint found; sampling from the initial (untrained) weights\n")
  end
  local Tokenizer = require("titan.tokenizer")
  local tok_path = cfg.model.tokenizer
  tok_path = config.resolve_file(tok_path)
  local tok = Tokenizer.load(tok_path)
  local ids = tok:encode_table(prompt, { bos = true })
  io.write(prompt)
  io.flush()
  local new, ended = 0, false
  sampling.generate(model, ids, {
    max_new_tokens = opts.max_new_tokens, temperature = opts.temperature, top_k = opts.top_k, top_p = opts.top_p,
    seed = opts.seed, eos_id = tok.eos_id, max_seq_len = cfg.training.seq_len, device = cfg.training.device,
    vocab_size = tok.vocab_size,
    on_token = function(id)
      if id == tok.eos_id then ended = true else new = new + 1 end
      if id ~= tok.eos_id and id ~= tok.bos_id then io.write(tok:decode({ id })); io.flush() end
    end,
  })
  io.write("\n")
  -- Why it stopped, on stderr (stdout stays the text): an early end-of-text
  -- is otherwise indistinguishable from a model that printed nothing.
  if ended then
    io.stderr:write(("titan generate: end of text after %d new token%s\n"):format(new, new == 1 and "" or "s"))
  end
end

return M
