-- Llama 3 3B as TorchTitan trains it on GPUs: the 1B recipe's settings
-- (bf16, seq 8192) with the 3B model. Needs CUDA devices; --print-config
-- works everywhere.
return {
  base = "llama3_1b",
  job = { description = "Llama 3 3B", dump_folder = "./outputs/llama3_3b" },
  model = { flavor = "3B" },
}
