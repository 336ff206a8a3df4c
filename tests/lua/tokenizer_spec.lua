-- Tokenizers: the shipped fortunes tokenizer, exact round trips (the whole
-- fortunes corpus, fuzzed bytes), tiktoken and HF tokenizer.json loading
-- (both merge spellings; written as strings), save, trainer determinism,
-- the CLI, HF tokenizers reading Titan's files (Python, when installed), bad input.
local cjson = require("cjson")
local env = require("titan.env")
local Tokenizer = require("titan.tokenizer")

local root = env.root
local exe = env.build_dir .. "/titan"
local shipped = root .. "/assets/tokenizers/fortunes_2048.json"
local FORTUNES = "/usr/share/games/fortunes"

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

local function write(path, text)
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
  return path
end

local tmpdir = os.tmpname()
os.remove(tmpdir)
os.execute("mkdir -p '" .. tmpdir .. "'")
local function tmp(name) return tmpdir .. "/" .. name end

local run = dofile("tests/lua/shell.lua").run

local function err_of(fn)
  local ok, err = pcall(fn)
  assert.is_false(ok, "expected an error")
  return tostring(err)
end

local function assert_mentions(msg, ...)
  for i = 1, select("#", ...) do
    local s = select(i, ...)
    assert(msg:find(s, 1, true), ("error message %q does not mention %q"):format(msg, s))
  end
  assert.is_nil(msg:find("\n"), "one line: " .. msg)
end

local b64chars = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
local function base64(s)
  local out = {}
  for i = 1, #s, 3 do
    local a, b, c = s:byte(i, i + 2)
    local v = a * 65536 + (b or 0) * 256 + (c or 0)
    local q = {}
    for k = 3, 0, -1 do
      local x = math.floor(v / 64 ^ k) % 64
      q[#q + 1] = b64chars:sub(x + 1, x + 1)
    end
    if not b then q[3], q[4] = "=", "=" elseif not c then q[4] = "=" end
    out[#out + 1] = table.concat(q)
  end
  return table.concat(out)
end

-- GPT-2's bytes_to_unicode, written independently of the module's.
local function byte_level(s)
  local map = {}
  local n = 0
  for b = 0, 255 do
    local keep = (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or (b >= 174)
    local cp = keep and b or 256 + n
    if not keep then n = n + 1 end
    map[b] = cp < 128 and string.char(cp) or string.char(0xC0 + math.floor(cp / 64), 0x80 + cp % 64)
  end
  return (s:gsub(".", function(c) return map[c:byte()] end))
end

local function fortune_files()
  local files = {}
  local p = io.popen("find " .. FORTUNES .. " -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' 2>/dev/null | LC_ALL=C sort")
  for line in p:lines() do files[#files + 1] = line end
  p:close()
  return files
end

local function ids_of(tok, s, opts)
  local ids, n = tok:encode(s, opts)
  local t = {}
  for i = 0, n - 1 do t[#t + 1] = ids[i] end
  return t
end

-- A tiny vocabulary: the 256 bytes (id = byte), then ab, bc, abc.
local function tiny_hf(merges, extra)
  local vocab = {}
  for b = 0, 255 do vocab[#vocab + 1] = ("%s: %d"):format(cjson.encode(byte_level(string.char(b))), b) end
  vocab[#vocab + 1] = '"ab": 256'
  vocab[#vocab + 1] = '"bc": 257'
  vocab[#vocab + 1] = '"abc": 258'
  return ([[{"version": "1.0", "added_tokens": [
    {"id": 259, "content": "<|begin_of_text|>", "special": true},
    {"id": 260, "content": "<|end_of_text|>", "special": true}],
  "normalizer": null,
  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": %s}, "behavior": "Isolated", "invert": false},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]},
  "decoder": {"type": "ByteLevel"},
  "model": {"type": "BPE"%s, "vocab": {%s}, "merges": %s}}]]):format(cjson.encode(Tokenizer.LLAMA3_PATTERN),
    extra or "", table.concat(vocab, ", "), merges)
end

describe("tokenizer", function()
  local tok
  setup(function() tok = Tokenizer.load(shipped) end)
  teardown(function()
    if tok then tok:free() end
    os.execute("rm -rf '" .. tmpdir .. "'")
  end)

  it("loads the shipped tokenizer: 2048 tokens, specials after the vocabulary", function()
    assert.are.equal(2048, tok.vocab_size)
    assert.are.equal(2046, tok.bos_id)
    assert.are.equal(2047, tok.eos_id)
    assert.are.equal(1790, tok.n_merges)
    assert.are.same({ "<|begin_of_text|>", true }, { tok:token(2046) })
    assert.are.same({ "<|end_of_text|>", true }, { tok:token(2047) })
    local ids, n = tok:encode("Hello world, said the fortune cookie.", { bos = true, eos = true })
    assert.are.equal("cdata", type(ids))
    assert.are.equal(2046, ids[0])
    assert.are.equal(2047, ids[n - 1])
    assert.is_true(n < 20)
    local t = tok:encode_table("Hello world, said the fortune cookie.", { bos = true, eos = true })
    assert.are.equal(n, #t)
    for i = 1, n do assert.are.equal(ids[i - 1], t[i]) end
    assert.are.equal("<|begin_of_text|>Hello world, said the fortune cookie.<|end_of_text|>", tok:decode(ids, n))
    assert.are.equal("<|begin_of_text|>Hello world, said the fortune cookie.<|end_of_text|>", tok:decode(t))
    local e, ne = tok:encode("")
    assert.are.equal(0, ne)
    assert.are.equal("", tok:decode(e, ne))
    assert.are.equal("", tok:decode({}))
  end)

  it("pre-tokenizes with the Llama 3 pattern (Unicode letters and numbers)", function()
    assert.are.same({ "Hello", " world", "123", "456", " don", "'t" }, tok:split("Hello world123456 don't"))
    assert.are.same({ "I", "'M", " here", ",", " YOU", "'LL", " see" }, tok:split("I'M here, YOU'LL see"))
    assert.are.same({ "naïve", " café" }, tok:split("naïve café"))
    assert.are.same({ "Привет", " мир" }, tok:split("Привет мир"))
    assert.are.same({ "٣٤٥", "٦", "x", "½²" }, tok:split("٣٤٥٦x½²"))
    assert.are.same({ "hello", "\n\n", "world" }, tok:split("hello\n\nworld"))
    assert.are.same({ "a", " ", " b" }, tok:split("a  b"))
    assert.are.same({ "ab", "\255\254", " cd" }, tok:split("ab\255\254 cd"))
  end)

  it("treats special-token text inside ordinary text as plain text", function()
    local t = ids_of(tok, "a<|end_of_text|>b")
    for _, id in ipairs(t) do assert.is_true(id < 2046) end
    assert.are.equal("a<|end_of_text|>b", tok:decode(t))
  end)

  local files = fortune_files()
  if #files == 0 then
    pending("round-trips every fortunes file: skipped, " .. FORTUNES .. " is absent (apt-get install fortunes)")
  else
    it("round-trips every fortunes file of the corpus exactly (" .. #files .. " files)", function()
      local bytes, tokens = 0, 0
      for _, path in ipairs(files) do
        local text = read(path)
        local ids, n = tok:encode(text)
        for i = 0, n - 1 do
          if ids[i] < 0 or ids[i] >= 2046 then error(("%s: id %d at %d"):format(path, ids[i], i)) end
        end
        local back = tok:decode(ids, n)
        if back ~= text then error("round trip differs for " .. path) end
        bytes, tokens = bytes + #text, tokens + n
      end
      -- the tokenizer was trained on this text: well under half a token per byte
      assert.is_true(tokens < bytes * 0.45, ("%d tokens for %d bytes"):format(tokens, bytes))
    end)
  end

  it("round-trips fuzzed byte strings exactly (invalid UTF-8, NULs, long runs)", function()
    math.randomseed(20240611)
    local pieces = { "the", " ", "\n", "\0", "\255", "\192", "\128\128", "é", "日本", "😀", "'s", "123", "<|end_of_text|>",
      "\r\n", "\t", "%", "\226\130", "\237\160\128" }
    local function gen(kind, n)
      local t = {}
      for i = 1, n do
        if kind == 1 then
          t[i] = string.char(math.random(0, 255))
        elseif kind == 2 then
          t[i] = pieces[math.random(#pieces)]
        else
          t[i] = string.char(math.random(128, 255))
        end
      end
      return table.concat(t)
    end
    local cases = { (" "):rep(20000), ("\n"):rep(5000), ("\255"):rep(5000), ("a"):rep(10000), ("9"):rep(999),
      ("\0"):rep(100), (" \t"):rep(3000) .. "x", ("ab"):rep(4000) }
    for i = 1, 600 do cases[#cases + 1] = gen(i % 3 + 1, math.random(0, 300)) end
    for i, s in ipairs(cases) do
      local ids, n = tok:encode(s)
      local back = tok:decode(ids, n)
      if back ~= s then error(("case %d (%d bytes) does not round-trip"):format(i, #s)) end
    end
  end)

  it("loads a tiktoken ranks file (Llama 3 specials after the ranks)", function()
    local lines = {}
    for b = 0, 255 do lines[#lines + 1] = base64(string.char(b)) .. " " .. b end
    lines[#lines + 1] = base64("ab") .. " 256"
    lines[#lines + 1] = base64("bc") .. " 257"
    lines[#lines + 1] = base64("abc") .. " 258"
    local path = write(tmp("tiny.tiktoken"), table.concat(lines, "\n") .. "\n")
    local t = Tokenizer.load(path)
    assert.are.equal(259 + 256, t.vocab_size)
    assert.are.equal(259, t.bos_id)
    assert.are.equal(260, t.eos_id)
    assert.are.same({ "<|eot_id|>", true }, { t:token(259 + 9) })
    assert.are.same({ 258 }, ids_of(t, "abc"))          -- ab (rank 256) first, then ab + c
    assert.are.same({ 257, 256 }, ids_of(t, "bcab"))
    assert.are.same({ 259, 256, 32, 257, 260 }, ids_of(t, "ab bc", { bos = true, eos = true }))
    assert.are.equal("<|begin_of_text|>ab bc<|end_of_text|>", t:decode(ids_of(t, "ab bc", { bos = true, eos = true })))
    t:free()
    -- chosen specials instead of Llama 3's
    t = Tokenizer.load(path, { special_tokens = { "<|begin_of_text|>", "<|end_of_text|>" } })
    assert.are.equal(261, t.vocab_size)
    t:free()
  end)

  it("a tiktoken file of the shipped vocabulary encodes the corpus as its tokenizer.json does", function()
    local lines = {}
    for id = 0, 2045 do lines[#lines + 1] = base64((tok:token(id))) .. " " .. id end
    local t = Tokenizer.load(write(tmp("fortunes.tiktoken"), table.concat(lines, "\n") .. "\n"),
      { special_tokens = { "<|begin_of_text|>", "<|end_of_text|>" } })
    assert.are.equal(2048, t.vocab_size)
    local text = #files > 0 and read(files[1]) or "The quick brown fox jumps over the lazy dog. " .. ("don't "):rep(9)
    assert.are.same(ids_of(tok, text), ids_of(t, text))
    -- and saving it writes a tokenizer.json that loads
    t:save(tmp("from_tiktoken.json"))
    local t2 = Tokenizer.load(tmp("from_tiktoken.json"))
    assert.are.equal(2048, t2.vocab_size)
    assert.is_true(t2.ignore_merges)
    assert.are.equal(text, t2:decode(ids_of(t2, text)))
    t:free()
    t2:free()
  end)

  it("loads HF merges both as \"a b\" strings and as [\"a\", \"b\"] pairs", function()
    local a = Tokenizer.load(write(tmp("pairs.json"), tiny_hf('[["b", "c"], ["a", "b"], ["a", "bc"]]')))
    local b = Tokenizer.load(write(tmp("strings.json"), tiny_hf('["b c", "a b", "a bc"]')))
    for _, t in ipairs({ a, b }) do
      assert.are.equal(261, t.vocab_size)
      assert.are.equal(259, t.bos_id)
      assert.are.equal(260, t.eos_id)
      assert.are.same({ 258 }, ids_of(t, "abc")) -- bc first (rank 0), then a + bc
      assert.are.same({ 256, 256 }, ids_of(t, "abab"))
    end
    a:free()
    b:free()
    -- rank order decides: with ab first and no ab + c merge, "abc" stays two tokens
    local c = Tokenizer.load(write(tmp("order.json"), tiny_hf('["a b", "b c", "a bc"]')))
    assert.are.same({ 256, 99 }, ids_of(c, "abc"))
    c:free()
    -- ignore_merges takes a piece that is a token whole
    local d = Tokenizer.load(write(tmp("ignore.json"), tiny_hf('["a b"]', ', "ignore_merges": true')))
    assert.are.same({ 258 }, ids_of(d, "abc"))
    d:free()
    -- the shipped file with its merges rewritten as pairs encodes the same
    local doc = cjson.decode(read(shipped))
    for i, m in ipairs(doc.model.merges) do doc.model.merges[i] = { m:match("^(%S+) (%S+)$") } end
    local e = Tokenizer.load(write(tmp("shipped_pairs.json"), cjson.encode(doc)))
    local text = "Whenever you find yourself on the side of the majority, it is time to pause and reflect."
    assert.are.same(ids_of(tok, text), ids_of(e, text))
    e:free()
  end)

  it("writes merges as \"left right\" strings, the form every HF tokenizers version reads", function()
    -- (HF tokenizers 0.15-0.19, which transformers up to 4.44 pins, refuse
    -- [left, right] pairs: "data did not match any variant of untagged enum ModelWrapper")
    local function check(text, n, what)
      local merges = cjson.decode(text).model.merges
      assert.are.equal(n, #merges, what)
      for i, m in ipairs(merges) do
        if type(m) ~= "string" or not m:match("^%S+ %S+$") then
          error(("%s: merges[%d] is %s, expected a \"left right\" string"):format(what, i, cjson.encode(m)))
        end
      end
    end
    check(read(shipped), 1790, "the shipped file")
    check(tok:to_json(), 1790, "to_json")
    check(tok:to_json({ add_bos = true }), 1790, "to_json (add_bos)")
    -- a file read with pairs is written with strings, and reads back as the same tokenizer
    local a = Tokenizer.load(write(tmp("pairs_in.json"), tiny_hf('[["b", "c"], ["a", "b"], ["a", "bc"]]')))
    a:save(tmp("strings_out.json"))
    check(read(tmp("strings_out.json")), 3, "saved from pairs")
    local b = Tokenizer.load(tmp("strings_out.json"))
    for _, s in ipairs({ "abc", "abab", "bcab c" }) do assert.are.same(ids_of(a, s), ids_of(b, s), s) end
    a:free()
    b:free()
    -- what `titan tokenizer train` writes
    local text = write(tmp("form.txt"), ("The early bird gets the worm; the second mouse gets the cheese.\n"):rep(20))
    local o, rc = run(("%s tokenizer train --vocab 280 --out %s %s"):format(exe, tmp("form.json"), text))
    assert.are.equal(0, rc, o)
    check(read(tmp("form.json")), 280 - 256 - 2, "titan tokenizer train")
  end)

  it("saves the same bytes it loaded, and frees deterministically", function()
    tok:save(tmp("saved.json"))
    assert.are.equal(read(shipped), read(tmp("saved.json")))
    local t = Tokenizer.load(tmp("saved.json"))
    t:free()
    t:free() -- a second free is a no-op
    assert_mentions(err_of(function() t:encode("x") end), "after free")
  end)

  it("trains deterministically: same text, same file; file order does not matter", function()
    local a = write(tmp("a.txt"), ("It was the best of times, it was the worst of times; 1234567 ideas.\n"):rep(30))
    local b = write(tmp("b.txt"), "Fortune favours the bold.\n%\nThe early bird gets the worm.\n%\n%\nÜber naïve café.\n%")
    write(tmp("b.txt.dat"), "") -- a strfile index next to it: b.txt is a fortune file
    local function train(out, x, y)
      local o, rc = run(("%s tokenizer train --vocab 300 --out %s %s %s"):format(exe, out, x, y))
      assert.are.equal(0, rc, o)
      assert.truthy(o:find("tokenizer: reading", 1, true), o)
      assert.truthy(o:find("tokenizer: wrote", 1, true), o)
      return read(out)
    end
    local j1 = train(tmp("t1.json"), a, b)
    local j2 = train(tmp("t2.json"), a, b)
    local j3 = train(tmp("t3.json"), b, a)
    -- a tokenizer file already there (checkpoints depend on it) is refused, untouched; --force replaces it
    write(tmp("t1.json"), "not a tokenizer")
    local o, rc = run(("%s tokenizer train --vocab 300 --out %s %s"):format(exe, tmp("t1.json"), a))
    assert.are.equal(1, rc, o)
    assert.truthy(o:find("titan: tokenizer: train: " .. tmp("t1.json") .. " exists; pass --force to replace it", 1,
      true), o)
    assert.are.equal("not a tokenizer", read(tmp("t1.json")))
    o, rc = run(("%s tokenizer train --vocab 300 --force --out %s %s %s"):format(exe, tmp("t1.json"), a, b))
    assert.are.equal(0, rc, o)
    assert.are.equal(j1, read(tmp("t1.json")))
    assert.are.equal(j1, j2)
    assert.are.equal(j1, j3)
    local t = Tokenizer.load(tmp("t1.json"))
    assert.are.equal(300, t.vocab_size)
    assert.are.equal(298, t.bos_id)
    assert.are.equal(299, t.eos_id)
    assert.are.equal(t:decode(ids_of(t, read(a))), read(a))
    t:free()
    -- the API gives the same file
    local t4 = Tokenizer.train({ vocab_size = 300, files = { a, b } })
    t4:save(tmp("t4.json"))
    assert.are.equal(j1, read(tmp("t4.json")))
    t4:free()
    -- progress: in place on a terminal; whole lines, no carriage return, in a log
    local function progress_of(tty)
      local k = { text = {} }
      function k:write(...) for _, x in ipairs({ ... }) do self.text[#self.text + 1] = x end end
      function k:flush() end
      Tokenizer.train({ vocab_size = 300, files = { a, b }, progress = k, progress_tty = tty }):free()
      return table.concat(k.text)
    end
    local on_tty, in_log = progress_of(true), progress_of(false)
    assert.truthy(on_tty:find("\rtokenizer: merges %d+, tokens 300/300"), on_tty)
    assert.falsy(in_log:find("\r", 1, true), in_log)
    assert.truthy(in_log:find("\ntokenizer: merges %d+, tokens 300/300 %(100%%%)[^\n]*\n$"), in_log)
    -- '%' separator lines are not text
    assert.are.equal("Fortune favours the bold.\nThe early bird gets the worm.\nÜber naïve café.\n",
      Tokenizer.fortune_text(read(b)))
    assert.are.equal("a\nb\n", Tokenizer.fortune_text("%\na\n%\n%\nb\n%\n"))
  end)

  it("the CLI encodes, decodes and describes", function()
    local out, rc = run(exe .. " tokenizer --help")
    assert.are.equal(0, rc)
    assert.truthy(out:find("titan tokenizer train --vocab N", 1, true))
    out, rc = run(("%s tokenizer encode --tokenizer %s --bos 'Hello world'"):format(exe, shipped))
    assert.are.equal(0, rc, out)
    local want = table.concat(ids_of(tok, "Hello world", { bos = true }), " ")
    assert.are.equal(want .. "\n", out)
    out, rc = run(("%s tokenizer decode --tokenizer %s %s"):format(exe, shipped, want))
    assert.are.equal(0, rc, out)
    assert.are.equal("<|begin_of_text|>Hello world", out)
    -- no TEXT (or --file -): standard input, as a pipe gives it
    out, rc = run(("printf 'Hello world' | %s tokenizer encode --tokenizer %s --bos"):format(exe, shipped))
    assert.are.equal(0, rc, out)
    assert.are.equal(want .. "\n", out)
    out, rc = run(("printf 'Hello world' | %s tokenizer encode --tokenizer %s --bos --file -"):format(exe, shipped))
    assert.are.equal(want .. "\n", out)
    out, rc = run(exe .. " tokenizer train --help") -- a command's --help is the usage, not an unknown option
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("titan tokenizer train --vocab N", 1, true), out)
    out, rc = run(("%s tokenizer encode --tokenizer %s --pieces 'Hello world'"):format(exe, shipped))
    assert.are.equal(0, rc, out)
    local _, lines = out:gsub("\n", "")
    assert.are.equal(#ids_of(tok, "Hello world"), lines)
    assert.truthy(out:find("\t world\n", 1, true), out)
    out, rc = run(("%s tokenizer info --tokenizer %s"):format(exe, shipped))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("vocab_size    2048", 1, true), out)
  end)

  -- The Python side (tests/reference/tokenizer_file_check.py, with
  -- TITAN_HF_PYTHON as tests/lua/hf_spec.lua): HF tokenizers reads the
  -- shipped file and what `titan tokenizer train` writes, and encodes as
  -- Titan does, special-token text inside a text included (split as
  -- plain text: tokenizers' encode_special_tokens, transformers'
  -- split_special_tokens, which HF exports set; docs/tokenizer.md).
  it("HF tokenizers (Python) loads Titan's files and encodes texts as Titan does", function()
    local python = os.getenv("TITAN_HF_PYTHON") or "/usr/bin/python3"
    local q = dofile("tests/lua/shell.lua").quote
    local o, rc = run(q(python) .. " -c 'import json'")
    if rc ~= 0 then return pending(python .. " does not run: " .. o) end
    local text = write(tmp("py.txt"), ("Fortune favours the bold; the early bird gets the worm.\n"):rep(20))
    o, rc = run(("%s tokenizer train --vocab 300 --out %s %s"):format(exe, tmp("py.json"), text))
    assert.are.equal(0, rc, o)
    local texts = { "Hello world", "  two spaces, tabs\tand\nnew lines\n", "ünïcödé — “quotes” 😀", "1234567 it's",
      "a<|end_of_text|>b", "<|begin_of_text|>Title\n\nBody <|end_of_text|> more<|end_of_text|>",
      "not quite <|end_of_text| nor <|endoftext|>" }
    local files = { shipped, tmp("py.json") }
    write(tmp("py_cases.json"), cjson.encode({ files = files, texts = texts }))
    o, rc = run(("%s %s %s %s"):format(q(python), q(root .. "/tests/reference/tokenizer_file_check.py"),
      q(tmp("py_cases.json")), q(tmp("py_report.json"))))
    assert.are.equal(0, rc, o)
    local report = cjson.decode(read(tmp("py_report.json")))
    if not report.available then
      return pending(("python tokenizers is not importable by %s (%s); install it with: python3 -m venv /opt/hfvenv && "
        .. "/opt/hfvenv/bin/pip install tokenizers, then run with TITAN_HF_PYTHON=/opt/hfvenv/bin/python"):format(
        python, tostring(report.error)))
    end
    for i, f in ipairs(report.files) do
      if f.error ~= cjson.null then
        error(("tokenizers %s cannot read %s: %s"):format(report.version, files[i], tostring(f.error)))
      end
      local t = Tokenizer.load(files[i])
      for k, s in ipairs(texts) do
        assert.are.same(ids_of(t, s), f.ids[k], ("tokenizers %s, %s: %q"):format(report.version, files[i], s))
      end
      t:free()
    end
  end)

  it("bad input fails with one line naming the file and what was expected", function()
    local missing = tmp("nope.json")
    assert_mentions(err_of(function() Tokenizer.load(missing) end), missing, "cannot read")
    local text = read(shipped)
    local cut = write(tmp("truncated.json"), text:sub(1, math.floor(#text / 2)))
    assert_mentions(err_of(function() Tokenizer.load(cut) end), cut, "malformed JSON", "expected an HF tokenizer.json")
    local bad = write(tmp("malformed.json"), '{"model": {"type": "BPE", "vocab": {"a": 0,}}}')
    assert_mentions(err_of(function() Tokenizer.load(bad) end), bad, "malformed JSON")
    local nomodel = write(tmp("nomodel.json"), '{"version": "1.0"}')
    assert_mentions(err_of(function() Tokenizer.load(nomodel) end), nomodel, "no \"model\" object")
    local wp = write(tmp("wordpiece.json"), '{"model": {"type": "WordPiece", "vocab": {}}}')
    assert_mentions(err_of(function() Tokenizer.load(wp) end), wp, "model.type is 'WordPiece'", "expected 'BPE'")
    local unknown = write(tmp("unknown_merge.json"), tiny_hf('["a b", "x zz"]'))
    assert_mentions(err_of(function() Tokenizer.load(unknown) end), unknown, "model.merges[2]", "'zz'")
    local badmerge = write(tmp("bad_merge.json"), tiny_hf('[42]'))
    assert_mentions(err_of(function() Tokenizer.load(badmerge) end), badmerge, "model.merges[1]")
    local nobytes = write(tmp("nobytes.json"), tiny_hf("[]"):gsub('"Ā": 0, ', ""))
    assert_mentions(err_of(function() Tokenizer.load(nobytes) end), nobytes, "byte 0x00", "all 256")
    local notbl = write(tmp("not_byte_level.json"), (tiny_hf("[]"):gsub('"ab": 256', '"a b": 256')))
    assert_mentions(err_of(function() Tokenizer.load(notbl) end), notbl, "not a byte-level character")
    local meta = write(tmp("metaspace.json"), (tiny_hf("[]"):gsub('"pre_tokenizer": {', '"pre_tokenizer": {"type": "Metaspace"}, "x": {')))
    assert_mentions(err_of(function() Tokenizer.load(meta) end), meta, "pre_tokenizer type is 'Metaspace'")
    local lines = {}
    for b = 0, 255 do lines[#lines + 1] = base64(string.char(b)) .. " " .. b end
    lines[3] = "this is not base64"
    local tt = write(tmp("bad.tiktoken"), table.concat(lines, "\n"))
    assert_mentions(err_of(function() Tokenizer.load(tt) end), tt .. ":3:", "expected 'base64(token bytes) rank'")
    lines[3] = base64("\2") .. " 1" -- rank 1 again
    write(tt, table.concat(lines, "\n"))
    assert_mentions(err_of(function() Tokenizer.load(tt) end), tt .. ":3:", "rank 1 appears twice")
    local short = write(tmp("short.tiktoken"), base64("a") .. " 0\n" .. base64("b") .. " 1\n")
    assert_mentions(err_of(function() Tokenizer.load(short) end), short, "no token for the byte 0x00")
    local wrong = write(tmp("model.safetensors"), "\8\0\0\0\0\0\0\0{}\0\0\0\0\0\0\0\0binary")
    assert_mentions(err_of(function() Tokenizer.load(wrong) end), wrong, "not a tokenizer file",
      "expected an HF tokenizer.json")
    local empty = write(tmp("empty.json"), "")
    assert_mentions(err_of(function() Tokenizer.load(empty) end), empty, "is empty")
    assert_mentions(err_of(function() tok:decode({ 1, 2, 5000 }) end), "5000", "not in the vocabulary")
    assert_mentions(err_of(function() Tokenizer.train({ vocab_size = 100, texts = { "x" } }) end), "at least 258")
    -- the CLI: exit status 1 and one line
    local out, rc = run(("%s tokenizer encode --tokenizer %s hello"):format(exe, cut))
    assert.are.equal(1, rc)
    assert_mentions((out:gsub("\n$", "")), "titan: tokenizer: " .. cut, "malformed JSON")
    out, rc = run(("%s tokenizer train --vocab 300 %s"):format(exe, missing))
    assert.are.equal(1, rc)
    assert_mentions((out:gsub("\n$", "")), missing)
    out, rc = run(exe .. " tokenizer frobnicate")
    assert.are.equal(1, rc)
    assert_mentions((out:gsub("\n$", "")), "unknown command 'frobnicate'")
  end)
end)
