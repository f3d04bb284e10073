// The GEMM shapes of one gpt2-124m training step (B·T = 1024 rows, d = 768, vocab 50304), timed
// single-threaded through one BLAS library chosen at compile time: OpenBLAS (USE_OPENBLAS), BLIS
// (USE_BLIS), oneDNN (USE_DNNL), Loom's AVX-512 kernel (USE_LOOM512,
// src/kernels/cpu/sgemm_avx512.cc), its bf16 kernel (USE_LOOM_BF16: operands rounded to bf16,
// fp32 sums; src/kernels/cpu/sgemm_bf16_avx512.cc) or the AVX2 experiment (USE_LOOM,
// loom_sgemm.cc). Built and run by bench/gemm/compare_libraries.sh, which compiles it once per
// library found on the machine; not part of the CMake build (the extra libraries are optional).
// Prints GFLOP/s per shape (best of 5) and the rate over the big shapes weighted by their time,
// which is what bounds a training step's speed. With the argument `split2`, every GEMM runs as two
// halves on two threads, split the way Loom's gemm() splits (the longer side of C, in multiples of
// 16), to see how far two threads can scale the GEMMs.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cstring>
#include <thread>
#if defined(USE_OPENBLAS)
#include <cblas.h>
static const char* name = "openblas";
static void sg(bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, 1.f, A, lda, B, ldb, beta, C, ldc);
}
#elif defined(USE_LOOM512)
#include "kernels/cpu/sgemm_avx512.h"
static const char* name = "loom512";
static void sg(bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B,
               int ldb, float beta, float* C, int ldc) {
  loom::cpu::sgemm_avx512(ta, tb, M, N, K, 1.f, A, lda, B, ldb, beta, C, ldc);
}
#elif defined(USE_LOOM_BF16)
#include "kernels/cpu/sgemm_bf16_avx512.h"
static const char* name = "loom-bf16";
static void sg(bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B,
               int ldb, float beta, float* C, int ldc) {
  loom::cpu::sgemm_bf16_avx512(ta, tb, M, N, K, 1.f, A, lda, B, ldb, beta, C, ldc);
}
#elif defined(USE_LOOM)
#include "loom_sgemm.h"
static const char* name = "loom";
static void sg(bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  loom::cpu::sgemm_avx2(ta, tb, M, N, K, 1.f, A, lda, B, ldb, beta, C, ldc);
}
#elif defined(USE_BLIS)
#include <blis.h>
static const char* name = "blis";
static void sg(bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  float one = 1.f;
  bli_sgemm(ta ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, tb ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, M, N, K, &one,
            (float*)A, lda, 1, (float*)B, ldb, 1, &beta, C, ldc, 1);
}
#else
#include <dnnl.h>
static const char* name = "onednn";
static void sg(bool ta, bool tb, int M, int N, int K, const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, 1.f, A, lda, B, ldb, beta, C, ldc);
}
#endif
struct S { const char* what; bool ta, tb; int M, N, K; float beta; };

// C's rows (or columns, when N > M) in two halves of whole 16-wide tiles, one per thread.
static void split2(const S& s, const float* A, int lda, const float* B, int ldb, float* C, int ldc) {
  auto half = [&](int i) {
    if (s.M >= s.N) {
      const int tiles = (s.M + 15) / 16, m0 = std::min(s.M, tiles * i / 2 * 16),
                m1 = std::min(s.M, tiles * (i + 1) / 2 * 16);
      const float* A0 = s.ta ? A + m0 : A + size_t(m0) * lda;
      sg(s.ta, s.tb, m1 - m0, s.N, s.K, A0, lda, B, ldb, s.beta, C + size_t(m0) * ldc, ldc);
    } else {
      const int tiles = (s.N + 15) / 16, n0 = std::min(s.N, tiles * i / 2 * 16),
                n1 = std::min(s.N, tiles * (i + 1) / 2 * 16);
      const float* B0 = s.tb ? B + size_t(n0) * ldb : B + n0;
      sg(s.ta, s.tb, s.M, n1 - n0, s.K, A, lda, B0, ldb, s.beta, C + n0, ldc);
    }
  };
  std::thread other(half, 1);
  half(0);
  other.join();
}

int main(int argc, char** argv) {
  const bool two = argc > 1 && std::strcmp(argv[1], "split2") == 0;
#if defined(USE_OPENBLAS)
  openblas_set_num_threads(1);
#endif
  const int BT = 1024, C = 768, V = 50304;
  S shapes[] = {
    {"qkv fwd NT", 0, 1, BT, 3 * C, C, 0}, {"fc fwd NT", 0, 1, BT, 4 * C, C, 0}, {"proj fwd NT", 0, 1, BT, C, 4 * C, 0},
    {"lmhead fwd NT", 0, 1, BT, V, C, 0},
    {"fc dinp NN", 0, 0, BT, C, 4 * C, 0}, {"proj dinp NN", 0, 0, BT, 4 * C, C, 0}, {"lmhead dinp NN", 0, 0, BT, C, V, 0},
    {"fc dW TN", 1, 0, 4 * C, C, BT, 1}, {"proj dW TN", 1, 0, C, 4 * C, BT, 1}, {"lmhead dW TN", 1, 0, V, C, BT, 1},
    {"attn S NT 256x256x64", 0, 1, 256, 256, 64, 0}, {"attn O NN 256x64x256", 0, 0, 256, 64, 256, 0},
  };
  std::vector<float> a(size_t(V) * 3072), b(size_t(V) * 3072), c(size_t(V) * 3072);
  for (size_t i = 0; i < a.size(); ++i) { a[i] = (i % 13) * 0.01f; b[i] = (i % 7) * 0.02f; c[i] = 0; }
  double tot_t = 0, tot_f = 0;
  for (auto& s : shapes) {
    if (two && s.M == 256) continue;  // per-head attention GEMMs run whole, one per thread
    int lda = s.ta ? s.M : s.K, ldb = s.tb ? s.K : s.N, ldc = s.N;
    double best = 1e30;
    int reps = 5;
    for (int r = 0; r < reps; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      int inner = (s.M == 256) ? 200 : 1;
      for (int i = 0; i < inner; ++i) {
        if (two) split2(s, a.data(), lda, b.data(), ldb, c.data(), ldc);
        else sg(s.ta, s.tb, s.M, s.N, s.K, a.data(), lda, b.data(), ldb, s.beta, c.data(), ldc);
      }
      double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / inner;
      best = std::min(best, t);
    }
    double f = 2.0 * s.M * s.N * s.K;
    if (s.M != 256) { tot_t += best; tot_f += f; }
    printf("%-8s %s %-22s %6.1f GFLOP/s  %8.2f ms\n", name, two ? "2 thr" : "1 thr", s.what,
           f / best * 1e-9, best * 1e3);
  }
  printf("%-8s %s big shapes combined %6.1f GFLOP/s\n", name, two ? "2 thr" : "1 thr",
         tot_f / tot_t * 1e-9);
}
