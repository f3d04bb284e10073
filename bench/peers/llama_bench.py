#!/usr/bin/env python3
"""Llama fp32 training-step benchmark for PyTorch on CPU, the peer of `loom bench train --shape
llama-s`: HuggingFace transformers' own LlamaForCausalLM (what Llama users train with in
PyTorch), built from a config (no download), eager attention, the LM head tied to the token
embedding as Loom's shape has it. With --config moe-s the peer of `--shape moe-s`: transformers'
MixtralForCausalLM, its router loss (coefficient 0.01) added to the loss as Loom adds its own.

  llama-s: vocab 8192, d 384, 6 layers, 6 query heads sharing 2 key/value heads, SwiGLU 1024,
           rope_theta 10000, batch 8 x T 256
  moe-s:   llama-s with 8 SwiGLU experts (1024 wide) per block, 2 per token

Optimizer: torch AdamW(lr 3e-4, betas (0.9, 0.95), eps 1e-8, weight_decay 0.1). Data: random
tokens from a seeded generator, a fresh (B, T+1) batch per step. A step = zero_grad + forward +
loss + backward + optimizer.step (all timed); the first --warmup steps are untimed.
FLOPs/token = 6*N + 12*L*d*T, N = all parameters (the tied embedding once: it is the head's
matmul), as Loom counts them. Output: "SAMPLE <tokens/s>" per timed step and "SUMMARY {json}",
the fields bench/train_vs_pytorch.sh reads (the same as shared/peers/gpt_bench.py's).

  EXTRA_PYTHONPATH=DIR python3 bench/peers/llama_bench.py --config llama-s --threads 1
  PEER=bench/peers/llama_bench.py bench/train_vs_pytorch.sh llama-s

Needs torch and transformers (checked with 4.40.2 on Debian's torch 1.13; pip install
transformers, EXTRA_PYTHONPATH for a --target install).
"""
import argparse
import json
import os
import statistics
import sys
import time

CONFIGS = {
    "llama-s": dict(vocab=8192, seq=256, d=384, layers=6, heads=6, kv_heads=2, ffn=1024,
                    theta=10000.0, batch=8),
    "moe-s": dict(vocab=8192, seq=256, d=384, layers=6, heads=6, kv_heads=2, ffn=1024,
                  theta=10000.0, batch=8, experts=8, top_k=2),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="llama-s")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()
    n = str(args.threads)  # before torch loads OpenBLAS / libgomp: their pools take these sizes
    os.environ["OMP_NUM_THREADS"] = n
    os.environ["OPENBLAS_NUM_THREADS"] = n
    os.environ["MKL_NUM_THREADS"] = n
    if os.environ.get("EXTRA_PYTHONPATH"):
        sys.path.append(os.environ["EXTRA_PYTHONPATH"])
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.set_num_threads(args.threads)
    cfg = CONFIGS[args.config]
    B, T = cfg["batch"], cfg["seq"]
    sizes = dict(vocab_size=cfg["vocab"], hidden_size=cfg["d"], intermediate_size=cfg["ffn"],
                 num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                 num_key_value_heads=cfg["kv_heads"], max_position_embeddings=T,
                 rope_theta=cfg["theta"], tie_word_embeddings=True, rms_norm_eps=1e-5)
    experts, top_k = cfg.get("experts", 0), cfg.get("top_k", 0)
    if experts:
        config = MixtralConfig(**sizes, num_local_experts=experts, num_experts_per_tok=top_k,
                               sliding_window=None, output_router_logits=True,
                               router_aux_loss_coef=0.01)
    else:
        config = LlamaConfig(**sizes)
    config._attn_implementation = "eager"
    torch.manual_seed(args.seed)
    model = (MixtralForCausalLM if experts else LlamaForCausalLM)(config).float().train()
    # A token is multiplied by its top_k experts only: the idle ones' weights are not counted.
    n_params = sum(p.numel() for p in model.parameters()) - \
        cfg["layers"] * (experts - top_k) * 3 * cfg["d"] * cfg["ffn"] * (experts > 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    flops_per_token = 6 * n_params + 12 * cfg["layers"] * cfg["d"] * T
    samples = []
    for step in range(args.warmup + args.steps):
        batch = torch.randint(0, cfg["vocab"], (B, T + 1), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=batch[:, :-1])
        logits = out.logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        if experts:
            loss = loss + config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        print(f"step {step} loss {loss.item():.4f} {dt * 1e3:.1f} ms", flush=True)
        if step >= args.warmup:
            samples.append(B * T / dt)
            print(f"SAMPLE {samples[-1]:.1f}", flush=True)
    tps = statistics.median(samples)
    print("SUMMARY " + json.dumps({
        "config": args.config, "threads": args.threads, "params": n_params, "batch": B, "seq": T,
        "tokens_per_s": tps, "gflops": flops_per_token * tps / 1e9, "torch": torch.__version__,
        "transformers": transformers.__version__,
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE", "unset")}), flush=True)


if __name__ == "__main__":
    main()
