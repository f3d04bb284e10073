// Time per op kind, for `loom bench train --profile`: what a step spends in GEMMs, attention,
// LayerNorm, cross-entropy... on the CPU or the GPU. Off by default, when an op pays one relaxed
// atomic load. On: a CPU op is timed by the wall clock around it (the CPU kernels return when
// done); a GPU op by a pair of CUDA events around it on the GPU's stream, read when the profile
// is collected, so the host never waits for the GPU in between and the timeline is undisturbed.
// Process-wide (every rank thread adds to the same table).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/exec.h"

namespace loom::ops {

struct OpTime {
  std::string name;  // the op, as kernels/ops.h names it ("matmul_forward", ...)
  int64_t calls = 0;
  double ms = 0;     // summed over the calls
};

// Clears the table and starts timing.
void start_profile();
// Stops timing and returns the table, the most expensive op first (waits for the GPU events).
std::vector<OpTime> stop_profile();

namespace detail {

extern std::atomic<bool> g_profiling;

// Times one op from construction to destruction (kernels/ops.h's dispatch).
class OpScope {
 public:
  OpScope(const char* name, const Exec& ex) {
    if (g_profiling.load(std::memory_order_relaxed)) begin(name, ex);
  }
  ~OpScope() {
    if (name_ != nullptr) end();
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  void begin(const char* name, const Exec& ex);
  void end();
  const char* name_ = nullptr;
  Device device_;
  double start_s_ = 0;
  void* events_[2] = {nullptr, nullptr};  // a GPU op's start and stop cudaEvent_t
};

}  // namespace detail
}  // namespace loom::ops
