-- describe.lua — the startup banner's lines about a job's layout: each
-- transform says what it did on this job (its module's describe(par), par
-- the object lua/parallel/parallelize.lua built); this file puts them in a
-- fixed order and holds what they share.
local titan = require("titan")

local M = {}

-- "a, b, a, a" -> "a x3, b": a list's distinct entries in first-seen order, with their counts.
function M.counted(list)
  local n, order = {}, {}
  for _, s in ipairs(list) do
    if not n[s] then order[#order + 1] = s end
    n[s] = (n[s] or 0) + 1
  end
  for i, s in ipairs(order) do order[i] = n[s] > 1 and ("%s x%d"):format(s, n[s]) or s end
  return table.concat(order, ", ")
end

-- What the collectives run over (on GPUs NCCL's; the threads then only feed the GPU).
function M.over(par)
  return par.dp and ({ nccl = "NCCL", ["local"] = "simulated ranks", fake = "a dry run's fake groups" })[
    par.dp:backend()] or "MPI"
end

function M.each(par)
  return par.device == "cpu" and (", %d threads each"):format(titan.num_threads()) or ""
end

-- The transforms in the banner's order, each with whether it applies to par.
M.order = {
  { "fsdp", function(par) return par.fsdp end },
  { "ddp", function(par) return not par.fsdp and par.dp and par.dims.dp_size > 1 end },
  { "cp", function(par) return par.cp_group end },
  { "ep", function(par) return par.ep_plan end },
  { "tp", function(par) return par.tp_plan end },
  { "pp", function(par) return par.pipe end },
  { "float8", function(par) return par.float8_count end },
  { "ac", function(par) return par.ac_blocks > 0 end },
}

-- The lines that apply to par, in M.order.
function M.lines(par)
  local out = {}
  for _, e in ipairs(M.order) do
    if e[2](par) then out[#out + 1] = require("parallel." .. e[1]).describe(par) end
  end
  return out
end

return M
