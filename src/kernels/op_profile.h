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

// What one call of an op must do at least, as kernels/ops.h counts it from its arguments:
// floating-point operations where they bound it (GEMMs and attention: 2 per multiply-add, causal
// attention counted as computed, half the square), and the bytes of its operands in their storage
// type, each read or written once. Time over these is the op's distance from the machine's
// roofline: a bandwidth-bound kernel far below the memory's GB/s, or a GEMM far below its
// TFLOP/s, is what to fix.
struct OpWork {
  double flops = 0;
  double bytes = 0;
};

struct OpTime {
  std::string name;  // the op, as kernels/ops.h names it ("matmul_forward", ...)
  int64_t calls = 0;
  double ms = 0;     // summed over the calls
  OpWork work;       // summed over the calls
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
  // `work` is only evaluated while a profile runs.
  template <typename Work>
  OpScope(const char* name, const Exec& ex, Work&& work) {
    if (g_profiling.load(std::memory_order_relaxed)) begin(name, ex, work());
  }
  ~OpScope() {
    if (name_ != nullptr) end();
  }
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  void begin(const char* name, const Exec& ex, OpWork work);
  void end();
  const char* name_ = nullptr;
  OpWork work_;
  Device device_;
  double start_s_ = 0;
  void* events_[2] = {nullptr, nullptr};  // a GPU op's start and stop cudaEvent_t
};

}  // namespace detail
}  // namespace loom::ops
