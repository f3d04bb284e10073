// Token + position embedding (the token rows alone where there is no position table: wpe and
// dwpe null). The backward is deterministic without atomics: dwpe has one thread per (t, c)
// summing over b in order; dwte has one thread per (channel, vocabulary partition): it walks all
// B·T tokens in order and adds the rows whose id falls in its partition, so each element of dwte
// has one owner and one order of additions, however often a token repeats.
#include "base/error.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/targets.h"

namespace loom::cuda {
namespace {

__global__ void first_bad_kernel(unsigned long long* first, const int32_t* ids, int64_t n,
                                 int64_t V, bool targets) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)
    if ((ids[i] < 0 || ids[i] >= V) && !(targets && ids[i] == kIgnoredTarget))
      atomicMin(first, static_cast<unsigned long long>(i));
}

__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const float* wte,
                                         const float* wpe, int64_t BT, int64_t T, int64_t C) {
  const int64_t n = BT * C;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t bt = i / C, c = i % C;
    const float te = wte[static_cast<int64_t>(tokens[bt]) * C + c];
    out[i] = wpe != nullptr ? te + wpe[(bt % T) * C + c] : te;
  }
}

__global__ void embedding_backward_wpe_kernel(float* dwpe, const float* dout, int64_t B, int64_t T,
                                              int64_t C) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // t·C + c
  if (i >= T * C) return;
  float acc = 0.0f;
  for (int64_t b = 0; b < B; ++b) acc += dout[b * T * C + i];
  dwpe[i] += acc;
}

// Thread (c, p): channel c of every vocabulary row v with v % kVocabPartitions == p. The walk
// over all B·T tokens is the kernel's cost (16384 at GPT-2's bench shape, each a dependent load
// and test): with kTokens = 4 it reads four ids in one 16-byte load (tokens aligned, BT a
// multiple of 4), then takes them in order — the same additions in the same order.
template <int kTokens>
__global__ void embedding_backward_wte_kernel(float* dwte, const float* dout, const int32_t* tokens,
                                              int64_t BT, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int p = static_cast<int>(blockIdx.y);
  if (c >= C) return;
  for (int64_t i0 = 0; i0 < BT; i0 += kTokens) {
    int32_t ids[kTokens];
    if constexpr (kTokens == 4) {
#ifdef __CUDA_ARCH__
      const int4 four = __ldg(reinterpret_cast<const int4*>(tokens + i0));
      ids[0] = four.x, ids[1] = four.y, ids[2] = four.z, ids[3] = four.w;
#else
      for (int k = 0; k < 4; ++k) ids[k] = tokens[i0 + k];
#endif
    } else {
      ids[0] = __ldg(tokens + i0);
    }
    for (int k = 0; k < kTokens; ++k) {
      const int32_t v = ids[k];
      if (v % kVocabPartitions == p)
        dwte[static_cast<int64_t>(v) * C + c] += dout[(i0 + k) * C + c];
    }
  }
}

__global__ void document_positions_kernel(int32_t* ids, const int32_t* starts,
                                          const int32_t* global, int64_t B, int64_t Tl, int64_t T) {
  const int64_t n = B * Tl;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
       k += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t b = k / Tl, i = k % Tl;
    const int64_t g = global != nullptr ? global[i] : i;
    ids[k] = static_cast<int32_t>(g - starts[b * T + g]);
  }
}

__global__ void window_starts_kernel(int32_t* out, const int32_t* starts, int64_t B, int64_t T,
                                     int64_t window) {
  const int64_t n = B * T;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
       k += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t first = starts != nullptr ? starts[k] : 0, from = k % T - window + 1;
    out[k] = static_cast<int32_t>(first > from ? first : from);
  }
}

__global__ void add_rows_by_id_kernel(float* out, const float* table, const int32_t* ids, int64_t N,
                                      int64_t C) {
  const int64_t n = N * C;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)
    out[i] += table[static_cast<int64_t>(ids[i / C]) * C + i % C];
}

}  // namespace

void document_positions(int device, int32_t* ids, const int32_t* starts, const int32_t* global,
                        int64_t B, int64_t Tl, int64_t T) {
  if (B * Tl == 0) return;
  DeviceGuard guard(device);
  launch("document_positions", document_positions_kernel, blocks_for(B * Tl, kThreads), kThreads,
         ids, starts, global, B, Tl, T);
}

void window_starts(int device, int32_t* out, const int32_t* starts, int64_t B, int64_t T,
                   int64_t window) {
  if (B * T == 0) return;
  DeviceGuard guard(device);
  launch("window_starts", window_starts_kernel, blocks_for(B * T, kThreads), kThreads, out, starts,
         B, T, window);
}

void add_rows_by_id(int device, float* out, const float* table, const int32_t* ids, int64_t N,
                    int64_t C) {
  if (N * C == 0) return;
  DeviceGuard guard(device);
  launch("add_rows_by_id", add_rows_by_id_kernel, blocks_for(N * C, kThreads), kThreads, out, table,
         ids, N, C);
}

int64_t first_out_of_range(const int32_t* ids, int64_t n, int64_t V, int32_t* bad, bool targets) {
  if (n == 0) return -1;
  int device = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&device));
  Scratch<unsigned long long> first(device, 1);
  const unsigned long long none = ~0ull;  // all 0xff bytes: queued, no wait
  LOOM_CUDA_CHECK(cudaMemsetAsync(first.get(), 0xff, sizeof none, nullptr));
  launch("first_bad_kernel", first_bad_kernel, blocks_for(n, kThreads), kThreads, first.get(), ids,
         n, V, targets);
  unsigned long long at = none;
  LOOM_CUDA_CHECK(cudaMemcpy(&at, first.get(), sizeof at, cudaMemcpyDeviceToHost));
  if (at == none) return -1;
  LOOM_CUDA_CHECK(cudaMemcpy(bad, ids + at, sizeof *bad, cudaMemcpyDeviceToHost));
  return static_cast<int64_t>(at);
}

void embedding_forward(int device, float* out, const int32_t* tokens, const float* wte,
                       const float* wpe, int64_t B, int64_t T, int64_t C, int64_t V,
                       bool ids_checked) {
  if (B * T == 0) return;
  DeviceGuard guard(device);
  int32_t bad = 0;
  if (const int64_t i = ids_checked ? -1 : first_out_of_range(tokens, B * T, V, &bad); i >= 0)
    fail("embedding: token id ", bad, " at batch ", i / T, ", position ", i % T,
         " is outside the vocabulary [0, ", V, ")");
  launch("embedding_forward", embedding_forward_kernel, blocks_for(B * T * C, kThreads), kThreads,
         out, tokens, wte, wpe, B * T, T, C);
}

void embedding_backward(int device, float* dwte, float* dwpe, const float* dout,
                        const int32_t* tokens, int64_t B, int64_t T, int64_t C) {
  if (B * T == 0) return;
  DeviceGuard guard(device);
  if (dwpe != nullptr)
    launch("embedding_backward (dwpe)", embedding_backward_wpe_kernel,
           static_cast<unsigned>((T * C + kThreads - 1) / kThreads), kThreads, dwpe, dout, B, T, C);
  const dim3 grid(static_cast<unsigned>((C + 127) / 128), kVocabPartitions);
  if ((B * T) % 4 == 0 && aligned_to(tokens, 16))
    launch("embedding_backward (dwte)", embedding_backward_wte_kernel<4>, grid, 128, dwte, dout,
           tokens, B * T, C);
  else
    launch("embedding_backward (dwte)", embedding_backward_wte_kernel<1>, grid, 128, dwte, dout,
           tokens, B * T, C);
}

}  // namespace loom::cuda
