#include "checkpoint/file_digest.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "base/error.h"

// Header-only: the hash compiles into this file and Loom's binaries need no libxxhash at run
// time (the GPU machines lack Debian's libraries).
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace loom {

struct Digester::State {
  XXH3_state_t xxh3;
};

Digester::Digester() : state_(std::make_unique<State>()) {
  XXH3_64bits_reset(&state_->xxh3);
}

Digester::~Digester() = default;

void Digester::update(const void* data, size_t bytes) {
  if (bytes == 0) return;
  XXH3_64bits_update(&state_->xxh3, data, bytes);
  bytes_ += static_cast<int64_t>(bytes);
}

FileDigest Digester::digest() const {
  return FileDigest{bytes_, XXH3_64bits_digest(&state_->xxh3)};
}

std::string xxh3_hex(uint64_t hash) {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(hash));
  return text;
}

bool parse_xxh3(const std::string& text, uint64_t& hash) {
  if (text.size() != 16) return false;
  uint64_t value = 0;
  for (char c : text) {
    int digit;
    if (c >= '0' && c <= '9')
      digit = c - '0';
    else if (c >= 'a' && c <= 'f')
      digit = c - 'a' + 10;
    else
      return false;
    value = value << 4 | static_cast<uint64_t>(digit);
  }
  hash = value;
  return true;
}

FileDigest digest_file(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) fail("cannot read '", path, "': ", std::strerror(errno));
  Digester digester;
  std::vector<char> chunk(size_t{4} << 20);
  size_t got;
  while ((got = std::fread(chunk.data(), 1, chunk.size(), f)) > 0)
    digester.update(chunk.data(), got);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) fail("cannot read '", path, "': read error");
  return digester.digest();
}

}  // namespace loom
