-- The debug model with its own parallelize function: the family's steps
-- (lua/parallel/llama3.lua), except that tensor parallelism leaves the
-- output layer whole on every tp rank (no loss parallelism: each rank
-- computes all the logits). docs/custom_parallelize.md walks through it.
--   ./titan --nproc 2 lua/recipes/llama3_debugmodel_whole_output.lua --parallelism.tp=2
return {
  base = "llama3_debugmodel",
  job = { description = "Llama 3 debug model, output layer unsharded by TP", dump_folder = "./outputs/whole_output" },

  parallelize = function(model, mesh, cfg, par)
    for _, m in ipairs(par:pipeline(model, mesh.pp)) do
      par:tensor_parallel(m, mesh.tp, { loss_parallel = false }) -- the output layer stays whole
      par:float8(m, mesh.tp)
      par:activation_checkpoint(m, cfg.activation_checkpoint)
      par:context_parallel(m, mesh.cp)
      par:expert_parallel(m, mesh.ep)
    end
    if par:enabled("fsdp") then par:fully_shard(mesh.dp_shard_cp, { replicate = mesh.dp_replicate })
    else par:replicate(mesh.dp_cp) end
  end,
}
