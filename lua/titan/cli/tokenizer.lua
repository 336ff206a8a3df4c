-- titan tokenizer — train, inspect and use byte-level BPE tokenizers.
local M = {}

local usage = [[
usage: titan tokenizer train --vocab N [--out FILE] [--fortune | --no-fortune] [--force] FILES...
       titan tokenizer encode --tokenizer FILE [--bos] [--eos] [--pieces] [TEXT... | --file PATH]
       titan tokenizer decode --tokenizer FILE IDS...
       titan tokenizer info --tokenizer FILE
       titan tokenizer --help

train    learn a byte-level BPE (Llama 3 pre-tokenizer) from text files and write an HF
         tokenizer.json. --vocab counts every token: 256 bytes + merges + 2 specials
         (<|begin_of_text|>, <|end_of_text|>). --out defaults to tokenizer.json; a file
         already there is refused before training unless --force (models trained with it need it).
         Fortune files (those with a FILE.dat index next to them) lose their '%' separator
         lines; --fortune / --no-fortune force the choice. Same text, same file, byte for byte.
encode   print the ids of TEXT (the arguments joined by spaces), of a file's bytes, or of
         standard input (no TEXT, or --file -);
         --bos/--eos add <|begin_of_text|>/<|end_of_text|>; --pieces prints one token a line
         (id and bytes) instead. Special-token text inside TEXT is encoded as plain text.
decode   write the bytes of IDS (numbers, separated by spaces or commas) to stdout, exactly.
info     vocabulary size, merges, special ids and the pre-tokenizer pattern.
FILE     an HF tokenizer.json or a tiktoken ranks file (told apart by content).
]]

local function fail(msg) error("tokenizer: " .. msg, 0) end

-- Options (--name VALUE, --name=VALUE, --flag) and positional arguments.
local function parse(args, spec)
  local opts, rest = {}, {}
  local i = 1
  while i <= #args do
    local a = args[i]
    local name, val = a:match("^%-%-([%w%-]+)=(.*)$")
    name = name or a:match("^%-%-([%w%-]+)$")
    if a == "--" then
      for j = i + 1, #args do rest[#rest + 1] = args[j] end
      break
    elseif name then
      local kind = spec[name]
      if not kind then fail(("unknown option '--%s'; see titan tokenizer --help"):format(name)) end
      if kind == "flag" then
        if val then fail(("--%s takes no value"):format(name)) end
        opts[name] = true
      else
        if not val then
          i = i + 1
          val = args[i]
          if val == nil then fail(("--%s needs a value"):format(name)) end
        end
        opts[name] = val
      end
    else
      rest[#rest + 1] = a
    end
    i = i + 1
  end
  return opts, rest
end

local function load(opts)
  if not opts.tokenizer then fail("--tokenizer FILE is required; see titan tokenizer --help") end
  return require("titan.tokenizer").load(opts.tokenizer)
end

local function printable(bytes)
  return (bytes:gsub("[^\32-\126]", function(c)
    local named = { ["\n"] = "\\n", ["\t"] = "\\t", ["\r"] = "\\r" }
    return named[c] or ("\\x%02x"):format(c:byte())
  end))
end

function M.train(args)
  local opts, files = parse(args, { vocab = "value", out = "value", fortune = "flag", ["no-fortune"] = "flag",
    force = "flag" })
  local n = tonumber(opts.vocab)
  if not n then fail("train needs --vocab N (the whole vocabulary size, e.g. --vocab 2048)") end
  if #files == 0 then fail("train needs text FILES to learn from") end
  local fortune
  if opts.fortune then fortune = true end
  if opts["no-fortune"] then fortune = false end
  local out = opts.out or "tokenizer.json"
  -- A tokenizer that checkpoints were trained with must not change under them.
  local existing = io.open(out, "rb")
  if existing then
    existing:close()
    if not opts.force then fail(("train: %s exists; pass --force to replace it (it was not touched)"):format(out)) end
  end
  local Tokenizer = require("titan.tokenizer")
  local t0 = os.clock()
  local tok, stats = Tokenizer.train({ vocab_size = n, files = files, fortune = fortune, progress = io.stderr })
  tok:save(out)
  io.stderr:write(("tokenizer: wrote %s: %d tokens (%d merges) in %.1f s\n"):format(out, tok.vocab_size, stats.merges,
    os.clock() - t0))
  tok:free()
end

function M.encode(args)
  local opts, words = parse(args, { tokenizer = "value", bos = "flag", eos = "flag", pieces = "flag", file = "value" })
  local text
  if opts.file and #words > 0 then fail("encode takes TEXT or --file PATH, not both") end
  if opts.file == "-" or (not opts.file and #words == 0) then
    -- (as `echo text | titan tokenizer encode`: nothing on the line, so the text comes on stdin)
    text = io.stdin:read("*a")
  elseif opts.file then
    local f, err = io.open(opts.file, "rb")
    if not f then fail(("cannot read %s: %s"):format(opts.file, tostring(err))) end
    text = f:read("*a")
    f:close()
  else
    text = table.concat(words, " ")
  end
  local tok = load(opts)
  local ids, n = tok:encode(text, { bos = opts.bos, eos = opts.eos })
  if opts.pieces then
    for i = 0, n - 1 do
      local bytes, special = tok:token(ids[i])
      io.write(("%d\t%s%s\n"):format(ids[i], printable(bytes), special and "\t(special)" or ""))
    end
  else
    local t = {}
    for i = 0, n - 1 do t[#t + 1] = tostring(ids[i]) end
    io.write(table.concat(t, " "), "\n")
  end
  tok:free()
end

function M.decode(args)
  local opts, words = parse(args, { tokenizer = "value" })
  local ids = {}
  for _, w in ipairs(words) do
    for item in w:gmatch("[^%s,]+") do
      local id = tonumber(item)
      if not id or id % 1 ~= 0 then fail(("decode: '%s' is not a token id; expected integers"):format(item)) end
      ids[#ids + 1] = id
    end
  end
  local tok = load(opts)
  local ok, text = pcall(tok.decode, tok, ids)
  tok:free()
  if not ok then error(text, 0) end
  io.write(text)
end

function M.info(args)
  local opts = parse(args, { tokenizer = "value" })
  local tok = load(opts)
  print(("file          %s"):format(opts.tokenizer))
  print(("vocab_size    %d (including special tokens)"):format(tok.vocab_size))
  print(("merges        %d"):format(tok.n_merges))
  print(("bos_id        %s"):format(tostring(tok.bos_id)))
  print(("eos_id        %s"):format(tostring(tok.eos_id)))
  print(("ignore_merges %s"):format(tostring(tok.ignore_merges)))
  print(("max token     %d bytes"):format(tok.max_token_len))
  print(("pattern       %s"):format(tok.pattern))
  tok:free()
end

function M.main(cmd, ...)
  if cmd == nil then
    io.stderr:write(usage)
    os.exit(1)
  end
  if cmd == "--help" or cmd == "-h" or cmd == "help" then
    io.write(usage)
    return
  end
  local fn = ({ train = M.train, encode = M.encode, decode = M.decode, info = M.info })[cmd]
  if not fn then fail(("unknown command '%s'; expected train, encode, decode or info (see titan tokenizer --help)"):format(cmd)) end
  for _, a in ipairs({ ... }) do
    if a == "--help" or a == "-h" then -- (titan tokenizer train --help, as titan data prepare --help)
      io.write(usage)
      return
    end
    if a == "--" then break end
  end
  fn({ ... })
end

return M
