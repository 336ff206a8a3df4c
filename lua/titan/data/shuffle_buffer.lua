-- data/shuffle_buffer.lua — shuffles a stream of windows within blocks.
--
-- A streaming dataset (text tokenized on the fly) cannot be permuted as a
-- whole; this reads `size` windows into a block and hands them out in a
-- seeded permutation of (seed, block number). The state is the inner
-- dataset's state at the start of the current block plus the index within
-- it: a resume re-reads that one block and continues exactly.
local ffi = require("ffi")
local random = require("titan.data.random")

local ShuffleBuffer = {}
ShuffleBuffer.__index = ShuffleBuffer

-- ShuffleBuffer.new(ds, {size = N, seed = 0})
function ShuffleBuffer.new(ds, opts)
  opts = opts or {}
  local size, seed = opts.size, opts.seed or 0
  if type(size) ~= "number" or size < 1 or size ~= math.floor(size) then
    error("ShuffleBuffer: size must be an integer >= 1, got " .. tostring(size), 2)
  end
  local row = ds.seq_len + 1
  local self = setmetatable({
    inner = ds, size = size, seed = seed, seq_len = ds.seq_len, row = row, name = ds.name,
    block = ffi.new("int32_t[?]", size * row), ids = {}, count = 0, index = 0, blockno = -1, loaded = false,
  }, ShuffleBuffer)
  return self
end

function ShuffleBuffer:_fill(blockno)
  self.start = self.inner:state_dict()
  self.blockno, self.count, self.index, self.ended = blockno, 0, 0, false
  while self.count < self.size do
    local ok, id = self.inner:next_window(self.block + self.count * self.row)
    if not ok then
      self.ended = true
      break
    end
    self.ids[self.count] = id
    self.count = self.count + 1
  end
  self.perm = random.permutation(self.count, self.seed, blockno)
  self.loaded = true
end

function ShuffleBuffer:next_window(dst)
  if self.loaded and self.index >= self.count and self.ended then
    -- The inner (finite) dataset ended inside this block: report the end once.
    self.loaded, self.count, self.index = false, 0, 0
    self.start = self.inner:state_dict()
    return false
  end
  if not self.loaded or self.index >= self.count then
    self:_fill(self.blockno + 1)
    if self.count == 0 then
      self.loaded = false
      return false
    end
  end
  local j = self.perm(self.index)
  self.index = self.index + 1
  ffi.copy(dst, self.block + j * self.row, self.row * 4)
  return true, self.ids[j]
end

function ShuffleBuffer:state_dict()
  return { kind = "shuffle_buffer", size = self.size, seed = self.seed, block = self.blockno, index = self.index,
    loaded = self.loaded, inner = self.loaded and self.start or self.inner:state_dict() }
end

function ShuffleBuffer:load_state_dict(s)
  require("titan.data.args").state(self.name, s, "shuffle_buffer", { size = self.size, seed = self.seed })
  self.inner:load_state_dict(s.inner)
  if s.loaded then
    self:_fill(s.block)
    self.index = s.index
  else
    self.blockno, self.loaded, self.count, self.index = s.block, false, 0, 0
  end
end

function ShuffleBuffer:reset()
  self.inner:reset()
  self.blockno, self.loaded, self.count, self.index = -1, false, 0, 0
end

return ShuffleBuffer
