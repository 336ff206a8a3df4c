-- What the fault specs share (tests/faults/*_spec.lua; not a spec itself):
-- run the debug model with a fault, and check the three things every bad
-- input and every fault must give: a non-zero exit, one line naming what was
-- wrong and what was expected, and nothing saved before it lost or torn.
-- Load with dofile("tests/faults/faults.lua"): specs run from the source root.
local env = require("titan.env")
local cjson = require("cjson")
local sh = dofile("tests/lua/shell.lua")

local M = { sh = sh, exe = env.build_dir .. "/titan" }

-- A command line training RECIPE (default the debug model) tiny and fast:
-- 32 tokens a step, no validation, no peak measurement, metrics.jsonl on.
function M.train_cmd(dump, extra, recipe, env_pre)
  local args = { recipe or "lua/recipes/llama3_debugmodel.lua", "--job.dump_folder=" .. dump,
    "--metrics.peak_flops=1e11", "--metrics.log_freq=1", "--metrics.enable_jsonl=true", "--training.seq_len=16",
    "--training.local_batch_size=2", "--validation.enable=false", "--lr_scheduler.warmup_steps=2" }
  for _, a in ipairs(extra or {}) do args[#args + 1] = a end
  for i, a in ipairs(args) do args[i] = sh.quote(a) end
  return ("%sOMP_NUM_THREADS=2 %s %s"):format(env_pre or "", M.exe, table.concat(args, " "))
end

-- The lines of out that are not empty.
local function lines(out)
  local l = {}
  for line in out:gmatch("[^\n]+") do
    if line:match("%S") then l[#l + 1] = line end
  end
  return l
end

-- cmd must fail (non-zero exit) with `text` (plain) on its last line, said
-- once. Returns the output.
function M.fails(cmd, text)
  local out, rc = sh.run(cmd)
  assert(rc ~= 0, ("exit 0 from %s:\n%s"):format(cmd, out))
  local l = lines(out)
  assert(#l > 0 and l[#l]:find(text, 1, true), ("the last line of\n%s\nlacks '%s'"):format(out, text))
  local _, n = out:gsub(text:gsub("%p", "%%%0"), "")
  assert(n == 1, ("'%s' said %d times:\n%s"):format(text, n, out))
  return out
end

-- The records of dump/metrics.jsonl, each line whole JSON (a torn line
-- fails), by step.
function M.metrics(dump)
  local by_step, n = {}, 0
  local f = io.open(dump .. "/metrics.jsonl")
  if not f then return by_step, 0 end
  for line in f:lines() do
    local ok, r = pcall(cjson.decode, line)
    assert(ok and type(r) == "table", ("%s/metrics.jsonl: a torn line: %s"):format(dump, line))
    if r.step then by_step[r.step] = r end
    n = n + 1
  end
  f:close()
  return by_step, n
end

-- The step folders of dump/checkpoint, sorted, each whole: `titan ckpt
-- verify` passes (every checksum; no NaN or inf).
function M.checkpoints(dump)
  local fs = require("titan.checkpoint.fs")
  local steps = {}
  local ok, names = pcall(fs.list, dump .. "/checkpoint")
  for _, name in ipairs(ok and names or {}) do
    local s = name:match("^step%-(%d+)$")
    if s then steps[#steps + 1] = tonumber(s) end
  end
  table.sort(steps)
  for _, s in ipairs(steps) do
    local dir = ("%s/checkpoint/step-%d"):format(dump, s)
    local out, rc = sh.run(("%s ckpt verify %s"):format(M.exe, sh.quote(dir)))
    assert(rc == 0 and out:find("every checksum matches", 1, true), out)
  end
  return steps
end

return M
