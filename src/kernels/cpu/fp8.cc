#include "kernels/cpu/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "base/check.h"
#include "kernels/cpu/gemm.h"

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

void quantize_fp8_blocks(ThreadPool& pool, float* out, int64_t ld_out, const float* in,
                         int64_t ld_in, int64_t rows, int64_t cols, int64_t block_rows,
                         int64_t block_cols) {
  LOOM_CHECK(block_rows > 0 && block_cols > 0 && rows >= 0 && cols >= 0);
  LOOM_CHECK(ld_in >= cols && ld_out >= cols);
  const int64_t row_blocks = (rows + block_rows - 1) / block_rows;
  const int64_t col_blocks = (cols + block_cols - 1) / block_cols;
  // Each task a band of block rows: its blocks' largest |values| in one sweep along the rows,
  // then the quantized values in a second.
  pool.parallel_for(row_blocks, 1, [&](int64_t rb0, int64_t rb1) {
    std::vector<float> amax(static_cast<size_t>(col_blocks));
    std::vector<char> finite(static_cast<size_t>(col_blocks));
    std::vector<float> scale(static_cast<size_t>(col_blocks));
    for (int64_t rb = rb0; rb < rb1; ++rb) {
      const int64_t r0 = rb * block_rows, r1 = std::min(rows, r0 + block_rows);
      std::fill(amax.begin(), amax.end(), 0.0f);
      std::fill(finite.begin(), finite.end(), char{1});
      for (int64_t r = r0; r < r1; ++r) {
        const float* row = in + r * ld_in;
        for (int64_t cb = 0; cb < col_blocks; ++cb) {
          float m = amax[cb];
          bool ok = finite[cb] != 0;
          const int64_t c1 = std::min(cols, (cb + 1) * block_cols);
          for (int64_t c = cb * block_cols; c < c1; ++c) {
            const float a = std::fabs(row[c]);
            m = std::max(m, a);
            ok = ok && std::isfinite(a);
          }
          amax[cb] = m;
          finite[cb] = ok ? 1 : 0;
        }
      }
      for (int64_t cb = 0; cb < col_blocks; ++cb)
        scale[cb] = finite[cb] != 0 && amax[cb] > 0 ? block_scale(amax[cb]) : 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        const float* row = in + r * ld_in;
        float* dst = out + r * ld_out;
        for (int64_t cb = 0; cb < col_blocks; ++cb) {
          const int64_t c0 = cb * block_cols, c1 = std::min(cols, c0 + block_cols);
          const float s = scale[cb];
          if (s == 0.0f) {  // zeros, or a block with an infinity or NaN: as it is
            std::copy(row + c0, row + c1, dst + c0);
            continue;
          }
          const float inv = 1.0f / s;  // a power of two: exact
          for (int64_t c = c0; c < c1; ++c) dst[c] = round_to_e4m3(row[c] * s) * inv;
        }
      }
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
  float* xq = scratch(x_buffer, N * C);
  quantize_fp8_blocks(pool, dq, OC, dout, OC, N, OC, block, 1);
  quantize_fp8_blocks(pool, xq, C, inp, C, N, C, block, 1);
  gemm<float>(pool, true, false, OC, C, N, 1, dq, OC, xq, C, 1, dweight, C);
  if (dbias != nullptr) bias_backward(pool, dbias, dout, N, OC);  // from the fp32 dout
}

}  // namespace loom::cpu
