-- The titan executable: scripts, -e, repl, --version, --help and errors.
local env = require("titan.env")
local exe = env.build_dir .. "/titan"

local run = dofile("tests/lua/shell.lua").run

describe("titan executable", function()
  it("-e runs code with the library", function()
    local out, rc = run(exe .. [[ -e 'print(require("titan").ones(2,3))']])
    assert.are.equal(0, rc)
    assert.truthy(out:find("tensor([[1., 1., 1.],", 1, true))
  end)

  it("runs a script with its arguments", function()
    local path = os.tmpname() .. ".lua"
    local f = assert(io.open(path, "w"))
    f:write('local titan = require("titan"); print(select("#", ...), arg[1], titan.arange(3):sum():item())\n')
    f:close()
    local out, rc = run(exe .. " " .. path .. " hello world")
    os.remove(path)
    assert.are.equal(0, rc)
    assert.truthy(out:find("2\thello\t3"), out)
  end)

  -- `titan test` points TITAN_TEST_TMPDIR at build/test-tmp so the specs' scratch does not pile up in /tmp
  it("os.tmpname makes its files under TITAN_TEST_TMPDIR when it is set; a missing one is one error line",
    function()
      local sh = dofile("tests/lua/shell.lua")
      local dir = sh.tmpdir()
      local out, rc = run("TITAN_TEST_TMPDIR=" .. sh.quote(dir) .. " " .. exe
        .. [[ -e 'local a, b = os.tmpname(), os.tmpname(); print(a, b, io.open(a) ~= nil, a ~= b)']])
      assert.are.equal(0, rc, out)
      local a, b, exists, differ = out:match("^(%S+)	(%S+)	(%S+)	(%S+)")
      assert.are.equal(dir .. "/lua_", a:sub(1, #dir + 5), out)
      assert.are.equal(dir .. "/lua_", b:sub(1, #dir + 5), out)
      assert.are.equal("true", exists, out)
      assert.are.equal("true", differ, out)
      os.execute("rm -rf " .. sh.quote(dir))
      out, rc = run("TITAN_TEST_TMPDIR=" .. sh.quote(dir) .. " " .. exe .. [[ -e 'os.tmpname()']])
      assert.are_not.equal(0, rc)
      assert.truthy(out:find("unable to make a temporary file under TITAN_TEST_TMPDIR: No such file or directory", 1,
        true), out)
    end)

  it("repl evaluates, prints, and keeps going after errors", function()
    local out, rc = run("printf 'x = titan.ones(2)\\nx:sum():item()\\nnosuch.thing()\\nfor i = 1, 2 do\\n  print(i * 10)\\nend\\n1 + 1\\n' | "
      .. exe .. " repl")
    assert.are.equal(0, rc)
    assert.truthy(out:find("\n2\n", 1, true) or out:find("> 2\n", 1, true), out)
    assert.truthy(out:find("error:"), out)
    assert.truthy(out:find("10") and out:find("20"), out)
  end)

  it("--version reports the BLAS choice; --help lists the commands", function()
    local out, rc = run(exe .. " --version")
    assert.are.equal(0, rc)
    assert.truthy(out:find("^titan %d+%.%d+"))
    assert.truthy(out:find("blas: OpenBLAS"))
    -- the MPI library, or why there is none (without starting MPI)
    assert.truthy(out:find(require("titan.dist").built("mpi") and "\nmpi: Open MPI v%d" or "\nmpi: not built"), out)
    out, rc = run(exe .. " --help")
    assert.are.equal(0, rc)
    assert.truthy(out:find("titan repl") and out:find("titan test") and out:find("titan --nproc N", 1, true))
    -- every subcommand written in Lua (lua/titan/cli/<name>.lua) is listed, here and in docs/cli.md
    local f = assert(io.open("docs/cli.md"))
    local doc = f:read("*a")
    f:close()
    local p = assert(io.popen("ls lua/titan/cli"))
    local n = 0
    for file in p:lines() do
      local name = file:match("^(.+)%.lua$")
      if name then
        n = n + 1
        assert.truthy(out:find("titan " .. name .. " ", 1, true), name .. " in titan --help")
        assert.truthy(doc:find("`titan " .. name .. " ", 1, true), name .. " in docs/cli.md")
      end
    end
    p:close()
    assert.truthy(n >= 4, "found the subcommands")
  end)

  it("a missing script and a failing script exit non-zero with one line", function()
    local out, rc = run(exe .. " /nonexistent/recipe.lua")
    assert.are.equal(1, rc)
    assert.truthy(out:find("cannot read script '/nonexistent/recipe.lua'", 1, true))
    out, rc = run(exe .. [[ -e 'error("boom")']])
    assert.are.equal(1, rc)
    assert.are.equal("titan: (command line):1: boom\n", out)
  end)
end)
