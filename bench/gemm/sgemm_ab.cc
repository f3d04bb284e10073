// Two builds of Loom's AVX-512 SGEMM (src/kernels/cpu/sgemm_avx512.cc) timed against each other
// in one process: every GEMM shape of a gpt2-124m layer runs A then B, nine times, and the best
// of each counts. This VM's speed drifts by 10–30% between minutes, so timing two binaries one
// after the other cannot resolve a few percent; interleaved best-of-9 in one process can (an
// A/A run agrees to 0.1%). Built and run by bench/gemm/sgemm_ab.sh.
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
  };
  S shapes[] = {
      {"qkv fwd NT", 0, 1, BT, 3 * C, C, 0},   {"fc fwd NT", 0, 1, BT, 4 * C, C, 0},
      {"proj fwd NT", 0, 1, BT, C, 4 * C, 0},  {"fc dinp NN", 0, 0, BT, C, 4 * C, 0},
      {"proj dinp NN", 0, 0, BT, 4 * C, C, 0}, {"fc dW TN", 1, 0, 4 * C, C, BT, 1},
      {"proj dW TN", 1, 0, C, 4 * C, BT, 1},
  };
  std::vector<float> a(size_t(4 * C) * 3072), b(size_t(4 * C) * 3072), c(size_t(4 * C) * 3072);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = (i % 13) * 0.01f;
    b[i] = (i % 7) * 0.02f;
    c[i] = 0;
  }
  double ta_ = 0, tb_ = 0, f_ = 0;
  for (auto& s : shapes) {
    int lda = s.ta ? s.M : s.K, ldb = s.tb ? s.K : s.N, ldc = s.N;
    double bestA = 1e30, bestB = 1e30;
    for (int r = 0; r < 9; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      loom_a::cpu::sgemm_avx512(s.ta, s.tb, s.M, s.N, s.K, 1.f, a.data(), lda, b.data(), ldb,
                                s.beta, c.data(), ldc);
      auto t1 = std::chrono::steady_clock::now();
      loom_b::cpu::sgemm_avx512(s.ta, s.tb, s.M, s.N, s.K, 1.f, a.data(), lda, b.data(), ldb,
                                s.beta, c.data(), ldc);
      auto t2 = std::chrono::steady_clock::now();
      bestA = std::min(bestA, std::chrono::duration<double>(t1 - t0).count());
      bestB = std::min(bestB, std::chrono::duration<double>(t2 - t1).count());
    }
    double f = 2.0 * s.M * s.N * s.K;
    f_ += f;
    ta_ += bestA;
    tb_ += bestB;
    printf("%-14s A %6.1f  B %6.1f GFLOP/s\n", s.what, f / bestA * 1e-9, f / bestB * 1e-9);
  }
  printf("combined A %6.1f  B %6.1f GFLOP/s\n", f_ / ta_ * 1e-9, f_ / tb_ * 1e-9);
}
