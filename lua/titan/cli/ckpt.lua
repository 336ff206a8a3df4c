-- cli/ckpt.lua — `titan ckpt ...`: inspect, verify and convert checkpoints.
local M = {}

M.usage = [[
usage: titan ckpt inspect DIR
         DIR: a step folder, a folder of step-N folders, or a Hugging Face folder:
         step, completeness, train state, tensors with dtypes, shapes, chunks and sizes
       titan ckpt verify DIR
         read every chunk of step folder DIR and check its CRC-32C
       titan ckpt convert --to hf (--recipe FILE | --model-flavor F [--model-name llama3])
                          [--dtype float32|bfloat16] [--max-shard-bytes N] [--tokenizer FILE] CKPT_DIR OUT_DIR
         a titan checkpoint (step folder, or the latest complete one in a folder) -> Hugging Face
         LlamaForCausalLM safetensors + config.json in the new folder OUT_DIR; with --tokenizer
         also tokenizer.json + tokenizer_config.json for AutoTokenizer. --recipe takes the model
         (model.name, model.flavor) and the tokenizer from the recipe the checkpoint was trained
         with; --model-flavor, --model-name and --tokenizer given too take precedence
       titan ckpt convert --from hf HF_DIR OUT_CKPT_DIR
         a Hugging Face Llama folder -> a new titan step folder (model only, step 0), usable as
         checkpoint.initial_load_path
       titan ckpt --help
]]

local function die(fmt, ...) error(("ckpt: " .. fmt):format(...), 0) end

-- --key value / --key=value options and positionals.
local function parse(args, allowed)
  local opts, pos = {}, {}
  local i = 1
  while i <= #args do
    local a = args[i]
    local k, v = a:match("^%-%-([%w%-]+)=(.*)$")
    if not k then k = a:match("^%-%-([%w%-]+)$") end
    if k then
      if not allowed[k] then
        local names = {}
        for n in pairs(allowed) do names[#names + 1] = "--" .. n end
        table.sort(names)
        die("unknown option --%s; expected %s (see titan ckpt --help)", k,
          #names > 0 and ("one of " .. table.concat(names, ", ")) or "none here")
      end
      if v == nil then
        i = i + 1
        v = args[i]
        if v == nil then die("option --%s needs a value", k) end
      end
      opts[k] = v
    else
      pos[#pos + 1] = a
    end
    i = i + 1
  end
  return opts, pos
end

local function latest_or_self(dir)
  local format = require("titan.checkpoint.format")
  if format.is_complete(dir) then return dir end
  local steps = format.list_steps(dir)
  for i = #steps, 1, -1 do
    if steps[i].complete then return steps[i].dir end
  end
  if #steps > 0 then die("%s holds no complete checkpoint (only interrupted saves)", dir) end
  return dir -- format.open names what is wrong with it
end

local function convert(args)
  local opts, pos = parse(args, { to = true, from = true, ["model-flavor"] = true, ["model-name"] = true, dtype = true,
    ["max-shard-bytes"] = true, tokenizer = true, recipe = true })
  local ckpt = require("titan.checkpoint")
  if opts.to and opts.from then die("convert takes --to hf or --from hf, not both") end
  if opts.to then
    if opts.to ~= "hf" then die("convert --to %s: only hf is supported", opts.to) end
    if #pos ~= 2 then die("convert --to hf needs CKPT_DIR and OUT_DIR (got %d path(s))", #pos) end
    local from_recipe = {}
    if opts.recipe then
      local config = require("titan.config")
      local ok, cfg = pcall(function() return config.resolve(config.load_recipe(opts.recipe), {}) end)
      if not ok then die("--recipe %s: %s", opts.recipe, tostring(cfg)) end
      local tok = cfg.model.tokenizer
      tok = config.resolve_file(tok)
      from_recipe = { flavor = cfg.model.flavor, name = cfg.model.name, tokenizer = tok ~= "" and tok or nil }
    end
    local flavor = opts["model-flavor"] or from_recipe.flavor
    if not flavor then die("convert --to hf needs --recipe FILE or --model-flavor (e.g. debugmodel, 8B)") end
    local name = opts["model-name"] or from_recipe.name or "llama3"
    if not name:match("^[%w_]+$") then die("bad --model-name %s", name) end
    local ok, family = pcall(require, "models." .. name)
    if not ok then die("unknown --model-name %s (no lua/models/%s.lua)", name, name) end
    if not family.flavors[flavor] then
      local names = {}
      for k in pairs(family.flavors) do names[#names + 1] = k end
      table.sort(names)
      die("unknown --model-flavor %s; expected one of %s", flavor, table.concat(names, ", "))
    end
    local dtype = opts.dtype or "float32"
    if dtype ~= "float32" and dtype ~= "bfloat16" then die("--dtype must be float32 or bfloat16, got %s", dtype) end
    local max = opts["max-shard-bytes"] and tonumber(opts["max-shard-bytes"])
    if opts["max-shard-bytes"] and not (max and max > 0) then die("--max-shard-bytes must be a positive number") end
    local src = latest_or_self(pos[1])
    local tok = opts.tokenizer or from_recipe.tokenizer
    if tok == "" then die("--tokenizer needs a FILE (a tokenizer.json or tiktoken ranks file)") end
    ckpt.hf.export({ checkpoint = src }, pos[2], { args = family.args(flavor), dtype = dtype, max_shard_bytes = max,
      tokenizer = tok })
    print(("exported %s (%s %s, %s%s) to %s"):format(src, name, flavor, dtype, tok and ", with its tokenizer" or "",
      pos[2]))
  elseif opts.from then
    if opts.from ~= "hf" then die("convert --from %s: only hf is supported", opts.from) end
    if #pos ~= 2 then die("convert --from hf needs HF_DIR and OUT_CKPT_DIR (got %d path(s))", #pos) end
    local _, a = ckpt.hf.to_checkpoint(pos[1], pos[2])
    print(("converted %s (%d layers, dim %d) to %s"):format(pos[1], a.n_layers, a.dim, pos[2]))
  else
    die("convert needs --to hf or --from hf (see titan ckpt --help)")
  end
end

function M.main(...)
  local args = { ... }
  local cmd = args[1]
  if cmd == nil then die("missing command; expected inspect, verify or convert (see titan ckpt --help)") end
  if cmd == "--help" or cmd == "-h" or cmd == "help" then
    io.write(M.usage)
    return 0
  end
  table.remove(args, 1)
  for _, a in ipairs(args) do -- (titan ckpt inspect --help: the usage, not an unknown option)
    if a == "--help" or a == "-h" then
      io.write(M.usage)
      return 0
    end
  end
  local ckpt = require("titan.checkpoint")
  if cmd == "inspect" then
    local _, pos = parse(args, {})
    if #pos ~= 1 then die("inspect needs exactly one DIR (got %d)", #pos) end
    print(ckpt.inspect(pos[1]))
  elseif cmd == "verify" then
    local _, pos = parse(args, {})
    if #pos ~= 1 then die("verify needs exactly one DIR (got %d)", #pos) end
    local dir = latest_or_self(pos[1])
    local n = ckpt.verify(dir)
    print(("%s: %d chunk(s), every checksum matches, no NaN or inf"):format(dir, n))
  elseif cmd == "convert" then
    convert(args)
  else
    die("unknown command '%s'; expected inspect, verify or convert (see titan ckpt --help)", cmd)
  end
  return 0
end

return M
