// ParquetColumnReader: the fixtures of tests/data/parquet (tools/make_parquet_fixtures.py: pyarrow
// and fastparquet, every codec, page version and string encoding) read back as their writers were
// given them; a missing, nested or non-string column, a file that is not Parquet and damaged
// pages are errors naming the file, never silent garbage.
#include "data/parquet_file.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/error.h"
#include "harness/error_of.h"
#include "test_files.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;
using testing::write_bytes;
using testutil::error_of;

const fs::path kFixtures = fs::path(LOOM_SOURCE_DIR) / "tests" / "data" / "parquet";

std::string bytes_of(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Every row of `column` of `path`: its text, or nullopt for a null.
std::vector<std::optional<std::string>> rows_of(const std::string& path,
                                                const std::string& column = "text") {
  ParquetColumnReader reader(path, column);
  std::vector<std::optional<std::string>> rows;
  std::string value = "stale";
  for (;;) {
    const ParquetColumnReader::Next got = reader.next(value);
    if (got == ParquetColumnReader::Next::end) break;
    if (got == ParquetColumnReader::Next::null) {
      EXPECT_TRUE(value.empty());
      rows.emplace_back();
    } else {
      rows.emplace_back(value);
    }
    EXPECT_EQ(reader.row(), static_cast<int64_t>(rows.size()));
  }
  EXPECT_EQ(reader.rows(), static_cast<int64_t>(rows.size()));
  EXPECT_EQ(reader.next(value), ParquetColumnReader::Next::end);  // and stays at the end
  return rows;
}

TEST(Parquet, NamesEndingInParquetAreParquet) {
  EXPECT_TRUE(is_parquet("fineweb/data/CC-MAIN-2024-10/000_00000.parquet"));
  EXPECT_FALSE(is_parquet("corpus.jsonl"));
  EXPECT_FALSE(is_parquet("parquet.txt"));
}

TEST(Parquet, EveryFixtureReadsAsItsWriterWasGivenIt) {
  std::ifstream in(kFixtures / "expected.json");
  const nlohmann::json expected = nlohmann::json::parse(in);
  std::vector<std::optional<std::string>> texts, with_nulls;
  for (const auto& text : expected["texts"]) {
    texts.emplace_back(text.get<std::string>());
    // As the script makes them: every 11th from the 4th a null.
    with_nulls.push_back(with_nulls.size() % 11 == 3 ? std::nullopt
                                                     : std::optional(text.get<std::string>()));
  }
  ASSERT_GT(texts.size(), 200u);
  int files = 0;
  for (const auto& [name, kind] : expected["files"].items()) {
    SCOPED_TRACE(name);
    const auto& want = kind == "texts"        ? texts
                       : kind == "with_nulls" ? with_nulls
                                              : decltype(texts){};
    if (kind != "empty") {
      ASSERT_FALSE(want.empty());
    }
    const auto got = rows_of((kFixtures / name).string());
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "row " << i + 1;
    ++files;
  }
  EXPECT_EQ(files, 11);
}

// Strings inside a list of structs (a conversation's messages, as the Hub's SFT datasets hold
// them) read a row's list at a time: null lists, empty lists, null elements and null strings (the
// zstd file's rows 4-7) as pyarrow wrote them; over data pages v1 and v2, in row groups of 30 and
// in one. A struct's field
// outside lists reads as a plain column, a null struct as a null.
TEST(Parquet, ListsOfStructsReadARowsListAtATime) {
  std::ifstream in(kFixtures / "conversations.json");
  const nlohmann::json expected = nlohmann::json::parse(in);
  for (const char* name : {"sft_messages.parquet", "sft_messages_zstd_v2.parquet"})
    for (const char* field : {"content", "role"}) {
      SCOPED_TRACE(std::string(name) + " " + field);
      const nlohmann::json& rows = expected[name];
      ASSERT_GT(rows.size(), 50u);
      ParquetColumnReader reader((kFixtures / name).string(),
                                 std::string("messages.list.element.") + field, true);
      std::vector<std::optional<std::string>> items{"stale"};
      for (size_t r = 0; r < rows.size(); ++r) {
        const nlohmann::json& messages = rows[r]["messages"];
        const ParquetColumnReader::Next got = reader.next_list(items);
        ASSERT_EQ(reader.row(), static_cast<int64_t>(r + 1));
        if (messages.is_null()) {
          ASSERT_EQ(got, ParquetColumnReader::Next::null) << "row " << r + 1;
          ASSERT_TRUE(items.empty());
          continue;
        }
        ASSERT_EQ(got, ParquetColumnReader::Next::value) << "row " << r + 1;
        ASSERT_EQ(items.size(), messages.size()) << "row " << r + 1;
        for (size_t m = 0; m < items.size(); ++m) {
          const nlohmann::json& want = messages[m].is_null() ? messages[m] : messages[m][field];
          if (want.is_null())
            EXPECT_FALSE(items[m].has_value()) << "row " << r + 1 << " message " << m;
          else
            EXPECT_EQ(items[m], want.get<std::string>()) << "row " << r + 1 << " message " << m;
        }
      }
      EXPECT_EQ(reader.next_list(items), ParquetColumnReader::Next::end);
      EXPECT_EQ(reader.rows(), static_cast<int64_t>(rows.size()));
    }
  // The columns a file lists, with the lists they are in.
  const auto columns = ParquetColumnReader::columns((kFixtures / "sft_messages.parquet").string());
  ASSERT_EQ(columns.size(), 4u);
  EXPECT_EQ(columns[2].path, "messages.list.element.content");
  EXPECT_TRUE(columns[2].strings);
  EXPECT_EQ(columns[2].lists, 1);
  EXPECT_EQ(columns[0].path, "id");
  EXPECT_FALSE(columns[0].strings);
  EXPECT_EQ(columns[1].lists, 0);
  // A list column read as a string, and a string as a list: refused by name.
  const std::string file = (kFixtures / "sft_messages.parquet").string();
  std::string e = error_of([&] { ParquetColumnReader(file, "messages.list.element.role"); });
  EXPECT_NE(e.find("'messages.list.element.role' is repeated (a list)"), std::string::npos) << e;
  e = error_of([&] { ParquetColumnReader(file, "prompt", true); });
  EXPECT_NE(e.find("'prompt' is not in a list"), std::string::npos) << e;
  // A struct's field: snappy_dict_v1's "meta" {url, score}.
  std::vector<std::optional<std::string>> urls;
  for (size_t i = 0; i < 280; ++i) urls.emplace_back("https://example.com/" + std::to_string(i));
  EXPECT_EQ(rows_of((kFixtures / "snappy_dict_v1.parquet").string(), "meta.url"), urls);
  e = error_of(
      [&] { ParquetColumnReader((kFixtures / "snappy_dict_v1.parquet").string(), "meta.score"); });
  EXPECT_NE(e.find("holds DOUBLE"), std::string::npos) << e;
}

TEST(Parquet, AMissingNestedOrNonStringColumnIsNamed) {
  const std::string file = (kFixtures / "snappy_dict_v1.parquet").string();
  std::string e = error_of([&] { ParquetColumnReader(file, "body"); });
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("no column 'body'"), std::string::npos) << e;
  EXPECT_NE(e.find("its columns: id, text, meta"), std::string::npos) << e;
  e = error_of([&] { ParquetColumnReader(file, "id"); });
  EXPECT_NE(e.find("column 'id' holds INT64, not strings"), std::string::npos) << e;
  e = error_of([&] { ParquetColumnReader(file, "meta"); });
  EXPECT_NE(e.find("column 'meta' is a group of columns"), std::string::npos) << e;
  e = error_of([&] { ParquetColumnReader(file, "url"); });  // a leaf inside the group
  EXPECT_NE(e.find("no column 'url'"), std::string::npos) << e;
}

TEST(Parquet, WhatIsNotParquetOrIsCutShortIsNamed) {
  TempDir dir;
  const std::string whole = bytes_of(kFixtures / "zstd_dict_v2.parquet");
  for (const auto& [bytes, words] : std::vector<std::pair<std::string, std::string>>{
           {"", "not a Parquet file"},
           {"{\"text\": \"a json line\"}\n", "not a Parquet file"},
           {whole.substr(0, whole.size() - 1), "not a Parquet file"},
           {whole.substr(0, whole.size() / 2) + whole.substr(whole.size() - 8), "footer"},
           {whole.substr(0, whole.size() - 4) + "PARE", "encrypted"}}) {
    const std::string path = dir.str() + "/bad.parquet";
    write_bytes(path, bytes);
    const std::string e = error_of([&] { rows_of(path); });
    EXPECT_NE(e.find(path), std::string::npos) << e;
    EXPECT_NE(e.find(words), std::string::npos) << e;
  }
  const std::string e = error_of([&] { ParquetColumnReader(dir.str() + "/none.parquet", "text"); });
  EXPECT_NE(e.find("cannot open"), std::string::npos) << e;
  // A refused file is unmapped (fuzz_parquet ran out of mappings when the constructor's throw
  // skipped the destructor): the process's mappings are as many after 200 refusals as before.
  const auto mappings = [] {
    std::ifstream maps("/proc/self/maps");
    return std::count(std::istreambuf_iterator<char>(maps), std::istreambuf_iterator<char>(), '\n');
  };
  const std::string path = dir.str() + "/bad.parquet";
  write_bytes(path, whole.substr(0, whole.size() / 2) + whole.substr(whole.size() - 8));
  const auto before = mappings();
  for (int i = 0; i < 200; ++i) error_of([&] { ParquetColumnReader(path, "text"); });
  EXPECT_EQ(mappings(), before);
}

// Pages whose bytes changed: the checksummed file names the page's CRC-32; in the others damage is
// caught where it breaks the format — a page header, a compressed stream — (a changed letter of a
// string stored as it is cannot be seen without a checksum, by any reader).
TEST(Parquet, DamagedPagesAreErrorsNamingTheRow) {
  TempDir dir;
  const std::string crc = bytes_of(kFixtures / "brotli_fallback_crc.parquet");
  int caught = 0;
  for (size_t at = 200; at < crc.size() / 2; at += 997) {
    std::string bytes = crc;
    bytes[at] = static_cast<char>(bytes[at] ^ 0x20);
    const std::string path = dir.str() + "/crc.parquet";
    write_bytes(path, bytes);
    const std::string e = error_of([&] { rows_of(path); });
    EXPECT_NE(e.find(path), std::string::npos) << e;
    EXPECT_NE(e.find("column 'text', row "), std::string::npos) << e;
    caught += e.find("CRC-32") != std::string::npos;
  }
  EXPECT_GE(caught, 3);
  // Zeros over the first page's header (a one-column file's starts after the magic number), or
  // inside a zstd or LZ4 stream.
  for (const auto& [name, from] :
       std::vector<std::pair<std::string, size_t>>{{"fastparquet_gzip.parquet", 4},
                                                   {"gzip_plain_v2.parquet", 4},
                                                   {"none_delta_length.parquet", 4},
                                                   {"zstd_dict_v2.parquet", 300},
                                                   {"lz4_delta_byte_array.parquet", 300}}) {
    SCOPED_TRACE(name);
    std::string bytes = bytes_of(kFixtures / name);
    for (size_t at = from; at < from + 40; ++at) bytes[at] = 0;
    const std::string path = dir.str() + "/" + name;
    write_bytes(path, bytes);
    std::string e;
    try {
      rows_of(path);
    } catch (const Error& error) {
      e = error.what();
    }
    EXPECT_NE(e.find("damaged Parquet data"), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace loom
