-- bench/allreduce.lua — the mpi backend's all-reduce of one gradient-sized
-- float32 buffer, best of 10 (each after a barrier), as DDP does once per
-- bucket.
--
--   OMP_NUM_THREADS=1 ./titan --nproc 2 bench/allreduce.lua [MEGABYTES]   (default 26.4: the debug model)
local titan = require("titan")
local dist = require("titan.dist")
local clock = require("titan.clock")

local g = dist.world_group() or error("bench/allreduce.lua: run it under titan --nproc N (N > 1)", 0)
local mb = tonumber(arg[1] or "26.4")
local t = titan.ones({ math.floor(mb * 1e6 / 4) })
local best = math.huge
for _ = 1, 10 do
  g:barrier()
  local t0 = clock.now()
  g:all_reduce(t, "sum")
  best = math.min(best, clock.now() - t0)
end
if g:rank() == 0 then
  print(("all_reduce of %.1f MB over %d ranks: best %.1f ms (%.2f GB/s of buffer)"):format(mb, g:size(), best * 1e3,
    mb / 1e3 / best))
end
