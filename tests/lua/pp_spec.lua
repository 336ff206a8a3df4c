-- Pipeline parallelism (lua/parallel/pp.lua) in one process: the stage
-- split, the schedules proved to run (and a broken one caught), and the
-- stages run one after the other giving the whole model's logits and
-- gradients bit for bit. Across real processes (losses, checkpoints):
-- mpi_spec.
local titan = require("titan")
local pp = require("parallel.pp")
local llama = require("models.llama3")

local ARGS = { dim = 64, n_layers = 5, n_heads = 4, n_kv_heads = 2, multiple_of = 32, vocab_size = 96,
  max_seq_len = 64 }

local function err(f)
  local ok, e = pcall(f)
  assert.is_false(ok, "expected an error")
  return tostring(e)
end

local function F(s, m) return { op = "F", stage = s, mb = m } end
local function B(s, m) return { op = "B", stage = s, mb = m } end

describe("pipeline layout", function()
  it("splits the blocks evenly and in order; stage s runs on rank s mod pp", function()
    local L = pp.layout(6, { pp = 2, schedule = "1F1B" })
    assert.are.same({ 2, 1, 2 }, { L.P, L.V, L.S })
    assert.are.same({ { 0, 3 }, { 3, 6 } }, { L.ranges[0], L.ranges[1] })
    L = pp.layout(6, { pp = 2, schedule = "Interleaved1F1B" }) -- two stages per rank by default
    assert.are.same({ 2, 4 }, { L.V, L.S })
    assert.are.same({ { 0, 1 }, { 1, 3 }, { 3, 4 }, { 4, 6 } }, { L.ranges[0], L.ranges[1], L.ranges[2], L.ranges[3] })
    assert.are.same({ 1, 3 }, pp.stage_ids(L, 1))
    L = pp.layout(6, { pp = 3, schedule = "Interleaved1F1B", layers_per_stage = 1 })
    assert.are.same({ 2, 6 }, { L.V, L.S })
  end)

  it("refuses what does not split, one line each", function()
    assert.truthy(err(function() pp.layout(6, { pp = 2, schedule = "ZeroBubble" }) end)
      :find("pipeline_parallel_schedule = ZeroBubble; expected one of 1F1B, GPipe, Interleaved1F1B", 1, true))
    assert.truthy(err(function() pp.layout(6, { pp = 4, schedule = "Interleaved1F1B" }) end)
      :find("makes 8 stages, more than the model's 6 blocks", 1, true))
    assert.truthy(err(function() pp.layout(6, { pp = 2, schedule = "GPipe", layers_per_stage = 4 }) end)
      :find("layers_per_stage = 4 makes 1.5 stages", 1, true))
    assert.truthy(err(function() pp.layout(6, { pp = 3, schedule = "1F1B", layers_per_stage = 1 }) end)
      :find("the 1F1B schedule runs one stage per rank", 1, true))
  end)
end)

describe("pipeline schedules", function()
  it("every schedule runs every stage and micro-batch both ways, without hanging", function()
    local n = 0
    for _, c in ipairs({ { "GPipe", 1 }, { "GPipe", 2 }, { "1F1B", 1 }, { "Interleaved1F1B", 2 },
      { "Interleaved1F1B", 3 } }) do
      for P = 2, 4 do
        for nmb = 1, 8 do
          if c[1] ~= "Interleaved1F1B" or nmb % P == 0 then
            local L = pp.layout(P * c[2] * 2, { pp = P, schedule = c[1], layers_per_stage = 2 })
            assert.are.equal(c[2], L.V)
            local all = pp.actions(L, nmb)
            assert.is_nil(pp.check(L, all, nmb), ("%s P=%d V=%d M=%d"):format(c[1], P, c[2], nmb))
            for r = 0, P - 1 do assert.are.equal(2 * L.V * nmb, #all[r]) end
            n = n + 1
          end
        end
      end
    end
    assert.is_true(n > 60)
  end)

  it("1F1B keeps at most pp - rank micro-batches in flight; GPipe all of them", function()
    local function peak(list)
      local live, most = 0, 0
      for _, a in ipairs(list) do
        live = live + (a.op == "F" and 1 or -1)
        most = math.max(most, live)
      end
      return most
    end
    local P, nmb = 4, 8
    local one = pp.actions(pp.layout(8, { pp = P, schedule = "1F1B" }), nmb)
    local all = pp.actions(pp.layout(8, { pp = P, schedule = "GPipe" }), nmb)
    for r = 0, P - 1 do
      assert.are.equal(P - r, peak(one[r]), "1F1B rank " .. r)
      assert.are.equal(nmb, peak(all[r]), "GPipe rank " .. r)
    end
  end)

  it("says where a broken schedule would hang or go wrong", function()
    local L = pp.layout(4, { pp = 2, schedule = "1F1B" })
    -- rank 0 waits for micro-batch 0's gradient before sending micro-batch 1;
    -- rank 1 wants micro-batch 1 before it runs micro-batch 0's backward
    local hang = { [0] = { F(0, 0), B(0, 0), F(0, 1), B(0, 1) }, [1] = { F(1, 0), F(1, 1), B(1, 0), B(1, 1) } }
    assert.are.equal("the schedule would hang: rank 0 at B0:0, rank 1 at F1:1", pp.check(L, hang, 2))
    local early = { [0] = { F(0, 0), B(0, 0) }, [1] = { B(1, 0), F(1, 0) } }
    assert.truthy(pp.check(L, early, 1):find("rank 1 runs the backward of stage 1 micro-batch 0 before its forward",
      1, true))
    local order = { [0] = { F(0, 0), F(0, 1), B(0, 0), B(0, 1) }, [1] = { F(1, 1), F(1, 0), B(1, 0), B(1, 1) } }
    assert.truthy(pp.check(L, order, 2):find("F:1: micro-batch 0 arrives where 1 is expected", 1, true))
    local short = { [0] = { F(0, 0), B(0, 0) }, [1] = { F(1, 0), B(1, 0) } }
    assert.truthy(pp.check(L, short, 2):find("stage 0 micro-batch 1 is never run both ways", 1, true))
  end)

  -- a rank's steps in one line: "t:action>message sent<message received ..." per step
  local function show(steps)
    local out = {}
    for _, st in ipairs(steps) do
      local w = tostring(st.t) .. ":"
      if st.action then w = w .. st.action.op .. st.action.stage .. ":" .. st.action.mb end
      if st.send then w = w .. ">" .. st.send.tag .. "/" .. st.send.mb end
      for _, rv in ipairs(st.recvs) do w = w .. "<" .. rv.tag .. "/" .. rv.mb end
      out[#out + 1] = w
    end
    return table.concat(out, " ")
  end

  it("on NCCL, in steps every rank counts alike: each message sent and received in the same step", function()
    local L = pp.layout(4, { pp = 2, schedule = "1F1B" })
    local steps = pp.steps(L, pp.actions(L, 2))
    assert.are.equal("0:F0:0>F:1/0 1:F0:1>F:1/1 2:<B:0/0 3:B0:0 4:<B:0/1 5:B0:1", show(steps[0]))
    assert.are.equal("0:<F:1/0 1:F1:0<F:1/1 2:B1:0>B:0/0 3:F1:1 4:B1:1>B:0/1", show(steps[1]))
    -- every schedule: each rank's actions in its list's order, one per step, and check_steps' invariants
    local n = 0
    for _, c in ipairs({ { "GPipe", 1 }, { "GPipe", 2 }, { "1F1B", 1 }, { "Interleaved1F1B", 2 },
      { "Interleaved1F1B", 3 } }) do
      for P = 2, 4 do
        for nmb = 1, 12 do
          if c[1] ~= "Interleaved1F1B" or nmb % P == 0 then
            local lay = pp.layout(P * c[2] * 2, { pp = P, schedule = c[1], layers_per_stage = 2 })
            local all = pp.actions(lay, nmb)
            local what = ("%s P=%d V=%d M=%d"):format(c[1], P, c[2], nmb)
            assert.is_nil(pp.check(lay, all, nmb, true), what)
            local st = pp.steps(lay, all)
            for r = 0, P - 1 do
              local k, last = 0, -1
              for _, s in ipairs(st[r]) do
                assert.is_true(s.t > last, what)
                last = s.t
                if s.action then
                  k = k + 1
                  assert.are.equal(all[r][k], s.action, what)
                end
              end
              assert.are.equal(#all[r], k, what)
            end
            n = n + 1
          end
        end
      end
    end
    assert.is_true(n > 100)
    -- the forward-only pass (validation): stage by stage of each rank, each micro-batch; rank 0's first stage
    -- sends all of them before its second stage receives, which hung when sends waited for the next receive
    L = pp.layout(4, { pp = 2, schedule = "Interleaved1F1B" })
    local fwd = { [0] = {}, [1] = {} }
    for r = 0, 1 do
      for _, st in ipairs(pp.stage_ids(L, r)) do
        for m = 0, 3 do fwd[r][#fwd[r] + 1] = F(st, m) end
      end
    end
    local fs = pp.steps(L, fwd)
    assert.is_nil(pp.check_steps(L, fs))
    assert.are.equal("0:F0:0>F:1/0 1:F0:1>F:1/1<F:2/0 2:F0:2>F:1/2<F:2/1 3:F0:3>F:1/3<F:2/2 4:F2:0>F:3/0<F:2/3 "
      .. "5:F2:1>F:3/1 6:F2:2>F:3/2 7:F2:3>F:3/3", show(fs[0]))
    -- the order that NCCL's in-order matching broke when a send waited for the rank's next receive: now by step
    L = pp.layout(4, { pp = 2, schedule = "Interleaved1F1B" })
    local all = { [0] = { F(0, 0), F(2, 0), F(0, 1), F(2, 1), B(2, 0), B(2, 1), B(0, 0), B(0, 1) },
      [1] = { F(1, 0), F(1, 1), F(3, 0), F(3, 1), B(3, 0), B(3, 1), B(1, 0), B(1, 1) } }
    assert.is_nil(pp.check(L, all, 2, true))
  end)

  it("check_steps says what a broken plan would do", function()
    local L = pp.layout(4, { pp = 2, schedule = "1F1B" })
    local function plan() return pp.steps(L, pp.actions(L, 2)) end
    local st = plan()
    st[0][2].send = nil -- (rank 0's F0:1 sends nothing)
    assert.are.equal("step 1:0>1: F:1:1 is received and never sent", pp.check_steps(L, st))
    st = plan()
    st[1][1].recvs[2] = st[1][1].recvs[1]
    assert.are.equal("rank 1 takes two messages from rank 0 in step 0", pp.check_steps(L, st))
    st = plan()
    st[1][1].action, st[1][2].action = st[1][2].action, nil -- (F1:0 in the step its input comes in)
    assert.are.equal("rank 1 runs F1:0 in step 0 before its input is there", pp.check_steps(L, st))
    st = plan()
    st[1][3].send.mb = 1
    assert.are.equal("step 2:1>0: B:0:1 is sent and B:0:0 received", pp.check_steps(L, st))
  end)
end)

describe("pipeline stages", function()
  local function build() return llama.build(ARGS, { device = "meta" }) end

  it("keep their blocks under the whole model's names; in a row they give its logits and gradients", function()
    local whole = llama.build(ARGS, { device = "cpu", seed = 3 })
    local L = pp.layout(ARGS.n_layers, { pp = 3, schedule = "1F1B" })
    local stages = {}
    for r = 0, 2 do
      local st = pp.split(build, llama.pp_plan, L, r)[1]
      st.model:to_empty("cpu")
      llama.init_weights(st.model, 3)
      stages[r + 1] = st
    end
    -- blocks 0 | 1-2 | 3-4; the embedding on the first stage, norm and output on the last
    local function names(st)
      local set = {}
      for _, np in ipairs(st.model:named_parameters()) do set[np[1]:gsub("^(layers%.%d+)%..*", "%1")] = true end
      local out = {}
      for k in pairs(set) do out[#out + 1] = k end
      table.sort(out)
      return table.concat(out, " ")
    end
    assert.are.equal("layers.0 tok_embeddings.weight", names(stages[1]))
    assert.are.equal("layers.1 layers.2", names(stages[2]))
    assert.are.equal("layers.3 layers.4 norm.weight output.weight", names(stages[3]))
    local union = {}
    for _, np in ipairs(pp.Stages(stages):named_parameters()) do
      assert.is_nil(union[np[1]], np[1])
      union[np[1]] = np[2]
    end
    local want = whole:named_parameters()
    for _, np in ipairs(want) do
      assert.are.same(np[2]:tolist_flat(), union[np[1]]:tolist_flat(), np[1]) -- the same initialization
      union[np[1]] = nil
    end
    assert.is_nil(next(union))
    for _, st in ipairs(stages) do
      for _, np in ipairs(st.model:named_parameters()) do union[np[1]] = np[2] end
    end

    local seq = {}
    for i = 1, 16 do seq[i] = (i * 37) % ARGS.vocab_size end
    local ids = titan.tensor(seq, { dtype = "int64" }):view(2, 8)
    for i = 1, 16 do seq[i] = (i * 11 + 5) % ARGS.vocab_size end
    local targets = titan.tensor(seq, { dtype = "int64" }):view(2, 8)
    local function loss_of(logits)
      return titan.F.cross_entropy(logits:reshape(-1, ARGS.vocab_size), targets:reshape(-1))
    end
    local ref = whole(ids)
    loss_of(ref):backward()
    -- stage by stage, each boundary a fresh leaf as a received activation is
    local x, ins, outs = ids, {}, {}
    for i, st in ipairs(stages) do
      if i > 1 then
        x = outs[i - 1]:detach()
        x.requires_grad = true
        ins[i] = x
      end
      outs[i] = st.model(x)
    end
    assert.are.same(ref:tolist_flat(), outs[3]:tolist_flat())
    loss_of(outs[3]):backward()
    for i = 2, 1, -1 do outs[i]:backward(ins[i + 1].grad) end
    for _, np in ipairs(want) do
      assert.are.same(np[2].grad:tolist_flat(), union[np[1]].grad:tolist_flat(), np[1])
    end
  end)

  it("activation checkpointing wraps the whole model's block numbers on each stage", function()
    local L = pp.layout(ARGS.n_layers, { pp = 2, schedule = "1F1B" }) -- blocks 0-1 | 2-4
    local ac = require("parallel.ac")
    local counts = {}
    for r = 0, 1 do
      local st = pp.split(build, llama.pp_plan, L, r)[1]
      counts[r + 1] = ac.apply(st.model, { mode = "selective", selective_ac_option = "2" })
      -- blocks 1 and 3 (every second from 1), as in the whole model
      for _, nl in ipairs(st.model.layers:named_children()) do
        assert.are.equal(tonumber(nl[1]) % 2 == 1, rawget(nl[2], "checkpointed") == true, nl[1])
      end
    end
    assert.are.same({ 1, 1 }, counts)
  end)

  it("a tied output layer is refused", function()
    assert.truthy(llama.pp_plan.check(llama.args("1B")):find("ties the output layer to the embedding", 1, true))
    assert.is_nil(llama.pp_plan.check(llama.args("debugmodel")))
  end)
end)
