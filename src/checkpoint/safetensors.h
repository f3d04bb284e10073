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
// reads the header alone and a tensor when asked (a model of many GB, one tensor at a time).
#pragma once

#include <map>
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

 private:
  std::string path_;
  int64_t data_start_ = 0;
  std::vector<std::string> names_;
  std::map<std::string, SafetensorsEntry> entries_;
};

}  // namespace loom
