-- data/token_dataset.lua — windows of pre-tokenized binary files
-- (data/tokens.lua), memory-mapped, read at random.
--
-- In each file (a shard), the stream [base, base + len) (the whole file, or
-- one side of the validation split) holds floor((len - 1) / seq_len)
-- windows of seq_len + 1 tokens, window j starting at base + j * seq_len:
-- the same windows as a TextDataset over the corpus the file was prepared
-- from. Windows never cross files; the shards' windows are numbered one
-- after the other. Each epoch visits them in order, or in a seeded
-- permutation of (seed, epoch); rank r of world w takes positions r, r + w,
-- ... of that order, so the ranks' shares are disjoint and cover every
-- window.
local TokenFile = require("titan.data.tokens").TokenFile
local random = require("titan.data.random")
local split = require("titan.data.split")
local args = require("titan.data.args")

local TokenDataset = {}
TokenDataset.__index = TokenDataset

-- TokenDataset.new(path | TokenFile | {paths or TokenFiles...}, opts)
--   opts.seq_len (required), rank = 0, world = 1, shuffle = false, seed = 0,
--   split = "train" | "val", val_fraction, infinite (default: not val), name
function TokenDataset.new(files, opts)
  opts = opts or {}
  local who = "TokenDataset"
  args.int(opts.seq_len, "seq_len", 1, who)
  local rank, world = args.shard(opts, who)
  local sp, frac = split.check(opts, who)
  local seed = opts.seed or 0
  args.int(seed, "seed", 0, who)
  if type(files) == "string" or getmetatable(files) == TokenFile then files = { files } end
  if type(files) ~= "table" or #files == 0 then error(who .. ": expected a token file or a list of them", 2) end
  local L = opts.seq_len
  local self = setmetatable({
    seq_len = L, rank = rank, world = world, shuffle = opts.shuffle and true or false, seed = seed, split = sp,
    shards = {}, num_windows = 0, tokens = 0,
  }, TokenDataset)
  for i, f in ipairs(files) do
    if type(f) == "string" then f = TokenFile.open(f) end
    if i > 1 and f.header.vocab_size ~= self.shards[1].file.header.vocab_size then
      error(("%s: vocab size %d differs from %s's %d"):format(f.path, f.header.vocab_size,
        self.shards[1].file.path, self.shards[1].file.header.vocab_size), 0)
    end
    local base, len = split.token_range(f:len(), sp, frac)
    local n = len > L and math.floor((len - 1) / L) or 0
    self.shards[i] = { file = f, base = base, first = self.num_windows, windows = n }
    self.num_windows = self.num_windows + n
    self.tokens = self.tokens + len
  end
  self.name = opts.name or (self.shards[1].file.path .. (#files > 1 and (" (+" .. (#files - 1) .. " files)") or ""))
  self.files = #self.shards
  if opts.infinite == nil then self.infinite = sp ~= "val" else self.infinite = opts.infinite end
  if self.num_windows <= rank then
    error(("%s: %d tokens%s make %d window(s) of seq_len + 1 = %d tokens, none for rank %d of world %d")
      :format(self.name, self.tokens, sp and (" in split '" .. sp .. "'") or "", self.num_windows, L + 1, rank, world), 0)
  end
  self:_start_epoch(0)
  return self
end

function TokenDataset:_start_epoch(e)
  self.epoch, self.position = e, 0
  if self.shuffle then
    self.order = random.permutation(self.num_windows, self.seed, e)
  else
    self.order = function(i) return i end
  end
end

-- Windows this rank visits in one epoch.
function TokenDataset:rank_windows()
  return math.floor((self.num_windows - 1 - self.rank) / self.world) + 1
end

-- Where window i (0-based) starts: token index, shard (a TokenFile).
function TokenDataset:window_start(i)
  local sh = self.shards
  local lo, hi = 1, #sh
  while lo < hi do -- the last shard whose first window is <= i
    local mid = math.floor((lo + hi + 1) / 2)
    if sh[mid].first <= i then lo = mid else hi = mid - 1 end
  end
  local s = sh[lo]
  return s.base + (i - s.first) * self.seq_len, s.file
end

-- next_window(dst): this rank's next window (seq_len + 1 tokens, one C
-- call) into the int32 buffer dst; true and its window index, or false at
-- the end of an epoch of a finite dataset.
function TokenDataset:next_window(dst)
  local k = self.rank + self.position * self.world
  if k >= self.num_windows then
    self:_start_epoch(self.epoch + 1)
    if not self.infinite then return false end
    k = self.rank
  end
  self.position = self.position + 1
  local i = self.order(k)
  local start, file = self:window_start(i)
  file:read_into(start, self.seq_len + 1, dst)
  return true, i
end

local KEYS = { "seq_len", "rank", "world", "num_windows", "files", "shuffle", "seed" }

function TokenDataset:state_dict()
  local s = { kind = "tokens", epoch = self.epoch, position = self.position }
  for _, k in ipairs(KEYS) do s[k] = self[k] end
  return s
end

function TokenDataset:load_state_dict(s)
  local current = {}
  for _, k in ipairs(KEYS) do current[k] = self[k] end
  args.state(self.name, s, "tokens", current)
  self:_start_epoch(s.epoch)
  self.position = s.position
end

function TokenDataset:reset() self:_start_epoch(0) end

function TokenDataset:close()
  for _, s in ipairs(self.shards) do s.file:close() end
end

return TokenDataset
