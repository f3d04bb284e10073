#include "loom_sgemm.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>

#include <stdexcept>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LOOM_SGEMM_AVX2 1
#endif

namespace loom::cpu {

#ifdef LOOM_SGEMM_AVX2
namespace {

constexpr int64_t kMR = 6;    // rows of the micro-tile
constexpr int64_t kNR = 16;   // columns: two ymm
constexpr int64_t kKC = 256;  // depth of a packed block: A and B micro-panels fit L1 together
constexpr int64_t kMC = 144;  // rows of a packed A block (~147 KB, in L2)
constexpr int64_t kNC = 3072; // columns of a packed B block (~3 MB, in L3)

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};

// Per-thread packing buffers, allocated once (first touch is expensive on these VMs).
float* buffer(std::unique_ptr<float[], FreeDeleter>& slot, int64_t floats) {
  if (!slot) {
    slot.reset(static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>(floats) * 4)));
    if (!slot) throw std::runtime_error("sgemm: out of memory for packing buffers");
  }
  return slot.get();
}

// op(A) rows [i0, i0+mc) × depth [p0, p0+kc) into 6-row micro-panels, k-major inside each; rows
// past mc are zero.
void pack_a(const float* A, int64_t lda, bool trans, int64_t i0, int64_t mc, int64_t p0,
            int64_t kc, float* out) {
  for (int64_t ir = 0; ir < mc; ir += kMR) {
    const int64_t mr = std::min(kMR, mc - ir);
    float* panel = out + ir * kc;
    if (!trans) {
      const float* rows[kMR];
      for (int64_t r = 0; r < kMR; ++r) rows[r] = A + (i0 + ir + std::min(r, mr - 1)) * lda + p0;
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t r = 0; r < kMR; ++r) panel[k * kMR + r] = r < mr ? rows[r][k] : 0.0f;
    } else {
      // op(A)(i, k) = A[k][i]: the 6 rows of a k are contiguous in A.
      for (int64_t k = 0; k < kc; ++k) {
        const float* src = A + (p0 + k) * lda + i0 + ir;
        for (int64_t r = 0; r < kMR; ++r) panel[k * kMR + r] = r < mr ? src[r] : 0.0f;
      }
    }
  }
}

// rows[0..8)[k0, k0+8), transposed: out[kk·16 + r] = rows[r][k0 + kk] (a panel's 8 columns).
inline void transpose8_store(const float* const* rows, int64_t k0, float* out) {
  __m256 r0 = _mm256_loadu_ps(rows[0] + k0), r1 = _mm256_loadu_ps(rows[1] + k0);
  __m256 r2 = _mm256_loadu_ps(rows[2] + k0), r3 = _mm256_loadu_ps(rows[3] + k0);
  __m256 r4 = _mm256_loadu_ps(rows[4] + k0), r5 = _mm256_loadu_ps(rows[5] + k0);
  __m256 r6 = _mm256_loadu_ps(rows[6] + k0), r7 = _mm256_loadu_ps(rows[7] + k0);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_store_ps(out + 0 * kNR, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_store_ps(out + 1 * kNR, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_store_ps(out + 2 * kNR, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_store_ps(out + 3 * kNR, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_store_ps(out + 4 * kNR, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_store_ps(out + 5 * kNR, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_store_ps(out + 6 * kNR, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_store_ps(out + 7 * kNR, _mm256_permute2f128_ps(u3, u7, 0x31));
}

// op(B) depth [p0, p0+kc) × columns [j0, j0+nc) into 16-column micro-panels, k-major inside
// each; columns past nc are zero.
void pack_b(const float* B, int64_t ldb, bool trans, int64_t p0, int64_t kc, int64_t j0,
            int64_t nc, float* out) {
  for (int64_t jr = 0; jr < nc; jr += kNR) {
    const int64_t nr = std::min(kNR, nc - jr);
    float* panel = out + jr * kc;
    if (!trans) {
      for (int64_t k = 0; k < kc; ++k) {
        const float* src = B + (p0 + k) * ldb + j0 + jr;
        float* dst = panel + k * kNR;
        if (nr == kNR) {
          _mm256_store_ps(dst, _mm256_loadu_ps(src));
          _mm256_store_ps(dst + 8, _mm256_loadu_ps(src + 8));
        } else {
          for (int64_t c = 0; c < kNR; ++c) dst[c] = c < nr ? src[c] : 0.0f;
        }
      }
    } else {
      // op(B)(k, j) = B[j][k]: 16 rows of B, read along k, 8 × 8 blocks transposed in registers.
      const float* cols[kNR];
      for (int64_t c = 0; c < kNR; ++c)
        cols[c] = B + (j0 + jr + std::min(c, nr - 1)) * ldb + p0;
      int64_t k = 0;
      if (nr == kNR)
        for (; k + 8 <= kc; k += 8)
          for (int64_t h = 0; h < 2; ++h) transpose8_store(cols + 8 * h, k, panel + k * kNR + 8 * h);
      for (; k < kc; ++k)
        for (int64_t c = 0; c < kNR; ++c) panel[k * kNR + c] = c < nr ? cols[c][k] : 0.0f;
    }
  }
}

// The 6 × 16 tile of alpha·Ap·Bp over depth kc, added to beta·C (beta == 0: C is not read).
// Ap: kc × 6, Bp: kc × 16, both packed and 64-byte aligned.
inline void micro_kernel(int64_t kc, const float* Ap, const float* Bp, float alpha, float beta,
                         float* C, int64_t ldc) {
  // C's tile is far from the last one in memory (rows ldc apart): start fetching it now, so the
  // misses overlap the k loop instead of stalling the update at the end.
  for (int64_t r = 0; r < kMR; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(C + r * ldc), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(C + r * ldc + kNR - 1), _MM_HINT_T0);
  }
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
  __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
  __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
  __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
  __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
  __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(Bp), b1 = _mm256_load_ps(Bp + 8);
    __m256 a = _mm256_broadcast_ss(Ap + 0);
    c00 = _mm256_fmadd_ps(a, b0, c00);
    c01 = _mm256_fmadd_ps(a, b1, c01);
    a = _mm256_broadcast_ss(Ap + 1);
    c10 = _mm256_fmadd_ps(a, b0, c10);
    c11 = _mm256_fmadd_ps(a, b1, c11);
    a = _mm256_broadcast_ss(Ap + 2);
    c20 = _mm256_fmadd_ps(a, b0, c20);
    c21 = _mm256_fmadd_ps(a, b1, c21);
    a = _mm256_broadcast_ss(Ap + 3);
    c30 = _mm256_fmadd_ps(a, b0, c30);
    c31 = _mm256_fmadd_ps(a, b1, c31);
    a = _mm256_broadcast_ss(Ap + 4);
    c40 = _mm256_fmadd_ps(a, b0, c40);
    c41 = _mm256_fmadd_ps(a, b1, c41);
    a = _mm256_broadcast_ss(Ap + 5);
    c50 = _mm256_fmadd_ps(a, b0, c50);
    c51 = _mm256_fmadd_ps(a, b1, c51);
    Ap += kMR;
    Bp += kNR;
  }
  const __m256 va = _mm256_set1_ps(alpha);
  auto store = [&](float* row, __m256 lo, __m256 hi) {
    lo = _mm256_mul_ps(lo, va);
    hi = _mm256_mul_ps(hi, va);
    if (beta != 0.0f) {
      const __m256 vb = _mm256_set1_ps(beta);
      lo = _mm256_fmadd_ps(vb, _mm256_loadu_ps(row), lo);
      hi = _mm256_fmadd_ps(vb, _mm256_loadu_ps(row + 8), hi);
    }
    _mm256_storeu_ps(row, lo);
    _mm256_storeu_ps(row + 8, hi);
  };
  store(C + 0 * ldc, c00, c01);
  store(C + 1 * ldc, c10, c11);
  store(C + 2 * ldc, c20, c21);
  store(C + 3 * ldc, c30, c31);
  store(C + 4 * ldc, c40, c41);
  store(C + 5 * ldc, c50, c51);
}

// A partial tile: the full kernel into a scratch tile, then the valid mr × nr corner.
void edge_kernel(int64_t kc, const float* Ap, const float* Bp, float alpha, float beta, float* C,
                 int64_t ldc, int64_t mr, int64_t nr) {
  alignas(64) float tile[kMR * kNR];
  micro_kernel(kc, Ap, Bp, 1.0f, 0.0f, tile, kNR);
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t j = 0; j < nr; ++j) {
      const float ab = alpha * tile[i * kNR + j];
      C[i * ldc + j] = beta == 0.0f ? ab : std::fma(beta, C[i * ldc + j], ab);
    }
}

}  // namespace

bool sgemm_avx2_available() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

void sgemm_avx2(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                int64_t ldc) {
  if (!sgemm_avx2_available()) throw std::runtime_error("sgemm_avx2: this CPU lacks AVX2 + FMA");
  if (M == 0 || N == 0) return;
  thread_local std::unique_ptr<float[], FreeDeleter> a_slot, b_slot;
  float* Ap = buffer(a_slot, kMC * kKC);
  float* Bp = buffer(b_slot, kKC * kNC);
  for (int64_t j0 = 0; j0 < N; j0 += kNC) {
    const int64_t nc = std::min(kNC, N - j0);
    for (int64_t p0 = 0; p0 < K; p0 += kKC) {
      const int64_t kc = std::min(kKC, K - p0);
      // The first depth block applies the caller's beta; the others add to it.
      const float beta_here = p0 == 0 ? beta : 1.0f;
      pack_b(B, ldb, trans_b, p0, kc, j0, nc, Bp);
      for (int64_t i0 = 0; i0 < M; i0 += kMC) {
        const int64_t mc = std::min(kMC, M - i0);
        pack_a(A, lda, trans_a, i0, mc, p0, kc, Ap);
        for (int64_t jr = 0; jr < nc; jr += kNR) {
          const int64_t nr = std::min(kNR, nc - jr);
          for (int64_t ir = 0; ir < mc; ir += kMR) {
            const int64_t mr = std::min(kMR, mc - ir);
            float* Ct = C + (i0 + ir) * ldc + j0 + jr;
            if (mr == kMR && nr == kNR)
              micro_kernel(kc, Ap + ir * kc, Bp + jr * kc, alpha, beta_here, Ct, ldc);
            else
              edge_kernel(kc, Ap + ir * kc, Bp + jr * kc, alpha, beta_here, Ct, ldc, mr, nr);
          }
        }
      }
    }
  }
}

#else  // no AVX2 + FMA in this build

bool sgemm_avx2_available() { return false; }

void sgemm_avx2(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                const float*, int64_t, float, float*, int64_t) {
  throw std::runtime_error("sgemm_avx2: this build has no AVX2 + FMA kernel");
}

#endif

}  // namespace loom::cpu
