-- data/args.lua — argument and saved-state checks the datasets share, so
-- each mistake reads the same wherever it is made.
local M = {}

-- Errors carry no Lua position: the message names the dataset and the option.
function M.int(v, name, min, who)
  if type(v) ~= "number" or v ~= math.floor(v) or v < min then
    error(("%s: %s must be an integer >= %d, got %s"):format(who, name, min, tostring(v)), 0)
  end
end

-- rank, world from opts (defaults 0, 1).
function M.shard(opts, who)
  local rank, world = opts.rank or 0, opts.world or 1
  M.int(world, "world", 1, who)
  M.int(rank, "rank", 0, who)
  if rank >= world then error(("%s: rank %d is outside world %d"):format(who, rank, world), 0) end
  return rank, world
end

-- A saved state must come from the same kind of dataset with the same
-- layout: resuming onto other settings would silently change the data.
function M.state(name, saved, kind, current)
  if type(saved) ~= "table" or saved.kind ~= kind then
    error(("%s: expected a saved '%s' dataset state, got %s"):format(name, kind,
      type(saved) == "table" and ("'" .. tostring(saved.kind) .. "'") or type(saved)), 0)
  end
  local keys = {}
  for k in pairs(current) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    if saved[k] ~= current[k] then
      -- (what a user changes to get here: the data files, seq_len, the ranks; say the ways out)
      error(("%s: the saved loader state has %s = %s, this dataset has %s = %s (the data, training.seq_len "
        .. "or the data-parallel ranks changed since the checkpoint: resume with the settings it was saved "
        .. "with, or start the data anew with --checkpoint.exclude_from_loading=dataloader)"):format(name, k,
        tostring(saved[k]), k, tostring(current[k])), 0)
    end
  end
end

return M
