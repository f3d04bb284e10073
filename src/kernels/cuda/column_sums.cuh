// out[c] += Σ_r value(r, c) over the rows r of an N × C matrix, in a fixed order: the bias and
// LayerNorm parameter gradients. Two passes: blocks of 32 columns × 8 row lanes reduce chunks of
// kRowsPerChunk rows into partial sums (lane order fixed), then one thread per column adds the
// chunks' partials in chunk order. No atomics, so the bits never depend on timing.
#pragma once

#include "kernels/cuda/launch.cuh"

namespace loom::cuda {

inline constexpr int64_t kRowsPerChunk = 256;

template <typename Value>
__global__ void column_partials_kernel(float* partials, Value value, int64_t N, int64_t C) {
  __shared__ float lanes[8][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowsPerChunk;
  const int64_t r1 = r0 + kRowsPerChunk < N ? r0 + kRowsPerChunk : N;
  float acc = 0.0f;
  if (c < C)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) acc += value(r, c);
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float total = lanes[0][threadIdx.x];
    for (int y = 1; y < 8; ++y) total += lanes[y][threadIdx.x];
    partials[static_cast<int64_t>(blockIdx.y) * C + c] = total;
  }
}

__global__ inline void column_finish_kernel(float* out, const float* partials, int64_t chunks,
                                            int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float total = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) total += partials[k * C + c];
  out[c] += total;
}

template <typename Value>
void accumulate_column_sums(int device, float* out, Value value, int64_t N, int64_t C,
                            const char* name) {
  if (N == 0 || C == 0) return;
  const int64_t chunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
  Scratch<float> partials(device, chunks * C);
  const dim3 grid(static_cast<unsigned>((C + 31) / 32), static_cast<unsigned>(chunks));
  launch(name, column_partials_kernel<Value>, grid, dim3(32, 8), partials.get(), value, N, C);
  launch(name, column_finish_kernel, static_cast<unsigned>((C + 255) / 256), 256, out,
         partials.get(), chunks, C);
}

}  // namespace loom::cuda
