#!/usr/bin/env python3
"""HuggingFace transformers reference for Loom's mixture of experts: writes the golden file of
tests/models/moe_reference_test.cc.

Reads the initial weights and batch that `loom_export_reference --moe` wrote (safetensors, Loom's
names: fused qkv rows, each expert's fused gate/up rows), loads them into transformers' own
MixtralForCausalLM (q/k/v_proj split out; each expert's w1 = gate, w3 = up, w2 = down; the router
as block_sparse_moe.gate; the LM head tied to embed_tokens) and records, computed in float64 from
the float32 weights:
  - the mean cross-entropy loss of the batch ("loss"),
  - the balance loss Loom adds ("aux_loss"): DeepSeek-V3's sequence-wise one, computed here from
    Mixtral's router logits (its own batch-wise router loss is off, router_aux_loss_coef 0):
    coef · Σ_layers mean_sequences Σ_e f_e · P_e, f_e = E / (k·T) · tokens of the sequence
    routed to e (no gradient), P_e = the sequence's mean router probability of e,
  - the gradient of loss + aux_loss for every Loom parameter ("grad.<name>", re-fused),
  - the cross-entropy on the same batch after each of 5 AdamW steps on loss + aux_loss (lr 1e-3,
    betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on 2-D weights only) in float32
    ("adamw_losses"),
  - the sum of squares of the initial weights ("init_sumsq").

So Loom's routing (softmax over all experts, top k, weights renormalised over the k), its expert
SwiGLUs and their sum are checked against the implementation users load Mixtral with, and its
balance loss's gradient against autograd.

Usage: PYTHON=/usr/bin/python3 tools/make_golden.sh moe. Needs torch, numpy and transformers
(checked with 4.40.2 on Debian's torch 1.13). EXTRA_PYTHONPATH appends a directory to sys.path.
"""
import os
import sys

if os.environ.get("EXTRA_PYTHONPATH"):
    sys.path.append(os.environ["EXTRA_PYTHONPATH"])

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_llama_reference import adamw_losses, attention_grads, attention_state, load_tied  # noqa: E402
from torch_reference import load_safetensors, save_safetensors  # noqa: E402


def build(tensors, meta, dtype):
    C = tensors["wte.weight"].shape[1]
    n_layers = sum(1 for k in tensors if k.endswith(".ln_1.weight"))
    n_heads, kv_heads, hidden = int(meta["n_heads"]), int(meta["n_kv_heads"]), int(meta["ffn_hidden"])
    experts, top_k = int(meta["moe_experts"]), int(meta["moe_top_k"])
    hd = C // n_heads
    config = MixtralConfig(vocab_size=tensors["wte.weight"].shape[0], hidden_size=C,
                           intermediate_size=hidden, num_hidden_layers=n_layers,
                           num_attention_heads=n_heads, num_key_value_heads=kv_heads,
                           max_position_embeddings=64, rms_norm_eps=float(meta["norm_eps"]),
                           rope_theta=float(meta["rope_theta"]), tie_word_embeddings=True,
                           sliding_window=None, num_local_experts=experts,
                           num_experts_per_tok=top_k, output_router_logits=True,
                           router_aux_loss_coef=0.0, hidden_act="silu")
    config._attn_implementation = "eager"
    model = MixtralForCausalLM(config).to(dtype)
    state = attention_state(tensors, n_layers, n_heads * hd, kv_heads * hd)
    for l in range(n_layers):
        ours, hf = f"blocks.{l}.", f"model.layers.{l}."
        state[hf + "block_sparse_moe.gate.weight"] = tensors[ours + "mlp.router.weight"]
        for e in range(experts):
            fc = tensors[ours + f"mlp.experts.{e}.fc.weight"]
            moe = hf + f"block_sparse_moe.experts.{e}."
            state[moe + "w1.weight"] = fc[:hidden]
            state[moe + "w3.weight"] = fc[hidden:]
            state[moe + "w2.weight"] = tensors[ours + f"mlp.experts.{e}.proj.weight"]
    load_tied(model, state, dtype)
    return model, n_layers, hidden, experts, top_k


def losses_of(model, tokens, targets, experts, top_k, coef):
    out = model(input_ids=tokens)
    logits = out.logits
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    B, T = tokens.shape
    aux = 0
    for router_logits in out.router_logits:  # (B·T, E) per layer
        p = F.softmax(router_logits.reshape(B, T, experts), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices  # (B, T, k)
        counts = F.one_hot(chosen, experts).sum(dim=(1, 2)).to(p.dtype)  # (B, E), no gradient
        f = counts * experts / (top_k * T)
        aux = aux + (f * p.mean(dim=1)).sum(dim=-1).mean()
    return ce, coef * aux


def loom_grads(model, names, n_layers, experts):
    g = attention_grads(model, n_layers)
    for l in range(n_layers):
        ours, m = f"blocks.{l}.", model.model.layers[l].block_sparse_moe
        g[ours + "mlp.router.weight"] = m.gate.weight.grad
        for e in range(experts):
            x = m.experts[e]
            assert x.w1.weight.grad is not None, f"expert {e} of layer {l} took no token"
            g[ours + f"mlp.experts.{e}.fc.weight"] = torch.cat([x.w1.weight.grad, x.w3.weight.grad])
            g[ours + f"mlp.experts.{e}.proj.weight"] = x.w2.weight.grad
    assert set(g) == set(names), set(g) ^ set(names)
    return g


def main(inp, out):
    tensors, meta = load_safetensors(inp)
    assert "moe_experts" in meta, "expected loom_export_reference --moe output"
    coef = float(meta["moe_aux_loss_coef"])
    batch = torch.from_numpy(tensors.pop("batch.tokens").astype(np.int64))
    tokens, targets = batch[:, :-1], batch[:, 1:]
    names = list(tensors.keys())

    # Mixtral's causal mask (transformers 4.40) is made in the default dtype from the model's
    # dtype's minimum: float64 must be the default while the float64 model runs.
    torch.set_default_dtype(torch.float64)
    model, n_layers, hidden, experts, top_k = build(tensors, meta, torch.float64)
    ce, aux = losses_of(model, tokens, targets, experts, top_k, coef)
    (ce + aux).backward()
    torch.set_default_dtype(torch.float32)
    golden = {"loss": np.array([ce.item()], dtype=np.float64),
              "aux_loss": np.array([aux.item()], dtype=np.float64)}
    for k, v in loom_grads(model, names, n_layers, experts).items():
        golden["grad." + k] = v.numpy().astype(np.float64)
    golden["init_sumsq"] = np.array([sum(float((v.astype(np.float64) ** 2).sum()) for v in tensors.values())])

    model32, *_ = build(tensors, meta, torch.float32)
    both = lambda m: losses_of(m, tokens, targets, experts, top_k, coef)  # noqa: E731
    losses = golden["adamw_losses"] = adamw_losses(model32, lambda m: sum(both(m)), lambda m: both(m)[0])
    import transformers
    save_safetensors(out, golden, {"torch": torch.__version__, "transformers": transformers.__version__,
                                   "source": "tools/hf_mixtral_reference.py"})
    print(f"loss {ce.item():.6f}, balance loss {aux.item():.6f}; after 5 AdamW steps {losses[-1]:.6f}; "
          f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: hf_mixtral_reference.py INIT.safetensors GOLDEN.safetensors")
    main(sys.argv[1], sys.argv[2])
