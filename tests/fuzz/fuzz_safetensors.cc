// Fuzzes load_safetensors, the reader of checkpoints' tensor files and of HuggingFace models
// (train.init_from): the input is the whole file. Properties: a refusal is a loom::Error; every
// byte of an accepted file's tensors can be read (the sanitizers see any access out of bounds);
// and the tensors written again by save_safetensors read back the same names in the same order,
// the same dtypes, shapes, bytes and metadata.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/safetensors.h"
#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace loom;
  const std::string path = (fuzz::scratch_dir() / "in.safetensors").string();
  fuzz::write_file(path, std::string_view(reinterpret_cast<const char*>(data), size));
  SafetensorsFile file;
  if (!fuzz::accepts([&] { file = load_safetensors(path); })) return 0;

  fuzz::require(file.names.size() == file.tensors.size(), "one tensor per name");
  std::vector<std::pair<std::string, Tensor>> tensors;
  uint64_t checksum = 0;
  for (const std::string& name : file.names) {
    const Tensor& t = file.tensors.at(name);
    const auto* bytes = static_cast<const uint8_t*>(t.raw());
    for (size_t i = 0; i < t.nbytes(); ++i) checksum += bytes[i];
    tensors.emplace_back(name, t);
  }
  const std::string copy = (fuzz::scratch_dir() / "copy.safetensors").string();
  if (!fuzz::accepts([&] { save_safetensors(copy, tensors, file.metadata); })) return 0;
  const SafetensorsFile again = load_safetensors(copy);
  fuzz::require(again.names == file.names, "names and their order survive a rewrite");
  fuzz::require(again.metadata == file.metadata, "metadata survives a rewrite");
  for (const std::string& name : file.names) {
    const Tensor& a = file.tensors.at(name);
    const Tensor& b = again.tensors.at(name);
    fuzz::require(a.dtype() == b.dtype() && a.shape() == b.shape(), "dtype and shape survive");
    fuzz::require(a.nbytes() == b.nbytes() &&
                      (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0),
                  "bytes survive a rewrite");
  }
  fuzz::keep(checksum);
  return 0;
}
