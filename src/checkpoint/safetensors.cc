// safetensors reader and writer. The checks on load follow the reference implementation
// (huggingface/safetensors, `Metadata::validate`): the tensors must tile the data exactly.
#include "checkpoint/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "base/check.h"
#include "base/error.h"

namespace loom {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; a big-endian host would need byte swaps");

using Json = nlohmann::ordered_json;  // keeps the header's key order

constexpr const char* kMetadataKey = "__metadata__";

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypes[] = {{DType::kF64, "F64"}, {DType::kF32, "F32"},
                                 {DType::kF16, "F16"}, {DType::kBF16, "BF16"},
                                 {DType::kI64, "I64"}, {DType::kI32, "I32"}};

const char* safetensors_name(DType dtype) {
  for (const DTypeName& d : kDTypes)
    if (d.dtype == dtype) return d.name;
  LOOM_CHECK_MSG(false, "dtype without a safetensors name");
  return "";
}

// "safetensors file 'path': <what>"
template <typename... Args>
[[noreturn]] void bad_file(const std::string& path, Args&&... args) {
  fail("safetensors file '", path, "': ", std::forward<Args>(args)...);
}

// A FILE* that closes itself; every failure names the file and the OS's reason. Everything
// written, and everything read (which must then be read front to back), goes into its digest.
class File {
 public:
  // digest = false: reads in any order (positioned, so from several threads), nothing digested
  // (SafetensorsIndex's).
  File(const std::string& path, const char* mode, bool digest = true)
      : path_(path), f_(std::fopen(path.c_str(), mode)), digest_(digest) {
    if (!f_) bad_file(path_, "cannot open: ", std::strerror(errno));
  }
  ~File() {
    if (f_) std::fclose(f_);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  void write(const void* data, size_t bytes) {
    if (bytes > 0 && std::fwrite(data, 1, bytes, f_) != bytes)
      bad_file(path_, "write failed: ", std::strerror(errno));
    digester_.update(data, bytes);
  }
  void read_at(int64_t offset, void* data, size_t bytes, const std::string& what) {
    if (bytes == 0) return;
    if (!digest_) {  // positioned reads: one open file read from several threads at once
      auto* to = static_cast<char*>(data);
      for (size_t done = 0; done < bytes;) {
        const ssize_t n = ::pread(::fileno(f_), to + done, bytes - done,
                                  static_cast<off_t>(offset + static_cast<int64_t>(done)));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0)
          bad_file(path_, n < 0 ? "read failed" : "unexpected end of file", " reading ", what,
                   n < 0 ? std::string(": ") + std::strerror(errno) : std::string());
        done += static_cast<size_t>(n);
      }
      return;
    }
    if (std::fseek(f_, static_cast<long>(offset), SEEK_SET) != 0)
      bad_file(path_, "seek failed reading ", what, ": ", std::strerror(errno));
    if (std::fread(data, 1, bytes, f_) != bytes)
      bad_file(path_, std::ferror(f_) ? "read failed" : "unexpected end of file", " reading ",
               what);
    if (!digest_) return;
    LOOM_CHECK_MSG(offset == read_end_, "safetensors reads must follow each other for the digest");
    read_end_ = offset + static_cast<int64_t>(bytes);
    digester_.update(data, bytes);
  }
  FileDigest digest() const { return digester_.digest(); }
  // Flushes to the disk, so that a rename after it publishes complete contents.
  void sync_and_close() {
    const bool ok = std::fflush(f_) == 0 && ::fsync(::fileno(f_)) == 0;
    const int err = errno;
    const bool closed = std::fclose(f_) == 0;
    f_ = nullptr;
    if (!ok || !closed) bad_file(path_, "write failed: ", std::strerror(ok ? errno : err));
  }

 private:
  std::string path_;
  std::FILE* f_;
  bool digest_;
  Digester digester_;
  int64_t read_end_ = 0;
};

int64_t checked_mul(int64_t a, int64_t b, const std::string& path, const std::string& name) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) bad_file(path, "tensor '", name, "': size overflows");
  return out;
}

int64_t to_int64(const Json& j, const std::string& path, const std::string& name,
                 const char* field) {
  if (!j.is_number_unsigned() || j.get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()})
    bad_file(path, "tensor '", name, "': ", field, " must hold non-negative integers, got ",
             j.dump());
  return static_cast<int64_t>(j.get<uint64_t>());
}

// One tensor's header entry, checked against itself (the tiling is checked afterwards).
struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  int64_t begin, end;
};

Entry parse_entry(const std::string& path, const std::string& name, const Json& info,
                  int64_t data_bytes) {
  if (!info.is_object() || !info.contains("dtype") || !info.contains("shape") ||
      !info.contains("data_offsets"))
    bad_file(path, "tensor '", name, "': expected {\"dtype\", \"shape\", \"data_offsets\"}, got ",
             info.dump());
  Entry e{name, DType::kF32, {}, 0, 0};
  const Json& dtype = info["dtype"];
  if (!dtype.is_string()) bad_file(path, "tensor '", name, "': dtype must be a string");
  const auto known = std::find_if(std::begin(kDTypes), std::end(kDTypes),
                                  [&](const DTypeName& d) { return dtype == d.name; });
  if (known == std::end(kDTypes))
    bad_file(path, "tensor '", name, "' has dtype ", dtype.dump(),
             ", which Loom does not read (F64, F32, F16, BF16, I64, I32)");
  e.dtype = known->dtype;
  if (!info["shape"].is_array()) bad_file(path, "tensor '", name, "': shape must be an array");
  for (const Json& d : info["shape"]) e.shape.push_back(to_int64(d, path, name, "shape"));
  const Json& offsets = info["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2)
    bad_file(path, "tensor '", name, "': data_offsets must be [begin, end], got ", offsets.dump());
  e.begin = to_int64(offsets[0], path, name, "data_offsets");
  e.end = to_int64(offsets[1], path, name, "data_offsets");

  int64_t numel = 1;
  for (int64_t d : e.shape) numel = checked_mul(numel, d, path, name);
  const int64_t bytes = checked_mul(numel, static_cast<int64_t>(dtype_size(e.dtype)), path, name);
  if (e.end < e.begin || e.end > data_bytes)
    bad_file(path, "tensor '", name, "': data_offsets [", e.begin, ", ", e.end,
             "] are out of range for ", data_bytes, " bytes of data");
  if (e.end - e.begin != bytes)
    bad_file(path, "tensor '", name, "': data_offsets [", e.begin, ", ", e.end, "] hold ",
             e.end - e.begin, " bytes, but shape ", shape_str(e.shape), " of ", known->name,
             " needs ", bytes);
  return e;
}

}  // namespace

struct SafetensorsWriter::Impl {
  std::string path, tmp;
  std::vector<SafetensorsSpec> specs;
  std::unique_ptr<File> file;
  size_t written = 0;  // of data_order
};

SafetensorsWriter::SafetensorsWriter(const std::string& path, std::vector<SafetensorsSpec> specs,
                                     const std::map<std::string, std::string>& metadata)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->tmp = path + ".tmp";
  impl_->specs = std::move(specs);
  const std::vector<SafetensorsSpec>& s = impl_->specs;
  std::set<std::string> seen;
  std::vector<int64_t> bytes;
  for (const SafetensorsSpec& spec : s) {
    if (spec.name.empty() || spec.name == kMetadataKey)
      bad_file(path, "cannot save a tensor named '", spec.name, "'");
    if (!seen.insert(spec.name).second) bad_file(path, "tensor '", spec.name, "' is given twice");
    int64_t n = static_cast<int64_t>(dtype_size(spec.dtype));
    for (int64_t d : spec.shape) n = checked_mul(n, d, path, spec.name);
    bytes.push_back(n);
  }

  // Data layout: back to back, wider dtypes first (stable otherwise), as the reference writer
  // does. The data starts 8-aligned, so every tensor is then aligned to its element size, which
  // loaders that view the bytes in place (mmap + torch) require.
  data_order_.resize(s.size());
  for (size_t i = 0; i < s.size(); ++i) data_order_[i] = i;
  std::stable_sort(data_order_.begin(), data_order_.end(), [&](size_t a, size_t b) {
    return dtype_size(s[a].dtype) > dtype_size(s[b].dtype);
  });
  std::vector<int64_t> begin(s.size());
  int64_t offset = 0;
  for (size_t i : data_order_) {
    begin[i] = offset;
    offset += bytes[i];
  }

  // Header: metadata first, then the tensors in the given order.
  Json header = Json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  for (size_t i = 0; i < s.size(); ++i)
    header[s[i].name] = {{"dtype", safetensors_name(s[i].dtype)},
                         {"shape", s[i].shape},
                         {"data_offsets", {begin[i], begin[i] + bytes[i]}}};
  std::string text;
  try {
    text = header.dump();
  } catch (const Json::exception& e) {  // names or metadata that are not valid UTF-8
    bad_file(path, "cannot write header: ", e.what());
  }
  // Pad with spaces so the data starts 8-byte aligned (8 + N is a multiple of 8).
  text.append((8 - text.size() % 8) % 8, ' ');

  impl_->file = std::make_unique<File>(impl_->tmp, "wb");
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * i));
  try {
    impl_->file->write(length, sizeof length);
    impl_->file->write(text.data(), text.size());
  } catch (...) {  // no destructor runs for a constructor that throws: remove path.tmp here
    impl_->file.reset();
    std::error_code ignored;
    std::filesystem::remove(impl_->tmp, ignored);
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (impl_->file == nullptr) return;  // finished
  impl_->file.reset();
  std::error_code ignored;
  std::filesystem::remove(impl_->tmp, ignored);
}

void SafetensorsWriter::write(const Tensor& t) {
  LOOM_CHECK_MSG(impl_->file != nullptr && impl_->written < data_order_.size(),
                 "SafetensorsWriter: more tensors written than specified");
  const SafetensorsSpec& spec = impl_->specs[data_order_[impl_->written]];
  LOOM_CHECK_MSG(
      t.defined() && t.device().is_cpu() && t.dtype() == spec.dtype && t.shape() == spec.shape,
      "SafetensorsWriter: a tensor unlike its spec");
  impl_->file->write(t.numel() > 0 ? t.raw() : nullptr, t.nbytes());
  ++impl_->written;
}

FileDigest SafetensorsWriter::finish() {
  LOOM_CHECK_MSG(impl_->file != nullptr && impl_->written == data_order_.size(),
                 "SafetensorsWriter: finished before every tensor was written");
  const FileDigest digest = impl_->file->digest();
  impl_->file->sync_and_close();
  impl_->file.reset();
  std::error_code ec;
  std::filesystem::rename(impl_->tmp, impl_->path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(impl_->tmp, ignored);
    bad_file(impl_->path, "cannot rename '", impl_->tmp, "' to it: ", ec.message());
  }
  return digest;
}

FileDigest save_safetensors(const std::string& path,
                            const std::vector<std::pair<std::string, Tensor>>& tensors,
                            const std::map<std::string, std::string>& metadata) {
  std::vector<Tensor> host;
  std::vector<SafetensorsSpec> specs;
  host.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) bad_file(path, "tensor '", name, "' is undefined");
    host.push_back(tensor.device().is_cpu() ? tensor : tensor.to(Device::cpu()));
    specs.push_back({name, tensor.dtype(), tensor.shape()});
  }
  SafetensorsWriter writer(path, std::move(specs), metadata);
  for (size_t i : writer.data_order()) writer.write(host[i]);
  return writer.finish();
}

namespace {
// A file's header: its metadata and entries (in the header's order), each checked, the entries
// tiling the data exactly, as the reference loader requires; `by_offset` indexes the entries in
// the order their data lies in the file.
struct Header {
  std::map<std::string, std::string> metadata;
  std::vector<Entry> entries;
  std::vector<size_t> by_offset;
  int64_t data_start = 0;
};

int64_t file_size_of(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) bad_file(path, "does not exist");
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) bad_file(path, "cannot read: ", ec.message());
  return static_cast<int64_t>(size);
}

// Reads the header of `file` (`file_bytes` long) from its first byte.
Header read_header(const std::string& path, File& file, int64_t file_bytes) {
  // 1. Header length and JSON.
  if (file_bytes < 8)
    bad_file(path, "is ", file_bytes, " bytes, too short for the 8-byte header length");
  uint8_t length[8];
  file.read_at(0, length, sizeof length, "the header length");
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= uint64_t{length[i]} << (8 * i);
  if (header_bytes > static_cast<uint64_t>(file_bytes - 8))
    bad_file(path, "header length ", header_bytes, " exceeds the ", file_bytes - 8,
             " bytes after it (not a safetensors file, or truncated)");
  std::string text(header_bytes, '\0');
  file.read_at(8, text.data(), text.size(), "the header");
  Json header;
  try {
    header = Json::parse(text);
  } catch (const Json::exception& e) {
    bad_file(path, "invalid JSON header: ", e.what());
  }
  if (!header.is_object()) bad_file(path, "the header is not a JSON object");

  // 2. Metadata and entries, each checked on its own.
  Header out;
  const int64_t data_start = 8 + static_cast<int64_t>(header_bytes);
  out.data_start = data_start;
  const int64_t data_bytes = file_bytes - data_start;
  for (const auto& [name, info] : header.items()) {
    if (name == kMetadataKey) {
      if (!info.is_object()) bad_file(path, "__metadata__ must be an object of strings");
      for (const auto& [key, value] : info.items()) {
        if (!value.is_string())
          bad_file(path, "__metadata__ '", key, "' must be a string, got ", value.dump());
        out.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    out.entries.push_back(parse_entry(path, name, info, data_bytes));
  }
  const std::vector<Entry>& entries = out.entries;

  // 3. The tensors must tile [0, data_bytes) exactly, as the reference loader requires.
  std::vector<size_t>& by_offset = out.by_offset;
  for (size_t i = 0; i < entries.size(); ++i) by_offset.push_back(i);
  std::stable_sort(by_offset.begin(), by_offset.end(), [&](size_t a, size_t b) {
    return entries[a].begin != entries[b].begin ? entries[a].begin < entries[b].begin
                                                : entries[a].end < entries[b].end;
  });
  int64_t expected = 0;
  for (size_t i = 0; i < by_offset.size(); ++i) {
    const Entry& e = entries[by_offset[i]];
    if (e.begin < expected)
      bad_file(path, "tensor '", e.name, "' overlaps tensor '", entries[by_offset[i - 1]].name,
               "'");
    if (e.begin > expected)
      bad_file(path, "tensor '", e.name, "' starts at ", e.begin, ", leaving a gap after byte ",
               expected);
    expected = e.end;
  }
  if (expected != data_bytes)
    bad_file(path, "tensors cover ", expected, " bytes of data, but the file holds ", data_bytes);
  return out;
}
}  // namespace

SafetensorsFile load_safetensors(const std::string& path) {
  const int64_t file_bytes = file_size_of(path);
  File file(path, "rb");
  Header header = read_header(path, file, file_bytes);
  SafetensorsFile out;
  out.metadata = std::move(header.metadata);
  const int64_t data_start = header.data_start;

  // 4. Data, read in offset order; names keep the header's order.
  for (const size_t i : header.by_offset) {
    const Entry* e = &header.entries[i];
    Tensor t = Tensor::empty(e->shape, e->dtype);
    file.read_at(data_start + e->begin, t.numel() > 0 ? t.raw() : nullptr, t.nbytes(),
                 "tensor '" + e->name + "'");
    out.tensors.emplace(e->name, std::move(t));
  }
  for (const Entry& e : header.entries) out.names.push_back(e.name);
  out.digest = file.digest();  // the tensors tile the data, so every byte went into it
  return out;
}

struct SafetensorsIndex::OpenFile {
  explicit OpenFile(const std::string& path) : file(path, "rb", /*digest=*/false) {}
  File file;
};

SafetensorsIndex::SafetensorsIndex(const std::string& path)
    : path_(path), file_(std::make_shared<OpenFile>(path)) {
  const int64_t file_bytes = file_size_of(path);
  const Header header = read_header(path, file_->file, file_bytes);
  data_start_ = header.data_start;
  for (const Entry& e : header.entries) {
    names_.push_back(e.name);
    entries_.emplace(e.name, SafetensorsEntry{e.dtype, e.shape, e.begin, e.end});
  }
}

const SafetensorsEntry* SafetensorsIndex::find(const std::string& name) const {
  const auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second;
}

Tensor SafetensorsIndex::read(const std::string& name) const {
  const SafetensorsEntry* e = find(name);
  if (e == nullptr) bad_file(path_, "has no tensor '", name, "'");
  Tensor t = Tensor::empty(e->shape, e->dtype);
  file_->file.read_at(data_start_ + e->begin, t.numel() > 0 ? t.raw() : nullptr, t.nbytes(),
                      "tensor '" + name + "'");
  return t;
}

void SafetensorsIndex::read_f32(const std::string& name, int64_t first, int64_t count,
                                float* out) const {
  const SafetensorsEntry* e = find(name);
  if (e == nullptr) bad_file(path_, "has no tensor '", name, "'");
  if (e->dtype != DType::kF32) bad_file(path_, "tensor '", name, "' is not F32");
  const int64_t numel = (e->end - e->begin) / 4;
  if (first < 0 || count < 0 || first > numel || count > numel - first)
    bad_file(path_, "tensor '", name, "' has ", numel, " elements, not [", first, ", ",
             first + count, ")");
  file_->file.read_at(data_start_ + e->begin + 4 * first, out, static_cast<size_t>(count) * 4,
                      "tensor '" + name + "'");
}

}  // namespace loom
