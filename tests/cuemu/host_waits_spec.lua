-- What a training step on a GPU asks of the host, counted by cuemu
-- (tests/cuemu/README.md): host waits for the device, device allocations
-- and frees, kernel launches. A GPU runs ahead of the host only as long as
-- the host does not wait for it, so in the steady state an eager step of the
-- trainer waits once (its loss, read back at the step's end, however many
-- micro-batches it accumulates), allocates and
-- frees no device memory (the caching allocator serves every tensor), and a
-- step replayed from CUDA graphs also launches no kernel of its own. A step
-- that logs reads its gradient norm too. Counts, never times. Exits 77
-- (skipped) anywhere but on cuemu.
local ffi = require("ffi")
package.path = "./tests/cuda/?.lua;./tests/cuemu/?.lua;" .. package.path
local S = require("step_helpers")
S.require_cuemu([[
struct tt_emu_counts {
  uint64_t syncs, sync_copies, mallocs, frees, host_allocs, host_frees, kernels;
};
void tt_emu_counts_get(struct tt_emu_counts *out);
]], "tt_emu_counts_get")
local H = require("helpers")

local function counts()
  local c = ffi.new("struct tt_emu_counts")
  ffi.C.tt_emu_counts_get(c)
  local t = {}
  for _, k in ipairs({ "syncs", "sync_copies", "mallocs", "frees", "host_allocs", "host_frees", "kernels" }) do
    t[k] = tonumber(c[k])
  end
  return t
end

local function delta(a, b)
  local d = {}
  for k, v in pairs(b) do d[k] = v - a[k] end
  return d
end

local new_trainer = S.debug_trainer
local function close(tr) S.close(tr, H) end

-- Steps from..to-1 then `to` (which logs): the counts of the unlogged
-- steps, per step, and of the logged one.
local function measure(tr, warm, n)
  tr:train(warm)
  local c0 = counts()
  tr:train(warm + n)
  local c1 = counts()
  tr:train(warm + n + 1)
  local c2 = counts()
  local plain = delta(c0, c1) -- n steps, the last of them logged
  local logged = delta(c1, c2) -- one logged step
  local per = {}
  for k, v in pairs(plain) do
    local rest = (v - logged[k]) / (n - 1) -- the n - 1 unlogged steps
    per[k] = rest
  end
  return per, logged
end

local function show(what, per, logged)
  io.stderr:write(("\n  %s: per unlogged step %s; a logged step %s\n"):format(what,
    require("cjson").encode(per), require("cjson").encode(logged)))
end

describe("a training step's host traffic on a GPU (cuemu's counts)", function()
  local cases = {
    { "f32", {} },
    { "bf16 params + f32 master", { "--training.mixed_precision_param=bfloat16" } },
    -- two micro-batches: their losses stay on the device until the step's one read
    { "2 micro-batches", { "--training.global_batch_tokens=128" } },
  }
  for _, case in ipairs(cases) do
  it("eager, " .. case[1] .. ": one wait (the loss), no device allocation or free", function()
    local tr = new_trainer(case[2])
    local per, logged = measure(tr, 2, 2)
    show("eager " .. case[1], per, logged)
    close(tr)
    assert.are.equal(1, per.syncs, "host synchronizations per step")
    assert.are.equal(1, per.sync_copies, "copies the host waits for per step (the loss)")
    assert.are.equal(0, per.mallocs, "cudaMalloc per step")
    assert.are.equal(0, per.frees, "cudaFree per step")
    assert.are.equal(0, per.host_allocs + per.host_frees, "pinned allocations per step")
    assert.truthy(per.kernels > 50, "an eager step launches its kernels")
    -- logging adds the gradient norm's read-back, nothing else
    assert.are.equal(2, logged.syncs, "host synchronizations of a logged step")
    assert.are.equal(2, logged.sync_copies, "copies the host waits for in a logged step (loss, norm)")
    assert.are.equal(0, logged.mallocs + logged.frees, "allocations or frees of a logged step")
  end)
  end

  it("profiled on the device clock: one more wait a step (the marks, read at its end), no allocation", function()
    local tr, lines = new_trainer({ "--profiling.enable_profiling", "--profiling.profile_freq=1" })
    local per = measure(tr, 2, 2)
    show("profiled, device clock", per, {})
    local log = table.concat(lines, "\n")
    close(tr)
    assert.truthy(log:find("timed region by region on the device (events on its stream", 1, true), log)
    assert.are.equal(2, per.syncs, "host synchronizations per step (the loss, the marks)")
    assert.are.equal(1, per.sync_copies, "copies the host waits for per step (the loss)")
    assert.are.equal(0, per.mallocs + per.frees, "cudaMalloc or cudaFree per step")
    -- the sync plan waits at both edges of every region
    tr, lines = new_trainer({ "--profiling.enable_profiling", "--profiling.profile_freq=1",
      "--profiling.region_timing=sync" })
    per = measure(tr, 2, 2)
    log = table.concat(lines, "\n")
    close(tr)
    assert.truthy(log:find("timed region by region with a device sync at each", 1, true), log)
    assert.truthy(per.syncs > 100, "a sync at every region's edges: " .. per.syncs)
  end)

  it("with training.cuda_graphs: one wait, no allocation, no kernel launched by the host", function()
    local tr, lines = new_trainer({ "--training.cuda_graphs=true" })
    -- step 1 eager, step 2 captures (emptying the shared cache), step 3
    -- refills the cache with the batches' small tensors: steady from step 4
    local per, logged = measure(tr, 3, 2)
    show("cuda graphs", per, logged)
    local log = table.concat(lines, "\n")
    close(tr)
    assert.truthy(log:find("captured forward + backward", 1, true), log)
    assert.truthy(log:find("captured the update of", 1, true), log)
    assert.are.equal(1, per.syncs, "host synchronizations per step")
    assert.are.equal(1, per.sync_copies, "copies the host waits for per step (the loss)")
    assert.are.equal(0, per.mallocs + per.frees + per.host_allocs + per.host_frees, "allocations or frees per step")
    assert.are.equal(0, per.kernels, "kernels launched outside the graphs")
    assert.are.equal(2, logged.syncs, "host synchronizations of a logged step")
    assert.are.equal(0, logged.mallocs + logged.frees, "allocations or frees of a logged step")
  end)
end)
