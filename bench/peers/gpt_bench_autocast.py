#!/usr/bin/env python3
"""The shared peer benchmark (shared/peers/gpt_bench.py) with its forward pass under PyTorch's
CPU autocast to bf16 (torch.autocast("cpu", dtype=torch.bfloat16)): the matmuls (Linear, the
attention's two bmm, the LM head) take bf16 operands, the rest stays fp32 with fp32 master
weights — the peer of Loom's runtime.matmul_precision = "bf16" on CPU ranks. Same arguments and
output as gpt_bench.py, plus "autocast": "bf16" and "mkldnn" (whether this PyTorch has oneDNN, which runs its
bf16 matmuls) in the SUMMARY line.
   PEER_DIR=../shared/peers python3 bench/peers/gpt_bench_autocast.py --config gpt2-124m --threads 1
"""
import json
import os
import sys

sys.path.insert(0, os.environ.get("PEER_DIR", os.path.join(os.path.dirname(__file__), "../../../shared/peers")))
import gpt_bench  # noqa: E402

_build = gpt_bench.build_model


def build_model_autocast(cfg, block, seed):
    import torch

    model = _build(cfg, block, seed)
    forward = model.forward

    def forward_in_bf16(idx, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(idx, targets)

    model.forward = forward_in_bf16
    return model


gpt_bench.build_model = build_model_autocast

_print = print


def print_with_autocast(*args, **kwargs):
    # Marks the SUMMARY line as this variant's.
    if args and isinstance(args[0], str) and args[0].startswith("SUMMARY "):
        import torch

        j = json.loads(args[0][len("SUMMARY "):])
        j["autocast"] = "bf16"
        j["mkldnn"] = torch.backends.mkldnn.is_available()
        args = ("SUMMARY " + json.dumps(j),) + args[1:]
    _print(*args, **kwargs)


gpt_bench.print = print_with_autocast

if __name__ == "__main__":
    gpt_bench.main()
