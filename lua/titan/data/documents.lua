-- data/documents.lua — reads documents, in order, from a list of text or
-- JSONL files, and can seek back to any document it has handed out (its
-- position is {file, byte, line, doc}): the loader's checkpoint stores that
-- position instead of re-reading the corpus on resume.
--
-- Formats (per file; `auto` picks by extension, then by content):
--   jsonl       one JSON object per line; the document is its `field` ("text")
--   lines       each non-blank line is a document (HF datasets' text default)
--   paragraphs  blocks separated by blank lines
--   fortune     entries separated by lines holding a single `%` (fortune(6) files)
--   file        the whole file is one document
-- `text` means lines or fortune, by content. Blank documents are skipped.
local cjson_ok, cjson = pcall(require, "cjson")

local M = {}

local Documents = {}
Documents.__index = Documents
M.Documents = Documents

local FORMATS = { jsonl = true, lines = true, paragraphs = true, fortune = true, file = true, text = true, auto = true }
M.FORMATS = FORMATS

local function open_error(path, err)
  local reason = tostring(err):gsub("^" .. path:gsub("%p", "%%%0") .. ": ", "")
  return ("cannot open '%s': %s"):format(path, reason)
end

-- The format of one file under `auto` / `text`.
local function detect(path, fmt)
  if fmt == "auto" then
    local lower = path:lower()
    if lower:match("%.jsonl$") or lower:match("%.ndjson$") or lower:match("%.json$") then return "jsonl" end
  elseif fmt ~= "text" then
    return fmt
  end
  local f = assert(io.open(path, "rb"))
  local head = f:read(65536) or ""
  f:close()
  if ("\n" .. head):find("\n%%\r?\n") then return "fortune" end
  return "lines"
end

-- Documents.new(paths, {format = "auto", field = "text"})
function Documents.new(paths, opts)
  opts = opts or {}
  if type(paths) == "string" then paths = { paths } end
  if type(paths) ~= "table" or #paths == 0 then error("documents: expected a list of input files", 0) end
  local fmt = opts.format or "auto"
  if not FORMATS[fmt] then
    local names = {}
    for k in pairs(FORMATS) do names[#names + 1] = k end
    table.sort(names)
    error(("documents: unknown format '%s' (expected one of %s)"):format(tostring(fmt), table.concat(names, ", ")), 0)
  end
  local self = setmetatable({ paths = {}, formats = {}, sizes = {}, field = opts.field or "text", total = 0 }, Documents)
  for i, p in ipairs(paths) do
    local f, err = io.open(p, "rb")
    if not f then error(open_error(p, err), 0) end
    -- A directory opens fine on Linux; only reading it fails.
    local _, rerr = f:read(1)
    local size = not rerr and f:seek("end")
    f:close()
    if not size then error(("cannot read '%s': %s"):format(p, rerr or "cannot seek"), 0) end
    self.paths[i], self.sizes[i] = p, size
    self.total = self.total + size
    self.formats[i] = detect(p, fmt)
    if self.formats[i] == "jsonl" and not cjson_ok then
      error("reading JSONL needs lua-cjson (apt-get install lua-cjson)", 0)
    end
  end
  if cjson_ok then self.json = cjson.new() end
  self:seek({ file = 1, byte = 0, line = 1, doc = 0 })
  return self
end

function Documents:close()
  if self.fh then self.fh:close() end
  self.fh = nil
end

-- Position of the next document: {file, byte, line, doc}.
function Documents:position()
  return { file = self.file, byte = self.byte, line = self.line, doc = self.doc }
end

function Documents:seek(pos)
  self:close()
  self.file, self.byte, self.line, self.doc = pos.file, pos.byte, pos.line, pos.doc
  self.done_bytes = 0
  for i = 1, math.min(pos.file - 1, #self.paths) do self.done_bytes = self.done_bytes + self.sizes[i] end
  if self.file <= #self.paths then
    local p = self.paths[self.file]
    local f, err = io.open(p, "rb")
    if not f then error(open_error(p, err), 0) end
    if not f:seek("set", self.byte) then error(("cannot seek '%s' to byte %d"):format(p, self.byte), 0) end
    self.fh = f
  end
end

function Documents:rewind() self:seek({ file = 1, byte = 0, line = 1, doc = 0 }) end

-- Bytes read so far over all files (progress reports).
function Documents:bytes_done() return self.done_bytes + self.byte end
function Documents:total_bytes() return self.total end

-- Reads one line (keeping its newline); remembers where it started.
local function read_line(self)
  self.line_byte, self.line_no = self.byte, self.line
  local l = self.fh:read("*L")
  if l then
    self.byte = self.byte + #l
    self.line = self.line + 1
  end
  return l
end

local function chomp(s)
  if s:byte(-1) == 10 then s = s:sub(1, -2) end
  if s:byte(-1) == 13 then s = s:sub(1, -2) end
  return s
end

local function blank(s) return not s:find("%S") end

-- Per format: the next document of the open file and the byte and line
-- where it starts, or nil at the end of the file.
local readers = {}

function readers.lines(self)
  while true do
    local l = read_line(self)
    if not l then return nil end
    l = chomp(l)
    if not blank(l) then return l, self.line_byte, self.line_no end
  end
end

function readers.paragraphs(self)
  local parts, byte, line = {}, nil, nil
  while true do
    local l = read_line(self)
    if not l then break end
    l = chomp(l)
    if not blank(l) then
      if #parts == 0 then byte, line = self.line_byte, self.line_no end
      parts[#parts + 1] = l
    elseif #parts > 0 then
      break
    end
  end
  if #parts == 0 then return nil end
  return table.concat(parts, "\n"), byte, line
end

function readers.fortune(self)
  while true do
    local byte, line = self.byte, self.line
    local parts, sep = {}, false
    while true do
      local l = read_line(self)
      if not l then break end
      if l:match("^%%\r?\n?$") then
        sep = true
        break
      end
      parts[#parts + 1] = l
    end
    local text = chomp(table.concat(parts))
    if not blank(text) then return text, byte, line end
    if not sep then return nil end
  end
end

function readers.file(self)
  if self.byte > 0 then return nil end
  local text = self.fh:read("*a") or ""
  self.byte = #text
  text = chomp(text)
  if blank(text) then return nil end
  return text, 0, 1
end

local function json_error(self, fmt, ...)
  error(("%s:%d: " .. fmt):format(self.paths[self.file], self.line_no, ...), 0)
end

function readers.jsonl(self)
  local json, field = self.json, self.field
  while true do
    local l = read_line(self)
    if not l then return nil end
    if not blank(l) then
      local ok, obj = pcall(json.decode, l)
      if not ok then json_error(self, "not valid JSON (%s)", (tostring(obj):gsub("^.-:%d+: ", ""))) end
      if type(obj) ~= "table" then
        json_error(self, "expected a JSON object with a \"%s\" string field, got %s", field,
          obj == json.null and "null" or type(obj))
      end
      local text = obj[field]
      if type(text) ~= "string" then
        if text == nil then
          local keys = {}
          for k in pairs(obj) do keys[#keys + 1] = tostring(k) end
          table.sort(keys)
          json_error(self, "no \"%s\" string field (keys: %s)", field, #keys > 0 and table.concat(keys, ", ") or "none")
        end
        json_error(self, "the \"%s\" field is %s, not a string", field, text == json.null and "null" or type(text))
      end
      if not blank(text) then return text, self.line_byte, self.line_no end
    end
  end
end

-- next() -> text, position (where this document starts), or nil after the
-- last file.
function Documents:next()
  while self.file <= #self.paths do
    local text, byte, line = readers[self.formats[self.file]](self)
    if text then
      local pos = { file = self.file, byte = byte, line = line, doc = self.doc }
      self.doc = self.doc + 1
      return text, pos
    end
    self:seek({ file = self.file + 1, byte = 0, line = 1, doc = self.doc })
  end
  return nil
end

return M
