"""A plain PyTorch Llama 3, written from the architecture as Meta's reference
(llama3/model.py) and TorchTitan's models/llama3 read. It shares nothing with
Titan: it is the independent side of tests/lua/reference_spec.lua.

Parameter names are TorchTitan's (and Titan's):
  tok_embeddings.weight
  layers.{i}.attention_norm.weight, layers.{i}.attention.{wq,wk,wv,wo}.weight
  layers.{i}.ffn_norm.weight,       layers.{i}.feed_forward.{w1,w2,w3}.weight
  norm.weight, output.weight (absent when tie_embeddings)
Linear weights are [out, in] (y = x W^T), no biases.

Every module computes in the dtype of its parameters (float64 or float32):
there is no upcast to float32 inside, so a float64 model is float64 from
end to end, RoPE and softmax included.
"""
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    ffn_hidden: int
    n_kv_heads: Optional[int] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1 scaling (Meta's apply_scaling); None for plain RoPE.
    rope_scaling: Optional[dict] = field(
        default_factory=lambda: {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_seq": 8192})
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def apply_scaling(freqs: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Meta's llama3 `apply_scaling`, with its constants taken from `scaling`."""
    scale_factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_seq"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / scale_factor)
        else:
            assert low_freq_wavelen != high_freq_wavelen
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return torch.tensor(new_freqs, dtype=freqs.dtype)


def precompute_freqs_cis(head_dim: int, end: int, theta: float, scaling: Optional[dict],
                         dtype: torch.dtype) -> torch.Tensor:
    """cis(t * freq_i), freq_i = theta^(-2i/head_dim), as a complex [end, head_dim/2].

    Angles are computed in float64 whatever `dtype` (Meta uses float32 here;
    at the short lengths tested the difference is far below the tolerances)
    and the result is cast to the complex type of `dtype`."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64)[: head_dim // 2] / head_dim))
    if scaling is not None:
        freqs = apply_scaling(freqs, scaling)
    t = torch.arange(end, dtype=torch.float64)
    angles = torch.outer(t, freqs)
    cis = torch.polar(torch.ones_like(angles), angles)
    return cis.to(torch.complex128 if dtype == torch.float64 else torch.complex64)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]: rotate the ADJACENT pairs (2i, 2i+1) as complex numbers
    (Meta's view_as_complex convention, not the HF rotate_half one)."""
    B, T, H, D = x.shape
    xc = torch.view_as_complex(x.reshape(B, T, H, D // 2, 2).contiguous())
    out = torch.view_as_real(xc * freqs_cis[:T].view(1, T, 1, D // 2))
    return out.reshape(B, T, H, D).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, T, Hkv, D] -> [B, T, Hkv * n_rep, D]; query head h uses kv head h // n_rep."""
    if n_rep == 1:
        return x
    B, T, Hkv, D = x.shape
    return x[:, :, :, None, :].expand(B, T, Hkv, n_rep, D).reshape(B, T, Hkv * n_rep, D)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads = a.n_heads
        self.n_kv_heads = a.n_kv_heads or a.n_heads
        self.head_dim = a.head_dim
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        n_rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        # Explicit causal softmax attention (no fused SDPA): the whole T x T matrix.
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        mask = torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1)
        probs = F.softmax(scores + mask, dim=-1)
        o = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.wo(o)


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_hidden, bias=False)
        self.w2 = nn.Linear(a.ffn_hidden, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList([TransformerBlock(a) for _ in range(a.n_layers)])
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = None if a.tie_embeddings else nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [B, T] -> logits [B, T, vocab]"""
        h = self.tok_embeddings(ids)
        a = self.args
        freqs_cis = precompute_freqs_cis(a.head_dim, ids.shape[1], a.rope_theta, a.rope_scaling, h.dtype)
        for layer in self.layers:
            h = layer(h, freqs_cis)
        h = self.norm(h)
        w = self.tok_embeddings.weight if self.output is None else self.output.weight
        return F.linear(h, w)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the targets that are not -100."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
