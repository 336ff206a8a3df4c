-- step_helpers.lua — what the cuemu specs that count a training step share:
-- the skip anywhere but on cuemu, and the debug-model trainer they count.
local ffi = require("ffi")

local S = {}

-- Declares cuemu's counters (`decls`, C) and exits 77 (ctest: skipped)
-- unless the running library exports `symbol`, i.e. anywhere but on cuemu.
function S.require_cuemu(decls, symbol)
  pcall(ffi.cdef, decls)
  if not pcall(function() return ffi.C[symbol] end) then
    io.stderr:write(("not on cuemu (no %s): skipped\n"):format(symbol))
    os.exit(77)
  end
end

-- A trainer on the debug model at a small size (dims multiples of 8, as
-- real models' are); log_freq far away, so only the last step of each
-- train() call logs (trainer.lua logs step == last). Returns it and the
-- lines it printed.
function S.debug_trainer(extra)
  local config = require("titan.config")
  local trainer = require("titan.trainer")
  local recipe = config.load_recipe("llama3_debugmodel")
  local argv = { "--job.dump_folder=" .. os.tmpname() .. ".d", "--metrics.enable_jsonl=false",
    "--metrics.peak_flops=1e15", "--metrics.log_freq=1000", "--validation.enable=false",
    "--training.device=cuda", "--training.seq_len=32", "--training.local_batch_size=2",
    "--training.global_batch_tokens=64", "--lr_scheduler.warmup_steps=2", "--training.steps=100" }
  for _, a in ipairs(extra or {}) do argv[#argv + 1] = a end
  local lines = {}
  local tr = trainer.new(config.resolve(recipe, argv), { print = function(l) lines[#lines + 1] = l end })
  return tr, lines
end

-- Closes the trainer and frees its model, RoPE tables and AdamW state.
function S.close(tr, H)
  tr:close()
  H.free_model(tr.model, tr.optimizer)
end

return S
