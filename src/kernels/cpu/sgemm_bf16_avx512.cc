#include "kernels/cpu/sgemm_bf16_avx512.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "base/error.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/gemm_avx512_parts.h"
#include "kernels/cpu/sgemm_avx512.h"

namespace loom::cpu {

bool has_avx512_bf16() {
#if defined(__x86_64__)
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0 && __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return yes;
#else
  return false;
#endif
}

Bf16Kernel bf16_kernel() {
  const char* env = std::getenv("LOOM_CPU_BF16_KERNEL");
  const std::string choice = env == nullptr ? "" : env;
  if (choice == "fma") return Bf16Kernel::kFmaOnRounded;
  if (choice == "dot") {
    if (!has_avx512_bf16())
      fail("LOOM_CPU_BF16_KERNEL=dot: this CPU lacks AVX512_BF16 (vdpbf16ps); unset it or set fma");
    return Bf16Kernel::kDotProduct;
  }
  if (!choice.empty())
    fail("LOOM_CPU_BF16_KERNEL='", choice, "': expected 'dot' (vdpbf16ps) or 'fma'");
#if defined(__x86_64__)
  // By vendor, not by timing the two, so that a run's bits never depend on a measurement: AMD's
  // Zen 4 and 5 run vdpbf16ps at twice their FMA rate; the Xeons we measured at half of it.
  __builtin_cpu_init();
  if (has_avx512_bf16() && __builtin_cpu_is("amd")) return Bf16Kernel::kDotProduct;
#endif
  return Bf16Kernel::kFmaOnRounded;
}

float round_to_bf16(float x) {
  uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    u |= 0x00400000u;  // NaN: quiet, never rounded into an infinity
  } else {
    u += 0x7FFFu + ((u >> 16) & 1u);  // to nearest, ties to even; overflow carries into Inf
  }
  u &= 0xFFFF0000u;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

#if defined(__x86_64__)
// GCC 12's unmasked AVX-512 conversions and inserts start from _mm512_undefined_*(), a
// self-initialised variable that -Wmaybe-uninitialized reports through every inlined call (a
// known false alarm).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace {

using namespace avx512_gemm;

// The register tile, as sgemm_avx512's: kMR rows of C (a broadcast pair of packed A each) × kNR
// columns (two zmm of packed B pairs), 24 accumulators.
constexpr int64_t kMR = 12;
constexpr int64_t kNR = 32;
// Depth in elements of k; packed, two to a 32-bit pair, so a panel holds what sgemm_avx512's
// holds at half its depth (the same bytes in L1 and L2).
constexpr int64_t kKC = 768;
constexpr int64_t kNC = 480;
constexpr int64_t kMC = 3072;
constexpr int64_t kPairsKC = kKC / 2;

// Pairs across two vectors: lane c = bf16(even[c]) in its low half, bf16(odd[c]) in its high
// half — depth k and k + 1 of one column, as vdpbf16ps takes them.
__attribute__((target("avx512f"))) inline __m512i interleaved_pairs(__m512 even, __m512 odd) {
  return _mm512_or_si512(shift_right_16(bf16_high(even)), bf16_high(odd));
}

// Pairs along one vector pair: 32 consecutive floats x[0..32) as 16 pairs (x[2m], x[2m+1]).
__attribute__((target("avx512f"))) inline __m512i consecutive_pairs(__m512 lo, __m512 hi) {
  const __m256i a = _mm512_cvtepi32_epi16(shift_right_16(bf16_high(lo)));
  const __m256i b = _mm512_cvtepi32_epi16(shift_right_16(bf16_high(hi)));
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
}

// The first n floats of x (n ≥ 0) as ceil(n / 2) pairs into out, an odd last element paired
// with zero.
__attribute__((target("avx512f"))) void row_to_pairs(const float* x, int64_t n, uint32_t* out) {
  for (int64_t k = 0; k < n; k += 32) {
    const __mmask16 lo = column_mask(n - k, 0), hi = column_mask(n - k, 16);
    const __m512i pairs =
        consecutive_pairs(_mm512_maskz_loadu_ps(lo, x + k), _mm512_maskz_loadu_ps(hi, x + k + 16));
    const int64_t count = std::min<int64_t>(16, (n - k + 1) / 2);
    _mm512_mask_storeu_epi32(out + k / 2, column_mask(count, 0), pairs);
  }
}

// `rows` rows of `width` pairs each (row r at scratch + r·stride) transposed into a micro-panel
// of `rows` columns: panel[p·rows + r] = row r's pair p. rows is kMR or kNR.
__attribute__((target("avx512f"))) void pairs_to_panel(const uint32_t* scratch, int64_t stride,
                                                       int64_t rows, int64_t width,
                                                       uint32_t* panel) {
  const float* row[kNR];
  for (int64_t r = 0; r < rows; ++r) row[r] = reinterpret_cast<const float*>(scratch + r * stride);
  float* out = reinterpret_cast<float*>(panel);
  int64_t p = 0;
  for (; p + 8 <= width; p += 8) {
    if (rows == kMR)
      transpose_12x8(row, p, out + p * kMR);
    else
      for (int64_t g = 0; g < rows / 8; ++g)
        transpose_8x8(row + 8 * g, p, out + p * rows + 8 * g, rows);
  }
  for (; p < width; ++p)
    for (int64_t r = 0; r < rows; ++r) panel[p * rows + r] = scratch[r * stride + p];
}

// A per-thread scratch of kNR rows of kPairsKC pairs, for the transposing packs.
uint32_t* pair_rows_scratch() {
  thread_local PackingSlot<uint32_t> slot;
  return packing_buffer(slot, kNR * kPairsKC);
}

// op(A) rows [i0, i0+mc) × depth [p0, p0+kc) into kMR-row micro-panels of pairs, pair-major
// inside each (panel[p·kMR + r] = (op(A)(r, 2p), op(A)(r, 2p+1))); rows past mc and the odd
// depth past kc are zero.
__attribute__((target("avx512f"))) void pack_a(const float* A, int64_t lda, bool trans, int64_t i0,
                                               int64_t mc, int64_t p0, int64_t kc, uint32_t* out) {
  const int64_t kcp = (kc + 1) / 2;
  if (trans) {
    // op(A)(i, k) = A[k][i]: depth rows k and k + 1 are runs of A, paired lane by lane.
    for (int64_t p = 0; p < kcp; ++p) {
      const float* even = A + (p0 + 2 * p) * lda + i0;
      const bool has_odd = 2 * p + 1 < kc;
      for (int64_t ir = 0; ir < mc; ir += kMR) {
        const __mmask16 m = column_mask(mc - ir, 0) & static_cast<__mmask16>((1u << kMR) - 1);
        const __m512 e = _mm512_maskz_loadu_ps(m, even + ir);
        const __m512 o = has_odd ? _mm512_maskz_loadu_ps(m, even + lda + ir) : _mm512_setzero_ps();
        _mm512_mask_storeu_epi32(out + ir * kcp + p * kMR, static_cast<__mmask16>((1u << kMR) - 1),
                                 interleaved_pairs(e, o));
      }
    }
    return;
  }
  // op(A)(i, k) = A[i][k]: each row's pairs are adjacent; paired row by row, then transposed.
  uint32_t* scratch = pair_rows_scratch();
  for (int64_t ir = 0; ir < mc; ir += kMR) {
    const int64_t mr = std::min(kMR, mc - ir);
    for (int64_t r = 0; r < kMR; ++r) {
      if (r < mr)
        row_to_pairs(A + (i0 + ir + r) * lda + p0, kc, scratch + r * kPairsKC);
      else
        std::fill(scratch + r * kPairsKC, scratch + r * kPairsKC + kcp, 0u);
    }
    pairs_to_panel(scratch, kPairsKC, kMR, kcp, out + ir * kcp);
  }
}

// op(B) depth [p0, p0+kc) × columns [j0, j0+nc) into kNR-column micro-panels of pairs,
// pair-major inside each (panel[p·kNR + c] = (op(B)(2p, c), op(B)(2p+1, c))); columns past nc
// and the odd depth past kc are zero.
__attribute__((target("avx512f"))) void pack_b(const float* B, int64_t ldb, bool trans, int64_t p0,
                                               int64_t kc, int64_t j0, int64_t nc, uint32_t* out) {
  const int64_t kcp = (kc + 1) / 2;
  uint32_t* scratch = trans ? pair_rows_scratch() : nullptr;
  for (int64_t jr = 0; jr < nc; jr += kNR) {
    const int64_t nr = std::min(kNR, nc - jr);
    uint32_t* panel = out + jr * kcp;
    if (!trans) {
      // op(B)(k, j) = B[k][j]: rows k and k + 1 paired lane by lane.
      const __mmask16 lo = column_mask(nr, 0), hi = column_mask(nr, 16);
      for (int64_t p = 0; p < kcp; ++p) {
        const float* even = B + (p0 + 2 * p) * ldb + j0 + jr;
        const bool has_odd = 2 * p + 1 < kc;
        const __m512 z = _mm512_setzero_ps();
        const __m512 e0 = _mm512_maskz_loadu_ps(lo, even),
                     e1 = _mm512_maskz_loadu_ps(hi, even + 16);
        const __m512 o0 = has_odd ? _mm512_maskz_loadu_ps(lo, even + ldb) : z;
        const __m512 o1 = has_odd ? _mm512_maskz_loadu_ps(hi, even + ldb + 16) : z;
        _mm512_store_si512(panel + p * kNR, interleaved_pairs(e0, o0));
        _mm512_store_si512(panel + p * kNR + 16, interleaved_pairs(e1, o1));
      }
    } else {
      // op(B)(k, j) = B[j][k]: column j's pairs are adjacent in row j; paired, then transposed.
      for (int64_t c = 0; c < kNR; ++c) {
        if (c < nr)
          row_to_pairs(B + (j0 + jr + c) * ldb + p0, kc, scratch + c * kPairsKC);
        else
          std::fill(scratch + c * kPairsKC, scratch + c * kPairsKC + kcp, 0u);
      }
      pairs_to_panel(scratch, kPairsKC, kNR, kcp, panel);
    }
  }
}

// The kMR × kNR tile alpha·Ap·Bp over kcp depth pairs, added to beta·C (beta == 0: C is not read)
// or, with a `bias` (the tile's columns of it; beta == 0), to the bias; only the top-left mr × nr
// corner is stored. Ap: kcp × kMR pairs, Bp: kcp × kNR pairs, packed, Bp 64-byte aligned.
#define LOOM_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define LOOM_ROW_ZERO(r) __m512 c##r##a = _mm512_setzero_ps(), c##r##b = _mm512_setzero_ps();
#define LOOM_ROW_STORE(r) \
  if (r < mr)             \
    store_row(C + r * ldc, c##r##a, c##r##b, va, vb, read_c, with_bias, bias_a, bias_b, lo, hi);
#define LOOM_TILE_STORE                                                                         \
  const __mmask16 lo = column_mask(nr, 0), hi = column_mask(nr, 16);                            \
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);                           \
  const bool read_c = beta != 0.0f, with_bias = bias != nullptr;                                \
  const __m512 bias_a = with_bias ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps();      \
  const __m512 bias_b = with_bias ? _mm512_maskz_loadu_ps(hi, bias + 16) : _mm512_setzero_ps(); \
  LOOM_ROWS(LOOM_ROW_STORE)

inline void prefetch_tile(const float* C, int64_t ldc, int64_t mr) {
  // C's rows are ldc apart and miss every cache level: fetch them while the k loop runs.
  for (int64_t r = 0; r < mr; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(C + r * ldc), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(C + r * ldc + kNR - 1), _MM_HINT_T0);
  }
}

__attribute__((target("avx512f,avx512bf16"))) void dot_kernel(int64_t kcp, const uint32_t* Ap,
                                                              const uint32_t* Bp, float alpha,
                                                              float beta, const float* bias,
                                                              float* C, int64_t ldc, int64_t mr,
                                                              int64_t nr) {
  prefetch_tile(C, ldc, mr);
#define LOOM_ROW_DOT(r)                                                      \
  {                                                                          \
    const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(Ap[r])); \
    c##r##a = _mm512_dpbf16_ps(c##r##a, a, b0);                              \
    c##r##b = _mm512_dpbf16_ps(c##r##b, a, b1);                              \
  }
  LOOM_ROWS(LOOM_ROW_ZERO)
  for (int64_t p = 0; p < kcp; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_load_si512(Bp), b1 = (__m512bh)_mm512_load_si512(Bp + 16);
    LOOM_ROWS(LOOM_ROW_DOT)
    Ap += kMR;
    Bp += kNR;
  }
  LOOM_TILE_STORE
#undef LOOM_ROW_DOT
}

#undef LOOM_TILE_STORE
#undef LOOM_ROW_STORE
#undef LOOM_ROW_ZERO
#undef LOOM_ROWS

}  // namespace

void sgemm_bf16_avx512(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                       const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
                       float* C, int64_t ldc, const float* bias, Bf16Kernel kernel) {
  if (!has_avx512f()) throw std::runtime_error("sgemm_bf16_avx512: this CPU lacks AVX-512 F");
  if (bias != nullptr && beta != 0.0f)
    throw std::runtime_error("sgemm_bf16_avx512: a bias needs beta == 0");
  if (M <= 0 || N <= 0 || K <= 0)
    throw std::runtime_error("sgemm_bf16_avx512: M, N and K must be positive");
  if (kernel == Bf16Kernel::kFmaOnRounded) {
    sgemm_avx512(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, bias,
                 /*round_operands_to_bf16=*/true);
    return;
  }
  if (!has_avx512_bf16())
    throw std::runtime_error("sgemm_bf16_avx512: the dot-product kernel needs AVX512_BF16");
  thread_local PackingSlot<uint32_t> a_slot, b_slot;
  uint32_t* Ap = packing_buffer(a_slot, kMC * kPairsKC);
  uint32_t* Bp = packing_buffer(b_slot, kPairsKC * kNC);
  for (int64_t i0 = 0; i0 < M; i0 += kMC) {
    const int64_t mc = std::min(kMC, M - i0);
    for (int64_t p0 = 0; p0 < K; p0 += kKC) {
      const int64_t kc = std::min(kKC, K - p0), kcp = (kc + 1) / 2;
      // The first depth block applies the caller's beta (or bias); the later ones add to it.
      const float beta_here = p0 == 0 ? beta : 1.0f;
      const float* bias_here = p0 == 0 ? bias : nullptr;
      pack_a(A, lda, trans_a, i0, mc, p0, kc, Ap);
      for (int64_t j0 = 0; j0 < N; j0 += kNC) {
        const int64_t nc = std::min(kNC, N - j0);
        pack_b(B, ldb, trans_b, p0, kc, j0, nc, Bp);
        for (int64_t ir = 0; ir < mc; ir += kMR) {
          const int64_t mr = std::min(kMR, mc - ir);
          float* Ct = C + (i0 + ir) * ldc + j0;
          for (int64_t jr = 0; jr < nc; jr += kNR) {
            const int64_t nr = std::min(kNR, nc - jr);
            const float* bias_tile = bias_here == nullptr ? nullptr : bias_here + j0 + jr;
            dot_kernel(kcp, Ap + ir * kcp, Bp + jr * kcp, alpha, beta_here, bias_tile, Ct + jr, ldc,
                       mr, nr);
          }
        }
      }
    }
  }
}

#else  // not x86-64

void sgemm_bf16_avx512(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t,
                       const float*, int64_t, float, float*, int64_t, const float*, Bf16Kernel) {
  throw std::runtime_error("sgemm_bf16_avx512: not an x86-64 build");
}

#endif

}  // namespace loom::cpu
