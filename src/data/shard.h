// Token shards in llm.c's format (karpathy/llm.c, dev/data/data_common.py, both variants).
//
// A shard is a 1024-byte header of 256 little-endian int32 followed by the tokens:
//   "gpt-2":   header[0] = 20240520 (magic), header[1] = 1 (version), tokens uint16;
//   "llama-3": header[0] = 20240801, header[1] = 7, tokens uint32 (vocabularies past 65536 ids,
//              Llama 3's 128256);
//   header[2] = number of tokens, header[3..255] = 0; little endian.
// So shards written by llm.c's dev/data scripts and by Loom are interchangeable.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace loom {

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr int32_t kShardMagic32 = 20240801;  // llm.c's "llama-3" uint32 shards
constexpr int32_t kShardVersion32 = 7;
constexpr int64_t kShardHeaderInts = 256;
constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;

struct ShardInfo {
  std::string path;
  int64_t num_tokens = 0;
  int32_t version = 0;
  int token_bytes = 2;  // 2 (uint16, "gpt-2") or 4 (uint32, "llama-3")
};

// Writes `tokens` to `path` atomically: to path + ".tmp", flushed and fsync'ed, then renamed, so
// a reader (or a crash) never sees a half-written shard; a loss mask beside it (made for its old
// tokens) is removed. Throws loom::Error naming the file on
// any I/O failure, or if there are more tokens than the int32 header count can hold.
void write_shard(const std::string& path, const std::vector<uint16_t>& tokens);
// The same as a uint32 "llama-3" shard.
void write_shard32(const std::string& path, const std::vector<uint32_t>& tokens);

// A token shard or a loss mask written as its items come, so that a writer need not hold them
// all (`loom data prepare` writes shards of 10^8 tokens): to path + ".tmp" behind a header whose
// count is written at finish(), then flushed, fsync'ed and renamed — the same file, as atomically,
// as write_shard / write_shard32 / write_loss_mask write. Destroyed unfinished (an exception
// unwinding), it removes the temporary file and leaves `path` as it was.
class StreamedShardFile {
 public:
  enum class Kind { tokens16, tokens32, loss_mask };
  StreamedShardFile(std::string path, Kind kind);
  ~StreamedShardFile();
  StreamedShardFile(const StreamedShardFile&) = delete;
  StreamedShardFile& operator=(const StreamedShardFile&) = delete;

  // Appends `count` items of the kind's width (2, 4 or 1 bytes) from `items`. Throws loom::Error
  // naming the file on an I/O failure or past the header's int32 count.
  void append(const void* items, int64_t count);
  // Writes the count, then renames into place; a token shard's stale loss mask is removed.
  void finish();
  int64_t count() const { return count_; }

 private:
  [[noreturn]] void fail_io(const char* what);
  std::string path_, tmp_;
  Kind kind_;
  std::FILE* file_ = nullptr;
  int64_t count_ = 0;
};

// Reads and validates the header only (magic, version, and that the token count matches the file
// size). Throws loom::Error naming the file for a missing file, a truncated header, a wrong
// magic, an unsupported version or a count that does not match the file size.
ShardInfo read_shard_header(const std::string& path);

// A shard's tokens mapped read-only from its file (mmap): nothing is read until touched, so a
// reader that takes a few windows of a large shard (an evaluation's batches) reads those pages
// only, and the pages are the page cache's, shared by every reader of the file (thread ranks
// mapping the same shard hold it once). The file must not shrink while mapped: shards are
// replaced by rename, as write_shard does, never truncated in place. If one is (or a network
// file system loses it), the read past its end is a SIGBUS; a reader that holds a Reading for the
// shard while it copies tokens then ends the process with exit status 1 and a line naming the
// shard, instead of a crash (a SIGBUS elsewhere goes to the handler installed before).
class MappedShard {
 public:
  // Opens and maps `path` with read_shard_header's checks. Throws loom::Error naming the file.
  explicit MappedShard(const std::string& path);
  ~MappedShard();
  MappedShard(const MappedShard&) = delete;
  MappedShard& operator=(const MappedShard&) = delete;

  const ShardInfo& info() const { return info_; }
  // The tokens after the header: uint16 (info().token_bytes == 2) or uint32 ones.
  const uint16_t* tokens16() const;
  const uint32_t* tokens32() const;

  // While alive, a SIGBUS on this thread names this shard (see above).
  class Reading {
   public:
    explicit Reading(const MappedShard& shard);
    ~Reading();
    Reading(const Reading&) = delete;
    Reading& operator=(const Reading&) = delete;

   private:
    const std::string* previous_;
  };

 private:
  ShardInfo info_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
};

// Loss masks (data.loss_mask; docs/formats.md): beside a shard, SHARD.mask (loss_mask_path) says
// which of its tokens count as targets — a fine-tuning corpus' prompt tokens do not. The same
// 1024-byte header as a shard's, header[0] = kLossMaskMagic, header[1] = kLossMaskVersion,
// header[2] = the shard's number of tokens, then one byte per token: 1 = the token counts where
// it is a target (the prediction of it from the tokens before), 0 = it does not.
constexpr int32_t kLossMaskMagic = 20261205;
constexpr int32_t kLossMaskVersion = 1;
std::string loss_mask_path(const std::string& shard_path);  // shard_path + ".mask"
// Writes `counts` (0 or 1 each; anything else is an error naming the entry) atomically, as
// write_shard.
void write_loss_mask(const std::string& path, const std::vector<uint8_t>& counts);

// Whether the shard at `shard_path` of `shard_tokens` tokens has a loss mask beside it; one that
// cannot be read, has a bad header or another count than its shard's is an error naming both.
bool has_loss_mask(const std::string& shard_path, int64_t shard_tokens);

// A loss mask open for reading: its header checked (magic, version, the size its count needs),
// entries read where asked. Throws loom::Error naming the file.
class LossMaskFile {
 public:
  explicit LossMaskFile(const std::string& path);
  ~LossMaskFile();
  LossMaskFile(const LossMaskFile&) = delete;
  LossMaskFile& operator=(const LossMaskFile&) = delete;

  int64_t tokens() const { return tokens_; }
  // Entries [begin, begin + n) into out; an entry other than 0 or 1 is an error naming it.
  void read(int64_t begin, int64_t n, uint8_t* out) const;

 private:
  std::string path_;
  int fd_ = -1;
  int64_t tokens_ = 0;
};

// Reads a whole uint16 shard, with the same checks as read_shard_header (a uint32 shard is an
// error: read_shard32).
std::vector<uint16_t> read_shard(const std::string& path);
// Reads a whole shard of either width, its tokens widened to uint32.
std::vector<uint32_t> read_shard32(const std::string& path);

}  // namespace loom
