-- Jobs that meet in one dump folder, and what killed jobs leave behind: a
-- second job in a live job's folder is refused with who holds it; the
-- temporary folders of interrupted saves (single or multi-rank) are removed
-- at the next start of the job, never a live one's.
local F = dofile("tests/faults/faults.lua")
local sh = F.sh

describe("a dump folder", function()
  it("in use by a live job is refused to a second one, naming the holder; free again when it ends", function()
    local dump = sh.tmpdir()
    -- (the first job runs until killed; its first step line says it holds the folder)
    local log = os.tmpname()
    sh.run_ok(("(%s > %s 2>&1 &) ; for i in $(seq 1 300); do grep -q 'step:' %s && break; sleep 0.1; done"):format(
      F.train_cmd(dump, { "--training.steps=100000" }), log, log))
    local out = F.fails(F.train_cmd(dump, { "--training.steps=1" }),
      ("trainer: job.dump_folder %s is in use by another job (pid "):format(dump))
    assert.truthy(out:find("expected a folder of its own (--job.dump_folder=...), or that job to end first", 1, true),
      out)
    local pid = out:match("in use by another job %(pid (%d+) on ")
    sh.run_ok("kill -9 " .. pid .. "; while kill -0 " .. pid .. " 2>/dev/null; do sleep 0.05; done")
    sh.run_ok(F.train_cmd(dump, { "--training.steps=1" }))
    os.remove(log)
  end)
end)

describe("an interrupted save's temporary folders", function()
  for _, launch in ipairs({ "one process", "2 simulated ranks" }) do
    it(("are removed at the job's next start (%s)"):format(launch), function()
      local dump = sh.tmpdir()
      local stale = { ".step-4.tmp-999999", ".purge-step-2-999998" }
      for _, name in ipairs(stale) do
        sh.run_ok(("mkdir -p %s/checkpoint/%s && head -c 100000 /dev/zero > %s/checkpoint/%s/rank-0.bin"):format(dump,
          name, dump, name))
      end
      local cmd = F.train_cmd(dump, { "--training.steps=2", "--checkpoint.enable=true", "--checkpoint.interval=2" })
      if launch ~= "one process" then cmd = cmd:gsub("(/titan) ", "%1 --simulate 2 ", 1) end
      sh.run_ok(cmd)
      assert.are.equal("step-2\n", sh.run_ok(("ls -A %s/checkpoint"):format(dump)))
      assert.are.same({ 2 }, F.checkpoints(dump))
    end)
  end
end)

describe("a rank that stops", function()
  -- (at step 3: the train timeout; in the first step, still the init timeout)
  for _, c in ipairs({ { 3, "train" }, { 1, "init" } }) do
    it(("at step %d stops the job after comm.%s_timeout_seconds, naming the collective; the trace written"):format(
      c[1], c[2]), function()
      if not require("titan.dist").built("mpi") then return pending("titan was built without Open MPI") end
      local dump = sh.tmpdir()
      local cmd = F.train_cmd(dump, { "--training.steps=6", "--checkpoint.enable=true", "--checkpoint.interval=2",
        ("--comm.%s_timeout_seconds=2"):format(c[2]) }, "tests/faults/recipes/freeze_rank.lua", ("TITAN_FAULT_STEP=%d ")
        :format(c[1])):gsub("(/titan) ", "%1 --nproc 2 ", 1)
      local t0 = os.time()
      local out, rc = sh.run((cmd:gsub("OMP_NUM_THREADS=2 ", "OMP_NUM_THREADS=1 timeout 120 ", 1)))
      assert.are.equal(124, rc, out) -- (the rank's exit code, passed on by mpirun)
      assert.is_true(os.time() - t0 < 60, out)
      local _, n = out:gsub(("has waited %%d+ s, more than comm.%s_timeout_seconds = 2: another rank of the group has "
        .. "not reached it %%(stopped, stuck on its device, or in another collective%%); stopping the job; this rank's "
        .. "last %%d+ collectives are in "):format(c[2]) .. dump:gsub("%p", "%%%0") .. "/comm_traces/rank0.jsonl", "")
      assert.are.equal(1, n, out)
      assert.truthy(out:find("titan (rank 0 of 2): ", 1, true), out)
      assert.are.same(c[1] == 3 and { 2 } or {}, F.checkpoints(dump))
      -- the flight recorder: one whole JSON line a collective, the last one still waiting
      local last
      for line in io.lines(dump .. "/comm_traces/rank0.jsonl") do last = require("cjson").decode(line) end
      assert.truthy(last.waiting_seconds >= 2 and last.group:find("[0,1]", 1, true), require("cjson").encode(last))
      -- (no rank left behind, stopped or spinning)
      assert.are.equal("", (sh.run("pgrep -f '[f]reeze_rank.lua'")))
    end)
  end
end)
