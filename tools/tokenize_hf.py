#!/usr/bin/env python3
"""Tokenizes text files with a HuggingFace tokenizer into Loom / llm.c token shards, for training
or fine-tuning a model whose vocabulary is that tokenizer's (a Hub GPT-2, SmolLM, TinyLlama,
Llama 2 / 3 started with train.init_from; docs/formats.md).

    python3 tools/tokenize_hf.py --tokenizer HF_DIR_OR_tokenizer.json INPUT... --out DIR \\
        [--val-fraction 0.1] [--shard-tokens 100000000] [--no-eos]

Writes DIR/train_NNNNNN.bin and DIR/val_NNNNNN.bin as `loom data prepare` does (the same split
rule: the files concatenated in order, the last val-fraction of the tokens to validation), in
llm.c's format: uint16 tokens (magic 20240520, version 1) when every id fits, else uint32 (magic
20240801, version 7: Llama 3's 128256-token vocabulary). Each file is one document: its tokens
are followed by the tokenizer's end-of-text token unless --no-eos (and the BOS token, when the
tokenizer adds one, comes first, as the tokenizer decides). Prints the counts and the vocabulary
size to put in model.vocab_size (at least; a padded size such as 50304 for GPT-2 is fine).

Needs the `tokenizers` package (pip install tokenizers) — the tokenizer.json of a Hub directory
is read directly, no network. Not used by the test suite: Loom reads the shards it writes
(tests/data/shard_test.cc checks both layouts).
"""
import argparse
import os
import struct
import sys

if os.environ.get("EXTRA_PYTHONPATH"):
    sys.path.append(os.environ["EXTRA_PYTHONPATH"])


def write_shard(path, tokens, wide):
    header = [20240801 if wide else 20240520, 7 if wide else 1, len(tokens)] + [0] * 253
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack("<%d%s" % (len(tokens), "I" if wide else "H"), *tokens))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--tokenizer", required=True, help="a HuggingFace directory with tokenizer.json, or the file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--shard-tokens", type=int, default=100_000_000)
    ap.add_argument("--no-eos", action="store_true")
    args = ap.parse_args()
    if not 0 <= args.val_fraction < 1:
        sys.exit(f"tokenize_hf: --val-fraction {args.val_fraction} must be in [0, 1)")
    from tokenizers import Tokenizer

    path = args.tokenizer
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        sys.exit(f"tokenize_hf: {path}: no tokenizer.json (a HuggingFace tokenizer directory?)")
    tok = Tokenizer.from_file(path)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos = None
    if not args.no_eos:
        for name in ("<|end_of_text|>", "<|endoftext|>", "</s>", "<|im_end|>", "<eos>"):
            eos = tok.token_to_id(name)
            if eos is not None:
                break
        if eos is None:
            sys.exit(f"tokenize_hf: {path} has no end-of-text token I know; pass --no-eos")
    tokens = []
    for name in args.inputs:
        with open(name, encoding="utf-8") as f:
            tokens += tok.encode(f.read()).ids
        if eos is not None:
            tokens.append(eos)
    n_val = round(len(tokens) * args.val_fraction)
    if args.val_fraction > 0:
        n_val = max(n_val, 1)
    wide = max(tokens, default=0) > 65535 or vocab > 65536
    os.makedirs(args.out, exist_ok=True)
    splits = {"train": tokens[:len(tokens) - n_val], "val": tokens[len(tokens) - n_val:]}
    for split, ids in splits.items():
        for i in range(0, max(len(ids), 1), args.shard_tokens):
            if ids:
                write_shard(os.path.join(args.out, f"{split}_{i // args.shard_tokens:06d}.bin"),
                            ids[i:i + args.shard_tokens], wide)
    print(f"{args.out}: {len(splits['train'])} train tokens, {len(splits['val'])} val tokens, "
          f"{'uint32' if wide else 'uint16'} shards; the tokenizer's vocabulary: {vocab} "
          f"(model.vocab_size >= {vocab})")


if __name__ == "__main__":
    main()
