// Two builds of Loom's AVX-512 SGEMM (src/kernels/cpu/sgemm_avx512.cc) timed against each other
// in one process: every GEMM shape of a gpt2-124m layer (and the LM head's three and one head's
// attention products) runs A then B, several times, and the best of each counts. This VM's speed
// drifts by 10–30% between minutes, so timing two binaries one after the other cannot resolve a
// few percent; interleaved best-of-N in one process can (an A/A run agrees to 0.1–1%). Built and
// run by bench/gemm/sgemm_ab.sh.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>
namespace loom_a::cpu {
void sgemm_avx512(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                  int64_t, float, float*, int64_t);
}
namespace loom_b::cpu {
void sgemm_avx512(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                  int64_t, float, float*, int64_t);
}
int main() {
  const int BT = 1024, C = 768, V = 50304;
  struct S {
    const char* what;
    bool ta, tb;
    int M, N, K;
    float beta;
    int lda;  // 0: the row length
  };
  const S shapes[] = {
      {"qkv fwd NT", 0, 1, BT, 3 * C, C, 0, 0},
      {"fc fwd NT", 0, 1, BT, 4 * C, C, 0, 0},
      {"proj fwd NT", 0, 1, BT, C, 4 * C, 0, 0},
      {"fc dinp NN", 0, 0, BT, C, 4 * C, 0, 0},
      {"proj dinp NN", 0, 0, BT, 4 * C, C, 0, 0},
      {"fc dW TN", 1, 0, 4 * C, C, BT, 1, 0},
      {"proj dW TN", 1, 0, C, 4 * C, BT, 1, 0},
      {"lmhead fwd NT", 0, 1, BT, V, C, 0, 0},
      {"lmhead dinp NN", 0, 0, BT, C, V, 0, 0},
      {"lmhead dW TN", 1, 0, V, C, BT, 1, 0},
      // The last 64-row query block of one head at T = 256, head size 64, q inside qkv (row
      // stride 3C): its scores, then its output from the probabilities.
      {"attn S NT", 0, 1, 64, 256, 64, 0, 3 * C},
      {"attn O NN", 0, 0, 64, 64, 256, 0, 0},
  };
  std::vector<float> a(size_t(V) * BT), b(size_t(V) * C), c(size_t(V) * BT);
  for (size_t i = 0; i < a.size(); ++i) a[i] = (i % 13) * 0.01f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = (i % 7) * 0.02f;
  double time_a = 0, time_b = 0, flops = 0;
  for (const S& s : shapes) {
    const int lda = s.lda ? s.lda : (s.ta ? s.M : s.K), ldb = s.tb ? s.K : s.N, ldc = s.N;
    const double f = 2.0 * s.M * s.N * s.K;
    const int reps = f < 1e8 ? 200 : 1;   // small products: time many at once
    const int rounds = f > 1e10 ? 3 : 9;  // the LM head's take half a second each
    double best_a = 1e30, best_b = 1e30;
    for (int r = 0; r < rounds; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; ++i)
        loom_a::cpu::sgemm_avx512(s.ta, s.tb, s.M, s.N, s.K, 1.f, a.data(), lda, b.data(), ldb,
                                  s.beta, c.data(), ldc);
      const auto t1 = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; ++i)
        loom_b::cpu::sgemm_avx512(s.ta, s.tb, s.M, s.N, s.K, 1.f, a.data(), lda, b.data(), ldb,
                                  s.beta, c.data(), ldc);
      const auto t2 = std::chrono::steady_clock::now();
      best_a = std::min(best_a, std::chrono::duration<double>(t1 - t0).count() / reps);
      best_b = std::min(best_b, std::chrono::duration<double>(t2 - t1).count() / reps);
    }
    flops += f;
    time_a += best_a;
    time_b += best_b;
    std::printf("%-15s A %6.1f  B %6.1f GFLOP/s\n", s.what, f / best_a * 1e-9, f / best_b * 1e-9);
  }
  std::printf("combined        A %6.1f  B %6.1f GFLOP/s\n", flops / time_a * 1e-9,
              flops / time_b * 1e-9);
}
