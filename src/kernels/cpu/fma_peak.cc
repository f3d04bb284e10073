#include "kernels/cpu/fma_peak.h"

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "kernels/cpu/sgemm_bf16_avx512.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace loom::cpu {
namespace {

// 12 independent accumulators: enough to cover FMA latency (4–5 cycles) × 2 ports with room to
// spare. Each call does `iters` × 12 FMAs of `lanes` floats; returns a value depending on every
// accumulator so nothing is optimised away.
constexpr int kAcc = 12;

#if defined(__x86_64__)
// The sum of every lane of the accumulators. Not _mm512_reduce_add_ps: GCC 12 warns inside it
// (-Wuninitialized, a known false positive).
__attribute__((target("avx512f"))) float sum_of(const __m512 (&acc)[kAcc]) {
  __m512 s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm512_add_ps(s, acc[i]);
  float out[16];
  _mm512_storeu_ps(out, s);
  float sum = 0;
  for (float v : out) sum += v;
  return sum;
}

__attribute__((target("avx512f"))) float fma_loop_avx512(long iters) {
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (long n = 0; n < iters; ++n)
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  return sum_of(acc);
}

// The same with vdpbf16ps: each instruction 16 lanes × 2 bf16 products added (64 FLOPs).
__attribute__((target("avx512f,avx512bf16"))) float dot_loop_avx512_bf16(long iters) {
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3F803F80);  // (1.0, 1.0)
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x33D633D6);  // (~1e-7, ~1e-7)
  for (long n = 0; n < iters; ++n)
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  return sum_of(acc);
}

__attribute__((target("avx2,fma"))) float fma_loop_avx2(long iters) {
  __m256 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (long n = 0; n < iters; ++n)
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < kAcc; ++i) s = _mm256_add_ps(s, acc[i]);
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}
#endif

float fma_loop_scalar(long iters) {
  float acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = static_cast<float>(i) * 1e-3f;
  for (long n = 0; n < iters; ++n)
    for (int i = 0; i < kAcc; ++i) acc[i] = acc[i] * 0.999999f + 1e-7f;
  float s = 0;
  for (float a : acc) s += a;
  return s;
}

}  // namespace

FmaPeak measure_fma_peak(int threads, double seconds, PeakKind kind) {
  using Loop = float (*)(long);
  Loop loop = fma_loop_scalar;
  int lanes = 1;
  FmaPeak peak;
  peak.isa = "scalar";
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (kind == PeakKind::kBf16Gemm && bf16_kernel() == Bf16Kernel::kDotProduct) {
    loop = dot_loop_avx512_bf16;
    lanes = 32;  // bf16 products per instruction, each a multiply and an add
    peak.isa = "avx512-bf16";
  } else if (__builtin_cpu_supports("avx512f")) {
    loop = fma_loop_avx512;
    lanes = 16;
    peak.isa = "avx512";
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    loop = fma_loop_avx2;
    lanes = 8;
    peak.isa = "avx2";
  }
#endif
  if (threads < 1) threads = 1;
  // Every thread runs chunks of the loop until the deadline; FLOPs are counted per chunk done.
  constexpr long kChunk = 1 << 16;
  std::atomic<bool> stop{false};
  std::atomic<long> chunks{0};
  std::atomic<float> sink{0};
  std::vector<std::thread> pool;
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      float s = 0;
      long done = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        s += loop(kChunk);
        ++done;
      }
      chunks.fetch_add(done);
      sink.store(s);
    });
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (auto& t : pool) t.join();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double flops = static_cast<double>(chunks.load()) * kChunk * kAcc * lanes * 2.0;
  peak.gflops = flops / elapsed / 1e9;
  return peak;
}

}  // namespace loom::cpu
