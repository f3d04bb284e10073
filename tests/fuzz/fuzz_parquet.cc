// Fuzzes the Parquet reader of `loom data prepare CORPUS.parquet` (data/parquet_file.h): the input
// is the file, its column "text" read row by row, and its list column
// "messages.list.element.content" a row's list at a time (`--sft`'s conversations). Seeds:
// tests/data/parquet's fixtures (every codec, page version and string encoding; lists of
// structs with nulls and empty lists).
// Properties: a refusal is a loom::Error naming the file; rows are numbered from 1 in order; a
// file read to its end gave as many rows as its footer says, and then stays at its end; a null
// list has no items. A tiny
// file may declare billions of rows (a run of nulls takes two bytes), so a read stops after 1M
// rows or 64 MiB of text: what it gave so far is still checked.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/parquet_file.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  const auto path = fuzz::scratch_dir() / "corpus.parquet";
  fuzz::write_file(path, std::string_view(reinterpret_cast<const char*>(data), size));
  fuzz::accepts([&] {
    ParquetColumnReader reader(path.string(), "text");
    fuzz::require(reader.rows() >= 0, "a file's rows are counted");
    std::string value;
    int64_t rows = 0, bytes = 0;
    for (;;) {
      const ParquetColumnReader::Next got = reader.next(value);
      if (got == ParquetColumnReader::Next::end) {
        fuzz::require(rows == reader.rows(), "the rows read are the footer's");
        fuzz::require(reader.next(value) == ParquetColumnReader::Next::end, "the end stays");
        break;
      }
      fuzz::require(got == ParquetColumnReader::Next::value || value.empty(), "a null is empty");
      fuzz::require(reader.row() == ++rows, "rows are numbered in order");
      bytes += static_cast<int64_t>(value.size());
      if (rows >= 1'000'000 || bytes >= (int64_t{64} << 20)) break;
    }
  });
  fuzz::accepts([&] {
    ParquetColumnReader reader(path.string(), "messages.list.element.content", true);
    std::vector<std::optional<std::string>> items;
    int64_t rows = 0, entries = 0;
    for (;;) {
      const ParquetColumnReader::Next got = reader.next_list(items);
      if (got == ParquetColumnReader::Next::end) {
        fuzz::require(rows == reader.rows(), "the rows read are the footer's");
        fuzz::require(reader.next_list(items) == ParquetColumnReader::Next::end, "the end stays");
        break;
      }
      fuzz::require(got == ParquetColumnReader::Next::value || items.empty(),
                    "a null list is empty");
      fuzz::require(reader.row() == ++rows, "rows are numbered in order");
      entries += static_cast<int64_t>(items.size()) + 1;
      if (entries >= 1'000'000) break;
    }
  });
  return 0;
}
