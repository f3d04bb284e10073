// safetensors — HuggingFace's tensor file format, read and written without Python.
//
//   [u64 little-endian N] [N bytes of UTF-8 JSON header, space-padded to a multiple of 8] [data]
//   header: {"__metadata__": {"key": "value", ...},
//            "<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
//
// Offsets are relative to the start of the data, which the tensors tile exactly (no gaps, no
// overlaps), each end - begin == numel × dtype size. Loom reads and writes F64, F32, F16, BF16,
// I64 and I32; other dtypes (U8, BOOL, F8_*) are reported by name. Data is little-endian, as on
// every host we run on. load_safetensors reads every tensor into host memory; SafetensorsIndex
// reads the header alone and a tensor (or a run of one) when asked, and SafetensorsWriter writes
// the header first and then one tensor at a time (a model of many GB, one tensor in memory).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/file_digest.h"
#include "tensor/tensor.h"

namespace loom {

// Writes `tensors` (device tensors are copied to the host first), listed in the header in the
// given order. Their data is laid out widest dtype first, as the reference writer does, so each
// tensor is aligned to its element size. Names must be unique, non-empty and not "__metadata__".
// The file is written to `path + ".tmp"` and renamed over `path` after an fsync, so a crash never
// leaves a partial file under the final name. Returns the digest of the bytes written.
FileDigest save_safetensors(const std::string& path,
                            const std::vector<std::pair<std::string, Tensor>>& tensors,
                            const std::map<std::string, std::string>& metadata = {});

// A file written one tensor at a time: every tensor's name, dtype and shape are given up front
// (the header, in that order), their data then tensor by tensor in data_order() — back to back,
// wider dtypes first (stable otherwise), as save_safetensors lays them out. Written to
// `path + ".tmp"`; finish() flushes it to the disk and renames it over `path`; a writer destroyed
// before finishing removes the partial file.
struct SafetensorsSpec {
  std::string name;
  DType dtype;
  Shape shape;
};
class SafetensorsWriter {
 public:
  SafetensorsWriter(const std::string& path, std::vector<SafetensorsSpec> specs,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // The order the tensors' data is written in: indices into the specs.
  const std::vector<size_t>& data_order() const { return data_order_; }
  // The next tensor of data_order() (a host tensor of its spec's dtype and shape).
  void write(const Tensor& t);
  // Every tensor written: flushes and renames; returns the digest of the bytes written.
  FileDigest finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<size_t> data_order_;
};

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;  // the header's "__metadata__" (may be empty)
  std::vector<std::string> names;               // tensor names in header order (= save order)
  std::map<std::string, Tensor> tensors;        // host tensors by name
  FileDigest digest;                            // of the whole file, as read
};

// Reads a whole file. Throws loom::Error naming the file (and the tensor) when it is missing or
// unreadable, the header length exceeds the file, the header is not valid JSON or not the
// expected shape, a dtype is unknown, or offsets are out of range / disagree with shape × dtype.
SafetensorsFile load_safetensors(const std::string& path);

// One tensor's header entry: its dtype, shape and bytes [begin, end) of the data.
struct SafetensorsEntry {
  DType dtype;
  Shape shape;
  int64_t begin, end;
};

// A file's header, checked as load_safetensors checks it (the same errors), with each tensor read
// from the file when asked: host memory for one tensor at a time.
class SafetensorsIndex {
 public:
  explicit SafetensorsIndex(const std::string& path);
  const std::string& path() const { return path_; }
  const std::vector<std::string>& names() const { return names_; }  // the header's order
  const SafetensorsEntry* find(const std::string& name) const;      // null: no such tensor
  Tensor read(const std::string& name) const;  // a host tensor; fails naming a missing one
  // Elements [first, first + count) of 1-D or N-D f32 tensor `name` (row-major) into `out`: a run
  // of one tensor, read without the rest. Fails naming the tensor when it is not f32 or the run
  // lies outside it.
  void read_f32(const std::string& name, int64_t first, int64_t count, float* out) const;

 private:
  struct OpenFile;  // kept open for the reads (shared by copies)
  std::string path_;
  std::shared_ptr<OpenFile> file_;
  int64_t data_start_ = 0;
  std::vector<std::string> names_;
  std::map<std::string, SafetensorsEntry> entries_;
};

}  // namespace loom
