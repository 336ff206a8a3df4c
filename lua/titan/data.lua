-- titan.data — datasets and the loader: `local data = require("titan.data")`.
--
--   data.TextDataset(paths, tok, {seq_len = T})  text / JSONL tokenized on the fly
--   data.TokenDataset(path(s), {seq_len = T, shuffle = true, seed = 1})  binary token files
--   data.Mixture({ {ds_a, 3}, {ds_b, 1} }, seed)  weighted mixture
--   data.ShuffleBuffer(ds, {size = N, seed})       block shuffle of a stream
--   data.Loader(ds, {batch_size = B})              {inputs, targets} int64 [B, T]
--   data.prepare{inputs, tokenizer, out, val_out, val_fraction}   corpus -> .bin
--   data.loaders{paths, tokenizer, seq_len, batch_size, ...}      train, val loaders
--
-- Every dataset takes rank/world (its share of windows), split = "train" |
-- "val" with val_fraction (held-out data), and has next_window(dst),
-- state_dict(), load_state_dict(s), reset(): a recipe can pass its own
-- object with those methods anywhere a dataset is expected. Format and
-- semantics: docs/data.md.
local M = {
  TokenFile = require("titan.data.tokens").TokenFile,
  TokenWriter = require("titan.data.tokens").TokenWriter,
  Documents = require("titan.data.documents").Documents,
  TextDataset = require("titan.data.text_dataset"),
  TokenDataset = require("titan.data.token_dataset"),
  Mixture = require("titan.data.mixture"),
  ShuffleBuffer = require("titan.data.shuffle_buffer"),
  Loader = require("titan.data.loader"),
  Progress = require("titan.data.progress"),
  random = require("titan.data.random"),
  split = require("titan.data.split"),
  prepare = require("titan.data.prepare").prepare,
}

-- Classes are callable: data.Loader(ds, opts) == data.Loader.new(ds, opts);
-- methods stay overridable on the class (data.Mixture.choose = ...).
for _, name in ipairs({ "TextDataset", "TokenDataset", "Mixture", "ShuffleBuffer", "Loader" }) do
  local cls = M[name]
  setmetatable(cls, { __call = function(_, ...) return cls.new(...) end })
end

-- Whether path is a binary token file (by its magic, not its name).
function M.is_token_file(path)
  local f = type(path) == "string" and io.open(path, "rb")
  if not f then return false end
  local magic = f:read(8)
  f:close()
  return magic == "TTOKENS1"
end

-- open(paths, opts): a TokenDataset when the files are binary token files,
-- else a TextDataset (opts.tokenizer required).
function M.open(paths, opts)
  opts = opts or {}
  local list = type(paths) == "string" and { paths } or paths
  if type(list) ~= "table" or #list == 0 then error("data.open: expected a path or a list of paths", 2) end
  local binary = 0
  for _, p in ipairs(list) do
    if M.is_token_file(p) then binary = binary + 1 end
  end
  if binary == #list then return M.TokenDataset.new(list, opts) end
  if binary > 0 then
    error("data.open: some inputs are binary token files and some are not; open them separately "
      .. "(data.Mixture combines datasets)", 2)
  end
  if not opts.tokenizer then
    error("data.open: " .. list[1] .. " is not a binary token file; reading text needs opts.tokenizer", 2)
  end
  return M.TextDataset.new(list, opts.tokenizer, opts)
end

-- loaders{paths, tokenizer, seq_len, batch_size, rank, world, seed, shuffle,
--         shuffle_buffer = 1024, val_fraction, val_paths, device}
-- -> train loader, validation loader (nil without val_fraction / val_paths).
function M.loaders(o)
  local function ds_opts(extra)
    local t = { tokenizer = o.tokenizer, seq_len = o.seq_len, rank = o.rank, world = o.world, seed = o.seed,
      format = o.format, field = o.field }
    for k, v in pairs(extra) do t[k] = v end
    return t
  end
  local frac = o.val_fraction or 0
  local held_out = frac > 0 and not o.val_paths
  local first = type(o.paths) == "table" and o.paths[1] or o.paths
  local train = M.open(o.paths, ds_opts({ split = held_out and "train" or nil, val_fraction = frac,
    shuffle = o.shuffle and M.is_token_file(first) }))
  if o.shuffle and getmetatable(train) == M.TextDataset then
    train = M.ShuffleBuffer.new(train, { size = o.shuffle_buffer or 1024, seed = o.seed })
  end
  local val
  if o.val_paths then
    val = M.open(o.val_paths, ds_opts({ infinite = false }))
  elseif held_out then
    val = M.open(o.paths, ds_opts({ split = "val", val_fraction = frac }))
  end
  local lopts = { batch_size = o.batch_size, device = o.device }
  return M.Loader.new(train, lopts), val and M.Loader.new(val, lopts) or nil
end

-- What the trainer uses: the config's dataset as loaders (data/build.lua).
local build = require("titan.data.build")
M.build, M.build_mixture, M.fortune_files = build.build, build.build_mixture, build.fortune_files

return M
