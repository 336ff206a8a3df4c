-- Datasets and the loader (lua/titan/data*): packing, formats, binary files,
-- shuffling, sharding, resume, validation split, mixtures, bad input, CLI.
local titan = require("titan")
local data = require("titan.data")
local cjson = require("cjson")
local ffi = require("ffi")
local env = require("titan.env")

-- A byte-level stand-in tokenizer: each byte is its own id, BOS 256, EOS 257.
local Byte = { vocab_size = 258, bos_id = 256, eos_id = 257 }
function Byte:encode(s, o)
  o = o or {}
  local n = #s + (o.bos and 1 or 0) + (o.eos and 1 or 0)
  local ids = ffi.new("int32_t[?]", math.max(n, 1))
  local k = 0
  if o.bos then ids[0], k = 256, 1 end
  for i = 1, #s do ids[k], k = s:byte(i), k + 1 end
  if o.eos then ids[k] = 257 end
  return ids, n
end
function Byte:encode_table(s)
  local ids, n = self:encode(s)
  local t = {}
  for i = 0, n - 1 do t[i + 1] = ids[i] end
  return t
end
function Byte:decode(ids, n)
  local out = {}
  for i = 0, (n or #ids) - 1 do
    local v = ids[i]
    if v < 256 then out[#out + 1] = string.char(v) end
  end
  return table.concat(out)
end

-- ---- helpers ------------------------------------------------------------------

local dir = io.popen("mktemp -d /tmp/titan_data_spec_XXXXXX"):read("*l")
local function path(name) return dir .. "/" .. name end
local function write(name, text)
  local f = assert(io.open(path(name), "wb"))
  f:write(text)
  f:close()
  return path(name)
end
local function read(p)
  local f = assert(io.open(p, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

-- Byte ids of a string with BOS/EOS markers: B("<ab>") = {256, 97, 98, 257}.
local function B(s)
  local t = {}
  for i = 1, #s do
    local c = s:sub(i, i)
    t[#t + 1] = c == "<" and 256 or c == ">" and 257 or c:byte()
  end
  return t
end

local function window_of(ds)
  local buf = ffi.new("int32_t[?]", ds.seq_len + 1)
  local ok, id, part = ds:next_window(buf)
  if not ok then return nil end
  local t = {}
  for i = 0, ds.seq_len do t[i + 1] = buf[i] end
  return t, id, part
end

-- All windows of one epoch of a finite dataset: list of {id, tokens}.
local function epoch(ds)
  local out = {}
  while true do
    local w, id = window_of(ds)
    if not w then return out end
    out[#out + 1] = { id = id, tokens = w }
  end
end

-- The next n batches as plain tables (inside a scope: tensors freed).
local function batches(loader, n)
  return titan.scope(function()
    local out = {}
    for i = 1, n do
      local b = loader:next()
      if not b then break end
      out[i] = { inputs = b.inputs:tolist(), targets = b.targets:tolist() }
    end
    return out
  end)
end

-- Twenty small documents with distinct names, in fortune format.
local function fortune_corpus(name, first, count)
  local parts = {}
  for d = first, first + count - 1 do
    parts[#parts + 1] = ("doc%02d says %s\n"):format(d, ("xyz"):rep(d % 4 + 1))
  end
  return write(name, table.concat(parts, "%\n") .. "%\n")
end

local corpus_a = fortune_corpus("corpus_a", 0, 12)
local corpus_b = write("corpus_b.txt", "line one of b\nline two of b\n\nline three, after a blank\n")
local corpus_c = fortune_corpus("corpus_c", 12, 8)
local corpus = { corpus_a, corpus_b, corpus_c }
local bin = path("order.bin")
data.prepare({ inputs = corpus, tokenizer = Byte, out = bin, quiet = true })

describe("titan.data", function()
  teardown(function() os.execute("rm -rf '" .. dir .. "'") end)

  describe("data: packing and formats", function()
    it("packs documents with BOS/EOS into windows of seq_len + 1 that share one token", function()
      local p = write("tiny.txt", "ab\ncd e\n\nf\n")
      local ds = data.TextDataset(p, Byte, { seq_len = 3, infinite = false })
      -- stream: <ab> <cd e> <f>  = 13 tokens -> 4 windows at 0, 3, 6, 9
      local w = epoch(ds)
      assert.are.same({ B("<ab>"), B("><cd"), B("d e>"), B("><f>") },
        { w[1].tokens, w[2].tokens, w[3].tokens, w[4].tokens })
      assert.are.equal(4, #w)
      assert.are.same({ 0, 1, 2, 3 }, { w[1].id, w[2].id, w[3].id, w[4].id })
      -- the loader: inputs = window[1..T], targets = window[2..T+1]
      local loader = data.Loader(data.TextDataset(p, Byte, { seq_len = 3 }), { batch_size = 2 })
      titan.scope(function()
        local b = loader:next()
        assert.are.equal("int64", b.inputs:dtype())
        assert.are.same({ 2, 3 }, b.inputs:shape())
        assert.are.same({ B("<ab"), B("><c") }, b.inputs:tolist())
        assert.are.same({ B("ab>"), B("<cd") }, b.targets:tolist())
        b = loader:next()
        assert.are.same({ B("d e"), B("><f") }, b.inputs:tolist())
        assert.are.same({ B(" e>"), B("<f>") }, b.targets:tolist())
        -- an infinite dataset starts the next epoch at the first document
        b = loader:next()
        assert.are.same({ B("<ab"), B("><c") }, b.inputs:tolist())
      end)
      loader:close()
      -- without BOS/EOS
      local plain = epoch(data.TextDataset(p, Byte, { seq_len = 2, bos = false, eos = false, infinite = false }))
      assert.are.same({ B("abc"), B("cd "), B(" ef") }, { plain[1].tokens, plain[2].tokens, plain[3].tokens })
    end)

    it("reads lines, paragraphs, fortune entries, whole files and JSONL as documents", function()
      local function docs(p, fmt)
        local r = data.Documents.new(p, { format = fmt })
        local out = {}
        while true do
          local text = r:next()
          if not text then break end
          out[#out + 1] = text
        end
        r:close()
        return out
      end
      local text = write("fmt.txt", "one\ntwo two\n\n\nthree\r\nfour\n")
      assert.are.same({ "one", "two two", "three", "four" }, docs(text, "auto"))
      assert.are.same({ "one\ntwo two", "three\nfour" }, docs(text, "paragraphs"))
      assert.are.same({ "one\ntwo two\n\n\nthree\r\nfour" }, docs(text, "file"))
      local fort = write("fmt_fortune", "A saying.\n%\nTwo\n  lines.\n%\n%\n   \n%\nLast, no final %\n")
      assert.are.same({ "A saying.", "Two\n  lines.", "Last, no final %" }, docs(fort, "auto"))
      local jl = write("fmt.jsonl", '{"text": "hi there"}\n\n{"id": 2, "text": "second\\ndoc"}\n{"text": ""}\n{"text":"end"}')
      assert.are.same({ "hi there", "second\ndoc", "end" }, docs(jl, "auto"))
      local other = write("fmt_field.jsonl", '{"body": "x1"}\n{"body": "x2"}\n')
      local r = data.Documents.new(other, { field = "body" })
      assert.are.equal("x1", r:next())
      r:close()
    end)

    it("tokenizes JSONL documents on the fly", function()
      local p = write("small.jsonl", '{"text": "ab"}\n{"meta": 1, "text": "c"}\n\n{"text": "   "}\n{"text": "de"}\n')
      local w = epoch(data.TextDataset(p, Byte, { seq_len = 4, infinite = false }))
      -- <ab><c><de> = 11 tokens -> windows at 0, 4 (8 + 5 > 11)
      assert.are.same({ B("<ab><"), B("<c><d") }, { w[1].tokens, w[2].tokens })
      assert.are.equal(2, #w)
    end)

    it("seeks back to any document it handed out", function()
      local r = data.Documents.new(corpus)
      local seen = {}
      while true do
        local text, pos = r:next()
        if not text then break end
        seen[#seen + 1] = { text = text, pos = pos }
      end
      assert.are.equal(12 + 3 + 8, #seen)
      for _, i in ipairs({ 1, 5, 12, 13, 14, 15, 16, 23 }) do
        r:seek(seen[i].pos)
        local text, pos = r:next()
        assert.are.equal(seen[i].text, text)
        assert.are.same(seen[i].pos, pos)
      end
      r:close()
    end)
  end)

  describe("data: binary token files", function()
    it("round-trips through prepare and gives the same batches as tokenizing on the fly", function()
      local out, vout = path("rt.bin"), path("rt_val.bin")
      local r = data.prepare({ inputs = corpus, tokenizer = Byte, out = out, val_out = vout, val_fraction = 0.2, quiet = true })
      local f = data.TokenFile.open(out)
      assert.are.same({ version = 1, token_bytes = 2, dtype = "uint16", num_tokens = r.train.tokens,
        num_docs = r.train.docs, vocab_size = 258, header_bytes = 64 }, f.header)
      assert.are.equal(64 + 2 * r.train.tokens, #read(out))
      assert.are.equal(23, r.train.docs + r.val.docs)
      assert.are.equal(4, r.val.docs) -- floor(23 * 0.2)
      -- the first document, as BOS + bytes + EOS
      assert.are.same(B("<doc00 says xyz>"), f:read_table(0, 16))
      titan.scope(function()
        local t = f:read(1, 5)
        assert.are.equal("int64", t:dtype())
        assert.are.same(B("doc00"), t:tolist())
      end)
      f:close()
      -- same windows, same batches, over several epochs, for 1 and 2 ranks
      for _, world in ipairs({ 1, 2 }) do
        for rank = 0, world - 1 do
          for _, sp in ipairs({ "train", "val" }) do
            local o = { seq_len = 7, rank = rank, world = world, split = sp, val_fraction = 0.2, infinite = true }
            local text = data.Loader(data.TextDataset(corpus, Byte, o), { batch_size = 3 })
            local bin = data.Loader(data.TokenDataset(sp == "train" and out or vout,
              { seq_len = 7, rank = rank, world = world, infinite = true }), { batch_size = 3 })
            local a, b = batches(text, 25), batches(bin, 25)
            assert.are.equal(25, #a)
            assert.are.same(a, b)
            text:close()
            bin:close()
          end
        end
      end
    end)

    it("reads several files (shards) as one dataset; windows do not cross files", function()
      local s1, s2 = path("shard1.bin"), path("shard2.bin")
      data.prepare({ inputs = { corpus_a }, tokenizer = Byte, out = s1, quiet = true })
      data.prepare({ inputs = { corpus_b, corpus_c }, tokenizer = Byte, out = s2, quiet = true })
      local function tokens_of(list)
        local t = {}
        for _, w in ipairs(list) do t[#t + 1] = w.tokens end
        return t
      end
      local expected = tokens_of(epoch(data.TextDataset(corpus_a, Byte, { seq_len = 6, infinite = false })))
      for _, w in ipairs(epoch(data.TextDataset({ corpus_b, corpus_c }, Byte, { seq_len = 6, infinite = false }))) do
        expected[#expected + 1] = w.tokens
      end
      local both = data.open({ s1, s2 }, { seq_len = 6, infinite = false })
      assert.are.equal(#expected, both.num_windows)
      assert.are.same(expected, tokens_of(epoch(both)))
      -- shuffled and sharded over 3 ranks: still every window once
      local seen = {}
      for rank = 0, 2 do
        local ds = data.TokenDataset({ s1, s2 }, { seq_len = 6, shuffle = true, seed = 2, rank = rank, world = 3,
          infinite = false })
        for _, w in ipairs(epoch(ds)) do
          assert.is_nil(seen[w.id])
          seen[w.id] = true
          assert.are.same(expected[w.id + 1], w.tokens)
        end
      end
      for i = 0, #expected - 1 do assert.is_true(seen[i]) end
    end)

    it("writes 4-byte tokens for vocabularies past 65536, and nothing under the final name on failure", function()
      local Big = setmetatable({ vocab_size = 70000 }, { __index = Byte })
      local p = path("big.bin")
      data.prepare({ inputs = { corpus_b }, tokenizer = Big, out = p, quiet = true })
      local f = data.TokenFile.open(p)
      assert.are.equal("uint32", f.header.dtype)
      assert.are.same(B("<line one of b>"), f:read_table(0, 15))
      f:close()
      -- a tokenizer that produces an id outside its vocabulary: refused, no file
      local Small = setmetatable({ vocab_size = 100 }, { __index = Byte })
      local bad = path("bad_vocab.bin")
      local ok, err = pcall(data.prepare, { inputs = { corpus_b }, tokenizer = Small, out = bad, quiet = true })
      assert.is_false(ok)
      assert.truthy(err:find("outside the vocabulary [0, 100)", 1, true), err)
      assert.is_nil(io.open(bad, "rb"))
      local leftovers = io.popen("ls " .. dir .. " | grep -c 'bad_vocab.bin.tmp' || true"):read("*a")
      assert.are.equal("0", leftovers:match("%d+"))
    end)

    local function sink()
      local k = { text = {} }
      function k:write(...) for _, s in ipairs({ ... }) do self.text[#self.text + 1] = s end end
      function k:flush() end
      return k
    end

    it("prints progress in place on a terminal while preparing", function()
      local k = sink()
      data.prepare({ inputs = corpus, tokenizer = Byte, out = path("progress.bin"), progress = k, progress_tty = true })
      local s = table.concat(k.text)
      assert.truthy(s:find("\rtokenizing: ", 1, true), s)
      assert.truthy(s:find("MB") and s:find("tokens/s") and s:find("100%%"), s)
      assert.are.equal("\n", s:sub(-1))
    end)

    -- A log file or CI: no carriage returns (a log of in-place redraws reads
    -- as one endless line), whole lines at most every ten seconds, the last
    -- one with the totals.
    it("prints whole lines, no carriage returns, when the output is not a terminal", function()
      local k = sink()
      data.prepare({ inputs = corpus, tokenizer = Byte, out = path("progress_log.bin"), progress = k })
      local s = table.concat(k.text)
      assert.falsy(s:find("\r", 1, true), s)
      assert.truthy(s:find("^tokenizing: [^\n]*100%%[^\n]*\n$"), s) -- one line: the run is short
      assert.is_false(data.Progress.is_tty(k))
    end)
  end)

  describe("data: order, shards, resume", function()
    it("a seeded permutation is a bijection and reproducible from (seed, epoch)", function()
      for _, n in ipairs({ 1, 2, 3, 10, 257, 1000, 4097 }) do
        local p = data.random.permutation(n, 7, 0)
        local seen, count = {}, 0
        for i = 0, n - 1 do
          local j = p(i)
          assert.truthy(j >= 0 and j < n and not seen[j])
          seen[j], count = true, count + 1
        end
        assert.are.equal(n, count)
      end
      local function order(seed, ep)
        local p, t = data.random.permutation(50, seed, ep), {}
        for i = 0, 49 do t[i + 1] = p(i) end
        return t
      end
      assert.are.same(order(1, 0), order(1, 0))
      assert.are_not.same(order(1, 0), order(2, 0))
      assert.are_not.same(order(1, 0), order(1, 1))
      local ident = {}
      for i = 0, 49 do ident[i + 1] = i end
      assert.are_not.same(ident, order(1, 0))
    end)

    it("shuffles window order per epoch, reproducibly from the seed", function()
      local function ids(seed, epochs)
        local ds = data.TokenDataset(bin, { seq_len = 5, shuffle = true, seed = seed, infinite = false })
        local all = {}
        for e = 1, epochs do
          local t = {}
          for _, w in ipairs(epoch(ds)) do t[#t + 1] = w.id end
          all[e] = t
        end
        return all
      end
      local a, b, c = ids(11, 2), ids(11, 2), ids(12, 2)
      assert.are.same(a, b)
      assert.are_not.same(a[1], c[1])
      assert.are_not.same(a[1], a[2]) -- each epoch has its own order
      local sorted = {}
      for i, v in ipairs(a[1]) do sorted[i] = v end
      table.sort(sorted)
      for i, v in ipairs(sorted) do assert.are.equal(i - 1, v) end
      -- a shuffled window holds the tokens at its start
      local ds = data.TokenDataset(bin, { seq_len = 5, shuffle = true, seed = 11 })
      local f = data.TokenFile.open(bin)
      for _ = 1, 10 do
        local w, id = window_of(ds)
        assert.are.same(f:read_table(id * 5, 6), w)
      end
      f:close()
    end)

    it("gives each rank a disjoint share; the shares cover every window (world 1, 2, 3)", function()
      local function check(make, name)
        local whole = {}
        for _, w in ipairs(epoch(make(0, 1))) do whole[w.id] = w.tokens end
        local n = 0
        for _ in pairs(whole) do n = n + 1 end
        assert.truthy(n > 10, name)
        for _, world in ipairs({ 1, 2, 3 }) do
          local owner = {}
          for rank = 0, world - 1 do
            local mine = epoch(make(rank, world))
            -- shares differ by at most one window
            assert.truthy(#mine == math.floor(n / world) or #mine == math.ceil(n / world), name)
            for _, w in ipairs(mine) do
              assert.is_nil(owner[w.id], ("%s: window %d read by ranks %s and %d"):format(name, w.id,
                tostring(owner[w.id]), rank))
              owner[w.id] = rank
              assert.are.same(whole[w.id], w.tokens)
            end
          end
          for id in pairs(whole) do assert.is_not_nil(owner[id], name .. ": window " .. id .. " read by no rank") end
        end
      end
      check(function(rank, world)
        return data.TokenDataset(bin, { seq_len = 6, rank = rank, world = world, shuffle = true, seed = 5, infinite = false })
      end, "binary, shuffled")
      check(function(rank, world)
        return data.TextDataset(corpus, Byte, { seq_len = 6, rank = rank, world = world, infinite = false })
      end, "text")
    end)

    it("restores loader state exactly: the batches after a restore are the uninterrupted ones", function()
      local makers = {
        text = function()
          return data.TextDataset(corpus, Byte, { seq_len = 9, rank = 1, world = 2 })
        end,
        jsonl = function()
          local lines = {}
          for d = 1, 30 do lines[d] = cjson.encode({ text = ("json doc %d %s"):format(d, ("q"):rep(d % 7)) }) end
          return data.TextDataset(write("resume.jsonl", table.concat(lines, "\n")), Byte, { seq_len = 8 })
        end,
        binary_shuffled = function()
          return data.TokenDataset(bin, { seq_len = 9, shuffle = true, seed = 3, rank = 0, world = 3 })
        end,
        mixture = function()
          return data.Mixture({
            { data.TextDataset(corpus, Byte, { seq_len = 5, split = "train", val_fraction = 0.1 }), 2 },
            { data.TokenDataset(bin, { seq_len = 5, shuffle = true, seed = 9 }), 1 },
          }, 42)
        end,
        shuffle_buffer = function()
          return data.ShuffleBuffer(data.TextDataset(corpus, Byte, { seq_len = 6 }), { size = 7, seed = 4 })
        end,
      }
      for name, make in pairs(makers) do
        -- stop at several points: mid-document, across the end of an epoch
        for _, before in ipairs({ 0, 1, 3, 11, 17 }) do
          local first = data.Loader(make(), { batch_size = 2 })
          batches(first, before)
          local saved = cjson.decode(cjson.encode(first:state_dict())) -- as a checkpoint stores it
          local expected = batches(first, 12)
          local resumed = data.Loader(make(), { batch_size = 2 })
          resumed:load_state_dict(saved)
          assert.are.same(expected, batches(resumed, 12), name .. " after " .. before .. " batches")
          assert.are.equal(before + 12, resumed.batches)
          first:close()
          resumed:close()
        end
      end
    end)

    it("refuses a state saved under another layout", function()
      local a = data.TokenDataset(bin, { seq_len = 9, rank = 0, world = 2 })
      local b = data.TokenDataset(bin, { seq_len = 9, rank = 0, world = 4 })
      local ok, err = pcall(b.load_state_dict, b, a:state_dict())
      assert.is_false(ok)
      assert.truthy(err:find("world = 2, this dataset has world = 4", 1, true), err)
      assert.truthy(err:find("start the data anew with --checkpoint.exclude_from_loading=dataloader)", 1, true), err)
      local t = data.TextDataset(corpus, Byte, { seq_len = 9 })
      ok, err = pcall(t.load_state_dict, t, a:state_dict())
      assert.truthy(not ok and err:find("expected a saved 'text' dataset state", 1, true), err)
    end)
  end)

  describe("data: validation split", function()
    -- The document names a split's windows contain (windows are read in
    -- order, so their inputs concatenate to the stream).
    local function doc_names(ds)
      local parts = {}
      for _, w in ipairs(epoch(ds)) do
        for i = 1, ds.seq_len do
          local v = w.tokens[i]
          parts[#parts + 1] = v < 256 and string.char(v) or "|"
        end
      end
      local names = {}
      for n in table.concat(parts):gmatch("doc(%d%d)") do names[tonumber(n)] = true end
      return names
    end

    it("holds out every (1/f)-th document of text, disjoint from training", function()
      local train = doc_names(data.TextDataset({ corpus_a, corpus_c }, Byte,
        { seq_len = 4, val_fraction = 0.25, split = "train", infinite = false }))
      local val = doc_names(data.TextDataset({ corpus_a, corpus_c }, Byte,
        { seq_len = 4, val_fraction = 0.25, split = "val" }))
      local nval = 0
      for d = 0, 19 do
        local held = data.split.is_val_doc(d, 0.25)
        if held then nval = nval + 1 end
        -- the last document may fall in the dropped tail of its stream
        if d < 19 then
          assert.are.equal(held, val[d] == true, "doc " .. d)
          assert.are.equal(not held, train[d] == true, "doc " .. d)
        end
        assert.is_false(train[d] == true and val[d] == true)
      end
      assert.are.equal(5, nval)
      -- a finite val dataset ends its pass, then starts over
      local v = data.TextDataset({ corpus_a, corpus_c }, Byte, { seq_len = 4, val_fraction = 0.25, split = "val" })
      local n1, n2 = #epoch(v), #epoch(v)
      assert.are.equal(n1, n2)
      assert.truthy(n1 > 0)
    end)

    it("holds out the tail of a binary file, disjoint from training", function()
      local f = data.TokenFile.open(bin)
      local n = f:len()
      f:close()
      local train = data.TokenDataset(bin, { seq_len = 5, split = "train", val_fraction = 0.1, infinite = false })
      local val = data.TokenDataset(bin, { seq_len = 5, split = "val", val_fraction = 0.1 })
      local cut = n - math.floor(n * 0.1 + 0.5)
      local last_train, first_val = -1, math.huge
      for _, w in ipairs(epoch(train)) do last_train = math.max(last_train, (train:window_start(w.id)) + 5) end
      for _, w in ipairs(epoch(val)) do first_val = math.min(first_val, (val:window_start(w.id))) end
      assert.truthy(last_train < cut and first_val >= cut, ("%d %d %d"):format(last_train, cut, first_val))
      assert.are.equal(math.floor((cut - 1) / 5), train.num_windows)
      assert.are.equal(math.floor((n - cut - 1) / 5), val.num_windows)
    end)

    it("data.loaders builds the train and validation loaders", function()
      local train, val = data.loaders({ paths = bin, seq_len = 8, batch_size = 4, val_fraction = 0.1, shuffle = true,
        seed = 1 })
      local tb, vb = batches(train, 2), batches(val, 1000)
      assert.are.equal(2, #tb)
      assert.truthy(#vb >= 1)
      train:close()
      val:close()
      local ttrain, tval = data.loaders({ paths = corpus, tokenizer = Byte, seq_len = 8, batch_size = 4,
        val_fraction = 0.2, shuffle = true, shuffle_buffer = 5 })
      assert.are.equal("shuffle_buffer", ttrain:state_dict().dataset.kind)
      assert.are.equal(2, #batches(ttrain, 2))
      assert.truthy(#batches(tval, 1000) >= 1)
    end)
  end)

  describe("data: mixture", function()
    it("honors the weights approximately over many draws with a fixed seed", function()
      local a = data.TokenDataset(bin, { seq_len = 4, shuffle = true, seed = 1 })
      local b = data.TextDataset(corpus, Byte, { seq_len = 4 })
      local mix = data.Mixture({ { a, 3 }, { b, 1 } }, 123)
      local buf = ffi.new("int32_t[5]")
      local count, n = { 0, 0 }, 4000
      local seq = {}
      for i = 1, n do
        local ok, _, part = mix:next_window(buf)
        assert.is_true(ok)
        count[part] = count[part] + 1
        if i <= 40 then seq[i] = part end
      end
      local frac = count[1] / n
      assert.truthy(math.abs(frac - 0.75) < 0.03, "fraction from the first part: " .. frac)
      -- same seed, same draws; another seed, others
      local function draws(seed)
        local m = data.Mixture({ { data.TokenDataset(bin, { seq_len = 4 }), 3 },
          { data.TextDataset(corpus, Byte, { seq_len = 4 }), 1 } }, seed)
        local t = {}
        for i = 1, 40 do t[i] = select(3, m:next_window(buf)) end
        return t
      end
      assert.are.same(seq, draws(123))
      assert.are_not.same(seq, draws(124))
    end)

    it("lets a recipe replace the sampling rule", function()
      local mix = data.Mixture({ { data.TokenDataset(bin, { seq_len = 4 }), 1 },
        { data.TextDataset(corpus, Byte, { seq_len = 4 }), 100 } }, 0)
      mix.choose = function(_, n) return n % 2 + 1 end -- alternate, whatever the weights
      local buf = ffi.new("int32_t[5]")
      local parts = {}
      for i = 1, 6 do parts[i] = select(3, mix:next_window(buf)) end
      assert.are.same({ 1, 2, 1, 2, 1, 2 }, parts)
    end)

    it("refuses bad weights and mismatched sequence lengths", function()
      local a = data.TokenDataset(bin, { seq_len = 4 })
      local ok, err = pcall(data.Mixture, { { a, 0 } })
      assert.truthy(not ok and err:find("expected a positive number"), err)
      ok, err = pcall(data.Mixture, { { a, 1 }, { data.TokenDataset(bin, { seq_len = 5 }), 1 } })
      assert.truthy(not ok and err:find("seq_len 5 but part 1"), err)
    end)
  end)

  describe("data: the loader and memory", function()
    it("batches are ordinary tensors freed by titan.scope", function()
      local loader = data.Loader(data.TokenDataset(bin, { seq_len = 16, shuffle = true }), { batch_size = 4 })
      local base = titan.live_tensors()
      for _ = 1, 20 do
        titan.scope(function()
          local b = loader:next()
          assert.are.same({ 4, 16 }, b.targets:shape())
          -- targets are inputs shifted by one
          local i, t = b.inputs:tolist(), b.targets:tolist()
          for r = 1, 4 do
            for c = 1, 15 do assert.are.equal(i[r][c + 1], t[r][c]) end
          end
        end)
      end
      assert.are.equal(base, titan.live_tensors())
      local b = loader:next()
      assert.are.equal(base + 2, titan.live_tensors())
      b.inputs:free()
      b.targets:free()
      assert.are.equal(base, titan.live_tensors())
      loader:close()
      -- int32 batches, and a short last batch of a finite dataset
      local fin = data.TokenDataset(bin, { seq_len = 16, infinite = false })
      local l2 = data.Loader(fin, { batch_size = 1000, dtype = "int32" })
      titan.scope(function()
        local bb = l2:next()
        assert.are.equal("int32", bb.inputs:dtype())
        assert.are.same({ fin.num_windows, 16 }, bb.inputs:shape())
        assert.is_nil(l2:next())
      end)
      l2:close()
    end)
  end)

  describe("data: bad input fails with one clear line", function()
    local function one_line_error(fn, ...)
      local ok, err = pcall(fn, ...)
      assert.is_false(ok)
      assert.are.equal("string", type(err))
      assert.is_nil(err:find("\n"), err)
      return err
    end

    it("a missing file", function()
      local err = one_line_error(data.TextDataset, { corpus_a, path("missing.txt") }, Byte, { seq_len = 4 })
      assert.are.equal("cannot open '" .. path("missing.txt") .. "': No such file or directory", err)
      err = one_line_error(data.TokenDataset, path("missing.bin"), { seq_len = 4 })
      assert.are.equal("tokens: cannot open '" .. path("missing.bin") .. "': No such file or directory", err)
    end)

    it("a truncated binary file", function()
      local whole = read(bin)
      local cut = write("cut.bin", whole:sub(1, #whole - 3))
      local err = one_line_error(data.TokenDataset, cut, { seq_len = 4 })
      local n = (#whole - 64) / 2
      assert.truthy(err:find(cut, 1, true), err)
      assert.truthy(err:find(("truncated: the header says %d tokens of 2 bytes"):format(n), 1, true), err)
      assert.truthy(err:find(("but the file has %d bytes"):format(#whole - 3), 1, true), err)
      local text = write("text_as.bin", "just some text that is long enough to hold a 64-byte header, and more\n")
      err = one_line_error(data.TokenFile.open, text)
      assert.truthy(err:find('not the magic "TTOKENS1"', 1, true), err)
    end)

    it("a JSONL line that is not JSON, or has no \"text\" field, names the file and line", function()
      local p = write("bad.jsonl", '{"text": "fine"}\n{"text": "also fine"\n')
      local ds = data.TextDataset(p, Byte, { seq_len = 4 })
      local err = one_line_error(epoch, ds)
      assert.truthy(err:find("^" .. p:gsub("%p", "%%%0") .. ":2: not valid JSON %("), err)
      p = write("nofield.jsonl", '{"text": "fine"}\n\n{"content": "x", "id": 3}\n')
      err = one_line_error(epoch, data.TextDataset(p, Byte, { seq_len = 4 }))
      assert.are.equal(p .. ':3: no "text" string field (keys: content, id)', err)
      p = write("notobj.jsonl", '"just a string"\n')
      err = one_line_error(epoch, data.TextDataset(p, Byte, { seq_len = 4 }))
      assert.are.equal(p .. ':1: expected a JSON object with a "text" string field, got string', err)
      -- prepare leaves no output behind
      one_line_error(data.prepare, { inputs = { p }, tokenizer = Byte, out = path("never.bin"), quiet = true })
      assert.is_nil(io.open(path("never.bin"), "rb"))
    end)

    it("too little data for a window, bad options", function()
      local p = write("short.txt", "ab\n")
      local err = one_line_error(epoch, data.TextDataset(p, Byte, { seq_len = 8 }))
      assert.truthy(err:find("none for rank 0 of world 1"), err)
      err = one_line_error(data.TokenDataset, bin, { seq_len = 4, rank = 3, world = 3 })
      assert.truthy(err:find("rank 3 is outside world 3"), err)
      err = one_line_error(data.TextDataset, corpus, Byte, { seq_len = 4, shuffle = true })
      assert.truthy(err:find("ShuffleBuffer"), err)
      err = one_line_error(data.TextDataset, corpus, Byte, { seq_len = 0 })
      assert.truthy(err:find("seq_len must be an integer >= 1"), err)
    end)
  end)

  describe("titan data (CLI)", function()
    local cli = require("titan.cli.data")
    local function capture(fn, ...)
      local sink = { text = {} }
      function sink:write(...) for _, s in ipairs({ ... }) do self.text[#self.text + 1] = s end end
      local saved_out, saved_load = cli.out, cli.load_tokenizer
      cli.out = sink
      cli.load_tokenizer = function() return Byte end
      local ok, err = pcall(fn, ...)
      cli.out, cli.load_tokenizer = saved_out, saved_load
      if not ok then error(err, 0) end
      return table.concat(sink.text)
    end

    it("prepare reads a directory of fortune files, skipping index files and links", function()
      os.execute("mkdir -p " .. dir .. "/fortunes")
      fortune_corpus("fortunes/alpha", 0, 6)
      fortune_corpus("fortunes/beta", 6, 6)
      write("fortunes/alpha.dat", "\0\0\0\2binary index")
      os.execute(("ln -s alpha %s/fortunes/alpha.u8"):format(dir))
      local notes = {}
      local files = cli.expand_inputs({ dir .. "/fortunes" }, function(m) notes[#notes + 1] = m end)
      assert.are.same({ dir .. "/fortunes/alpha", dir .. "/fortunes/beta" }, files)
      assert.are.same({}, notes)
      -- a shell glob passes them all: the link is a duplicate, the index is binary
      files = cli.expand_inputs({ dir .. "/fortunes/alpha", dir .. "/fortunes/alpha.dat", dir .. "/fortunes/alpha.u8",
        dir .. "/fortunes/beta" }, function(m) notes[#notes + 1] = m end)
      assert.are.same({ dir .. "/fortunes/alpha", dir .. "/fortunes/beta" }, files)
      assert.are.same({ "skipped 1 binary file (alpha.dat) and 1 duplicate (links to inputs)" }, notes)

      local out = capture(cli.main, "prepare", "--tokenizer", "byte.json", "--out", path("f.bin"),
        "--val-out", path("f_val.bin"), "--val-fraction=0.25", "--quiet", dir .. "/fortunes")
      assert.truthy(out:find("wrote " .. path("f.bin") .. ": %d+ tokens, 9 documents %(uint16, vocab 258%)"), out)
      assert.truthy(out:find("wrote " .. path("f_val.bin") .. ": %d+ tokens, 3 documents"), out)
      local f = data.TokenFile.open(path("f.bin"))
      assert.are.same(B("<doc00 says xyz>"), f:read_table(0, 16))
      f:close()

      out = capture(cli.main, "inspect", path("f.bin"), "--tokenizer", "byte.json", "-n", "8")
      assert.truthy(out:find("documents   9", 1, true), out)
      assert.truthy(out:find("vocab       258", 1, true), out)
      assert.truthy(out:find("dtype       uint16", 1, true), out)
      assert.truthy(out:find("first 8 tokens: 256 100 111 99 48 48 32 115", 1, true), out)
      assert.truthy(out:find("decoded: doc00 s", 1, true), out)

      -- JSONL by flag
      local jl = write("cli.jsonl", '{"text": "one"}\n{"text": "two"}\n')
      out = capture(cli.main, "prepare", "--tokenizer", "t", "--out", path("j.bin"), "--jsonl", "--quiet", jl)
      assert.truthy(out:find("10 tokens, 2 documents", 1, true), out)
      -- an output that exists is refused before any work and left as it was; --force replaces it
      local before = read(path("j.bin"))
      local ok, e = pcall(capture, cli.main, "prepare", "--tokenizer", "t", "--out", path("j.bin"), "--quiet", jl)
      assert.is_false(ok)
      assert.truthy(e:find("prepare: " .. path("j.bin") .. " exists; pass --force to replace it (it was not touched)",
        1, true), e)
      assert.are.equal(before, read(path("j.bin")))
      out = capture(cli.main, "prepare", "--tokenizer", "t", "--out", path("j.bin"), "--quiet", "--force", jl)
      assert.truthy(out:find("tokens, 2 documents", 1, true), out)
    end)

    it("reports usage errors in one line", function()
      local function err_of(...)
        local ok, e = pcall(capture, cli.main, ...)
        assert.is_false(ok)
        assert.is_nil(e:find("\n"), e)
        return e
      end
      assert.truthy(err_of("prepare", "--out", "x.bin", "in.txt"):find("--tokenizer FILE is required", 1, true))
      assert.truthy(err_of("prepare", "--tokenizer", "t", "--out", "x.bin", "--val-fraction", "0.1", "in.txt")
        :find("--val-fraction needs --val-out", 1, true))
      assert.truthy(err_of("prepare", "--tokenizer", "t", "--out", "x.bin", "--val-out", "v.bin",
        "--val-fraction", "2", "in.txt"):find("must be a number in (0, 1)", 1, true))
      assert.truthy(err_of("frobnicate"):find("unknown command 'frobnicate'", 1, true))
      assert.truthy(err_of("inspect", "a.bin", "--nope"):find("unknown option '--nope'", 1, true))
    end)

    it("runs as `titan data` with --help, inspect and exit codes", function()
      local exe = env.build_dir .. "/titan"
      local run = dofile("tests/lua/shell.lua").run
      local out, rc = run(exe .. " data --help")
      assert.are.equal(0, rc)
      assert.truthy(out:find("titan data prepare --tokenizer FILE --out FILE.bin", 1, true), out)
      out, rc = run(exe .. " data inspect " .. bin)
      assert.are.equal(0, rc)
      assert.truthy(out:find("format      TTOKENS1 version 1", 1, true), out)
      assert.truthy(out:find("first 32 tokens: 256 100 111 99", 1, true), out)
      local whole = read(bin)
      write("cli_cut.bin", whole:sub(1, #whole - 1))
      out, rc = run(exe .. " data inspect " .. path("cli_cut.bin"))
      assert.are.equal(1, rc)
      assert.truthy(out:find("^titan: tokens: '" .. path("cli_cut.bin"):gsub("%p", "%%%0") .. "' is truncated"), out)
      assert.are.equal(1, select(2, out:gsub("\n", "")))
    end)
  end)

  describe("data: with the shipped tokenizer", function()
    it("prepares a fortune file that decodes back to its documents", function()
      local tok_path = env.root .. "/assets/tokenizers/fortunes_2048.json"
      local have = io.open(tok_path, "rb")
      local ok, Tokenizer = pcall(require, "titan.tokenizer")
      if not have or not ok then
        pending("needs assets/tokenizers/fortunes_2048.json and titan.tokenizer")
        return
      end
      have:close()
      local tok = Tokenizer.load(tok_path)
      local src = "/usr/share/games/fortunes/fortunes"
      local out = path("real.bin")
      local r = data.prepare({ inputs = { src }, tokenizer = tok, out = out, quiet = true })
      local f = data.TokenFile.open(out)
      assert.are.equal(tok.vocab_size, f.header.vocab_size)
      assert.are.equal(r.train.docs, f.header.num_docs)
      -- the first document: BOS, its tokens, EOS
      local docs = data.Documents.new(src)
      local first = docs:next()
      docs:close()
      local ids, n = tok:encode(first, { bos = true, eos = true })
      local buf = ffi.new("int32_t[?]", n)
      f:read_into(0, n, buf)
      for i = 0, n - 1 do assert.are.equal(ids[i], buf[i]) end
      assert.are.equal(first, tok:decode(buf + 1, n - 2))
      f:close()
      -- on the fly and from the file: the same batches
      local a = data.Loader(data.TextDataset(src, tok, { seq_len = 32 }), { batch_size = 2 })
      local b = data.Loader(data.TokenDataset(out, { seq_len = 32 }), { batch_size = 2 })
      assert.are.same(batches(a, 5), batches(b, 5))
    end)

    it("special-token text inside a document is text: BOS and EOS only where documents begin and end", function()
      local tok_path = env.root .. "/assets/tokenizers/fortunes_2048.json"
      local tok = require("titan.tokenizer").load(tok_path)
      local docs = { "How to end a document: write <|end_of_text|> and stop.",
        "<|begin_of_text|><|end_of_text|>", "a<|end_of_text|><|begin_of_text|>b" }
      local lines = {}
      for i, d in ipairs(docs) do lines[i] = cjson.encode({ text = d }) end
      local p = write("specials.jsonl", table.concat(lines, "\n") .. "\n")
      local total = 0
      for _, d in ipairs(docs) do total = total + #tok:encode_table(d) + 2 end
      -- one window holding the whole stream: the markers are the packing's
      local w = epoch(data.TextDataset(p, tok, { seq_len = total - 1, infinite = false }))
      assert.are.equal(1, #w)
      local want, bos, eos = {}, 0, 0
      for _, d in ipairs(docs) do
        for _, id in ipairs(tok:encode_table(d, { bos = true, eos = true })) do want[#want + 1] = id end
      end
      assert.are.same(want, w[1].tokens)
      for _, id in ipairs(w[1].tokens) do
        if id == tok.bos_id then bos = bos + 1 elseif id == tok.eos_id then eos = eos + 1 end
      end
      assert.are.equal(#docs, bos)
      assert.are.equal(#docs, eos)
      -- and each document decodes back to its text, special-token text included
      local at = 1
      for _, d in ipairs(docs) do
        local n = #tok:encode_table(d)
        assert.are.equal(tok.bos_id, w[1].tokens[at])
        assert.are.equal(d, tok:decode({ unpack(w[1].tokens, at + 1, at + n) }))
        assert.are.equal(tok.eos_id, w[1].tokens[at + n + 1])
        at = at + n + 2
      end
      tok:free()
    end)
  end)
end)
