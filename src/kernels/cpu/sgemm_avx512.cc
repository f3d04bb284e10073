#include "kernels/cpu/sgemm_avx512.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <stdexcept>

#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/gemm_avx512_parts.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace loom::cpu {

#if defined(__x86_64__)
namespace {

using namespace avx512_gemm;

// The register tile: kMR rows of C (broadcast from packed A) × kNR columns (two zmm of packed B).
// 24 accumulators cover the FMA latency (4 cycles) × 2 ports three times over, and leave 8
// registers for the two B vectors and the broadcasts.
constexpr int64_t kMR = 12;
constexpr int64_t kNR = 32;
// Cache blocking, BLIS-style with the roles as this tile needs them: one A micro-panel (kMR × kKC,
// 18 KB; or kMR rows of A read in place, see sgemm_avx512()) stays in L1 while the kernel walks the
// B micro-panels of a packed B block (kKC × kNC, 720 KB, in L2); the packed A block (kMC × kKC, up
// to 4.5 MB) lives in L3. Sizes measured on a Xeon with 48 KB L1 and 2 MB L2 a core
// (bench/README.md): kKC 192–768 and kNC 320–960 all land within 3% of each other, kKC = 384 and
// kNC = 480 a little ahead.
constexpr int64_t kKC = 384;
constexpr int64_t kNC = 480;   // 15 micro-panels
constexpr int64_t kMC = 3072;  // 256 micro-panels

// op(A) rows [i0, i0+mc) × depth [p0, p0+kc) into kMR-row micro-panels, k-major inside each
// (panel[k·kMR + r]); rows past mc are zero.
__attribute__((target("avx512f"))) void pack_a(const float* A, int64_t lda, bool trans, int64_t i0,
                                               int64_t mc, int64_t p0, int64_t kc, float* out) {
  if (trans) {
    // op(A)(i, k) = A[k][i]: depth row k of the block is one contiguous run of A, read once
    // from start to end and dealt out kMR floats to each panel. (Panel by panel instead, each
    // panel would read kc rows lda apart, one TLB entry and a short stream each.)
    for (int64_t k = 0; k < kc; ++k) {
      const float* src = A + (p0 + k) * lda + i0;
      for (int64_t ir = 0; ir < mc; ir += kMR) {
        const int64_t mr = std::min(kMR, mc - ir);
        const __m512 v = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << mr) - 1), src + ir);
        _mm512_mask_storeu_ps(out + ir * kc + k * kMR, static_cast<__mmask16>((1u << kMR) - 1), v);
      }
    }
    return;
  }
  for (int64_t ir = 0; ir < mc; ir += kMR) {
    const int64_t mr = std::min(kMR, mc - ir);
    float* panel = out + ir * kc;
    // op(A)(i, k) = A[i][k]: kMR rows read along k side by side.
    const float* rows[kMR];
    for (int64_t r = 0; r < kMR; ++r) rows[r] = A + (i0 + ir + std::min(r, mr - 1)) * lda + p0;
    if (mr == kMR) {
      int64_t k = 0;
      for (; k + 8 <= kc; k += 8) transpose_12x8(rows, k, panel + k * kMR);
      for (; k < kc; ++k)
        for (int64_t r = 0; r < kMR; ++r) panel[k * kMR + r] = rows[r][k];
    } else {
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t r = 0; r < kMR; ++r) panel[k * kMR + r] = r < mr ? rows[r][k] : 0.0f;
    }
  }
}

// op(B) depth [p0, p0+kc) × columns [j0, j0+nc) into kNR-column micro-panels, k-major inside
// each (panel[k·kNR + c]); columns past nc are zero.
__attribute__((target("avx512f"))) void pack_b(const float* B, int64_t ldb, bool trans, int64_t p0,
                                               int64_t kc, int64_t j0, int64_t nc, float* out) {
  for (int64_t jr = 0; jr < nc; jr += kNR) {
    const int64_t nr = std::min(kNR, nc - jr);
    float* panel = out + jr * kc;
    if (!trans) {
      // op(B)(k, j) = B[k][j]: a k's columns are contiguous; masked loads stop at column nr.
      const __mmask16 lo = column_mask(nr, 0), hi = column_mask(nr, 16);
      for (int64_t k = 0; k < kc; ++k) {
        const float* src = B + (p0 + k) * ldb + j0 + jr;
        _mm512_store_ps(panel + k * kNR, _mm512_maskz_loadu_ps(lo, src));
        _mm512_store_ps(panel + k * kNR + 16, _mm512_maskz_loadu_ps(hi, src + 16));
      }
    } else {
      // op(B)(k, j) = B[j][k]: kNR rows of B read along k, 8 × 8 blocks transposed in registers.
      const float* cols[kNR];
      for (int64_t c = 0; c < kNR; ++c) cols[c] = B + (j0 + jr + std::min(c, nr - 1)) * ldb + p0;
      int64_t k = 0;
      if (nr == kNR)
        for (; k + 8 <= kc; k += 8)
          for (int64_t g = 0; g < kNR / 8; ++g)
            transpose_8x8(cols + 8 * g, k, panel + k * kNR + 8 * g, kNR);
      for (; k < kc; ++k)
        for (int64_t c = 0; c < kNR; ++c) panel[k * kNR + c] = c < nr ? cols[c][k] : 0.0f;
    }
  }
}

// The kMR × kNR tile alpha·op(A)·Bp over depth kc, added to beta·C (beta == 0: C is not read)
// or, with a `bias` (the tile's kNR columns of it; beta == 0), to the bias, of which only the
// top-left mr × nr corner is stored. Bp: kc × kNR, packed, 64-byte aligned.
// op(A)'s rows come from a packed micro-panel (kc × kMR, lda unused) or, kDirectA, straight from
// A as stored: row r at A + r·lda (rows from mr on read row mr - 1 again; their sums are dropped).
template <bool kDirectA>
__attribute__((target("avx512f"))) void micro_kernel(int64_t kc, const float* A, int64_t lda,
                                                     const float* Bp, float alpha, float beta,
                                                     const float* bias, float* C, int64_t ldc,
                                                     int64_t mr, int64_t nr) {
  const float* a_row[kMR];
  if constexpr (kDirectA)
    for (int64_t r = 0; r < kMR; ++r) a_row[r] = A + std::min(r, mr - 1) * lda;
  // C's rows are ldc apart and miss every cache level: start fetching them now, so the misses
  // overlap the k loop instead of stalling the update at the end.
  for (int64_t r = 0; r < mr; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(C + r * ldc), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(C + r * ldc + kNR - 1), _MM_HINT_T0);
  }
  // Written out rather than as an array in a loop, so no compiler keeps an accumulator in memory.
#define LOOM_ROW_ZERO(r) __m512 c##r##a = _mm512_setzero_ps(), c##r##b = _mm512_setzero_ps();
#define LOOM_ROW_FMA(r)                                             \
  {                                                                 \
    const __m512 a = _mm512_set1_ps(kDirectA ? a_row[r][k] : A[r]); \
    c##r##a = _mm512_fmadd_ps(a, b0, c##r##a);                      \
    c##r##b = _mm512_fmadd_ps(a, b1, c##r##b);                      \
  }
#define LOOM_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
  LOOM_ROWS(LOOM_ROW_ZERO)
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_load_ps(Bp), b1 = _mm512_load_ps(Bp + 16);
    LOOM_ROWS(LOOM_ROW_FMA)
    if constexpr (!kDirectA) A += kMR;
    Bp += kNR;
  }
  const __mmask16 lo = column_mask(nr, 0), hi = column_mask(nr, 16);
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  const bool read_c = beta != 0.0f, with_bias = bias != nullptr;
  const __m512 bias_a = with_bias ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps();
  const __m512 bias_b = with_bias ? _mm512_maskz_loadu_ps(hi, bias + 16) : _mm512_setzero_ps();
#define LOOM_ROW_STORE(r) \
  if (r < mr)             \
    store_row(C + r * ldc, c##r##a, c##r##b, va, vb, read_c, with_bias, bias_a, bias_b, lo, hi);
  LOOM_ROWS(LOOM_ROW_STORE)
#undef LOOM_ROW_STORE
#undef LOOM_ROWS
#undef LOOM_ROW_FMA
#undef LOOM_ROW_ZERO
}

}  // namespace

bool sgemm_avx512_reads_a_in_place(bool trans_a, int64_t N) {
  return !trans_a && N <= 1024;
}

void sgemm_avx512(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                  int64_t ldc, const float* bias, bool round_operands_to_bf16) {
  if (!has_avx512f()) throw std::runtime_error("sgemm_avx512: this CPU lacks AVX-512 F");
  if (bias != nullptr && beta != 0.0f)
    throw std::runtime_error("sgemm_avx512: a bias needs beta == 0");
  if (M <= 0 || N <= 0 || K <= 0)
    throw std::runtime_error("sgemm_avx512: M, N and K must be positive (the caller handles 0)");
  thread_local PackingSlot<float> a_slot, b_slot;
  float* Ap = packing_buffer(a_slot, kMC * kKC);
  float* Bp = packing_buffer(b_slot, kKC * kNC);
  // An untransposed A can be read in place: the kernel takes its rows as they are stored. That
  // saves packing A, which costs most where each packed row is used least — narrow products
  // (N = 768: 2–4% faster; one head's attention output: 30%); where N is wide, the packed
  // panel's one contiguous stream serves many B panels and comes out ahead. Measured with
  // bench/gemm/sgemm_ab.sh.
  const bool direct_a = !round_operands_to_bf16 && sgemm_avx512_reads_a_in_place(trans_a, N);
  for (int64_t i0 = 0; i0 < M; i0 += kMC) {
    const int64_t mc = std::min(kMC, M - i0);
    for (int64_t p0 = 0; p0 < K; p0 += kKC) {
      const int64_t kc = std::min(kKC, K - p0);
      // The first depth block applies the caller's beta (or bias); the later ones add to it.
      const float beta_here = p0 == 0 ? beta : 1.0f;
      const float* bias_here = p0 == 0 ? bias : nullptr;
      if (!direct_a) pack_a(A, lda, trans_a, i0, mc, p0, kc, Ap);
      // Rounded where packed, in cache: the panels are (mc rounded up to kMR) × kc floats.
      if (round_operands_to_bf16) round_to_bf16_in_place(Ap, (mc + kMR - 1) / kMR * kMR * kc);
      for (int64_t j0 = 0; j0 < N; j0 += kNC) {
        const int64_t nc = std::min(kNC, N - j0);
        pack_b(B, ldb, trans_b, p0, kc, j0, nc, Bp);
        if (round_operands_to_bf16) round_to_bf16_in_place(Bp, (nc + kNR - 1) / kNR * kNR * kc);
        for (int64_t ir = 0; ir < mc; ir += kMR) {
          const int64_t mr = std::min(kMR, mc - ir);
          float* Ct = C + (i0 + ir) * ldc + j0;
          for (int64_t jr = 0; jr < nc; jr += kNR) {
            const int64_t nr = std::min(kNR, nc - jr);
            const float* bias_tile = bias_here == nullptr ? nullptr : bias_here + j0 + jr;
            if (direct_a)
              micro_kernel<true>(kc, A + (i0 + ir) * lda + p0, lda, Bp + jr * kc, alpha, beta_here,
                                 bias_tile, Ct + jr, ldc, mr, nr);
            else
              micro_kernel<false>(kc, Ap + ir * kc, 0, Bp + jr * kc, alpha, beta_here, bias_tile,
                                  Ct + jr, ldc, mr, nr);
          }
        }
      }
    }
  }
}

void sgemm_avx512(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                  int64_t ldc) {
  sgemm_avx512(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, nullptr);
}

#else  // not x86-64

bool sgemm_avx512_reads_a_in_place(bool, int64_t) {
  return false;
}

void sgemm_avx512(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                  int64_t, float, float*, int64_t, const float*, bool) {
  throw std::runtime_error("sgemm_avx512: not an x86-64 build");
}

void sgemm_avx512(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                  int64_t, float, float*, int64_t) {
  throw std::runtime_error("sgemm_avx512: not an x86-64 build");
}

#endif

}  // namespace loom::cpu
