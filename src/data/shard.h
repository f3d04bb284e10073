// Token shards in llm.c's format (karpathy/llm.c, dev/data/data_common.py, "gpt-2" variant).
//
// A shard is a 1024-byte header of 256 little-endian int32 followed by the tokens as
// little-endian uint16:
//   header[0] = 20240520 (magic), header[1] = 1 (version), header[2] = number of tokens,
//   header[3..255] = 0.
// So shards written by llm.c's dev/data scripts (GPT-2 tokens) and by Loom are interchangeable.
// llm.c's uint32 "llama-3" shards (magic 20240801) are recognised only to explain the refusal.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom {

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersion = 1;
constexpr int64_t kShardHeaderInts = 256;
constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;

struct ShardInfo {
  std::string path;
  int64_t num_tokens = 0;
  int32_t version = 0;
};

// Writes `tokens` to `path` atomically: to path + ".tmp", flushed and fsync'ed, then renamed, so
// a reader (or a crash) never sees a half-written shard. Throws loom::Error naming the file on
// any I/O failure, or if there are more tokens than the int32 header count can hold.
void write_shard(const std::string& path, const std::vector<uint16_t>& tokens);

// Reads and validates the header only (magic, version, and that the token count matches the file
// size). Throws loom::Error naming the file for a missing file, a truncated header, a wrong
// magic, an unsupported version or a count that does not match the file size.
ShardInfo read_shard_header(const std::string& path);

// Reads a whole shard, with the same checks as read_shard_header.
std::vector<uint16_t> read_shard(const std::string& path);

}  // namespace loom
