-- placements.lua — where a job's parameters lie: the device mesh of a
-- config on a world of ranks, and each parameter of one rank as a DTensor
-- (lua/titan/dtensor.lua) of the meta model, worked out without memory and
-- without communication. The REPL (`titan repl --world N RECIPE.lua`) shows
-- it; the trainer takes its checkpoint boxes from it and checks that every
-- tensor the transforms made has its piece's shape.
--
--   local job = require("parallel.placements").job(cfg, world, rank)
--   job.mesh                      -- the DeviceMesh [pp, dp_replicate, dp_shard, cp, tp] (+ views)
--   job.params[fqn]               -- a DTensor: global shape, placements, this rank's box
--   job.names                     -- this rank's parameter names, in the model's order
--   job.stages                    -- the pipeline stages this rank holds (pp > 1)
--   job:memory()                  -- bytes of parameters, gradients and optimizer state
--
-- The rules are the transforms' (until each transform declares its own,
-- lua/parallel/*.lua): a parameter lies on the mesh [dp_replicate,
-- dp_shard_cp, tp] of its pipeline stage: tensor parallelism cuts the
-- family's colwise weights by rows (Shard(1)), its rowwise ones by columns
-- (Shard(2)), the output layer and the embedding by vocabulary rows when
-- loss and vocabulary parallelism split them; FSDP (dp_shard > 1) then cuts
-- the rows of that slice over the dp_shard x cp ranks (torch.chunk's rule:
-- the last ranks may hold empty pieces); dp_replicate holds copies (DDP,
-- HSDP). Under expert parallelism a rank holds its experts only; their FSDP
-- (when dp_shard > 1 and the ep groups repeat) cuts their rows over the
-- ranks holding the same experts (the ep_replica view).
local dt = require("titan.dtensor")
local meshlib = require("titan.mesh")

local M = {}

local Job = {}
Job.__index = Job

local function set_of(list)
  local s = {}
  for _, v in ipairs(list or {}) do s[v] = true end
  return s
end

-- The tensor dim a TP plan cuts a parameter along (nil: whole on every tp rank).
local function tp_dim(name, plan, flags)
  if name == (plan.output or "") .. ".weight" then return flags.loss_parallel and 1 or nil end
  if name == (plan.embedding or "") .. ".weight" then return flags.vocab_parallel and 1 or nil end
  local inner = name:match("^layers%.%d+%.(.+)%.weight$")
  if not inner then return nil end
  if flags.colwise[inner] then return 1 end
  if flags.rowwise[inner] then return 2 end
  return nil
end

-- cfg: a resolved config; world, rank: the job's ranks and the one to
-- describe. The degrees' errors are dims.lua's. opts.tp_flags: how TP
-- splits (sequence, loss and vocabulary parallel: what the parallelize
-- function declared; default the config's, as parallel.dims derives them);
-- opts.tp, opts.fsdp: false where the parallelize function left TP or FSDP
-- off although the degrees allow them (default: on where the degree is > 1).
function M.job(cfg, world, rank, opts)
  opts = opts or {}
  local par, t = cfg.parallelism, cfg.training
  local family = require("models." .. cfg.model.name)
  local function build_meta()
    return family.build(cfg.model.flavor, { device = "meta", dtype = t.mixed_precision_param,
      overrides = { max_seq_len = math.max(t.seq_len, family.args(cfg.model.flavor).max_seq_len) } })
  end
  local model = build_meta()
  local pd = require("parallel.dims").new(cfg, world)
  local rep, shard, tp, pp, cp = pd.dp_replicate, pd.dp_shard, pd.tp, pd.pp, pd.cp
  local ep = pd:check_experts(model, family)
  if tp > 1 then require("parallel.tp").check(model, family.tp_plan, tp) end
  local mesh = meshlib.from_parallelism({ pp = pp, dp_replicate = rep, dp_shard = shard, cp = cp, tp = tp, ep = ep },
    world, rank, { fake = true })
  local self = setmetatable({ cfg = cfg, mesh = mesh, world = world, rank = rank, family = family, params = {},
    names = {}, degrees = { pp = pp, dp_replicate = rep, dp_shard = shard, cp = cp, tp = tp, ep = ep },
    dtype = t.mixed_precision_param }, Job)

  -- this rank's modules: its pipeline stages, or the whole model
  local models = { model }
  if pp > 1 then
    local pplib = require("parallel.pp")
    local layout = pplib.layout(model.args.n_layers, { pp = pp, schedule = par.pipeline_parallel_schedule,
      layers_per_stage = par.pipeline_parallel_layers_per_stage })
    local pp_rank = mesh:coord()[1]
    self.stages = {}
    models = {}
    for _, st in ipairs(pplib.split(build_meta, family.pp_plan, layout, pp_rank)) do
      models[#models + 1] = st.model
      self.stages[#self.stages + 1] = { id = st.id, layers = { st.lo, st.hi - 1 } }
    end
    self.pp_layout = layout
  end
  -- expert parallelism: the experts this rank holds
  if ep > 1 then
    local eplib = require("parallel.ep")
    for _, m in ipairs(models) do eplib.apply(m, mesh:group("ep")) end
  end
  self.model = #models == 1 and models[1] or models

  -- the flags the trainer derives for TP
  local plan = family.tp_plan or {}
  local flags = { colwise = set_of(plan.colwise), rowwise = set_of(plan.rowwise) }
  if opts.tp == false then tp = 1 end
  if tp > 1 then
    local f = opts.tp_flags or pd:check_model(model, family).tp_flags
    flags.loss_parallel, flags.vocab_parallel = f.loss_parallel, f.vocab_parallel
  end
  local pmesh = mesh:sub({ "dp_replicate", "dp_shard_cp", "tp" })
  local fsdp = shard > 1 and opts.fsdp ~= false
  local replicas = ep > 1 and mesh:size("ep_replica") > 1
  local emesh = ep > 1 and mesh:sub("ep_replica")
  for _, m in ipairs(models) do
    for _, np in ipairs(m:named_parameters()) do
      local name, p = np[1], np[2]
      local d
      if ep > 1 and name:find(".moe.experts.", 1, true) then
        d = dt.meta(p:shape(), p:dtype(), emesh, { (fsdp and replicas) and dt.Shard(1) or dt.Replicate() })
      else
        local k = tp > 1 and tp_dim(name, plan, flags)
        d = dt.meta(p:shape(), p:dtype(), pmesh, { dt.Replicate(), fsdp and dt.Shard(1) or dt.Replicate(),
          k and dt.Shard(k) or dt.Replicate() }, { order = { "tp", "dp_shard_cp" } })
      end
      self.params[name] = d
      self.names[#self.names + 1] = name
    end
  end
  return self
end

-- Bytes this rank holds for its parameters, their gradients and the AdamW
-- state (two float32 moments, and float32 master weights under bf16
-- parameters): { params, grads, optimizer, total }.
function Job:memory()
  local pb, ob = 0, 0
  for _, name in ipairs(self.names) do
    local d = self.params[name]
    pb = pb + d:bytes_local()
    ob = ob + d:numel_local() * (8 + (d.dtype == "bfloat16" and 4 or 0))
  end
  return { params = pb, grads = pb, optimizer = ob, total = 2 * pb + ob }
end

return M
