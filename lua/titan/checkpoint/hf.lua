-- checkpoint/hf.lua — Hugging Face Llama interop: our (TorchTitan's) names
-- <-> LlamaForCausalLM's, the q/k row order for rotary embeddings, and
-- config.json.
--
-- Titan/Meta rotate adjacent pairs (2i, 2i+1) of each head; HF rotates
-- halves (i, i + d/2). Row h*d + 2i + j of our wq/wk is row h*d + j*d/2 + i
-- of HF's (the permute of HF's convert_llama_weights_to_hf.py). Both
-- directions are strided views ([H, d/2, 2, in] transposed to
-- [H, 2, d/2, in]): export packs the view in C, import reads the file
-- straight into the view; no element loop runs in Lua.
--
--   hf.export({ model = m } | { checkpoint = dir }, out_dir, { args =, dtype =, max_shard_bytes =, tokenizer = })
--   hf.import(hf_dir, model)          hf.to_checkpoint(hf_dir, out_dir)
require("titan") -- the tensor face complete (views come with titan.ops)
local tensor = require("titan.tensor")
local autograd = require("titan.autograd")
local json = require("titan.checkpoint.json")
local fs = require("titan.checkpoint.fs")
local format = require("titan.checkpoint.format")
local safetensors = require("titan.checkpoint.safetensors")

local M = {}

M.MAX_SHARD_BYTES = 5e9 -- transformers' default max_shard_size ("5GB")
M.INDEX = "model.safetensors.index.json"
M.SINGLE = "model.safetensors"

local function fail(fmt, ...) error(("hf: " .. fmt):format(...), 0) end

-- Ordered { titan, hf, shape, heads (q/k: rows are permuted per head) }.
function M.name_map(a)
  if a.moe then fail("the flavor has mixture-of-experts layers, which have no Hugging Face Llama names; expected a "
    .. "dense flavor") end
  local hd = a.head_dim or a.dim / a.n_heads
  local D, F, V = a.dim, a.ffn_hidden, a.vocab_size
  local q, kv = a.n_heads * hd, a.n_kv_heads * hd
  local list = { { titan = "tok_embeddings.weight", hf = "model.embed_tokens.weight", shape = { V, D } } }
  local function add(t, h, shape, heads) list[#list + 1] = { titan = t, hf = h, shape = shape, heads = heads } end
  for i = 0, a.n_layers - 1 do
    local L, H = ("layers.%d."):format(i), ("model.layers.%d."):format(i)
    add(L .. "attention.wq.weight", H .. "self_attn.q_proj.weight", { q, D }, a.n_heads)
    add(L .. "attention.wk.weight", H .. "self_attn.k_proj.weight", { kv, D }, a.n_kv_heads)
    add(L .. "attention.wv.weight", H .. "self_attn.v_proj.weight", { kv, D })
    add(L .. "attention.wo.weight", H .. "self_attn.o_proj.weight", { D, q })
    add(L .. "feed_forward.w1.weight", H .. "mlp.gate_proj.weight", { F, D })
    add(L .. "feed_forward.w3.weight", H .. "mlp.up_proj.weight", { F, D })
    add(L .. "feed_forward.w2.weight", H .. "mlp.down_proj.weight", { D, F })
    add(L .. "attention_norm.weight", H .. "input_layernorm.weight", { D })
    add(L .. "ffn_norm.weight", H .. "post_attention_layernorm.weight", { D })
  end
  add("norm.weight", "model.norm.weight", { D })
  if not a.tie_embeddings then add("output.weight", "lm_head.weight", { V, D }) end
  return list
end

-- The strided view of a [heads * d, in] weight in the other row order:
-- to_hf = true gives HF's order from ours, false ours from HF's (as a
-- destination to read HF bytes into, with the stored shape [H, 2, d/2, in]).
local function permuted(w, heads)
  local rows, cols = w:size(1), w:size(2)
  local hd = rows / heads
  return autograd.no_grad(function() return w:view(heads, hd / 2, 2, cols):transpose(2, 3) end)
end

-- The context Llama 3.1's RoPE scaling stretches its 8192 positions to: the
-- max_position_embeddings of Meta's Llama 3.1-3.3 configs (and the longest
-- sequence lua/models/llama3.lua lets a flavor without max_seq_len train on).
M.LLAMA3_SCALED_CONTEXT = 131072

-- max_position_embeddings: the model's max_seq_len, or with the llama3 RoPE
-- scaling the context it is made for when that is longer, as Meta's
-- configs have it. transformers warns on loading a llama3 rope_scaling
-- whose original_max_position_embeddings is not below
-- max_position_embeddings (the debug model: 8192 against its 2048). Its
-- frequencies depend on the original and the factors only, never on
-- max_position_embeddings, so the logits are the same either way. (With a
-- tokenizer, tokenizer_config.json's model_max_length keeps max_seq_len.)
function M.config(a, dtype, special)
  local sc = a.rope_scaling
  local scaling = json.null
  local max_pos = a.max_seq_len
  if sc and sc.factor and sc.factor > 1 then
    -- (a field left out takes F.rope_tables' default, as the model's tables did)
    local original = sc.original_max_seq or 8192
    -- floats as transformers checks them (8.0: an integral 8 is "not a float" to it)
    scaling = { rope_type = "llama3", factor = json.float(sc.factor),
      low_freq_factor = json.float(sc.low_freq_factor or 1), high_freq_factor = json.float(sc.high_freq_factor or 4),
      original_max_position_embeddings = original }
    max_pos = math.max(max_pos, M.LLAMA3_SCALED_CONTEXT)
    if max_pos <= original then max_pos = math.floor(sc.factor * original) end -- (an original past Llama 3.1's)
  end
  return {
    architectures = json.array({ "LlamaForCausalLM" }), model_type = "llama",
    hidden_size = a.dim, intermediate_size = a.ffn_hidden, num_attention_heads = a.n_heads,
    num_key_value_heads = a.n_kv_heads, num_hidden_layers = a.n_layers, head_dim = a.head_dim or a.dim / a.n_heads,
    rms_norm_eps = a.norm_eps, rope_theta = json.float(a.rope_theta), rope_scaling = scaling, vocab_size = a.vocab_size,
    tie_word_embeddings = a.tie_embeddings and true or false, max_position_embeddings = max_pos,
    torch_dtype = dtype, hidden_act = "silu", attention_bias = false, attention_dropout = 0.0, mlp_bias = false,
    initializer_range = 0.02, pretraining_tp = 1, use_cache = true,
    -- with a tokenizer: transformers' generate() stops at this EOS
    bos_token_id = special and special.bos_id, eos_token_id = special and special.eos_id,
  }
end

-- The tokenizer files transformers' AutoTokenizer reads from the export:
-- tokenizer.json (BOS put in front by its post_processor, as Llama 3's
-- own, since Titan trains on BOS + document + EOS) and
-- tokenizer_config.json. Read up front into plain Lua values, and the
-- tokenizer freed at once: nothing is left for the garbage collector if
-- the export fails later.
local function load_tokenizer(path, a)
  local tok = require("titan.tokenizer").load(path)
  local n = tok.vocab_size
  local ok, t = pcall(function()
    return { json = tok:to_json({ add_bos = true }), bos_id = tok.bos_id, eos_id = tok.eos_id,
      bos = tok.bos_id and tok:token(tok.bos_id), eos = tok.eos_id and tok:token(tok.eos_id) }
  end)
  tok:free()
  if not ok then error(t, 0) end
  if n > a.vocab_size then
    fail("the tokenizer %s has %d tokens but the model's vocab_size is %d", path, n, a.vocab_size)
  end
  return t
end

-- split_special_tokens: special-token text inside a text ("<|end_of_text|>"
-- in a document) is plain text to Titan, so that data never forges a
-- document boundary or a control token; transformers matches it as the
-- special token unless told so, and would encode such a text otherwise
-- than the model was trained on (docs/tokenizer.md, "Special tokens").
local function write_tokenizer(tok, dir, a)
  fs.write_file(fs.join(dir, "tokenizer.json"), tok.json)
  local cfg = { tokenizer_class = "PreTrainedTokenizerFast", model_max_length = a.max_seq_len,
    clean_up_tokenization_spaces = false, model_input_names = json.array({ "input_ids", "attention_mask" }),
    bos_token = tok.bos, eos_token = tok.eos, split_special_tokens = true }
  fs.write_file(fs.join(dir, "tokenizer_config.json"), json.encode(cfg, 2) .. "\n")
end

-- config.json -> the model arguments the weights need (names as llama3.args).
function M.args_from_config(c, where)
  local function need(k)
    if type(c[k]) ~= "number" then fail("%s has no numeric %s", where, k) end
    return c[k]
  end
  local a = {
    dim = need("hidden_size"), n_layers = need("num_hidden_layers"), n_heads = need("num_attention_heads"),
    vocab_size = need("vocab_size"), ffn_hidden = need("intermediate_size"),
    tie_embeddings = c.tie_word_embeddings == true,
  }
  a.n_kv_heads = type(c.num_key_value_heads) == "number" and c.num_key_value_heads or a.n_heads
  a.head_dim = type(c.head_dim) == "number" and c.head_dim or a.dim / a.n_heads
  return a
end

local function read_config(dir)
  local path = fs.join(dir, "config.json")
  local text = fs.read_file(path)
  if not text then fail("%s has no config.json", dir) end
  return json.decode(text, "hf: " .. path), path
end

-- ---- export --------------------------------------------------------------------

-- Where the tensors come from: a model's parameters, or a titan checkpoint
-- (each read whole, converted to the export dtype on the way).
local function source_of(src, dtype)
  if src.model then
    local sd = src.model:state_dict()
    return {
      shape = function(name) return sd.tensors[name] and sd.tensors[name]:shape() end,
      get = function(name) return sd.tensors[name], false end,
    }
  end
  local dir = src.checkpoint
  local ck = type(dir) == "table" and dir or format.open(dir)
  return {
    ck = ck,
    shape = function(name) return ck:has(name) and ck:entry(name).shape end,
    get = function(name)
      ck:check_files({ name })
      return ck:load_tensor(name, { dtype = dtype }), true
    end,
  }
end

-- Write out_dir (a new folder: never replaces one) with config.json and
-- model.safetensors, or shards + model.safetensors.index.json beyond
-- opts.max_shard_bytes. opts.args: model arguments (llama3.args); opts.dtype:
-- float32 (default) or bfloat16; opts.tokenizer: a tokenizer file (HF
-- tokenizer.json or tiktoken ranks) to export beside the weights.
function M.export(src, out_dir, opts)
  opts = opts or {}
  local a = opts.args or (src.model and src.model.args)
  if not a then fail("export needs the model arguments (opts.args)") end
  local dtype = opts.dtype or "float32"
  if dtype ~= "float32" and dtype ~= "bfloat16" then fail("export dtype must be float32 or bfloat16, got %s", dtype) end
  local max_bytes = opts.max_shard_bytes or M.MAX_SHARD_BYTES
  local source = source_of(src, dtype)
  local map = M.name_map(a)
  local known = {}
  for _, m in ipairs(map) do
    known[m.titan] = true
    local have = source.shape(m.titan)
    if not have then fail("the source has no tensor %s (expected shape %s)", m.titan, tensor.shape_str(m.shape)) end
    if tensor.shape_str(have) ~= tensor.shape_str(m.shape) then
      fail("tensor %s has shape %s but the model arguments give %s (another flavor?)", m.titan,
        tensor.shape_str(have), tensor.shape_str(m.shape))
    end
  end
  if source.ck then
    for _, name in ipairs(source.ck:names()) do
      if not name:match("^optimizer%.") and not known[name] then
        fail("checkpoint %s holds %s, which the model arguments do not have (another flavor?)", source.ck.dir, name)
      end
    end
  end
  if fs.exists(out_dir) and not (fs.is_dir(out_dir) and #fs.list(out_dir) == 0) then
    fail("%s already exists; export writes a new folder and never replaces one", out_dir)
  end
  local tok = opts.tokenizer and load_tokenizer(opts.tokenizer, a)
  -- Shards in map order, each at most max_bytes (a bigger tensor alone).
  local esize = dtype == "float32" and 4 or 2
  local shards, cur, cur_bytes, total = {}, nil, 0, 0
  for _, m in ipairs(map) do
    local n = 1
    for _, s in ipairs(m.shape) do n = n * s end
    n = n * esize
    if not cur or (cur_bytes + n > max_bytes and #cur > 0) then
      cur, cur_bytes = {}, 0
      shards[#shards + 1] = cur
    end
    cur[#cur + 1] = m
    cur_bytes, total = cur_bytes + n, total + n
  end
  local tmp = fs.join(fs.dirname(out_dir), ("." .. fs.basename(out_dir) .. ".tmp-%d"):format(fs.pid()))
  if fs.exists(tmp) then fs.remove_all(tmp) end
  fs.mkdirs(tmp)
  -- (a failure part-way leaves no temporary folder behind, empty or not)
  local ok, err = pcall(function()
    local weight_map = {}
    for i, shard in ipairs(shards) do
      local file = #shards == 1 and M.SINGLE or ("model-%05d-of-%05d.safetensors"):format(i, #shards)
      local entries, shapes, owned = {}, {}, {}
      for _, m in ipairs(shard) do
        local t, own = source.get(m.titan)
        if own then owned[#owned + 1] = t end
        if t:dtype() ~= dtype then
          t = t:to(dtype)
          owned[#owned + 1] = t
        end
        if m.heads then
          t = permuted(t, m.heads)
          owned[#owned + 1] = t
          shapes[m.hf] = m.shape
        end
        entries[#entries + 1] = { m.hf, t }
        weight_map[m.hf] = file
      end
      safetensors.write(fs.join(tmp, file), entries, { shapes = shapes, metadata = { format = "pt" } })
      for _, t in ipairs(owned) do t:free() end
    end
    if #shards > 1 then
      fs.write_file(fs.join(tmp, M.INDEX), json.encode({ metadata = { total_size = total }, weight_map = weight_map },
        2) .. "\n")
    end
    fs.write_file(fs.join(tmp, "config.json"), json.encode(M.config(a, dtype, tok), 2) .. "\n")
    if tok then write_tokenizer(tok, tmp, a) end
    fs.sync_dir(tmp)
    if fs.is_dir(out_dir) then fs.remove_all(out_dir) end -- an empty folder only (checked above)
    fs.rename(tmp, out_dir)
  end)
  if not ok then
    pcall(fs.remove_all, tmp)
    error(err, 0)
  end
  fs.sync_dir(fs.dirname(out_dir))
  return out_dir
end

-- ---- import --------------------------------------------------------------------

-- name -> open safetensors file holding it, for a folder (single file or index).
local function open_folder(dir)
  local files, where = {}, {}
  local index = fs.join(dir, M.INDEX)
  if fs.exists(index) then
    local idx = json.decode(fs.read_file(index), "hf: " .. index)
    if type(idx) ~= "table" or type(idx.weight_map) ~= "table" then fail("%s has no weight_map", index) end
    for name, file in pairs(idx.weight_map) do
      if not files[file] then
        local path = fs.join(dir, file)
        if not fs.exists(path) then fail("%s lists %s, which is missing (tensor %s)", index, file, name) end
        files[file] = safetensors.open(path)
      end
      if not files[file]:entry(name) then fail("%s: %s has no tensor %s", index, file, name) end
      where[name] = files[file]
    end
  else
    local path = fs.join(dir, M.SINGLE)
    if not fs.exists(path) then fail("%s has neither %s nor %s", dir, M.SINGLE, M.INDEX) end
    local f = safetensors.open(path)
    for _, name in ipairs(f:names()) do where[name] = f end
  end
  return where
end

-- The reads for args `a` from an HF folder: { {m, file, dst = fn(tensor)} }, validated.
local function plan_import(dir, a)
  local where = open_folder(dir)
  local map, wanted = M.name_map(a), {}
  local plan = {}
  local tied_src = nil
  for _, m in ipairs(map) do
    wanted[m.hf] = true
    local f = where[m.hf]
    if not f then fail("%s has no tensor %s (for our %s)", dir, m.hf, m.titan) end
    local e = f:entry(m.hf)
    if tensor.shape_str(e.shape) ~= tensor.shape_str(m.shape) then
      fail("%s: tensor %s has shape %s but the model needs %s (another model size?)", dir, m.hf,
        tensor.shape_str(e.shape), tensor.shape_str(m.shape))
    end
    plan[#plan + 1] = { m = m, file = f, dtype = e.our_dtype }
    if m.titan == "tok_embeddings.weight" then tied_src = plan[#plan] end
  end
  local unexpected = {}
  for name in pairs(where) do
    if not wanted[name] and not name:match("rotary_emb%.inv_freq$") and not (a.tie_embeddings and name == "lm_head.weight") then
      unexpected[#unexpected + 1] = name
    end
  end
  table.sort(unexpected)
  if #unexpected > 0 then
    fail("%s holds %d tensor(s) the model lacks (%s%s): another model shape?", dir, #unexpected,
      table.concat(unexpected, ", ", 1, math.min(3, #unexpected)), #unexpected > 3 and ", ..." or "")
  end
  return plan, tied_src
end

local function read_into(p, dst)
  local m = p.m
  if m.heads then
    local view = permuted(dst, m.heads)
    local rows, cols = m.shape[1], m.shape[2]
    p.file:read(m.hf, view, { shape = { m.heads, 2, rows / m.heads / 2, cols } })
    view:free()
  else
    p.file:read(m.hf, dst)
  end
end

-- Load an HF Llama folder into `model` (its args give the layout; a
-- config.json that disagrees is an error naming the field). opts (a
-- distributed job): shard_of(name) -> global shape, offset of this rank's
-- piece (FSDP rows, TP slices: each tensor is read whole, one at a time,
-- and the piece copied), known (the names other ranks hold: a pipeline
-- stage has some of the model).
function M.import(dir, model, opts)
  opts = opts or {}
  local a = model.args
  local cfg_path = fs.join(dir, "config.json")
  if fs.exists(cfg_path) then
    local c = read_config(dir)
    local got = M.args_from_config(c, cfg_path)
    for _, k in ipairs({ { "hidden_size", "dim" }, { "num_hidden_layers", "n_layers" },
      { "num_attention_heads", "n_heads" }, { "num_key_value_heads", "n_kv_heads" }, { "vocab_size", "vocab_size" },
      { "intermediate_size", "ffn_hidden" } }) do
      if got[k[2]] ~= a[k[2]] then
        fail("%s has %s = %s but the model has %s = %s", cfg_path, k[1], tostring(got[k[2]]), k[2], tostring(a[k[2]]))
      end
    end
  end
  local plan = plan_import(dir, a)
  local sd = model:state_dict()
  local mine = {}
  for _, p in ipairs(plan) do
    local name = p.m.titan
    if sd.tensors[name] then
      mine[#mine + 1] = p
    elseif not (opts.known and opts.known[name]) then
      fail("the model has no parameter %s", name)
    end
  end
  autograd.no_grad(function()
    for _, p in ipairs(mine) do
      local dst = sd.tensors[p.m.titan]
      local gshape, off = nil, nil
      if opts.shard_of then gshape, off = opts.shard_of(p.m.titan, dst) end
      if not gshape then
        read_into(p, dst)
      else
        require("titan.memory").scope(function()
          local whole = tensor.empty(gshape, { dtype = dst:dtype() })
          read_into(p, whole)
          local piece = whole
          for d = 1, #gshape do piece = piece:narrow(d, off[d] + 1, dst:size(d)) end
          dst:copy_(piece)
        end)
      end
    end
  end)
  return model
end

-- An HF folder -> a titan checkpoint folder out_dir (model only, step 0,
-- stored in the HF dtype), loadable as checkpoint.initial_load_path.
function M.to_checkpoint(dir, out_dir, opts)
  opts = opts or {}
  local c, cfg_path = read_config(dir)
  local a = M.args_from_config(c, cfg_path)
  if fs.exists(out_dir) then fail("%s already exists; conversion writes a new checkpoint and never replaces one", out_dir) end
  local plan = plan_import(dir, a)
  local items, owned = {}, {}
  for _, p in ipairs(plan) do
    local t = tensor.empty(p.m.shape, { dtype = opts.dtype or p.dtype })
    read_into(p, t)
    items[#items + 1] = { name = p.m.titan, tensor = t }
    owned[#owned + 1] = t
  end
  format.write(out_dir, { items }, { step = 0, model_only = true, train_state = { extra = {}, hf_config = c } })
  for _, t in ipairs(owned) do t:free() end
  return out_dir, a
end

return M
