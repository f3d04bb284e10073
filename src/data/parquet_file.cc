#include "data/parquet_file.h"

#include <brotli/decode.h>
#include <fcntl.h>
#include <lz4.h>
#include <snappy-c.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "base/check.h"
#include "base/error.h"

namespace loom {
namespace {

// A damaged encoding met below the file's structure; the reader adds the file, column and row.
struct DecodeError {
  std::string why;
};

uint32_t little_u32(const uint8_t* p) {
  return p[0] | p[1] << 8 | p[2] << 16 | uint32_t{p[3]} << 24;
}

uint32_t big_u32(const uint8_t* p) {
  return uint32_t{p[0]} << 24 | p[1] << 16 | p[2] << 8 | p[3];
}

// The names the format gives its enums, for messages.
const char* type_name(int32_t type) {
  static const char* const kNames[] = {"BOOLEAN", "INT32",  "INT64",      "INT96",
                                       "FLOAT",   "DOUBLE", "BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY"};
  return type >= 0 && type < 8 ? kNames[type] : "an unknown type";
}

const char* codec_name(int32_t codec) {
  static const char* const kNames[] = {"UNCOMPRESSED", "SNAPPY", "GZIP", "LZO",
                                       "BROTLI",       "LZ4",    "ZSTD", "LZ4_RAW"};
  return codec >= 0 && codec < 8 ? kNames[codec] : "an unknown codec";
}

// Parquet's enums (parquet.thrift).
enum Type : int32_t { kByteArray = 6 };
enum Repetition : int32_t { kRequired = 0, kOptional = 1, kRepeated = 2 };
enum Codec : int32_t {
  kUncompressed = 0,
  kSnappy = 1,
  kGzip = 2,
  kLzo = 3,
  kBrotli = 4,
  kLz4Hadoop = 5,
  kZstd = 6,
  kLz4Raw = 7
};
enum PageType : int32_t { kDataPage = 0, kDictionaryPage = 2, kDataPageV2 = 3 };
enum Encoding : int32_t {
  kPlain = 0,
  kPlainDictionary = 2,
  kRle = 3,
  kDeltaLengthByteArray = 6,
  kDeltaByteArray = 7,
  kRleDictionary = 8
};

// ---- Thrift's compact protocol (the footer's metadata and each page's header) ----------------

enum ThriftType : int {
  kTrue = 1,  // a bool field's value is its type
  kFalse = 2,
  kByte = 3,
  kI16 = 4,
  kI32 = 5,
  kI64 = 6,
  kDouble = 7,
  kBinary = 8,
  kList = 9,
  kSet = 10,
  kMap = 11,
  kStruct = 12
};

class Thrift {
 public:
  Thrift(const uint8_t* begin, const uint8_t* end) : p_(begin), end_(end) {}
  const uint8_t* position() const { return p_; }

  uint8_t byte() {
    if (p_ == end_) throw DecodeError{"Thrift metadata ends early"};
    return *p_++;
  }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
      const uint8_t b = byte();
      if (shift < 64) v |= uint64_t{b & 0x7fu} << shift;
      if ((b & 0x80) == 0) return v;
    }
    throw DecodeError{"a varint of over 10 bytes"};
  }
  int64_t zigzag() {
    const uint64_t v = varint();
    return static_cast<int64_t>(v >> 1) ^ -static_cast<int64_t>(v & 1);
  }
  int64_t integer(int type) {
    if (type == kByte) return static_cast<int8_t>(byte());
    if (type == kI16 || type == kI32 || type == kI64) return zigzag();
    throw DecodeError{"an integer field of another type"};
  }
  int32_t i32(int type) {
    const int64_t v = integer(type);
    if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())
      throw DecodeError{"a 32-bit field out of range"};
    return static_cast<int32_t>(v);
  }
  bool boolean(int type) {
    if (type != kTrue && type != kFalse) throw DecodeError{"a bool field of another type"};
    return type == kTrue;
  }
  std::string_view binary(int type) {
    if (type != kBinary) throw DecodeError{"a string field of another type"};
    const uint64_t n = varint();
    if (n > static_cast<uint64_t>(end_ - p_)) throw DecodeError{"a string past the end"};
    const std::string_view s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }

  // Calls visit(id, type) for each field of a struct up to its stop; visit reads the field's
  // value or skip(type)s it.
  template <typename Visit>
  void fields(Visit&& visit) {
    Nest nest(*this);
    int64_t last = 0;
    for (;;) {
      const uint8_t head = byte();
      if (head == 0) return;
      const int delta = head >> 4;
      last = delta != 0 ? last + delta : zigzag();
      visit(last, head & 0x0f);
    }
  }
  // A list's (or set's) element type and size; its elements follow.
  std::pair<int, uint64_t> list(int type) {
    if (type != kList && type != kSet) throw DecodeError{"a list field of another type"};
    const uint8_t head = byte();
    uint64_t size = head >> 4;
    if (size == 15) size = varint();
    if (size > static_cast<uint64_t>(end_ - p_))  // every element takes a byte at least
      throw DecodeError{"a list longer than its bytes"};
    return {head & 0x0f, size};
  }
  template <typename Visit>
  void elements(int type, Visit&& visit) {
    const auto [element, size] = list(type);
    for (uint64_t i = 0; i < size; ++i) visit(element);
  }

  void skip(int type) {
    switch (type) {
      case kTrue:
      case kFalse:
        return;  // the field's type was its value
      case kByte:
        byte();
        return;
      case kI16:
      case kI32:
      case kI64:
        varint();
        return;
      case kDouble:
        if (end_ - p_ < 8) throw DecodeError{"Thrift metadata ends early"};
        p_ += 8;
        return;
      case kBinary:
        binary(type);
        return;
      case kList:
      case kSet: {
        Nest nest(*this);
        elements(type, [&](int element) { skip_element(element); });
        return;
      }
      case kMap: {
        Nest nest(*this);
        const uint64_t size = varint();
        if (size == 0) return;
        if (size > static_cast<uint64_t>(end_ - p_))
          throw DecodeError{"a map longer than its bytes"};
        const uint8_t types = byte();
        for (uint64_t i = 0; i < size; ++i) {
          skip_element(types >> 4);
          skip_element(types & 0x0f);
        }
        return;
      }
      case kStruct:
        fields([&](int64_t, int field_type) { skip(field_type); });
        return;
      default:
        throw DecodeError{"a Thrift field of unknown type"};
    }
  }

 private:
  // A collection's bools are a byte each; elsewhere an element reads as a field's value.
  void skip_element(int type) {
    if (type == kTrue || type == kFalse)
      byte();
    else
      skip(type);
  }
  // Bounds the nesting, so that a damaged footer cannot exhaust the stack.
  struct Nest {
    explicit Nest(Thrift& reader) : thrift(reader) {
      if (++thrift.depth_ > 32) throw DecodeError{"Thrift structures nested over 32 deep"};
    }
    ~Nest() { --thrift.depth_; }
    Thrift& thrift;
  };

  const uint8_t* p_;
  const uint8_t* end_;
  int depth_ = 0;
};

// ---- value encodings ----------------------------------------------------------------------

// `width` (0..64) bits from bit `bit` of base[0, bytes), least significant first.
uint64_t bits_at(const uint8_t* base, size_t bytes, uint64_t bit, int width) {
  if (width == 0) return 0;
  if ((bit + static_cast<uint64_t>(width) - 1) / 8 >= bytes)
    throw DecodeError{"bit-packed values past the end of their run"};
  size_t at = bit / 8;
  const int shift = static_cast<int>(bit % 8);
  uint64_t v = base[at++] >> shift;
  for (int got = 8 - shift; got < width; got += 8) v |= uint64_t{base[at++]} << got;
  return width == 64 ? v : v & ((uint64_t{1} << width) - 1);
}

uint64_t varint_at(const uint8_t*& p, const uint8_t* end) {
  Thrift t(p, end);
  const uint64_t v = t.varint();
  p = t.position();
  return v;
}

// The RLE / bit-packed hybrid of definition levels and dictionary indices.
class RleDecoder {
 public:
  RleDecoder() = default;
  RleDecoder(const uint8_t* begin, const uint8_t* end, int width)
      : p_(begin), end_(end), width_(width) {
    if (width < 0 || width > 32) throw DecodeError{"a bit width over 32"};
  }
  uint32_t next() {
    if (left_ == 0) start_run();
    --left_;
    if (repeated_) return value_;
    const auto v = static_cast<uint32_t>(bits_at(packed_, packed_bytes_, bit_, width_));
    bit_ += static_cast<uint64_t>(width_);
    return v;
  }

 private:
  void start_run() {
    if (p_ == end_) throw DecodeError{"RLE-coded values end early"};
    const uint64_t head = varint_at(p_, end_);
    const uint64_t count = head >> 1;
    if (count == 0) throw DecodeError{"an empty RLE run"};
    if ((head & 1) != 0) {  // `count` groups of 8 bit-packed values
      if (count > (uint64_t{1} << 40)) throw DecodeError{"a bit-packed run too long"};
      const uint64_t bytes = count * static_cast<uint64_t>(width_);
      packed_ = p_;
      // The last run of a page may be cut short: its values are checked as they are read.
      packed_bytes_ = std::min<uint64_t>(bytes, static_cast<uint64_t>(end_ - p_));
      p_ += packed_bytes_;
      left_ = count * 8;
      bit_ = 0;
      repeated_ = false;
      return;
    }
    const int value_bytes = (width_ + 7) / 8;
    if (end_ - p_ < value_bytes) throw DecodeError{"an RLE run's value past the end"};
    value_ = 0;
    for (int i = 0; i < value_bytes; ++i) value_ |= uint32_t{p_[i]} << (8 * i);
    p_ += value_bytes;
    if (width_ < 32 && (value_ >> width_) != 0)
      throw DecodeError{"an RLE value wider than its width"};
    left_ = count;
    repeated_ = true;
  }

  const uint8_t* p_ = nullptr;
  const uint8_t* end_ = nullptr;
  int width_ = 0;
  uint64_t left_ = 0;  // values left in the run
  bool repeated_ = false;
  uint32_t value_ = 0;               // a repeated run's value
  const uint8_t* packed_ = nullptr;  // a bit-packed run's bytes
  uint64_t packed_bytes_ = 0, bit_ = 0;
};

// DELTA_BINARY_PACKED integers (the lengths and prefix lengths of the delta string encodings):
// a header, then blocks of a minimum delta, the bit widths of its miniblocks, and the miniblocks'
// bit-packed deltas less that minimum.
class DeltaDecoder {
 public:
  DeltaDecoder() = default;
  DeltaDecoder(const uint8_t* begin, const uint8_t* end) : p_(begin), end_(end) {
    const uint64_t block = varint_at(p_, end_);
    miniblocks_ = varint_at(p_, end_);
    left_ = varint_at(p_, end_);
    Thrift t(p_, end_);
    last_ = t.zigzag();
    p_ = t.position();
    if (block == 0 || block % 128 != 0 || block > (uint64_t{1} << 32) || miniblocks_ == 0 ||
        block % miniblocks_ != 0 || (block / miniblocks_) % 32 != 0)
      throw DecodeError{"a DELTA_BINARY_PACKED header of impossible block sizes"};
    per_miniblock_ = block / miniblocks_;
  }

  int64_t next() {
    if (left_ == 0) throw DecodeError{"fewer delta-coded values than the page's"};
    --left_;
    if (!first_done_) {  // the header's first value
      first_done_ = true;
      return last_;
    }
    if (in_miniblock_ == 0) next_miniblock();
    const uint64_t delta = bits_at(miniblock_, miniblock_bytes_, bit_, width_);
    bit_ += static_cast<uint64_t>(width_);
    --in_miniblock_;
    last_ = static_cast<int64_t>(static_cast<uint64_t>(last_) + static_cast<uint64_t>(min_delta_) +
                                 delta);  // wraps as the writer's arithmetic did
    return last_;
  }

  // Where the encoded values end (the next section of the page starts), found by walking the
  // blocks' headers: the miniblocks of the last block that hold no value are not stored.
  const uint8_t* end_of_values() const {
    DeltaDecoder walk = *this;
    if (walk.left_ > 0 && !walk.first_done_) {
      walk.first_done_ = true;
      --walk.left_;
    }
    walk.left_ -= std::min(walk.left_, walk.in_miniblock_);
    walk.in_miniblock_ = 0;
    while (walk.left_ > 0) {
      walk.next_miniblock(/*check_width=*/false);
      walk.left_ -= std::min(walk.left_, walk.in_miniblock_);
      walk.in_miniblock_ = 0;
    }
    return walk.p_;
  }

 private:
  void next_miniblock(bool check_width = true) {
    if (miniblock_index_ >= miniblocks_) {  // a new block
      Thrift t(p_, end_);
      min_delta_ = t.zigzag();
      p_ = t.position();
      if (static_cast<uint64_t>(end_ - p_) < miniblocks_)
        throw DecodeError{"a delta block's bit widths past the end"};
      widths_ = p_;
      p_ += miniblocks_;
      miniblock_index_ = 0;
    }
    width_ = widths_[miniblock_index_++];
    if (width_ > 64) {
      if (check_width) throw DecodeError{"a delta miniblock's bit width over 64"};
      width_ = 64;  // an unused miniblock's width may be anything; walked, it counts as stored
    }
    const uint64_t bytes = per_miniblock_ * static_cast<uint64_t>(width_) / 8;
    miniblock_ = p_;
    miniblock_bytes_ = std::min<uint64_t>(bytes, static_cast<uint64_t>(end_ - p_));
    p_ += miniblock_bytes_;
    in_miniblock_ = per_miniblock_;
    bit_ = 0;
  }

  const uint8_t* p_ = nullptr;
  const uint8_t* end_ = nullptr;
  uint64_t miniblocks_ = 1, per_miniblock_ = 32, left_ = 0;
  int64_t last_ = 0, min_delta_ = 0;
  bool first_done_ = false;
  const uint8_t* widths_ = nullptr;
  uint64_t miniblock_index_ = std::numeric_limits<uint64_t>::max();  // forces a block at first
  const uint8_t* miniblock_ = nullptr;
  uint64_t miniblock_bytes_ = 0, in_miniblock_ = 0, bit_ = 0;
  int width_ = 0;
};

void inflate_gzip(const uint8_t* in, size_t size, char* out, size_t out_size) {
  z_stream z{};
  if (inflateInit2(&z, 15 + 32) != Z_OK) throw DecodeError{"cannot start zlib"};  // gzip or zlib
  z.next_in = const_cast<Bytef*>(in);
  z.avail_in = static_cast<uInt>(size);
  z.next_out = reinterpret_cast<Bytef*>(out);
  z.avail_out = static_cast<uInt>(out_size);
  const int rc = inflate(&z, Z_FINISH);
  const uLong produced = z.total_out;
  inflateEnd(&z);
  if (rc != Z_STREAM_END || produced != out_size)
    throw DecodeError{"damaged GZIP data, or not the page's size"};
}

void decompress_lz4_hadoop(const uint8_t* in, size_t size, char* out, size_t out_size) {
  // Hadoop's framing: blocks of [big-endian decompressed size, compressed size, LZ4 block]. Some
  // writers wrote plain LZ4 blocks under this codec, so a page that is not framed is read as one
  // (as Arrow does).
  const uint8_t* p = in;
  const uint8_t* end = in + size;
  size_t produced = 0;
  bool framed = size >= 8;
  while (framed && end - p >= 8) {
    const uint32_t block_out = big_u32(p), block_in = big_u32(p + 4);
    if (block_in > static_cast<size_t>(end - p - 8) || block_out > out_size - produced) {
      framed = false;
      break;
    }
    const int got = LZ4_decompress_safe(reinterpret_cast<const char*>(p + 8), out + produced,
                                        static_cast<int>(block_in), static_cast<int>(block_out));
    if (got < 0 || static_cast<uint32_t>(got) != block_out) {
      framed = false;
      break;
    }
    produced += block_out;
    p += 8 + block_in;
  }
  if (framed && p == end && produced == out_size) return;
  const int got = LZ4_decompress_safe(reinterpret_cast<const char*>(in), out,
                                      static_cast<int>(size), static_cast<int>(out_size));
  if (got < 0 || static_cast<size_t>(got) != out_size)
    throw DecodeError{"damaged LZ4 data, or not the page's size"};
}

void decompress(int32_t codec, const uint8_t* in, size_t size, char* out, size_t out_size) {
  switch (codec) {
    case kSnappy: {
      size_t n = 0;
      const auto* src = reinterpret_cast<const char*>(in);
      if (snappy_uncompressed_length(src, size, &n) != SNAPPY_OK || n != out_size ||
          snappy_uncompress(src, size, out, &n) != SNAPPY_OK || n != out_size)
        throw DecodeError{"damaged SNAPPY data, or not the page's size"};
      return;
    }
    case kGzip:
      inflate_gzip(in, size, out, out_size);
      return;
    case kBrotli: {
      size_t n = out_size;
      if (BrotliDecoderDecompress(size, in, &n, reinterpret_cast<uint8_t*>(out)) !=
              BROTLI_DECODER_RESULT_SUCCESS ||
          n != out_size)
        throw DecodeError{"damaged BROTLI data, or not the page's size"};
      return;
    }
    case kLz4Hadoop:
      decompress_lz4_hadoop(in, size, out, out_size);
      return;
    case kZstd: {
      const size_t n = ZSTD_decompress(out, out_size, in, size);
      if (ZSTD_isError(n) || n != out_size)
        throw DecodeError{"damaged ZSTD data, or not the page's size"};
      return;
    }
    case kLz4Raw: {
      if (size > std::numeric_limits<int>::max()) throw DecodeError{"an LZ4 page over 2 GiB"};
      const int n = LZ4_decompress_safe(reinterpret_cast<const char*>(in), out,
                                        static_cast<int>(size), static_cast<int>(out_size));
      if (n < 0 || static_cast<size_t>(n) != out_size)
        throw DecodeError{"damaged LZ4_RAW data, or not the page's size"};
      return;
    }
    default:
      throw DecodeError{std::string("codec ") + codec_name(codec)};
  }
}

// ---- the footer -----------------------------------------------------------------------------

struct SchemaElement {
  int32_t type = -1;
  int32_t repetition = kRequired;
  std::string name;
  int32_t children = 0;
};

struct ChunkMeta {
  std::string path;  // path_in_schema joined by '.'
  int32_t type = -1, codec = -1;
  int64_t values = -1, compressed = -1, data_offset = -1, dictionary_offset = -1;
  bool elsewhere = false;  // file_path: its pages in another file
  bool encrypted = false;
};

struct RowGroupMeta {
  std::vector<ChunkMeta> chunks;
  int64_t rows = -1;
};

struct FileMeta {
  std::vector<SchemaElement> schema;
  std::vector<RowGroupMeta> row_groups;
  int64_t rows = -1;
};

ChunkMeta read_chunk(Thrift& t) {
  ChunkMeta c;
  t.fields([&](int64_t id, int type) {
    if (id == 1) {
      t.binary(type);
      c.elsewhere = true;
    } else if (id == 3) {  // ColumnMetaData
      t.fields([&](int64_t mid, int mtype) {
        switch (mid) {
          case 1:
            c.type = t.i32(mtype);
            break;
          case 3:
            t.elements(mtype, [&](int element) {
              if (!c.path.empty()) c.path += '.';
              c.path += t.binary(element);
            });
            break;
          case 4:
            c.codec = t.i32(mtype);
            break;
          case 5:
            c.values = t.integer(mtype);
            break;
          case 7:
            c.compressed = t.integer(mtype);
            break;
          case 9:
            c.data_offset = t.integer(mtype);
            break;
          case 11:
            c.dictionary_offset = t.integer(mtype);
            break;
          default:
            t.skip(mtype);
        }
      });
    } else if (id == 8 || id == 9) {  // crypto_metadata, encrypted_column_metadata
      c.encrypted = true;
      t.skip(type);
    } else {
      t.skip(type);
    }
  });
  return c;
}

FileMeta read_footer(Thrift& t) {
  FileMeta meta;
  t.fields([&](int64_t id, int type) {
    switch (id) {
      case 2:
        t.elements(type, [&](int element) {
          if (element != kStruct) throw DecodeError{"a schema element that is not a struct"};
          SchemaElement e;
          t.fields([&](int64_t sid, int stype) {
            switch (sid) {
              case 1:
                e.type = t.i32(stype);
                break;
              case 3:
                e.repetition = t.i32(stype);
                break;
              case 4:
                e.name = t.binary(stype);
                break;
              case 5:
                e.children = t.i32(stype);
                break;
              default:
                t.skip(stype);
            }
          });
          meta.schema.push_back(std::move(e));
        });
        break;
      case 3:
        meta.rows = t.integer(type);
        break;
      case 4:
        t.elements(type, [&](int element) {
          if (element != kStruct) throw DecodeError{"a row group that is not a struct"};
          RowGroupMeta g;
          t.fields([&](int64_t gid, int gtype) {
            if (gid == 1)
              t.elements(gtype, [&](int chunk) {
                if (chunk != kStruct) throw DecodeError{"a column chunk that is not a struct"};
                g.chunks.push_back(read_chunk(t));
              });
            else if (gid == 3)
              g.rows = t.integer(gtype);
            else
              t.skip(gtype);
          });
          meta.row_groups.push_back(std::move(g));
        });
        break;
      default:
        t.skip(type);
    }
  });
  return meta;
}

// A leaf column (a field of a primitive type) and its levels: an entry's definition level counts
// the optional and repeated fields on its path that are present, its repetition level the
// repeated field it repeats (0: a new row).
struct Leaf {
  std::string path;  // the names of its fields from the top, joined by '.'
  int32_t type = -1;
  int max_def = 0, max_rep = 0;
  int list_def = 0;  // the definition level of its innermost repeated field
};

// Appends the leaves of schema[i]'s subtree, depth first; returns the index after the subtree.
size_t collect_leaves(const std::vector<SchemaElement>& schema, size_t i, const std::string& prefix,
                      int def, int rep, int list_def, std::vector<Leaf>& leaves, int depth = 0) {
  if (depth > 64) throw DecodeError{"a schema nested over 64 deep"};
  const SchemaElement& e = schema[i];
  if (e.children < 0) throw DecodeError{"a negative number of schema children"};
  if (e.repetition < kRequired || e.repetition > kRepeated)
    throw DecodeError{"a field's repetition is not REQUIRED, OPTIONAL or REPEATED"};
  def += e.repetition != kRequired ? 1 : 0;
  if (e.repetition == kRepeated) {
    ++rep;
    list_def = def;
  }
  const std::string path = prefix.empty() ? e.name : prefix + "." + e.name;
  ++i;
  if (e.children == 0) {
    leaves.push_back({path, e.type, def, rep, list_def});
    return i;
  }
  for (int32_t k = 0; k < e.children; ++k) {
    if (i >= schema.size()) throw DecodeError{"schema children past its end"};
    i = collect_leaves(schema, i, path, def, rep, list_def, leaves, depth + 1);
  }
  return i;
}

// The bits a level up to `max` takes.
int bit_width(int max) {
  int bits = 0;
  while ((max >> bits) != 0) ++bits;
  return bits;
}

struct PageHeader {
  int32_t type = -1, uncompressed = -1, compressed = -1;
  bool has_crc = false;
  uint32_t crc = 0;
  int32_t values = -1, encoding = -1, level_encoding = kRle;  // data page v1 / v2, dictionary
  int32_t level_bytes = 0, repetition_bytes = 0;              // v2
  bool values_compressed = true;                              // v2
};

PageHeader read_page_header(Thrift& t) {
  PageHeader h;
  t.fields([&](int64_t id, int type) {
    switch (id) {
      case 1:
        h.type = t.i32(type);
        break;
      case 2:
        h.uncompressed = t.i32(type);
        break;
      case 3:
        h.compressed = t.i32(type);
        break;
      case 4:
        h.has_crc = true;
        h.crc = static_cast<uint32_t>(t.i32(type));
        break;
      case 5:  // DataPageHeader
        t.fields([&](int64_t did, int dtype) {
          if (did == 1)
            h.values = t.i32(dtype);
          else if (did == 2)
            h.encoding = t.i32(dtype);
          else if (did == 3)
            h.level_encoding = t.i32(dtype);
          else
            t.skip(dtype);
        });
        break;
      case 7:  // DictionaryPageHeader
        t.fields([&](int64_t did, int dtype) {
          if (did == 1)
            h.values = t.i32(dtype);
          else if (did == 2)
            h.encoding = t.i32(dtype);
          else
            t.skip(dtype);
        });
        break;
      case 8:  // DataPageHeaderV2
        t.fields([&](int64_t did, int dtype) {
          switch (did) {
            case 1:
              h.values = t.i32(dtype);
              break;
            case 4:
              h.encoding = t.i32(dtype);
              break;
            case 5:
              h.level_bytes = t.i32(dtype);
              break;
            case 6:
              h.repetition_bytes = t.i32(dtype);
              break;
            case 7:
              h.values_compressed = t.boolean(dtype);
              break;
            default:
              t.skip(dtype);
          }
        });
        break;
      default:
        t.skip(type);
    }
  });
  if (h.uncompressed < 0 || h.compressed < 0) throw DecodeError{"a page header without its sizes"};
  return h;
}

}  // namespace

bool is_parquet(std::string_view path) {
  return path.ends_with(".parquet");
}

struct ParquetColumnReader::ColumnChunk {
  int32_t codec = kUncompressed;
  int64_t rows = 0, values = 0;  // values: its entries, nulls and lists' elements included
  int64_t begin = 0, end = 0;  // its pages' bytes in the file
};

struct ParquetColumnReader::Page {
  int64_t values_left = 0;  // entries left, nulls included
  int32_t encoding = kPlain;
  RleDecoder levels;       // definition levels: max_def_ a value, less a null (of some field)
  RleDecoder repetitions;  // repetition levels (list columns): 0 a row's first entry
  const uint8_t* data = nullptr;  // PLAIN values; the delta encodings' bytes
  const uint8_t* data_end = nullptr;
  RleDecoder indices;              // dictionary encodings
  DeltaDecoder lengths, prefixes;  // the delta encodings
  std::string previous;            // DELTA_BYTE_ARRAY's last value
};

namespace {

// The footer of a mapped Parquet file: its metadata, its leaves, the names of its top-level
// columns, and where the footer starts.
struct Footer {
  FileMeta meta;
  std::vector<Leaf> leaves;
  std::vector<std::string> top_level;
  int64_t begin = 0;
};

Footer read_parquet_footer(const uint8_t* file, size_t size, const std::string& path) {
  // A Parquet file: "PAR1", the column chunks, the footer's metadata, its length, "PAR1".
  const auto not_parquet = [&](const char* why) {
    fail("input file '", path, "': not a Parquet file (", why, ")");
  };
  if (size < 12) not_parquet("shorter than its magic numbers and footer length");
  if (std::memcmp(file + size - 4, "PARE", 4) == 0)
    fail("input file '", path, "': an encrypted Parquet file (not read)");
  if (std::memcmp(file, "PAR1", 4) != 0 || std::memcmp(file + size - 4, "PAR1", 4) != 0)
    not_parquet("no PAR1 at its start and end");
  const uint32_t footer_size = little_u32(file + size - 8);
  if (footer_size > size - 12) not_parquet("its footer's length is past its start");
  Footer footer;
  footer.begin = static_cast<int64_t>(size - 8 - footer_size);
  try {
    Thrift t(file + footer.begin, file + size - 8);
    footer.meta = read_footer(t);
    const std::vector<SchemaElement>& schema = footer.meta.schema;
    if (schema.empty()) throw DecodeError{"no schema"};
    // The top-level fields are the root's children, each followed by its own subtree.
    size_t i = 1;
    for (int32_t k = 0; k < schema[0].children; ++k) {
      if (i >= schema.size()) throw DecodeError{"schema children past its end"};
      footer.top_level.push_back(schema[i].name);
      i = collect_leaves(schema, i, "", 0, 0, 0, footer.leaves);
    }
  } catch (const DecodeError& d) {
    fail("input file '", path, "': damaged Parquet footer (", d.why, ")");
  }
  return footer;
}

}  // namespace

void ParquetColumnReader::map(const std::string& path, Mapping& mapping) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("input file '", path, "': cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail("input file '", path, "': cannot stat: ", std::strerror(errno));
  }
  mapping.size = static_cast<size_t>(st.st_size);
  if (mapping.size > 0) {
    void* data = ::mmap(nullptr, mapping.size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (data == MAP_FAILED) {
      ::close(fd);
      fail("input file '", path, "': cannot map: ", std::strerror(errno));
    }
    mapping.data = static_cast<const uint8_t*>(data);
    ::madvise(data, mapping.size, MADV_SEQUENTIAL);
  }
  ::close(fd);
}

std::vector<ParquetColumnReader::Column> ParquetColumnReader::columns(const std::string& path) {
  Mapping mapping;
  map(path, mapping);
  std::vector<Column> columns;
  for (const Leaf& leaf : read_parquet_footer(mapping.data, mapping.size, path).leaves)
    columns.push_back({leaf.path, leaf.type == kByteArray, leaf.max_rep});
  return columns;
}

ParquetColumnReader::ParquetColumnReader(std::string path, std::string column, bool list)
    : path_(std::move(path)), column_(std::move(column)), list_(list) {
  map(path_, file_);
  page_ = std::make_unique<Page>();
  const Footer footer = read_parquet_footer(file_.data, file_.size, path_);
  const FileMeta& meta = footer.meta;
  const Leaf* leaf = nullptr;
  for (const Leaf& l : footer.leaves)
    if (l.path == column_) leaf = &l;
  const auto refuse = [&](const auto&... why) {
    fail("input file '", path_, "': column '", column_, "' ", why...);
  };
  if (leaf == nullptr) {
    for (const std::string& name : footer.top_level)
      if (name == column_)
        refuse("is a group of columns (a struct or a list), not ",
               list ? "a list of strings" : "a string");
    std::string names;
    for (const std::string& name : footer.top_level) names += (names.empty() ? "" : ", ") + name;
    fail("input file '", path_, "': no column '", column_, "' (its columns: ", names,
         "; --json-key names the text column)");
  }
  if (leaf->type != kByteArray)
    refuse("holds ", type_name(leaf->type), ", not strings (BYTE_ARRAY)");
  if (!list && leaf->max_rep > 0) refuse("is repeated (a list), not a string");
  if (list && leaf->max_rep != 1) refuse("is not in a list (or in lists of lists)");
  max_def_ = leaf->max_def;
  max_rep_ = leaf->max_rep;
  list_def_ = leaf->list_def;

  // The column's chunk in each row group: its pages' bytes, codec, rows and entries.
  int64_t rows = 0;
  for (size_t g = 0; g < meta.row_groups.size(); ++g) {
    const RowGroupMeta& group = meta.row_groups[g];
    const ChunkMeta* chunk = nullptr;
    for (const ChunkMeta& c : group.chunks)
      if (c.path == column_) chunk = &c;
    const auto bad = [&](const auto&... why) {
      fail("input file '", path_, "': column '", column_, "': row group ", g, ": ", why...);
    };
    if (chunk == nullptr) bad("no chunk of the column (damaged footer)");
    if (group.rows == 0 && chunk->values == 0) continue;  // writers leave its offsets unset
    if (chunk->elsewhere) bad("its pages are in another file (file_path), not read");
    if (chunk->encrypted) bad("encrypted, not read");
    if (chunk->type != kByteArray) bad("a chunk of ", type_name(chunk->type), ", not BYTE_ARRAY");
    if (chunk->codec < 0 || chunk->codec > kLz4Raw || chunk->codec == kLzo)
      bad("compressed with ", codec_name(chunk->codec), ", which is not read (UNCOMPRESSED, ",
          "SNAPPY, GZIP, BROTLI, LZ4, ZSTD and LZ4_RAW are)");
    // A row is an entry, or in a list column one or more.
    if (group.rows < 0 || chunk->values < group.rows ||
        (max_rep_ == 0 && chunk->values != group.rows))
      bad(chunk->values, " values for ", group.rows, " rows (damaged footer)");
    ColumnChunk c;
    c.codec = chunk->codec;
    c.rows = group.rows;
    c.values = chunk->values;
    c.begin = chunk->dictionary_offset > 0 &&
                      (chunk->data_offset <= 0 || chunk->dictionary_offset < chunk->data_offset)
                  ? chunk->dictionary_offset
                  : chunk->data_offset;
    if (c.begin < 4 || chunk->compressed < 0 || chunk->compressed > footer.begin - c.begin)
      bad("its pages' bytes are not between the file's magic number and its footer");
    c.end = c.begin + chunk->compressed;
    rows += c.rows;
    chunks_.push_back(c);
  }
  if (meta.rows != rows)
    fail("input file '", path_, "': damaged Parquet footer (", meta.rows, " rows, its row groups ",
         "hold ", rows, ")");
  rows_ = rows;
}

ParquetColumnReader::~ParquetColumnReader() = default;

ParquetColumnReader::Mapping::~Mapping() {
  if (data != nullptr) ::munmap(const_cast<uint8_t*>(data), size);
}

void ParquetColumnReader::release_before(const uint8_t* at) {
  // The pages before `at` are read (values are copied out; a dictionary is kept as a copy), so
  // their memory goes back: a file read a page at a time holds a page or two, not the whole file
  // that the mapping has touched (its pages come back from the page cache if read again).
  constexpr size_t kPage = 4096;
  const auto end = static_cast<size_t>(at - file_.data) / kPage * kPage;
  if (end > released_) {
    ::madvise(const_cast<uint8_t*>(file_.data) + released_, end - released_, MADV_DONTNEED);
    released_ = end;
  }
}

void ParquetColumnReader::damaged(const std::string& why) const {
  fail("input file '", path_, "': column '", column_, "', row ", row_, ": damaged Parquet data (",
       why, ")");
}

const uint8_t* ParquetColumnReader::page_bytes(const uint8_t* compressed, size_t compressed_size,
                                               size_t uncompressed_size) {
  const int32_t codec = chunks_[chunk_ - 1].codec;
  if (codec == kUncompressed) {
    if (compressed_size != uncompressed_size)
      throw DecodeError{"an uncompressed page whose two sizes differ"};
    return compressed;
  }
  // Writers cut pages at about 1 MiB (a page holds at least one whole value); a size read from the
  // file is checked before it is allocated.
  constexpr size_t kMaxPageBytes = size_t{512} << 20;
  if (uncompressed_size > kMaxPageBytes)
    throw DecodeError{"a page of " + std::to_string(uncompressed_size) +
                      " bytes, over the 512 MiB this reader takes"};
  if (uncompressed_size > scratch_capacity_) {
    scratch_.reset(new char[uncompressed_size]);  // not zeroed: the codec writes every byte
    scratch_capacity_ = uncompressed_size;
  }
  decompress(codec, compressed, compressed_size, scratch_.get(), uncompressed_size);
  return reinterpret_cast<const uint8_t*>(scratch_.get());
}

void ParquetColumnReader::load_dictionary(const uint8_t* data, size_t size, int32_t count,
                                          int encoding) {
  if (encoding != kPlain && encoding != kPlainDictionary)
    throw DecodeError{"a dictionary page not PLAIN-encoded"};
  if (count < 0 || static_cast<uint64_t>(count) > size / 4)
    throw DecodeError{"a dictionary of more entries than its bytes hold"};
  dictionary_data_.reset(new char[size]);
  if (size > 0) std::memcpy(dictionary_data_.get(), data, size);
  dictionary_.clear();
  dictionary_.reserve(static_cast<size_t>(count));
  const char* p = dictionary_data_.get();
  const char* end = p + size;
  for (int32_t i = 0; i < count; ++i) {
    if (end - p < 4) throw DecodeError{"a dictionary entry past the page's end"};
    const uint32_t n = little_u32(reinterpret_cast<const uint8_t*>(p));
    if (n > static_cast<size_t>(end - p - 4))
      throw DecodeError{"a dictionary entry past the page's end"};
    dictionary_.emplace_back(p + 4, n);
    p += 4 + n;
  }
}

bool ParquetColumnReader::next_page() {
  for (;;) {
    if (chunk_values_left_ == 0) {  // the next row group's chunk
      if (chunk_ > 0 && chunk_rows_ != chunks_[chunk_ - 1].rows)
        damaged("a row group's entries hold " + std::to_string(chunk_rows_) + " rows, not its " +
                std::to_string(chunks_[chunk_ - 1].rows));
      if (chunk_ == chunks_.size()) return false;
      const ColumnChunk& c = chunks_[chunk_++];
      at_ = file_.data + c.begin;
      chunk_end_ = file_.data + c.end;
      chunk_values_left_ = c.values;
      chunk_rows_ = 0;
      dictionary_.clear();
      has_dictionary_ = false;
      continue;
    }
    if (at_ == chunk_end_)
      damaged("the column's chunk ends before its rows (" + std::to_string(chunk_values_left_) +
              " left)");
    release_before(at_);
    PageHeader h;
    const uint8_t* body = nullptr;
    try {
      Thrift t(at_, chunk_end_);
      h = read_page_header(t);
      body = t.position();
    } catch (const DecodeError& d) {
      damaged("a page header: " + d.why);
    }
    if (h.compressed > chunk_end_ - body) damaged("a page past the end of its chunk");
    const auto compressed = static_cast<size_t>(h.compressed);
    const auto uncompressed = static_cast<size_t>(h.uncompressed);
    at_ = body + compressed;
    if (h.has_crc && static_cast<uint32_t>(crc32(0, body, static_cast<uInt>(compressed))) != h.crc)
      damaged("a page's CRC-32 does not match its bytes");
    try {
      if (h.type == kDictionaryPage) {
        load_dictionary(page_bytes(body, compressed, uncompressed), uncompressed, h.values,
                        h.encoding);
        has_dictionary_ = true;
        continue;
      }
      if (h.type != kDataPage && h.type != kDataPageV2) continue;  // an index page: skipped
      if (h.values < 0 || h.values > chunk_values_left_)
        throw DecodeError{"a data page of more values than its chunk's rows"};
      Page& page = *page_;
      const uint8_t* data = nullptr;
      const uint8_t* end = nullptr;
      if (h.type == kDataPage) {  // levels and values compressed together
        data = page_bytes(body, compressed, uncompressed);
        end = data + uncompressed;
        // Each kind of levels: its byte length, then its RLE / bit-packed runs.
        const auto levels = [&](int max, RleDecoder& decoder) {
          if (max == 0) return;
          if (h.level_encoding != kRle)
            throw DecodeError{"levels not RLE-encoded (BIT_PACKED is not read)"};
          if (end - data < 4) throw DecodeError{"levels past the page's end"};
          const uint32_t n = little_u32(data);
          if (n > static_cast<size_t>(end - data - 4))
            throw DecodeError{"levels past the page's end"};
          decoder = RleDecoder(data + 4, data + 4 + n, bit_width(max));
          data += 4 + n;
        };
        levels(max_rep_, page.repetitions);
        levels(max_def_, page.levels);
      } else {  // v2: the levels uncompressed, then the values, compressed or not
        if (h.repetition_bytes < 0 || h.level_bytes < 0 ||
            static_cast<size_t>(h.repetition_bytes) + static_cast<size_t>(h.level_bytes) >
                std::min(compressed, uncompressed))
          throw DecodeError{"levels past the page's end"};
        const auto repetitions = static_cast<size_t>(h.repetition_bytes);
        const auto definitions = static_cast<size_t>(h.level_bytes);
        if ((max_rep_ == 0 && repetitions != 0) || (max_def_ == 0 && definitions != 0))
          throw DecodeError{"levels in a page of a column that has none"};
        if (max_rep_ > 0)
          page.repetitions = RleDecoder(body, body + repetitions, bit_width(max_rep_));
        if (max_def_ > 0)
          page.levels =
              RleDecoder(body + repetitions, body + repetitions + definitions, bit_width(max_def_));
        const size_t levels = repetitions + definitions;
        data = h.values_compressed
                   ? page_bytes(body + levels, compressed - levels, uncompressed - levels)
                   : body + levels;
        if (!h.values_compressed && compressed != uncompressed)
          throw DecodeError{"an uncompressed page whose two sizes differ"};
        end = data + (uncompressed - levels);
      }
      page.encoding = h.encoding;
      page.data = data;
      page.data_end = end;
      switch (h.encoding) {
        case kPlain:
          break;
        case kPlainDictionary:
        case kRleDictionary:
          if (!has_dictionary_) throw DecodeError{"dictionary-coded values without a dictionary"};
          if (data == end) throw DecodeError{"dictionary indices without their bit width"};
          page.indices = RleDecoder(data + 1, end, data[0]);
          break;
        case kDeltaLengthByteArray:
          page.lengths = DeltaDecoder(data, end);
          page.data = page.lengths.end_of_values();
          break;
        case kDeltaByteArray:
          page.prefixes = DeltaDecoder(data, end);
          page.lengths = DeltaDecoder(page.prefixes.end_of_values(), end);
          page.data = page.lengths.end_of_values();
          page.previous.clear();
          break;
        default:
          throw DecodeError{"values in encoding " + std::to_string(h.encoding) +
                            ", which is not read for strings"};
      }
      page.values_left = h.values;
      chunk_values_left_ -= h.values;
      if (h.values > 0) return true;
    } catch (const DecodeError& d) {
      damaged(d.why);
    }
  }
}

bool ParquetColumnReader::next_entry(Entry& entry) {
  while (page_->values_left == 0)
    if (!next_page()) return false;
  Page& page = *page_;
  --page.values_left;
  try {
    entry.repetition = max_rep_ > 0 ? static_cast<int>(page.repetitions.next()) : 0;
    entry.definition = max_def_ > 0 ? static_cast<int>(page.levels.next()) : 0;
    if (entry.repetition > max_rep_ || entry.definition > max_def_)
      throw DecodeError{"a level past its column's most"};
    if (entry.repetition == 0) {
      ++chunk_rows_;
    } else if (chunk_rows_ == 0) {
      throw DecodeError{"a row group's first entry continues a row"};
    }
    std::string& value = entry.value;
    if (entry.definition < max_def_) {  // a null: the string's, or a field's above it
      value.clear();
      return true;
    }
    const auto take = [&](uint64_t n) {
      if (n > static_cast<uint64_t>(page.data_end - page.data))
        throw DecodeError{"a string past the page's end"};
      const auto* p = reinterpret_cast<const char*>(page.data);
      page.data += n;
      return std::string_view(p, n);
    };
    switch (page.encoding) {
      case kPlain: {
        if (page.data_end - page.data < 4) throw DecodeError{"a string past the page's end"};
        const uint32_t n = little_u32(page.data);
        page.data += 4;
        value.assign(take(n));
        break;
      }
      case kPlainDictionary:
      case kRleDictionary: {
        const uint32_t index = page.indices.next();
        if (index >= dictionary_.size()) throw DecodeError{"a dictionary index past its end"};
        value.assign(dictionary_[index]);
        break;
      }
      case kDeltaLengthByteArray: {
        const int64_t n = page.lengths.next();
        if (n < 0) throw DecodeError{"a negative string length"};
        value.assign(take(static_cast<uint64_t>(n)));
        break;
      }
      default: {  // kDeltaByteArray: a prefix of the previous value, then a suffix
        const int64_t prefix = page.prefixes.next();
        const int64_t n = page.lengths.next();
        if (prefix < 0 || static_cast<uint64_t>(prefix) > page.previous.size() || n < 0)
          throw DecodeError{"a prefix longer than the previous string, or a negative length"};
        page.previous.resize(static_cast<size_t>(prefix));
        page.previous.append(take(static_cast<uint64_t>(n)));
        value = page.previous;
      }
    }
  } catch (const DecodeError& d) {
    damaged(d.why);
  }
  return true;
}

ParquetColumnReader::Next ParquetColumnReader::next(std::string& value) {
  LOOM_CHECK(!list_);
  if (!next_entry(pending_)) {
    value.clear();
    return Next::end;
  }
  ++row_;
  value.swap(pending_.value);
  return pending_.definition == max_def_ ? Next::value : Next::null;
}

ParquetColumnReader::Next ParquetColumnReader::next_list(
    std::vector<std::optional<std::string>>& items) {
  LOOM_CHECK(list_);
  items.clear();
  // pending_ holds the row's first entry once a row has been read: it ended the row before.
  if (!has_pending_ && !next_entry(pending_)) return Next::end;
  has_pending_ = false;
  ++row_;
  // Below the list's definition level an entry holds no element: one level below, an empty
  // list; further, a null list (or a null field above it).
  const Next got = pending_.definition >= list_def_ - 1 ? Next::value : Next::null;
  bool element = pending_.definition >= list_def_;
  for (;;) {
    if (element) {
      if (pending_.definition == max_def_)
        items.emplace_back(std::move(pending_.value));
      else
        items.emplace_back();  // a null element, or a null string in it
    }
    if (!next_entry(pending_)) break;
    if (pending_.repetition == 0) {  // the next row's
      has_pending_ = true;
      break;
    }
    if (!element) damaged("a list's element after an empty or null list");
    // A row's list is held whole; a file may declare billions of elements in a few bytes.
    if (items.size() >= (size_t{1} << 20))
      fail("input file '", path_, "': column '", column_, "', row ", row_,
           ": a list of over 1048576 elements (not read)");
    element = pending_.definition >= list_def_;
    if (!element) damaged("an empty or null list inside a list");
  }
  return got;
}

}  // namespace loom
