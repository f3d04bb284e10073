// FileDigest — what a file held: its length and the XXH3-64 hash of its bytes.
//
// Checkpoints record the digest of every tensor file they write (state.json "files") and check
// it when they are read, so a file damaged on disk or in a copy, truncated, or swapped for
// another checkpoint's is an error that names it instead of a run that silently resumes from
// garbage. XXH3 (xxHash, Debian's libxxhash-dev, used header-only) hashes at memory speed, so
// the check costs little next to reading the file; it guards against accidents, not tampering.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace loom {

struct FileDigest {
  int64_t bytes = 0;
  uint64_t xxh3 = 0;
  bool operator==(const FileDigest&) const = default;
};

// The hash as 16 lowercase hex digits (how state.json records it), and back; parse_xxh3 returns
// false for anything but 16 hex digits.
std::string xxh3_hex(uint64_t hash);
bool parse_xxh3(const std::string& text, uint64_t& hash);

// A digest built up from consecutive pieces of a file, in order.
class Digester {
 public:
  Digester();
  ~Digester();
  Digester(const Digester&) = delete;
  Digester& operator=(const Digester&) = delete;

  void update(const void* data, size_t bytes);
  FileDigest digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
  int64_t bytes_ = 0;
};

// The digest of a whole file, read in chunks. Throws loom::Error naming the file when it cannot
// be read.
FileDigest digest_file(const std::string& path);

}  // namespace loom
