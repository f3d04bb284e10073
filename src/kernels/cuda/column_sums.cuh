// out[c] += Σ_r value(r, c) over the rows r of an N × C matrix, in a fixed order: the bias and
// LayerNorm parameter gradients. Two passes: blocks of 32 columns × 8 row lanes reduce chunks of
// kRowsPerChunk rows into partial sums (lane order fixed), then one thread per column adds the
// chunks' partials in chunk order. No atomics, so the bits never depend on timing.
//
// value(r, c) returns a float (out: float*), or a ColumnPair of two terms summed side by side
// (out: ColumnPairOut), two gradients from one pass over the operands they share — each sum
// bit for bit what its own pass would give.
#pragma once

#include <utility>

#include "kernels/cuda/launch.cuh"

namespace loom::cuda {

inline constexpr int64_t kRowsPerChunk = 256;

struct ColumnPair {
  float first, second;  // no initialisers: a __shared__ array of them must be trivial
};
struct ColumnPairOut {
  float* first;
  float* second;
};

#if defined(__CUDACC__) || defined(LOOM_CUDA_EMULATE)
__device__ inline ColumnPair operator+(ColumnPair a, ColumnPair b) {
  return {a.first + b.first, a.second + b.second};
}
__device__ inline void add_column_total(float* out, int64_t c, float total) {
  out[c] += total;
}
__device__ inline void add_column_total(ColumnPairOut out, int64_t c, ColumnPair total) {
  out.first[c] += total.first;
  out.second[c] += total.second;
}
#endif

template <typename Sum, typename Value>
__global__ void column_partials_kernel(Sum* partials, Value value, int64_t N, int64_t C) {
  __shared__ Sum lanes[8][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowsPerChunk;
  const int64_t r1 = r0 + kRowsPerChunk < N ? r0 + kRowsPerChunk : N;
  Sum acc{};
  if (c < C)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) acc = acc + value(r, c);
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    Sum total = lanes[0][threadIdx.x];
    for (int y = 1; y < 8; ++y) total = total + lanes[y][threadIdx.x];
    partials[static_cast<int64_t>(blockIdx.y) * C + c] = total;
  }
}

template <typename Sum, typename Out>
__global__ void column_finish_kernel(Out out, const Sum* partials, int64_t chunks, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  Sum total{};
  for (int64_t k = 0; k < chunks; ++k) total = total + partials[k * C + c];
  add_column_total(out, c, total);
}

template <typename Out, typename Value>
void accumulate_column_sums(int device, Out out, Value value, int64_t N, int64_t C,
                            const char* name) {
  using Sum = decltype(std::declval<const Value&>()(int64_t{}, int64_t{}));
  if (N == 0 || C == 0) return;
  const int64_t chunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
  Scratch<Sum> partials(device, chunks * C);
  const dim3 grid(static_cast<unsigned>((C + 31) / 32), static_cast<unsigned>(chunks));
  launch(name, column_partials_kernel<Sum, Value>, grid, dim3(32, 8), partials.get(), value, N, C);
  launch(name, column_finish_kernel<Sum, Out>, static_cast<unsigned>((C + 255) / 256), 256, out,
         static_cast<const Sum*>(partials.get()), chunks, C);
}

}  // namespace loom::cuda
