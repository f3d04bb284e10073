// Parts shared by Loom's two AVX-512 GEMM kernels (sgemm_avx512.cc, fp32 FMAs, and
// sgemm_bf16_avx512.cc, bf16 dot products): packing buffers, 32-bit transposes for packing,
// masks for edge tiles and the store of a tile row into C. Internal to those two files.
#pragma once

#if defined(__x86_64__)

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <stdexcept>

namespace loom::cpu::avx512_gemm {

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using PackingSlot = std::unique_ptr<T[], FreeDeleter>;

// A packing buffer of this thread, allocated once. Huge pages where the kernel gives them: the
// first touch of fresh 4 KiB pages costs ~11 µs each on the VMs we run on.
template <typename T>
T* packing_buffer(PackingSlot<T>& slot, int64_t elements) {
  if (!slot) {
    constexpr size_t kHuge = size_t{2} << 20;
    const size_t bytes = (static_cast<size_t>(elements) * sizeof(T) + kHuge - 1) / kHuge * kHuge;
    slot.reset(static_cast<T*>(std::aligned_alloc(kHuge, bytes)));
    if (!slot) throw std::runtime_error("AVX-512 GEMM: out of memory for its packing buffers");
    madvise(slot.get(), bytes, MADV_HUGEPAGE);  // advice only: without it, 4 KiB pages
  }
  return slot.get();
}

// The lanes of columns [first, first+16) that lie below nr.
inline __mmask16 column_mask(int64_t nr, int64_t first) {
  const int64_t n = std::clamp<int64_t>(nr - first, 0, 16);
  return static_cast<__mmask16>(n == 16 ? 0xFFFFu : (1u << n) - 1);
}

// rows[0..8)[k0, k0+8) transposed into out[kk·stride + r] = rows[r][k0 + kk]: eight k-rows of
// eight rows of a micro-panel (stride = the panel's width). Moves 32-bit elements, whatever they
// hold (floats, or pairs of bf16).
__attribute__((target("avx512f"))) inline void transpose_8x8(const float* const* rows, int64_t k0,
                                                             float* out, int64_t stride) {
  const __m256 r0 = _mm256_loadu_ps(rows[0] + k0), r1 = _mm256_loadu_ps(rows[1] + k0);
  const __m256 r2 = _mm256_loadu_ps(rows[2] + k0), r3 = _mm256_loadu_ps(rows[3] + k0);
  const __m256 r4 = _mm256_loadu_ps(rows[4] + k0), r5 = _mm256_loadu_ps(rows[5] + k0);
  const __m256 r6 = _mm256_loadu_ps(rows[6] + k0), r7 = _mm256_loadu_ps(rows[7] + k0);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(out + 0 * stride, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(out + 1 * stride, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(out + 2 * stride, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(out + 3 * stride, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(out + 4 * stride, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(out + 5 * stride, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(out + 6 * stride, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(out + 7 * stride, _mm256_permute2f128_ps(u3, u7, 0x31));
}

// rows[0..12)[k0, k0+8) transposed into out[kk·12 + r] = rows[r][k0 + kk]: eight k-rows of a
// full 12-row micro-panel. Rows 0–7 through an 8 × 8 transpose, rows 8–11 through two 4 × 4.
__attribute__((target("avx512f"))) inline void transpose_12x8(const float* const* rows, int64_t k0,
                                                              float* out) {
  constexpr int64_t kRows = 12;
  transpose_8x8(rows, k0, out, kRows);
  for (int64_t half = 0; half < 8; half += 4) {
    __m128 a = _mm_loadu_ps(rows[8] + k0 + half), b = _mm_loadu_ps(rows[9] + k0 + half);
    __m128 c = _mm_loadu_ps(rows[10] + k0 + half), d = _mm_loadu_ps(rows[11] + k0 + half);
    _MM_TRANSPOSE4_PS(a, b, c, d);
    _mm_storeu_ps(out + (half + 0) * kRows + 8, a);
    _mm_storeu_ps(out + (half + 1) * kRows + 8, b);
    _mm_storeu_ps(out + (half + 2) * kRows + 8, c);
    _mm_storeu_ps(out + (half + 3) * kRows + 8, d);
  }
}

// One 32-wide row of a tile into C: alpha·(a, b) + beta·C, C read only when read_c, or,
// with_bias, alpha·(a, b) + (bias_a, bias_b).
__attribute__((target("avx512f"))) inline void store_row(float* row, __m512 a, __m512 b,
                                                         __m512 alpha, __m512 beta, bool read_c,
                                                         bool with_bias, __m512 bias_a,
                                                         __m512 bias_b, __mmask16 lo,
                                                         __mmask16 hi) {
  a = _mm512_mul_ps(a, alpha);
  b = _mm512_mul_ps(b, alpha);
  if (read_c) {
    a = _mm512_fmadd_ps(beta, _mm512_maskz_loadu_ps(lo, row), a);
    b = _mm512_fmadd_ps(beta, _mm512_maskz_loadu_ps(hi, row + 16), b);
  } else if (with_bias) {
    a = _mm512_add_ps(a, bias_a);
    b = _mm512_add_ps(b, bias_b);
  }
  _mm512_mask_storeu_ps(row, lo, a);
  _mm512_mask_storeu_ps(row + 16, hi, b);
}

// Each 32-bit lane shifted right by 16 bits. (The masked form: GCC 12's _mm512_srli_epi32 starts
// from _mm512_undefined_epi32(), which -Wmaybe-uninitialized reports through every inlined call.)
__attribute__((target("avx512f"))) inline __m512i shift_right_16(__m512i u) {
  return _mm512_maskz_srli_epi32(static_cast<__mmask16>(0xFFFF), u, 16);
}

// Each lane of x rounded to bf16 (to nearest, ties to even; a NaN stays a NaN), its 16 bits in
// the high half of the lane and the low half zero: the lane is then that bf16 as an fp32.
// (cpu::round_to_bf16 is the scalar reference.)
__attribute__((target("avx512f"))) inline __m512i bf16_high(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(shift_right_16(u), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

// The first n floats of x rounded to bf16 in place (still fp32s): a packed operand block.
__attribute__((target("avx512f"))) inline void round_to_bf16_in_place(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(x + i, _mm512_castsi512_ps(bf16_high(_mm512_loadu_ps(x + i))));
  if (i < n) {
    const __mmask16 m = column_mask(n - i, 0);
    _mm512_mask_storeu_ps(x + i, m,
                          _mm512_castsi512_ps(bf16_high(_mm512_maskz_loadu_ps(m, x + i))));
  }
}

}  // namespace loom::cpu::avx512_gemm

#endif  // __x86_64__
