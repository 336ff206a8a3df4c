#!/usr/bin/python3
"""run_reference.py DIR — the PyTorch side of tests/lua/reference_spec.lua.

Reads DIR/config.json, DIR/weights.bin and DIR/batch.bin (format: README.md
next to this file), builds tests/reference/llama3.py's model from them in
float64 and again in float32, and for each precision computes the first-step
loss, every parameter's gradient, and the losses of `steps` AdamW steps on the
same batch. Writes DIR/result.json and DIR/grads.bin (the float64 gradients
of the first step, little-endian float64, in manifest order).

Prints one summary line; on any problem prints one line naming it to stderr
and exits non-zero.
"""
import json
import math
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def fail(msg, code=2):
    sys.stderr.write("run_reference: " + msg + "\n")
    sys.exit(code)


try:
    import torch
except Exception as e:  # ImportError, or a broken install
    fail("torch not importable with %s (%s: %s): install python3-torch (Debian) for this interpreter"
         % (sys.executable, type(e).__name__, e), 3)

sys.dont_write_bytecode = True  # leave no __pycache__ in the source tree
sys.path.insert(0, HERE)
from llama3 import ModelArgs, Transformer, loss_fn  # noqa: E402

DTYPE_BYTES = {"float32": 4, "float64": 8}
MODEL_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "norm_eps", "rope_theta",
              "rope_scaling", "tie_embeddings")
SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_seq")


def read_bytes(path):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        fail("cannot read %s: %s" % (path, e.strerror))


def load_config(d):
    path = os.path.join(d, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except OSError as e:
        fail("cannot read %s: %s" % (path, e.strerror))
    except ValueError as e:
        fail("%s is not valid JSON: %s" % (path, e))
    for k in ("model", "batch", "optim", "steps", "manifest"):
        if k not in cfg:
            fail("%s: missing key '%s' (expected model, batch, optim, steps, manifest)" % (path, k))
    m = cfg["model"]
    missing = [k for k in MODEL_KEYS if k not in m]
    if missing:
        fail("%s: model is missing %s" % (path, ", ".join(missing)))
    sc = m["rope_scaling"]
    if sc is not None and (not isinstance(sc, dict) or any(k not in sc for k in SCALING_KEYS)):
        fail("%s: model.rope_scaling must be null or {%s}" % (path, ", ".join(SCALING_KEYS)))
    for k in ("lr", "betas", "eps", "weight_decay"):
        if k not in cfg["optim"]:
            fail("%s: optim is missing '%s'" % (path, k))
    if cfg.get("weights_dtype", "float32") not in DTYPE_BYTES:
        fail("%s: weights_dtype '%s'; expected float32 or float64" % (path, cfg.get("weights_dtype")))
    if not (isinstance(cfg["steps"], int) and cfg["steps"] >= 1):
        fail("%s: steps must be an integer >= 1, got %r" % (path, cfg["steps"]))
    return cfg


def model_args(m):
    n_kv = m["n_kv_heads"] or m["n_heads"]
    if m["dim"] % m["n_heads"] or m["n_heads"] % n_kv or (m["dim"] // m["n_heads"]) % 2:
        fail("model: dim %d, n_heads %d, n_kv_heads %d: expected dim = n_heads * even head_dim and n_heads a "
             "multiple of n_kv_heads" % (m["dim"], m["n_heads"], n_kv))
    return ModelArgs(dim=m["dim"], n_layers=m["n_layers"], n_heads=m["n_heads"], n_kv_heads=n_kv,
                     vocab_size=m["vocab_size"], ffn_hidden=m["ffn_hidden"], norm_eps=float(m["norm_eps"]),
                     rope_theta=float(m["rope_theta"]), rope_scaling=m["rope_scaling"],
                     tie_embeddings=bool(m["tie_embeddings"]))


def load_weights(d, cfg, names_shapes):
    """-> {name: float64 tensor}, checked against the model's parameter list."""
    wdt = cfg.get("weights_dtype", "float32")
    esize = DTYPE_BYTES[wdt]
    path = os.path.join(d, "weights.bin")
    blob = read_bytes(path)
    manifest = cfg["manifest"]
    got = {e["name"] for e in manifest}
    want = set(names_shapes)
    if got != want:
        fail("manifest and model parameters differ: missing %s, unexpected %s"
             % (sorted(want - got) or "none", sorted(got - want) or "none"))
    if len(manifest) != len(got):
        fail("manifest names a parameter twice")
    out, end = {}, 0
    for e in manifest:
        name, shape, off = e["name"], list(e["shape"]), int(e["offset"])
        if shape != names_shapes[name]:
            fail("%s: manifest shape %s but the model's is %s" % (name, shape, names_shapes[name]))
        n = math.prod(shape)
        if off < 0 or off % esize or off + n * esize > len(blob):
            fail("%s: bytes [%d, %d) outside %s (%d bytes)" % (name, off, off + n * esize, path, len(blob)))
        t = torch.frombuffer(bytearray(blob[off:off + n * esize]), dtype=getattr(torch, wdt)).view(shape)
        out[name] = t.to(torch.float64)
        end = max(end, off + n * esize)
    if end != len(blob):
        fail("%s has %d bytes; the manifest covers %d" % (path, len(blob), end))
    for name, t in out.items():
        if not torch.isfinite(t).all():
            fail("%s: weights contain NaN or Inf" % name)
    return out


def load_batch(d, cfg, vocab):
    B, T = int(cfg["batch"]["batch_size"]), int(cfg["batch"]["seq_len"])
    path = os.path.join(d, "batch.bin")
    blob = read_bytes(path)
    if len(blob) != 2 * B * T * 8:
        fail("%s has %d bytes; expected %d (int64 inputs [%d, %d] then targets [%d, %d])"
             % (path, len(blob), 2 * B * T * 8, B, T, B, T))
    v = torch.tensor(struct.unpack("<%dq" % (2 * B * T), blob), dtype=torch.int64)
    inputs, targets = v[:B * T].view(B, T), v[B * T:].view(B, T)
    if inputs.min() < 0 or inputs.max() >= vocab:
        fail("%s: input ids outside [0, %d)" % (path, vocab))
    bad = (targets != -100) & ((targets < 0) | (targets >= vocab))
    if bad.any():
        fail("%s: targets outside [0, %d) and not -100" % (path, vocab))
    if (targets != -100).sum() == 0:
        fail("%s: every target is -100" % path)
    return inputs, targets


def run(args, weights, inputs, targets, cfg, dtype):
    """-> (first-step grads {name: tensor}, losses before each of `steps` AdamW steps)"""
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    model.to(dtype)
    params = list(model.parameters())
    o = cfg["optim"]
    opt = torch.optim.AdamW(params, lr=float(o["lr"]), betas=tuple(float(b) for b in o["betas"]),
                            eps=float(o["eps"]), weight_decay=float(o["weight_decay"]), foreach=False)
    losses, grads = [], None
    for step in range(cfg["steps"]):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    for i, l in enumerate(losses):
        if not math.isfinite(l):
            fail("%s reference: loss at step %d is %r" % (dtype, i + 1, l))
    return grads, losses


def rel(a, b):
    """max|a - b| / max|b| (0 when both are zero)"""
    den = b.abs().max().item()
    num = (a.to(torch.float64) - b.to(torch.float64)).abs().max().item()
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def main():
    if len(sys.argv) != 2:
        fail("usage: /usr/bin/python3 run_reference.py DIR (DIR holds config.json, weights.bin, batch.bin)", 64)
    d = sys.argv[1]
    if not os.path.isdir(d):
        fail("%s is not a directory" % d)
    cfg = load_config(d)
    args = model_args(cfg["model"])
    shapes = {n: list(p.shape) for n, p in Transformer(args).named_parameters()}
    weights = load_weights(d, cfg, shapes)
    inputs, targets = load_batch(d, cfg, args.vocab_size)

    g64, l64 = run(args, weights, inputs, targets, cfg, torch.float64)
    g32, l32 = run(args, weights, inputs, targets, cfg, torch.float32)

    gm, offset, chunks = [], 0, []
    for e in cfg["manifest"]:
        g = g64[e["name"]].contiguous()
        gm.append({"name": e["name"], "shape": list(g.shape), "offset": offset})
        chunks.append(g.numpy().astype("<f8").tobytes())
        offset += g.numel() * 8
    with open(os.path.join(d, "grads.bin"), "wb") as f:
        for c in chunks:
            f.write(c)

    grad_rel = {n: rel(g32[n], g64[n]) for n in g64}
    worst = max(grad_rel, key=grad_rel.get)
    result = {
        "torch_version": torch.__version__,
        "loss": l64[0],
        "losses": l64,
        "losses_f32": l32,
        "grads_file": "grads.bin",
        "grads_dtype": "float64",
        "grads_manifest": gm,
        "f32_vs_f64": {
            "loss_rel": abs(l32[0] - l64[0]) / abs(l64[0]),
            "losses_rel_max": max(abs(a - b) / abs(b) for a, b in zip(l32, l64)),
            "grad_rel_max": grad_rel[worst],
            "grad_rel_worst_param": worst,
            "grad_rel": grad_rel,
        },
    }
    with open(os.path.join(d, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("reference ok: torch %s, %d params, B=%d T=%d: loss %.10f -> %.10f over %d AdamW steps (f64); "
          "f32 vs f64: loss %.2e, grads %.2e (%s)"
          % (torch.__version__, len(g64), inputs.shape[0], inputs.shape[1], l64[0], l64[-1], len(l64),
             result["f32_vs_f64"]["loss_rel"], grad_rel[worst], worst))


if __name__ == "__main__":
    main()
