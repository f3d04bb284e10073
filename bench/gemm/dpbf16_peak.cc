// The fp32 FMA rate against AVX512_BF16's dot product (vdpbf16ps: 16 lanes × 2 bf16 products a
// lane, 64 FLOPs an instruction against an FMA's 32) on one core, 24 independent accumulators
// each. Whether a bf16 compute path could beat fp32 on this CPU: on the Xeon of 2026-12-01 it
// could not (bench/README.md). g++ -O2 bench/gemm/dpbf16_peak.cc -o /tmp/dpbf16_peak
#include <immintrin.h>

#include <chrono>
#include <cstdio>

__attribute__((target("avx512f,avx512bf16"))) double dpbf16_gflops(long iters) {
  __m512 c[24];
  for (auto& x : c) x = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3f003f00);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; i++) {
#pragma GCC unroll 24
    for (int j = 0; j < 24; j++) c[j] = _mm512_dpbf16_ps(c[j], a, b);
    __asm__ volatile("" : "+v"(a));
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float t = 0;
  for (auto& x : c) t += _mm512_reduce_add_ps(x);
  if (t == 1) std::puts("");
  return iters * 24.0 * 64 / s / 1e9;
}

__attribute__((target("avx512f"))) double fma_gflops(long iters) {
  __m512 c[24];
  for (auto& x : c) x = _mm512_setzero_ps();
  __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(0.5f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < iters; i++) {
#pragma GCC unroll 24
    for (int j = 0; j < 24; j++) c[j] = _mm512_fmadd_ps(a, b, c[j]);
    __asm__ volatile("" : "+v"(a));
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float t = 0;
  for (auto& x : c) t += _mm512_reduce_add_ps(x);
  if (t == 1) std::puts("");
  return iters * 24.0 * 32 / s / 1e9;
}

int main() {
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::puts("this CPU lacks AVX512_BF16");
    return 1;
  }
  for (int r = 0; r < 3; r++)
    std::printf("fp32 FMA %.1f GFLOP/s   vdpbf16ps %.1f GFLOP/s\n", fma_gflops(50000000),
                dpbf16_gflops(50000000));
}
