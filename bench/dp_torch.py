"""PyTorch side of bench/dp_cpu.sh: the plain PyTorch Llama 3 of
tests/reference/llama3.py trained with DistributedDataParallel over gloo
(CPU), one process per rank, eager float32, AdamW, random tokens.

usage: /usr/bin/python3 bench/dp_torch.py CONFIG LOCAL_BATCH SEQ STEPS
Rank and world come from RANK / WORLD_SIZE (MASTER_ADDR / MASTER_PORT for
the rendezvous); WORLD_SIZE=1 runs the same loop without DDP. Rank 0 prints
one line of key=value pairs: global tokens/s (best and median step).
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))
from llama3 import ModelArgs, Transformer, loss_fn  # noqa: E402
from train_torch import CONFIGS  # noqa: E402


def main():
    name, B, T, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or os.cpu_count()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    args = ModelArgs(**CONFIGS[name])
    model = Transformer(args).float()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model)  # 25 MB buckets, overlapped with backward
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    V = args.vocab_size
    gen = torch.Generator().manual_seed(1 + rank)

    def step():
        toks = torch.randint(0, V, (B, T + 1), generator=gen)
        logits = model(toks[:, :T])
        loss = loss_fn(logits, toks[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    times = []
    for _ in range(steps):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    tok = B * T * world
    if rank == 0:
        print(f"impl=pytorch config={name} world={world} local_batch={B} seq={T} "
              f"tps_best={tok / min(times):.1f} tps_median={tok / statistics.median(times):.1f} "
              f"threads={threads} torch={torch.__version__}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
