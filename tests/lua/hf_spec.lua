-- Hugging Face interop: names, the q/k row order, config.json, export ->
-- import round trips (f32 bit-exact, bf16 within rounding), sharded
-- folders with an index, errors, `titan ckpt convert` both ways, and the
-- Python side (tests/reference/hf_check.py): the safetensors library reads
-- the files, a Llama in HF's conventions and transformers' LlamaForCausalLM
-- give our logits. Python pieces that are not installed report pending.
local titan = require("titan")
local llama3 = require("models.llama3")
local ckpt = require("titan.checkpoint")
local hf = require("titan.checkpoint.hf")
local safetensors = require("titan.checkpoint.safetensors")
local format = require("titan.checkpoint.format")
local json = require("titan.checkpoint.json")
local fs = require("titan.checkpoint.fs")
local env = require("titan.env")
local ffi, C = titan.ffi, titan.C

local EXE = env.build_dir .. "/titan"
local PYTHON = os.getenv("TITAN_HF_PYTHON") or "/usr/bin/python3"
local CHECK = env.root .. "/tests/reference/hf_check.py"
local INSTALL = "install them with: python3 -m venv --system-site-packages /opt/hfvenv && "
  .. "/opt/hfvenv/bin/pip install safetensors transformers==4.44.2, then run with TITAN_HF_PYTHON=/opt/hfvenv/bin/python "
  .. "(see docs/checkpoint.md)"

local GQA = { dim = 32, n_layers = 2, n_heads = 4, n_kv_heads = 2, multiple_of = 16, vocab_size = 61, max_seq_len = 32 }
local TIED = { dim = 32, n_layers = 1, n_heads = 2, n_kv_heads = 1, multiple_of = 16, vocab_size = 50, max_seq_len = 32,
  tie_embeddings = true }

local root = ("/tmp/titan_hf_spec.%d"):format(fs.pid())
local counter = 0
local function tmpdir()
  counter = counter + 1
  local d = ("%s/%d"):format(root, counter)
  fs.mkdirs(d)
  return d
end

local shell = dofile("tests/lua/shell.lua")
local sh_quote = shell.quote

-- rc first, as this spec reads it
local function run(cmd)
  local out, rc = shell.run(cmd)
  return rc, out
end

local function flat(t) return table.concat(t:tolist_flat(), ",") end

local function same_params(a, b, convert)
  local sb = b:state_dict().tensors
  for _, np in ipairs(a:named_parameters()) do
    local x = np[2]
    if convert then x = x:to(convert):to("float32") end
    if flat(x) ~= flat(sb[np[1]]) then return false, np[1] end
  end
  return true
end

local IDS = { 3, 1, 4, 1, 5, 9, 2, 6 }

local function logits_of(m)
  return titan.no_grad(function()
    return m(titan.tensor({ IDS }, { dtype = "int64" })):reshape(#IDS, m.args.vocab_size)
  end)
end

setup(function() fs.mkdirs(root) end)
teardown(function() fs.remove_all(root) end)

describe("HF names and layout", function()
  it("maps every parameter to LlamaForCausalLM's name (w1 = gate, w3 = up, w2 = down)", function()
    local map = {}
    for _, m in ipairs(hf.name_map(llama3.args(GQA))) do map[m.titan] = m.hf end
    assert.are.equal("model.embed_tokens.weight", map["tok_embeddings.weight"])
    assert.are.equal("model.layers.1.self_attn.q_proj.weight", map["layers.1.attention.wq.weight"])
    assert.are.equal("model.layers.0.self_attn.o_proj.weight", map["layers.0.attention.wo.weight"])
    assert.are.equal("model.layers.0.mlp.gate_proj.weight", map["layers.0.feed_forward.w1.weight"])
    assert.are.equal("model.layers.0.mlp.up_proj.weight", map["layers.0.feed_forward.w3.weight"])
    assert.are.equal("model.layers.0.mlp.down_proj.weight", map["layers.0.feed_forward.w2.weight"])
    assert.are.equal("model.layers.1.input_layernorm.weight", map["layers.1.attention_norm.weight"])
    assert.are.equal("model.layers.1.post_attention_layernorm.weight", map["layers.1.ffn_norm.weight"])
    assert.are.equal("model.norm.weight", map["norm.weight"])
    assert.are.equal("lm_head.weight", map["output.weight"])
    local m = llama3.build(GQA, { device = "meta" })
    local n = 0
    for _, np in ipairs(m:named_parameters()) do
      assert.truthy(map[np[1]], np[1])
      n = n + 1
    end
    assert.are.equal(n, #hf.name_map(llama3.args(GQA)))
    for _, e in ipairs(hf.name_map(llama3.args(TIED))) do assert.are_not.equal("lm_head.weight", e.hf) end
  end)

  it("exports q/k rows in HF's rotate-half order: row h*d + j*d/2 + i is our row h*d + 2i + j", function()
    local m = llama3.build(GQA, { seed = 3 })
    local out = tmpdir() .. "/hf"
    hf.export({ model = m }, out)
    local f = safetensors.open(out .. "/model.safetensors")
    local a = m.args
    for _, which in ipairs({ { "wq", "q_proj", a.n_heads }, { "wk", "k_proj", a.n_kv_heads } }) do
      local ours = m.layers["1"].attention[which[1]].weight:tolist()
      local theirs = titan.empty({ which[3] * a.head_dim, a.dim })
      f:read("model.layers.1.self_attn." .. which[2] .. ".weight", theirs)
      theirs = theirs:tolist()
      local d = a.head_dim
      for h = 0, which[3] - 1 do
        for i = 0, d / 2 - 1 do
          for j = 0, 1 do
            assert.are.same(ours[h * d + 2 * i + j + 1], theirs[h * d + j * d / 2 + i + 1])
          end
        end
      end
    end
    -- v, o and the MLP are not permuted
    local v = titan.empty({ a.n_kv_heads * a.head_dim, a.dim })
    f:read("model.layers.0.self_attn.v_proj.weight", v)
    assert.are.equal(flat(m.layers["0"].attention.wv.weight), flat(v))
  end)

  it("writes config.json with LlamaForCausalLM's fields", function()
    local a = llama3.args(GQA)
    local m = llama3.build(GQA, { seed = 1 })
    local out = tmpdir() .. "/hf"
    hf.export({ model = m }, out, { dtype = "bfloat16" })
    local c = json.decode(fs.read_file(out .. "/config.json"))
    assert.are.same({ "LlamaForCausalLM" }, c.architectures)
    assert.are.equal("llama", c.model_type)
    assert.are.equal(a.dim, c.hidden_size)
    assert.are.equal(a.ffn_hidden, c.intermediate_size)
    assert.are.equal(4, c.num_attention_heads)
    assert.are.equal(2, c.num_key_value_heads)
    assert.are.equal(2, c.num_hidden_layers)
    assert.are.equal(a.norm_eps, c.rms_norm_eps)
    assert.are.equal(a.rope_theta, c.rope_theta)
    assert.are.same({ rope_type = "llama3", factor = 8, low_freq_factor = 1, high_freq_factor = 4,
      original_max_position_embeddings = 8192 }, c.rope_scaling)
    assert.are.equal(61, c.vocab_size)
    assert.is_false(c.tie_word_embeddings)
    -- transformers wants original_max_position_embeddings below max_position_embeddings (else it warns):
    -- the context the scaling is made for, Meta's 131072, not the 32 positions the model trains on
    assert.are.equal(131072, c.max_position_embeddings)
    assert.are.equal("bfloat16", c.torch_dtype)
    assert.are.equal("BF16", safetensors.open(out .. "/model.safetensors"):entry("lm_head.weight").dtype)
    for _, flavor in ipairs({ "debugmodel", "1B", "8B", "70B" }) do
      local fc = hf.config(llama3.args(flavor), "bfloat16")
      assert.truthy(fc.rope_scaling.original_max_position_embeddings < fc.max_position_embeddings, flavor)
      assert.are.equal(131072, fc.max_position_embeddings, flavor) -- (Meta's Llama 3.1 configs say so)
    end
    -- an original past 131072 is still below it; no scaling: max_position_embeddings is max_seq_len
    local far = hf.config(llama3.args(GQA, { rope_scaling = { factor = 8, low_freq_factor = 1, high_freq_factor = 4,
      original_max_seq = 262144 } }), "float32")
    assert.are.equal(8 * 262144, far.max_position_embeddings)
    local plain = hf.config(llama3.args(GQA, { rope_scaling = { factor = 1 } }), "float32")
    assert.are.equal(json.null, plain.rope_scaling)
    assert.are.equal(32, plain.max_position_embeddings)
  end)

  it("transformers loads the exported config.json without a warning (Python, when installed)", function()
    local rc, out = run(sh_quote(PYTHON) .. " -c 'import json'")
    if rc ~= 0 then return pending(PYTHON .. " does not run: " .. out) end
    local dir = tmpdir()
    hf.export({ model = llama3.build("debugmodel", { seed = 1 }) }, dir .. "/hf")
    rc, out = run(("%s %s %s %s"):format(sh_quote(PYTHON), sh_quote(env.root .. "/tests/reference/hf_config_check.py"),
      sh_quote(dir .. "/hf"), sh_quote(dir .. "/report.json")))
    assert.are.equal(0, rc, out)
    local report = json.decode(fs.read_file(dir .. "/report.json"))
    if not report.available then
      return pending("transformers is not importable by " .. PYTHON .. "; " .. INSTALL)
    end
    assert.are.same({}, report.warnings, "transformers " .. report.version)
    assert.are.equal(131072, report.max_position_embeddings)
  end)
end)

describe("HF round trips", function()
  it("export -> import is bit-exact in f32 (GQA and tied embeddings)", function()
    for _, flavor in ipairs({ GQA, TIED }) do
      local m = llama3.build(flavor, { seed = 11 })
      local out = tmpdir() .. "/hf"
      hf.export({ model = m }, out)
      local m2 = llama3.build(flavor, { seed = 12 })
      assert.is_false(same_params(m, m2))
      hf.import(out, m2)
      assert.is_true(same_params(m, m2))
      assert.are.equal(flat(logits_of(m)), flat(logits_of(m2)))
    end
  end)

  it("export in bf16 -> import into f32 equals rounding each weight to bf16", function()
    local m = llama3.build(GQA, { seed = 5 })
    local out = tmpdir() .. "/hf"
    hf.export({ model = m }, out, { dtype = "bfloat16" })
    local m2 = llama3.build(GQA, { seed = 6 })
    hf.import(out, m2)
    local ok, name = same_params(m, m2, "bfloat16")
    assert.is_true(ok, name)
  end)

  it("beyond max_shard_bytes: numbered files and model.safetensors.index.json; imports the same", function()
    local m = llama3.build(GQA, { seed = 8 })
    local out = tmpdir() .. "/hf"
    hf.export({ model = m }, out, { max_shard_bytes = 30000 })
    local idx = json.decode(fs.read_file(out .. "/model.safetensors.index.json"))
    local files, n = {}, 0
    for _, file in pairs(idx.weight_map) do
      if not files[file] then n = n + 1 end
      files[file] = true
    end
    assert.truthy(n > 2)
    assert.is_false(fs.exists(out .. "/model.safetensors"))
    local total = 0
    for _, np in ipairs(m:named_parameters()) do total = total + np[2]:nbytes() end
    assert.are.equal(total, idx.metadata.total_size)
    assert.truthy(files[("model-00001-of-%05d.safetensors"):format(n)])
    local m2 = llama3.build(GQA, { seed = 9 })
    hf.import(out, m2)
    assert.is_true(same_params(m, m2))
    -- and through a titan checkpoint: HF folder -> checkpoint -> model
    local ck = tmpdir() .. "/from_hf"
    hf.to_checkpoint(out, ck)
    local m3 = llama3.build(GQA, { seed = 10 })
    assert.are.equal(0, ckpt.load(ck, { model = m3 }))
    assert.is_true(same_params(m, m3))
  end)

  it("refuses to overwrite, and names what differs on import", function()
    local m = llama3.build(GQA, { seed = 1 })
    local out = tmpdir() .. "/hf"
    hf.export({ model = m }, out)
    local before = fs.read_file(out .. "/model.safetensors")
    local ok, err = pcall(hf.export, { model = m }, out)
    assert.is_false(ok)
    assert.truthy(err:find("already exists") and not err:find("\n"), err)
    assert.are.equal(before, fs.read_file(out .. "/model.safetensors"))
    local other = llama3.build({ dim = 32, n_layers = 3, n_heads = 4, n_kv_heads = 2, multiple_of = 16, vocab_size = 61,
      max_seq_len = 32 }, { seed = 1 })
    ok, err = pcall(hf.import, out, other)
    assert.is_false(ok)
    assert.truthy(err:find("num_hidden_layers = 2 but the model has n_layers = 3", 1, true), err)
    -- a folder missing a tensor
    local part = tmpdir()
    local f = safetensors.open(out .. "/model.safetensors")
    local entries = {}
    for _, name in ipairs(f:names()) do
      if name ~= "model.layers.1.mlp.up_proj.weight" then
        local e = f:entry(name)
        local t = titan.empty(e.shape, { dtype = e.our_dtype })
        f:read(name, t)
        entries[#entries + 1] = { name, t }
      end
    end
    safetensors.write(part .. "/model.safetensors", entries)
    ok, err = pcall(hf.import, part, llama3.build(GQA, { seed = 2 }))
    assert.is_false(ok)
    assert.truthy(err:find("has no tensor model.layers.1.mlp.up_proj.weight", 1, true) and not err:find("\n"), err)
    -- a truncated file
    local trunc = tmpdir()
    local fh = assert(io.open(trunc .. "/model.safetensors", "wb"))
    fh:write(before:sub(1, #before - 10))
    fh:close()
    ok, err = pcall(hf.import, trunc, llama3.build(GQA, { seed = 2 }))
    assert.truthy(not ok and err:find("truncated"), err)
  end)

  it("titan ckpt convert: checkpoint -> HF -> checkpoint for a named flavor (debugmodel)", function()
    local m = llama3.build("debugmodel", { seed = 4 })
    local dir = tmpdir()
    ckpt.save(dir .. "/ck/step-9", { model = m, extra = { step = 9 } })
    local rc, out = run(("%s ckpt convert --to hf --model-flavor debugmodel --dtype float32 %s %s"):format(
      sh_quote(EXE), sh_quote(dir .. "/ck"), sh_quote(dir .. "/hf")))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("exported .*step%-9"), out)
    rc, out = run(("%s ckpt convert --from hf %s %s"):format(sh_quote(EXE), sh_quote(dir .. "/hf"),
      sh_quote(dir .. "/back")))
    assert.are.equal(0, rc, out)
    local m2 = llama3.build("debugmodel", { seed = 5 })
    ckpt.load(dir .. "/back", { model = m2 })
    assert.is_true(same_params(m, m2))
    rc, out = run(("%s ckpt inspect %s"):format(sh_quote(EXE), sh_quote(dir .. "/hf")))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("model.layers.5.self_attn.q_proj.weight", 1, true), out)
    -- a flavor that does not fit the checkpoint: one line, exit 1, nothing written
    rc, out = run(("%s ckpt convert --to hf --model-flavor 1B %s %s"):format(sh_quote(EXE), sh_quote(dir .. "/ck"),
      sh_quote(dir .. "/hf1b")))
    assert.are.equal(1, rc)
    assert.truthy(out:match("^titan: hf: [^\n]+ has shape [^\n]+\n$"), out)
    assert.is_false(fs.exists(dir .. "/hf1b"))
  end)
end)

describe("HF files from Python", function()
  local report, skip

  setup(function()
    local rc, out = run(sh_quote(PYTHON) .. " -c 'import torch'")
    if rc ~= 0 then
      skip = PYTHON .. " has no torch (" .. (out:match("[^\n]*Error[^\n]*") or "?") .. "); " .. INSTALL
      return
    end
    local m = llama3.build(GQA, { seed = 21 })
    local dir = tmpdir()
    hf.export({ model = m }, dir .. "/hf")
    local fh = assert(io.open(dir .. "/tokens.json", "w"))
    fh:write(json.encode(IDS))
    fh:close()
    local logits = logits_of(m)
    local n = logits:numel()
    local buf = ffi.new("float[?]", n)
    assert(C.tt_tensor_to_host(logits:ptr(), buf, n * 4) == 0)
    fh = assert(io.open(dir .. "/logits.f32", "wb"))
    fh:write(ffi.string(buf, n * 4))
    fh:close()
    rc, out = run(("%s %s %s %s %s %s"):format(sh_quote(PYTHON), sh_quote(CHECK), sh_quote(dir .. "/hf"),
      sh_quote(dir .. "/tokens.json"), sh_quote(dir .. "/logits.f32"), sh_quote(dir .. "/report.json")))
    assert(rc == 0, "hf_check.py failed: " .. out)
    report = json.decode(fs.read_file(dir .. "/report.json"))
  end)

  it("the files parse as safetensors with the names and shapes config.json implies", function()
    if skip then return pending(skip) end
    assert.is_true(report.names_match)
    assert.is_true(report.shapes_match)
  end)

  it("the safetensors library loads every file", function()
    if skip then return pending(skip) end
    if not report.safetensors.available then
      return pending("python safetensors is not importable by " .. PYTHON .. "; " .. INSTALL)
    end
    assert.is_true(report.safetensors.ok, tostring(report.safetensors.error))
  end)

  it("a Llama in HF's conventions (rotate-half RoPE) gives our logits to 1e-4", function()
    if skip then return pending(skip) end
    assert.truthy(report.manual.rel < 1e-4, "relative error " .. report.manual.rel)
  end)

  it("transformers' LlamaForCausalLM gives our logits to 1e-4", function()
    if skip then return pending(skip) end
    if not report.transformers.available then
      return pending("transformers is not importable by " .. PYTHON .. "; " .. INSTALL)
    end
    assert.truthy(report.transformers.rel < 1e-4, "relative error " .. report.transformers.rel)
  end)
end)

-- The tokenizer beside the weights: AutoTokenizer.from_pretrained(folder)
-- must give Titan's ids (BOS first, as Titan trains and prompts) and the
-- model config the BOS/EOS ids generate() stops at.
describe("HF export with the tokenizer", function()
  local TOK = env.root .. "/assets/tokenizers/fortunes_2048.json"
  -- (the last two hold special-token text, plain text to Titan: split_special_tokens makes it so in transformers)
  local TEXTS = { "Hello world", "  two spaces, tabs\tand\nnew lines\n", "ünïcödé — “quotes” 😀", "1234567 it's",
    "a<|end_of_text|>b", "<|begin_of_text|>Title\n\nBody <|end_of_text|> more<|end_of_text|>" }

  local function export_with_tokenizer(dir)
    local m = llama3.build("debugmodel", { seed = 7 })
    hf.export({ model = m }, dir, { tokenizer = TOK })
    return m
  end

  it("writes tokenizer.json (BOS added, string merges) and tokenizer_config.json; config.json gets the ids", function()
    local dir = tmpdir() .. "/hf"
    export_with_tokenizer(dir)
    local Tokenizer = require("titan.tokenizer")
    local ours = Tokenizer.load(TOK)
    local cfg = json.decode(fs.read_file(dir .. "/config.json"))
    assert.are.equal(ours.bos_id, cfg.bos_token_id)
    assert.are.equal(ours.eos_id, cfg.eos_token_id)
    local tc = json.decode(fs.read_file(dir .. "/tokenizer_config.json"))
    assert.are.equal("PreTrainedTokenizerFast", tc.tokenizer_class)
    assert.are.equal(ours:token(ours.bos_id), tc.bos_token)
    assert.are.equal(ours:token(ours.eos_id), tc.eos_token)
    assert.is_true(tc.split_special_tokens) -- special-token text in a text is text, as Titan encodes it
    local tj = json.decode(fs.read_file(dir .. "/tokenizer.json"))
    assert.are.equal("TemplateProcessing", tj.post_processor.type)
    assert.are.same({ ours.bos_id }, tj.post_processor.special_tokens[tc.bos_token].ids)
    assert.are.equal("string", type(tj.model.merges[1]))
    -- Titan reads the exported file back as the same tokenizer
    local back = Tokenizer.load(dir .. "/tokenizer.json")
    for _, t in ipairs(TEXTS) do
      assert.are.same(ours:encode_table(t, { bos = true }), back:encode_table(t, { bos = true }), t)
    end
    -- without --tokenizer: no tokenizer files, no ids
    local plain = tmpdir() .. "/plain"
    hf.export({ model = llama3.build("debugmodel", { seed = 7 }) }, plain)
    assert.is_false(fs.exists(plain .. "/tokenizer.json"))
    assert.is_nil(json.decode(fs.read_file(plain .. "/config.json")).eos_token_id)
  end)

  it("a tokenizer larger than the model's vocabulary is refused before anything is written", function()
    local dir = tmpdir()
    ckpt.save(dir .. "/ck/step-1", { model = llama3.build(GQA, { seed = 1 }), extra = { step = 1 } })
    local ok, err = pcall(hf.export, { checkpoint = dir .. "/ck/step-1" }, dir .. "/hf",
      { args = llama3.args(GQA), tokenizer = TOK })
    assert.is_false(ok)
    assert.truthy(tostring(err):find("has 2048 tokens but the model's vocab_size is 61", 1, true), tostring(err))
    assert.is_false(fs.exists(dir .. "/hf"))
    -- the CLI: --tokenizer, and its line
    local ck = dir .. "/ck2"
    ckpt.save(ck .. "/step-3", { model = llama3.build("debugmodel", { seed = 3 }), extra = { step = 3 } })
    local rc, out = run(("%s ckpt convert --to hf --model-flavor debugmodel --tokenizer %s %s %s"):format(sh_quote(EXE),
      sh_quote(TOK), sh_quote(ck), sh_quote(dir .. "/cli")))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("with its tokenizer", 1, true), out)
    assert.is_true(fs.exists(dir .. "/cli/tokenizer_config.json"))
    -- --recipe: the model and the tokenizer of the recipe the checkpoint was trained with
    local recipe = dir .. "/r.lua"
    fs.write_file(recipe, ("return { base = 'llama3_debugmodel', model = { tokenizer = %q } }"):format(TOK))
    rc, out = run(("%s ckpt convert --to hf --recipe %s %s %s"):format(sh_quote(EXE), sh_quote(recipe), sh_quote(ck),
      sh_quote(dir .. "/by_recipe")))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("(llama3 debugmodel, float32, with its tokenizer)", 1, true), out)
    assert.are.equal(fs.read_file(dir .. "/cli/tokenizer.json"), fs.read_file(dir .. "/by_recipe/tokenizer.json"))
    assert.are.equal(fs.read_file(dir .. "/cli/config.json"), fs.read_file(dir .. "/by_recipe/config.json"))
    -- neither --recipe nor --model-flavor: one line
    rc, out = run(("%s ckpt convert --to hf %s %s"):format(sh_quote(EXE), sh_quote(ck), sh_quote(dir .. "/none")))
    assert.are.equal(1, rc, out)
    assert.truthy(out:match("^titan: ckpt: convert %-%-to hf needs %-%-recipe FILE or %-%-model%-flavor[^\n]*\n$"), out)
  end)

  it("the tokenizers library and transformers' AutoTokenizer give Titan's ids and decode back", function()
    local rc, out = run(sh_quote(PYTHON) .. " -c 'import json'")
    if rc ~= 0 then return pending(PYTHON .. " does not run: " .. out) end
    local dir = tmpdir()
    export_with_tokenizer(dir .. "/hf")
    local ours = require("titan.tokenizer").load(TOK)
    local cases = {}
    for i, t in ipairs(TEXTS) do cases[i] = { text = t, ids = json.array(ours:encode_table(t, { bos = true })) } end
    fs.write_file(dir .. "/cases.json", json.encode(json.array(cases)))
    rc, out = run(("%s %s %s %s %s"):format(sh_quote(PYTHON), sh_quote(env.root .. "/tests/reference/hf_tokenizer_check.py"),
      sh_quote(dir .. "/hf"), sh_quote(dir .. "/cases.json"), sh_quote(dir .. "/report.json")))
    assert.are.equal(0, rc, out)
    local report = json.decode(fs.read_file(dir .. "/report.json"))
    if not report.tokenizers.available then
      return pending("python tokenizers is not importable by " .. PYTHON .. "; " .. INSTALL)
    end
    assert.is_true(report.tokenizers.ok, tostring(report.tokenizers.error))
    if not report.transformers.available then
      return pending("transformers is not importable by " .. PYTHON .. "; " .. INSTALL)
    end
    assert.is_true(report.transformers.ok, tostring(report.transformers.error))
  end)
end)
