// A text column of a Parquet file, read a value at a time (`loom data prepare CORPUS.parquet`).
//
// The Hub ships most pretraining corpora as Parquet: FineWeb and FineWeb-Edu, The Stack, and every
// dataset's auto-converted `refs/convert/parquet` branch; and its fine-tuning sets. Apache Arrow's
// C++ Parquet library is not in Debian 12, so this is a reader of our own for what a corpus needs:
// one string column (BYTE_ARRAY, required or optional), its pages streamed a row group at a time
// from the mapped file. A column is a leaf of the schema named by its path ("text", a struct's
// "meta.url", or in a list "messages.list.element.content", read a row's list at a time:
// `loom data prepare --sft` reads conversations so).
//
// What it reads (the Parquet format 2.x): the footer's Thrift compact-protocol metadata; data pages
// v1 and v2 and dictionary pages; the PLAIN, PLAIN_DICTIONARY / RLE_DICTIONARY, DELTA_LENGTH_BYTE_
// ARRAY and DELTA_BYTE_ARRAY encodings; definition and repetition levels (RLE / bit-packed
// hybrid; strings in structs and in one level of lists); the codecs
// UNCOMPRESSED, SNAPPY, GZIP, BROTLI, ZSTD, LZ4 (Hadoop's framing, or plain blocks) and LZ4_RAW;
// a page's CRC-32 when the writer stored one. Checked on what pyarrow (also datatrove's writer,
// FineWeb's) and fastparquet write (tests/data/parquet); other writers use the same pages and
// encodings but were not tried.
// Refused, with an error naming the file and the column: lists of lists, other types, encrypted
// files, columns in other files, LZO, and any damage — never a silently shorter corpus.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

// Whether a corpus file is Parquet: its name ends in ".parquet".
bool is_parquet(std::string_view path);

class ParquetColumnReader {
 public:
  // A leaf column of a file: its path, whether it holds strings, and the lists it is in.
  struct Column {
    std::string path;
    bool strings = false;
    int lists = 0;
  };
  // The leaf columns of `path`, in the file's order (throws as the constructor does).
  static std::vector<Column> columns(const std::string& path);

  // Maps `path` and reads its footer; throws loom::Error naming the file if it is not Parquet or
  // is damaged, and naming the column (and the file's top-level columns) if `column` is not a
  // string column of it outside lists — or with `list`, one inside exactly one list.
  ParquetColumnReader(std::string path, std::string column, bool list = false);
  ~ParquetColumnReader();
  ParquetColumnReader(const ParquetColumnReader&) = delete;
  ParquetColumnReader& operator=(const ParquetColumnReader&) = delete;

  enum class Next { value, null, end };
  // The next row's string into `value` (Next::value), or Next::null for a null (value emptied;
  // also where a struct above it is null), or Next::end after the last row. Throws loom::Error
  // naming the file, column and row on damaged data. Not for a `list` column.
  Next next(std::string& value);
  // A `list` column's next row: its list's elements into `items` (nullopt: a null element, or a
  // null string in one) and Next::value, or Next::null for a null list (items empty), or
  // Next::end. A list of over 2^20 elements is refused.
  Next next_list(std::vector<std::optional<std::string>>& items);

  int64_t rows() const { return rows_; }  // the file's rows, by its footer
  int64_t row() const { return row_; }    // the row `next` returned last, from 1
  const std::string& path() const { return path_; }
  const std::string& column() const { return column_; }

 private:
  struct ColumnChunk;  // where a row group's pages of the column are, and how they are coded
  struct Page;         // the data page being read
  struct Mapping;
  static void map(const std::string& path, Mapping& mapping);
  // An entry of the column: its levels, and its string where the definition level is full.
  struct Entry {
    int repetition = 0, definition = 0;
    std::string value;
  };
  bool next_entry(Entry& entry);  // false after the last
  bool next_page();  // loads the next data page (a dictionary page on the way); false at the end
  void load_dictionary(const uint8_t* data, size_t size, int32_t count, int encoding);
  const uint8_t* page_bytes(const uint8_t* compressed, size_t compressed_size,
                            size_t uncompressed_size);  // decompressed into scratch_, or in place
  void release_before(const uint8_t* at);  // gives back the mapping's pages read before `at`
  [[noreturn]] void damaged(const std::string& why) const;

  // The file mapped read-only; unmapped by its destructor, also when the constructor throws.
  struct Mapping {
    const uint8_t* data = nullptr;
    size_t size = 0;
    Mapping() = default;
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    ~Mapping();
  };

  std::string path_, column_;
  bool list_ = false;
  Mapping file_;
  int max_def_ = 0, max_rep_ = 0;  // the column's most levels (0: none stored)
  int list_def_ = 0;               // the definition level of its list (list_)
  int64_t rows_ = 0, row_ = 0;
  int64_t chunk_rows_ = 0;  // rows begun in the chunk being read
  Entry pending_;           // next_list: the entry that began the next row
  bool has_pending_ = false;
  std::vector<ColumnChunk> chunks_;  // one a row group
  size_t chunk_ = 0;                 // the row group being read
  const uint8_t* at_ = nullptr;      // its next page header
  const uint8_t* chunk_end_ = nullptr;
  bool has_dictionary_ = false;
  size_t released_ = 0;  // the mapping's bytes before this are given back
  int64_t chunk_values_left_ = 0;
  std::unique_ptr<Page> page_;
  std::unique_ptr<char[]> scratch_;  // a decompressed page (not zeroed)
  size_t scratch_capacity_ = 0;
  std::unique_ptr<char[]> dictionary_data_;
  std::vector<std::string_view> dictionary_;
};

}  // namespace loom
