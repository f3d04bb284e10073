#include "kernels/cpu/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "base/check.h"
#include "kernels/cpu/cpu_features.h"
#include "kernels/cpu/gemm.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace loom::cpu {
namespace {

uint32_t bits_of(float x) {
  uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

float float_of(uint32_t u) {
  float x = 0;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// The power of two s with amax · s ≤ 448 < amax · 2s (amax > 0, finite), kept a normal float.
float block_scale(float amax) {
  int k = static_cast<int>(std::floor(std::log2(static_cast<double>(kE4m3Max) / amax)));
  if (static_cast<double>(amax) * std::ldexp(1.0, k) > kE4m3Max) --k;  // log2's last bit
  if (static_cast<double>(amax) * std::ldexp(1.0, k + 1) <= kE4m3Max) ++k;
  return std::ldexp(1.0f, std::clamp(k, -126, 126));
}

// A per-thread buffer of at least n floats, reused across calls (fresh pages cost ~11 µs each on
// the VMs we run on).
float* scratch(std::vector<float>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(static_cast<size_t>(n));
  return buffer.data();
}

}  // namespace

float round_to_e4m3(float x) {
  if (std::isnan(x)) return x;
  const float a = std::fabs(x);
  float r = 0;
  if (a >= 0x1p-6f) {  // normal: keep 3 of the 23 mantissa bits, to nearest even
    uint32_t u = bits_of(a);
    u += 0x7FFFFu + ((u >> 20) & 1u);
    r = float_of(u & 0xFFF00000u);
    if (!(r <= kE4m3Max)) r = kE4m3Max;  // saturate (an infinity too)
  } else {                               // subnormal: multiples of 2^-9, to nearest even
    r = std::nearbyint(a * 512.0f) * 0x1p-9f;
  }
  return std::copysign(r, x);
}

namespace {

#if defined(__x86_64__)
// GCC 12's unmasked AVX-512 intrinsics start from _mm512_undefined_*(), which
// -Wmaybe-uninitialized reports through every inlined call (a known false alarm; as in
// sgemm_bf16_avx512.cc).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// dst[c] = round_to_e4m3(row[c] · scale[c]) · inverse[c] for c < n, 16 lanes at a time; where
// scale[c] is 0 (a block of zeros, or with an infinity or NaN) the value is copied. The same
// operations as the scalar path, lane by lane: the same bits.
__attribute__((target("avx512f"))) void quantize_row_avx512(float* dst, const float* row,
                                                            const float* scale,
                                                            const float* inverse, int64_t n) {
  const __m512 min_normal = _mm512_set1_ps(0x1p-6f), max = _mm512_set1_ps(kE4m3Max);
  const __m512i sign = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = static_cast<__mmask16>(n - c >= 16 ? 0xFFFFu : (1u << (n - c)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(m, row + c);
    const __m512 s = _mm512_maskz_loadu_ps(m, scale + c);
    const __m512 y = _mm512_mul_ps(x, s);
    const __m512i yi = _mm512_castps_si512(y);
    const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, yi));
    // Normal: 3 of 23 mantissa bits, to nearest even, saturated at 448.
    const __m512i u = _mm512_castps_si512(a);
    const __m512i lsb =
        _mm512_and_si512(_mm512_maskz_srli_epi32(0xFFFF, u, 20), _mm512_set1_epi32(1));
    const __m512i r =
        _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFFF)), lsb),
                         _mm512_set1_epi32(static_cast<int>(0xFFF00000u)));
    const __m512 normal = _mm512_min_ps(_mm512_castsi512_ps(r), max);
    // Subnormal: multiples of 2^-9, to nearest even.
    const __m512 sub =
        _mm512_mul_ps(_mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(512.0f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                      _mm512_set1_ps(0x1p-9f));
    const __m512 q =
        _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, min_normal, _CMP_GE_OQ), sub, normal);
    const __m512 signed_q =
        _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(q), _mm512_and_si512(sign, yi)));
    __m512 out = _mm512_mul_ps(signed_q, _mm512_maskz_loadu_ps(m, inverse + c));
    out = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_EQ_OQ), out, x);
    _mm512_mask_storeu_ps(dst + c, m, out);
  }
}
#endif

void quantize_row(float* dst, const float* row, const float* scale, const float* inverse,
                  int64_t n) {
#if defined(__x86_64__)
  if (has_avx512f()) return quantize_row_avx512(dst, row, scale, inverse, n);
#endif
  for (int64_t c = 0; c < n; ++c)
    dst[c] = scale[c] == 0.0f ? row[c] : round_to_e4m3(row[c] * scale[c]) * inverse[c];
}

}  // namespace

void quantize_fp8_blocks(ThreadPool& pool, float* out, int64_t ld_out, const float* in,
                         int64_t ld_in, int64_t rows, int64_t cols, int64_t block_rows,
                         int64_t block_cols) {
  LOOM_CHECK(block_rows > 0 && block_cols > 0 && rows >= 0 && cols >= 0);
  LOOM_CHECK(ld_in >= cols && ld_out >= cols);
  const int64_t row_blocks = (rows + block_rows - 1) / block_rows;
  // Each task a band of block rows: each column's largest |value| over the band's rows in one
  // sweep (vectorised along the row), reduced to its blocks' and spread back as a scale per
  // column; then the quantized values in a second sweep. One code path for 1 × b, b × 1 and
  // b × b blocks.
  pool.parallel_for(row_blocks, 1, [&](int64_t rb0, int64_t rb1) {
    std::vector<float> col_max(static_cast<size_t>(cols));
    std::vector<float> scale(static_cast<size_t>(cols)), inverse(static_cast<size_t>(cols));
    for (int64_t rb = rb0; rb < rb1; ++rb) {
      const int64_t r0 = rb * block_rows, r1 = std::min(rows, r0 + block_rows);
      std::fill(col_max.begin(), col_max.end(), 0.0f);
      for (int64_t r = r0; r < r1; ++r) {
        const float* row = in + r * ld_in;
        // Not std::max: a NaN must win (it marks the block to be copied), and |x| > m is false
        // for it; m < |x| || |x| != |x| keeps it.
        for (int64_t c = 0; c < cols; ++c) {
          const float a = std::fabs(row[c]);
          col_max[c] = (a > col_max[c] || a != a) ? a : col_max[c];
        }
      }
      for (int64_t c0 = 0; c0 < cols; c0 += block_cols) {
        const int64_t c1 = std::min(cols, c0 + block_cols);
        float amax = 0;
        for (int64_t c = c0; c < c1; ++c)
          amax = (col_max[c] > amax || col_max[c] != col_max[c]) ? col_max[c] : amax;
        const float s = std::isfinite(amax) && amax > 0 ? block_scale(amax) : 0.0f;
        std::fill(scale.begin() + c0, scale.begin() + c1, s);
        std::fill(inverse.begin() + c0, inverse.begin() + c1, s == 0.0f ? 0.0f : 1.0f / s);
      }
      for (int64_t r = r0; r < r1; ++r)
        quantize_row(out + r * ld_out, in + r * ld_in, scale.data(), inverse.data(), cols);
    }
  });
}

void matmul_forward_fp8(ThreadPool& pool, float* out, const float* inp, const float* weight,
                        const float* bias, int64_t N, int64_t C, int64_t OC, int64_t block) {
  thread_local std::vector<float> x_buffer, w_buffer;
  float* xq = scratch(x_buffer, N * C);
  float* wq = scratch(w_buffer, OC * C);
  quantize_fp8_blocks(pool, xq, C, inp, C, N, C, 1, block);
  quantize_fp8_blocks(pool, wq, C, weight, C, OC, C, block, block);
  gemm<float>(pool, false, true, N, OC, C, 1, xq, C, wq, C, 0, out, OC, bias);
}

void matmul_backward_fp8(ThreadPool& pool, float* dinp, float* dweight, float* dbias,
                         const float* dout, const float* inp, const float* weight, int64_t N,
                         int64_t C, int64_t OC, int64_t block) {
  thread_local std::vector<float> d_buffer, x_buffer, w_buffer;
  float* dq = scratch(d_buffer, N * OC);
  if (dinp != nullptr) {  // dinp (N, C) = dout (N, OC) · weight (OC, C), contraction over OC
    float* wq = scratch(w_buffer, OC * C);
    quantize_fp8_blocks(pool, dq, OC, dout, OC, N, OC, 1, block);
    quantize_fp8_blocks(pool, wq, C, weight, C, OC, C, block, block);
    gemm<float>(pool, false, false, N, C, OC, 1, dq, OC, wq, C, 0, dinp, C);
  }
  // dweight (OC, C) += doutᵀ (OC, N) · inp (N, C), contraction over the N tokens.
  if (dweight != nullptr) {
    float* xq = scratch(x_buffer, N * C);
    quantize_fp8_blocks(pool, dq, OC, dout, OC, N, OC, block, 1);
    quantize_fp8_blocks(pool, xq, C, inp, C, N, C, block, 1);
    gemm<float>(pool, true, false, OC, C, N, 1, dq, OC, xq, C, 1, dweight, C);
  }
  if (dbias != nullptr) bias_backward(pool, dbias, dout, N, OC);  // from the fp32 dout
}

}  // namespace loom::cpu
