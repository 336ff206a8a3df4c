"""Checks a Hugging Face Llama folder exported by Titan from the Python side.

    hf_check.py HF_DIR TOKENS_JSON TITAN_LOGITS_F32 OUT_JSON

TOKENS_JSON is a JSON list of token ids; TITAN_LOGITS_F32 holds Titan's
logits for them (float32, [T, vocab], little-endian). Writes OUT_JSON:

  safetensors:  the `safetensors` library reads every file (names, shapes,
                dtypes against config.json, bytes equal to a plain parse), or
                {"available": false} when it is not importable;
  manual:       logits of a small Llama written here in HF's conventions
                (rotate_half RoPE, HF names, llama3 rope scaling as
                transformers computes it) from a plain parse of the files,
                relative error against Titan's;
  transformers: LlamaForCausalLM.from_pretrained(HF_DIR) logits, relative
                error against Titan's, or {"available": false}.

Only torch is required. Nothing here shares code with Titan.
"""
import json
import math
import os
import struct
import sys

import torch
import torch.nn.functional as F

ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
             "I64": torch.int64, "I32": torch.int32}


def parse_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        raw = bytearray(data[8 + n + b:8 + n + end])
        t = torch.frombuffer(raw, dtype=ST_DTYPES[e["dtype"]]) if raw else torch.empty(0, dtype=ST_DTYPES[e["dtype"]])
        out[name] = t.reshape(e["shape"]).clone()
    return out


def files_of(hf_dir):
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    return ["model.safetensors"]


def expected_shapes(cfg):
    d, h, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // h
    f, v = cfg["intermediate_size"], cfg["vocab_size"]
    out = {"model.embed_tokens.weight": [v, d], "model.norm.weight": [d]}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": [h * hd, d], p + "self_attn.k_proj.weight": [kv * hd, d],
                    p + "self_attn.v_proj.weight": [kv * hd, d], p + "self_attn.o_proj.weight": [d, h * hd],
                    p + "mlp.gate_proj.weight": [f, d], p + "mlp.up_proj.weight": [f, d],
                    p + "mlp.down_proj.weight": [d, f], p + "input_layernorm.weight": [d],
                    p + "post_attention_layernorm.weight": [d]})
    if not cfg.get("tie_word_embeddings"):
        out["lm_head.weight"] = [v, d]
    return out


def llama3_inv_freq(inv_freq, rs):
    """transformers' _compute_llama3_parameters."""
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, out)


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def hf_forward(cfg, w, tokens):
    """A Llama in HF's conventions, in float64."""
    w = {k: v.double() for k, v in w.items()}
    d, h, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // h
    eps, T = cfg["rms_norm_eps"], len(tokens)
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    rs = cfg.get("rope_scaling")
    if rs and rs.get("rope_type") == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, rs)
    freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos(), emb.sin()

    def rotate_half(x):
        return torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)

    x = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms(x, w[p + "input_layernorm.weight"], eps)
        q = (a @ w[p + "self_attn.q_proj.weight"].T).view(T, h, hd).transpose(0, 1)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).view(T, kv, hd).transpose(0, 1)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).view(T, kv, hd).transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(h // kv, 0), v.repeat_interleave(h // kv, 0)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1)
        o = (att @ v).transpose(0, 1).reshape(T, h * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        b = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + (F.silu(b @ w[p + "mlp.gate_proj.weight"].T) * (b @ w[p + "mlp.up_proj.weight"].T)) @ \
            w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def rel_err(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def main():
    hf_dir, tokens_path, logits_path, out_path = sys.argv[1:5]
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(tokens_path) as f:
        tokens = json.load(f)
    raw = bytearray(open(logits_path, "rb").read())
    titan = torch.frombuffer(raw, dtype=torch.float32).reshape(len(tokens), cfg["vocab_size"]).clone()
    report = {}

    weights = {}
    for name in files_of(hf_dir):
        weights.update(parse_safetensors(os.path.join(hf_dir, name)))
    shapes = expected_shapes(cfg)
    report["names_match"] = sorted(weights) == sorted(shapes)
    report["shapes_match"] = all(list(weights[k].shape) == s for k, s in shapes.items() if k in weights)

    try:
        import safetensors
        from safetensors.torch import load_file
        ok, err = True, None
        for name in files_of(hf_dir):
            for k, t in load_file(os.path.join(hf_dir, name)).items():
                if k not in weights or not torch.equal(t, weights[k]) or \
                        str(t.dtype).replace("torch.", "") != cfg["torch_dtype"]:
                    ok, err = False, f"{name}: {k} differs (dtype {t.dtype})"
                    break
        report["safetensors"] = {"available": True, "version": safetensors.__version__, "ok": ok, "error": err}
    except ImportError as e:
        report["safetensors"] = {"available": False, "error": str(e)}

    report["manual"] = {"rel": rel_err(hf_forward(cfg, weights, tokens), titan)}

    try:
        import transformers
        from transformers import LlamaForCausalLM
        model = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager")
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0]
        report["transformers"] = {"available": True, "version": transformers.__version__,
                                  "rel": rel_err(logits, titan)}
    except ImportError as e:
        report["transformers"] = {"available": False, "error": str(e)}

    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
