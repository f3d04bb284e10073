#!/usr/bin/env python3
"""Checks a `loom checkpoint export --format hf` directory with HuggingFace transformers: loads it
with AutoModelForCausalLM.from_pretrained (GPT2LMHeadModel, or LlamaForCausalLM for a
model.arch = "llama" export) and prints the greedy continuation of a byte-level prompt,
which must equal `loom sample --checkpoint CKPT --prompt PROMPT --tokens N --temperature 0` of the
same checkpoint (the models compute the same logits up to float rounding).

    python3 tools/check_hf_export.py HF_DIR --prompt '12+34=' --tokens 40

Needs torch and transformers (pip install transformers safetensors; not used by the test suite).
EXTRA_PYTHONPATH appends a directory to sys.path (e.g. a pip --target install).
"""
import argparse
import os
import sys

if os.environ.get("EXTRA_PYTHONPATH"):
    sys.path.append(os.environ["EXTRA_PYTHONPATH"])

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch1_shim  # noqa: E402,F401  (a Qwen 3 export needs transformers >= 4.51: on torch 1.13 too)
from transformers import AutoModelForCausalLM  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("--prompt", default="12+34=")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer.json (or its directory) to encode the prompt and decode the "
                         "output with, for a model trained on tools/tokenize_hf.py's shards; "
                         "default: bytes, as loom sample")
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir).eval()
    context = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    tok = None
    if args.tokenizer:
        from tokenizers import Tokenizer
        path = args.tokenizer
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path)
    ids = tok.encode(args.prompt).ids if tok else list(args.prompt.encode())
    with torch.no_grad():
        for _ in range(args.tokens):
            window = ids[-context:]
            # use_cache=False: no key/value cache (Gemma 3's HybridCache needs torch 2)
            logits = model(torch.tensor([window]), use_cache=False).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    if tok:
        print(tok.decode(ids))
    else:
        print(bytes(t if t < 256 else ord("?") for t in ids).decode("latin-1"))


if __name__ == "__main__":
    main()
