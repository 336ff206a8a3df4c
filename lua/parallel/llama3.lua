-- llama3.lua — how a Llama 3 (and its mixture-of-experts flavors) is laid
-- over the ranks: TorchTitan's parallelize_llama, in its order. Each step
-- is one call on a named sub-mesh of the job's DeviceMesh [pp, dp_replicate,
-- dp_shard, cp, tp] (lua/titan/mesh.lua); a step whose sub-mesh has one
-- rank (or that the config leaves off) does nothing. The steps and what
-- each does are lua/parallel/parallelize.lua's; a recipe replaces this
-- function with its own (`parallelize = function(model, mesh, cfg, par) ... end`:
-- docs/custom_parallelize.md).
--
-- model: the whole model, built on meta (no memory yet); mesh: the job's
-- mesh; cfg: the resolved config; par: the job being laid out.
local M = {}

function M.parallelize(model, mesh, cfg, par)
  -- Pipeline parallelism first: this rank's stages, each a pruned copy of
  -- the model (lua/parallel/pp.lua); { model } without it.
  for _, m in ipairs(par:pipeline(model, mesh.pp)) do
    -- Tensor parallelism: attention's heads and the feed-forward's units
    -- split over tp (colwise in, rowwise out); with sequence parallelism the
    -- norms and the residual stream split along the sequence; with loss
    -- parallelism the output layer by vocabulary (lua/parallel/tp.lua).
    par:tensor_parallel(m, mesh.tp)
    -- Float8 Linear layers (model.converters = float8), their scales over tp.
    par:float8(m, mesh.tp)
    -- Activation checkpointing of the blocks activation_checkpoint picks.
    par:activation_checkpoint(m, cfg.activation_checkpoint)
    -- Context parallelism: attention's inner function and RoPE's positions
    -- for this rank's chunks of the sequence (lua/parallel/cp.lua).
    par:context_parallel(m, mesh.cp)
    -- Expert parallelism: each rank of an ep group keeps its share of the
    -- experts; tokens travel to them and back (lua/parallel/ep.lua).
    par:expert_parallel(m, mesh.ep)
  end
  -- Data parallelism last: FSDP over dp_shard x cp (HSDP: replicated over
  -- dp_replicate), or DDP over the data-parallel ranks. Under expert
  -- parallelism FSDP shards the experts over the ranks holding the same ones.
  if par:enabled("fsdp") then
    par:fully_shard(mesh.dp_shard_cp, { replicate = mesh.dp_replicate })
  else
    par:replicate(mesh.dp_cp)
  end
  return model
end

return M
