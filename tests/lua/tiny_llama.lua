-- A Llama 3 small enough for specs that run its forward and backward many
-- times in one process (fsdp_spec, ddp_spec): its args, and a batch of
-- token ids from a fixed linear congruential sequence.
local titan = require("titan")

local M = {}

M.ARGS = { dim = 64, n_layers = 3, n_heads = 4, n_kv_heads = 2, multiple_of = 32, vocab_size = 96, max_seq_len = 64 }

-- int64 [2, 24] ids below vocab_size, the same for the same seed.
function M.ids_batch(seed)
  local rows, r = {}, seed
  for b = 1, 2 do
    rows[b] = {}
    for t = 1, 24 do
      r = (r * 1103515245 + 12345) % 2147483648
      rows[b][t] = r % M.ARGS.vocab_size
    end
  end
  return titan.tensor(rows, { dtype = "int64" })
end

return M
