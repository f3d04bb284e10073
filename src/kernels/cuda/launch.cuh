// What every CUDA kernel file shares: the launch, grid sizes, warp and block reductions, and
// scratch memory from the GPU's caching allocator.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "base/error.h"
#include "device/allocator.h"
#include "device/cuda/cuda_check.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/unroll.h"  // LOOM_UNROLL
#ifdef LOOM_CUDA_EMULATE
#include "device/cuda/emulator/scheduler.h"
#endif

namespace loom::cuda {

// After a launch: a bad configuration is reported here; with LOOM_CUDA_SYNC=1 in the
// environment, errors while the kernel ran too (at the cost of a synchronisation per kernel).
void check_launch(const char* kernel);

// kernel<<<grid, block>>>(args...) on the legacy default stream, then check_launch(name). Under
// the CUDA emulator (LOOM_CUDA_EMULATE, device/cuda/emulator) the grid runs here and now, on the
// calling thread.
template <typename... Params, typename... Args>
void launch(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, Args... args) {
#ifdef LOOM_CUDA_EMULATE
  cuda_emu::run_kernel(name, {grid.x, grid.y, grid.z}, {block.x, block.y, block.z},
                       [&] { kernel(args...); });
#else
  // clang-format reads .cuh files as C++ and would split the chevrons.
  // clang-format off
  kernel<<<grid, block>>>(args...);
  // clang-format on
#endif
  check_launch(name);
}

// Calls f(T{}) with T the type GEMM operands are rounded to at the current matmul precision,
// __nv_bfloat16 or __half, and returns that precision; fails naming `what` at fp32 and TF32,
// whose operands stay fp32. For kernels that write their output as the next GEMM's operand.
template <typename F>
MatmulPrecision with_rounded_type(const char* what, F&& f) {
  const MatmulPrecision precision = matmul_precision();
  switch (precision) {
    case MatmulPrecision::kBf16:
      f(__nv_bfloat16{});
      return precision;
    case MatmulPrecision::kFp16:
      f(__half{});
      return precision;
    case MatmulPrecision::kTf32:
    case MatmulPrecision::kFp32:
      break;
  }
  fail(what, ": the matmul precision is not bf16 or fp16, so GEMM operands stay fp32");
}

// gemm_rounded_output's checks (gemm.cu and gemm_emulated.cu): sizes, a 16-bit matmul precision
// (returned), operands rounded for it.
MatmulPrecision check_rounded_output_gemm(int64_t M, int64_t N, int64_t K, const GemmOperand& A,
                                          const GemmOperand& B);

// Threads per block of the element-wise and column kernels.
constexpr int kThreads = 256;
// The embedding gradients (embedding.cu, vocab_shard.cu) sum token rows into vocabulary rows
// without atomics: thread (c, p) owns channel c of the vocabulary rows v with v % 64 == p.
constexpr int kVocabPartitions = 64;

// Blocks for a grid-stride loop over n elements: enough to fill the GPU a few times over.
int blocks_for(int64_t n, int threads);

// Whether p starts on a `bytes` boundary (the wide accesses below, cp.async, the flash kernels).
inline bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Blocks of `per_block` items each covering `items` (a ceiling division).
inline unsigned blocks_of(int64_t items, int64_t per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

// The index of the first id outside [0, V) among ids[0, n) on the current GPU, or -1; with its
// value in *bad. Waits for the GPU (8 bytes come back): token and target checks. Targets pass
// `targets` = true, which also takes kIgnoredTarget (kernels/targets.h).
int64_t first_out_of_range(const int32_t* ids, int64_t n, int64_t V, int32_t* bad,
                           bool targets = false);

// Scratch memory of GPU `device` for the length of one call, from its caching allocator. Freed
// when the call returns, possibly before the GPU ran the kernels that use it: sound, because
// every kernel runs on the same stream in issue order, so the next user of the block waits.
template <typename T>
class Scratch {
 public:
  Scratch(int device, int64_t count)
      : allocator_(allocator_for(Device::cuda(device))),
        bytes_(static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(T)),
        data_(static_cast<T*>(allocator_.allocate(bytes_))) {}
  ~Scratch() { allocator_.deallocate(data_, bytes_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* get() const { return data_; }

 private:
  Allocator& allocator_;
  size_t bytes_;
  T* data_;
};

#if defined(__CUDACC__) || defined(LOOM_CUDA_EMULATE)
template <typename T>
__device__ inline T warp_sum(T x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ inline float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024), returned to every
// thread. The tree is fixed, so the result is too. `shared` holds 32 values.
template <typename T>
__device__ inline T block_sum(T x, T* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  x = warp_sum(x);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = lane < warps ? shared[lane] : T(0);
  return warp_sum(x);
}

// fp32 -> a GEMM operand's storage type: itself, or bf16 / fp16 rounded to nearest even (fp16
// overflows to ±inf beyond 65504: what loss scaling watches for).
__device__ inline void round_to(float& out, float x) {
  out = x;
}
__device__ inline void round_to(__nv_bfloat16& out, float x) {
  out = __float2bfloat16_rn(x);
}
__device__ inline void round_to(__half& out, float x) {
  out = __float2half_rn(x);
}

// A stored value as fp32: itself, or a 16-bit one widened (exactly).
__device__ inline float widen(float x) {
  return x;
}
__device__ inline float widen(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ inline float widen(__half x) {
  return __half2float(x);
}

// kVec consecutive values at p as one 8- or 16-byte access (p aligned to it), widened to fp32 /
// rounded from fp32 (round_to); kVec = 1: a plain access. A streaming kernel whose threads each
// walk long runs keeps 4–8× the bytes in flight of one-element loads, which on an H100-class GPU
// (~3 MB must be in flight to reach its bandwidth) decides whether it streams at memory speed or
// waits on latency.
template <int kVec, typename T>
__device__ inline void load_pack(const T* p, float (&out)[kVec]) {
  constexpr int kBytes = kVec * static_cast<int>(sizeof(T));
  static_assert(kVec == 1 || kBytes == 8 || kBytes == 16, "one access of 8 or 16 bytes");
  if constexpr (kVec == 1) {
    out[0] = widen(*p);
  } else {
    T v[kVec];
#ifdef __CUDA_ARCH__
    if constexpr (kBytes == 16) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p);
      memcpy(v, &raw, kBytes);
    } else {
      const uint2 raw = *reinterpret_cast<const uint2*>(p);
      memcpy(v, &raw, kBytes);
    }
#else
    std::memcpy(static_cast<void*>(v), p, kBytes);
#endif
    for (int k = 0; k < kVec; ++k) out[k] = widen(v[k]);
  }
}

template <int kVec, typename T>
__device__ inline void store_pack(T* p, const float (&in)[kVec]) {
  constexpr int kBytes = kVec * static_cast<int>(sizeof(T));
  static_assert(kVec == 1 || kBytes == 8 || kBytes == 16, "one access of 8 or 16 bytes");
  if constexpr (kVec == 1) {
    round_to(*p, in[0]);
  } else {
    T v[kVec];
    for (int k = 0; k < kVec; ++k) round_to(v[k], in[k]);
#ifdef __CUDA_ARCH__
    if constexpr (kBytes == 16) {
      uint4 raw;
      memcpy(&raw, v, kBytes);
      *reinterpret_cast<uint4*>(p) = raw;
    } else {
      uint2 raw;
      memcpy(&raw, v, kBytes);
      *reinterpret_cast<uint2*>(p) = raw;
    }
#else
    std::memcpy(static_cast<void*>(p), v, kBytes);
#endif
  }
}

__device__ inline float block_max(float x, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  x = warp_max(x);
  __syncthreads();
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = lane < warps ? shared[lane] : -INFINITY;
  return warp_max(x);
}
#endif

}  // namespace loom::cuda
