// Datasets on disk: finding shards from a config value, and making shards from text.
//
// A dataset is a directory of llm.c token shards (data/shard.h) named train_NNNNNN.bin and
// val_NNNNNN.bin (six digits, from 000000). prepare_dataset makes one from text files with the
// byte tokenizer, prepare_tokenized_dataset with a HuggingFace byte-level BPE tokenizer (a Hub
// model's own); synthesize_addition makes a small learnable one ("12+345=357\n" lines) so the
// quick start needs no download. Shards tokenized elsewhere (llm.c's dev/data scripts,
// tools/tokenize_hf.py) are read unchanged.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

class BpeTokenizer;  // data/bpe_tokenizer.h

// The shard paths named by a config value `spec` (what_key, e.g. "data.train", names the key in
// errors). `spec` is
//   - a glob pattern (contains '*', '?' or '['): the regular files it matches (POSIX glob(3));
//   - a directory: every regular file in it ending in ".bin" (train and val alike: point the key
//     at "dir/train_*.bin" to pick one split);
//   - otherwise a single file, which must exist.
// The result is sorted by name (byte order). No match throws loom::Error naming the key and spec.
std::vector<std::string> resolve_shards(const std::string& spec, const std::string& what_key);

// "train", 3 -> "train_000003.bin".
std::string shard_file_name(std::string_view split, int64_t index);

// How far prepare_tokenized_dataset has come, after each batch of documents.
struct PrepareProgress {
  int64_t bytes = 0;      // text read (decompressed; a JSON Lines file's lines, blank ones not)
  int64_t documents = 0;  // documents tokenized (JSON lines with an empty text not counted)
  int64_t tokens = 0;     // their tokens, end-of-text tokens included
  double seconds = 0;     // since the start
};

struct PrepareOptions {
  double val_fraction = 0.1;           // the last val_fraction of the tokens; [0, 1)
  int64_t shard_tokens = 100'000'000;  // tokens per shard (the last shard of a split may be short)
  // prepare_sft_dataset's conversations: "" (none), "chatml" or "llama3".
  std::string chat_template{};
  // prepare_tokenized_dataset's and prepare_sft_dataset's threads, a document (an example) each
  // at a time: 0 = one a core.
  int threads = 0;
  // prepare_tokenized_dataset's JSON Lines inputs: the key of each object's document text
  // (Megatron-LM's preprocess_data.py --json-keys).
  std::string json_key = "text";
  // prepare_tokenized_dataset's and prepare_sft_dataset's batches: documents are read until a batch
  // holds this many bytes of text (or 4 text files a thread); two batches are in memory at once.
  int64_t batch_bytes = int64_t{16} << 20;
  // prepare_tokenized_dataset: called after each batch (on the calling thread), e.g. to print
  // progress through a corpus of hours; empty: not called.
  std::function<void(const PrepareProgress&)> progress{};
};

struct PrepareResult {
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  std::vector<std::string> train_shards;  // full paths, in order
  std::vector<std::string> val_shards;
  // prepare_tokenized_dataset: the documents tokenized, and the JSON lines skipped for an empty
  // text.
  int64_t documents = 0;
  int64_t empty_documents = 0;
};
using SynthResult = PrepareResult;

// Tokenises the text files `inputs` (bytes, read in binary; gzip or zstd ones decompressed,
// data/input_file.h) with ByteTokenizer and writes out_dir/train_NNNNNN.bin and
// out_dir/val_NNNNNN.bin, creating out_dir. JSON Lines files are refused: the byte vocabulary
// has no end-of-text token to end their documents (they need a tokenizer).
//
// Split rule (deterministic, no shuffling): the files are concatenated in the order given, with
// no separator between them (the byte vocabulary has no end-of-text token; a text file's final
// newline separates it from the next). Of the N tokens, the LAST n_val go to validation, where
// n_val = round(N * val_fraction), at least 1 when val_fraction > 0; the first N - n_val go to
// training. Each split is cut into shards of shard_tokens tokens.
//
// Files stream through one shard-sized buffer, so memory stays at about 2 * shard_tokens bytes
// (a compressed file is read twice: once to count its bytes).
// Stale shards of an earlier run (train_/val_NNNNNN.bin beyond the ones written now) are deleted
// so that out_dir/train_*.bin names exactly this dataset.
PrepareResult prepare_dataset(const std::vector<std::string>& inputs, const std::string& out_dir,
                              const PrepareOptions& options = {});

// A synthetic corpus of addition problems, one per line: "a+b=c\n" where each operand has 1, 2 or
// 3 digits (equally likely; then uniform among numbers of that many digits) drawn from
// RandomStream(seed, "synth"). Training gets the first n_train_tokens bytes of the stream of
// lines; validation continues the same stream from the next whole line for n_val_tokens bytes
// (so the splits start on a line and the last line of each may be cut). Written like
// prepare_dataset (shards of PrepareOptions{}.shard_tokens tokens; no val shard when
// n_val_tokens == 0). Identical bytes for the same seed.
SynthResult synthesize_addition(const std::string& out_dir, int64_t n_train_tokens,
                                int64_t n_val_tokens, uint64_t seed);

// Supervised fine-tuning data: JSONL files whose every non-blank line is a prompt-completion
// example, {"prompt": "...", "completion": "..."} (TRL's prompt-completion format), byte-tokenised
// into out_dir's train/val shards with loss masks beside them (data/shard.h, data.loss_mask):
// each example's prompt bytes, whose targets do not count, then its completion's and, with
// eot >= 0 (a byte: 0..255), that end-of-text token after it, whose do — so training learns the
// completions, and to end them, given the prompts. The last round(examples × val_fraction) (at
// least one when > 0) whole examples go to validation. Every line is checked before anything is
// written (an error names the file and line). Stale shards and their masks are deleted as by
// prepare_dataset.
//
// With a `tokenizer` (a HuggingFace byte-level BPE, data/bpe_tokenizer.h) the strings are its
// tokens instead of bytes — each prompt with the BOS it adds, each completion without — and
// `eot` (its end-of-text token: BpeTokenizer::end_of_text()) is required; the shards are uint32
// where its vocabulary passes 65536. tools/tokenize_hf.py --sft writes the same files.
//
// Conversations (TRL's conversational forms): a line {"messages": [{"role": "system" | "user" |
// "assistant", "content": "..."}, ...]}, or {"prompt": [messages], "completion": [messages]},
// rendered by options.chat_template — "chatml" ("<|im_start|>ROLE\nCONTENT<|im_end|>\n":
// SmolLM2, Qwen) or "llama3" ("<|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|>") —
// after the tokenizer's BOS: each assistant turn's content and end-of-turn marker count (in the
// second form only the completion's), headers and other turns do not; no end-of-text token is
// added (the marker ends each turn). Each part is tokenized on its own, as torchtune tokenizes a
// message's header and content; the markers must be tokens of the tokenizer (with bytes: text).
//
// Every line is parsed first to count the examples; then the examples are tokenized by
// options.threads threads a batch at a time (as prepare_tokenized_dataset's documents), the same
// files whatever the count. Inputs may be gzip or zstd compressed (data/input_file.h).
PrepareResult prepare_sft_dataset(const std::vector<std::string>& inputs,
                                  const std::string& out_dir, const PrepareOptions& options = {},
                                  int64_t eot = -1, const BpeTokenizer* tokenizer = nullptr);

// Documents through a HuggingFace BPE tokenizer, as tools/tokenize_hf.py writes them (the same
// files, bit for bit). A text file is one document; a JSON Lines file (data/input_file.h:
// ".jsonl", ".ndjson" or ".json", maybe compressed) is one a line, the string at
// options.json_key of each object (blank lines skipped; an empty text skipped and counted in
// PrepareResult::empty_documents; a line that is not an object with that string is an error
// naming the file and line). Any input may be gzip or zstd compressed (".gz", ".zst"). Each
// document: its tokens, with the BOS the tokenizer adds, then `eot` (-1: nothing); the documents
// concatenated in order, the last val_fraction of the tokens (rounded, at least one when > 0) to
// validation; uint32 shards where the vocabulary passes 65536, else uint16. Documents are
// tokenized whole (a text cannot be cut anywhere without changing its pieces) by
// options.threads threads, a batch at a time (16 MiB of text or 4 text files a thread; the next
// batch read while one is tokenized), and the same files come out whatever the count; the
// corpus' tokens wait in a scratch file in out_dir (2 bytes each, 4 past 65536 ids) until the
// split point is known, so memory holds two batches, not the corpus.
PrepareResult prepare_tokenized_dataset(const std::vector<std::string>& inputs,
                                        const std::string& out_dir, const BpeTokenizer& tokenizer,
                                        const PrepareOptions& options = {}, int64_t eot = -1);

// Loss masks (data/shard.h) for one split of synthesize_addition's corpus, its shards in order:
// only the answers count as targets — "46\n" of "12+34=46\n", the problem "12+34=" given as a
// fine-tuning prompt is. Writes SHARD.mask beside each shard; returns the targets that count.
int64_t write_addition_answer_masks(const std::vector<std::string>& split_shards);

}  // namespace loom
