#!/usr/bin/env python3
"""Writes the byte-level BPE tokenizer fixtures of tests/data/tokenizers/ with HuggingFace's
`tokenizers` (pip install tokenizers; checked with 0.23.3): three small tokenizers trained on Tiny
Shakespeare in the three pre-tokenizer styles of the Hub's byte-level BPE models, and the ids and
the text `tokenizers` gives for a list of strings — what data/bpe_tokenizer.h must reproduce
(tests/data/bpe_tokenizer_test.cc).

    python3 tools/make_tokenizer_fixtures.py ../shared/data/tinyshakespeare.txt tests/data/tokenizers

  gpt2.json    GPT-2's: ByteLevel pre-tokenizer with its regex, <|endoftext|> special
  llama3.json  Llama 3's: Split on its regex (case-insensitive contractions, digits in threes),
               ByteLevel without a regex, ignore_merges, a BOS added by a TemplateProcessing,
               its chat template's header and end-of-turn tokens
  smollm.json  SmolLM's: Digits (each digit alone), then ByteLevel with GPT-2's regex; ChatML's
               <|im_start|> and <|im_end|>
  expected.json  {"strings": [...], "<name>": {"ids": [[...]...], "decoded": [...]}} per tokenizer
"""
import json
import os
import sys

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")

STRINGS = [
    "",
    "Hello world",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "  leading spaces and  double  spaces   ",
    "numbers 1 12 123 1234 12345 3.14159 and 2026-12-06",
    "contractions: I'm, you're, they've, we'll, it's, I'D, YOU'LL",
    "tabs\tand\r\nwindows lines\n\n\nand blank lines\n",
    "unicode: café naïve Straße ÆØÅ Ελληνικά русский 日本語 한국어",
    "emoji: 🙂👍🏽 and symbols ∑∫√ ← → ★",
    "<|endoftext|>a document after the end-of-text<|endoftext|>",
    "<|im_start|>user\nHi<|im_end|>\n<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>",
    "trailing space ",
    "ROMEO: O, she doth teach the torches to burn bright!",
    "\u00a0non-breaking\u2003em space\u3000ideographic",
    "x" * 300,
]


def trained(pre, ignore_merges, specials, corpus, vocab=600):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([corpus], trainer)
    return tok


def main():
    corpus, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    toks = {
        "gpt2": trained(byte_level, False, ["<|endoftext|>"], corpus),
        "llama3": trained(pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
            True, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"], corpus),
        "smollm": trained(pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), byte_level]),
            False, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], corpus),
    }
    llama3 = toks["llama3"]
    bos = llama3.token_to_id("<|begin_of_text|>")
    llama3.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    expected = {"strings": STRINGS}
    for name, tok in toks.items():
        tok.save(os.path.join(out, name + ".json"))
        ids = [tok.encode(s).ids for s in STRINGS]
        expected[name] = {"ids": ids,
                          "decoded": [tok.decode(i, skip_special_tokens=False) for i in ids]}
    with open(os.path.join(out, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False, indent=0)
        f.write("\n")


if __name__ == "__main__":
    main()
