-- data/text_dataset.lua — text and JSONL files tokenized on the fly.
--
-- Documents are read in order, tokenized, and packed into one stream with
-- BOS before and EOS after each (TorchTitan's packing); the stream is cut
-- into windows of seq_len + 1 tokens that overlap by one (window k starts at
-- token k * seq_len), so inputs = window[1..T] and targets = window[2..T+1].
-- A tail shorter than a window is dropped; the next epoch starts again at
-- the first document. Rank r of world w takes windows k = r, r + w, ...:
-- every rank reads and tokenizes the whole corpus (fine for small corpora;
-- prepare large ones with `titan data prepare`).
--
-- The position is (epoch, window, the document the next window starts in,
-- and the offset into that document's tokens): a checkpoint resumes by
-- seeking to that document, not by re-reading everything before it.
local ffi = require("ffi")
local Documents = require("titan.data.documents").Documents
local split = require("titan.data.split")
local args = require("titan.data.args")

local TextDataset = {}
TextDataset.__index = TextDataset

-- TextDataset.new(paths, tokenizer, opts)
--   opts.seq_len (required), rank = 0, world = 1, split = "train" | "val",
--   val_fraction, infinite (default: not the val split), bos = true,
--   eos = true, format = "auto", field = "text", name
function TextDataset.new(paths, tokenizer, opts)
  opts = opts or {}
  local who = "TextDataset"
  if type(tokenizer) ~= "table" or type(tokenizer.encode) ~= "function" then
    error(who .. ": expected a tokenizer with :encode (titan.tokenizer)", 2)
  end
  args.int(opts.seq_len, "seq_len", 1, who)
  if opts.shuffle then
    error(who .. ": documents stream in order; wrap the dataset in data.ShuffleBuffer(ds, {size = N}) to shuffle "
      .. "windows, or prepare a binary file (titan data prepare) for a full shuffle", 2)
  end
  local rank, world = args.shard(opts, who)
  local sp, frac = split.check(opts, who)
  if type(paths) == "string" then paths = { paths } end
  if type(paths) ~= "table" or #paths == 0 then error(who .. ": expected a path or a list of paths", 2) end
  local self = setmetatable({
    seq_len = opts.seq_len,
    rank = rank,
    world = world,
    split = sp,
    val_fraction = frac,
    tokenizer = tokenizer,
    docs = Documents.new(paths, { format = opts.format, field = opts.field }),
    name = opts.name or paths[1],
    encode_opts = {
      bos = opts.bos ~= false and tokenizer.bos_id ~= nil,
      eos = opts.eos ~= false and tokenizer.eos_id ~= nil,
    },
  }, TextDataset)
  if opts.infinite == nil then self.infinite = sp ~= "val" else self.infinite = opts.infinite end
  self.cap = math.max(4 * (self.seq_len + 1), 4096)
  self.buf = ffi.new("int32_t[?]", self.cap)
  self:_start_epoch(0)
  return self
end

-- Pending tokens live in buf[head, tail); queue[qfirst..qlast] are the
-- documents they come from ({pos, n}), the first already `off` tokens in.
function TextDataset:_clear()
  self.head, self.tail = 0, 0
  self.queue, self.qfirst, self.qlast, self.off = {}, 1, 0, 0
end

function TextDataset:_start_epoch(e)
  self.epoch, self.window = e, 0
  self:_clear()
  self.docs:rewind()
end

function TextDataset:_append(ids, n)
  if self.tail + n > self.cap then
    local live = self.tail - self.head
    if live + n <= self.cap and self.head >= live then
      -- Compact in place: source and destination do not overlap.
      ffi.copy(self.buf, self.buf + self.head, live * 4)
    else
      local cap = self.cap
      while cap < 2 * (live + n) do cap = cap * 2 end
      local nb = ffi.new("int32_t[?]", cap)
      ffi.copy(nb, self.buf + self.head, live * 4)
      self.buf, self.cap = nb, cap
    end
    self.head, self.tail = 0, live
  end
  ffi.copy(self.buf + self.tail, ids, n * 4)
  self.tail = self.tail + n
end

-- Reads, tokenizes and appends the next document of the split; false at
-- the end of the corpus.
function TextDataset:_fetch()
  while true do
    local text, pos = self.docs:next()
    if not text then return false end
    if split.keep_doc(pos.doc, self.split, self.val_fraction) then
      local ids, n = self.tokenizer:encode(text, self.encode_opts)
      if n > 0 then
        self:_append(ids, n)
        self.qlast = self.qlast + 1
        self.queue[self.qlast] = { pos = pos, n = n }
        return true
      end
    end
  end
end

function TextDataset:_advance(n)
  self.head = self.head + n
  local off, q = self.off + n, self.queue
  while self.qfirst <= self.qlast and off >= q[self.qfirst].n do
    off = off - q[self.qfirst].n
    q[self.qfirst] = nil
    self.qfirst = self.qfirst + 1
  end
  self.off = off
end

-- next_window(dst): writes this rank's next window (seq_len + 1 int32
-- tokens) to dst. Returns true and the window's index in its epoch, or
-- false at the end of an epoch of a finite dataset.
function TextDataset:next_window(dst)
  local need = self.seq_len + 1
  while true do
    while self.tail - self.head < need do
      if not self:_fetch() then
        local seen = self.window
        if seen <= self.rank then
          error(("%s: an epoch has %d window(s) of seq_len + 1 = %d tokens, none for rank %d of world %d "
            .. "(the corpus%s is too small)"):format(self.name, seen, need, self.rank, self.world,
              self.split and (" split '" .. self.split .. "'") or ""), 0)
        end
        self:_start_epoch(self.epoch + 1)
        if not self.infinite then return false end
      end
    end
    local k = self.window
    self.window = k + 1
    local mine = k % self.world == self.rank
    if mine then ffi.copy(dst, self.buf + self.head, need * 4) end
    self:_advance(self.seq_len)
    if mine then return true, k end
  end
end

function TextDataset:state_dict()
  local pos = self.qfirst <= self.qlast and self.queue[self.qfirst].pos or self.docs:position()
  return {
    kind = "text", epoch = self.epoch, window = self.window,
    file = pos.file, byte = pos.byte, line = pos.line, doc = pos.doc, offset = self.off,
    seq_len = self.seq_len, rank = self.rank, world = self.world, files = #self.docs.paths,
  }
end

function TextDataset:load_state_dict(s)
  args.state(self.name, s, "text",
    { seq_len = self.seq_len, rank = self.rank, world = self.world, files = #self.docs.paths })
  self.epoch, self.window = s.epoch, s.window
  self:_clear()
  self.docs:seek({ file = s.file, byte = s.byte, line = s.line, doc = s.doc })
  if s.offset > 0 then
    if not self:_fetch() or self.queue[self.qfirst].n <= s.offset or self.queue[self.qfirst].pos.doc ~= s.doc then
      error(("%s: the saved loader state points at document %d, offset %d, which this corpus does not have")
        :format(self.name, s.doc, s.offset), 0)
    end
    self.head, self.off = s.offset, s.offset
  end
end

-- Back to the first window of epoch 0.
function TextDataset:reset() self:_start_epoch(0) end

function TextDataset:close() self.docs:close() end

return TextDataset
