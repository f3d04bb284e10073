#!/usr/bin/env python3
"""PyTorch reference for Loom's GPT-2: writes the golden file of tests/models/gpt2_reference_test.cc.

Reads the initial weights and batch that `loom_export_reference` wrote (safetensors), builds the
same GPT-2 in PyTorch (written here from the paper's description, independently of Loom), and
records, in float64 computed from the float32 weights:
  - the mean cross-entropy loss of the batch,
  - the gradient of that loss for every parameter ("grad.<name>"),
  - the losses on the same batch after each of 5 AdamW steps (lr 1e-3, betas (0.9, 0.95),
    eps 1e-8, weight decay 0.1 on 2-D weights only, no clipping) in float32 ("adamw_losses"),
  - the sum of squares of the initial weights ("init_sumsq"), so the C++ test can tell a changed
    initialisation from a wrong gradient.

Usage: tools/make_golden.sh (builds the exporter, runs this script). Needs torch and numpy
(Debian: python3-torch). The safetensors format is read and written here by hand (8-byte header
length, JSON header, raw little-endian data) so no extra package is needed.
"""
import json
import math
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

DTYPES = {"F32": np.float32, "F64": np.float64, "I32": np.int32, "I64": np.int64}


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        out[name] = np.frombuffer(data[b:e], dtype=DTYPES[info["dtype"]]).reshape(info["shape"])
    return out, meta


def save_safetensors(path, tensors, meta):
    header, blobs, offset = {"__metadata__": meta}, [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        dt = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.int32): "I32"}[arr.dtype]
        raw = arr.tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for raw in blobs:
            f.write(raw)


def gpt2_loss(p, tokens, targets, n_layers, n_heads):
    B, T = tokens.shape
    C = p["wte.weight"].shape[1]
    hd = C // n_heads
    x = p["wte.weight"][tokens] + p["wpe.weight"][:T]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for l in range(n_layers):
        pre = f"blocks.{l}."
        h = F.layer_norm(x, (C,), p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], eps=1e-5)
        qkv = h @ p[pre + "attn.qkv.weight"].T + p[pre + "attn.qkv.bias"]
        q, k, v = qkv.split(C, dim=2)
        q = q.view(B, T, n_heads, hd).transpose(1, 2)
        k = k.view(B, T, n_heads, hd).transpose(1, 2)
        v = v.view(B, T, n_heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + y @ p[pre + "attn.proj.weight"].T + p[pre + "attn.proj.bias"]
        h = F.layer_norm(x, (C,), p[pre + "ln_2.weight"], p[pre + "ln_2.bias"], eps=1e-5)
        h = F.gelu(h @ p[pre + "mlp.fc.weight"].T + p[pre + "mlp.fc.bias"], approximate="tanh")
        x = x + h @ p[pre + "mlp.proj.weight"].T + p[pre + "mlp.proj.bias"]
    x = F.layer_norm(x, (C,), p["ln_f.weight"], p["ln_f.bias"], eps=1e-5)
    logits = x @ p["wte.weight"].T  # LM head tied to the token embedding
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main(inp, out):
    tensors, meta = load_safetensors(inp)
    batch = torch.from_numpy(tensors.pop("batch.tokens").astype(np.int64))
    tokens, targets = batch[:, :-1], batch[:, 1:]
    n_heads = int(meta["n_heads"])
    n_layers = sum(1 for k in tensors if k.endswith(".ln_1.weight"))
    names = list(tensors.keys())

    # Loss and gradients in float64.
    p64 = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in tensors.items()}
    loss = gpt2_loss(p64, tokens, targets, n_layers, n_heads)
    loss.backward()
    golden = {"loss": np.array([loss.item()], dtype=np.float64)}
    for k in names:
        golden["grad." + k] = p64[k].grad.numpy().astype(np.float64)
    golden["init_sumsq"] = np.array([sum(float((v.astype(np.float64) ** 2).sum()) for v in tensors.values())])

    # Five AdamW steps in float32 on the same batch; loss after each.
    p32 = {k: torch.tensor(v.copy(), requires_grad=True) for k, v in tensors.items()}
    decay = [p32[k] for k in names if p32[k].dim() >= 2]
    no_decay = [p32[k] for k in names if p32[k].dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        l32 = gpt2_loss(p32, tokens, targets, n_layers, n_heads)
        l32.backward()
        opt.step()
        with torch.no_grad():
            losses.append(gpt2_loss(p32, tokens, targets, n_layers, n_heads).item())
    golden["adamw_losses"] = np.array(losses, dtype=np.float64)
    save_safetensors(out, golden, {"torch": torch.__version__, "source": "tools/torch_reference.py"})
    print(f"loss {loss.item():.6f}; after 5 AdamW steps {losses[-1]:.6f}; wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: torch_reference.py INIT.safetensors GOLDEN.safetensors")
    main(sys.argv[1], sys.argv[2])
