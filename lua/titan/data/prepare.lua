-- data/prepare.lua — tokenizes a corpus once into binary token files
-- (data/tokens.lua), with the same documents, packing (BOS/EOS) and
-- validation split as a TextDataset reading the corpus on the fly: a
-- TokenDataset over the result yields the same windows.
local Documents = require("titan.data.documents").Documents
local TokenWriter = require("titan.data.tokens").TokenWriter
local split = require("titan.data.split")
local Progress = require("titan.data.progress")

local M = {}

-- prepare{ inputs = {paths...}, tokenizer = tok, out = "train.bin",
--          val_out = "val.bin", val_fraction = 0.05, format = "auto",
--          field = "text", bos = true, eos = true, quiet = false }
-- -> { train = {path, tokens, docs}, val = {path, tokens, docs} | nil, seconds }
function M.prepare(opts)
  local tok = opts.tokenizer
  if type(tok) ~= "table" or type(tok.encode) ~= "function" or type(tok.vocab_size) ~= "number" then
    error("prepare: expected a tokenizer (with vocab_size and :encode)", 2)
  end
  if type(opts.out) ~= "string" then error("prepare: out (the output file) is required", 2) end
  local frac = opts.val_fraction or 0
  if opts.val_out then
    if type(frac) ~= "number" or frac <= 0 or frac >= 1 then
      error("prepare: val_out needs val_fraction in (0, 1), got " .. tostring(opts.val_fraction), 2)
    end
  elseif frac ~= 0 then
    error("prepare: val_fraction needs val_out (where the held-out documents go)", 2)
  end
  if opts.val_out == opts.out then error("prepare: out and val_out are the same file", 2) end
  local docs = Documents.new(opts.inputs, { format = opts.format, field = opts.field })
  local encode_opts = { bos = opts.bos ~= false and tok.bos_id ~= nil, eos = opts.eos ~= false and tok.eos_id ~= nil }
  local progress = Progress.new("tokenizing", docs:total_bytes(), { quiet = opts.quiet, out = opts.progress,
    tty = opts.progress_tty })
  local train = TokenWriter.open(opts.out, tok.vocab_size)
  local val
  local ok, err = pcall(function()
    if opts.val_out then val = TokenWriter.open(opts.val_out, tok.vocab_size) end
    local tokens = 0
    while true do
      local text, pos = docs:next()
      if not text then break end
      local ids, n = tok:encode(text, encode_opts)
      if n > 0 then
        local w = (val and split.is_val_doc(pos.doc, frac)) and val or train
        w:append(ids, n, 1)
        tokens = tokens + n
      end
      progress:update(docs:bytes_done(), tokens)
    end
    progress:finish(docs:total_bytes(), tokens)
    train:finish()
    if val then val:finish() end
  end)
  docs:close()
  if not ok then
    -- Nothing half-written stays behind; a file that already existed is untouched.
    if not progress.quiet and progress.tty then progress.out:write("\n") end -- end the line drawn in place
    train:abort()
    if val then val:abort() end
    error(err, 0)
  end
  local result = { train = { path = opts.out, tokens = train.num_tokens, docs = train.num_docs },
    seconds = progress.seconds }
  if val then result.val = { path = opts.val_out, tokens = val.num_tokens, docs = val.num_docs } end
  return result
end

return M
