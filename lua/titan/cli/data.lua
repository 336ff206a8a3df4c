-- cli/data.lua — `titan data ...`: prepare binary token files, inspect them.
local data = require("titan.data")

local M = {}

-- Where results go (a seam: tests capture it).
M.out = io.stdout
local function say(s) M.out:write(s, "\n") end

M.usage = [[
usage: titan data prepare --tokenizer FILE --out FILE.bin [--val-out FILE.bin --val-fraction F]
                          [--jsonl | --format FMT] [--field NAME] [--no-bos] [--no-eos] [--quiet] [--force]
                          INPUTS...
       titan data inspect FILE.bin [--tokenizer FILE] [-n N]
       titan data --help

prepare   tokenizes INPUTS (files, or directories of files) into a binary token file:
          each document becomes BOS + tokens + EOS, documents in input order. With
          --val-out, every (1/F)-th document goes to the validation file instead.
          Formats (--format): auto (default: .jsonl/.json by name, else text), text
          (fortune files if they hold `%` lines, else one document per line), jsonl
          (the "text" field, or --field), lines, paragraphs, fortune, file.
          Directories contribute their regular files, sorted, skipping symlinks,
          hidden files, *.dat and *.u8 (the fortune index files and their links);
          files that hold NUL bytes are skipped with a note. The output appears only
          when complete (written to FILE.bin.tmp.PID, then renamed). An output file
          that exists already is refused before any work unless --force.
inspect   prints the header (tokens, documents, vocab, dtype) and the first N tokens
          (default 32), decoded when --tokenizer is given.

examples:
  titan data prepare --tokenizer assets/tokenizers/fortunes_2048.json \
      --out data/fortunes.bin --val-out data/fortunes_val.bin --val-fraction 0.05 \
      /usr/share/games/fortunes
  titan data inspect data/fortunes.bin --tokenizer assets/tokenizers/fortunes_2048.json
]]

-- The tokenizer loader (a seam: tests substitute their own).
function M.load_tokenizer(path)
  local ok, Tokenizer = pcall(require, "titan.tokenizer")
  if not ok then error("data: cannot load the tokenizer module (titan.tokenizer): " .. tostring(Tokenizer), 0) end
  return Tokenizer.load(path)
end

local function fail(fmt, ...) error("data: " .. fmt:format(...), 0) end

-- "1234567" -> "1,234,567"
local function commas(n)
  local s = ("%d"):format(n)
  local out = s:reverse():gsub("(%d%d%d)", "%1,"):reverse()
  return (out:gsub("^,", ""))
end
M.commas = commas

-- Parses argv into options and positional arguments, by a table of known
-- options: name -> "flag" | "value".
local function parse(argv, known, command)
  local opts, pos = {}, {}
  local i = 1
  while i <= #argv do
    local a = argv[i]
    local name, value = a:match("^%-%-([%w%-]+)=(.*)$")
    if not name then name = a:match("^%-%-([%w%-]+)$") or (a:match("^%-(%a)$")) end
    if name then
      local kind = known[name]
      if not kind then
        local names = {}
        for k in pairs(known) do names[#names + 1] = (#k == 1 and "-" or "--") .. k end
        table.sort(names)
        fail("%s: unknown option '%s' (expected %s)", command, a, table.concat(names, ", "))
      end
      if kind == "flag" then
        if value then fail("%s: option --%s takes no value", command, name) end
        opts[name] = true
      else
        if not value then
          i = i + 1
          value = argv[i]
          if value == nil then fail("%s: option %s needs a value", command, a) end
        end
        opts[name] = value
      end
    else
      pos[#pos + 1] = a
    end
    i = i + 1
  end
  return opts, pos
end

-- ---- input files --------------------------------------------------------------

local ffi = require("ffi")
pcall(ffi.cdef, "char *realpath(const char *path, char *resolved_path);")

local function real(path)
  local buf = ffi.new("char[4096]")
  local ok, r = pcall(ffi.C.realpath, path, buf)
  if ok and r ~= nil then return ffi.string(buf) end
  return path
end

local function looks_binary(path)
  local f = io.open(path, "rb")
  if not f then return false end
  local head = f:read(8192) or ""
  f:close()
  return head:find("\0", 1, true) ~= nil
end

-- Files and directories -> the list of files to read, in order. Binary
-- files are skipped and duplicates (a link and its target) read once;
-- `note` gets one line summing up what was skipped.
function M.expand_inputs(inputs, note)
  note = note or function(msg) io.stderr:write("data: ", msg, "\n") end
  local lfs_ok, lfs = pcall(require, "lfs")
  local files, seen, binary, dups = {}, {}, {}, 0
  local function add(p)
    local r = real(p)
    if seen[r] then
      dups = dups + 1
    elseif looks_binary(p) then
      binary[#binary + 1] = p:match("[^/]*$")
    else
      seen[r] = true
      files[#files + 1] = p
    end
  end
  for _, p in ipairs(inputs) do
    local mode = lfs_ok and lfs.attributes(p, "mode")
    if mode == "directory" then
      local names = {}
      for name in lfs.dir(p) do
        if not name:match("^%.") and not name:match("%.dat$") and not name:match("%.u8$") then
          local full = p:gsub("/+$", "") .. "/" .. name
          if lfs.symlinkattributes(full, "mode") == "file" then names[#names + 1] = full end
        end
      end
      table.sort(names)
      for _, f in ipairs(names) do add(f) end
    elseif not lfs_ok or mode == "file" or mode == nil then
      add(p) -- missing files fail later with the reader's message
    else
      fail("prepare: '%s' is a %s, not a file or directory", p, mode)
    end
  end
  local skipped = {}
  if #binary > 0 then
    local shown = #binary <= 3 and table.concat(binary, ", ")
      or (table.concat(binary, ", ", 1, 3) .. ", ...")
    skipped[#skipped + 1] = ("%d binary file%s (%s)"):format(#binary, #binary == 1 and "" or "s", shown)
  end
  if dups > 0 then skipped[#skipped + 1] = ("%d duplicate%s (links to inputs)"):format(dups, dups == 1 and "" or "s") end
  if #skipped > 0 then note("skipped " .. table.concat(skipped, " and ")) end
  if #files == 0 then fail("prepare: no input files (after skipping binary files)") end
  return files
end

-- ---- commands -------------------------------------------------------------------

local function prepare(argv)
  local opts, inputs = parse(argv, {
    tokenizer = "value", out = "value", ["val-out"] = "value", ["val-fraction"] = "value", jsonl = "flag",
    format = "value", field = "value", ["no-bos"] = "flag", ["no-eos"] = "flag", quiet = "flag", help = "flag",
    force = "flag",
  }, "prepare")
  if opts.help then
    M.out:write(M.usage)
    return
  end
  if not opts.tokenizer then fail("prepare: --tokenizer FILE is required") end
  if not opts.out then fail("prepare: --out FILE.bin is required") end
  if #inputs == 0 then fail("prepare: no inputs given (text, JSONL or fortune files, or directories)") end
  local frac
  if opts["val-fraction"] then
    frac = tonumber(opts["val-fraction"])
    if not frac or frac <= 0 or frac >= 1 then
      fail("prepare: --val-fraction must be a number in (0, 1), got '%s'", opts["val-fraction"])
    end
    if not opts["val-out"] then fail("prepare: --val-fraction needs --val-out FILE.bin") end
  elseif opts["val-out"] then
    fail("prepare: --val-out needs --val-fraction F")
  end
  -- Token files can take hours to make: one already there is replaced only on request.
  for _, key in ipairs({ "out", "val-out" }) do
    local f = opts[key] and io.open(opts[key], "rb")
    if f then
      f:close()
      if not opts.force then fail("prepare: %s exists; pass --force to replace it (it was not touched)", opts[key]) end
    end
  end
  if opts.jsonl and opts.format and opts.format ~= "jsonl" then
    fail("prepare: --jsonl and --format %s contradict each other", opts.format)
  end
  local files = M.expand_inputs(inputs)
  local tok = M.load_tokenizer(opts.tokenizer)
  local r = data.prepare({
    inputs = files, tokenizer = tok, out = opts.out, val_out = opts["val-out"], val_fraction = frac,
    format = opts.jsonl and "jsonl" or opts.format, field = opts.field,
    bos = not opts["no-bos"], eos = not opts["no-eos"], quiet = opts.quiet,
  })
  local dtype = tok.vocab_size <= 65536 and "uint16" or "uint32"
  for _, part in ipairs({ r.train, r.val }) do
    say(("wrote %s: %s tokens, %s documents (%s, vocab %d)"):format(part.path, commas(part.tokens),
      commas(part.docs), dtype, tok.vocab_size))
  end
end

-- Control characters shown as escapes so the decoded text stays on one line.
local function escape(s)
  return (s:gsub("[%c\\]", function(c)
    if c == "\n" then return "\\n" elseif c == "\t" then return "\\t" elseif c == "\\" then return "\\\\" end
    return ("\\x%02x"):format(c:byte())
  end))
end

local function inspect(argv)
  local opts, pos = parse(argv, { tokenizer = "value", n = "value", help = "flag" }, "inspect")
  if opts.help then
    M.out:write(M.usage)
    return
  end
  if #pos ~= 1 then fail("inspect: expected one FILE.bin, got %d arguments", #pos) end
  local n = tonumber(opts.n or 32)
  if not n or n < 0 or n ~= math.floor(n) then fail("inspect: -n must be a count, got '%s'", tostring(opts.n)) end
  local f = data.TokenFile.open(pos[1])
  local h = f.header
  local size = 64 + h.num_tokens * h.token_bytes
  say(("file        %s"):format(f.path))
  say(("format      TTOKENS1 version %d, %d-byte header, %d bytes"):format(h.version, h.header_bytes, size))
  say(("tokens      %s"):format(commas(h.num_tokens)))
  say(("documents   %s"):format(commas(h.num_docs)))
  say(("vocab       %s"):format(commas(h.vocab_size)))
  say(("dtype       %s (%d bytes per token)"):format(h.dtype, h.token_bytes))
  if h.num_docs > 0 then say(("tokens/doc  %.1f"):format(h.num_tokens / h.num_docs)) end
  local m = math.min(n, h.num_tokens)
  if m > 0 then
    local ids = f:read_table(0, m)
    say(("first %d tokens: %s"):format(m, table.concat(ids, " ")))
    if opts.tokenizer then
      local tok = M.load_tokenizer(opts.tokenizer)
      if tok.vocab_size ~= h.vocab_size then
        say(("note: the tokenizer has vocab %d, the file says %d"):format(tok.vocab_size, h.vocab_size))
      end
      local buf = ffi.new("int32_t[?]", m)
      f:read_into(0, m, buf)
      say("decoded: " .. escape(tok:decode(buf, m)))
    end
  end
  f:close()
end

local commands = { prepare = prepare, inspect = inspect }

function M.main(...)
  local argv = { ... }
  local cmd = table.remove(argv, 1)
  if cmd == nil then fail("expected a command: prepare or inspect (see titan data --help)") end
  if cmd == "--help" or cmd == "-h" or cmd == "help" then
    M.out:write(M.usage)
    return
  end
  local fn = commands[cmd]
  if not fn then fail("unknown command '%s' (expected prepare or inspect; see titan data --help)", cmd) end
  fn(argv)
end

return M
