-- Llama 3 405B as TorchTitan trains it on GPUs: the 70B recipe's settings
-- with the 405B model and a lower learning rate. Needs many CUDA devices;
-- --print-config works everywhere.
return {
  base = "llama3_70b",
  job = { description = "Llama 3 405B", dump_folder = "./outputs/llama3_405b" },
  model = { flavor = "405B" },
  optimizer = { lr = 8e-5 },
}
