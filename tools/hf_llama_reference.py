#!/usr/bin/env python3
"""HuggingFace transformers reference for Loom's Llama: writes the golden file of
tests/models/llama_reference_test.cc.

Reads the initial weights and batch that `loom_export_reference --llama` wrote (safetensors, Loom's
names: fused qkv and gate/up weights), loads them into transformers' own LlamaForCausalLM (its
q/k/v_proj and gate/up_proj split out of the fused rows, the LM head tied to embed_tokens) and
records, computed in float64 from the float32 weights:
  - the mean cross-entropy loss of the batch,
  - the gradient of that loss for every Loom parameter ("grad.<name>", re-fused),
  - the losses on the same batch after each of 5 AdamW steps (lr 1e-3, betas (0.9, 0.95),
    eps 1e-8, weight decay 0.1 on 2-D weights only, no clipping) in float32 ("adamw_losses"),
  - the sum of squares of the initial weights ("init_sumsq").

So Loom's rotary embedding (rotate_half pairing), grouped-query head sharing, RMSNorm, SwiGLU
(gate first) and tied head are checked against the implementation users load their Llamas with.
From `loom_export_reference --qwen2` (meta qkv_bias = 1) the same in transformers'
Qwen2ForCausalLM: the fused qkv bias split into q/k/v_proj.bias, its gradient re-fused. From
`--qwen3` (meta qk_norm = 1, head_dim 32) in Qwen3ForCausalLM: its q_norm / k_norm, heads wider
than their share of hidden_size (needs transformers >= 4.51: made with 4.51.3 on Debian's torch
1.13 through tools/torch1_shim.py). From `--olmo2` (meta norm_placement = post, qk_norm_scope =
full) in Olmo2ForCausalLM: ln_1 / ln_2 as its post_attention_layernorm / post_feedforward_layernorm
(no input norms), q_norm / k_norm over all the query / key heads (transformers >= 4.47). From
`--gemma3` (meta norm_placement = sandwich, ffn_activation = gelu_tanh, ...) in Gemma3ForCausalLM
(transformers >= 4.50; its text model, run without its cache): the four norms a block and
q_norm / k_norm loaded as Gemma's w = Loom's gain − 1 (Gemma's RMSNorm scales by 1 + w: the
gradients are the same), the embedding times √hidden_size, the window and local rotary base.

Usage: PYTHON=/usr/bin/python3 tools/make_golden.sh llama. Needs torch, numpy and transformers
(pip install transformers; checked with 4.40.2 on Debian's torch 1.13). EXTRA_PYTHONPATH appends a
directory to sys.path (e.g. a pip --target install).
"""
import os
import sys

if os.environ.get("EXTRA_PYTHONPATH"):
    sys.path.append(os.environ["EXTRA_PYTHONPATH"])

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch1_shim  # noqa: E402,F401  (before transformers)
from torch_reference import load_safetensors, save_safetensors  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402


def build(tensors, meta, dtype):
    C = tensors["wte.weight"].shape[1]
    n_layers = sum(1 for k in tensors if k.endswith(".ln_1.weight"))
    n_heads, kv_heads, hidden = int(meta["n_heads"]), int(meta["n_kv_heads"]), int(meta["ffn_hidden"])
    hd = int(meta.get("head_dim", C // n_heads))
    shape = dict(vocab_size=tensors["wte.weight"].shape[0], hidden_size=C, intermediate_size=hidden,
                 num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=kv_heads,
                 max_position_embeddings=64, rms_norm_eps=float(meta["norm_eps"]),
                 rope_theta=float(meta["rope_theta"]), tie_word_embeddings=True, hidden_act="silu")
    if meta.get("norm_placement") == "sandwich":  # Gemma 3
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # transformers >= 4.50
        assert meta.get("ffn_activation") == "gelu_tanh"
        shape.pop("hidden_act")
        config = Gemma3TextConfig(head_dim=hd, query_pre_attn_scalar=hd, pad_token_id=None,
                                  hidden_activation="gelu_pytorch_tanh",
                                  sliding_window=int(meta["sliding_window"]),
                                  sliding_window_pattern=int(meta["full_attention_every"]),
                                  rope_local_base_freq=float(meta["rope_local_theta"]), **shape)
        config._attn_implementation = "eager"
        model = Gemma3ForCausalLM(config).to(dtype)
    elif meta.get("norm_placement") == "post":  # OLMo 2: post-norms, full-width q_norm / k_norm
        from transformers import Olmo2Config, Olmo2ForCausalLM  # transformers >= 4.47
        assert meta.get("qk_norm_scope") == "full" and "head_dim" not in meta
        # No padding row (Olmo2Config's pad_token_id 1 would leave token 1's embedding gradient
        # out, as nn.Embedding's padding_idx does; Loom has no padding token).
        config = Olmo2Config(attention_bias=False, pad_token_id=None, **shape)
        config._attn_implementation = "eager"
        model = Olmo2ForCausalLM(config).to(dtype)
    elif meta.get("qk_norm") == "1":  # Qwen 3: q_norm / k_norm, head_dim its own, no window
        from transformers import Qwen3Config, Qwen3ForCausalLM  # transformers >= 4.51
        config = Qwen3Config(use_sliding_window=False, head_dim=hd, attention_bias=False, **shape)
        config._attn_implementation = "eager"
        model = Qwen3ForCausalLM(config).to(dtype)
    elif meta.get("qkv_bias") == "1":  # Qwen 2: q/k/v biases, no sliding window
        config = Qwen2Config(use_sliding_window=False, **shape)
        config._attn_implementation = "eager"
        model = Qwen2ForCausalLM(config).to(dtype)
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    else:
        config = LlamaConfig(attention_bias=False, mlp_bias=False, **shape)
        config._attn_implementation = "eager"
        model = LlamaForCausalLM(config).to(dtype)
    state = attention_state(tensors, n_layers, n_heads * hd, kv_heads * hd,
                            post=meta.get("norm_placement") == "post",
                            gemma=meta.get("norm_placement") == "sandwich")
    for l in range(n_layers):
        ours, hf = f"blocks.{l}.", f"model.layers.{l}."
        fc = tensors[ours + "mlp.fc.weight"]
        state[hf + "mlp.gate_proj.weight"] = fc[:hidden]
        state[hf + "mlp.up_proj.weight"] = fc[hidden:]
        state[hf + "mlp.down_proj.weight"] = tensors[ours + "mlp.proj.weight"]
    load_tied(model, state, dtype)
    return model, n_layers, hidden, n_heads * hd + kv_heads * hd


def attention_state(tensors, n_layers, C, kv, post=False, gemma=False):
    """transformers' names for what a Llama-form model holds besides its MLPs, from Loom's tensors:
    the embedding, the norms, and q/k/v_proj split out of the fused qkv rows (C the queries' rows,
    kv the keys' and the values'). `post`: OLMo 2's norms, after the attention and the MLP.
    `gemma`: Gemma 3's four norms a block, every gain as Gemma's w = gain − 1."""
    gain = (lambda g: g - 1) if gemma else (lambda g: g)
    state = {"model.embed_tokens.weight": tensors["wte.weight"], "model.norm.weight": gain(tensors["ln_f.weight"])}
    for l in range(n_layers):
        ours, hf = f"blocks.{l}.", f"model.layers.{l}."
        qkv = tensors[ours + "attn.qkv.weight"]
        if gemma:
            state[hf + "input_layernorm.weight"] = gain(tensors[ours + "ln_1.weight"])
            state[hf + "post_attention_layernorm.weight"] = gain(tensors[ours + "attn_out_norm.weight"])
            state[hf + "pre_feedforward_layernorm.weight"] = gain(tensors[ours + "ln_2.weight"])
            state[hf + "post_feedforward_layernorm.weight"] = gain(tensors[ours + "mlp_out_norm.weight"])
        elif post:
            state[hf + "post_attention_layernorm.weight"] = tensors[ours + "ln_1.weight"]
            state[hf + "post_feedforward_layernorm.weight"] = tensors[ours + "ln_2.weight"]
        else:
            state[hf + "input_layernorm.weight"] = tensors[ours + "ln_1.weight"]
            state[hf + "post_attention_layernorm.weight"] = tensors[ours + "ln_2.weight"]
        state[hf + "self_attn.q_proj.weight"] = qkv[:C]
        state[hf + "self_attn.k_proj.weight"] = qkv[C:C + kv]
        state[hf + "self_attn.v_proj.weight"] = qkv[C + kv:]
        if ours + "attn.qkv.bias" in tensors:  # Qwen 2's
            bias = tensors[ours + "attn.qkv.bias"]
            state[hf + "self_attn.q_proj.bias"] = bias[:C]
            state[hf + "self_attn.k_proj.bias"] = bias[C:C + kv]
            state[hf + "self_attn.v_proj.bias"] = bias[C + kv:]
        if ours + "attn.q_norm.weight" in tensors:  # Qwen 3's, OLMo 2's, Gemma 3's
            state[hf + "self_attn.q_norm.weight"] = gain(tensors[ours + "attn.q_norm.weight"])
            state[hf + "self_attn.k_norm.weight"] = gain(tensors[ours + "attn.k_norm.weight"])
        state[hf + "self_attn.o_proj.weight"] = tensors[ours + "attn.proj.weight"]
    return state


def load_tied(model, state, dtype):
    """Loads `state` into the model, its LM head tied to the embedding."""
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)).to(dtype)
                                                 for k, v in state.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def loss_of(model, tokens, targets):
    logits = model(input_ids=tokens, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def attention_grads(model, n_layers):
    """Loom's names for the gradients of what attention_state loads (qkv fused back)."""
    g = {"wte.weight": model.model.embed_tokens.weight.grad, "ln_f.weight": model.model.norm.weight.grad}
    for l in range(n_layers):
        ours, layer = f"blocks.{l}.", model.model.layers[l]
        a = layer.self_attn
        if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3's
            g[ours + "ln_1.weight"] = layer.input_layernorm.weight.grad
            g[ours + "attn_out_norm.weight"] = layer.post_attention_layernorm.weight.grad
            g[ours + "ln_2.weight"] = layer.pre_feedforward_layernorm.weight.grad
            g[ours + "mlp_out_norm.weight"] = layer.post_feedforward_layernorm.weight.grad
        elif hasattr(layer, "post_feedforward_layernorm"):  # OLMo 2's
            g[ours + "ln_1.weight"] = layer.post_attention_layernorm.weight.grad
            g[ours + "ln_2.weight"] = layer.post_feedforward_layernorm.weight.grad
        else:
            g[ours + "ln_1.weight"] = layer.input_layernorm.weight.grad
            g[ours + "ln_2.weight"] = layer.post_attention_layernorm.weight.grad
        g[ours + "attn.qkv.weight"] = torch.cat([a.q_proj.weight.grad, a.k_proj.weight.grad, a.v_proj.weight.grad])
        if a.q_proj.bias is not None:  # Qwen 2's
            g[ours + "attn.qkv.bias"] = torch.cat([a.q_proj.bias.grad, a.k_proj.bias.grad, a.v_proj.bias.grad])
        if hasattr(a, "q_norm"):  # Qwen 3's
            g[ours + "attn.q_norm.weight"] = a.q_norm.weight.grad
            g[ours + "attn.k_norm.weight"] = a.k_norm.weight.grad
        g[ours + "attn.proj.weight"] = a.o_proj.weight.grad
    return g


def adamw_losses(model, train_loss, eval_loss, steps=5):
    """The losses after each of `steps` AdamW steps (lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight
    decay 0.1 on 2-D weights only) on train_loss(model)."""
    params = list(model.parameters())  # the tied head appears once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        train_loss(model).backward()
        opt.step()
        with torch.no_grad():
            losses.append(eval_loss(model).item())
    return np.array(losses, dtype=np.float64)


def loom_grads(model, names, n_layers, hidden, q_end):
    g = attention_grads(model, n_layers)
    for l in range(n_layers):
        ours, m = f"blocks.{l}.", model.model.layers[l].mlp
        g[ours + "mlp.fc.weight"] = torch.cat([m.gate_proj.weight.grad, m.up_proj.weight.grad])
        g[ours + "mlp.proj.weight"] = m.down_proj.weight.grad
    assert set(g) == set(names), set(g) ^ set(names)
    return g


def main(inp, out):
    tensors, meta = load_safetensors(inp)
    assert meta.get("arch") == "llama", "expected loom_export_reference --llama or --qwen2 output"
    batch = torch.from_numpy(tensors.pop("batch.tokens").astype(np.int64))
    tokens, targets = batch[:, :-1], batch[:, 1:]
    names = list(tensors.keys())

    # Qwen 2's causal mask (transformers 4.40) is made in the default dtype from the model's
    # dtype's minimum, as Mixtral's: float64 the default while the float64 model runs.
    qwen2 = meta.get("qkv_bias") == "1" or meta.get("qk_norm") == "1"  # (Gemma 3's too)
    if qwen2:
        torch.set_default_dtype(torch.float64)
    model, n_layers, hidden, q_end = build(tensors, meta, torch.float64)
    loss = loss_of(model, tokens, targets)
    loss.backward()
    torch.set_default_dtype(torch.float32)
    golden = {"loss": np.array([loss.item()], dtype=np.float64)}
    for k, v in loom_grads(model, names, n_layers, hidden, q_end).items():
        golden["grad." + k] = v.numpy().astype(np.float64)
    golden["init_sumsq"] = np.array([sum(float((v.astype(np.float64) ** 2).sum()) for v in tensors.values())])

    model32, *_ = build(tensors, meta, torch.float32)
    step_loss = lambda m: loss_of(m, tokens, targets)  # noqa: E731
    losses = golden["adamw_losses"] = adamw_losses(model32, step_loss, step_loss)
    import transformers
    save_safetensors(out, golden, {"torch": torch.__version__, "transformers": transformers.__version__,
                                   "source": "tools/hf_llama_reference.py" + (" (" + type(model).__name__ + ")" if qwen2 else "")})
    print(f"loss {loss.item():.6f}; after 5 AdamW steps {losses[-1]:.6f}; wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: hf_llama_reference.py INIT.safetensors GOLDEN.safetensors")
    main(sys.argv[1], sys.argv[2])
