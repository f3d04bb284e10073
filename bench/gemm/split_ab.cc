// Row split vs column split of C across two threads, interleaved, best of N
// (bench/gemm/split_ab.sh).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "base/thread_pool.h"
#include "kernels/cpu/gemm.h"
using namespace loom;
void run(ThreadPool& pool, bool rows, bool ta, bool tb, int M, int N, int K, const float* A,
         int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  const int64_t T = 16;
  if (rows)
    pool.parallel_for((M + T - 1) / T, 1, [&](int64_t t0, int64_t t1) {
      const int64_t m0 = t0 * T, m1 = std::min<int64_t>(M, t1 * T);
      cpu::gemm_serial<float>(ta, tb, m1 - m0, N, K, 1.f, ta ? A + m0 : A + m0 * lda, lda, B, ldb,
                              beta, C + m0 * ldc, ldc);
    });
  else
    pool.parallel_for((N + T - 1) / T, 1, [&](int64_t t0, int64_t t1) {
      const int64_t n0 = t0 * T, n1 = std::min<int64_t>(N, t1 * T);
      cpu::gemm_serial<float>(ta, tb, M, n1 - n0, K, 1.f, A, lda, tb ? B + n0 * ldb : B + n0, ldb,
                              beta, C + n0, ldc);
    });
}
int main() {
  const int BT = 1024, C = 768, V = 50304;
  struct S {
    const char* w;
    bool ta, tb;
    int M, N, K;
    float beta;
  };
  S shapes[] = {{"qkv fwd NT", 0, 1, BT, 3 * C, C, 1},   {"fc fwd NT", 0, 1, BT, 4 * C, C, 1},
                {"proj fwd NT", 0, 1, BT, C, 4 * C, 1},  {"fc dinp NN", 0, 0, BT, C, 4 * C, 0},
                {"proj dinp NN", 0, 0, BT, 4 * C, C, 0}, {"fc dW TN", 1, 0, 4 * C, C, BT, 1},
                {"proj dW TN", 1, 0, C, 4 * C, BT, 1},   {"lmhead fwd NT", 0, 1, BT, V, C, 0},
                {"lmhead dinp NN", 0, 0, BT, C, V, 0},   {"lmhead dW TN", 1, 0, V, C, BT, 1}};
  std::vector<float> a(size_t(V) * BT, 0.01f), b(size_t(V) * C, 0.02f), c(size_t(V) * BT, 0.f);
  ThreadPool p1(1), p2(2);
  for (auto& s : shapes) {
    int lda = s.ta ? s.M : s.K, ldb = s.tb ? s.K : s.N, ldc = s.N;
    double f = 2.0 * s.M * s.N * s.K;
    double b1 = 1e30, br = 1e30, bc = 1e30;
    int rounds = f > 1e10 ? 3 : 9;
    for (int r = 0; r < rounds; r++) {
      auto t0 = std::chrono::steady_clock::now();
      run(p1, true, s.ta, s.tb, s.M, s.N, s.K, a.data(), lda, b.data(), ldb, s.beta, c.data(), ldc);
      auto t1 = std::chrono::steady_clock::now();
      run(p2, true, s.ta, s.tb, s.M, s.N, s.K, a.data(), lda, b.data(), ldb, s.beta, c.data(), ldc);
      auto t2 = std::chrono::steady_clock::now();
      run(p2, false, s.ta, s.tb, s.M, s.N, s.K, a.data(), lda, b.data(), ldb, s.beta, c.data(),
          ldc);
      auto t3 = std::chrono::steady_clock::now();
      b1 = std::min(b1, std::chrono::duration<double>(t1 - t0).count());
      br = std::min(br, std::chrono::duration<double>(t2 - t1).count());
      bc = std::min(bc, std::chrono::duration<double>(t3 - t2).count());
    }
    printf("%-16s 1T %6.1f | 2T rows %6.1f (x%.2f)  cols %6.1f (x%.2f) GFLOP/s\n", s.w,
           f / b1 / 1e9, f / br / 1e9, b1 / br, f / bc / 1e9, b1 / bc);
  }
}
