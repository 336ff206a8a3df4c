-- titan repl: piped input, the pretty printer, and the prompt driven on a
-- pseudo-terminal (line editing, history, completion) with each line editor.
local env = require("titan.env")
local ffi = require("ffi")
local pretty = require("titan.pretty")
local sh = dofile("tests/lua/shell.lua")

local exe = env.exe or (env.build_dir .. "/titan")

-- Drives a command on a pseudo-terminal: argv[1] the command (run by sh),
-- then steps: "s<bytes>" types, "e<text>" waits until text shows on the
-- screen after what the step before waited for. Prints the screen (escape
-- sequences and \r removed), then __exit=<status>; or __timeout and the step.
-- All of it within 20 s, so a prompt that stops answering fails, not hangs.
local PTY_DRIVER = [=[
import os, pty, re, select, sys, time, fcntl, termios, struct
deadline = time.time() + 20
pid, fd = pty.fork()
if pid == 0:
    os.execvp("sh", ["sh", "-c", sys.argv[1]])
fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0)) # wide: no wrapped lines
raw = b""
def screen():
    t = raw.decode("utf-8", "replace")
    return re.sub(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>78]|[\r\x07]", "", t)
def pump(timeout):  # False at the end of output
    global raw
    if not select.select([fd], [], [], timeout)[0]: return True
    try: data = os.read(fd, 65536)
    except OSError: return False
    raw += data
    return bool(data)
def give_up(why):
    print(screen()); print("__timeout " + why); os.kill(pid, 9); os.waitpid(pid, 0); sys.exit(1)
pos = 0
for step in sys.argv[2:]:
    kind, text = step[0], step[1:]
    if kind == "s":
        # Type only once the line editor reads: it turns canonical mode off
        # (both ends of a pty share one termios). libedit shows its prompt
        # before that, and what comes sooner the kernel cooks (a Ctrl-D is lost).
        while termios.tcgetattr(fd)[3] & termios.ICANON:
            if time.time() > deadline or not pump(0.01): give_up("waiting for the line editor")
        os.write(fd, os.fsencode(text))
        continue
    while True:
        i = screen().find(text, pos)
        if i >= 0:
            pos = i + len(text)
            break
        if time.time() > deadline or not pump(max(0.0, deadline - time.time())): give_up("waiting for %r" % text)
while pump(max(0.0, deadline - time.time())):
    if time.time() > deadline: give_up("waiting for the exit")
_, status = os.waitpid(pid, 0)
print(screen())
print("__exit=%d" % (os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)))
]=]

local function read_file(path)
  local f = io.open(path, "rb")
  if not f then return nil end
  local s = f:read("*a")
  f:close()
  return s
end

local function write_file(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

local function lines_of(s)
  local t = {}
  for line in s:gmatch("([^\n]*)\n") do t[#t + 1] = line end
  return t
end

describe("titan repl", function()
  describe("with piped input", function()
    it("runs statements, prints expressions, reports an error on one line and goes on; exit 0", function()
      local out, rc = sh.run([[printf 'x = 1 + 1\nx\nfor i=1,2 do\nprint(i)\nend\nerror("boom")\nprint("after")\n' | ]]
        .. exe .. " repl")
      assert.are.equal(0, rc, out)
      -- no banner or prompts when stdin is not a terminal: only what the lines print
      assert.are.equal('2\n1\n2\nerror: repl:1: boom\nafter\n', out)
    end)

    it("prints several values, tables pretty, strings quoted; `_` is the last value; syntax errors go on", function()
      local out, rc = sh.run([[printf '1, "two", nil\n{ b = 2, a = { 1, 2 } }\n_.a\nx = = 1\n=3\nreturn\n' | ]]
        .. exe .. " repl")
      assert.are.equal(0, rc, out)
      assert.are.equal('1\t"two"\tnil\n{ a = { 1, 2 }, b = 2 }\n{ 1, 2 }\n'
        .. "error: repl:1: unexpected symbol near '='\n3\n", out)
    end)

    it("reports a statement the input ends inside of", function()
      local out, rc = sh.run([[printf 'function f()\n  return 1\n' | ]] .. exe .. " repl")
      assert.are.equal(0, rc, out)
      assert.are.equal("error: repl:2: 'end' expected (to close 'function' at line 1) near '<eof>'\n", out)
    end)

    it("run(opts) adds opts.env's globals", function()
      local out, rc = sh.run("printf 'rank * 2\\ntitan ~= nil\\n' | " .. exe
        .. [[ -e 'require("titan.repl").run({ env = { rank = 3 } })']])
      assert.are.equal(0, rc, out)
      assert.are.equal("6\ntrue\n", out)
    end)
  end)

  describe("pretty.format", function()
    local f = pretty.format

    it("prints scalars: strings quoted with escapes, numbers read back exactly", function()
      assert.are.equal('"a\\"b\\\\c\\n\\t\\000\\0011"', f('a"b\\c\n\t\0\0011'))
      assert.are.equal('"héllo"', f("héllo"))
      assert.are.equal("0.1", f(0.1))
      assert.are.equal("0.30000000000000004", f(0.1 + 0.2))
      assert.are.equal("9007199254740992", f(2 ^ 53))
      assert.are.equal("-3", f(-3))
      assert.are.equal("inf", f(math.huge))
      assert.are.equal("nan", f(0 / 0))
      assert.are.equal("nil", f(nil))
      assert.are.equal("true", f(true))
    end)

    it("sorts keys: the array part first, then numbers in order, then strings, then the rest", function()
      local t = { "a", "b", zeta = 1, alpha = 2, [10] = 3, [-1] = 4, [2.5] = 5, ["not a name"] = 6, ["end"] = 7,
        [true] = 8 }
      assert.are.equal('{ "a", "b", [-1] = 4, [2.5] = 5, [10] = 3, alpha = 2, ["end"] = 7, ["not a name"] = 6, '
        .. "zeta = 1, [true] = 8 }", f(t, { width = 200 }))
    end)

    it("nests and indents what does not fit on a line, packing the array part", function()
      local t = { name = "llama3", dims = { 256, 512, 1024 },
        training = { steps = 10, lr = 0.0008, dataset = "c4_test", seq_len = 2048, mixed = { param = "bf16" } } }
      assert.are.equal(table.concat({
        "{",
        "  dims = { 256, 512, 1024 },",
        '  name = "llama3",',
        "  training = {",
        '    dataset = "c4_test",',
        "    lr = 0.0008,",
        '    mixed = { param = "bf16" },',
        "    seq_len = 2048,",
        "    steps = 10",
        "  }",
        "}" }, "\n"), f(t, { width = 40 }))
      local a = {}
      for i = 1, 12 do a[i] = i * 100 end
      assert.are.equal("{\n  100, 200, 300, 400, 500,\n  600, 700, 800, 900, 1000,\n  1100, 1200\n}", f(a, { width = 30 }))
    end)

    it("shows a table inside itself as <cycle>, and the same table twice in full", function()
      local t = { name = "t" }
      t.self = t
      t.list = { t }
      assert.are.equal('{ list = { <cycle> }, name = "t", self = <cycle> }', f(t))
      local shared = { 1 }
      assert.are.equal("{ a = { 1 }, b = { 1 } }", f({ a = shared, b = shared }))
    end)

    it("stops at the depth limit (4 by default) with {...}; empty tables stay {}", function()
      assert.are.equal("{ { { { {...} } } } }", f({ { { { { 5 } } } } }))
      assert.are.equal("{ { { { {} } } } }", f({ { { { {} } } } }))
      assert.are.equal("{ a = {...} }", f({ a = { b = 1 } }, { depth = 1 }))
      assert.are.equal("{...}", f({ 1 }, { depth = 0 }))
    end)

    it("truncates a long table with the count left out", function()
      local a = {}
      for i = 1, 150 do a[i] = i end
      local s = f(a)
      local tail = "99, 100,\n  ... (50 more)\n}"
      assert.are.equal(tail, s:sub(-#tail))
      assert.are.equal("{ 1, 2, 3, ... (147 more) }", f(a, { max_items = 3 }))
      assert.are.equal("{ a = 1, b = 2, ... (1 more) }", f({ a = 1, b = 2, c = 3 }, { max_items = 2 }))
    end)

    it("prints values with a __tostring (tensors) and cdata through tostring", function()
      local titan = require("titan")
      local x = titan.ones(2)
      assert.are.equal(tostring(x), f(x))
      assert.are.equal("{ w = " .. tostring(x) .. " }", f({ w = x }, { width = 1000 }))
      local box = setmetatable({}, { __tostring = function() return "<box>" end })
      assert.are.equal("{ <box>, 7LL }", f({ box, ffi.new("int64_t", 7) }))
      local bad = setmetatable({}, { __tostring = function() error("no", 0) end })
      assert.are.equal("<tostring error: no>", f(bad))
    end)
  end)

  describe("on a terminal", function()
    local has_python = select(2, sh.run("command -v python3")) == 0
    local driver, tmp

    setup(function()
      tmp = sh.tmpdir()
      driver = tmp .. "/pty_driver.py"
      write_file(driver, PTY_DRIVER)
    end)
    teardown(function() os.execute("rm -rf " .. sh.quote(tmp)) end)

    -- The screen and the exit status of cmd driven through steps.
    local function drive(cmd, steps)
      local words = { "python3", sh.quote(driver), sh.quote(cmd) }
      for _, s in ipairs(steps) do words[#words + 1] = sh.quote(s) end
      local out = sh.run(table.concat(words, " "))
      assert.falsy(out:find("__timeout", 1, true), out)
      return out, tonumber(out:match("__exit=(%d+)"))
    end

    local function skip_reason(soname)
      if not has_python then return "no python3 here to drive a pseudo-terminal" end
      if not pcall(ffi.load, soname) then return soname .. " is not installed" end
    end

    for _, editor in ipairs({ { "libedit", "libedit.so.2" }, { "readline", "libreadline.so.8" } }) do
      local name, soname = editor[1], editor[2]
      it(("edits, recalls history, completes, goes on after an error and exits on Ctrl-D (%s)"):format(name),
        function()
          local why = skip_reason(soname)
          if why then return pending(why) end
          local hist = tmp .. "/history_" .. name
          -- a full history file: the session's lines push the oldest out
          local old = {}
          for i = 1, 1000 do old[i] = "old" .. i end
          write_file(hist, table.concat(old, "\n") .. "\n")
          local cmd = ("TERM=xterm HOME=%s TITAN_HISTORY=%s TITAN_LINEEDIT=%s %s repl")
            :format(sh.quote(tmp), sh.quote(hist), name, exe)
          local screen, rc = drive(cmd, {
            "e`titan` is loaded", "e> ",
            "sa = 41\r", "e> ",
            "s\27[A", "ea = 41",   -- Up: the line comes back
            "s + 1\r", "e> ",      -- edited: a = 41 + 1
            "sa\r", "e42\n", "e> ",
            "sa\r", "e42\n", "e> ", -- a repeat is one history line
            "sfor i = 1, 2 do\r", "e>> ",
            "sprint(i * 100)\r", "e>> ",
            "send\r", "e100\n200\n", "e> ",
            'serror("boom")\r', "eerror: repl:1: boom\n", "e> ",
            's"af" .. "ter"\r', 'e"after"\n', "e> ",
            "stitan.aran\t", "etitan.arange", -- Tab completes the library's names
            "s(3)\r", "etensor([0., 1., 2.]", "e> ",
            "s\4",
          })
          assert.are.equal(0, rc, screen)
          assert.truthy(screen:find("a = 41 + 1", 1, true), screen)
          assert.truthy(screen:find("titan.arange(3)", 1, true), screen)
          local lines = lines_of(read_file(hist))
          assert.are.equal(1000, #lines)
          assert.are.equal("old10", lines[1])
          assert.are.same({ "a = 41", "a = 41 + 1", "a", "for i = 1, 2 do", "print(i * 100)", "end",
            'error("boom")', '"af" .. "ter"', "titan.arange(3)" }, { unpack(lines, 992) })
        end)
    end

    it("takes run(opts)'s banner, prompt and globals; an empty TITAN_HISTORY keeps none", function()
      local why = skip_reason("libedit.so.2")
      if why then return pending(why) end
      local code = [[require("titan.repl").run({ env = { rank = 3 }, banner = "world of 4 ranks",
        prompt = function(more) return more and "rank 3>> " or "rank 3> " end })]]
      local cmd = ("TERM=xterm HOME=%s TITAN_HISTORY= %s -e %s"):format(sh.quote(tmp), exe, sh.quote(code))
      local screen, rc = drive(cmd, {
        "eworld of 4 ranks\n", "erank 3> ",
        "srank * 2\r", "e6\n", "erank 3> ",
        "sif rank then\r", "erank 3>> ",
        "sprint('r' .. rank) end\r", "er3\n", "erank 3> ",
        "s\4",
      })
      assert.are.equal(0, rc, screen)
      assert.falsy(screen:find("Ctrl-D exits", 1, true), screen)
      assert.is_nil(read_file(tmp .. "/.titan_history"))
    end)
  end)

  describe("--world N RECIPE.lua", function()
    it("lays out the 8B recipe on 64 ranks offline: the mesh, a weight's placements and pieces", function()
      local out = sh.run_ok("printf 'print(mesh)\\nprint(params[\"layers.0.attention.wq.weight\"])\\nrank(63)\\n"
        .. "print(params[\"layers.0.attention.wq.weight\"])\\nprint(memory().total_gib < 2)\\n' | " .. exe
        .. " repl --world 64 lua/recipes/llama3_8b.lua --parallelism.dp_shard=8 --parallelism.tp=8 2>&1")
      assert.truthy(out:find("DeviceMesh 64 ranks: dp_shard 8 x tp 8 (this rank 0: dp_shard 0, tp 0)", 1, true), out)
      assert.truthy(out:find("tp groups (8 groups of 8 ranks): [0-7] [8-15]", 1, true), out)
      assert.truthy(out:find("DTensor(shape=[4096, 4096], dtype=bfloat16, placements=(dp_shard_cp: Shard(1), tp: "
        .. "Shard(1)), order tp > dp_shard_cp; rank 0 holds [64, 4096] at offset [0, 0], no data)", 1, true), out)
      assert.truthy(out:find("rank 63 holds [64, 4096] at offset [4032, 0]", 1, true), out)
      assert.truthy(out:find("\ntrue\n", 1, true), out)
    end)

    it("refuses what the world cannot hold with the trainer's line, and a bad --world", function()
      sh.one_line(exe .. " repl --world 3 lua/recipes/llama3_8b.lua --parallelism.tp=8 </dev/null 2>&1",
        "titan: trainer: parallelism.tp = 8, but the job has 3 rank(s)")
      sh.one_line(exe .. " repl --world zero lua/recipes/llama3_8b.lua </dev/null 2>&1",
        "repl: --world zero; expected a number of ranks >= 1")
      local out = sh.run_ok("printf 'rank(9)\\nprint(mesh:size())\\n' | " .. exe .. " repl --world 4 2>&1")
      assert.truthy(out:find("rank(9): expected a rank from 0 to 3", 1, true), out)
      assert.truthy(out:find("\n4\n", 1, true) or out:find("^4\n") or out:find("\n4$"), out)
    end)
  end)
end)
