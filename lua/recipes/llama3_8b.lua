-- Llama 3 8B as TorchTitan trains it on GPUs: the 1B recipe's settings
-- (bf16, seq 8192) with the 8B model. Needs CUDA devices; --print-config
-- works everywhere.
return {
  base = "llama3_1b",
  job = { description = "Llama 3 8B", dump_folder = "./outputs/llama3_8b" },
  model = { flavor = "8B" },
  -- TorchTitan's 8B keeps attention and every other linear per block, recomputes the rest
  activation_checkpoint = { mode = "selective", selective_ac_option = "op" },
}
