-- Data that is not what the config says, and a disk that fills: a token
-- file that is text or random bytes, random bytes or a token file given as
-- text, a token file of a larger vocabulary than the model's, and writes
-- that fail (metrics.jsonl, a checkpoint) part-way: each stops the job with
-- one line, and what was written before stays whole.
local F = dofile("tests/faults/faults.lua")
local sh = F.sh

local function file_of(bytes)
  local path = os.tmpname()
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
  return path
end

-- 64 KiB of seeded random bytes.
local function random_bytes()
  local t, x = {}, 12345
  for i = 1, 65536 do
    x = (x * 1103515245 + 12345) % 2147483648
    t[i] = string.char(math.floor(x / 65536) % 256)
  end
  return table.concat(t)
end

-- A token file of `vocab` holding ids (a Lua list).
local function token_file(vocab, ids)
  local ffi = require("ffi")
  local path = os.tmpname()
  local w = require("titan.data.tokens").TokenWriter.open(path, vocab)
  local buf = ffi.new("int32_t[?]", #ids)
  for i, v in ipairs(ids) do buf[i - 1] = v end
  w:append(buf, #ids, 1)
  w:finish()
  return path
end

local function data_cmd(dataset, path, extra)
  return F.train_cmd(sh.tmpdir(), sh.with({ "--training.dataset=" .. dataset, "--training.dataset_path=" .. path,
    "--training.steps=1" }, extra))
end

describe("a dataset file", function()
  it("given as bin must be a token file: text and random bytes are refused", function()
    for _, bytes in ipairs({ "plain text, not tokens\n", random_bytes() }) do
      local p = file_of(bytes)
      F.fails(data_cmd("bin", p), ("data: training.dataset = bin, but %s is not a Titan token file (it does not "
        .. "start with TTOKENS1); expected a file from `titan data prepare`"):format(p))
      os.remove(p)
    end
  end)

  it("given as text or jsonl must look like text: random bytes and a token file are refused", function()
    local p = file_of(random_bytes())
    for _, ds in ipairs({ "text", "jsonl" }) do
      F.fails(data_cmd(ds, p), ("data: %s does not look like text ("):format(p))
    end
    local utf16 = file_of(("\255\254" .. ("h\0i\0\n\0"):rep(100)))
    F.fails(data_cmd("text", utf16), "does not look like text (a NUL byte at offset 3 in its first 602 bytes)")
    local tok = token_file(2048, { 1, 2, 3, 4, 5 })
    F.fails(data_cmd("text", tok), ("data: %s is a Titan token file; expected training.dataset = bin for it"):format(tok))
    for _, q in ipairs({ p, utf16, tok }) do os.remove(q) end
  end)

  it("of tokens above the model's vocabulary is refused at start, not hours in", function()
    local ids = {}
    for i = 1, 4096 do ids[i] = (i * 7919) % 128256 end
    local tok = token_file(128256, ids)
    F.fails(data_cmd("bin", tok), ("trainer: the token file %s holds tokens of a 128256-token vocabulary but the "
      .. "model's vocab_size is 2048"):format(tok))
    os.remove(tok)
  end)
end)

-- (bash's ulimit -f caps the size of each file the job writes; with SIGXFSZ
-- ignored a write past it fails with EFBIG, as on a full disk)
describe("a write that fails part-way", function()
  it("to metrics.jsonl stops the job with one line and leaves no torn record", function()
    local dump = sh.tmpdir()
    local out = F.fails("trap '' XFSZ; ulimit -f 2; " .. F.train_cmd(dump, { "--training.steps=20" }),
      ("metrics: cannot write %s/metrics.jsonl: File too large; the job stops"):format(dump))
    local m, n = F.metrics(dump) -- (every line parses)
    assert.is_true(n >= 3 and n < 20, out)
    assert.truthy(m[n - 1] and not m[n], out) -- steps 1 .. n-1 after the start event
  end)

  it("to TensorBoard's events or a profiler trace stops the job with one line", function()
    local dump = sh.tmpdir()
    local out = F.fails("trap '' XFSZ; ulimit -f 1; " .. F.train_cmd(dump, { "--training.steps=40",
      "--metrics.enable_jsonl=false", "--metrics.enable_tensorboard=true" }), "File too large")
    assert.truthy(out:find("tensorboard: cannot write " .. dump .. "/tb/", 1, true), out)
    out = F.fails("trap '' XFSZ; ulimit -f 1; " .. F.train_cmd(sh.tmpdir(), { "--training.steps=2",
      "--metrics.enable_jsonl=false", "--profiling.enable_profiling=true", "--profiling.profile_freq=1" }),
      "File too large")
    assert.truthy(out:find("profiler: cannot write ", 1, true), out)
  end)

  it("to a checkpoint stops the job with one line and leaves no partial step behind", function()
    local dump = sh.tmpdir()
    local out = F.fails("trap '' XFSZ; ulimit -f 4096; " .. F.train_cmd(dump, { "--training.steps=3",
      "--checkpoint.enable=true", "--checkpoint.interval=2" }), "File too large")
    assert.truthy(out:find("checkpoint: cannot write ", 1, true), out)
    assert.are.same({}, F.checkpoints(dump))
    local left = sh.run_ok(("ls -A %s/checkpoint"):format(dump))
    assert.are.equal("", left)
    local m = F.metrics(dump)
    assert.truthy(m[2] and not m[3], out)
  end)

  it("in a checkpoint conversion leaves no temporary folder behind", function()
    local dump = sh.tmpdir()
    sh.run_ok(F.train_cmd(dump, { "--training.steps=1", "--checkpoint.enable=true", "--checkpoint.interval=1" }))
    local ck, hf, back = dump .. "/checkpoint/step-1", dump .. "/out/hf", dump .. "/out/ck"
    F.fails(("trap '' XFSZ; ulimit -f 2048; %s ckpt convert --to hf --model-flavor debugmodel %s %s"):format(F.exe, ck,
      hf), "File too large")
    assert.are.equal("", sh.run_ok(("ls -A %s/out"):format(dump)))
    sh.run_ok(("%s ckpt convert --to hf --model-flavor debugmodel %s %s"):format(F.exe, ck, hf))
    F.fails(("trap '' XFSZ; ulimit -f 2048; %s ckpt convert --from hf %s %s"):format(F.exe, hf, back), "File too large")
    assert.are.equal("hf\n", sh.run_ok(("ls -A %s/out"):format(dump)))
  end)
end)
