-- data/tokens.lua — binary token files (engine/dataset.c, docs/data.md):
-- TokenFile reads a memory-mapped file, TokenWriter writes one through a
-- temporary name that is renamed into place by :finish().
local tffi = require("titan.ffi")
local tensor = require("titan.tensor")
local ffi, C, check = tffi.ffi, tffi.C, tffi.check

local M = {}

-- ---- reading ----------------------------------------------------------------

local TokenFile = {}
TokenFile.__index = TokenFile
M.TokenFile = TokenFile

local handle_out = ffi.new("tt_tokens*[1]")
local header_buf = ffi.new("tt_tokens_header")

function TokenFile.open(path)
  if type(path) ~= "string" then error("TokenFile.open: expected a path, got " .. type(path), 2) end
  handle_out[0] = nil
  if C.tt_tokens_open(path, handle_out) ~= 0 then error(ffi.string(C.tt_last_error()), 0) end
  local self = setmetatable({ path = path, _c = ffi.gc(handle_out[0], C.tt_tokens_close) }, TokenFile)
  check(C.tt_tokens_describe(self._c, header_buf))
  self.header = {
    version = tonumber(header_buf.version),
    token_bytes = tonumber(header_buf.token_bytes),
    dtype = header_buf.token_bytes == 2 and "uint16" or "uint32",
    num_tokens = tonumber(header_buf.num_tokens),
    num_docs = tonumber(header_buf.num_docs),
    vocab_size = tonumber(header_buf.vocab_size),
    header_bytes = tonumber(header_buf.header_bytes),
  }
  return self
end

local function handle(self)
  if self._c == nil then error("token file '" .. self.path .. "' was already closed", 3) end
  return self._c
end

function TokenFile:len() return tonumber(C.tt_tokens_len(handle(self))) end

-- Tokens [start, start + len) (0-based) into an int32/int64 buffer: one C call.
function TokenFile:read_into(start, len, dst, dtype)
  local d = (dtype == nil or dtype == "int32") and C.TT_I32 or C.TT_I64
  if C.tt_tokens_read(handle(self), start, len, d, dst) ~= 0 then error(ffi.string(C.tt_last_error()), 2) end
end

-- Tokens [start, start + len) as a new 1-D tensor (int64 unless opts.dtype).
function TokenFile:read(start, len, opts)
  opts = opts or {}
  local t = tensor.empty({ len }, { dtype = opts.dtype or "int64" })
  if C.tt_tokens_read_tensor(handle(self), start, len, t._c, 0) ~= 0 then
    local msg = ffi.string(C.tt_last_error())
    t:free()
    error(msg, 2)
  end
  return t
end

-- Tokens [start, start + len) as a Lua table (inspection, tests).
function TokenFile:read_table(start, len)
  local buf = ffi.new("int32_t[?]", math.max(len, 1))
  self:read_into(start, len, buf)
  local out = {}
  for i = 0, len - 1 do out[i + 1] = buf[i] end
  return out
end

function TokenFile:close()
  if self._c ~= nil then
    local c = self._c
    self._c = nil
    ffi.gc(c, nil)
    C.tt_tokens_close(c)
  end
end

-- ---- writing ----------------------------------------------------------------

local TokenWriter = {}
TokenWriter.__index = TokenWriter
M.TokenWriter = TokenWriter

local writer_out = ffi.new("tt_tokens_writer*[1]")

-- TokenWriter.open(path, vocab_size[, token_bytes]): token_bytes 2 or 4,
-- chosen from the vocabulary size when omitted.
function TokenWriter.open(path, vocab_size, token_bytes)
  writer_out[0] = nil
  if C.tt_tokens_writer_open(path, vocab_size, token_bytes or 0, writer_out) ~= 0 then
    error(ffi.string(C.tt_last_error()), 0)
  end
  -- The finalizer aborts: a writer dropped without finish() leaves no file.
  local self = setmetatable({ path = path, _c = ffi.gc(writer_out[0], C.tt_tokens_writer_abort),
    num_tokens = 0, num_docs = 0 }, TokenWriter)
  self.temp_path = ffi.string(C.tt_tokens_writer_temp_path(self._c))
  return self
end

local function writer_handle(self)
  if self._c == nil then error("token writer for '" .. self.path .. "' was already finished or aborted", 3) end
  return self._c
end

-- Appends n tokens from an int32_t buffer; they complete `docs` documents.
function TokenWriter:append(ids, n, docs)
  if C.tt_tokens_writer_append(writer_handle(self), ids, n, docs or 0) ~= 0 then
    error(ffi.string(C.tt_last_error()), 0)
  end
  self.num_tokens = self.num_tokens + n
  self.num_docs = self.num_docs + (docs or 0)
end

local function release(self)
  local c = self._c
  self._c = nil
  ffi.gc(c, nil)
  return c
end

function TokenWriter:finish()
  writer_handle(self)
  local c = release(self)
  if C.tt_tokens_writer_finish(c) ~= 0 then error(ffi.string(C.tt_last_error()), 0) end
end

function TokenWriter:abort()
  if self._c ~= nil then C.tt_tokens_writer_abort(release(self)) end
end

return M
