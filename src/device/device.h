// Device — where a tensor's bytes live: the host (cpu) or a CUDA GPU.
//
// A CPU device has an index too: with thread ranks every rank allocates from its own `cpu:R`, so
// the allocator statistics (bytes in use, peak) are per rank, as they are per GPU with CUDA.
#pragma once

#include <string>
#include <string_view>

namespace loom {

enum class DeviceType { kCpu, kCuda };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;

  static Device cpu(int index = 0) { return {DeviceType::kCpu, index}; }
  static Device cuda(int index = 0) { return {DeviceType::kCuda, index}; }
  // Parses "cpu", "cpu:1", "cuda", "cuda:3"; throws loom::Error naming the text otherwise.
  static Device parse(std::string_view text);

  bool is_cpu() const { return type == DeviceType::kCpu; }
  bool is_cuda() const { return type == DeviceType::kCuda; }
  std::string str() const;
  friend bool operator==(const Device&, const Device&) = default;
};

}  // namespace loom
