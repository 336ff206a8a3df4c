-- The Llama 3 debug model on the CPU: trains on the Debian fortunes corpus
-- with the shipped 2048-token tokenizer in a few minutes.
--   ./titan lua/recipes/llama3_debugmodel.lua [--training.steps=50 ...]
return {
  job = { description = "Llama 3 debug model, fortunes corpus, CPU", dump_folder = "./outputs/llama3_debugmodel" },
  model = { name = "llama3", flavor = "debugmodel", tokenizer = "assets/tokenizers/fortunes_2048.json" },
  optimizer = { lr = 3e-3, beta1 = 0.9, beta2 = 0.95, weight_decay = 0.1, no_decay_pattern = "norm%.weight$" },
  lr_scheduler = { warmup_steps = 20, decay_type = "cosine", min_lr_factor = 0.1 },
  training = {
    dataset = "fortunes", local_batch_size = 8, seq_len = 512, steps = 400, max_norm = 1.0, seed = 0,
    device = "cpu", mixed_precision_param = "float32",
  },
  validation = { enable = true, freq = 100, steps = 4, split = 0.02 },
  metrics = { log_freq = 10 },
}
