-- estimate.lua — a job's memory, FLOPs, communication and step time for
-- each rank role, before any hardware: the trainer's own start-up and two
-- of its training steps run on the meta device (shapes, no memory, no
-- math) over fake process groups (no peers: lua/titan/dist.lua's fake
-- backend), with the meta device's accounting counting what every tensor
-- would hold on a real one and each group counting what it carried.
--
--   local est = require("titan.estimate")
--   local r = est.run(cfg, world, { device = "h100" })   -- a report: r.roles[i] per pipeline stage
--   print(est.format(r))
--
-- What the figures are (docs/estimate.md):
--   params      the parameters this rank holds (its TP slices, FSDP shards, stages, experts), and buffers
--   optimizer   AdamW's state once made (two f32 moments per parameter; f32 master weights under bf16)
--   peak        the most held at once during a steady-state step (step 2): params, optimizer state,
--               gradients, activations and every temporary, as the allocator counts them (its size classes)
--   activations peak - params - optimizer - the gradients held at the end of the backward
--   comm        bytes this rank handed to each mesh dim's collectives in one step (by kind)
--   flops       the model's FLOPs per token (6N + attention, TorchTitan's count) x the tokens this rank
--               computes in a step
--   time        a roofline: compute at the device's peak for the parameters' dtype, each dim's bytes
--               at its link's bandwidth (ring all-reduce 2(n-1)/n, gathers and scatters (n-1)/n,
--               point to point 1), overlapped (max) and not (sum)
-- One rank per pipeline stage is run (the ranks of a stage hold and do the
-- same; routing is taken as balanced over the experts). The dry run's
-- tensors are dropped with its trainer and collected before the next role,
-- whose figures are measured from what is held when it starts.
local titan = require("titan")
local dist = require("titan.dist")
local tensor = require("titan.tensor")
local devices = require("titan.devices")

local C = titan.C
local M = {}

local GiB = 2 ^ 30

local function meta_stats()
  local s = titan.memory_stats("meta")
  return s
end

local KINDS = { "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "send", "recv" }
M.KINDS = KINDS

-- Bytes and calls each group of the job's mesh carried (since the last
-- reset), by the mesh dims it spans: { [label] = { size, bytes = {kind = n}, calls = {kind = n} } }.
local function traffic(par)
  local out = {}
  for _, e in ipairs(par.mesh:made_groups()) do
    local t = e.group:traffic()
    out[e.label] = { size = e.group:size(), bytes = t.bytes, calls = t.calls }
  end
  return out
end

local function reset_traffic(par)
  for _, e in ipairs(par.mesh:made_groups()) do e.group:reset_traffic() end
end

-- A trainer of rank `rank` of `world` on the meta device: the trainer's
-- own pieces (lua/titan/trainer.lua) over the job the family's parallel
-- layer lays out, its data a stand-in of the right shapes.
local function dry_trainer(cfg, world, rank)
  local trainer = require("titan.trainer")
  local family = require("models." .. cfg.model.name)
  local root = world > 1 and dist.new_group({ backend = "fake", rank = rank, world = world }) or nil
  local acc = function(on) C.tt_memory_meta_accounting(on and 1 or 0) end
  local par = family.parallel().setup(cfg, family, { rank = rank, world = world, local_size = 1 },
    { device = "meta", root = root, fit_check = false, print = function() end, parallelize = cfg.parallelize,
      accounting = acc })
  local tr = setmetatable({ cfg = cfg, par = par, model = par.model, device = "meta", rank = rank, world = world,
    print = function() end, dp_rank = par.dp_rank, dp_size = par.dims.dp_size, step = 0 }, trainer.Trainer)
  local t = cfg.training
  local B, T = t.local_batch_size, t.seq_len
  tr.data = { train = { next = function()
    return { inputs = titan.empty({ B, T }, { dtype = "int64", device = "meta" }),
      targets = titan.empty({ B, T }, { dtype = "int64", device = "meta" }) }
  end } }
  local per_micro = B * T * tr.dp_size
  tr.grad_accum = t.global_batch_tokens > 0 and math.max(1, math.floor(t.global_batch_tokens / per_micro)) or 1
  tr.loss_fn = cfg.loss_fn or trainer.loss_fn
  tr.train_step = cfg.train_step or trainer.train_step
  tr.checkpoint = {}
  tr.device_update = false
  return tr, root
end

-- The start-up a dry run checks beyond the layout (rank 0's, for real):
-- the tokenizer and the data (their files read), the checkpoint plan (what
-- would be loaded; nothing is written), and the banner's lines.
local function startup(tr, d)
  local cfg = tr.cfg
  local stand_in = tr.data
  tr:build_data()
  local loader = tr.data
  tr.data = stand_in
  if loader.train and loader.train.close then loader.train:close() end
  tr.flops_per_token, tr.nparams = tr.par.flops_per_token, tr.par.nparams
  tr.peak_flops = cfg.metrics.peak_flops > 0 and cfg.metrics.peak_flops
    or (d.tflops[cfg.training.mixed_precision_param] or d.tflops.float32) * 1e12
  tr.peak_source = cfg.metrics.peak_flops > 0 and "configured" or ("%s, the device table's"):format(d.name)
  local lines = {}
  tr.print = function(line) lines[#lines + 1] = line end
  tr:banner()
  tr.print = function() end
  local ck = cfg.checkpoint
  local plan
  if not ck.enable then
    plan = "checkpoint: off (checkpoint.enable = false)"
  else
    -- (the plan is rank 0's, read alone: the manager of one rank)
    local m = require("titan.checkpoint.manager").new(ck, { dump_folder = cfg.job.dump_folder, rank = 0,
      world = 1, log = function() end })
    local steps = m:complete_steps(true)
    plan = #steps > 0 and ("checkpoint: %s holds step %d; the job would resume from it"):format(m.folder,
      steps[#steps].step) or ck.initial_load_path ~= "" and ("checkpoint: none in %s; the job would start from %s")
      :format(m.folder, ck.initial_load_path) or ("checkpoint: none in %s; the job would start from scratch")
      :format(m.folder)
  end
  lines[#lines + 1] = plan
  return lines
end

-- One rank's figures (see the header). cfg: resolved; the job's device is
-- read for the dtype only. opts.startup: also check the start-up a dry run
-- checks (startup() above), with opts.device_table for the banner's peak.
function M.role(cfg, world, rank, opts)
  opts = opts or {}
  local prev_reads = tensor.dry_run
  local prev_acc = C.tt_memory_meta_accounting(0)
  local prev_dry = C.tt_dist_fake_dry(1)
  local base = meta_stats().allocated
  local ok, res = pcall(function()
    tensor.dry_run = true
    local tr, root = dry_trainer(cfg, world, rank)
    local par = tr.par
    local banner = opts.startup and startup(tr, opts.device_table)
    C.tt_memory_meta_accounting(1)
    local params_b = meta_stats().allocated - base
    tr:build_optimizer()
    local plist = par:parameters()
    -- Step 1 makes the optimizer state; step 2 is the steady state a real run repeats. The peak is
    -- the higher of the two, as a real run's allocator reports it.
    titan.reset_peak_memory("meta")
    tr:step_once(1, plist)
    local peak1 = meta_stats().peak_allocated - base
    local after1 = meta_stats().allocated - base
    reset_traffic(par)
    titan.reset_peak_memory("meta")
    local grads_b = 0
    local sync = par.sync
    par.sync = function(p, ps, loss) -- (the gradients held when the backward is done)
      for _, x in ipairs(ps) do if x.grad then grads_b = grads_b + x.grad:nbytes() end end
      return sync(p, ps, loss)
    end
    local written0 = meta_stats().allocated_total
    tr:step_once(2, plist)
    par.sync = nil
    local s = meta_stats()
    local out = {
      rank = rank, coord = par.mesh:coord(), names = par.mesh:names(), stage = par.pp_rank,
      params = params_b, optimizer = after1 - params_b, grads = grads_b,
      peak = math.max(peak1, s.peak_allocated - base), traffic = traffic(par), written = s.allocated_total - written0,
      -- (the step's tokens over every rank, each rank's share: TorchTitan's per-GPU count, which divides a
      -- replica's tokens by tp x cp x pp)
      tokens = cfg.training.local_batch_size * cfg.training.seq_len * tr.grad_accum * tr.dp_size / world,
      flops_per_token = par.flops_per_token, nparams = par.nparams, grad_accum = tr.grad_accum,
      -- (the matmuls' dtype: float8 Linear layers multiply in fp8; every FLOP is then counted at its peak)
      dtype = (("," .. cfg.model.converters .. ","):gsub("%s", ""):find(",float8,", 1, true)) and "float8"
        or cfg.training.mixed_precision_param, banner = banner,
    }
    out.activations = out.peak - out.params - out.optimizer - out.grads
    par:close()
    if root then root:free() end
    return out
  end)
  C.tt_memory_meta_accounting(prev_acc)
  C.tt_dist_fake_dry(prev_dry)
  tensor.dry_run = prev_reads
  if not ok then error(res, 0) end
  collectgarbage()
  return res
end

-- The job's degrees, through its model family's parallel layer (lua/titan
-- requires nothing from lua/parallel itself).
local function dims_of(cfg, world) return require("models." .. cfg.model.name).parallel().dims(cfg, world) end

-- The ranks that stand for every role: one per pipeline stage (its first rank).
function M.roles(cfg, world)
  local pd = dims_of(cfg, world)
  local out = {}
  for s = 0, pd.pp - 1 do out[#out + 1] = s * (world / pd.pp) end
  return out
end

-- The roofline of one role on device d (a devices.lua table).
local FACTOR = { all_reduce = function(n) return 2 * (n - 1) / n end, reduce_scatter = function(n) return (n - 1) / n end,
  all_gather = function(n) return (n - 1) / n end, all_to_all = function(n) return (n - 1) / n end,
  broadcast = function() return 1 end, send = function() return 1 end, recv = function() return 0 end }

local OVERLAPPED = { dp_cp = true, dp_shard_cp = true, dp_replicate = true, dp = true, dp_shard = true,
  ep_replica = true, world = true }
M.OVERLAPPED = OVERLAPPED

function M.roofline(r, d, world)
  local tflops = d.tflops[r.dtype] or d.tflops.float32
  local flops = r.flops_per_token * r.tokens
  local compute = flops / (tflops * 1e12)
  -- (every tensor the step makes is written once and read once at the memory's bandwidth: the
  -- elementwise work, norms, softmax and copies that the matmuls' FLOPs leave out)
  local memory = 2 * r.written / (d.hbm_gbs * 1e9)
  -- (the data-parallel dims' collectives, FSDP's and DDP's, overlap the compute; tensor, context,
  -- expert and pipeline parallelism's carry activations the next op waits for)
  local comm, serial, dims = 0, 0, {}
  for label, t in pairs(r.traffic) do
    local n = t.size
    -- (a group within a node rides NVLink; one that spans nodes, the network)
    local bw = (n <= d.ranks_per_node and world <= d.ranks_per_node or n <= d.ranks_per_node and label == "tp")
      and d.intra_gbs or d.inter_gbs
    local secs = 0
    if n > 1 then
      for k, b in pairs(t.bytes) do secs = secs + b * FACTOR[k](n) / (bw * 1e9) end
    end
    dims[label] = secs
    if OVERLAPPED[label] then comm = comm + secs else serial = serial + secs end
  end
  local step = math.max(compute + memory + serial, comm)
  return { flops = flops, compute_s = compute, memory_s = memory, comm_s = comm + serial, serial_s = serial,
    dims_s = dims, step_s = step, step_serial_s = compute + memory + comm + serial, tokens_per_s = r.tokens / step,
    mfu = compute / step }
end

-- Keys that could make a role fit, each checked by estimating again (the
-- worst role only): full activation checkpointing, half the local batch,
-- every data-parallel rank sharding (no replicas), twice the tensor-parallel
-- ranks. Returns { { keys = "...", peak = bytes }, ... } of those that fit.
function M.what_fits(cfg, world, rank, d)
  local config = require("titan.config")
  local par, t = cfg.parallelism, cfg.training
  local cands = {}
  if cfg.activation_checkpoint.mode ~= "full" then
    cands[#cands + 1] = { "--activation_checkpoint.mode=full" }
  end
  if t.local_batch_size >= 2 and t.local_batch_size % 2 == 0 then
    cands[#cands + 1] = { ("--training.local_batch_size=%d"):format(t.local_batch_size / 2) }
  end
  local pd = dims_of(cfg, world)
  if pd.dp_replicate > 1 then
    cands[#cands + 1] = { "--parallelism.dp_replicate=1", ("--parallelism.dp_shard=%d"):format(pd.dp_shard * pd.dp_replicate) }
  end
  if pd.dp_size % 2 == 0 then
    cands[#cands + 1] = { ("--parallelism.tp=%d"):format(pd.tp * 2), "--parallelism.dp_replicate=1",
      "--parallelism.dp_shard=-1" }
  end
  local out = {}
  for _, keys in ipairs(cands) do
    local ok, r = pcall(function()
      local c = config.resolve(cfg, keys)
      return M.role(c, world, rank)
    end)
    if ok and r.peak <= d.memory_gib * GiB then out[#out + 1] = { keys = table.concat(keys, " "), peak = r.peak } end
  end
  return out
end

-- The whole estimate: opts.device (a name in devices.lua or a table), opts.roles (ranks to run).
function M.run(cfg, world, opts)
  opts = opts or {}
  local d = opts.device
  if type(d) == "string" or d == nil then
    local name = d or (cfg.training.device:match("^cuda") and "h100" or "cpu")
    d = devices.get(name)
    if not d then
      error(("estimate: --device %s; expected one of %s, or a table of your own (lua/titan/devices.lua)"):format(name,
        table.concat(devices.names, ", ")), 0)
    end
  end
  local report = { world = world, device = d, roles = {}, model = cfg.model.name .. " " .. cfg.model.flavor }
  for i, r in ipairs(opts.roles or M.roles(cfg, world)) do
    local role = M.role(cfg, world, r, { startup = opts.startup and i == 1, device_table = d })
    role.time = M.roofline(role, d, world)
    role.fits = role.peak <= d.memory_gib * GiB
    if not role.fits and opts.advise ~= false then role.would_fit = M.what_fits(cfg, world, r, d) end
    report.roles[#report.roles + 1] = role
  end
  return report
end

local function gib(b) return ("%.2f GiB"):format(b / GiB) end
local function human(b)
  if b >= GiB then return ("%.2f GiB"):format(b / GiB) end
  if b >= 2 ^ 20 then return ("%.1f MiB"):format(b / 2 ^ 20) end
  if b >= 1024 then return ("%.1f KiB"):format(b / 1024) end
  return ("%d B"):format(b)
end
M.human = human

-- The report as text.
function M.format(rep)
  local d = rep.device
  local lines = { ("estimate: %s on %d rank(s) of %s (%.1f GiB each)"):format(rep.model, rep.world, d.name,
    d.memory_gib) }
  for _, r in ipairs(rep.roles) do
    local where = {}
    for i, n in ipairs(r.names) do where[#where + 1] = ("%s %d"):format(n, r.coord[i]) end
    lines[#lines + 1] = ("rank %d (%s):"):format(r.rank, table.concat(where, ", "))
    lines[#lines + 1] = ("  memory: params %s, optimizer %s, gradients %s, activations and temporaries %s; "
      .. "peak %s (%.0f%% of %.1f GiB)%s"):format(gib(r.params), gib(r.optimizer), gib(r.grads), gib(r.activations),
      gib(r.peak), 100 * r.peak / (d.memory_gib * GiB), d.memory_gib,
      r.fits and "" or (" -- does not fit, by %s"):format(gib(r.peak - d.memory_gib * GiB)))
    if r.would_fit then
      if #r.would_fit == 0 then
        lines[#lines + 1] = "  none of full AC, half the local batch, sharding over every data-parallel rank or twice "
          .. "the tp ranks alone makes it fit: more ranks (--world), pipeline stages, or a smaller flavor"
      end
      for _, w in ipairs(r.would_fit) do
        lines[#lines + 1] = ("  would fit with %s: peak %s"):format(w.keys, gib(w.peak))
      end
    end
    local t = r.time
    lines[#lines + 1] = ("  compute: %.3g TFLOP per step (%s tokens a rank x %.3g GFLOP/token), %.1f ms at peak; %s written "
      .. "and read again, %.1f ms at %d GB/s"):format(t.flops / 1e12, r.tokens, r.flops_per_token / 1e9,
      t.compute_s * 1e3, human(r.written), t.memory_s * 1e3, d.hbm_gbs)
    local labels = {}
    for label in pairs(r.traffic) do labels[#labels + 1] = label end
    table.sort(labels)
    for _, label in ipairs(labels) do
      local tr, parts, total = r.traffic[label], {}, 0
      for _, k in ipairs(KINDS) do
        local b = tr.bytes[k] or 0
        if b > 0 then
          parts[#parts + 1] = ("%s %s x%d"):format(k, human(b), tr.calls[k])
          total = total + b
        end
      end
      if total > 0 then
        lines[#lines + 1] = ("  comm over %s (%d ranks): %s per step (%s), %.1f ms%s"):format(label, tr.size,
          human(total), table.concat(parts, ", "), (t.dims_s[label] or 0) * 1e3,
          OVERLAPPED[label] and " (overlapped)" or " (in the critical path)")
      end
    end
    lines[#lines + 1] = ("  step: %.1f ms (data-parallel communication overlapped with compute; %.1f ms all one "
      .. "after the other), "
      .. "%s tokens/s per rank, MFU %.1f%%"):format(t.step_s * 1e3, t.step_serial_s * 1e3,
      require("titan.metrics").commas(math.floor(t.tokens_per_s)), 100 * t.mfu)
  end
  return table.concat(lines, "\n")
end

return M
