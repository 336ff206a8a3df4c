-- Checkpoints: the reshard math, sharded save/load across layouts (uneven
-- splits, f32 into bf16), the train state (bit-exact resume), the manager
-- (interval, keep_latest_k, load_step, exclusions, model-only and seed
-- saves, async), failures that name the file and tensor and modify
-- nothing, a writer killed with SIGKILL, SIGTERM at a step boundary, and
-- `titan ckpt`.
local titan = require("titan")
local llama3 = require("models.llama3")
local optim = require("titan.optim")
local ckpt = require("titan.checkpoint")
local layout = require("titan.checkpoint.layout")
local format = require("titan.checkpoint.format")
local json = require("titan.checkpoint.json")
local fs = require("titan.checkpoint.fs")
local env = require("titan.env")

local EXE = env.build_dir .. "/titan"

local FLAVOR = { dim = 32, n_layers = 2, n_heads = 4, n_kv_heads = 2, multiple_of = 16, vocab_size = 61,
  max_seq_len = 32 }

local root = ("/tmp/titan_ckpt_spec.%d"):format(fs.pid())
local counter = 0
local function tmpdir()
  counter = counter + 1
  local d = ("%s/%d"):format(root, counter)
  fs.mkdirs(d)
  return d
end

local shell = dofile("tests/lua/shell.lua")
local sh_quote = shell.quote

-- rc first, as this spec reads it
local function run(cmd)
  local out, rc = shell.run(cmd)
  return rc, out
end

local function write(path, text)
  local f = assert(io.open(path, "wb"))
  f:write(text)
  f:close()
end

-- Every file under dir (one level of folders) -> its bytes.
local function snapshot(dir)
  local out = {}
  for _, name in ipairs(fs.list(dir)) do
    local p = fs.join(dir, name)
    if fs.is_dir(p) then
      for k, v in pairs(snapshot(p)) do out[name .. "/" .. k] = v end
    else
      out[name] = fs.read_file(p)
    end
  end
  return out
end

local function same_tensor(a, b)
  return a:dtype() == b:dtype() and table.concat(a:shape(), ",") == table.concat(b:shape(), ",")
    and table.concat(a:tolist_flat(), ",") == table.concat(b:tolist_flat(), ",")
end

local function model(seed, flavor)
  return llama3.build(flavor or FLAVOR, { seed = seed })
end

-- One optimizer step on a fixed batch; returns the loss.
local function train_step(m, opt)
  local ids = titan.tensor({ { 1, 5, 9, 13, 17, 21, 25, 29 } }, { dtype = "int64" })
  local tgt = titan.tensor({ 5, 9, 13, 17, 21, 25, 29, 33 }, { dtype = "int64" })
  local loss = titan.scope(function()
    local l = titan.F.cross_entropy(m(ids):reshape(-1, m.args.vocab_size), tgt)
    l:backward()
    return l:item()
  end)
  opt:step()
  opt:zero_grad()
  return loss
end

-- A data loader stand-in: its position is an opaque table.
local function loader(pos)
  return {
    pos = pos, epoch = 1,
    state_dict = function(self) return { pos = self.pos, epoch = self.epoch, nested = { "a", 1.5 } } end,
    load_state_dict = function(self, s) self.pos, self.epoch, self.loaded = s.pos, s.epoch, s end,
  }
end

local function one_line(err)
  err = tostring(err)
  return not err:find("\n") and err
end

setup(function() fs.mkdirs(root) end)
teardown(function() fs.remove_all(root) end)

describe("checkpoint layout math", function()
  it("splits like torch.chunk: ceil-sized parts, the last smaller, trailing parts empty", function()
    local parts = {}
    for i = 0, 2 do parts[#parts + 1] = { layout.chunk(7, 3, i) } end
    assert.are.same({ { 0, 3 }, { 3, 3 }, { 6, 1 } }, parts)
    parts = {}
    for i = 0, 3 do parts[#parts + 1] = { layout.chunk(7, 4, i) } end
    assert.are.same({ { 0, 2 }, { 2, 2 }, { 4, 2 }, { 6, 1 } }, parts)
    parts = {}
    for i = 0, 3 do parts[#parts + 1] = { layout.chunk(2, 4, i) } end
    assert.are.same({ { 0, 1 }, { 1, 1 }, { 2, 0 }, { 2, 0 } }, parts)
    local o, s = layout.shard_box({ 7, 10 }, 2, 3, 2)
    assert.are.same({ 0, 8 }, o)
    assert.are.same({ 7, 2 }, s)
    assert.are.equal(6, #layout.grid_boxes({ 7, 10 }, { 2, 3 }))
  end)

  it("finds the overlaps of a wanted box with stored chunks, in chunk and destination coordinates", function()
    local chunks = {}
    for i = 0, 3 do
      local o, s = layout.shard_box({ 7, 10 }, 1, 4, i)
      chunks[#chunks + 1] = { offset = o, size = s, id = i }
    end
    -- a column shard (cols 4..7) crosses every row chunk
    local reads, covered = layout.plan_reads(chunks, { 0, 4 }, { 7, 4 })
    assert.are.equal(4, #reads)
    assert.are.equal(28, covered)
    assert.are.same({ 0, 4 }, reads[2].start)
    assert.are.same({ 2, 0 }, reads[2].dst)
    assert.are.same({ 2, 4 }, reads[2].count)
    assert.is_false(reads[2].whole)
    -- rows 2..5 whole: chunks 1 and 2, both whole
    reads, covered = layout.plan_reads(chunks, { 2, 0 }, { 4, 10 })
    assert.are.equal(2, #reads)
    assert.is_true(reads[1].whole and reads[2].whole)
    assert.are.equal(40, covered)
    -- a missing chunk shows in the covered volume
    table.remove(chunks, 3)
    local _, c = layout.plan_reads(chunks, { 0, 0 }, { 7, 10 })
    assert.are.equal(50, c)
  end)

  it("writes a replicated box once, from the lowest rank", function()
    local keep = layout.dedup({
      { { name = "w", offset = { 0 }, size = { 4 } }, { name = "b", offset = { 0 }, size = { 2 } } },
      { { name = "w", offset = { 4 }, size = { 4 } }, { name = "b", offset = { 0 }, size = { 2 } } },
    })
    assert.are.same({ true, true }, { keep[1][1], keep[1][2] })
    assert.is_true(keep[2][1])
    assert.is_nil(keep[2][2])
  end)

  it("JSON round-trips doubles exactly, sorts keys and keeps empty arrays", function()
    local v = { b = 0.1, a = 1 / 3, c = 2 ^ 53 - 1, d = 1e-300, e = json.array({}), f = { 1, 2, 3 }, g = -0.0625 }
    local text = json.encode(v)
    assert.truthy(text:find('^{"a":'))
    assert.truthy(text:find('"e":%[%]'))
    local back = json.decode(text)
    for _, k in ipairs({ "a", "b", "c", "d", "g" }) do assert.are.equal(v[k], back[k]) end
    assert.are.same({ 1, 2, 3 }, back.f)
    local ok, err = pcall(json.decode, "{oops", "thing.json")
    assert.is_false(ok)
    assert.truthy(err:find("thing.json is not valid JSON"))
  end)
end)

describe("sharded save and load", function()
  -- A [7, 10] f32 ramp, a [5] f32 vector, a [4, 6] bf16 matrix.
  local function originals()
    return {
      A = titan.arange(70):reshape(7, 10):mul(0.37):add_scalar(-3),
      B = titan.arange(5):mul(1.5),
      C = titan.arange(24):reshape(4, 6):mul(0.01):to("bfloat16"),
    }
  end

  -- ranks[r+1] = items holding the boxes `boxes_of(name, shape)[r+1]`.
  local function save_layout(dir, orig, nranks, boxes_of)
    local ranks = {}
    for r = 1, nranks do ranks[r] = {} end
    for _, name in ipairs({ "A", "B", "C" }) do
      local t = orig[name]
      local boxes = boxes_of(name, t:shape())
      for r = 1, nranks do
        local b = boxes[r]
        local piece = t
        for d = 1, #b.offset do piece = piece:narrow(d, b.offset[d] + 1, b.size[d]) end
        if layout.volume(b.size) > 0 then
          table.insert(ranks[r], { name = name, tensor = piece:contiguous(), global_shape = t:shape(), offset = b.offset })
        end
      end
    end
    format.write(dir, ranks, { step = 3 })
  end

  -- Load box of `name` as dtype and compare with the original's slice.
  local function check_box(ck, orig, name, box, dtype)
    local t = orig[name]
    local dst = titan.zeros(box.size, { dtype = dtype or t:dtype() })
    ck:read(name, ck:plan(name, { global_shape = t:shape(), offset = box.offset, size = box.size }), dst)
    local want = t
    for d = 1, #box.offset do want = want:narrow(d, box.offset[d] + 1, box.size[d]) end
    want = want:contiguous():to(dtype or t:dtype())
    assert.are.same(want:tolist_flat(), dst:tolist_flat(), name .. " at " .. table.concat(box.offset, ","))
  end

  local function row_shards(k)
    return function(_, shape)
      local out = {}
      for i = 0, k - 1 do
        local o, s = layout.shard_box(shape, 1, k, i)
        out[#out + 1] = { offset = o, size = s }
      end
      return out
    end
  end

  it("saved as 4 row shards (7 rows: 2, 2, 2, 1), loads as 3 column shards, whole, 3 row shards and a 2x2 grid", function()
    local orig, dir = originals(), tmpdir() .. "/step-3"
    save_layout(dir, orig, 4, row_shards(4))
    local ck = format.open(dir)
    assert.are.equal(4, #ck:entry("A").chunks)
    assert.are.same({ 2, 10 }, ck:entry("A").chunks[1].size)
    assert.are.same({ 1, 10 }, ck:entry("A").chunks[4].size)
    for _, name in ipairs({ "A", "C" }) do
      local shape = orig[name]:shape()
      for i = 0, 2 do
        local o, s = layout.shard_box(shape, 2, 3, i)
        check_box(ck, orig, name, { offset = o, size = s })
        o, s = layout.shard_box(shape, 1, 3, i)
        check_box(ck, orig, name, { offset = o, size = s })
      end
      for _, b in ipairs(layout.grid_boxes(shape, { 2, 2 })) do check_box(ck, orig, name, b) end
      check_box(ck, orig, name, { offset = { 0, 0 }, size = shape })
    end
    check_box(ck, orig, "B", { offset = { 0 }, size = { 5 } })
    check_box(ck, orig, "B", { offset = { 3 }, size = { 2 } })
  end)

  it("saved as a 2x3 grid (uneven), loads as 4 row shards and whole", function()
    local orig, dir = originals(), tmpdir() .. "/step-3"
    save_layout(dir, orig, 6, function(_, shape)
      if #shape == 1 then
        local out = {}
        for i = 0, 5 do
          local o, s = layout.shard_box(shape, 1, 6, i)
          out[#out + 1] = { offset = o, size = s }
        end
        return out
      end
      return layout.grid_boxes(shape, { 2, 3 })
    end)
    local ck = format.open(dir)
    assert.are.equal(6, #ck:entry("A").chunks)
    for _, name in ipairs({ "A", "B", "C" }) do
      local shape = orig[name]:shape()
      for i = 0, 3 do
        local o, s = layout.shard_box(shape, 1, 4, i)
        if s[1] > 0 then check_box(ck, orig, name, { offset = o, size = s }) end
      end
      local zeros = {}
      for d = 1, #shape do zeros[d] = 0 end
      check_box(ck, orig, name, { offset = zeros, size = shape })
    end
  end)

  it("converts on load: f32 stored into bf16 (and bf16 into f32), rounding as a cast does", function()
    local orig, dir = originals(), tmpdir() .. "/step-3"
    save_layout(dir, orig, 3, row_shards(3))
    local ck = format.open(dir)
    check_box(ck, orig, "A", { offset = { 0, 0 }, size = { 7, 10 } }, "bfloat16")
    check_box(ck, orig, "A", { offset = { 1, 3 }, size = { 5, 4 } }, "bfloat16")
    check_box(ck, orig, "C", { offset = { 0, 0 }, size = { 4, 6 } }, "float32")
    local whole = ck:load_tensor("A", { dtype = "bfloat16" })
    assert.are.equal("bfloat16", whole:dtype())
    assert.are.same(orig.A:to("bfloat16"):tolist_flat(), whole:tolist_flat())
  end)

  it("stores a replicated tensor once and names every chunk's file, offset and checksum", function()
    local orig, dir = originals(), tmpdir() .. "/step-3"
    save_layout(dir, orig, 2, function(_, shape)
      local zeros = {}
      for d = 1, #shape do zeros[d] = 0 end
      return { { offset = zeros, size = shape }, { offset = zeros, size = shape } }
    end)
    local meta = json.decode(fs.read_file(dir .. "/metadata.json"))
    assert.are.equal(1, #meta.tensors.A.chunks)
    local c = meta.tensors.A.chunks[1]
    assert.are.equal("rank-0.bin", c.file)
    assert.are.equal(0, c.byte_offset % 64)
    assert.truthy(c.crc32c:match("^%x%x%x%x%x%x%x%x$"))
    assert.are.equal(1, meta.version)
    assert.are.equal("titan-checkpoint", meta.format)
    assert.is_true(fs.exists(dir .. "/COMPLETE"))
    assert.is_true(fs.exists(dir .. "/rank-1.bin")) -- rank 1 wrote a file with no chunks
  end)
end)

describe("train state", function()
  it("model, AdamW moments, per-parameter steps, loader position, RNG and lr step round-trip; training resumes bit-exactly", function()
    local m, dir = model(1), tmpdir() .. "/step-2"
    local opt = optim.AdamW(m:named_parameters(), { lr = 1e-2, weight_decay = 0.1 })
    train_step(m, opt)
    train_step(m, opt)
    opt:set_lr_factor(0.625)
    local dl = loader(1234)
    ckpt.save(dir, { model = m, optimizer = opt, dataloader = dl,
      extra = { step = 2, rng = { seed = 7, offset = 2 ^ 40 + 3 }, lr_step = 2 } })

    local m2 = model(99)
    local opt2 = optim.AdamW(m2:named_parameters(), { lr = 1e-2, weight_decay = 0.1 })
    local dl2, extra = loader(0), {}
    local step, ts = ckpt.load(dir, { model = m2, optimizer = opt2, dataloader = dl2, extra = extra })
    assert.are.equal(2, step)
    assert.are.equal(1234, dl2.pos)
    assert.are.same({ "a", 1.5 }, dl2.loaded.nested)
    assert.are.equal(2 ^ 40 + 3, extra.rng.offset)
    assert.are.equal(2, ts.lr_scheduler.step)
    assert.are.equal(2, opt2.step_count)
    assert.are.equal(0.625, opt2.lr_factor)
    for _, np in ipairs(m:named_parameters()) do
      assert.is_true(same_tensor(np[2], m2:state_dict().tensors[np[1]]), np[1])
      local s1, s2 = opt.state[np[1]], opt2.state[np[1]]
      assert.is_true(same_tensor(s1.exp_avg, s2.exp_avg) and same_tensor(s1.exp_avg_sq, s2.exp_avg_sq), np[1])
      assert.are.equal(s1.step, s2.step)
    end
    -- the next steps are identical to the bit
    for _ = 1, 2 do assert.are.equal(train_step(m, opt), train_step(m2, opt2)) end
  end)

  it("bf16 parameters keep their f32 master weights", function()
    local Net = titan.nn.Module:extend("BfNet")
    function Net:init() self.fc = titan.nn.Linear(6, 4, { dtype = "bfloat16" }) end
    local net = Net()
    local opt = optim.AdamW(net:named_parameters(), { lr = 0.1 })
    net.fc.weight.grad = titan.full({ 4, 6 }, 0.5, { dtype = "bfloat16" })
    opt:step()
    local st = opt.state["fc.weight"]
    assert.are.equal("float32", st.master:dtype())
    local dir = tmpdir() .. "/step-1"
    ckpt.save(dir, { model = net, optimizer = opt, extra = { step = 1 } })
    assert.is_true(format.open(dir):has("optimizer.state.fc.weight.master"))
    local net2 = Net()
    local opt2 = optim.AdamW(net2:named_parameters(), { lr = 0.1 })
    ckpt.load(dir, { model = net2, optimizer = opt2 })
    assert.is_true(same_tensor(st.master, opt2.state["fc.weight"].master))
    assert.is_true(same_tensor(net.fc.weight, net2.fc.weight))
  end)
end)

describe("CheckpointManager", function()
  local function manager(dump, over)
    local cfg = { enable = true, interval = 2, keep_latest_k = 0 }
    for k, v in pairs(over or {}) do cfg[k] = v end
    return ckpt.Manager(cfg, { dump_folder = dump, log = function() end })
  end

  it("saves on the interval and the final step, keeps the newest k, loads the latest or load_step", function()
    local dump = tmpdir()
    local m = model(1)
    local opt = optim.AdamW(m:named_parameters(), {})
    local mgr = manager(dump, { keep_latest_k = 2 })
    assert.is_false(mgr:should_save(1))
    assert.is_true(mgr:should_save(2))
    assert.is_true(mgr:should_save(3, true))
    for step = 1, 7 do
      train_step(m, opt)
      mgr:maybe_save(step, { model = m, optimizer = opt, extra = { step = step } }, { final = step == 7 })
    end
    mgr:close()
    local steps = {}
    for _, s in ipairs(format.list_steps(dump .. "/checkpoint")) do steps[#steps + 1] = s.step end
    assert.are.same({ 6, 7 }, steps)
    local m2 = model(2)
    local opt2 = optim.AdamW(m2:named_parameters(), {})
    local extra = {}
    assert.are.equal(7, manager(dump):load({ model = m2, optimizer = opt2, extra = extra }))
    assert.are.equal(7, extra.step)
    assert.is_true(same_tensor(m.norm.weight, m2.norm.weight))
    assert.are.equal(6, manager(dump, { load_step = 6 }):load({ model = m2, optimizer = opt2 }))
    local ok, err = pcall(function() manager(dump, { load_step = 4 }):load({ model = m2 }) end)
    assert.is_false(ok)
    assert.truthy(one_line(err) and err:find("load_step = 4") and err:find("complete steps: 6, 7"), err)
    -- nothing to load: nil (train from scratch)
    assert.is_nil(manager(tmpdir()):load({ model = m2 }))
    assert.is_nil(ckpt.Manager({ enable = false }, { dump_folder = dump }):load({ model = m2 }))
  end)

  it("keep_latest_k = 1 keeps only the newest; k = 0 keeps all", function()
    local dump = tmpdir()
    local m = model(1)
    local mgr = manager(dump, { keep_latest_k = 1, interval = 1 })
    for step = 1, 3 do mgr:save(step, { model = m }) end
    assert.are.equal(1, #format.list_steps(dump .. "/checkpoint"))
    assert.are.equal(3, format.list_steps(dump .. "/checkpoint")[1].step)
  end)

  it("exclude_from_loading leaves the optimizer and loader alone; a bad part name is one line", function()
    local dump = tmpdir()
    local m = model(1)
    local opt = optim.AdamW(m:named_parameters(), {})
    train_step(m, opt)
    manager(dump):save(2, { model = m, optimizer = opt, dataloader = loader(5), extra = { step = 2, lr_step = 2 } })
    local m2 = model(2)
    local opt2 = optim.AdamW(m2:named_parameters(), {})
    local dl = loader(0)
    local step, info = manager(dump, { exclude_from_loading = "optimizer, dataloader,lr_scheduler" })
      :load({ model = m2, optimizer = opt2, dataloader = dl })
    assert.are.equal(2, step)
    assert.is_nil(next(opt2.state))
    assert.are.equal(0, opt2.step_count)
    assert.are.equal(0, dl.pos)
    assert.is_nil(info.lr_step)
    assert.is_true(same_tensor(m.output.weight, m2.output.weight))
    local ok, err = pcall(manager, dump, { exclude_from_loading = "optimizer,model" })
    assert.is_false(ok)
    assert.truthy(one_line(err) and err:find("unknown part 'model'"), err)
    ok, err = pcall(manager, dump, { async_mode = "sometimes" })
    assert.truthy(not ok and err:find("async_mode"), err)
  end)

  it("the final save can be model only in bf16; a seed checkpoint (step 0) is model only; initial_load_path", function()
    local dump = tmpdir()
    local m = model(1)
    local opt = optim.AdamW(m:named_parameters(), {})
    train_step(m, opt)
    local mgr = manager(dump, { last_save_model_only = true, export_dtype = "bfloat16", interval = 100 })
    mgr:save(5, { model = m, optimizer = opt, extra = { step = 5 } }, { final = true })
    local ck = format.open(dump .. "/checkpoint/step-5")
    assert.is_true(ck.meta.model_only)
    assert.are.equal("bfloat16", ck:entry("output.weight").dtype)
    assert.is_false(ck:has("optimizer.state.output.weight.exp_avg"))
    local m2 = model(2)
    local opt2 = optim.AdamW(m2:named_parameters(), {})
    -- (a resume from it would restart the moments, the data and the schedule: refused, unless asked for)
    local ok, err = pcall(function() manager(dump):load({ model = m2, optimizer = opt2 }) end)
    assert.truthy(not ok and err:find("step-5 holds the model only (a final export", 1, true), err)
    local step, info = manager(dump, { exclude_from_loading = "optimizer,dataloader,lr_scheduler" })
      :load({ model = m2, optimizer = opt2 })
    assert.are.equal(5, step)
    assert.is_true(info.model_only)
    assert.are.same(m.output.weight:to("bfloat16"):to("float32"):tolist_flat(), m2.output.weight:tolist_flat())
    -- seed checkpoint
    local seed_dump = tmpdir()
    manager(seed_dump, { create_seed_checkpoint = true }):save(0, { model = m, optimizer = opt }, { force = true })
    assert.is_true(format.open(seed_dump .. "/checkpoint/step-0").meta.model_only)
    local m3 = model(3)
    assert.are.equal(0, manager(seed_dump):load({ model = m3, optimizer = optim.AdamW(m3:named_parameters(), {}) }))
    assert.is_true(same_tensor(m.output.weight, m3.output.weight))
    -- initial_load_path: used when the folder has none; model only by default
    local m4 = model(4)
    local opt4 = optim.AdamW(m4:named_parameters(), {})
    local s4 = manager(tmpdir(), { initial_load_path = seed_dump .. "/checkpoint" }):load({ model = m4, optimizer = opt4 })
    assert.are.equal(0, s4)
    assert.is_true(same_tensor(m.tok_embeddings.weight, m4.tok_embeddings.weight))
    assert.is_nil(next(opt4.state))
  end)

  -- World of `world` ranks in one process: coroutines, with gather/barrier
  -- meeting at each rank's k-th collective (what the distributed layer does).
  local function run_ranks(world, fn)
    local meets, counts, cos = {}, {}, {}
    local function gather_for(r)
      return function(v)
        counts[r] = (counts[r] or 0) + 1
        local k = counts[r]
        meets[k] = meets[k] or { n = 0, vals = {} }
        meets[k].vals[r + 1] = v
        meets[k].n = meets[k].n + 1
        while meets[k].n < world do coroutine.yield() end
        local out = {}
        for i = 1, world do out[i] = meets[k].vals[i] end
        return out
      end
    end
    for r = 0, world - 1 do
      local gather = gather_for(r)
      cos[r + 1] = coroutine.create(function() fn(r, gather, function() gather(true) end) end)
    end
    local live = world
    while live > 0 do
      live = 0
      for _, co in ipairs(cos) do
        if coroutine.status(co) ~= "dead" then
          local ok, err = coroutine.resume(co)
          if not ok then error(err, 0) end
          if coroutine.status(co) ~= "dead" then live = live + 1 end
        end
      end
    end
  end

  -- A stand-in for a sharded model: rank r of `world` holds the torch.chunk
  -- part r of dim `dim` of every 2-D tensor; 1-D tensors are replicated.
  local function sharded(full, world, r, dim)
    local names, tensors, boxes = {}, {}, {}
    for _, np in ipairs(full:named_parameters()) do
      local name, t = np[1], np[2]
      local shape = t:shape()
      local o, s = { 0 }, { shape[1] }
      if #shape == 2 then o, s = layout.shard_box(shape, dim, world, r) end
      local piece = t
      for d = 1, #shape do piece = piece:narrow(d, o[d] + 1, s[d]) end
      names[#names + 1] = name
      tensors[name] = titan.no_grad(function() return titan.zeros(s):copy_(piece) end)
      boxes[name] = { shape = shape, offset = o }
    end
    return {
      model = { state_dict = function() return { names = names, tensors = tensors } end },
      shard_of = function(name) return boxes[name].shape, boxes[name].offset end,
      tensors = tensors, boxes = boxes,
    }
  end

  it("two ranks save row shards, three ranks load column shards (coroutines as the distributed layer)", function()
    local dump = tmpdir()
    local full = model(17)
    run_ranks(2, function(r, gather, barrier)
      local sh = sharded(full, 2, r, 1)
      local mgr = ckpt.Manager({ enable = true, interval = 1 }, { dump_folder = dump, rank = r, world = 2,
        gather = gather, barrier = barrier, shard_of = sh.shard_of, log = function() end })
      mgr:save(3, { model = sh.model, extra = { step = 3 } })
      mgr:close()
    end)
    local ck = format.open(dump .. "/checkpoint/step-3")
    assert.are.equal(2, ck.meta.world_size)
    assert.are.equal(2, #ck:entry("layers.0.feed_forward.w1.weight").chunks)
    assert.are.equal(1, #ck:entry("norm.weight").chunks) -- replicated: written once
    run_ranks(3, function(r)
      local sh = sharded(model(18), 3, r, 2)
      local mgr = ckpt.Manager({ enable = true }, { dump_folder = dump, rank = r, world = 3,
        gather = function(v) return { v } end, barrier = function() end, shard_of = sh.shard_of, log = function() end })
      assert.are.equal(3, mgr:load({ model = sh.model }))
      local want = sharded(full, 3, r, 2)
      for name, t in pairs(sh.tensors) do assert.is_true(same_tensor(want.tensors[name], t), name) end
    end)
  end)

  it("async: the snapshot is taken at save, written in the background, committed by wait/close/the next save", function()
    local dump = tmpdir()
    local m = model(1)
    local before = m.norm.weight:tolist_flat()
    local pinned = titan.memory_stats("pinned")
    local mgr = manager(dump, { async_mode = "async" })
    mgr:save(2, { model = m, extra = { step = 2 } })
    titan.no_grad(function() m.norm.weight:fill_(42) end) -- training goes on
    mgr:wait()
    assert.is_true(format.is_complete(dump .. "/checkpoint/step-2"))
    mgr:save(4, { model = m, extra = { step = 4 } })
    mgr:save(6, { model = m, extra = { step = 6 } }) -- waits for step 4 first
    mgr:close()
    assert.are.same(pinned, titan.memory_stats("pinned")) -- CPU snapshots are plain copies, never pinned
    local ck = format.open(dump .. "/checkpoint/step-2")
    assert.are.same(before, ck:load_tensor("norm.weight"):tolist_flat())
    assert.are.equal(42, format.open(dump .. "/checkpoint/step-6"):load_tensor("norm.weight"):tolist_flat()[1])
    assert.is_true(format.is_complete(dump .. "/checkpoint/step-4"))
  end)
end)

describe("bad checkpoints fail with one line and change no file", function()
  local function saved()
    local dump = tmpdir()
    local m = model(1)
    local opt = optim.AdamW(m:named_parameters(), {})
    train_step(m, opt)
    local dir = dump .. "/step-1"
    ckpt.save(dir, { model = m, optimizer = opt, extra = { step = 1 } })
    return dir, m
  end

  local function fails_cleanly(dir, load, pattern)
    local before = snapshot(dir)
    local ok, err = pcall(load)
    assert.is_false(ok)
    err = tostring(err)
    assert.truthy(one_line(err), "one line: " .. err)
    assert.truthy(err:find(pattern), err)
    local after = snapshot(dir)
    for name, bytes in pairs(before) do assert.is_true(after[name] == bytes, name .. " changed") end
    for name in pairs(after) do assert.truthy(before[name], name .. " appeared") end
    return err
  end

  it("a flipped byte: checksum mismatch naming the file and tensor", function()
    local dir = saved()
    local meta = json.decode(fs.read_file(dir .. "/metadata.json"))
    local c = meta.tensors["layers.1.feed_forward.w2.weight"].chunks[1]
    local bin = fs.read_file(dir .. "/rank-0.bin")
    local at = c.byte_offset + 100
    local f = assert(io.open(dir .. "/rank-0.bin", "r+b"))
    f:seek("set", at)
    f:write(string.char((bin:byte(at + 1) + 1) % 256))
    f:close()
    local err = fails_cleanly(dir, function() ckpt.load(dir, { model = model(2) }) end, "corrupt")
    assert.truthy(err:find("rank%-0%.bin") and err:find("layers.1.feed_forward.w2.weight", 1, true), err)
    -- `titan ckpt verify` says the same
    local rc, out = run(sh_quote(EXE) .. " ckpt verify " .. sh_quote(dir))
    assert.are.equal(1, rc)
    assert.truthy(out:find("layers.1.feed_forward.w2.weight", 1, true), out)
  end)

  it("a truncated data file: its size disagrees with the metadata", function()
    local dir = saved()
    local bin = fs.read_file(dir .. "/rank-0.bin")
    os.remove(dir .. "/rank-0.bin")
    write(dir .. "/rank-0.bin", bin:sub(1, #bin - 1000))
    local err = fails_cleanly(dir, function() ckpt.load(dir, { model = model(2) }) end, "truncated")
    assert.truthy(err:find("rank%-0%.bin") and err:find("tensor "), err)
  end)

  it("metadata that disagrees with the data or with itself", function()
    local dir = saved()
    local text = fs.read_file(dir .. "/metadata.json")
    os.remove(dir .. "/metadata.json")
    -- claim the norm holds 33 elements
    local bad = text:gsub('("norm%.weight": {%s*"chunks": %[%s*{%s*"byte_offset": %d+,%s*"crc32c": "%x+",%s*"file": "rank%-0%.bin",%s*"nbytes": )128', "%1132", 1)
    assert.are_not.equal(text, bad)
    write(dir .. "/metadata.json", bad)
    fails_cleanly(dir, function() ckpt.load(dir, { model = model(2) }) end, "tensor norm%.weight chunk 1 says 132 bytes")
    -- a checksum that does not match the bytes
    os.remove(dir .. "/metadata.json")
    local bad2 = text:gsub('("norm%.weight": {%s*"chunks": %[%s*{%s*"byte_offset": %d+,%s*"crc32c": ")(%x+)', function(pre, crc)
      return pre .. (crc:sub(1, 7) .. (crc:sub(8, 8) == "0" and "1" or "0"))
    end, 1)
    write(dir .. "/metadata.json", bad2)
    fails_cleanly(dir, function() ckpt.load(dir, { model = model(2) }) end, "norm%.weight")
    os.remove(dir .. "/metadata.json")
    write(dir .. "/metadata.json", "{ not json")
    fails_cleanly(dir, function() ckpt.load(dir, { model = model(2) }) end, "not valid JSON")
  end)

  it("a checkpoint of another model shape", function()
    local dir = saved()
    local fewer = { dim = 32, n_layers = 1, n_heads = 4, n_kv_heads = 2, multiple_of = 16, vocab_size = 61, max_seq_len = 32 }
    fails_cleanly(dir, function() ckpt.load(dir, { model = model(2, fewer) }) end, "this model lacks %(layers%.1%.")
    local wider = { dim = 64, n_layers = 2, n_heads = 4, n_kv_heads = 2, multiple_of = 16, vocab_size = 61, max_seq_len = 32 }
    fails_cleanly(dir, function() ckpt.load(dir, { model = model(2, wider) }) end,
      "tensor %S+ has shape %[%d+, 32%] in the checkpoint but %[%d+, 64%] here")
  end)

  it("a folder without COMPLETE is refused when named and skipped (one warning line) when searching", function()
    local dir = saved()
    os.remove(dir .. "/COMPLETE")
    fails_cleanly(dir, function() ckpt.load(dir, { model = model(2) }) end, "incomplete")
    -- searching: in a child, so its stderr can be read
    local folder = fs.dirname(dir)
    local script = fs.join(folder, "probe.lua")
    write(script, ([[
      local ckpt = require("titan.checkpoint")
      local llama3 = require("models.llama3")
      local m = llama3.build({ dim = 32, n_layers = 2, n_heads = 4, n_kv_heads = 2, multiple_of = 16,
        vocab_size = 61, max_seq_len = 32 }, { seed = 1 })
      local mgr = ckpt.Manager({ enable = true, folder = %q }, { dump_folder = "/", log = function() end })
      print("loaded", mgr:load({ model = m }))
    ]]):format(folder))
    local rc, out = run(sh_quote(EXE) .. " " .. sh_quote(script))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("loaded\tnil"), out)
    local warn = out:match("[^\n]*ignoring[^\n]*")
    assert.truthy(warn and warn:find("step%-1") and warn:find("COMPLETE"), out)
  end)
end)

describe("crash safety", function()
  it("a writer killed with SIGKILL at random points never leaves a folder that loads as complete", function()
    local dump = tmpdir()
    local script = fs.join(dump, "writer.lua")
    -- Saves in a loop; every parameter of step s holds the value s.
    write(script, [[
      local titan = require("titan")
      local ckpt = require("titan.checkpoint")
      local Net = titan.nn.Module:extend("Net")
      function Net:init()
        for i = 1, 4 do self:child("l" .. i, titan.nn.Linear(512, 512)) end
      end
      local net = Net()
      local mgr = ckpt.Manager({ enable = true, interval = 1, keep_latest_k = 3 },
        { dump_folder = arg[1], log = function() end })
      local step = mgr:load({ model = net }) or 0
      io.stdout:write("start ", step, "\n"); io.stdout:flush()
      while true do
        step = step + 1
        titan.no_grad(function() for _, p in ipairs(net:parameters()) do p:fill_(step) end end)
        mgr:save(step, { model = net, extra = { step = step } })
      end
    ]])
    math.randomseed(fs.pid())
    local Net = titan.nn.Module:extend("Net")
    function Net:init()
      for i = 1, 4 do self:child("l" .. i, titan.nn.Linear(512, 512)) end
    end
    local last = 0
    for round = 1, 6 do
      local pause = 0.3 + math.random() * 0.7
      run(("%s %s %s >/dev/null 2>&1 & p=$!; sleep %.3f; kill -9 $p; wait $p"):format(sh_quote(EXE),
        sh_quote(script), sh_quote(dump), pause))
      local folder = dump .. "/checkpoint"
      for _, s in ipairs(format.list_steps(folder)) do
        -- a step-N folder only ever appears complete (renamed after COMPLETE)
        assert.is_true(s.complete, "round " .. round .. ": " .. s.dir .. " has no COMPLETE")
        local net = Net()
        local step = ckpt.load(s.dir, { model = net })
        assert.are.equal(s.step, step)
        assert.are.equal(s.step, net.l4.weight:tolist_flat()[512 * 512])
        assert.are.equal(s.step, net.l1.weight:tolist_flat()[1])
        net:free()
      end
      -- everything else in the folder is hidden (temporary or being purged): never a candidate
      for _, name in ipairs(fs.is_dir(folder) and fs.list(folder) or {}) do
        assert.truthy(name:match("^step%-%d+$") or name:match("^%.step%-%d+%.tmp%-%d+$")
          or name:match("^%.purge%-step%-%d+%-%d+$"), name)
      end
      local steps = format.list_steps(folder)
      if #steps > 0 then
        assert.truthy(steps[#steps].step >= last, "the latest complete step never goes back")
        last = steps[#steps].step
        local net = Net()
        assert.are.equal(last, ckpt.Manager({ enable = true }, { dump_folder = dump, log = function() end })
          :load({ model = net }))
        net:free()
      end
    end
    assert.truthy(last > 0, "no checkpoint completed in six rounds")
  end)

  it("SIGTERM is noticed at the next step boundary: the trainer saves and exits", function()
    local dump = tmpdir()
    local script = fs.join(dump, "train.lua")
    write(script, [[
      local titan = require("titan")
      local ckpt = require("titan.checkpoint")
      ckpt.install_signal_handlers()
      local net = titan.nn.Linear(64, 64)
      local mgr = ckpt.Manager({ enable = true, interval = 1000000 }, { dump_folder = arg[1], log = function() end })
      local step = 0
      while true do
        step = step + 1
        titan.no_grad(function() net.weight:fill_(step) end)
        if step == 3 then local f = io.open(arg[1] .. "/ready", "w"); f:write("go"); f:close() end
        local sig = ckpt.signal_pending()
        if sig then
          mgr:save(step, { model = net, extra = { step = step } }, { force = true })
          mgr:close()
          print(("%s at step %d: saved"):format(sig, step))
          os.exit(0)
        end
      end
    ]])
    local out_file = dump .. "/out.txt"
    -- wait (bounded) for the child to be in its loop, then SIGTERM it
    local rc, out = run(("%s %s %s > %s 2>&1 & p=$!; for i in $(seq 1 600); do [ -f %s/ready ] && break; sleep 0.05; done; "
      .. "kill -TERM $p; wait $p; echo \"child=$?\""):format(sh_quote(EXE), sh_quote(script), sh_quote(dump),
      sh_quote(out_file), sh_quote(dump)))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("child=0"), out)
    local text = fs.read_file(out_file)
    local step = tonumber(text:match("SIGTERM at step (%d+): saved"))
    assert.truthy(step and step >= 3, text)
    local net = titan.nn.Linear(64, 64)
    assert.are.equal(step, ckpt.load(format.step_dir(dump .. "/checkpoint", step), { model = net }))
    assert.are.equal(step, net.weight:tolist_flat()[1])
  end)
end)

describe("titan ckpt", function()
  it("--help, inspect, and one clear line with exit 1 for bad arguments", function()
    local rc, out = run(sh_quote(EXE) .. " ckpt --help")
    assert.are.equal(0, rc)
    assert.truthy(out:find("titan ckpt inspect DIR") and out:find("convert %-%-to hf"), out)
    rc, out = run(sh_quote(EXE) .. " ckpt inspect --help") -- a command's --help: the usage too
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("titan ckpt inspect DIR", 1, true), out)
    local dump = tmpdir()
    local m = model(1)
    ckpt.save(dump .. "/ck/step-4", { model = m, extra = { step = 4 } })
    rc, out = run(sh_quote(EXE) .. " ckpt inspect " .. sh_quote(dump .. "/ck"))
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("step 4: complete") and out:find("tok_embeddings.weight%s+float32%s+%[61, 32%]"), out)
    rc, out = run(sh_quote(EXE) .. " ckpt verify " .. sh_quote(dump .. "/ck"))
    assert.are.equal(0, rc, out)
    for _, args in ipairs({ "", "bogus", "inspect", "inspect /nonexistent/dir", "convert --to hf a b",
      "convert --to hf --model-flavor nope a b", "convert --to xyz --model-flavor debugmodel a b",
      "convert --from hf /nonexistent/hf " .. dump .. "/x", "inspect --frobnicate x" }) do
      rc, out = run(sh_quote(EXE) .. " ckpt " .. args)
      assert.are.equal(1, rc, args .. ": " .. out)
      assert.truthy(out:match("^titan: [^\n]+\n$"), args .. ": " .. out)
    end
  end)
end)
