#include "checkpoint/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "harness/error_of.h"

namespace loom {
namespace {

using testutil::error_of;

namespace fs = std::filesystem;

::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\"\ndoes not contain \"" << part << "\"";
}

// A path under the test temp dir, unique per test and process; removed (with its .tmp) at the end.
class TempPath {
 public:
  explicit TempPath(const std::string& tag = "") {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = (fs::path(::testing::TempDir()) / (std::string("loom_st_") + info->name() + tag + "_" +
                                               std::to_string(::getpid()) + ".safetensors"))
                .string();
  }
  ~TempPath() {
    std::error_code ec;
    fs::remove(path_, ec);
    fs::remove(path_ + ".tmp", ec);
  }
  const std::string& str() const { return path_; }

 private:
  std::string path_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A file as the format lays it out: u64 LE header length, header, data.
std::string file_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(uint64_t{header.size()} >> (8 * i));
  return out + header + data;
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

// A tensor whose bytes are an arbitrary pattern (NaN payloads, denormals and all), so equality
// after a round trip is bitwise, not numeric.
Tensor patterned(const Shape& shape, DType dtype, uint8_t seed) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* bytes = static_cast<uint8_t*>(t.raw());
  for (size_t i = 0; i < t.nbytes(); ++i) bytes[i] = static_cast<uint8_t>(seed + 37 * i + i / 7);
  return t;
}

void expect_same(const Tensor& a, const Tensor& b, const std::string& name) {
  ASSERT_TRUE(b.defined()) << name;
  EXPECT_EQ(a.dtype(), b.dtype()) << name;
  EXPECT_EQ(a.shape(), b.shape()) << name;
  ASSERT_EQ(a.nbytes(), b.nbytes()) << name;
  if (a.nbytes() > 0) {
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << name;
  }
}

TEST(Safetensors, RoundTripsEveryDTypeBitwise) {
  const std::vector<std::pair<std::string, Tensor>> tensors = {
      {"blocks.0.attn.qkv.weight", patterned({3, 5}, DType::kF32, 1)},
      {"f64", patterned({4}, DType::kF64, 2)},
      {"bf16", patterned({3}, DType::kBF16, 3)},  // 6 bytes, before wider dtypes
      {"f16", patterned({2, 2}, DType::kF16, 4)},
      {"i32", patterned({5}, DType::kI32, 5)},
      {"i64", patterned({2, 1}, DType::kI64, 6)},
      {"scalar", patterned({}, DType::kF32, 7)},
      {"empty", Tensor::empty({0, 4}, DType::kF32)},
      {"last", patterned({1}, DType::kBF16, 8)},
  };
  TempPath path;
  save_safetensors(path.str(), tensors);
  EXPECT_FALSE(fs::exists(path.str() + ".tmp"));

  const SafetensorsFile file = load_safetensors(path.str());
  EXPECT_TRUE(file.metadata.empty());
  ASSERT_EQ(file.names.size(), tensors.size());
  ASSERT_EQ(file.tensors.size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(file.names[i], tensors[i].first);  // file order = save order
    expect_same(tensors[i].second, file.tensors.at(tensors[i].first), tensors[i].first);
  }
  EXPECT_EQ(file.tensors.at("scalar").ndim(), 0);
  EXPECT_EQ(file.tensors.at("empty").numel(), 0);
}

// SafetensorsIndex reads the header alone and each tensor when asked, in any order: the same
// names, dtypes, shapes and bytes as load_safetensors; a missing name and a truncated file are
// named as load_safetensors names them.
TEST(Safetensors, AnIndexReadsEachTensorAsTheWholeFileDoes) {
  const std::vector<std::pair<std::string, Tensor>> tensors = {
      {"w", patterned({3, 5}, DType::kF32, 1)},   {"bf16", patterned({3}, DType::kBF16, 3)},
      {"i64", patterned({2, 1}, DType::kI64, 6)}, {"empty", Tensor::empty({0, 4}, DType::kF32)},
      {"last", patterned({7}, DType::kF16, 8)},
  };
  TempPath path;
  save_safetensors(path.str(), tensors);
  const SafetensorsFile whole = load_safetensors(path.str());
  const SafetensorsIndex index(path.str());
  EXPECT_EQ(index.names(), whole.names);
  for (auto it = tensors.rbegin(); it != tensors.rend(); ++it) {  // back to front
    ASSERT_NE(index.find(it->first), nullptr);
    EXPECT_EQ(index.find(it->first)->shape, it->second.shape());
    expect_same(it->second, index.read(it->first), it->first);
  }
  EXPECT_EQ(index.find("nope"), nullptr);
  EXPECT_NE(testutil::error_of([&] { (void)index.read("nope"); }).find("has no tensor 'nope'"),
            std::string::npos);
  // Truncated by a byte: the header's tiling no longer matches, before any tensor is read.
  fs::resize_file(path.str(), fs::file_size(path.str()) - 1);
  const std::string error = testutil::error_of([&] { SafetensorsIndex again(path.str()); });
  EXPECT_EQ(error, testutil::error_of([&] { (void)load_safetensors(path.str()); }));
  EXPECT_NE(error.find("tensor 'last': data_offsets [82, 96] are out of range for 95 bytes"),
            std::string::npos)
      << error;
}

// Data is laid out widest dtype first, so every tensor starts at a multiple of its element size
// (loaders that view mmapped bytes in place need that); the header keeps the given order.
TEST(Safetensors, DataIsAlignedAndHeaderKeepsTheGivenOrder) {
  TempPath path;
  save_safetensors(path.str(), {{"b", patterned({3}, DType::kBF16, 1)},
                                {"f", patterned({3}, DType::kF32, 2)},
                                {"h", patterned({1}, DType::kF16, 3)},
                                {"d", patterned({1}, DType::kF64, 4)},
                                {"i", patterned({1}, DType::kI32, 5)}});
  const std::string bytes = read_bytes(path.str());
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  const auto header = nlohmann::ordered_json::parse(bytes.substr(8, n));
  std::vector<std::string> keys;
  for (const auto& [name, info] : header.items()) {
    keys.push_back(name);
    const size_t elem = info["dtype"] == "F64"                             ? 8
                        : info["dtype"] == "F32" || info["dtype"] == "I32" ? 4
                                                                           : 2;
    EXPECT_EQ(info["data_offsets"][0].get<size_t>() % elem, 0u) << name;
  }
  EXPECT_EQ(keys, (std::vector<std::string>{"b", "f", "h", "d", "i"}));
  EXPECT_EQ(header["d"]["data_offsets"].dump(), "[0,8]");
  EXPECT_EQ(load_safetensors(path.str()).names, keys);
}

TEST(Safetensors, MetadataRoundTrips) {
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"step", "1200"}, {"empty", ""}, {"quote\"s", "ünïcode \\ \n"}};
  TempPath path;
  save_safetensors(path.str(), {{"x", Tensor::from_vector({1, 2}, {2})}}, metadata);
  const SafetensorsFile file = load_safetensors(path.str());
  EXPECT_EQ(file.metadata, metadata);
  EXPECT_EQ(file.tensors.at("x").to_vector(), (std::vector<float>{1, 2}));

  // No tensors at all is a valid file too.
  save_safetensors(path.str(), {}, {{"only", "metadata"}});
  const SafetensorsFile none = load_safetensors(path.str());
  EXPECT_TRUE(none.names.empty());
  EXPECT_EQ(none.metadata.at("only"), "metadata");
}

TEST(Safetensors, WritesTheExactLayout) {
  TempPath path;
  save_safetensors(path.str(), {{"x", Tensor::from_vector({1.0f, -2.0f}, {2})}},
                   {{"format", "pt"}});
  std::string header =
      R"({"__metadata__":{"format":"pt"},"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  header.append((8 - header.size() % 8) % 8, ' ');  // space-padded so data starts 8-aligned
  EXPECT_EQ(read_bytes(path.str()), file_bytes(header, from_hex("0000803f000000c0")));
}

// Bytes written by the reference implementation (Python `safetensors` 0.8.0, `serialize` with
// metadata {"format": "pt", "step": "3"}): its key order, dtype-sorted data and padding.
TEST(Safetensors, ReadsAFileWrittenByTheReferenceImplementation) {
  const std::string header = R"({"__metadata__":{"step":"3","format":"pt"},)"
                             R"("ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},)"
                             R"("empty":{"dtype":"F64","shape":[0,2],"data_offsets":[16,16]},)"
                             R"("w":{"dtype":"F32","shape":[2],"data_offsets":[16,24]},)"
                             R"("scalar":{"dtype":"I32","shape":[],"data_offsets":[24,28]},)"
                             R"("h":{"dtype":"BF16","shape":[1,3],"data_offsets":[28,34]},)"
                             R"("half":{"dtype":"F16","shape":[1],"data_offsets":[34,36]}}  )";
  ASSERT_EQ(header.size(), 392u);
  const std::string data =
      from_hex("0700000000000000ffffffffffffffff0000c03f000000c02a000000803f00c0c07f003c");
  TempPath path;
  write_bytes(path.str(), file_bytes(header, data));

  const SafetensorsFile file = load_safetensors(path.str());
  EXPECT_EQ(file.metadata, (std::map<std::string, std::string>{{"format", "pt"}, {"step", "3"}}));
  EXPECT_EQ(file.names, (std::vector<std::string>{"ids", "empty", "w", "scalar", "h", "half"}));
  const Tensor& ids = file.tensors.at("ids");
  ASSERT_EQ(ids.dtype(), DType::kI64);
  EXPECT_EQ(ids.data<int64_t>()[0], 7);
  EXPECT_EQ(ids.data<int64_t>()[1], -1);
  EXPECT_EQ(file.tensors.at("empty").shape(), (Shape{0, 2}));
  EXPECT_EQ(file.tensors.at("empty").dtype(), DType::kF64);
  EXPECT_EQ(file.tensors.at("w").to_vector(), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(file.tensors.at("scalar").shape(), Shape{});
  EXPECT_EQ(file.tensors.at("scalar").data<int32_t>()[0], 42);
  const Tensor& h = file.tensors.at("h");
  EXPECT_EQ(h.dtype(), DType::kBF16);
  EXPECT_EQ(h.shape(), (Shape{1, 3}));
  EXPECT_EQ(h.data_u16()[0], 0x3f80);  // 1.0
  EXPECT_EQ(h.data_u16()[1], 0xc000);  // -2.0
  EXPECT_EQ(h.data_u16()[2], 0x7fc0);  // NaN
  EXPECT_EQ(file.tensors.at("half").to_vector(), (std::vector<float>{1.0f}));
}

TEST(Safetensors, SaveReplacesAtomicallyAndRejectsBadInput) {
  TempPath path;
  save_safetensors(path.str(), {{"a", Tensor::from_vector({1, 2, 3}, {3})}});
  save_safetensors(path.str(), {{"b", Tensor::from_vector({4}, {1})}});  // overwrites
  EXPECT_EQ(load_safetensors(path.str()).names, std::vector<std::string>{"b"});
  EXPECT_FALSE(fs::exists(path.str() + ".tmp"));

  const Tensor t = Tensor::from_vector({1}, {1});
  std::string e = error_of([&] { save_safetensors(path.str(), {{"a", t}, {"a", t}}); });
  EXPECT_TRUE(Contains(e, path.str()));
  EXPECT_TRUE(Contains(e, "tensor 'a' is given twice"));
  e = error_of([&] { save_safetensors(path.str(), {{"__metadata__", t}}); });
  EXPECT_TRUE(Contains(e, "'__metadata__'"));
  e = error_of([&] { save_safetensors(path.str(), {{"u", Tensor()}}); });
  EXPECT_TRUE(Contains(e, "tensor 'u' is undefined"));
  e = error_of([&] { save_safetensors(path.str(), {{"bad\xff", t}}); });  // not UTF-8
  EXPECT_TRUE(Contains(e, "cannot write header"));
  // A failed save leaves the previous file untouched.
  EXPECT_EQ(load_safetensors(path.str()).names, std::vector<std::string>{"b"});

  e = error_of([&] { save_safetensors("/nonexistent/dir/model.safetensors", {{"a", t}}); });
  EXPECT_TRUE(Contains(e, "/nonexistent/dir/model.safetensors.tmp"));
  EXPECT_TRUE(Contains(e, "cannot open"));
}

// Each corrupt file gives an error naming the file and, where there is one, the tensor.
TEST(Safetensors, CorruptFilesAreReportedWithTheFileName) {
  TempPath path;
  auto load_error = [&](const std::string& bytes) {
    write_bytes(path.str(), bytes);
    return error_of([&] { load_safetensors(path.str()); });
  };
  auto expect_error = [&](const std::string& bytes, const std::string& part) {
    const std::string e = load_error(bytes);
    EXPECT_TRUE(Contains(e, "safetensors file '" + path.str() + "'"));
    EXPECT_TRUE(Contains(e, part));
  };
  const std::string data8(8, '\0');

  std::string e = error_of([] { load_safetensors("/nonexistent/model.safetensors"); });
  EXPECT_TRUE(Contains(e, "'/nonexistent/model.safetensors'"));
  EXPECT_TRUE(Contains(e, "does not exist"));

  expect_error("abc", "too short");
  expect_error(file_bytes("{}", "").substr(0, 8) + "{", "header length 2 exceeds the 1 bytes");
  expect_error(std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}", "header length");
  expect_error(file_bytes("{\"x\": ", ""), "invalid JSON header");
  expect_error(file_bytes("[1, 2]", ""), "not a JSON object");
  expect_error(file_bytes(R"({"x":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})", data8),
               "tensor 'x' has dtype \"U8\"");
  expect_error(file_bytes(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", data8),
               "tensor 'x': data_offsets [0, 16] are out of range for 8 bytes of data");
  expect_error(file_bytes(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8),
               "tensor 'x': data_offsets [0, 8] hold 8 bytes, but shape [3] of F32 needs 12");
  expect_error(file_bytes(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", data8),
               "tensor 'x': data_offsets [8, 4] are out of range");
  expect_error(file_bytes(R"({"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", data8),
               "tensor 'x': shape must hold non-negative integers, got -1");
  expect_error(file_bytes(R"({"x":{"dtype":"F32","shape":[2]}})", data8),
               "tensor 'x': expected {\"dtype\", \"shape\", \"data_offsets\"}");
  expect_error(file_bytes(R"({"x":{"dtype":"F32","shape":[4611686018427387904,4],)"
                          R"("data_offsets":[0,8]}})",
                          data8),
               "tensor 'x': size overflows");
  expect_error(file_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", data8),
               "tensor 'a' starts at 4, leaving a gap");
  expect_error(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                          R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                          data8),
               "overlaps");
  expect_error(file_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", data8),
               "tensors cover 4 bytes of data, but the file holds 8");
  expect_error(file_bytes(R"({"__metadata__":{"step":3}})", ""), "__metadata__ 'step'");

  // A file cut short inside the data.
  TempPath good("good");
  save_safetensors(good.str(), {{"w", Tensor::from_vector({1, 2, 3, 4}, {4})}});
  const std::string whole = read_bytes(good.str());
  expect_error(whole.substr(0, whole.size() - 3),
               "tensor 'w': data_offsets [0, 16] are out of range");
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

using testutil::error_of;

// Known answers from Debian's `xxhsum -H3` (package xxhash), so state.json's digests can be
// checked by hand: printf '' | xxhsum -H3, printf Loom | xxhsum -H3, 10000 zero bytes.
TEST(FileDigest, IsXxh3AsXxhsumPrintsIt) {
  Digester empty;
  EXPECT_EQ(xxh3_hex(empty.digest().xxh3), "2d06800538d394c2");
  EXPECT_EQ(empty.digest().bytes, 0);
  Digester loom;
  loom.update("Loom", 4);
  EXPECT_EQ(xxh3_hex(loom.digest().xxh3), "207dfa9555cf5ff4");
  // In pieces of any size, the digest of the whole.
  const std::string zeros(10000, '\0');
  Digester pieces;
  pieces.update(zeros.data(), 1);
  pieces.update(zeros.data(), 4095);
  pieces.update(zeros.data(), 0);
  pieces.update(zeros.data(), 5904);
  EXPECT_EQ(xxh3_hex(pieces.digest().xxh3), "99b4d8e5f223fef7");
  EXPECT_EQ(pieces.digest().bytes, 10000);
}

TEST(FileDigest, HexRoundTripsAndRejectsAnythingElse) {
  uint64_t h = 0;
  ASSERT_TRUE(parse_xxh3("2d06800538d394c2", h));
  EXPECT_EQ(h, 0x2d06800538d394c2ull);
  EXPECT_EQ(xxh3_hex(0x00000000000000ffull), "00000000000000ff");
  for (const char* bad : {"", "2d06800538d394c", "2d06800538d394c2f", "2D06800538D394C2",
                          "2d06800538d394cg", " d06800538d394c2"})
    EXPECT_FALSE(parse_xxh3(bad, h)) << bad;
}

// save returns the digest of exactly the bytes it wrote, load the digest of what it read, and
// digest_file the same from the file itself; one changed byte changes it.
TEST(FileDigest, SaveAndLoadDigestTheWholeFile) {
  TempPath path;
  const FileDigest saved = save_safetensors(
      path.str(),
      {{"w", patterned({3, 5}, DType::kF32, 1)}, {"h", patterned({7}, DType::kBF16, 2)}},
      {{"format", "test"}});
  EXPECT_EQ(saved.bytes, static_cast<int64_t>(fs::file_size(path.str())));
  EXPECT_EQ(digest_file(path.str()), saved);
  EXPECT_EQ(load_safetensors(path.str()).digest, saved);
  const std::string bytes = read_bytes(path.str());
  Digester whole;
  whole.update(bytes.data(), bytes.size());
  EXPECT_EQ(whole.digest(), saved);

  std::string changed = bytes;
  changed[changed.size() - 3] ^= 0x01;  // one bit of the last tensor's data
  write_bytes(path.str(), changed);
  EXPECT_NE(load_safetensors(path.str()).digest, saved);
  EXPECT_NE(digest_file(path.str()), saved);
  EXPECT_TRUE(Contains(error_of([] { digest_file("/nonexistent/x.safetensors"); }),
                       "/nonexistent/x.safetensors"));
}

}  // namespace
}  // namespace loom
