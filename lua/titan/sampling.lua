-- sampling.lua — next-token sampling, written in Lua so it is easy to
-- change: temperature, top-k, then top-p (nucleus) over the softmax of one
-- row of logits. The softmax itself runs in C.
local titan = require("titan")

local M = {}

-- logits: a 1-D tensor [V]. opts: temperature (1; 0 = greedy), top_k (0 =
-- off), top_p (1 = off), rng (a function returning uniform [0, 1)).
function M.sample(logits, opts)
  opts = opts or {}
  local temperature = opts.temperature or 1
  if temperature <= 0 then return titan.argmax(logits):item() end
  local probs = titan.scope(function()
    return logits:float():scale(1 / temperature):reshape(1, -1):softmax():tolist_flat()
  end)
  -- candidates sorted by probability (ties by id, for determinism)
  local ids = {}
  for i = 1, #probs do ids[i] = i end
  table.sort(ids, function(a, b)
    if probs[a] ~= probs[b] then return probs[a] > probs[b] end
    return a < b
  end)
  local n = #ids
  if opts.top_k and opts.top_k > 0 then n = math.min(n, opts.top_k) end
  local top_p = opts.top_p or 1
  local mass, keep = 0, 0
  for i = 1, n do
    keep = i
    mass = mass + probs[ids[i]]
    if mass >= top_p then break end
  end
  local r = (opts.rng or math.random)() * mass
  local acc = 0
  for i = 1, keep do
    acc = acc + probs[ids[i]]
    if r < acc then return ids[i] - 1 end
  end
  return ids[keep] - 1
end

-- Generate up to max_new_tokens after `prompt_ids` (a Lua table) with a
-- model mapping int64 [1, T] -> logits [1, T, V]. Stops at eos_id. Calls
-- on_token(id) for each new token (streaming). opts.vocab_size: sample only
-- ids below it (a tokenizer smaller than the model's vocabulary cannot
-- decode the rest).
function M.generate(model, prompt_ids, opts)
  opts = opts or {}
  local ids = { unpack(prompt_ids) }
  local max_len = opts.max_seq_len or 2048
  -- A seeded stream for sampling: a 31-bit LCG (exact in doubles), so the
  -- same seed gives the same text on every machine.
  local state = (opts.seed or 0) % 2147483647 + 1
  local rng = opts.rng or function()
    state = (state * 48271) % 2147483647
    return state / 2147483647
  end
  for _ = 1, opts.max_new_tokens or 64 do
    local window = {}
    for i = math.max(1, #ids - max_len + 1), #ids do window[#window + 1] = ids[i] end
    local next_id = titan.no_grad(function()
      return titan.scope(function()
        local x = titan.tensor({ window }, { dtype = "int64", device = opts.device })
        local logits = model(x)
        local last = logits:select(2, #window):select(1, 1)
        if opts.vocab_size and opts.vocab_size < last:size(1) then last = last:narrow(1, 1, opts.vocab_size) end
        return M.sample(last, { temperature = opts.temperature, top_k = opts.top_k, top_p = opts.top_p, rng = rng })
      end)
    end)
    ids[#ids + 1] = next_id
    if opts.on_token then opts.on_token(next_id) end
    if opts.eos_id and next_id == opts.eos_id then break end
  end
  return ids
end

return M
