#!/usr/bin/env python3
"""Writes the BPE tokenizer fixtures of tests/data/tokenizers/ with HuggingFace's `tokenizers`
(pip install tokenizers; checked with 0.23.3): small tokenizers trained on Tiny Shakespeare in the
three pre-tokenizer styles of the Hub's byte-level BPE models and two sentencepiece styles, and
the ids and the text `tokenizers` gives for a list of strings — what data/bpe_tokenizer.h must
reproduce (tests/data/bpe_tokenizer_test.cc).

    python3 tools/make_tokenizer_fixtures.py ../shared/data/tinyshakespeare.txt tests/data/tokenizers

  gpt2.json    GPT-2's: ByteLevel pre-tokenizer with its regex, <|endoftext|> special
  llama3.json  Llama 3's: Split on its regex (case-insensitive contractions, digits in threes),
               ByteLevel without a regex, ignore_merges, a BOS added by a TemplateProcessing,
               its chat template's header and end-of-turn tokens
  smollm.json  SmolLM's: Digits (each digit alone), then ByteLevel with GPT-2's regex; ChatML's
               <|im_start|> and <|im_end|>
  llama2.json  Llama 2's (TinyLlama, Mistral 7B): normalizer Prepend "▁" + Replace " " by "▁", no
               pre-tokenizer, byte fallback (<0x00>..<0xFF> at ids 3..258 after <unk> <s> </s>),
               a BOS, decoder Replace "▁" by " ", ByteFallback, Fuse, Strip one leading space
  qwen2.json   Qwen 2's: a NFC normalizer, then Split on its regex (each digit alone) and
               ByteLevel without a regex; ChatML's tokens. expected.json's "normalizer_variants":
               its ids with NFD, NFKC and NFKD instead
  metaspace.json  a Metaspace pre-tokenizer (prepend_scheme "first", split), no byte fallback:
               characters without a token are <unk>, a run of them one (fuse_unk); a BOS;
               decoder Metaspace. expected.json's "variants": its ids with the pre-tokenizer's
               other prepend schemes and split or not
  expected.json  {"strings": [...], "<name>": {"ids": [[...]...], "decoded": [...]}} per tokenizer
               and "added_flags": added tokens with lstrip / rstrip / single_word / normalized
               appended to gpt2.json and llama2.json (their added_tokens entries, and the ids of
               ADDED_STRINGS with them)

    python3 tools/make_tokenizer_fixtures.py --added-flags tests/data/tokenizers

only (re)writes expected.json's "added_flags", from the fixtures as they are.
"""
import json
import os
import sys

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
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
    "Hello</s>world <s>again",
    "<s>Hello",
    " one leading space",
    "x▁y and ▁▁ marks",
    "unknown 日本語 runs ★★ mixed",
    "composed \u00e9 and decomposed e\u0301, \u212b and A\u030a, \u1100\u1161 jamo",
    "compatibility: \ufb01ne \u2460 \uff21\uff22 x\u00b2 \u00bd",
]


def trained(pre, ignore_merges, specials, corpus, vocab=600, normalizer=None):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([corpus], trainer)
    return tok


def with_bos(tok, bos="<s>"):
    tok.post_processor = processors.TemplateProcessing(
        single=bos + " $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def sentencepiece_style(corpus):
    """Llama 2's layout: trained on words (Metaspace splits them), then run on whole stretches."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    tok.train([corpus], trainers.BpeTrainer(vocab_size=600 - 256, show_progress=False,
                                            special_tokens=["<unk>", "<s>", "</s>"]))
    j = json.loads(tok.to_str())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({"<0x%02X>" % b: 3 + b for b in range(256)})
    for token, _ in sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    j["model"]["vocab"] = vocab
    for added in j["added_tokens"]:
        added["id"] = vocab[added["content"]]
    j["pre_tokenizer"] = None
    tok = Tokenizer.from_str(json.dumps(j))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return with_bos(tok)


def metaspace_style(corpus):
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.train([corpus], trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                            special_tokens=["<unk>", "<s>", "</s>"]))
    return with_bos(tok)


# Added tokens' flags, as HuggingFace's AddedVocabulary applies them: lstrip / rstrip take the
# whitespace (Unicode's) beside a match into the token, single_word drops a match with a word
# character (\w) beside it, and a "normalized" token is matched in a second pass, on what the
# first (the other tokens) left. "m>!" overlaps "<norm>": the first pass's token wins.
ADDED_TOKENS = [
    AddedToken("<mask>", lstrip=True, special=True, normalized=False),
    AddedToken("<|assistant|>", rstrip=True, special=True, normalized=False),
    AddedToken("<both>", lstrip=True, rstrip=True, special=True, normalized=False),
    AddedToken("thee", single_word=True, special=False, normalized=False),
    AddedToken("m>!", special=False, normalized=False),
]
NORMALIZED_TOKENS = [AddedToken("<norm>", special=False, normalized=True)]  # gpt2: no normalizer
ADDED_STRINGS = [
    "I saw a <mask> here",
    "a   <mask>",
    "<mask>x and x<mask>",
    "<|assistant|>   Hello\n",
    "<|assistant|>\n\nHi<|assistant|>",
    "thee and thee, thou thee's, theeing, _thee, 日thee, éthee, thee",
    "  <both>  x <both>",
    "<norm>! and <norm> and m>! <norm>",
    "x <mask><|assistant|> y <both><both> z",
    "\u3000<mask>\u3000<|assistant|>\u00a0z\u2003<both>\u2003",
    "tab\t<mask>\t\t<|assistant|>\r\n",
    "<|endoftext|> <mask> </s> <mask>",
]


def added_flags(out):
    """expected.json's "added_flags": for gpt2 and llama2, the added tokens' entries and the ids."""
    flags = {"strings": ADDED_STRINGS}
    for name, extra in (("gpt2", ADDED_TOKENS + NORMALIZED_TOKENS), ("llama2", ADDED_TOKENS)):
        tok = Tokenizer.from_file(os.path.join(out, name + ".json"))
        known = len(json.loads(tok.to_str())["added_tokens"])
        tok.add_tokens(extra)
        entries = json.loads(tok.to_str())["added_tokens"][known:]
        flags[name] = {"added_tokens": entries, "ids": [tok.encode(s).ids for s in ADDED_STRINGS]}
    return flags


def main():
    if sys.argv[1] == "--added-flags":
        path = os.path.join(sys.argv[2], "expected.json")
        with open(path, encoding="utf-8") as f:
            expected = json.load(f)
        expected["added_flags"] = added_flags(sys.argv[2])
        with open(path, "w", encoding="utf-8") as f:
            json.dump(expected, f, ensure_ascii=False, indent=0)
            f.write("\n")
        return
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
    toks["qwen2"] = trained(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        False, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], corpus, normalizer=normalizers.NFC())
    toks["llama2"] = sentencepiece_style(corpus)
    toks["metaspace"] = metaspace_style(corpus)
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
    # metaspace.json with its pre-tokenizer's other settings: "variants": {"SCHEME split|whole":
    # ids of every string}.
    expected["variants"] = {}
    for scheme in ("always", "first", "never"):
        for split in (True, False):
            tok = Tokenizer.from_str(toks["metaspace"].to_str())
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme,
                                                         split=split)
            expected["variants"][f"{scheme} {'split' if split else 'whole'}"] = [
                tok.encode(s).ids for s in STRINGS]
    expected["normalizer_variants"] = {}
    for form in ("NFD", "NFKC", "NFKD"):
        tok = Tokenizer.from_str(toks["qwen2"].to_str())
        tok.normalizer = getattr(normalizers, form)()
        expected["normalizer_variants"][form] = [tok.encode(s).ids for s in STRINGS]
    expected["added_flags"] = added_flags(out)
    with open(os.path.join(out, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False, indent=0)
        f.write("\n")


if __name__ == "__main__":
    main()
