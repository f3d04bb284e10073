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

// Warp matrix operations (mma.h) on 16×16×16 tiles. On the GPU a fragment is spread over the
// warp's lanes in an unspecified order; here every lane keeps the whole tile, row-major, which
// honours the one thing kernels may assume: x[] element-wise operations apply to every element
// once. The *_sync calls meet the warp first, as their names promise.
namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static constexpr int rows = std::is_same_v<Use, matrix_b> ? K : M;
  static constexpr int cols = std::is_same_v<Use, matrix_a> ? K : N;
  static constexpr int num_elements = rows * cols;
  T x[num_elements];
};

template <typename Use, int M, int N, int K, typename T, typename Layout>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm) {
  using F = fragment<Use, M, N, K, T, Layout>;
  __syncwarp();
  for (int r = 0; r < F::rows; ++r)
    for (int c = 0; c < F::cols; ++c)
      f.x[r * F::cols + c] = std::is_same_v<Layout, row_major> ? p[r * ldm + c] : p[c * ldm + r];
}

template <int M, int N, int K, typename T>
void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* p, unsigned ldm,
                      layout_t layout) {
  __syncwarp();
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c)
      f.x[r * N + c] = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
}

template <int M, int N, int K, typename T>
void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm,
                       layout_t layout) {
  __syncwarp();
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c)
      (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[r * N + c];
}

template <typename Use, int M, int N, int K, typename T, typename Layout, typename V>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, const V& value) {
  for (T& e : f.x) e = static_cast<T>(value);
}

inline float to_float(float x) {
  return x;
}
inline float to_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
inline float to_float(__half x) {
  return __half2float(x);
}

// d = a·b + c, fp32 products summed in k order (the tensor cores' order is theirs).
template <int M, int N, int K, typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LA>& a,
              const fragment<matrix_b, M, N, K, T, LB>& b,
              const fragment<accumulator, M, N, K, float>& c) {
  __syncwarp();
  float out[M * N];
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float acc = c.x[m * N + n];
      for (int k = 0; k < K; ++k) acc += to_float(a.x[m * K + k]) * to_float(b.x[k * N + n]);
      out[m * N + n] = acc;
    }
  std::memcpy(d.x, out, sizeof out);
}

}  // namespace nvcuda::wmma
