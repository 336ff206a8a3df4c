"""PyTorch side of bench/train_cpu.sh: the same model config trained the same
way (forward + backward + AdamW on random tokens), eager float32, with the
plain PyTorch Llama 3 of tests/reference/llama3.py (its attention
materializes the T x T scores, as eager PyTorch 1.13 does without SDPA).

usage: /usr/bin/python3 bench/train_torch.py CONFIG BATCH SEQ STEPS [AC]
AC: none (default), full, or N (every Nth block, counted from 1): blocks
wrapped in torch.utils.checkpoint (non-reentrant), as TorchTitan applies
activation checkpointing.
Prints one line of key=value pairs, like bench/train_cpu.lua.
"""
import os
import resource
import sys
import time

import torch
import torch.utils.checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))
from llama3 import ModelArgs, Transformer, loss_fn  # noqa: E402

CONFIGS = {
    "debugmodel": dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048, ffn_hidden=768),
    "125m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000, ffn_hidden=2048),
}


def apply_ac(model, ac):
    """Wraps blocks N, 2N, ... (from 1) as TorchTitan's ac_freq does; full = every block."""
    if ac == "none":
        return 0
    freq = 1 if ac == "full" else int(ac)
    wrapped = 0
    for i, block in enumerate(model.layers, start=1):
        if i % freq == 0:
            def ckpt_forward(*args, _fwd=block.forward):
                return torch.utils.checkpoint.checkpoint(_fwd, *args, use_reentrant=False)
            block.forward = ckpt_forward
            wrapped += 1
    return wrapped


def main():
    name, B, T, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    ac = sys.argv[5] if len(sys.argv) > 5 else "none"
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or os.cpu_count()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    args = ModelArgs(**CONFIGS[name])
    model = Transformer(args).float()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    ac_blocks = apply_ac(model, ac)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    V = args.vocab_size

    def step():
        toks = torch.randint(0, V, (B, T + 1))
        logits = model(toks[:, :T])
        loss = loss_fn(logits, toks[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in model.parameters())
    n_emb = model.tok_embeddings.weight.numel()
    flops_per_token = 6 * (n - n_emb) + 12 * args.n_layers * args.n_heads * args.head_dim * T
    tok = B * T
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"impl=pytorch config={name} batch={B} seq={T} tps_best={tok / min(times):.1f} "
          f"tps_mean={tok * steps / sum(times):.1f} flops_per_token={flops_per_token} "
          f"maxrss_mib={maxrss:.1f} threads={threads} ac={ac} ac_blocks={ac_blocks} torch={torch.__version__}")


if __name__ == "__main__":
    main()
