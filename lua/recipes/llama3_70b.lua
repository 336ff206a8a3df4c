-- Llama 3 70B as TorchTitan trains it on GPUs (bf16 compute, seq 8192).
-- Needs CUDA devices; on a machine that cannot hold it, it stops with a
-- clear message. --print-config works everywhere.
return {
  job = { description = "Llama 3 70B", dump_folder = "./outputs/llama3_70b" },
  model = { name = "llama3", flavor = "70B", tokenizer = "assets/tokenizers/fortunes_2048.json" },
  optimizer = { lr = 1.5e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1 },
  lr_scheduler = { warmup_steps = 200, decay_type = "linear", min_lr_factor = 0.0 },
  training = {
    dataset = "fortunes", local_batch_size = 1, seq_len = 8192, steps = 1000, max_norm = 1.0,
    device = "cuda", mixed_precision_param = "bfloat16",
  },
  -- TorchTitan's 70B and 405B recompute every block's activations
  activation_checkpoint = { mode = "full" },
  parallelism = { dp_shard = -1, tp = 8 },
  metrics = { log_freq = 10 },
}
