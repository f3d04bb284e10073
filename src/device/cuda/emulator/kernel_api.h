// CUDA C++ as plain C++ for the emulator (preset "cuda-emulated", LOOM_CUDA_EMULATE=ON): included
// first by the generated translation units that compile Loom's .cu files with the host compiler.
// The CUDA toolkit's own headers give the types (dim3, cudaError_t, __nv_bfloat16 with its host
// conversions) and, outside nvcc, define __global__ / __device__ / __host__ away; this header maps
// the rest of what our kernels use onto the emulator (scheduler.h) and the runtime onto
// runtime.cc: __shared__ arrays become per-host-thread statics, shared by the fibers of the one
// block that runs at a time; threadIdx and friends read the running fiber's indices.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "device/cuda/emulator/scheduler.h"

#undef __shared__
#define __shared__ static thread_local

// Register budgets for nvcc: nothing to the host compiler.
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

#define threadIdx (::loom::cuda_emu::current().thread_idx)
#define blockIdx (::loom::cuda_emu::current().block_idx)
#define blockDim (::loom::cuda_emu::current().block_dim)
#define gridDim (::loom::cuda_emu::current().grid_dim)

inline void __syncthreads() {
  ::loom::cuda_emu::sync_threads();
}

namespace loom::cuda_emu {
template <typename T>
T shuffle_from(T value, int source_lane) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move 8 bytes at most");
  T out;
  warp_exchange(&value, &out, sizeof(T), source_lane);
  return out;
}
}  // namespace loom::cuda_emu

// The warp shuffles, width 32 (the only width our kernels use).
template <typename T>
T __shfl_sync(unsigned /*mask*/, T value, int source_lane, int /*width*/ = 32) {
  return ::loom::cuda_emu::shuffle_from(value, source_lane);
}
template <typename T>
T __shfl_xor_sync(unsigned /*mask*/, T value, int lane_mask, int /*width*/ = 32) {
  return ::loom::cuda_emu::shuffle_from(value, ::loom::cuda_emu::lane_id() ^ lane_mask);
}
template <typename T>
T __shfl_down_sync(unsigned /*mask*/, T value, unsigned delta, int /*width*/ = 32) {
  return ::loom::cuda_emu::shuffle_from(value,
                                        ::loom::cuda_emu::lane_id() + static_cast<int>(delta));
}

// Loads through the read-only cache: plain loads.
template <typename T>
T __ldg(const T* p) {
  return *p;
}

// Atomics: one block runs at a time and its fibers never interleave within a call, so plain
// read-modify-writes are atomic here.
template <typename T>
T atomicMin(T* address, T value) {
  const T old = *address;
  if (value < old) *address = value;
  return old;
}
template <typename T>
T atomicAdd(T* address, T value) {
  const T old = *address;
  *address = old + value;
  return old;
}

// Correctly rounded single-precision operations, never contracted into FMAs with the operations
// around them, as on a GPU. GCC contracts a·b + c across statements and inlined calls in C++
// (its -ffp-contract=fast is the default everywhere but ISO C), so each operand and result
// passes through a barrier the optimiser cannot see into.
inline float rounded_barrier(float x) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  asm("" : "+x"(x));
#else
  volatile float kept = x;
  x = kept;
#endif
  return x;
}
inline float __fadd_rn(float a, float b) {
  return rounded_barrier(rounded_barrier(a) + rounded_barrier(b));
}
inline float __fsub_rn(float a, float b) {
  return rounded_barrier(rounded_barrier(a) - rounded_barrier(b));
}
inline float __fmul_rn(float a, float b) {
  return rounded_barrier(rounded_barrier(a) * rounded_barrier(b));
}
inline float __fdiv_rn(float a, float b) {
  return rounded_barrier(rounded_barrier(a) / rounded_barrier(b));
}
inline float __fsqrt_rn(float a) {
  return std::sqrt(a);
}
inline float __fmaf_rn(float a, float b, float c) {
  return std::fma(a, b, c);
}

// __syncwarp(): the 32 lanes of the warp meet (a shuffle nobody reads).
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) {
  (void)::loom::cuda_emu::shuffle_from(0, ::loom::cuda_emu::lane_id());
}
