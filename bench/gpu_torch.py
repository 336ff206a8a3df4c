"""PyTorch on the same GPU as bench/gpu.lua, measured the same way, and the
side-by-side table of both.

  python3 bench/gpu_torch.py [--json FILE] [--titan-json FILE] [--budget S] [--quick]
                             [--no-compile] [--device cpu --smoke]

Measures (bf16 on CUDA):
  * GEMM TFLOP/s, F.linear (y = x @ W^T) at 8192^3 and the Llama 3 8B shapes;
  * attention TFLOP/s, F.scaled_dot_product_attention (causal, GQA) forward,
    backward, forward+backward (FLOPs fwd = 4*B*H*T^2*D/2, bwd = 2.5 x fwd),
    with TorchTitan's kernel order (cuDNN, flash, memory-efficient, math) and
    again with flash alone; each row names the kernel SDPA picked;
  * GB/s of F.rms_norm and of torch.optim.AdamW(fused=True);
  * training tokens/s + MFU of Llama 3 debugmodel (B16 x 2048) and 1B (B1 x 8192):
      eager-amp     f32 parameters, torch.autocast bf16, fused AdamW (f32 state):
                    the numerics Titan uses (bf16 compute, f32 master weights)
      eager-bf16    bf16 parameters and optimizer state (no master copy)
      compile-amp   torch.compile of eager-amp (when time is left)
    The model is tests/reference/llama3.py's architecture with SDPA attention
    (TorchTitan's kernel order), the fused F.rms_norm and real-valued RoPE
    (bf16 has no complex type), the loss on f32 logits as TorchTitan computes
    it.
With --titan-json (bench/gpu.lua --json) it ends with Titan next to PyTorch.
Every measurement is guarded: one failure prints `error: ...` and the rest go on.
"""
import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # torch >= 2.3
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:
    SDPBackend = sdpa_kernel = None

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))
import llama3 as ref  # noqa: E402

PEAK = 989e12  # H200 / H100 SXM dense bf16

# Titan's flavors (lua/models/llama3.lua), ffn_hidden already rounded as Titan does.
FLAVORS = {
    "debugmodel": dict(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048, ffn_hidden=768),
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=8192,
               tie_embeddings=True),
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=192),
}

ARGS = None
T_START = time.perf_counter()
RESULTS = {"meta": {}, "gemm": [], "attention": [], "memory": [], "train": [], "errors": []}


def time_left():
    return ARGS.budget - (time.perf_counter() - T_START)


def sync():
    if ARGS.device.startswith("cuda"):
        torch.cuda.synchronize()


def save():
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(RESULTS, f)
            f.write("\n")


class OutOfTime(BaseException):
    """Not an Exception: torch.compile catches those and carries on."""


_ARMED = False


def _out_of_time(signum, frame):
    if _ARMED:
        raise OutOfTime("the budget ran out during this measurement")


def guarded(section, label, need, fn):
    if time_left() < need:
        print(f"skipped: {section} {label} ({time_left():.0f} s left of the budget, needs ~{need:.0f})", flush=True)
        RESULTS["errors"].append({"section": section, "label": label, "error": "skipped: no time left"})
        return None
    # A measurement that would run past the budget (a long torch.compile) is
    # interrupted by SIGALRM, so the tables still print. The timer fires again
    # every second until the measurement ends, in case code in between
    # swallows the first one.
    global _ARMED
    use_alarm = hasattr(signal, "SIGALRM") and time_left() < 1e8
    if use_alarm:
        signal.signal(signal.SIGALRM, _out_of_time)
        _ARMED = True
        signal.setitimer(signal.ITIMER_REAL, max(1.0, time_left() - 3), 1.0)
    try:
        try:
            r = fn()
        finally:
            _ARMED = False
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
    except (Exception, OutOfTime) as e:  # noqa: BLE001 — one failure must not stop the rest
        msg = f"{type(e).__name__}: {e}".replace("\n", " ")[:400]
        print(f"error: {section} {label}: {msg}", flush=True)
        if os.environ.get("GPU_TORCH_TRACEBACK"):
            traceback.print_exc()
        RESULTS["errors"].append({"section": section, "label": label, "error": msg})
        r = None
    finally:
        if ARGS.device.startswith("cuda"):
            torch.cuda.empty_cache()
    save()
    return r


def time_it(fn, target=0.05, rounds=5, warmup=2):
    """Median seconds per call over `rounds` rounds of back-to-back calls."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - t0, 1e-6)
    reps = max(1, min(200, int(target / one)))
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        ts.append((time.perf_counter() - t0) / reps)
    return statistics.median(ts)


def table(header, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]

    def line(cells):
        return "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths)) + " |"

    print(line(header))
    print("|-" + "-|-".join("-" * w for w in widths) + "-|")
    for r in rows:
        print(line(r))


# ---- GEMM ---------------------------------------------------------------------------------------
def gemm(label, M, N, K, dt, ta=0, tb=1):
    """out[M, N] = op(a) @ op(b), a stored [K, M] when ta (else [M, K]), b [N, K] when tb (else [K, N]):
    bench/gpu.lua's tt_op_matmul operands."""
    def run():
        dev = ARGS.device
        a = torch.randn(*((K, M) if ta else (M, K)), device=dev, dtype=dt)
        b = torch.randn(*((N, K) if tb else (K, N)), device=dev, dtype=dt)
        x, w = (a.t() if ta else a), (b.t() if tb else b)
        out = torch.empty(M, N, device=dev, dtype=dt)
        t = time_it(lambda: torch.matmul(x, w, out=out))
        tf = 2 * M * N * K / t / 1e12
        print(f"  [gemm] {label:26s} {M}x{N}x{K}: {t * 1e3:.3f} ms, {tf:.1f} TFLOP/s", flush=True)
        return dict(label=label, dtype=str(dt).replace("torch.", ""), M=M, N=N, K=K, ms=t * 1e3, tflops=tf)

    r = guarded("gemm", label, 5, run)
    if r:
        RESULTS["gemm"].append(r)


def gemm_float8(label, M, N, K):
    """bench/gpu.lua's gemm_float8: e4m3 x [M, K] and w [N, K] with tensorwise scales, bf16 out, fast
    accumulation: torch._scaled_mm as torchao's Float8Linear forward calls it."""
    def run():
        dev = ARGS.device
        if not hasattr(torch, "_scaled_mm") or not dev.startswith("cuda"):
            raise RuntimeError("torch._scaled_mm on a GPU is needed")
        f8 = torch.float8_e4m3fn
        x, w = torch.randn(M, K, device=dev), torch.randn(N, K, device=dev)
        sx, sw = 448.0 / x.abs().max(), 448.0 / w.abs().max()
        a, b = (x * sx).clamp(-448, 448).to(f8), (w * sw).clamp(-448, 448).to(f8)
        ia, ib = sx.reciprocal().float(), sw.reciprocal().float()
        t = time_it(lambda: torch._scaled_mm(a, b.t(), scale_a=ia, scale_b=ib, out_dtype=torch.bfloat16,
                                             use_fast_accum=True))
        tf = 2 * M * N * K / t / 1e12
        print(f"  [gemm] {label:26s} {M}x{N}x{K}: {t * 1e3:.3f} ms, {tf:.1f} TFLOP/s", flush=True)
        return dict(label=label, dtype="float8_e4m3fn", M=M, N=N, K=K, ms=t * 1e3, tflops=tf)

    r = guarded("gemm", label, 5, run)
    if r:
        RESULTS["gemm"].append(r)


# ---- attention ------------------------------------------------------------------------------------
# TorchTitan runs F.scaled_dot_product_attention inside
# sdpa_kernel([CUDNN_ATTENTION, FLASH_ATTENTION, EFFICIENT_ATTENTION, MATH],
# set_priority=True) (torchtitan/models/attention.py), so that is what "PyTorch
# eager with SDPA" means here. PyTorch's own default order changed between
# releases (cuDNN first on Hopper only with a recent cuDNN), so the order is
# pinned rather than left to the version on the machine. "flash" forces
# FlashAttention-2 alone: a second reference row for the attention benchmark.
TITAN_ORDER = None  # TorchTitan's order, where this torch can pin one
if sdpa_kernel is not None:
    TITAN_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]
    try:
        sdpa_kernel(TITAN_ORDER, set_priority=True)  # a generator: nothing runs until entered
    except TypeError:  # torch < 2.6: no set_priority (a list only enables, in PyTorch's own order)
        TITAN_ORDER = None


def sdpa_policy(kind):
    """A context manager for `kind` ("torchtitan" or "flash"), or None when this torch cannot pin one."""
    if kind == "flash":
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION) if sdpa_kernel is not None else None
    return sdpa_kernel(TITAN_ORDER, set_priority=True) if TITAN_ORDER is not None else None


def under(kind, fn):
    """fn() inside a fresh context of `kind`'s policy (one context serves one `with`), or as it is without one."""
    policy = sdpa_policy(kind)
    if policy is None:
        return fn()
    with policy:
        return fn()


def sdpa_choice(q, k, v, kind):
    """The kernel SDPA picks for these tensors under `kind`'s policy: "cudnn", "flash", ... or "?"."""
    if SDPBackend is None or not hasattr(torch, "_fused_sdp_choice"):
        return "?"

    def ask():
        kw = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
        try:
            return SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True, **kw)).name
        except (TypeError, RuntimeError, ValueError):
            return "?"

    name = under(kind, ask)
    return {"CUDNN_ATTENTION": "cudnn", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient",
            "MATH": "math"}.get(name, name.lower())


def sdpa(q, k, v, causal=True):
    """q [B, Hq, T, D], k/v [B, Hkv, S, D]."""
    hq, hkv = q.shape[1], k.shape[1]
    if hasattr(F, "scaled_dot_product_attention"):
        if hq != hkv:
            try:
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            except TypeError:  # torch < 2.5: no enable_gqa
                pass
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    # torch < 2.0 (the CPU smoke test only): plain softmax attention
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    T, S = q.shape[2], k.shape[2]
    s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
    if causal:
        s = s + torch.full((T, S), float("-inf"), device=q.device, dtype=s.dtype).triu(S - T + 1)
    return torch.matmul(torch.softmax(s, dim=-1), v)


def attention(B, T, Hq, Hkv, D, dt, kind="torchtitan"):
    label = f"B{B} T{T} Hq{Hq} Hkv{Hkv} D{D}"
    fwd_flops = 4 * B * Hq * T * T * D / 2
    if kind != "torchtitan" and sdpa_policy(kind) is None:
        print(f"  [attention] {label} {kind}: not measured (this torch cannot force the kernel)", flush=True)
        return

    def run():
        dev = ARGS.device

        # [B, T, H, D] seen as [B, H, T, D]: the layout the model hands SDPA
        # (and Titan's attention takes), which cuDNN's SDPA accepts.
        def bthd(h, grad):
            return torch.randn(B, T, h, D, device=dev, dtype=dt).transpose(1, 2).requires_grad_(grad)

        q, k, v = bthd(Hq, True), bthd(Hkv, True), bthd(Hkv, True)
        dout = bthd(Hq, False)
        backend = sdpa_choice(q, k, v, kind)

        def fwd():
            with torch.no_grad():
                under(kind, lambda: sdpa(q, k, v))

        def both():
            o = under(kind, lambda: sdpa(q, k, v))
            o.backward(dout)
            q.grad = k.grad = v.grad = None

        tf = time_it(fwd)
        tfb = time_it(both, warmup=1)
        tb = max(tfb - tf, 1e-9)
        policy = kind if sdpa_policy(kind) is not None else "default"  # torch < 2.6: PyTorch's own order
        r = dict(label=label, dtype=str(dt).replace("torch.", ""), B=B, T=T, Hq=Hq, Hkv=Hkv, D=D, policy=policy,
                 backend=backend, fwd_ms=tf * 1e3, bwd_ms=tb * 1e3, fwd_bwd_ms=tfb * 1e3,
                 fwd_tflops=fwd_flops / tf / 1e12, bwd_tflops=2.5 * fwd_flops / tb / 1e12,
                 fwd_bwd_tflops=3.5 * fwd_flops / tfb / 1e12)
        print(f"  [attention] {label} {policy} ({backend}): fwd {r['fwd_tflops']:.1f}, "
              f"fwd+bwd {r['fwd_bwd_tflops']:.1f} TFLOP/s", flush=True)
        return r

    r = guarded("attention", f"{label} {kind}", 8, run)
    if r:
        RESULTS["attention"].append(r)


# ---- memory-bound kernels ---------------------------------------------------------------------------
def rms_norm(x, w, eps):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def mem_row(kernel, dt, shape, t, nbytes):
    r = dict(kernel=kernel, dtype=dt, shape=shape, ms=t * 1e3, gbps=nbytes / t / 1e9)
    print(f"  [memory] {kernel:18s} {dt:9s} {shape:12s} {t * 1e3:8.3f} ms {r['gbps']:8.1f} GB/s", flush=True)
    RESULTS["memory"].append(r)


def memory_benches(smoke):
    dev = ARGS.device
    n = 1 << 16 if smoke else 1 << 28

    def copy():
        a = torch.randn(n, device=dev)
        b = torch.empty_like(a)
        mem_row("device copy", "float32", str(n), time_it(lambda: b.copy_(a)), 2 * 4 * n)

    guarded("memory", "copy", 5, copy)

    for dt, rows, dim in ([(torch.float32, 64, 128)] if smoke else
                          [(torch.bfloat16, 32768, 4096), (torch.float32, 16384, 4096)]):
        def norm(dt=dt, rows=rows, dim=dim):
            x = torch.randn(rows, dim, device=dev, dtype=dt, requires_grad=True)
            w = torch.randn(dim, device=dev, dtype=dt, requires_grad=True)
            dy = torch.randn(rows, dim, device=dev, dtype=dt)
            nb = rows * dim * x.element_size()
            name = str(dt).replace("torch.", "")
            with torch.no_grad():
                tf = time_it(lambda: rms_norm(x, w, 1e-5))
            mem_row("rmsnorm fwd", name, f"{rows}x{dim}", tf, 2 * nb)

            def both():
                y = rms_norm(x, w, 1e-5)
                y.backward(dy)
                x.grad = w.grad = None

            tfb = time_it(both, warmup=1)
            mem_row("rmsnorm fwd+bwd", name, f"{rows}x{dim}", tfb, 5 * nb)

        guarded("memory", f"rmsnorm {dt}", 8, norm)

    for pdt, label in ([(torch.float32, "adamw float32")] if smoke else
                       [(torch.float32, "adamw float32"), (torch.bfloat16, "adamw bfloat16")]):
        def adamw(pdt=pdt, label=label):
            p = torch.randn(n, device=dev, dtype=pdt, requires_grad=True)
            p.grad = torch.randn(n, device=dev, dtype=pdt) * 1e-3
            kw = {"fused": True} if dev.startswith("cuda") else {}
            opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
            t = time_it(opt.step)
            es = p.element_size()
            # read p, g, m, v; write p, m, v (state in the param dtype: no master copy)
            mem_row(label + " (fused)" if kw else label, str(pdt).replace("torch.", ""), str(n), t, n * 7 * es)

        guarded("memory", label, 8, adamw)


# ---- the model -------------------------------------------------------------------------------------
def rope_tables(head_dim, T, theta, scaling, device):
    cis = ref.precompute_freqs_cis(head_dim, T, theta, scaling, torch.float32)
    return cis.real.contiguous().to(device), cis.imag.contiguous().to(device)


def apply_rope(x, cos, sin):
    """x [B, T, H, D]: rotate adjacent pairs (2i, 2i+1) in f32 (Meta's convention, real arithmetic)."""
    B, T, H, D = x.shape
    xf = x.float().reshape(B, T, H, D // 2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:T].view(1, T, 1, D // 2), sin[:T].view(1, T, 1, D // 2)
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return out.reshape(B, T, H, D).type_as(x)


class FusedRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class SdpaAttention(ref.Attention):
    def forward(self, x, rope):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if TITAN_ORDER is not None:
            with sdpa_kernel(TITAN_ORDER, set_priority=True):
                o = sdpa(q, k, v)
        else:
            o = sdpa(q, k, v)
        return self.wo(o.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class Block(ref.TransformerBlock):
    def __init__(self, a):
        nn.Module.__init__(self)
        self.attention_norm = FusedRMSNorm(a.dim, a.norm_eps)
        self.attention = SdpaAttention(a)
        self.ffn_norm = FusedRMSNorm(a.dim, a.norm_eps)
        self.feed_forward = ref.FeedForward(a)


class Llama(nn.Module):
    def __init__(self, a, T, device):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList([Block(a) for _ in range(a.n_layers)])
        self.norm = FusedRMSNorm(a.dim, a.norm_eps)
        self.output = None if a.tie_embeddings else nn.Linear(a.dim, a.vocab_size, bias=False)
        self.rope = rope_tables(a.head_dim, T, a.rope_theta, a.rope_scaling, device)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h, self.rope)
        h = self.norm(h)
        w = self.tok_embeddings.weight if self.output is None else self.output.weight
        return F.linear(h, w)


def flops_per_token(model, a, T):
    n = sum(p.numel() for p in model.parameters())
    n_emb = model.tok_embeddings.weight.numel()
    # as llama3.flops_per_token: tied, the embedding is also the output matmul
    matmul_params = n if a.tie_embeddings else n - n_emb
    return 6 * matmul_params + 12 * a.n_layers * a.n_heads * a.head_dim * T, n


def profile_step(label, mode, step, cuda):
    """One more step under torch.profiler: its heaviest ops by their own device
    time (host time on the CPU), next to bench/gpu.lua's region-by-region profile
    of Titan's step. Returns the top rows for the JSON."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        step()
        sync()
    avgs = prof.key_averages()
    key = "self_cpu_time_total"
    if cuda:  # (renamed self_device_time_total in torch 2.4; the old name is gone in some later ones)
        key = "self_device_time_total" if len(avgs) and hasattr(avgs[0], "self_device_time_total") \
            else "self_cuda_time_total"
    print(f"  [profile] {label} {mode}: one more step under torch.profiler, ops by {key}", flush=True)
    print(avgs.table(sort_by=key, row_limit=30), flush=True)
    rows = sorted(avgs, key=lambda e: getattr(e, key, 0), reverse=True)[:60]
    return [dict(name=e.key, calls=e.count, self_ms=getattr(e, key, 0) / 1e3) for e in rows]


def train(label, flavor, B, T, mode, steps, warmup, need, profile=False):
    def run():
        dev = ARGS.device
        cuda = dev.startswith("cuda")
        a = ref.ModelArgs(**FLAVORS[flavor])
        t0 = time.perf_counter()
        with torch.device(dev) if hasattr(torch, "device") and hasattr(torch.device, "__enter__") else _null():
            model = Llama(a, T, dev)
        model = model.to(dev)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1)
                else:
                    # as bench/gpu.lua's fast_init: the embedding std 1, or the
                    # output layer's dim^-0.5 when it is also the output (tied)
                    emb_std = a.dim ** -0.5 if a.tie_embeddings else 1.0
                    p.normal_(0, emb_std if name.startswith("tok_embeddings") else 0.02)
        amp = mode.endswith("amp")
        if not amp:
            model = model.to(torch.bfloat16 if cuda else torch.float32)
        fpt, nparams = flops_per_token(model, a, T)
        # The kernel the model's attention gets: its q, k, v as SdpaAttention
        # hands them over (bf16 on the GPU in both modes, autocast or not).
        adt = torch.bfloat16 if cuda else torch.float32

        def qkv(h):
            return torch.empty(B, T, h, a.head_dim, device=dev, dtype=adt).transpose(1, 2).requires_grad_()

        attn = sdpa_choice(qkv(a.n_heads), qkv(a.n_kv_heads), qkv(a.n_kv_heads), "torchtitan")
        kw = {"fused": True} if cuda else {}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
        fwd = torch.compile(model) if mode.startswith("compile") else model
        g = torch.Generator(device="cpu").manual_seed(7)
        ids = torch.randint(0, a.vocab_size, (B, T + 1), generator=g).to(dev)
        x, y = ids[:, :T].contiguous(), ids[:, 1:].contiguous()
        V = a.vocab_size

        def step():
            if amp and cuda:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = fwd(x)
            else:
                logits = fwd(x)
            loss = F.cross_entropy(logits.float().view(-1, V), y.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()

        ts, loss = [], None
        c0 = time.perf_counter()
        for i in range(warmup + steps):
            s0 = time.perf_counter()
            loss = step()
            sync()
            if i == 0:
                first_s = time.perf_counter() - c0
            if i >= warmup:
                ts.append(time.perf_counter() - s0)
            if i == warmup - 1 and cuda:
                torch.cuda.reset_peak_memory_stats()
        t = statistics.median(ts)
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0
        tps = B * T / t
        r = dict(model=label, mode=mode, B=B, T=T, attention=attn, step_ms=t * 1e3, tokens_per_s=tps,
                 mfu=tps * fpt / PEAK,
                 flops_per_token=fpt, params=nparams, peak_gib=peak, build_s=c0 - t0, first_step_s=first_s,
                 last_loss=loss, steps=steps)
        print(f"  [train] {label} {mode} B{B} T{T} (sdpa {attn}): {t * 1e3:.1f} ms/step, {tps:.0f} tokens/s, "
              f"MFU {100 * r['mfu']:.1f}%, "
              f"peak {peak:.1f} GiB (first step {first_s:.1f} s, loss {loss:.3f})", flush=True)
        if profile:
            r["profile"] = profile_step(label, mode, step, cuda)
        return r

    r = guarded("train", f"{label} {mode}", need, run)
    if r:
        RESULTS["train"].append(r)
    return r


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ---- side by side ---------------------------------------------------------------------------------
def side_by_side(titan):
    print()
    print("## Titan and PyTorch on this GPU (same shapes; ratio = Titan / PyTorch)")
    print()
    rows = []
    tg = {r["label"]: r for r in titan.get("gemm", [])}
    for r in RESULTS["gemm"]:
        t = tg.get(r["label"])
        if t:
            rows.append(["gemm " + r["label"], f"{t['tflops']:.1f} TFLOP/s", f"{r['tflops']:.1f} TFLOP/s",
                         f"{t['tflops'] / r['tflops']:.2f}"])
    ta = {(r["T"], r["B"], r["dtype"]): r for r in titan.get("attention", [])}
    for r in RESULTS["attention"]:
        t = ta.get((r["T"], r["B"], r["dtype"]))
        if t:
            rows.append([f"attention fwd+bwd {r['label']} {r['dtype']} vs torch {r['policy']} ({r['backend']})",
                         f"{t['fwd_bwd_tflops']:.1f} TFLOP/s", f"{r['fwd_bwd_tflops']:.1f} TFLOP/s",
                         f"{t['fwd_bwd_tflops'] / r['fwd_bwd_tflops']:.2f}"])
    for tr in titan.get("train", []):
        for r in RESULTS["train"]:
            if r["model"] == tr["model"] and r["B"] == tr["B"] and r["T"] == tr["T"]:
                launch = (" (cuda graph)" if tr.get("graphs") else "") + \
                    (" (gemm autotune)" if tr.get("gemm_autotune") else "") + \
                    (f" ({tr['plans'].lstrip(', ')})" if tr.get("plans") else "")
                rows.append([f"train {tr['model']} B{tr['B']}x{tr['T']}: titan {tr['dtype']}{launch} vs torch {r['mode']} "
                             f"(sdpa {r.get('attention', '?')})",
                             f"{tr['tokens_per_s']:.0f} tok/s ({100 * tr['mfu']:.1f}% MFU)",
                             f"{r['tokens_per_s']:.0f} tok/s ({100 * r['mfu']:.1f}% MFU)",
                             f"{tr['tokens_per_s'] / r['tokens_per_s']:.2f}"])
    table(["what", "titan", "pytorch", "ratio"], rows)
    print()
    print("targets (docs/gpu.md): Llama 3 1B >= 50% MFU and >= 1.2 x PyTorch eager (eager-amp) tokens/s")


def main():
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json")
    p.add_argument("--titan-json")
    p.add_argument("--budget", type=float, default=1e9)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of this script)")
    ARGS = p.parse_args()
    dev = ARGS.device
    if dev.startswith("cuda") and not torch.cuda.is_available():
        print("bench/gpu_torch.py: torch sees no CUDA device", file=sys.stderr)
        sys.exit(1)
    name = torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu"
    RESULTS["meta"] = dict(torch=torch.__version__, cuda=torch.version.cuda, device=name, peak_flops=PEAK,
                           budget_s=ARGS.budget, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    print(f"torch {torch.__version__} | cuda {torch.version.cuda} | {name} | budget {ARGS.budget:.0f} s", flush=True)
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    bf = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    S = ARGS.smoke
    compile_ok = hasattr(torch, "compile") and not ARGS.no_compile and not S

    # Headline figures first, as bench/gpu.lua orders them.
    if S:
        gemm("square", 64, 64, 64, bf)
        attention(1, 64, 4, 2, 32, bf)
        attention(1, 64, 4, 2, 32, bf, "flash")
    else:
        gemm("square 8192^3", 8192, 8192, 8192, bf)
        gemm_float8("square 8192^3 fp8", 8192, 8192, 8192)
        attention(1, 8192, 32, 8, 128, bf)
        attention(1, 8192, 32, 8, 128, bf, "flash")
    memory_benches(S)
    if S:
        train("tiny", "tiny", 2, 32, "eager-amp", 2, 1, 0, profile=True)
        train("tiny", "tiny", 2, 32, "eager-bf16", 2, 1, 0)
    else:
        for mode in ("eager-amp", "eager-bf16"):
            train("llama3 1B", "1B", 1, 8192, mode, 5, 2, 40, profile=True)
            train("llama3 debugmodel", "debugmodel", 16, 2048, mode, 10, 3, 15)
        # The launch-bound shape bench/gpu.lua also runs from a CUDA graph.
        train("llama3 debugmodel", "debugmodel", 4, 512, "eager-amp", 10, 3, 8)
        # Llama 3 1B's linear layers at 8192 tokens, the step's three products each (bench/gpu.lua)
        for name, din, dout in (("wq/wo", 2048, 2048), ("wk/wv", 2048, 512), ("w1/w3", 2048, 8192),
                                ("w2", 8192, 2048), ("output", 2048, 128256)):
            gemm(f"1B {name} fwd", 8192, dout, din, bf, 0, 1)
            gemm(f"1B {name} dgrad", 8192, din, dout, bf, 0, 0)
            gemm(f"1B {name} wgrad", dout, din, 8192, bf, 1, 0)
        gemm("8B wq/wo 4096->4096", 8192, 4096, 4096, bf)
        gemm("8B wk/wv 4096->1024", 8192, 1024, 4096, bf)
        gemm("8B w1/w3 4096->14336", 8192, 14336, 4096, bf)
        gemm("8B w2 14336->4096", 8192, 4096, 14336, bf)
        gemm("8B output 4096->128256", 8192, 128256, 4096, bf)
        if not ARGS.quick:
            attention(4, 2048, 32, 8, 128, bf)

    print()
    print("## GEMM (torch.matmul, y = x @ W^T, TF32 off)")
    table(["shape", "dtype", "MxNxK", "ms", "TFLOP/s", "of peak"],
          [[r["label"], r["dtype"], f"{r['M']}x{r['N']}x{r['K']}", f"{r['ms']:.3f}", f"{r['tflops']:.1f}",
            f"{100 * r['tflops'] * 1e12 / PEAK:.0f}%"] for r in RESULTS["gemm"]])
    print()
    print("## Attention (F.scaled_dot_product_attention, causal; bwd = (fwd+bwd) - fwd; "
          "policy torchtitan = cuDNN, flash, efficient, math in that order)")
    table(["shape", "dtype", "policy", "kernel", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s"],
          [[r["label"], r["dtype"], r["policy"], r["backend"], f"{r['fwd_ms']:.3f}", f"{r['fwd_tflops']:.1f}",
            f"{r['fwd_bwd_ms']:.3f}", f"{r['fwd_bwd_tflops']:.1f}"] for r in RESULTS["attention"]])
    print()
    print("## Memory-bound kernels (GB/s of the bytes each must move)")
    table(["kernel", "dtype", "elements", "ms", "GB/s"],
          [[r["kernel"], r["dtype"], r["shape"], f"{r['ms']:.3f}", f"{r['gbps']:.1f}"] for r in RESULTS["memory"]])
    print()
    print("## Training (AdamW fused, clip 1.0, random tokens; MFU over 989 TFLOP/s)")
    table(["model", "mode", "B x T", "sdpa", "step ms", "tokens/s", "MFU", "peak GiB", "first step s"],
          [[r["model"], r["mode"], f"{r['B']}x{r['T']}", r["attention"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:.0f}",
            f"{100 * r['mfu']:.1f}%", f"{r['peak_gib']:.1f}", f"{r['first_step_s']:.1f}"] for r in RESULTS["train"]])
    if RESULTS["errors"]:
        print()
        print(f"note: {len(RESULTS['errors'])} measurement(s) failed or were skipped (error:/skipped: lines above)")
    titan = None
    if ARGS.titan_json:
        try:
            with open(ARGS.titan_json) as f:
                titan = json.load(f)
        except (OSError, ValueError) as e:
            print(f"note: no Titan figures to compare ({ARGS.titan_json}: {e})")
    if titan:
        side_by_side(titan)
    save()

    # torch.compile last: its compile time is long and unpredictable; the
    # tables above are out already if it runs out of budget.
    if compile_ok:
        sys.stdout.flush()
        n0 = len(RESULTS["train"])
        train("llama3 debugmodel", "debugmodel", 16, 2048, "compile-amp", 10, 3, 60)
        train("llama3 1B", "1B", 1, 8192, "compile-amp", 5, 3, 120)
        rows = RESULTS["train"][n0:]
        if rows:
            print()
            print("## Training with torch.compile (compile-amp; first step includes the compile)")
            tt = {(r["model"], r["B"], r["T"]): r for r in (titan or {}).get("train", [])}
            table(["model", "B x T", "step ms", "tokens/s", "MFU", "first step s", "titan / compile"],
                  [[r["model"], f"{r['B']}x{r['T']}", f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:.0f}",
                    f"{100 * r['mfu']:.1f}%", f"{r['first_step_s']:.1f}",
                    f"{tt[(r['model'], r['B'], r['T'])]['tokens_per_s'] / r['tokens_per_s']:.2f}"
                    if (r["model"], r["B"], r["T"]) in tt else "-"] for r in rows])
    RESULTS["meta"]["elapsed_s"] = time.perf_counter() - T_START
    save()


if __name__ == "__main__":
    main()
