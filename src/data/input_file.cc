#include "data/input_file.h"

#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "base/error.h"

namespace loom {
namespace {

constexpr size_t kMaxFrameHead = 18;  // ZSTD_FRAMEHEADERSIZE_MAX: a frame header's most bytes

// Whether a frame's first 4 bytes are zstd's magic number or a skippable frame's. libzstd also
// decodes the formats before 1.0 (0.5-0.7), whose streaming decoders accept damaged frames that
// they refuse whole (fuzz_compressed found one); nothing ships corpora in them.
bool zstd_magic(std::string_view head) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(head[i]); };
  const uint32_t magic = byte(0) | byte(1) << 8 | byte(2) << 16 | uint32_t{byte(3)} << 24;
  return magic == ZSTD_MAGICNUMBER ||
         (magic & ZSTD_MAGIC_SKIPPABLE_MASK) == ZSTD_MAGIC_SKIPPABLE_START;
}

}  // namespace

Compression compression_of(std::string_view path) {
  if (path.ends_with(".gz")) return Compression::gzip;
  if (path.ends_with(".zst") || path.ends_with(".zstd")) return Compression::zstd;
  return Compression::none;
}

bool is_json_lines(std::string_view path) {
  for (std::string_view suffix : {".gz", ".zst", ".zstd"})
    if (path.ends_with(suffix)) {
      path.remove_suffix(suffix.size());
      break;
    }
  return path.ends_with(".jsonl") || path.ends_with(".ndjson") || path.ends_with(".json");
}

// The compressed side: a buffer of the file's bytes and the library's stream state. A "stream"
// is a gzip member or a zstd frame; several may follow one another.
struct InputFile::Decoder {
  explicit Decoder(size_t buffer_bytes) : in(new char[buffer_bytes]), capacity(buffer_bytes) {}
  std::unique_ptr<char[]> in;  // not zeroed: only what fread wrote is looked at
  size_t capacity;
  size_t in_begin = 0, in_end = 0;  // unread compressed bytes
  bool eof = false;                 // the file has no more
  bool stream_open = false;         // inside a member / frame
  int64_t streams = 0;              // members / frames decoded whole
  z_stream z{};
  ZSTD_DStream* zstd = nullptr;
  // The zstd frame being read: its first bytes (the header: at most 18) and the bytes it gave.
  // libzstd checks a frame's declared content size only when the frame arrives whole in one
  // call; fed a buffer at a time, a frame that declares more than it holds ends quietly short.
  std::string frame_head;
  uint64_t frame_out = 0;

  ~Decoder() {
    if (zstd != nullptr) ZSTD_freeDStream(zstd);
  }
};

InputFile::InputFile(std::string path, size_t buffer_bytes)
    : path_(std::move(path)), compression_(compression_of(path_)) {
  file_ = std::fopen(path_.c_str(), "rb");
  if (file_ == nullptr) fail("input file '", path_, "': cannot open: ", std::strerror(errno));
  if (compression_ == Compression::none) return;
  decoder_ = std::make_unique<Decoder>(std::max<size_t>(buffer_bytes, 1));
  if (compression_ == Compression::gzip) {
    // 16 + MAX_WBITS: a gzip header and trailer (CRC-32 and length checked), not zlib's.
    if (inflateInit2(&decoder_->z, 16 + MAX_WBITS) != Z_OK) {
      std::fclose(file_);
      fail("input file '", path_, "': cannot start zlib");
    }
  } else {
    decoder_->zstd = ZSTD_createDStream();
    if (decoder_->zstd == nullptr) {
      std::fclose(file_);
      fail("input file '", path_, "': cannot start zstd");
    }
  }
}

InputFile::~InputFile() {
  if (decoder_ && compression_ == Compression::gzip) inflateEnd(&decoder_->z);
  if (file_ != nullptr) std::fclose(file_);
}

size_t InputFile::fill_input() {
  Decoder& d = *decoder_;
  d.in_begin = 0;
  d.in_end = std::fread(d.in.get(), 1, d.capacity, file_);
  if (d.in_end == 0) {
    if (std::ferror(file_)) fail("input file '", path_, "': read error");
    d.eof = true;
  }
  return d.in_end;
}

size_t InputFile::read(char* out, size_t n) {
  if (n == 0) return 0;
  if (compression_ == Compression::none) {
    const size_t got = std::fread(out, 1, n, file_);
    if (got == 0 && std::ferror(file_)) fail("input file '", path_, "': read error");
    return got;
  }
  Decoder& d = *decoder_;
  const char* kind = compression_ == Compression::gzip ? "gzip" : "zstd";
  for (;;) {
    if (d.in_begin == d.in_end && !d.eof) fill_input();
    const bool input_left = d.in_begin < d.in_end;
    const size_t in_before = d.in_begin;
    if (!input_left && !d.stream_open) {  // the end, between streams
      if (d.streams == 0) fail("input file '", path_, "': empty, not ", kind, " data");
      return 0;
    }
    size_t produced = 0;
    if (compression_ == Compression::gzip) {
      if (!d.stream_open) {
        inflateReset(&d.z);
        d.stream_open = true;
      }
      d.z.next_in = reinterpret_cast<Bytef*>(d.in.get() + d.in_begin);
      d.z.avail_in = static_cast<uInt>(d.in_end - d.in_begin);
      d.z.next_out = reinterpret_cast<Bytef*>(out);
      d.z.avail_out = static_cast<uInt>(std::min<size_t>(n, UINT32_MAX));
      const uInt out_before = d.z.avail_out;
      const int rc = inflate(&d.z, Z_NO_FLUSH);
      d.in_begin = d.in_end - d.z.avail_in;
      produced = out_before - d.z.avail_out;
      if (rc == Z_STREAM_END) {
        d.stream_open = false;
        ++d.streams;
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {  // Z_BUF_ERROR: no progress without input
        if (d.streams > 0 && d.z.total_out == 0)     // not the header of another member
          fail("input file '", path_, "': bytes that are not gzip after its gzip data (", d.streams,
               " member", d.streams == 1 ? "" : "s", " read)");
        fail("input file '", path_,
             "': damaged gzip data (zlib: ", d.z.msg != nullptr ? d.z.msg : "error", ")");
      }
    } else {
      ZSTD_inBuffer in{d.in.get() + d.in_begin, d.in_end - d.in_begin, 0};
      ZSTD_outBuffer buffer{out, n, 0};
      const size_t hint = ZSTD_decompressStream(d.zstd, &buffer, &in);
      if (ZSTD_isError(hint))
        fail("input file '", path_, "': damaged zstd data (", ZSTD_getErrorName(hint), ")");
      const size_t head = std::min(in.pos, kMaxFrameHead - d.frame_head.size());
      const bool magic_seen = d.frame_head.size() >= 4;
      d.frame_head.append(d.in.get() + d.in_begin, head);
      if (!magic_seen && d.frame_head.size() >= 4 && !zstd_magic(d.frame_head))
        fail("input file '", path_, "': not zstd data (frame ", d.streams + 1,
             " starts with no zstd magic number: a format before zstd 1.0, or another)");
      d.in_begin += in.pos;
      produced = buffer.pos;
      d.frame_out += produced;
      if (hint == 0 && (d.stream_open || in.pos > 0)) {  // a frame decoded and flushed whole
        const unsigned long long declared =
            ZSTD_getFrameContentSize(d.frame_head.data(), d.frame_head.size());
        if (declared != ZSTD_CONTENTSIZE_UNKNOWN && declared != ZSTD_CONTENTSIZE_ERROR &&
            declared != d.frame_out)
          fail("input file '", path_, "': damaged zstd data (frame ", d.streams + 1, " declares ",
               declared, " bytes and holds ", d.frame_out, ")");
        ++d.streams;
        d.frame_head.clear();
        d.frame_out = 0;
        d.stream_open = false;
      } else if (hint != 0) {
        d.stream_open = true;
      }
    }
    if (produced > 0) return produced;
    if (input_left && d.in_begin == in_before)  // neither side moved: never expected, never a hang
      fail("input file '", path_, "': damaged ", kind, " data (the decoder made no progress)");
    if (!input_left && d.eof)
      fail("input file '", path_, "': the ", kind, " data ends early (a truncated file?)");
  }
}

std::string read_input_file(const std::string& path) {
  InputFile file(path);
  std::string text;
  if (compression_of(path) == Compression::none) {  // the size known: one allocation
    std::error_code ec;
    const std::uintmax_t size = std::filesystem::file_size(path, ec);
    if (!ec) text.reserve(static_cast<size_t>(size));
  }
  std::vector<char> block(kInputBufferBytes);
  while (const size_t got = file.read(block.data(), block.size())) text.append(block.data(), got);
  return text;
}

LineReader::LineReader(std::string path, size_t buffer_bytes)
    : file_(std::move(path), buffer_bytes),
      buffer_(new char[std::max<size_t>(buffer_bytes, 1)]),
      capacity_(std::max<size_t>(buffer_bytes, 1)) {}

bool LineReader::next(std::string& line) {
  line.clear();
  bool partial = false;  // bytes of a line taken before the buffer ran out
  for (;;) {
    if (begin_ < end_) {
      const char* data = buffer_.get();
      const void* newline = std::memchr(data + begin_, '\n', end_ - begin_);
      if (newline != nullptr) {
        const size_t at = static_cast<size_t>(static_cast<const char*>(newline) - data);
        line.append(data + begin_, at - begin_);
        begin_ = at + 1;
        ++line_number_;
        return true;
      }
      line.append(data + begin_, end_ - begin_);
      begin_ = end_;
      partial = true;
    }
    if (!at_end_) {
      begin_ = 0;
      end_ = file_.read(buffer_.get(), capacity_);
      at_end_ = end_ == 0;
      continue;
    }
    if (!partial) return false;
    ++line_number_;
    return true;
  }
}

}  // namespace loom
