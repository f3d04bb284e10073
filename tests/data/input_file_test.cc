// InputFile and LineReader: plain, gzip and zstd files read as the same bytes; several members
// or frames as their concatenation; damaged, truncated or trailing data named, never short text.
#include "data/input_file.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "compress.h"
#include "tensor/rng.h"
#include "test_files.h"

namespace loom {
namespace {

using testing::expect_error;
using testing::gzip;
using testing::TempDir;
using testing::write_bytes;
using testing::zstd;

// Text of `bytes` bytes that compresses poorly, so the compressed file spans several of the
// reader's 1 MiB buffers: random lowercase words and newlines.
std::string random_text(size_t bytes, uint64_t seed) {
  RandomStream rng(seed, "input_file_test");
  std::string text;
  text.reserve(bytes);
  while (text.size() < bytes) {
    const uint32_t r = rng.next_u32();
    text += r % 17 == 0 ? '\n' : r % 7 == 0 ? ' ' : static_cast<char>('a' + (r >> 8) % 26);
  }
  return text;
}

// Every line of `path` as LineReader returns it, and its numbers.
std::vector<std::string> lines_of(const std::string& path) {
  LineReader reader(path);
  std::vector<std::string> lines;
  std::string line;
  while (reader.next(line)) {
    lines.push_back(line);
    EXPECT_EQ(reader.line_number(), static_cast<int64_t>(lines.size()));
  }
  EXPECT_FALSE(reader.next(line));  // and stays at the end
  return lines;
}

TEST(InputFile, NamesSayTheCompressionAndTheFormat) {
  EXPECT_EQ(compression_of("a.txt"), Compression::none);
  EXPECT_EQ(compression_of("a.jsonl.gz"), Compression::gzip);
  EXPECT_EQ(compression_of("a.jsonl.zst"), Compression::zstd);
  EXPECT_EQ(compression_of("a.zstd"), Compression::zstd);
  EXPECT_EQ(compression_of("gz"), Compression::none);
  EXPECT_TRUE(is_json_lines("a.jsonl"));
  EXPECT_TRUE(is_json_lines("c4-train.00001-of-01024.json.gz"));
  EXPECT_TRUE(is_json_lines("pile/00.jsonl.zst"));
  EXPECT_TRUE(is_json_lines("x.ndjson"));
  EXPECT_FALSE(is_json_lines("a.txt.gz"));
  EXPECT_FALSE(is_json_lines("jsonl.txt"));
  EXPECT_FALSE(is_json_lines("a.jsonl.bz2"));  // not a compression Loom reads: not JSON Lines
}

TEST(InputFile, CompressedFilesReadAsThePlainOne) {
  TempDir dir;
  const std::string text = random_text(3'500'000, 1);  // several buffers either side
  write_bytes(dir.file("t.txt"), text);
  write_bytes(dir.file("t.txt.gz"), gzip(text));
  write_bytes(dir.file("t.txt.zst"), zstd(text));
  // Several members / frames, one of them empty, read as their concatenation (as zcat does).
  const std::string a = text.substr(0, 1'000'001), b = text.substr(1'000'001);
  write_bytes(dir.file("m.txt.gz"), gzip(a) + gzip("") + gzip(b, 1));
  write_bytes(dir.file("m.txt.zst"), zstd(a) + zstd("") + zstd(b, 12));
  for (const char* name : {"t.txt", "t.txt.gz", "t.txt.zst", "m.txt.gz", "m.txt.zst"}) {
    SCOPED_TRACE(name);
    EXPECT_EQ(read_input_file(dir.file(name)), text);
    // Small reads give the same bytes as large ones.
    InputFile file(dir.file(name));
    std::string got;
    char block[7];
    while (const size_t n = file.read(block, sizeof(block))) got.append(block, n);
    EXPECT_EQ(got, text);
    EXPECT_EQ(file.read(block, sizeof(block)), 0u);
  }
  // Empty content: a plain empty file, or a compressed empty text.
  write_bytes(dir.file("e.txt"), "");
  write_bytes(dir.file("e.txt.gz"), gzip(""));
  write_bytes(dir.file("e.txt.zst"), zstd(""));
  for (const char* name : {"e.txt", "e.txt.gz", "e.txt.zst"})
    EXPECT_EQ(read_input_file(dir.file(name)), "") << name;
}

TEST(InputFile, DamagedTruncatedOrTrailingDataIsNamed) {
  TempDir dir;
  const std::string text = random_text(300'000, 2);
  const std::string gz = gzip(text), zs = zstd(text);
  const auto expect_named = [&](const std::string& name, const std::string& bytes,
                                std::initializer_list<std::string> words) {
    SCOPED_TRACE(name);
    const std::string path = dir.file(name);
    write_bytes(path, bytes);
    expect_error([&] { read_input_file(path); }, {path});
    for (const std::string& word : words) expect_error([&] { read_input_file(path); }, {word});
  };
  // Cut anywhere: the end of the data is missing, never a shorter text.
  for (const size_t keep : {size_t{5}, gz.size() / 2, gz.size() - 1})
    expect_named("cut.gz", gz.substr(0, keep), {"gzip", "ends early"});
  for (const size_t keep : {size_t{3}, zs.size() / 2, zs.size() - 1})
    expect_named("cut.zst", zs.substr(0, keep), {"zstd"});
  std::string flipped = gz;
  flipped[gz.size() - 6] ^= 0x40;  // the CRC-32 of the content
  expect_named("crc.gz", flipped, {"damaged gzip data"});
  expect_named("plain.gz", text, {"damaged gzip data"});
  expect_named("plain.zst", text, {"damaged zstd data"});
  expect_named("empty.gz", "", {"empty, not gzip data"});
  expect_named("empty.zst", "", {"empty, not zstd data"});
  expect_named("tail.gz", gz + "garbage!", {"not gzip after its gzip data", "1 member"});
  expect_named("tail.zst", zs + "garbage!", {"damaged zstd data"});
  // A zstd frame that declares 5 bytes and holds an empty last block: libzstd refuses it when
  // the frame comes whole, but passes it fed a few bytes at a time; InputFile counts itself.
  // A frame of zstd 0.7 (magic 0xFD2FB527): libzstd's old decoders, like the short frame, pass
  // damaged frames fed piecemeal; refused by their magic number, whole or not.
  write_bytes(dir.file("short.zst"), std::string("\x28\xb5\x2f\xfd\x20\x05\x01\x00\x00", 9));
  write_bytes(dir.file("v07.zst"), std::string("\x27\xb5\x2f\xfd\x00\x00\xd7\x00\x95", 9));
  // (Whole, libzstd names the damage; piecemeal, InputFile does.)
  for (const char* name : {"short.zst", "v07.zst"})
    for (const size_t buffer : {size_t{1}, size_t{4}, size_t{1} << 20})
      expect_error(
          [&] {
            InputFile file(dir.file(name), buffer);
            char block[16];
            while (file.read(block, sizeof(block)) > 0) {
            }
          },
          {dir.file(name), "zstd data ("});
  expect_error([&] { InputFile file(dir.file("missing.gz")); },
               {dir.file("missing.gz"), "cannot open"});
}

TEST(LineReader, LinesAcrossBuffersAndTheLastOneWithoutANewline) {
  TempDir dir;
  // Lines longer than the 1 MiB buffer, empty lines, \r\n kept as written, no final newline.
  const std::string long_line(2'500'000, 'x');
  const std::vector<std::string> want{"first", "", long_line, "with cr\r", "", "last"};
  std::string text;
  for (size_t i = 0; i < want.size(); ++i) text += want[i] + (i + 1 < want.size() ? "\n" : "");
  write_bytes(dir.file("l.txt"), text);
  write_bytes(dir.file("l.jsonl.zst"), zstd(text));
  write_bytes(dir.file("n.txt.gz"), gzip(text + "\n"));  // with the final newline: the same lines
  for (const char* name : {"l.txt", "l.jsonl.zst", "n.txt.gz"})
    EXPECT_EQ(lines_of(dir.file(name)), want) << name;
  write_bytes(dir.file("empty.txt"), "");
  EXPECT_TRUE(lines_of(dir.file("empty.txt")).empty());
  write_bytes(dir.file("one.txt"), "\n");
  EXPECT_EQ(lines_of(dir.file("one.txt")), std::vector<std::string>{""});
}

}  // namespace
}  // namespace loom
