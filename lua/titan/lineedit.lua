-- lineedit.lua — reads the lines typed at a prompt: with line editing, history
-- and tab completion through a line-editing library loaded at run time
-- (libedit's readline-compatible API, else GNU readline), or plainly through
-- io.read when neither loads or stdin is not a terminal.
--
-- The libraries are optional run-time dependencies: nothing is linked, so the
-- executable builds and runs without them. The history file is plain text, one
-- line a line, written here rather than by the libraries' write_history: the
-- two libraries' formats differ (libedit escapes spaces as \040 under a
-- header), and a file both can share, that people can grep, is worth more.
local ffi = require("ffi")

local M = {}

M.HISTORY_LINES = 1000 -- the history file keeps the newest this many lines

-- Every name carries a tt_le_ prefix redirected to the real symbol (asm
-- labels): ffi.cdef declarations are global to the process, and another
-- module may declare isatty or free with a different spelling.
ffi.cdef([[
int tt_le_isatty(int fd) __asm__("isatty");
void *tt_le_malloc(size_t n) __asm__("malloc");
void tt_le_free(void *p) __asm__("free");
char *tt_le_readline(const char *prompt) __asm__("readline");
int tt_le_add_history(const char *line) __asm__("add_history");
typedef char **(*tt_le_completer)(const char *text, int start, int end);
extern tt_le_completer tt_le_attempted_completion_function __asm__("rl_attempted_completion_function");
extern int tt_le_attempted_completion_over __asm__("rl_attempted_completion_over");
extern int tt_le_completion_append_character __asm__("rl_completion_append_character");
extern const char *tt_le_basic_word_break_characters __asm__("rl_basic_word_break_characters");
extern const char *tt_le_completer_word_break_characters __asm__("rl_completer_word_break_characters");
extern const char *tt_le_readline_name __asm__("rl_readline_name");
extern char *tt_le_line_buffer __asm__("rl_line_buffer");
]])

-- Which libraries to try, in order; TITAN_LINEEDIT picks one (or `off`).
local LIBRARIES = {
  libedit = { "libedit.so.2", "edit" },
  readline = { "libreadline.so.8", "readline" },
}

-- Strings handed to the libraries must outlive the call: they keep the
-- pointers. Lua-owned buffers anchored here live as long as the process.
local anchors = {}
local function cstring(s)
  local buf = ffi.new("char[?]", #s + 1, s)
  anchors[#anchors + 1] = buf
  return buf
end

-- A copy of s in malloc'd memory: the libraries free what a completer returns.
local function c_strdup(s)
  local p = ffi.cast("char *", ffi.C.tt_le_malloc(#s + 1))
  ffi.copy(p, s) -- copies the terminating zero too
  return p
end

local function load_library(which)
  for _, name in ipairs(LIBRARIES[which]) do
    local ok, lib = pcall(ffi.load, name)
    if ok and pcall(function() return lib.tt_le_readline and lib.tt_le_add_history end) then return lib end
  end
  return nil
end

-- The library named by TITAN_LINEEDIT, or the first that loads: lib, name.
local function pick_library()
  local want = os.getenv("TITAN_LINEEDIT")
  if want == "off" or want == "plain" then return nil end
  if want and want ~= "" then
    if not LIBRARIES[want] then
      io.stderr:write(("titan: TITAN_LINEEDIT=%s: expected libedit, readline or off; reading plainly\n"):format(want))
      return nil
    end
    return load_library(want), want
  end
  for _, name in ipairs({ "libedit", "readline" }) do
    local lib = load_library(name)
    if lib then return lib, name end
  end
  return nil
end

-- The history file's lines, oldest first.
local function read_lines(path)
  local lines, f = {}, io.open(path, "r")
  if not f then return lines end
  for line in f:lines() do lines[#lines + 1] = line end
  f:close()
  return lines
end

-- Rewrites the file with its newest `keep` lines when it has more.
local function trim(path, lines, keep)
  if #lines <= keep then return lines end
  local kept = {}
  for i = #lines - keep + 1, #lines do kept[#kept + 1] = lines[i] end
  local f = io.open(path, "w")
  if f then
    f:write(table.concat(kept, "\n"), "\n")
    f:close()
  end
  return kept
end

-- The history file: TITAN_HISTORY when set (empty: none), else ~/.titan_history.
function M.history_path()
  local p = os.getenv("TITAN_HISTORY")
  if p then return p ~= "" and p or nil end
  local home = os.getenv("HOME")
  return home and home ~= "" and (home .. "/.titan_history") or nil
end

-- The longest prefix that all of list's strings share.
local function common_prefix(list)
  local p = list[1]
  for i = 2, #list do
    local s = list[i]
    local n = 0
    while n < #p and n < #s and p:byte(n + 1) == s:byte(n + 1) do n = n + 1 end
    p = p:sub(1, n)
  end
  return p
end

-- Hooks `complete(word, before)` (before: the line up to the word; returns the
-- words that may replace it) into the library as its attempted-completion
-- function. The library frees the array and strings it gets back.
local function install_completer(lib, complete)
  -- Word boundaries for Lua: '.' and ':' stay inside a word (titan.ones, x:sum)
  -- so the completer sees the whole path.
  local breaks = cstring(" \t\n\"\\'`@$><=;|&{(,+-*/%^#~[])}")
  lib.tt_le_basic_word_break_characters = breaks
  lib.tt_le_completer_word_break_characters = breaks
  local function completer(text, start, _)
    -- No space after a completion (`titan.ones` goes on with `(`, a file
    -- name with its closing quote); GNU readline sets a space back each time.
    lib.tt_le_completion_append_character = 0
    local ok, words = pcall(function()
      local before = lib.tt_le_line_buffer ~= nil and ffi.string(lib.tt_le_line_buffer, start) or ""
      return complete(ffi.string(text), before)
    end)
    if not ok or not words then return nil end -- nil without `over`: the library's file names
    lib.tt_le_attempted_completion_over = 1
    if #words == 0 then return nil end
    local arr = ffi.cast("char **", ffi.C.tt_le_malloc((#words + 2) * ffi.sizeof("char *")))
    -- The libraries' convention: [0] replaces the word (the one match, or what
    -- all share), then the matches to list, then NULL.
    arr[0] = c_strdup(#words == 1 and words[1] or common_prefix(words))
    local n = 1
    if #words > 1 then
      for _, w in ipairs(words) do arr[n] = c_strdup(w); n = n + 1 end
    end
    arr[n] = nil
    return arr
  end
  local cb = ffi.cast("tt_le_completer", completer)
  anchors[#anchors + 1] = cb
  lib.tt_le_attempted_completion_function = cb
end

local Reader = {}
Reader.__index = Reader

-- Opens the reader for stdin. opts.complete: a completer as above (optional);
-- opts.history: the history file (default M.history_path(); false: none).
-- Fields: kind ("libedit", "readline" or "plain"), interactive (stdin is a
-- terminal: the caller shows a banner and prompts only then), history (the
-- file in use, or nil).
function M.open(opts)
  opts = opts or {}
  local self = setmetatable({ kind = "plain", interactive = ffi.C.tt_le_isatty(0) == 1 }, Reader)
  if not self.interactive then return self end
  local lib, name = pick_library()
  if not lib then return self end
  self.lib, self.kind = lib, name
  lib.tt_le_readline_name = cstring("titan") -- for `$if titan` in ~/.inputrc
  if opts.complete then install_completer(lib, opts.complete) end
  local path = opts.history
  if path == nil then path = M.history_path() end
  if path then
    self.history = path
    local lines = trim(path, read_lines(path), M.HISTORY_LINES)
    for _, line in ipairs(lines) do lib.tt_le_add_history(line) end
    self.count, self.last = #lines, lines[#lines]
  end
  return self
end

-- The next line (without its newline), or nil at the end of input (Ctrl-D).
-- prompt is shown only when stdin is a terminal.
function Reader:read(prompt)
  if not self.lib then
    if self.interactive then
      io.write(prompt)
      io.flush()
    end
    return io.read("*l")
  end
  io.flush() -- what the last statement printed comes before the prompt
  -- libedit decodes multibyte characters through the C library's LC_CTYPE,
  -- "C" unless set: take the environment's for the call so UTF-8 typed at the
  -- prompt stays UTF-8, and give the process its own back after.
  local ctype = os.setlocale(nil, "ctype")
  os.setlocale("", "ctype")
  local p = self.lib.tt_le_readline(prompt)
  os.setlocale(ctype, "ctype")
  if p == nil then return nil end
  local line = ffi.string(p)
  ffi.C.tt_le_free(p)
  self:remember(line)
  return line
end
-- The completer is a callback from inside readline(): LuaJIT takes one only
-- when that C call was made by the interpreter, not by a compiled trace
-- ("bad callback"), so the reader is never compiled.
jit.off(Reader.read)

-- Adds line to the history (not blank lines, nor a line repeating the one
-- before) and appends it to the file at once, so a crash or Ctrl-C loses none.
function Reader:remember(line)
  if not line:find("%S") or line == self.last then return end
  self.last = line
  self.lib.tt_le_add_history(line)
  if not self.history then return end
  local f = io.open(self.history, "a")
  if f then
    f:write(line, "\n")
    f:close()
    self.count = self.count + 1
  end
end

-- Ends the session: caps the history file at M.HISTORY_LINES lines.
function Reader:close()
  if self.history and self.count > M.HISTORY_LINES then
    trim(self.history, read_lines(self.history), M.HISTORY_LINES)
  end
end

return M
