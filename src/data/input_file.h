// Corpus files as they come: plain, gzip (.gz) or Zstandard (.zst) compressed, text or JSON Lines.
//
// Web corpora are shipped compressed and a document a JSON line (The Pile and SlimPajama as
// .jsonl.zst, Dolma as .json.gz, FineWeb's JSON exports), so `loom data prepare` reads them as
// they are: InputFile streams a file's bytes through zlib or libzstd, chosen by the name's suffix,
// and LineReader cuts them into lines. Compressed data that is damaged, truncated or followed by
// something else is an error naming the file, never a short document.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>

namespace loom {

enum class Compression { none, gzip, zstd };

// Bytes read at a time: enough that a read is cheap beside decoding, little enough that opening
// many small files (fine-tuning examples, a fuzzer's inputs) touches few fresh pages.
inline constexpr size_t kInputBufferBytes = size_t{64} << 10;

// By the name's last suffix: ".gz" gzip, ".zst" or ".zstd" Zstandard, anything else none.
Compression compression_of(std::string_view path);

// Whether a corpus file holds JSON Lines (a document an object, one a line): its name, less a
// compression suffix, ends in ".jsonl", ".ndjson" or ".json" ("c4-train.00001.json.gz").
bool is_json_lines(std::string_view path);

// A file's bytes, decompressed as its name says. Several gzip members or zstd frames one after
// another read as their concatenation (as `zcat` and `zstdcat` do).
class InputFile {
 public:
  // Throws loom::Error naming the file if it cannot be opened. `buffer_bytes`: the compressed
  // bytes read at a time (small ones test the refills).
  explicit InputFile(std::string path, size_t buffer_bytes = kInputBufferBytes);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  // Up to `n` bytes of the content into `out`; 0 only at its end. Throws loom::Error naming the
  // file on a read error, damaged compressed data, or a compressed stream cut short.
  size_t read(char* out, size_t n);

  const std::string& path() const { return path_; }

 private:
  struct Decoder;
  size_t fill_input();  // refills the compressed-input buffer; returns what it read

  std::string path_;
  Compression compression_;
  std::FILE* file_ = nullptr;
  std::unique_ptr<Decoder> decoder_;
};

// The whole (decompressed) content of `path`.
std::string read_input_file(const std::string& path);

// The lines of a (possibly compressed) file: each without its '\n'; a last line without one is
// a line; a '\r' before the '\n' is kept (JSON and text readers treat it as they do).
class LineReader {
 public:
  // `buffer_bytes`: the content read at a time, and the compressed bytes (InputFile).
  explicit LineReader(std::string path, size_t buffer_bytes = kInputBufferBytes);

  // The next line into `line`; false at the end of the file.
  bool next(std::string& line);
  // The number of the line `next` returned last, from 1.
  int64_t line_number() const { return line_number_; }
  const std::string& path() const { return file_.path(); }

 private:
  InputFile file_;
  std::unique_ptr<char[]> buffer_;  // not zeroed: only what a read wrote is looked at
  size_t capacity_;
  size_t begin_ = 0;  // unread bytes are buffer_[begin_, end_)
  size_t end_ = 0;
  bool at_end_ = false;
  int64_t line_number_ = 0;
};

}  // namespace loom
