-- TensorBoard event files (lua/titan/tensorboard.lua): the bytes against
-- the official writer's, the reader's checks, and a training run with
-- metrics.enable_tensorboard (its scalars against metrics.jsonl's).
local tb = require("titan.tensorboard")
local env = require("titan.env")
local cjson = require("cjson")
local ffi = require("ffi")
local sh = dofile("tests/lua/shell.lua")

local function hex(s) return (s:gsub(".", function(c) return ("%02x"):format(c:byte()) end)) end
local function unhex(h) return (h:gsub("%x%x", function(b) return string.char(tonumber(b, 16)) end)) end

local function esc(s) return (s:gsub("%p", "%%%0")) end -- a path as a literal Lua pattern

local f32 = ffi.new("float[1]")
local function as_float(v) f32[0] = v; return tonumber(f32[0]) end

local tmpdir = sh.tmpdir

local function write_file(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end

describe("tensorboard event files", function()
  it("CRC-32C of the standard check string", function()
    assert.are.equal(0xe3069283, tb.crc32c("123456789"))
    assert.are.equal(0, tb.crc32c(""))
  end)

  it("writes the bytes TensorBoard's own RecordWriter writes for the same events", function()
    -- From tensorboard 2.20 (PyPI), event_pb2.Event / summary_pb2.Summary
    -- serialized and framed by tensorboard.summary.writer.record_writer:
    -- Event(wall_time=1.5, file_version="brain.Event:2"), then
    -- Event(wall_time=1700000000.25, step=300, summary={loss_metrics/global_avg_loss: 2.25, lr: 3e-4}).
    local official = "1800000000000000a37f4b2209000000000000f83f1a0d627261696e2e4576656e743a322a28646c3e00000000"
      .. "000000d9d240e70900001040fc54d94110ac022a300a230a1c6c6f73735f6d6574726963732f676c6f62616c5f6176675f6c6f"
      .. "737315000010400a090a026c721552499d39f76c49cf"
    local ours = tb.record(tb.encode_event({ wall_time = 1.5, file_version = "brain.Event:2" }))
      .. tb.record(tb.encode_event({ wall_time = 1700000000.25, step = 300,
        values = { { "loss_metrics/global_avg_loss", 2.25 }, { "lr", 3e-4 } } }))
    assert.are.equal(official, hex(ours))
    -- and the reader reads the official bytes back
    local d = tmpdir()
    write_file(d .. "/official", unhex(official))
    local evs = tb.read(d .. "/official")
    assert.are.equal(2, #evs)
    assert.are.equal("brain.Event:2", evs[1].file_version)
    assert.are.equal(1.5, evs[1].wall_time)
    assert.are.equal(300, evs[2].step)
    assert.are.equal(2.25, evs[2].values["loss_metrics/global_avg_loss"])
    assert.are.equal(as_float(3e-4), evs[2].values.lr)
    os.execute("rm -rf '" .. d .. "'")
  end)

  it("a writer's file reads back (floats as float32, NaN and inf kept); a second writer never reuses the name",
    function()
      local d = tmpdir()
      local t = 1000
      local w = tb.Writer(d, { now = function() t = t + 0.5; return t end })
      assert.truthy(w.path:find("^" .. esc(d) .. "/events%.out%.tfevents%.%d+%..+%.0$"), w.path)
      w:scalars(1, { loss = 7.61234567, lr = 1e-4 })
      w:scalars(2, { loss = 0 / 0, grad_norm = math.huge, note = "strings are not scalars" })
      w:scalars(3, {}) -- nothing to write
      local w2 = tb.Writer(d)
      assert.are_not.equal(w.path, w2.path)
      w2:close()
      w:close()
      assert.has_error(function() w:scalars(4, { loss = 1 }) end)
      local evs = tb.read(w.path)
      assert.are.equal(3, #evs)
      assert.are.equal("brain.Event:2", evs[1].file_version)
      assert.are.same({ 1000.5, 1001, 1001.5 }, { evs[1].wall_time, evs[2].wall_time, evs[3].wall_time })
      assert.are.equal(1, evs[2].step)
      assert.are.same({ loss = as_float(7.61234567), lr = as_float(1e-4) }, evs[2].values)
      assert.is_true(evs[3].values.loss ~= evs[3].values.loss)
      assert.are.equal(math.huge, evs[3].values.grad_norm)
      assert.is_nil(evs[3].values.note)
      os.execute("rm -rf '" .. d .. "'")
    end)

  it("a damaged or cut file fails with the record and what is wrong", function()
    local d = tmpdir()
    local w = tb.Writer(d)
    w:scalars(5, { loss = 3 })
    w:close()
    local f = assert(io.open(w.path, "rb"))
    local s = f:read("*a")
    f:close()
    local n1 = #tb.record(tb.encode_event({ wall_time = 0, file_version = "brain.Event:2" }))
    write_file(d .. "/flipped", s:sub(1, n1 + 20) .. string.char((s:byte(n1 + 21) + 1) % 256) .. s:sub(n1 + 22))
    local ok, err = pcall(tb.read, d .. "/flipped")
    assert.is_false(ok)
    assert.truthy(err:find("record 2: the data's CRC does not match", 1, true), err)
    write_file(d .. "/cut", s:sub(1, #s - 3))
    ok, err = pcall(tb.read, d .. "/cut")
    assert.is_false(ok)
    assert.truthy(err:find("record 2 is truncated", 1, true), err)
    ok, err = pcall(tb.read, d .. "/missing")
    assert.is_false(ok)
    assert.truthy(err:find("tensorboard: cannot open " .. d .. "/missing", 1, true), err)
    os.execute("rm -rf '" .. d .. "'")
  end)
end)

describe("metrics.enable_tensorboard in training", function()
  local exe = env.build_dir .. "/titan"
  local function run(args)
    return sh.run(exe .. " lua/recipes/llama3_debugmodel.lua --training.steps=4 --training.seq_len=64 "
      .. "--training.local_batch_size=2 --metrics.peak_flops=1e11 --metrics.log_freq=2 " .. args)
  end

  it("rank 0 writes each logged step's scalars and the validation loss, as metrics.jsonl has them", function()
    local dump = tmpdir()
    local out, rc = run("--job.dump_folder=" .. dump .. " --metrics.enable_tensorboard --validation.enable "
      .. "--validation.freq=2 --validation.steps=1")
    assert.are.equal(0, rc, out)
    local path = out:match("metrics: TensorBoard events in (%S+)")
    assert.truthy(path, out)
    assert.truthy(path:find("^" .. esc(dump) .. "/tb/%d%d%d%d%d%d%d%d%-%d%d%d%d/events%.out%.tfevents%."), path)
    local evs = tb.read(path)
    local by_step, val = {}, {}
    for _, e in ipairs(evs) do
      if e.values and e.values["loss_metrics/global_avg_loss"] then by_step[e.step] = e.values end
      if e.values and e.values["validation_metrics/loss"] then val[e.step] = e.values["validation_metrics/loss"] end
    end
    local jf = assert(io.open(dump .. "/metrics.jsonl"))
    local logged = 0
    for line in jf:lines() do
      local r = cjson.decode(line)
      if r.loss then
        logged = logged + 1
        local v = by_step[r.step]
        assert.truthy(v, "step " .. r.step .. " in the event file")
        for field, tag in pairs(require("titan.metrics").tensorboard_tags) do
          if r[field] ~= nil then assert.are.equal(as_float(r[field]), v[tag], tag) end
        end
      elseif r.validation_loss then
        assert.are.equal(as_float(r.validation_loss), val[r.step], "validation at step " .. r.step)
      end
    end
    jf:close()
    assert.are.equal(3, logged) -- steps 1, 2, 4 (log_freq 2, the first and the last)
    assert.truthy(val[2] and val[4], cjson.encode(val))
    os.execute("rm -rf '" .. dump .. "'")
  end)

  it("a folder that cannot be made stops the run before its first step, with one line", function()
    local file = os.tmpname() -- a file where a folder would go
    local out, rc = run("--job.dump_folder=" .. file .. "-d --metrics.enable_tensorboard --metrics.save_tb_folder="
      .. file .. "/tb")
    assert.are.equal(1, rc, out)
    assert.truthy(out:find("trainer: metrics.save_tb_folder: cannot create folder " .. file .. "/tb", 1, true), out)
    assert.is_nil(out:find("step:", 1, true), out)
    out, rc = run("--job.dump_folder=" .. file .. "-d --metrics.save_tb_folder=")
    assert.are.equal(1, rc, out)
    assert.truthy(out:find("metrics.save_tb_folder is empty; expected a folder name under job.dump_folder", 1, true),
      out)
    os.remove(file)
    os.execute("rm -rf '" .. file .. "-d'")
  end)
end)
