#!/usr/bin/env python3
"""Tokenizes text files with a HuggingFace tokenizer into Loom / llm.c token shards, for training
or fine-tuning a model whose vocabulary is that tokenizer's (a Hub GPT-2, SmolLM, TinyLlama,
Llama 2 / 3 started with train.init_from; docs/formats.md).

    python3 tools/tokenize_hf.py --tokenizer HF_DIR_OR_tokenizer.json INPUT... --out DIR \\
        [--val-fraction 0.1] [--shard-tokens 100000000] [--no-eos]

Writes DIR/train_NNNNNN.bin and DIR/val_NNNNNN.bin as `loom data prepare` does (the same split
rule: the files concatenated in order, the last val-fraction of the tokens to validation), in
llm.c's format: uint16 tokens (magic 20240520, version 1) when every id fits, else uint32 (magic
20240801, version 7: Llama 3's 128256-token vocabulary). Each text file is one document, and a
JSON Lines file (.jsonl, .ndjson, .json) one a line: the string at --json-key (default "text"),
blank lines and empty texts skipped; any input may be .gz or .zst (the `zstandard` package)
compressed. A Parquet file (.parquet; the `pyarrow` package) is one document a row: its column
--json-key, nulls and empty texts skipped. A document's tokens are followed by the tokenizer's end-of-text token unless --no-eos
(and the BOS token, when the tokenizer adds one, comes first, as the tokenizer decides). Prints
the counts and the vocabulary size to put in model.vocab_size (at least; a padded size such as
50304 for GPT-2 is fine).

With --sft --chat-template chatml|llama3, conversations ({"messages": [...]}, ShareGPT's
{"conversations": [{"from": ..., "value": ...}]}, or "prompt" and "completion" as lists of
messages) are rendered and counted as `loom data prepare` does (docs/data.md): the assistant
turns' content and end markers count. Parquet files of such rows are read too (pyarrow).

With --sft the inputs are JSONL fine-tuning examples, one object a line, {"prompt": "...",
"completion": "..."} (TRL's prompt-completion format): each example is its prompt's tokens (with
the BOS the tokenizer adds), then its completion's and the end-of-text token, and beside each
shard a loss mask (SHARD.mask, docs/formats.md) counts the completion's targets and the
end-of-text's, not the prompt's — train them with data.loss_mask = true. The last val-fraction of
the examples, whole, go to validation.

Needs the `tokenizers` package (pip install tokenizers) — the tokenizer.json of a Hub directory
is read directly, no network. `--tokenizer bytes` is Loom's byte tokenizer instead (no package;
--sft then writes what `loom data prepare --sft --eot 10` writes, which is how this script is
checked). Not used by the test suite: Loom reads the shards it writes (tests/data/shard_test.cc
checks both layouts).
"""
import argparse
import gzip
import io
import json
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


def write_loss_mask(shard_path, counts):
    """SHARD.mask: the shard's header with magic 20261205, version 1, then a byte per token."""
    tmp = shard_path + ".mask.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<256i", 20261205, 1, len(counts), *([0] * 253)))
        f.write(bytes(counts))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, shard_path + ".mask")


class ByteTokenizer:
    """Loom's byte tokenizer (data/tokenizer.h): each UTF-8 byte a token, 256 ids, no specials."""

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("utf-8"))

    def vocab(self):
        return 256


def open_input(name):
    """A (maybe .gz or .zst compressed) input as text: UTF-8, newlines as written."""
    if name.endswith(".gz"):
        raw = gzip.open(name, "rb")
    elif name.endswith((".zst", ".zstd")):
        import zstandard

        raw = zstandard.ZstdDecompressor().stream_reader(open(name, "rb"), read_across_frames=True)
    else:
        raw = open(name, "rb")
    return io.TextIOWrapper(raw, encoding="utf-8", newline="")


def is_json_lines(name):
    for suffix in (".gz", ".zst", ".zstd"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return name.endswith((".jsonl", ".ndjson", ".json"))


def documents(names, key):
    """Each text file whole; each non-blank line of a JSON Lines file, its string at `key` (empty
    ones skipped); each row of a Parquet file, its column `key` (nulls and empty ones skipped), as
    Loom reads them (data/dataset.h)."""
    for name in names:
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            for batch in pq.ParquetFile(name).iter_batches(columns=[key], batch_size=4096):
                for text in batch.column(0).to_pylist():
                    if text:
                        yield text
            continue
        with open_input(name) as f:
            if not is_json_lines(name):
                yield f.read()
                continue
            for number, line in enumerate(f.read().split("\n"), 1):
                if not line.strip(" \t\r"):
                    continue
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as e:
                    sys.exit(f"tokenize_hf: {name} line {number}: not JSON: {e}")
                if not isinstance(doc, dict) or not isinstance(doc.get(key), str):
                    sys.exit(f'tokenize_hf: {name} line {number}: no string "{key}"')
                if doc[key]:
                    yield doc[key]


def render_chat(template, messages, first_counted):
    """A conversation's (text, counts) parts in a chat template, as Loom renders it
    (data/dataset.h): each assistant turn from first_counted on counts, its content and end marker."""
    parts = []

    def add(text, counts):
        if parts and parts[-1][1] == counts:
            parts[-1] = (parts[-1][0] + text, counts)
        else:
            parts.append((text, counts))

    for i, m in enumerate(messages):
        counts = m["role"] == "assistant" and i >= first_counted
        if template == "chatml":
            add("<|im_start|>" + m["role"] + "\n", False)
            add(m["content"] + "<|im_end|>", counts)
            add("\n", False)
        else:
            add("<|start_header_id|>" + m["role"] + "<|end_header_id|>\n\n", False)
            add(m["content"] + "<|eot_id|>", counts)
    return parts


def example_objects(names):
    """(where, object) of each non-blank line of the JSONL files, and each row of the Parquet files
    as Loom reads it: its "messages" column, or else its "prompt" and "completion"."""
    for name in names:
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            columns = pq.ParquetFile(name).schema_arrow.names
            keys = (["messages"] if "messages" in columns else ["conversations"]
                    if "conversations" in columns else ["prompt", "completion"])
            for number, row in enumerate(pq.read_table(name, columns=keys).to_pylist(), 1):
                yield f"{name} row {number}", row
            continue
        with open_input(name) as f:
            for number, line in enumerate(f.read().split("\n"), 1):
                if not line.strip(" \t\r"):
                    continue
                where = f"{name} line {number}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as e:
                    sys.exit(f"tokenize_hf: {where}: not JSON: {e}")


def sft_examples(names, chat_template=None):
    """(prompt, completion) of each non-blank line of the JSONL files (and row of the Parquet
    files), checked as Loom checks; a conversation as a list of (text, counts) parts instead."""
    for where, example in example_objects(names):
        if not isinstance(example, dict):
            sys.exit(f"tokenize_hf: {where}: not a JSON object")
        if "conversations" in example and "messages" not in example:  # ShareGPT's {from, value}
            roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                     "system": "system"}
            turns = example["conversations"]
            if not isinstance(turns, list) or not all(
                    isinstance(t, dict) and t.get("from") in roles and isinstance(t.get("value"), str)
                    for t in turns):
                sys.exit(f"tokenize_hf: {where}: a turn is not {{from: human|gpt|system, value}}")
            example = {"messages": [{"role": roles[t["from"]], "content": t["value"]} for t in turns]}
        if "messages" in example or isinstance(example.get("prompt"), list):
            if not chat_template:
                sys.exit(f"tokenize_hf: {where}: a conversation needs --chat-template")
            if "messages" in example:
                messages, first = example["messages"], 0
            else:
                messages = example["prompt"] + example["completion"]
                first = len(example["prompt"])
            for m in messages:
                if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
                    sys.exit(f"tokenize_hf: {where}: a message is not {{role, content}}")
            yield render_chat(chat_template, messages, first)
            continue
        for key in ("prompt", "completion"):
            if not isinstance(example.get(key), str):
                sys.exit(f'tokenize_hf: {where}: no string "{key}"')
        if not example["completion"]:
            sys.exit(f'tokenize_hf: {where}: an empty "completion"')
        yield example["prompt"], example["completion"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--tokenizer", required=True, help="a HuggingFace directory with tokenizer.json, or the file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--shard-tokens", type=int, default=100_000_000)
    ap.add_argument("--no-eos", action="store_true")
    ap.add_argument("--json-key", default="text",
                    help="a JSON Lines document's text key, or a Parquet file's text column")
    ap.add_argument("--sft", action="store_true", help="the inputs are prompt-completion JSONL")
    ap.add_argument("--chat-template", choices=["chatml", "llama3"],
                    help="with --sft: how conversations ({\"messages\": [...]}) are rendered")
    args = ap.parse_args()
    if not 0 <= args.val_fraction < 1:
        sys.exit(f"tokenize_hf: --val-fraction {args.val_fraction} must be in [0, 1)")
    if args.sft and args.no_eos:
        sys.exit("tokenize_hf: --sft needs the end-of-text token (the model learns to stop)")
    if args.tokenizer == "bytes":
        tok, path = ByteTokenizer(), "bytes"
        vocab, eos = 256, (10 if args.sft else None)  # a newline ends each completion
        if not args.sft and not args.no_eos:
            sys.exit("tokenize_hf: the byte tokenizer has no end-of-text token; pass --no-eos")
        encode = tok.encode
    else:
        from tokenizers import Tokenizer

        path = args.tokenizer
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            sys.exit(f"tokenize_hf: {path}: no tokenizer.json (a HuggingFace tokenizer directory?)")
        tok = Tokenizer.from_file(path)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        eos = None

        def encode(text, add_special_tokens=True):
            return tok.encode(text, add_special_tokens=add_special_tokens).ids

    if not args.no_eos and eos is None:
        for name in ("<|end_of_text|>", "<|endoftext|>", "</s>", "<|im_end|>", "<eos>"):
            eos = tok.token_to_id(name)
            if eos is not None:
                break
        if eos is None:
            sys.exit(f"tokenize_hf: {path} has no end-of-text token I know; pass --no-eos")
    tokens, counts = [], None
    if args.sft:  # each example: the prompt (not counted), the completion and eos (counted)
        examples = []
        for e in sft_examples(args.inputs, args.chat_template):
            if isinstance(e, list):  # a conversation: the BOS, then each part on its own
                ids, mask = encode(""), [0] * len(encode(""))
                for text, counts in e:
                    part = encode(text, add_special_tokens=False)
                    ids += part
                    mask += [int(counts)] * len(part)
                examples.append((ids, mask))
            else:
                p, c = encode(e[0]), encode(e[1], add_special_tokens=False) + [eos]
                examples.append((p + c, [0] * len(p) + [1] * len(c)))
        if not examples:
            sys.exit("tokenize_hf: no examples in the input files")
        n_val = int(len(examples) * args.val_fraction + 0.5)  # as Loom's llround
        if args.val_fraction > 0:
            n_val = max(n_val, 1)
        if n_val >= len(examples):
            sys.exit(f"tokenize_hf: {len(examples)} examples leave nothing for training")
        split_at = 0
        counts = []
        for k, (ids, mask) in enumerate(examples):
            if k == len(examples) - n_val:
                split_at = len(tokens)
            tokens += ids
            counts += mask
        if n_val == 0:
            split_at = len(tokens)
        n_val = len(tokens) - split_at  # in tokens from here on
    else:
        for text in documents(args.inputs, args.json_key):  # bytes as they are: no \r\n -> \n
            tokens += encode(text)
            if eos is not None:
                tokens.append(eos)
        n_val = int(len(tokens) * args.val_fraction + 0.5)  # as Loom's llround (not round's ties to even)
        if args.val_fraction > 0:
            n_val = max(n_val, 1)
    wide = max(tokens, default=0) > 65535 or vocab > 65536
    os.makedirs(args.out, exist_ok=True)
    cut = len(tokens) - n_val
    splits = {"train": (tokens[:cut], counts[:cut] if counts else None),
              "val": (tokens[cut:], counts[cut:] if counts else None)}
    for split, (ids, mask) in splits.items():
        for i in range(0, max(len(ids), 1), args.shard_tokens):
            if ids:
                shard = os.path.join(args.out, f"{split}_{i // args.shard_tokens:06d}.bin")
                write_shard(shard, ids[i:i + args.shard_tokens], wide)
                if os.path.exists(shard + ".mask"):
                    os.remove(shard + ".mask")  # made for the shard's old tokens
                if mask is not None:
                    write_loss_mask(shard, mask[i:i + args.shard_tokens])
    print(f"{args.out}: {len(splits['train'][0])} train tokens, {len(splits['val'][0])} val tokens, "
          f"{'uint32' if wide else 'uint16'} shards; the tokenizer's vocabulary: {vocab} "
          f"(model.vocab_size >= {vocab})")


if __name__ == "__main__":
    main()
