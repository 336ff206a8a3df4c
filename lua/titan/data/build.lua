-- data/build.lua — what the trainer uses by default: the config's dataset
-- section turned into {train = loader, val = loader}. A recipe replaces it
-- with its own build_data (see lua/recipes/llama3_debugmodel_mix.lua).
local M = {}

local FORTUNES = "/usr/share/games/fortunes"

local function data() return require("titan.data") end

-- The Debian fortunes corpus, sorted by name; opts.from/opts.to keep the
-- files whose names start with a letter in that range.
-- opts.dir replaces the Debian location (training.dataset_path for the
-- fortunes dataset: a machine without the package can carry the files).
function M.fortune_files(opts)
  opts = opts or {}
  local dir = opts.dir or FORTUNES
  local f = io.open(dir .. "/fortunes", "r")
  if not f then
    error("data: the fortunes corpus is missing (" .. dir .. "/fortunes); install the Debian package "
      .. "(apt-get install fortunes) or point training.dataset_path at a copy of its folder", 0)
  end
  f:close()
  local files = require("titan.cli.data").expand_inputs({ dir }, function() end)
  if opts.from or opts.to then
    local from, to = opts.from or "a", opts.to or "z"
    local keep = {}
    for _, p in ipairs(files) do
      local c = p:match("([^/]*)$"):sub(1, 1):lower()
      if c >= from and c <= to then keep[#keep + 1] = p end
    end
    files = keep
  end
  return files
end

local function split_paths(s)
  local out = {}
  for p in s:gmatch("[^,]+") do out[#out + 1] = p end
  return out
end

-- The dataset files and the reader's format for training.dataset.
function M.paths(cfg)
  local t = cfg.training
  if t.dataset == "fortunes" then
    return M.fortune_files({ dir = t.dataset_path ~= "" and t.dataset_path or nil }), "fortune"
  end
  local paths = split_paths(t.dataset_path)
  if #paths == 0 then
    error(("data: training.dataset = %s needs training.dataset_path (comma-separated files)"):format(t.dataset), 0)
  end
  local formats = { text = "text", jsonl = "jsonl", bin = nil }
  if formats[t.dataset] == nil and t.dataset ~= "bin" then
    error(("data: unknown training.dataset '%s'; expected fortunes, text, jsonl or bin"):format(t.dataset), 0)
  end
  for _, p in ipairs(paths) do M.check_file(p, t.dataset) end
  return paths, formats[t.dataset]
end

-- A dataset file is what training.dataset says, by its bytes and not its
-- name: a token file starts with its magic; a text or JSONL corpus holds no
-- NUL byte and is mostly valid UTF-8 in its first 64 KiB (random bytes, a
-- token file or a binary given as text would otherwise train as text).
function M.check_file(path, dataset)
  local f, err = io.open(path, "rb")
  if not f then error(("data: cannot read training.dataset_path file %s: %s"):format(path, tostring(err)), 0) end
  local head = f:read(65536) or ""
  f:close()
  local is_tokens = head:sub(1, 8) == "TTOKENS1"
  if dataset == "bin" then
    if not is_tokens then
      error(("data: training.dataset = bin, but %s is not a Titan token file (it does not start with TTOKENS1); "
        .. "expected a file from `titan data prepare`, or training.dataset = text or jsonl for a corpus"):format(path),
        0)
    end
    return
  end
  if is_tokens then
    error(("data: %s is a Titan token file; expected training.dataset = bin for it (training.dataset = %s reads "
      .. "text)"):format(path, dataset), 0)
  end
  local nul = head:find("\0", 1, true)
  local bad, i, n = 0, 1, #head
  while i <= n do -- (a sequence cut by the 64 KiB boundary counts as valid)
    local c = head:byte(i)
    local len = c < 0x80 and 1 or (c >= 0xC2 and c <= 0xDF) and 2 or (c >= 0xE0 and c <= 0xEF) and 3
      or (c >= 0xF0 and c <= 0xF4) and 4 or 0
    if len == 0 then
      bad, i = bad + 1, i + 1
    else
      local ok = true
      for k = 1, len - 1 do
        local b = head:byte(i + k)
        if b and (b < 0x80 or b > 0xBF) then ok = false end
      end
      if ok then i = i + len else bad, i = bad + 1, i + 1 end
    end
  end
  if nul or (n > 0 and bad > n / 10) then
    error(("data: %s does not look like text (%s in its first %d bytes); expected UTF-8 text for training.dataset "
      .. "= %s"):format(path, nul and ("a NUL byte at offset " .. (nul - 1)) or (bad .. " bytes of invalid UTF-8"),
      n, dataset), 0)
  end
end

function M.build(cfg, tokenizer, dp)
  local t = cfg.training
  local paths, format = M.paths(cfg)
  local train, val = data().loaders({
    paths = paths, tokenizer = tokenizer, format = format, seq_len = t.seq_len, batch_size = t.local_batch_size,
    rank = dp.rank, world = dp.world, seed = t.seed, shuffle = t.shuffle,
    val_fraction = cfg.validation.enable and cfg.validation.split or 0, device = t.device,
  })
  return { train = train, val = val }
end

-- specs: { {name =, weight =, files = {...}, format = "fortune"}, ... }: one
-- text dataset per spec, drawn from by weight (data.Mixture:choose is the
-- Lua function to replace for another sampling rule).
function M.build_mixture(cfg, tokenizer, dp, specs)
  local d, t = data(), cfg.training
  local frac = cfg.validation.enable and cfg.validation.split or 0
  local parts, all = {}, {}
  for i, s in ipairs(specs) do
    if #s.files == 0 then error(("data: mixture part %d (%s) has no files"):format(i, tostring(s.name)), 0) end
    local ds = d.TextDataset(s.files, tokenizer, { seq_len = t.seq_len, rank = dp.rank, world = dp.world,
      format = s.format or "fortune", split = frac > 0 and "train" or nil, val_fraction = frac, name = s.name })
    parts[i] = { ds, s.weight }
    for _, f in ipairs(s.files) do all[#all + 1] = f end
  end
  local train = d.Loader(d.Mixture(parts, t.seed), { batch_size = t.local_batch_size, device = t.device })
  local val
  if frac > 0 then
    val = d.Loader(d.TextDataset(all, tokenizer, { seq_len = t.seq_len, rank = dp.rank, world = dp.world,
      format = specs[1].format or "fortune", split = "val", val_fraction = frac, infinite = false }),
      { batch_size = t.local_batch_size, device = t.device })
  end
  return { train = train, val = val }
end

return M
