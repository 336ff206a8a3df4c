-- data/split.lua — the held-out validation split, deterministic and disjoint
-- from training:
--   * documents (text read on the fly, and `titan data prepare --val-out`):
--     with fraction f, document d (0-based, in reading order) is held out when
--     floor((d + 1) f) > floor(d f): every (1/f)-th document, exactly
--     floor(n f) of the first n, spread over the whole corpus;
--   * one binary token file: the last round(f * N) tokens form the
--     validation stream, the rest the training stream.
local M = {}

-- Checks opts.split / opts.val_fraction; returns split ("train" | "val" | nil), fraction.
function M.check(opts, who)
  local s, f = opts.split, opts.val_fraction or 0
  if s ~= nil and s ~= "train" and s ~= "val" then
    error(("%s: split must be \"train\" or \"val\", got %s"):format(who, tostring(s)), 0)
  end
  if type(f) ~= "number" or f < 0 or f >= 1 then
    error(("%s: val_fraction must be a number in [0, 1), got %s"):format(who, tostring(f)), 0)
  end
  if s == "val" and f == 0 then
    error(("%s: split \"val\" needs val_fraction > 0"):format(who), 0)
  end
  if s == nil then f = 0 end
  return s, f
end

function M.is_val_doc(doc, fraction)
  if fraction <= 0 then return false end
  return math.floor((doc + 1) * fraction) > math.floor(doc * fraction)
end

-- Whether document `doc` belongs to the split.
function M.keep_doc(doc, split, fraction)
  if split == nil or fraction == 0 then return true end
  return M.is_val_doc(doc, fraction) == (split == "val")
end

-- The token range [base, base + len) of a split of an N-token stream.
function M.token_range(n, split, fraction)
  if split == nil or fraction == 0 then return 0, n end
  local cut = n - math.floor(n * fraction + 0.5)
  if split == "train" then return 0, cut end
  return cut, n - cut
end

return M
