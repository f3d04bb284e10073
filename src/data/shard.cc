#include "data/shard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string_view>

#include "base/check.h"
#include "base/error.h"

namespace loom {
namespace {

// The file format is little endian; we read and write it with plain memcpy/fread.
static_assert(std::endian::native == std::endian::little,
              "shard I/O assumes a little-endian host (x86-64, aarch64)");

constexpr int32_t kLlmcModelMagic = 20240326;   // llm.c GPT-2 model checkpoint

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

std::string errno_str() {
  return std::strerror(errno);
}

// Opens `path` for reading and returns it with its size in bytes.
File open_for_read(const std::string& path, int64_t& file_bytes) {
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) fail("token shard '", path, "': cannot open: ", errno_str());
  struct stat st {};
  if (fstat(fileno(f.get()), &st) != 0)
    fail("token shard '", path, "': cannot stat: ", errno_str());
  if (!S_ISREG(st.st_mode)) fail("token shard '", path, "': not a regular file");
  file_bytes = static_cast<int64_t>(st.st_size);
  return f;
}

// Reads the header from `f` (positioned at 0) and checks it against the file size.
ShardInfo read_and_check_header(std::FILE* f, const std::string& path, int64_t file_bytes) {
  if (file_bytes < kShardHeaderBytes)
    fail("token shard '", path, "': truncated header: the file has ", file_bytes,
         " bytes, a token shard starts with a ", kShardHeaderBytes, "-byte header");
  std::array<int32_t, kShardHeaderInts> header{};
  if (std::fread(header.data(), sizeof(int32_t), header.size(), f) != header.size())
    fail("token shard '", path, "': short read of the ", kShardHeaderBytes, "-byte header");

  const bool wide = header[0] == kShardMagic32;
  if (header[0] != kShardMagic && !wide) {
    std::string hint = "this is not an llm.c token shard";
    char first[4];
    std::memcpy(first, &header[0], 4);
    if (std::all_of(first, first + 4, [](char c) { return c >= 0x20 && c < 0x7f; }))
      hint += detail::concat(" (it starts with the text \"", std::string_view(first, 4), "\")");
    if (header[0] == kLlmcModelMagic)
      hint = "this looks like an llm.c model checkpoint, not a token shard";
    fail("token shard '", path, "': bad magic ", header[0], " (expected ", kShardMagic, " or ",
         kShardMagic32, "): ", hint,
         "; token shards are made by Loom's dataset preparation or llm.c's dev/data scripts");
  }
  const int32_t version = wide ? kShardVersion32 : kShardVersion;
  if (header[1] != version)
    fail("token shard '", path, "': unsupported version ", header[1], " (this build reads version ",
         version, wide ? " of uint32 shards, magic " : " of uint16 shards, magic ", header[0], ")");
  const int64_t n = header[2];
  const int width = wide ? 4 : 2;
  const int64_t expected_bytes = kShardHeaderBytes + width * n;
  if (n < 0 || expected_bytes != file_bytes)
    fail("token shard '", path, "': the header says ", n, " tokens, which needs ", expected_bytes,
         " bytes (", kShardHeaderBytes, "-byte header + ", width, " bytes per token), but the file has ",
         file_bytes, " bytes (truncated or not a token shard?)");
  return ShardInfo{path, n, header[1], width};
}

}  // namespace

namespace {
const char* kind_name(StreamedShardFile::Kind kind) {
  return kind == StreamedShardFile::Kind::loss_mask ? "loss mask" : "token shard";
}
size_t item_bytes(StreamedShardFile::Kind kind) {
  return kind == StreamedShardFile::Kind::tokens16   ? sizeof(uint16_t)
         : kind == StreamedShardFile::Kind::tokens32 ? sizeof(uint32_t)
                                                     : sizeof(uint8_t);
}
// A new shard's tokens are not those a loss mask beside it was made for: the mask goes.
void remove_stale_loss_mask(const std::string& shard_path);
}  // namespace

StreamedShardFile::StreamedShardFile(std::string path, Kind kind)
    : path_(std::move(path)), tmp_(path_ + ".tmp"), kind_(kind) {
  file_ = std::fopen(tmp_.c_str(), "wb");
  if (file_ == nullptr) fail_io("cannot create");
  std::array<int32_t, kShardHeaderInts> header{};  // its count written by finish()
  if (std::fwrite(header.data(), sizeof(int32_t), header.size(), file_) != header.size())
    fail_io("cannot write header to");
}

StreamedShardFile::~StreamedShardFile() {
  if (file_ != nullptr) {  // unfinished: nothing replaces path_
    std::fclose(file_);
    std::remove(tmp_.c_str());
  }
}

void StreamedShardFile::fail_io(const char* what) {
  const std::string err = errno_str();
  if (file_ != nullptr) std::fclose(file_);
  file_ = nullptr;
  std::remove(tmp_.c_str());
  fail(kind_name(kind_), " '", path_, "': ", what, " '", tmp_, "': ", err);
}

void StreamedShardFile::append(const void* items, int64_t count) {
  LOOM_CHECK(file_ != nullptr && count >= 0);
  if (count_ + count > std::numeric_limits<int32_t>::max()) {
    std::fclose(file_);
    file_ = nullptr;
    std::remove(tmp_.c_str());
    fail(kind_name(kind_), " '", path_, "': ", count_ + count,
         " tokens do not fit the int32 count of the header (max ",
         std::numeric_limits<int32_t>::max(), "); write smaller shards");
  }
  const auto n = static_cast<size_t>(count);
  if (n > 0 && std::fwrite(items, item_bytes(kind_), n, file_) != n)
    fail_io("cannot write the contents to");
  count_ += count;
}

void StreamedShardFile::finish() {
  LOOM_CHECK(file_ != nullptr);
  const std::array<int32_t, 3> head{kind_ == Kind::tokens16   ? kShardMagic
                                    : kind_ == Kind::tokens32 ? kShardMagic32
                                                              : kLossMaskMagic,
                                    kind_ == Kind::tokens16   ? kShardVersion
                                    : kind_ == Kind::tokens32 ? kShardVersion32
                                                              : kLossMaskVersion,
                                    static_cast<int32_t>(count_)};
  if (std::fseek(file_, 0, SEEK_SET) != 0) fail_io("cannot seek in");
  if (std::fwrite(head.data(), sizeof(int32_t), head.size(), file_) != head.size())
    fail_io("cannot write header to");
  if (std::fflush(file_) != 0) fail_io("cannot flush");
  if (fsync(fileno(file_)) != 0) fail_io("cannot fsync");
  std::FILE* closing = file_;
  file_ = nullptr;
  if (std::fclose(closing) != 0) {
    const std::string err = errno_str();
    std::remove(tmp_.c_str());
    fail(kind_name(kind_), " '", path_, "': cannot close '", tmp_, "': ", err);
  }
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const std::string err = errno_str();
    std::remove(tmp_.c_str());
    fail(kind_name(kind_), " '", path_, "': cannot rename into place '", tmp_, "': ", err);
  }
  if (kind_ != Kind::loss_mask) remove_stale_loss_mask(path_);
}

namespace {
// Writes the n elements of `items` to `path` atomically, as a file of `kind`.
template <typename Item>
void write_headed_file(const std::string& path, StreamedShardFile::Kind kind,
                       const std::vector<Item>& items) {
  StreamedShardFile file(path, kind);
  file.append(items.data(), static_cast<int64_t>(items.size()));
  file.finish();
}
}  // namespace

namespace {
void remove_stale_loss_mask(const std::string& shard_path) {
  const std::string mask = loss_mask_path(shard_path);
  if (std::remove(mask.c_str()) != 0 && errno != ENOENT)
    fail("token shard '", shard_path, "': cannot remove the loss mask of its old tokens '", mask,
         "': ", errno_str());
}
}  // namespace

void write_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
  write_headed_file(path, StreamedShardFile::Kind::tokens16, tokens);
}

void write_shard32(const std::string& path, const std::vector<uint32_t>& tokens) {
  write_headed_file(path, StreamedShardFile::Kind::tokens32, tokens);
}

std::string loss_mask_path(const std::string& shard_path) {
  return shard_path + ".mask";
}

void write_loss_mask(const std::string& path, const std::vector<uint8_t>& counts) {
  for (size_t i = 0; i < counts.size(); ++i)
    if (counts[i] > 1)
      fail("loss mask '", path, "': entry ", i, " is ", static_cast<int>(counts[i]),
           " (each token's entry is 0 or 1)");
  write_headed_file(path, StreamedShardFile::Kind::loss_mask, counts);
}

bool has_loss_mask(const std::string& shard_path, int64_t shard_tokens) {
  const std::string path = loss_mask_path(shard_path);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return false;  // no mask: the shard's targets all count
    fail("loss mask '", path, "': cannot stat: ", errno_str());
  }
  const LossMaskFile mask(path);
  if (mask.tokens() != shard_tokens)
    fail("loss mask '", path, "' has ", mask.tokens(), " entries, but its shard '", shard_path,
         "' has ", shard_tokens, " tokens (one entry per token)");
  return true;
}

LossMaskFile::LossMaskFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail("loss mask '", path, "': cannot open: ", errno_str());
  // The constructor throws: the destructor will not run, so the file is closed here.
  const auto refuse = [&](const auto&... what) {
    ::close(fd_);
    fail("loss mask '", path, "': ", what...);
  };
  struct stat st {};
  if (fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) refuse("not a regular file");
  std::array<int32_t, kShardHeaderInts> header{};
  const auto bytes = static_cast<int64_t>(st.st_size);
  if (bytes < kShardHeaderBytes ||
      ::pread(fd_, header.data(), kShardHeaderBytes, 0) != kShardHeaderBytes)
    refuse("truncated header: the file has ", bytes, " bytes, a loss mask starts with a ",
           kShardHeaderBytes, "-byte header");
  if (header[0] != kLossMaskMagic || header[1] != kLossMaskVersion)
    refuse("bad magic / version ", header[0], " / ", header[1], " (expected ", kLossMaskMagic,
           " / ", kLossMaskVersion, ": a loss mask file, docs/formats.md)");
  tokens_ = header[2];
  if (tokens_ < 0 || kShardHeaderBytes + tokens_ != bytes)
    refuse("the header says ", tokens_, " tokens, which needs ", kShardHeaderBytes + tokens_,
           " bytes (a byte per token), but the file has ", bytes);
}

LossMaskFile::~LossMaskFile() {
  ::close(fd_);
}

void LossMaskFile::read(int64_t begin, int64_t n, uint8_t* out) const {
  LOOM_CHECK(begin >= 0 && n >= 0 && begin + n <= tokens_);
  int64_t done = 0;
  while (done < n) {
    const ssize_t got =
        ::pread(fd_, out + done, static_cast<size_t>(n - done), kShardHeaderBytes + begin + done);
    if (got <= 0)
      fail("loss mask '", path_, "': cannot read entries ", begin, "..", begin + n, ": ",
           got < 0 ? errno_str() : std::string("the file is shorter than its header says"));
    done += got;
  }
  for (int64_t i = 0; i < n; ++i)
    if (out[i] > 1)
      fail("loss mask '", path_, "': entry ", begin + i, " is ", static_cast<int>(out[i]),
           " (each token's entry is 0 or 1)");
}

ShardInfo read_shard_header(const std::string& path) {
  int64_t file_bytes = 0;
  File f = open_for_read(path, file_bytes);
  return read_and_check_header(f.get(), path, file_bytes);
}

namespace {

// The shard this thread is copying tokens from (MappedShard::Reading), for the SIGBUS handler. A
// SIGBUS from a read is delivered to the reading thread, so its thread-local is the one to look at.
thread_local const std::string* tl_reading_shard = nullptr;
struct sigaction previous_sigbus {};

// Async-signal-safe: write(2) and _exit only.
void on_sigbus(int sig, siginfo_t*, void*) {
  if (const std::string* path = tl_reading_shard) {
    constexpr char head[] = "loom: error: token shard '";
    constexpr char tail[] =
        "' is shorter than when it was opened (SIGBUS reading it while mapped): truncated or "
        "rewritten in place? Replace shards by writing a new file and renaming it over\n";
    ssize_t ignored = write(STDERR_FILENO, head, sizeof head - 1);
    ignored = write(STDERR_FILENO, path->data(), path->size());
    ignored = write(STDERR_FILENO, tail, sizeof tail - 1);
    (void)ignored;
    _exit(1);
  }
  // Not a shard's: the handler before ours takes it (the faulting read runs again on return).
  sigaction(sig, &previous_sigbus, nullptr);
}

void install_sigbus_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &previous_sigbus);
  });
}

}  // namespace

MappedShard::Reading::Reading(const MappedShard& shard) : previous_(tl_reading_shard) {
  tl_reading_shard = &shard.info_.path;
}

MappedShard::Reading::~Reading() {
  tl_reading_shard = previous_;
}

MappedShard::MappedShard(const std::string& path) {
  install_sigbus_handler();
  int64_t file_bytes = 0;
  File f = open_for_read(path, file_bytes);
  info_ = read_and_check_header(f.get(), path, file_bytes);
  bytes_ = static_cast<size_t>(file_bytes);
  base_ = mmap(nullptr, bytes_, PROT_READ, MAP_PRIVATE, fileno(f.get()), 0);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    fail("token shard '", path, "': cannot map ", bytes_, " bytes: ", errno_str());
  }
  // The mapping outlives the descriptor, which `f` closes.
}

MappedShard::~MappedShard() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

const uint16_t* MappedShard::tokens16() const {
  LOOM_CHECK(info_.token_bytes == 2);
  return reinterpret_cast<const uint16_t*>(static_cast<const char*>(base_) + kShardHeaderBytes);
}

const uint32_t* MappedShard::tokens32() const {
  LOOM_CHECK(info_.token_bytes == 4);
  return reinterpret_cast<const uint32_t*>(static_cast<const char*>(base_) + kShardHeaderBytes);
}

std::vector<uint16_t> read_shard(const std::string& path) {
  int64_t file_bytes = 0;
  File f = open_for_read(path, file_bytes);
  const ShardInfo info = read_and_check_header(f.get(), path, file_bytes);
  if (info.token_bytes != 2)
    fail("token shard '", path, "': a uint32 (llama-3) shard where uint16 tokens were expected");
  std::vector<uint16_t> tokens(static_cast<size_t>(info.num_tokens));
  if (std::fread(tokens.data(), sizeof(uint16_t), tokens.size(), f.get()) != tokens.size())
    fail("token shard '", path, "': short read: expected ", info.num_tokens,
         " tokens (did the file change while reading?)");
  return tokens;
}

std::vector<uint32_t> read_shard32(const std::string& path) {
  int64_t file_bytes = 0;
  File f = open_for_read(path, file_bytes);
  const ShardInfo info = read_and_check_header(f.get(), path, file_bytes);
  std::vector<uint32_t> tokens(static_cast<size_t>(info.num_tokens));
  bool ok;
  if (info.token_bytes == 4) {
    ok = std::fread(tokens.data(), sizeof(uint32_t), tokens.size(), f.get()) == tokens.size();
  } else {
    std::vector<uint16_t> narrow(tokens.size());
    ok = std::fread(narrow.data(), sizeof(uint16_t), narrow.size(), f.get()) == narrow.size();
    std::copy(narrow.begin(), narrow.end(), tokens.begin());
  }
  if (!ok)
    fail("token shard '", path, "': short read: expected ", info.num_tokens,
         " tokens (did the file change while reading?)");
  return tokens;
}

}  // namespace loom
