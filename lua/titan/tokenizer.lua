-- tokenizer.lua — byte-level BPE tokenizers: load (HF tokenizer.json or a
-- tiktoken ranks file), encode, decode, save, and train.
--
--   local Tokenizer = require("titan.tokenizer")
--   local tok = Tokenizer.load("assets/tokenizers/fortunes_2048.json")
--   local ids, n = tok:encode(text, { bos = true, eos = true })   -- int32_t[?] and its length
--   local text = tok:decode(ids, n)                                 -- or tok:decode({ 1, 2, 3 })
--   tok:free()
--
-- Files are parsed here (decisions); the C engine (engine/tokenizer*.c)
-- receives flat arrays and runs the loops over bytes. Memory is C's and is
-- released by tok:free(); ffi.gc only catches a forgotten free.
local cjson = require("cjson")
local tffi = require("titan.ffi")
local ffi, C = tffi.ffi, tffi.C

local M = {}
local Tokenizer = {}
Tokenizer.__index = Tokenizer
M.Tokenizer = Tokenizer

local function check(status)
  if status ~= 0 then error(ffi.string(C.tt_last_error()), 0) end
end

-- The special tokens Meta's llama3 tokenizer.py appends to a tiktoken vocabulary.
function M.llama3_special_tokens()
  local s = { "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|reserved_special_token_4|>", "<|eot_id|>" }
  for i = 5, 250 do s[#s + 1] = "<|reserved_special_token_" .. i .. "|>" end
  return s
end

M.BOS = "<|begin_of_text|>"
M.EOS = "<|end_of_text|>"
-- Other names files use for the same roles (GPT-2, SentencePiece-era models).
local bos_names = { M.BOS, "<s>", "<|startoftext|>" }
local eos_names = { M.EOS, "</s>", "<|endoftext|>" }

-- GPT-2's pre-tokenizer (an HF ByteLevel pre-tokenizer with use_regex = true).
M.GPT2_PATTERN = [['s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+]]

do
  local p = ffi.new("const char*[1]")
  check(C.tt_tokenizer_pattern(nil, p))
  M.LLAMA3_PATTERN = ffi.string(p[0])
end

-- ---- GPT-2's bytes_to_unicode: how tokenizer.json spells token bytes -------

local byte_to_char, char_to_byte = {}, {}
do
  local function utf8(cp)
    if cp < 0x80 then return string.char(cp) end
    return string.char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64) -- every code point here is < 0x800
  end
  local printable = {}
  for b = 33, 126 do printable[b] = true end
  for b = 161, 172 do printable[b] = true end
  for b = 174, 255 do printable[b] = true end
  local n = 0
  for b = 0, 255 do
    local cp = b
    if not printable[b] then
      cp = 256 + n
      n = n + 1
    end
    byte_to_char[string.char(b)] = utf8(cp)
    char_to_byte[utf8(cp)] = string.char(b)
  end
end

local function to_byte_level(bytes) return (bytes:gsub(".", byte_to_char)) end

-- Returns the bytes, or nil and the first character that is not a byte-level one.
local function from_byte_level(s)
  local bad
  local out = s:gsub("[%z\1-\127\192-\255][\128-\191]*", function(c)
    local b = char_to_byte[c]
    if not b then bad = bad or c end
    return b
  end)
  if bad then return nil, bad end
  return out
end

-- ---- reading files -----------------------------------------------------------

local function read_file(path, what)
  local f, err = io.open(path, "rb")
  if not f then
    local reason = tostring(err):match(": ([^:]+)$") or tostring(err) -- io.open repeats the path
    error(("tokenizer: cannot read %s %s: %s"):format(what or "file", path, reason), 0)
  end
  local text = f:read("*a")
  f:close()
  if not text then error(("tokenizer: cannot read %s %s"):format(what or "file", path), 0) end
  return text
end

local function show(s, max)
  max = max or 40
  local t = s:sub(1, max):gsub("[^\32-\126]", function(c) return ("\\x%02x"):format(c:byte()) end)
  if #s > max then t = t .. "..." end
  return t
end

local b64 = {}
do
  local alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
  for i = 1, 64 do b64[alphabet:byte(i)] = i - 1 end
end

-- Strict base64 (padded, as Python's b64decode wants); nil when malformed.
local function base64_decode(s)
  local n = #s
  if n == 0 or n % 4 ~= 0 then return nil end
  local out = {}
  for i = 1, n, 4 do
    local a, b, c, d = s:byte(i, i + 3)
    a, b = b64[a], b64[b]
    if not a or not b then return nil end
    local last = i + 3 == n
    local cv = c == 61 and last and -1 or b64[c]
    local dv = d == 61 and last and -1 or b64[d]
    if not cv or not dv or (cv < 0 and dv >= 0) then return nil end
    local v = ((a * 64 + b) * 64 + math.max(cv, 0)) * 64 + math.max(dv, 0)
    local b1, b2, b3 = math.floor(v / 65536), math.floor(v / 256) % 256, v % 256
    if cv < 0 then
      out[#out + 1] = string.char(b1)
    elseif dv < 0 then
      out[#out + 1] = string.char(b1, b2)
    else
      out[#out + 1] = string.char(b1, b2, b3)
    end
  end
  return table.concat(out)
end

-- tiktoken: one "base64(bytes) rank" per line (Llama 3's tokenizer.model).
local function parse_tiktoken(text, path, opts)
  local tokens, ids = {}, {}
  local seen_rank = {}
  local max_rank = -1
  local pos, lineno = 1, 0
  local len = #text
  while pos <= len do
    local nl = text:find("\n", pos, true) or len + 1
    local line = text:sub(pos, nl - 1):gsub("\r$", "")
    lineno = lineno + 1
    pos = nl + 1
    if line ~= "" then
      local b, r = line:match("^(%S+) (%d+)$")
      local bytes = b and base64_decode(b)
      if not bytes then
        error(("tokenizer: %s:%d: '%s' is not a tiktoken line; expected 'base64(token bytes) rank'"):format(path,
          lineno, show(line)), 0)
      end
      local rank = tonumber(r)
      if seen_rank[rank] then
        error(("tokenizer: %s:%d: rank %d appears twice (first on line %d); expected unique ranks"):format(path,
          lineno, rank, seen_rank[rank]), 0)
      end
      seen_rank[rank] = lineno
      tokens[#tokens + 1] = bytes
      ids[#ids + 1] = rank
      if rank > max_rank then max_rank = rank end
    end
  end
  if #tokens == 0 then error(("tokenizer: %s: no tokens; expected lines 'base64(token bytes) rank'"):format(path), 0) end
  local specials, special_ids = {}, {}
  for i, s in ipairs(opts.special_tokens or M.llama3_special_tokens()) do
    specials[i] = s
    special_ids[i] = max_rank + i -- after the regular vocabulary, as tiktoken numbers them
  end
  return {
    source = path, tokens = tokens, ids = ids, tiktoken = true, ignore_merges = true,
    specials = specials, special_ids = special_ids,
  }
end

local function is_null(v) return v == nil or v == cjson.null end

-- The regex of an HF pre_tokenizer, when it is a byte-level one we implement.
local function hf_pattern(pre, path)
  local function fail(what)
    error(("tokenizer: %s: pre_tokenizer %s; expected a byte-level one (Split with a Regex then ByteLevel, or "
      .. "ByteLevel alone)"):format(path, what), 0)
  end
  if is_null(pre) then fail("is null") end
  if type(pre) ~= "table" then fail("is not an object") end
  local steps = pre.type == "Sequence" and pre.pretokenizers or { pre }
  if type(steps) ~= "table" then fail("Sequence has no pretokenizers list") end
  local pattern, byte_level
  for _, p in ipairs(steps) do
    if type(p) ~= "table" then fail("has a step that is not an object") end
    if p.type == "Split" then
      local rx = type(p.pattern) == "table" and p.pattern.Regex
      if type(rx) ~= "string" then fail("Split has no Regex pattern") end
      if p.behavior ~= nil and p.behavior ~= "Isolated" then fail("Split behavior is '" .. tostring(p.behavior) .. "'") end
      if p.invert == true then fail("Split is inverted") end
      if pattern then fail("has two Split steps") end
      pattern = rx
    elseif p.type == "ByteLevel" then
      byte_level = true
      if p.add_prefix_space == true then fail("ByteLevel adds a prefix space") end
      if p.use_regex ~= false then
        if pattern then fail("has a Split and a ByteLevel with use_regex") end
        pattern = M.GPT2_PATTERN
      end
    else
      fail("type is '" .. tostring(p.type) .. "'")
    end
  end
  if not byte_level then fail("has no ByteLevel step") end
  -- ByteLevel with use_regex = false and no Split: the text is one piece.
  return pattern or [[(?s).+]]
end

-- HF tokenizer.json with a BPE model.
local function parse_hf(text, path)
  local ok, doc = pcall(cjson.decode, text)
  if not ok then
    local msg = tostring(doc):gsub("^.-:%d+: ", "")
    error(("tokenizer: %s: malformed JSON (%s); expected an HF tokenizer.json"):format(path, msg), 0)
  end
  local function fail(fmt, ...) error(("tokenizer: %s: " .. fmt):format(path, ...), 0) end
  if type(doc) ~= "table" or type(doc.model) ~= "table" then
    fail("no \"model\" object; expected an HF tokenizer.json with a BPE model")
  end
  local model = doc.model
  if model.type ~= nil and model.type ~= "BPE" then fail("model.type is '%s'; expected 'BPE'", tostring(model.type)) end
  if type(model.vocab) ~= "table" then fail("model.vocab is missing; expected an object of token -> id") end
  if type(model.merges) ~= "table" then fail("model.merges is missing; expected a list of merges") end
  for _, k in ipairs({ "continuing_subword_prefix", "end_of_word_suffix" }) do
    if not is_null(model[k]) and model[k] ~= "" then fail("model.%s is set; byte-level BPE has none", k) end
  end
  if not is_null(doc.normalizer) then
    fail("has a normalizer (%s); expected none (byte-level BPE sees the raw bytes)",
      tostring(type(doc.normalizer) == "table" and doc.normalizer.type))
  end
  local pattern = hf_pattern(doc.pre_tokenizer, path)

  local tokens, ids, by_name = {}, {}, {}
  for name, id in pairs(model.vocab) do
    if type(name) ~= "string" or type(id) ~= "number" or id < 0 or id % 1 ~= 0 then
      fail("model.vocab entry '%s': %s; expected token -> non-negative integer id", show(tostring(name)), tostring(id))
    end
    local bytes, bad = from_byte_level(name)
    if not bytes then
      fail("model.vocab token '%s' has '%s', not a byte-level character; expected GPT-2 bytes_to_unicode spelling",
        show(name), show(bad))
    end
    tokens[#tokens + 1] = bytes
    ids[#ids + 1] = id
    by_name[name] = id
  end
  -- pairs() order is not fixed: sort by id so building is deterministic.
  local order = {}
  for i = 1, #ids do order[i] = i end
  table.sort(order, function(a, b) return ids[a] < ids[b] end)
  local stokens, sids = {}, {}
  for i, k in ipairs(order) do
    stokens[i], sids[i] = tokens[k], ids[k]
  end

  local merges = {}
  for i, m in ipairs(model.merges) do
    local a, b
    if type(m) == "string" then
      a, b = m:match("^(%S+) (%S+)$")
    elseif type(m) == "table" and type(m[1]) == "string" and type(m[2]) == "string" and m[3] == nil then
      a, b = m[1], m[2]
    end
    if not a then
      fail("model.merges[%d] is %s; expected \"left right\" or [\"left\", \"right\"]", i,
        type(m) == "string" and ("'" .. show(m) .. "'") or type(m))
    end
    local l, r = by_name[a], by_name[b]
    if not l or not r then fail("model.merges[%d] names '%s', which is not in model.vocab", i, show(l and b or a)) end
    merges[#merges + 1] = { l, r }
  end

  local specials, special_ids, named = {}, {}, {}
  if not is_null(doc.added_tokens) then
    if type(doc.added_tokens) ~= "table" then fail("added_tokens is not a list") end
    for i, t in ipairs(doc.added_tokens) do
      if type(t) ~= "table" or type(t.content) ~= "string" or type(t.id) ~= "number" then
        fail("added_tokens[%d] has no content or id; expected {\"id\": N, \"content\": \"...\"}", i)
      end
      named[t.content] = t.id
      -- GPT-2 keeps <|endoftext|> in the vocabulary as well: one token, not two.
      if model.vocab[to_byte_level(t.content)] ~= t.id then
        specials[#specials + 1] = t.content
        special_ids[#special_ids + 1] = t.id
      end
    end
  end
  return {
    source = path, pattern = pattern, tokens = stokens, ids = sids, merges = merges,
    ignore_merges = model.ignore_merges == true, specials = specials, special_ids = special_ids, named = named,
  }
end

-- ---- building ----------------------------------------------------------------

local function int32s(list)
  local a = ffi.new("int32_t[?]", #list + 1)
  for i = 1, #list do a[i - 1] = list[i] end
  return a
end

local function lens_of(list)
  local a = ffi.new("int32_t[?]", #list + 1)
  for i = 1, #list do a[i - 1] = #list[i] end
  return a
end

local function wrap(ptr, extra)
  local self = setmetatable({ _c = ffi.gc(ptr, C.tt_tokenizer_free) }, Tokenizer)
  local d = ffi.new("tt_tokenizer_desc")
  check(C.tt_tokenizer_describe(ptr, d))
  self.vocab_size = d.vocab_size
  self.bos_id = d.bos_id >= 0 and d.bos_id or nil
  self.eos_id = d.eos_id >= 0 and d.eos_id or nil
  self.n_merges = d.n_merges
  self.max_token_len = d.max_token_len
  self.ignore_merges = d.ignore_merges ~= 0
  local p = ffi.new("const char*[1]")
  check(C.tt_tokenizer_pattern(ptr, p))
  self.pattern = ffi.string(p[0])
  for k, v in pairs(extra or {}) do self[k] = v end
  return self
end

local function find_named(names, lookup)
  for _, n in ipairs(names) do
    if lookup[n] then return lookup[n] end
  end
  return -1
end

-- From Lua tables (what the parsers produce, or hand-made vocabularies):
--   tokens = { bytes, ... }, ids = { id, ... } (default 0, 1, ...),
--   merges = { { left_id, right_id }, ... } (lowest rank first) or tiktoken = true,
--   specials = { text, ... }, special_ids = { id, ... } (default: after the tokens),
--   pattern (default Llama 3), ignore_merges, source (for messages).
function M.new(spec)
  local tokens = spec.tokens or {}
  local ids = spec.ids
  if not ids then
    ids = {}
    for i = 1, #tokens do ids[i] = i - 1 end
  end
  local specials = spec.specials or {}
  local special_ids = spec.special_ids
  if not special_ids then
    local top = -1
    for _, id in ipairs(ids) do top = math.max(top, id) end
    special_ids = {}
    for i = 1, #specials do special_ids[i] = top + i end
  end
  local named = {}
  for k, v in pairs(spec.named or {}) do named[k] = v end
  for i, s in ipairs(specials) do named[s] = special_ids[i] end
  local flat_merges = {}
  for i, m in ipairs(spec.merges or {}) do
    flat_merges[2 * i - 1], flat_merges[2 * i] = m[1], m[2]
  end
  -- The C side reads these during the call only; the locals keep them alive.
  local token_bytes, special_bytes, source = table.concat(tokens), table.concat(specials), spec.source or ""
  local token_lens, token_ids, merges = lens_of(tokens), int32s(ids), int32s(flat_merges)
  local special_lens, special_id_arr = lens_of(specials), int32s(special_ids)
  local s = ffi.new("tt_tokenizer_spec")
  s.source = source
  s.pattern = spec.pattern
  s.n_tokens = #tokens
  s.token_bytes = ffi.cast("const uint8_t *", token_bytes)
  s.token_lens = token_lens
  s.token_ids = token_ids
  s.tiktoken = spec.tiktoken and 1 or 0
  s.n_merges = #flat_merges / 2
  s.merges = merges
  s.n_specials = #specials
  s.special_bytes = ffi.cast("const uint8_t *", special_bytes)
  s.special_lens = special_lens
  s.special_ids = special_id_arr
  s.bos_id = spec.bos_id or find_named(bos_names, named)
  s.eos_id = spec.eos_id or find_named(eos_names, named)
  s.ignore_merges = spec.ignore_merges and 1 or 0
  local out = ffi.new("tt_tokenizer*[1]")
  local st = C.tt_tokenizer_new(s, out)
  local _ = { token_bytes, special_bytes, source, spec.pattern, token_lens, token_ids, merges, special_lens,
    special_id_arr }
  check(st)
  return wrap(out[0], { source = spec.source })
end

-- Load a tokenizer.json (HF) or a tiktoken ranks file, told apart by content.
-- opts.special_tokens replaces the Llama 3 specials a tiktoken file gets.
function M.load(path, opts)
  opts = opts or {}
  if type(path) ~= "string" then error("tokenizer: load expects a file path, got " .. type(path), 0) end
  local text = read_file(path, "tokenizer file")
  local first = text:match("^%s*(.)")
  local spec
  if first == "{" then
    spec = parse_hf(text, path)
  elseif text:match("^[A-Za-z0-9+/]+=*[ ]%d+\r?\n") or text:match("^[A-Za-z0-9+/]+=*[ ]%d+$") then
    spec = parse_tiktoken(text, path, opts)
  else
    error(("tokenizer: %s is %s; expected an HF tokenizer.json (a JSON object) or a tiktoken ranks file "
      .. "(lines 'base64(token bytes) rank')"):format(path, #text == 0 and "empty" or "not a tokenizer file"), 0)
  end
  return M.new(spec)
end

-- ---- the tokenizer object ------------------------------------------------------

local function handle(self)
  local c = self._c
  if c == nil then error("tokenizer: used after free()", 3) end
  return c
end

local nout = ffi.new("int64_t[1]")

-- ids (int32_t[?], at least n long) and n. opts.bos / opts.eos add
-- <|begin_of_text|> / <|end_of_text|>; special-token text inside str is
-- encoded as plain text.
function Tokenizer:encode(str, opts)
  local c = handle(self)
  if type(str) ~= "string" then error("tokenizer: encode expects a string, got " .. type(str), 2) end
  local bos = opts and opts.bos and 1 or 0
  local eos = opts and opts.eos and 1 or 0
  local cap = #str + 2
  local ids = ffi.new("int32_t[?]", cap)
  check(C.tt_tokenizer_encode(c, str, #str, bos, eos, ids, cap, nout))
  return ids, tonumber(nout[0])
end

function Tokenizer:encode_table(str, opts)
  local ids, n = self:encode(str, opts)
  local t = {}
  for i = 1, n do t[i] = ids[i - 1] end
  return t
end

local decode_buf, decode_cap = nil, 0
local nbytes = ffi.new("size_t[1]")

-- ids: an int32_t array with its length n, or a Lua table of ids.
function Tokenizer:decode(ids, n)
  local c = handle(self)
  if type(ids) == "table" then
    n = n or #ids
    local a = ffi.new("int32_t[?]", n + 1)
    for i = 1, n do a[i - 1] = ids[i] end
    ids = a
  elseif type(ids) == "cdata" then
    if not n then error("tokenizer: decode of an ffi array needs its length n", 2) end
  else
    error("tokenizer: decode expects a table of ids or an int32_t array and n, got " .. type(ids), 2)
  end
  check(C.tt_tokenizer_decode_length(c, ids, n, nbytes))
  local len = tonumber(nbytes[0])
  if len > decode_cap then
    decode_cap = math.max(len, 2 * decode_cap, 4096)
    decode_buf = ffi.new("char[?]", decode_cap)
  end
  check(C.tt_tokenizer_decode(c, ids, n, decode_buf, decode_cap, nbytes))
  return ffi.string(decode_buf, len)
end

-- The bytes of one token and whether it is special.
function Tokenizer:token(id)
  local c = handle(self)
  local p, len, sp = ffi.new("const uint8_t*[1]"), ffi.new("int32_t[1]"), ffi.new("int32_t[1]")
  check(C.tt_tokenizer_token(c, id, p, len, sp))
  return ffi.string(p[0], len[0]), sp[0] ~= 0
end

-- Pre-tokenizer pieces of str (a list of strings): for inspection and tests.
function Tokenizer:split(str)
  local c = handle(self)
  local ends = ffi.new("int64_t[?]", #str + 1)
  check(C.tt_tokenizer_split(c, str, #str, ends, #str + 1, nout))
  local out, start = {}, 0
  for i = 0, tonumber(nout[0]) - 1 do
    local e = tonumber(ends[i])
    out[#out + 1] = str:sub(start + 1, e)
    start = e
  end
  return out
end

function Tokenizer:free()
  if self._c ~= nil then
    local c = self._c
    self._c = nil
    ffi.gc(c, nil)
    C.tt_tokenizer_free(c)
  end
end

function Tokenizer:__tostring()
  return ("Tokenizer(vocab_size=%d, merges=%d, bos_id=%s, eos_id=%s%s)"):format(self.vocab_size, self.n_merges,
    tostring(self.bos_id), tostring(self.eos_id), self.source and (", source=" .. self.source) or "")
end

-- ---- saving as HF tokenizer.json -------------------------------------------------

local function js(s) return cjson.encode(s) end

-- The "post_processor" line of tokenizer.json: null, or HF tokenizers'
-- TemplateProcessing with BOS before each sequence (Llama 3's layout).
local function post_processor(self, add_bos)
  if not (add_bos and self.bos_id) then return '  "post_processor": null,' end
  local bos = js(self:token(self.bos_id))
  local function special(type_id) return ('{"SpecialToken": {"id": %s, "type_id": %d}}'):format(bos, type_id) end
  local function seq(id, type_id) return ('{"Sequence": {"id": "%s", "type_id": %d}}'):format(id, type_id) end
  return table.concat({
    '  "post_processor": {',
    '    "type": "TemplateProcessing",',
    ('    "single": [%s, %s],'):format(special(0), seq("A", 0)),
    ('    "pair": [%s, %s, %s, %s],'):format(special(0), seq("A", 0), special(1), seq("B", 1)),
    ('    "special_tokens": {%s: {"id": %s, "ids": [%d], "tokens": [%s]}}'):format(bos, bos, self.bos_id, bos),
    '  },',
  }, "\n")
end

-- The JSON text of this tokenizer, written in a fixed order (the same
-- tokenizer always gives the same bytes). opts.add_bos: a post_processor
-- that puts the BOS token in front of every encoding, as Llama 3's own
-- tokenizer.json does (Titan trains on BOS + document + EOS and encodes
-- prompts with BOS; Titan's loader ignores post_processor, callers say bos).
-- Merges are "left right" strings, never [left, right] pairs: HF tokenizers
-- reads strings in every version, pairs only from 0.20 (0.15-0.19, which
-- transformers up to 4.44 pins, refuse them with "data did not match any
-- variant of untagged enum ModelWrapper"). A byte-level name never holds a
-- space (the space byte is spelled "Ġ"), so the string splits back exactly.
function Tokenizer:to_json(opts)
  opts = opts or {}
  local c = handle(self)
  local p, len, sp = ffi.new("const uint8_t*[1]"), ffi.new("int32_t[1]"), ffi.new("int32_t[1]")
  local names, added = {}, {}
  for id = 0, self.vocab_size - 1 do
    if C.tt_tokenizer_token(c, id, p, len, sp) == 0 then
      local bytes = ffi.string(p[0], len[0])
      if sp[0] ~= 0 then
        added[#added + 1] = ('    {"id": %d, "content": %s, "single_word": false, "lstrip": false, "rstrip": false, '
          .. '"normalized": false, "special": true}'):format(id, js(bytes))
      else
        names[id] = to_byte_level(bytes)
      end
    end
  end
  C.tt_clear_error()
  local vocab = {}
  for id = 0, self.vocab_size - 1 do
    if names[id] then vocab[#vocab + 1] = ("      %s: %d"):format(js(names[id]), id) end
  end
  local merges = {}
  local l, r, m = ffi.new("int32_t[1]"), ffi.new("int32_t[1]"), ffi.new("int32_t[1]")
  for i = 0, self.n_merges - 1 do
    check(C.tt_tokenizer_merge(c, i, l, r, m))
    merges[#merges + 1] = ("      %s"):format(js(names[l[0]] .. " " .. names[r[0]]))
  end
  local out = {
    '{',
    '  "version": "1.0",',
    '  "truncation": null,',
    '  "padding": null,',
    '  "added_tokens": [',
    table.concat(added, ",\n"),
    '  ],',
    '  "normalizer": null,',
    '  "pre_tokenizer": {',
    '    "type": "Sequence",',
    '    "pretokenizers": [',
    ('      {"type": "Split", "pattern": {"Regex": %s}, "behavior": "Isolated", "invert": false},'):format(
      js(self.pattern)),
    '      {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}',
    '    ]',
    '  },',
    post_processor(self, opts.add_bos),
    '  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},',
    '  "model": {',
    '    "type": "BPE",',
    '    "dropout": null,',
    '    "unk_token": null,',
    '    "continuing_subword_prefix": null,',
    '    "end_of_word_suffix": null,',
    '    "fuse_unk": false,',
    '    "byte_fallback": false,',
    ('    "ignore_merges": %s,'):format(self.ignore_merges and "true" or "false"),
    '    "vocab": {',
    table.concat(vocab, ",\n"),
    '    },',
    '    "merges": [',
    table.concat(merges, ",\n"),
    '    ]',
    '  }',
    '}',
    '',
  }
  if #added == 0 then table.remove(out, 6) end
  if #merges == 0 then table.remove(out, #out - 4) end
  return table.concat(out, "\n")
end

-- Write tokenizer.json; a temporary name then a rename, so a failed write
-- never leaves a half file under the final name.
function Tokenizer:save(path)
  local text = self:to_json()
  local tmp = path .. ".tmp"
  local f, err = io.open(tmp, "wb")
  if not f then error(("tokenizer: cannot write %s: %s"):format(tmp, tostring(err)), 0) end
  local ok, werr = f:write(text)
  f:close()
  if not ok then
    os.remove(tmp)
    error(("tokenizer: cannot write %s: %s"):format(tmp, tostring(werr)), 0)
  end
  local rok, rerr = os.rename(tmp, path)
  if not rok then
    os.remove(tmp)
    error(("tokenizer: cannot rename %s to %s: %s"):format(tmp, path, tostring(rerr)), 0)
  end
end

-- ---- training ----------------------------------------------------------------------

-- A fortune file (fortune(6)) has its strfile index next to it.
function M.is_fortune_file(path)
  local f = io.open(path .. ".dat", "rb")
  if f then f:close() end
  return f ~= nil
end

-- The text of a fortune file: lines holding only '%' separate the entries
-- and are not text.
function M.fortune_text(text)
  local t, n = "\n" .. text, 0
  repeat t, n = t:gsub("\n%%\r?\n", "\n") until n == 0
  t = t:gsub("\n%%\r?$", "\n")
  return t:sub(2)
end

local function mb(n) return ("%.1f MB"):format(n / 1e6) end

-- Train a byte-level BPE. opts:
--   vocab_size   every token counted: 256 bytes + merges + specials (required)
--   files        paths (fortune files lose their '%' lines; opts.fortune = true/false forces it)
--   texts        strings (in addition to files)
--   specials     default { "<|begin_of_text|>", "<|end_of_text|>" }
--   pattern      default the Llama 3 pattern
--   progress     a file (io.stderr) to report on, or nil; progress_tty: whether it is a terminal
--                (default: asked), else whole lines every ten seconds, no \r
function M.train(opts)
  local specials = opts.specials or { M.BOS, M.EOS }
  local vocab = tonumber(opts.vocab_size)
  local floor = 256 + #specials
  if not vocab or vocab % 1 ~= 0 or vocab < floor then
    error(("tokenizer: vocab size %s is too small; expected at least %d (256 bytes + %d special tokens)"):format(
      tostring(opts.vocab_size), floor, #specials), 0)
  end
  local log = opts.progress
  local tty = opts.progress_tty
  if tty == nil then tty = log ~= nil and require("titan.data.progress").is_tty(log) end
  local t0 = os.clock()
  local function say(fmt, ...) if log then log:write(fmt:format(...)) end end

  local tr_out = ffi.new("tt_tokenizer_trainer*[1]")
  check(C.tt_tokenizer_trainer_new(opts.pattern, tr_out))
  local tr = ffi.gc(tr_out[0], C.tt_tokenizer_trainer_free)
  local function done_with(err)
    ffi.gc(tr, nil)
    C.tt_tokenizer_trainer_free(tr)
    if err then error(err, 0) end
  end
  local ok, err = pcall(function()
    local files = opts.files or {}
    if #files > 0 then
      local total = 0
      for _, path in ipairs(files) do
        local f, e = io.open(path, "rb")
        if not f then
          error(("tokenizer: cannot read training file %s: %s"):format(path, tostring(e):match(": ([^:]+)$") or e), 0)
        end
        total = total + (f:seek("end") or 0)
        f:close()
      end
      say("tokenizer: reading %s from %d file%s\n", mb(total), #files, #files == 1 and "" or "s")
    end
    for _, path in ipairs(files) do
      local text = read_file(path, "training file")
      local fortune = opts.fortune
      if fortune == nil then fortune = M.is_fortune_file(path) end
      if fortune then text = M.fortune_text(text) end
      check(C.tt_tokenizer_trainer_add(tr, text, #text))
    end
    for _, text in ipairs(opts.texts or {}) do check(C.tt_tokenizer_trainer_add(tr, text, #text)) end
  end)
  if not ok then done_with(err) end

  local stats = ffi.new("tt_tokenizer_train_stats")
  check(C.tt_tokenizer_trainer_stats(tr, stats))
  say("tokenizer: %s of text, %d pieces, %d unique (%.1f s)\n", mb(tonumber(stats.bytes)), tonumber(stats.pieces),
    tonumber(stats.unique_pieces), os.clock() - t0)

  local want = vocab - #specials -- regular tokens
  local done = ffi.new("int32_t[1]")
  local last_report, last_len = -1, 0
  ok, err = pcall(function()
    while true do
      check(C.tt_tokenizer_trainer_stats(tr, stats))
      local have = stats.tokens
      local now = os.clock()
      if log and (now - last_report >= (tty and 0.1 or 10) or have >= want) then
        last_report = now
        local line = ("tokenizer: merges %d, tokens %d/%d (%3d%%), last pair seen %d times, %.1f s"):format(
          stats.merges, have + #specials, vocab, math.floor(100 * (have - 256) / math.max(want - 256, 1)),
          tonumber(stats.last_count), now - t0)
        if tty then
          say("\r%s%s", line, (" "):rep(math.max(0, last_len - #line))) -- in place, over a longer previous line
        else
          say("%s\n", line)
        end
        last_len = #line
      end
      if have >= want then break end
      -- One merge adds at most one token: never overshoots the target.
      check(C.tt_tokenizer_trainer_merge(tr, math.min(want - have, 64), done))
      if done[0] == 0 then break end -- no pair left: the corpus is exhausted
    end
  end)
  if not ok then done_with(err) end
  if tty then say("\n") end
  if stats.tokens < want then
    say("tokenizer: the text has no pair left to merge; vocabulary is %d, not %d\n", stats.tokens + #specials, vocab)
  end
  local bos_i, eos_i = -1, -1
  for i, s in ipairs(specials) do
    for _, n in ipairs(bos_names) do if s == n and bos_i < 0 then bos_i = i - 1 end end
    for _, n in ipairs(eos_names) do if s == n and eos_i < 0 then eos_i = i - 1 end end
  end
  local out = ffi.new("tt_tokenizer*[1]")
  local sbytes, slens = table.concat(specials), lens_of(specials)
  local st = C.tt_tokenizer_trainer_finish(tr, #specials, ffi.cast("const uint8_t *", sbytes), slens, bos_i, eos_i, out)
  local _ = { sbytes, slens }
  local result = { merges = tonumber(stats.merges), bytes = tonumber(stats.bytes), pieces = tonumber(stats.pieces),
    unique_pieces = tonumber(stats.unique_pieces), seconds = os.clock() - t0 }
  done_with()
  check(st)
  return wrap(out[0]), result
end

return M
