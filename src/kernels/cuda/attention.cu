// Causal self-attention. With bf16 matmuls and head size 64 or 128 the fused kernels of
// flash_attention.cu run; otherwise (fp32 / TF32 / fp16, other head sizes) heads are split out
// of qkv into contiguous (B·NH, T, hd) tensors, scores go through batched cuBLASLt GEMMs into a
// (B·NH, T, T) scratch matrix, and a warp per row does the causal softmax. Same contract as the
// CPU kernel either way (out and lse kept, the backward recomputes the probabilities from lse).
//
// Backward, per head, with P = exp(S - lse) (zero above the diagonal) and D_i = Σ_d dO_id·O_id:
//   dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP - D) / sqrt(hd),  dQ = dS·K,  dK = dSᵀ·Q.
#include <algorithm>
#include <cmath>
#include <vector>

#include "base/error.h"
#include "kernels/cuda/flash_attention.h"
#include "kernels/cuda/key_runs.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

constexpr int kRowsPerBlock = 8;  // one warp per row

#define LOOM_FOR_EACH(i, n)                                                              \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

// Element (bh, t, d) of a (B·NH, T, hd) head tensor is column `part`·C + h·hd + d of row b·T + t
// of a (B·T, width) matrix: qkv has width 3C and parts 0, 1, 2; out and dout width C, part 0.
struct HeadIndex {
  int64_t T, C, NH, hd;
  __device__ int64_t operator()(int64_t i, int64_t width, int part) const {
    const int64_t d = i % hd, t = (i / hd) % T, bh = i / (hd * T);
    const int64_t b = bh / NH, h = bh % NH;
    return (b * T + t) * width + part * C + h * hd + d;
  }
};

__global__ void split_heads_kernel(float* q, float* k, float* v, const float* qkv, HeadIndex at,
                                   int64_t n) {
  LOOM_FOR_EACH(i, n) {
    q[i] = qkv[at(i, 3 * at.C, 0)];
    k[i] = qkv[at(i, 3 * at.C, 1)];
    v[i] = qkv[at(i, 3 * at.C, 2)];
  }
}

__global__ void merge_heads_kernel(float* dqkv, const float* dq, const float* dk, const float* dv,
                                   HeadIndex at, int64_t n) {
  LOOM_FOR_EACH(i, n) {
    dqkv[at(i, 3 * at.C, 0)] = dq[i];
    dqkv[at(i, 3 * at.C, 1)] = dk[i];
    dqkv[at(i, 3 * at.C, 2)] = dv[i];
  }
}

// heads (B·NH, T, hd) <-> rows (B·T, C)
__global__ void heads_to_rows_kernel(float* rows, const float* heads, HeadIndex at, int64_t n) {
  LOOM_FOR_EACH(i, n) rows[at(i, at.C, 0)] = heads[i];
}
__global__ void rows_to_heads_kernel(float* heads, const float* rows, HeadIndex at, int64_t n) {
  LOOM_FOR_EACH(i, n) heads[i] = rows[at(i, at.C, 0)];
}

// Row r of each head's (n_rows, keys) scores in place, the query at position first + r (the
// whole-sequence attention: n_rows = keys = Tq = T, first = at = 0): P_rj =
// exp(S_rj − lse) for the key rows j the row sees (mask: causal, and its document's with
// document masking), else 0; lse into lse[bh·Tq + at + r], bh = b·NH + h. A row that sees no key
// gets P = 0 and lse -inf. One warp per row.
__global__ void causal_softmax_kernel(float* S, float* lse, int64_t rows, int64_t n_rows,
                                      int64_t keys, int64_t first, int64_t Tq, int64_t at,
                                      KeyMask mask, int64_t NH) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t bh = row / n_rows, r = row % n_rows;
  const int64_t begin = mask.begin(bh / NH, first + r), end = mask.end(first + r);
  float* s = S + row * keys;
  float mx = -INFINITY;
  for (int64_t j = begin + lane; j < end; j += 32) mx = fmaxf(mx, s[j]);
  mx = warp_max(mx);
  float sum = 0.0f;
  for (int64_t j = begin + lane; j < end; j += 32) sum += expf(s[j] - mx);
  const float l = end > begin ? mx + logf(warp_sum(sum)) : -INFINITY;
  for (int64_t j = lane; j < keys; j += 32) s[j] = j >= begin && j < end ? expf(s[j] - l) : 0.0f;
  if (lane == 0) lse[bh * Tq + at + r] = l;
}
// The backward's P of those rows from the saved lse, in place over the recomputed scores.
__global__ void probabilities_kernel(float* S, const float* lse, int64_t rows, int64_t n_rows,
                                     int64_t keys, int64_t first, int64_t Tq, int64_t at,
                                     KeyMask mask, int64_t NH) {
  LOOM_FOR_EACH(e, rows * keys) {
    const int64_t row = e / keys, j = e % keys, bh = row / n_rows, r = row % n_rows;
    const bool seen = j >= mask.begin(bh / NH, first + r) && j < mask.end(first + r);
    S[e] = seen ? expf(S[e] - lse[bh * Tq + at + r]) : 0.0f;
  }
}
// D (B·NH·T) = Σ_d dout ∘ out per head row; one warp per row. `Out`: fp32, or the 16-bit type
// attention_forward_rounded wrote out in; `DO` likewise fp32, or bf16 for the flash kernels.
template <typename DO, typename Out>
__global__ void row_dot_kernel(float* D, const DO* dout, const Out* out, HeadIndex at,
                               int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  float acc = 0.0f;
  for (int64_t d = lane; d < at.hd; d += 32) {
    const int64_t e = at(row * at.hd + d, at.C, 0);
    acc += widen(dout[e]) * widen(out[e]);
  }
  acc = warp_sum(acc);
  if (lane == 0) D[row] = acc;
}

// dS = P ∘ (dP - D) · scale, in place over dP (P is zero above the diagonal, so is dS).
__global__ void softmax_backward_kernel(float* dP, const float* P, const float* D, float scale,
                                        int64_t rows, int64_t T) {
  LOOM_FOR_EACH(e, rows * T) {
    const int64_t row = e / T;
    dP[e] = P[e] * (dP[e] - D[row]) * scale;
  }
}

// Batched row-major GEMM over the B·NH heads: C_b = alpha·op(A_b)·op(B_b) (+ beta·C_b).
void head_gemm(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               GemmOperand A, int64_t lda, int64_t stride_a, GemmOperand B, int64_t ldb,
               int64_t stride_b, float* C, int64_t ldc, int64_t stride_c, int64_t heads) {
  gemm(device, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, 0.0f, C, ldc, nullptr,
       GemmBatch{heads, stride_a, stride_b, stride_c});
}

void check_shapes(int64_t C, int64_t NH) {
  if (NH <= 0 || C % NH != 0) fail("attention: channels ", C, " not divisible by heads ", NH);
}

// The key/value heads of a call: KV, 0 meaning NH. Shared ones (fewer than NH) are read in place
// by the flash kernels only; the batched-GEMM path takes (B, T, 3C).
int64_t kv_heads_of(const char* what, int64_t C, int64_t NH, int64_t KV, int64_t B) {
  if (KV == 0 || KV == NH) return NH;
  if (!flash_attention_applies(C, NH, B))
    fail(what, ": ", KV, " key/value heads for ", NH,
         " query heads are read in place by the flash kernels only (bf16, head size 64 or 128), which "
         "do not apply");
  return KV;
}

}  // namespace

void attention_forward(int device, float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                       int64_t C, int64_t NH, cpu::DocumentStarts docs, int64_t KV) {
  check_shapes(C, NH);
  KV = kv_heads_of("attention_forward", C, NH, KV, B);
  if (B * T == 0) return;
  if (flash_attention_applies(C, NH, B)) {
    flash_attention_forward(device, out, lse, qkv, B, T, C, NH, KV, docs);
    return;
  }
  DeviceGuard guard(device);
  const int64_t hd = C / NH, heads = B * NH, n = B * T * C;
  const HeadIndex at{T, C, NH, hd};
  Scratch<float> q(device, n), k(device, n), v(device, n), y(device, n);
  Scratch<float> S(device, heads * T * T);
  launch("attention_forward (split heads)", split_heads_kernel, blocks_for(n, kThreads), kThreads,
         q.get(), k.get(), v.get(), qkv, at, n);
  // S = Q·Kᵀ / sqrt(hd)
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  head_gemm(device, false, true, T, T, hd, scale, q.get(), hd, T * hd, k.get(), hd, T * hd, S.get(),
            T, T * T, heads);
  launch("attention_forward (softmax)", causal_softmax_kernel, blocks_of(heads * T, kRowsPerBlock),
         kRowsPerBlock * 32, S.get(), lse, heads * T, T, T, int64_t{0}, T, int64_t{0},
         KeyMask{KeyRuns{T}, docs}, NH);
  // Y = P·V
  head_gemm(device, false, false, T, hd, T, 1.0f, S.get(), T, T * T, v.get(), hd, T * hd, y.get(),
            hd, T * hd, heads);
  launch("attention_forward (merge heads)", heads_to_rows_kernel, blocks_for(n, kThreads), kThreads,
         out, y.get(), at, n);
}

namespace {

// attention_backward given D = rowsum(dout ∘ out) per head row (row_dot_kernel).
void attention_backward_given_D(int device, float* dqkv, const float* dout, const float* qkv,
                                const float* D, const float* lse, int64_t B, int64_t T, int64_t C,
                                int64_t NH, int64_t KV, cpu::DocumentStarts docs) {
  if (flash_attention_applies(C, NH, B)) {
    flash_attention_backward(device, dqkv, dout, qkv, lse, D, B, T, C, NH, KV, docs);
    return;
  }
  const int64_t hd = C / NH, heads = B * NH, n = B * T * C, rows = heads * T;
  const HeadIndex at{T, C, NH, hd};
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  Scratch<float> q(device, n), k(device, n), v(device, n), dy(device, n);
  Scratch<float> dq(device, n), dk(device, n), dv(device, n);
  Scratch<float> P(device, heads * T * T), dP(device, heads * T * T);

  launch("attention_backward (split heads)", split_heads_kernel, blocks_for(n, kThreads), kThreads,
         q.get(), k.get(), v.get(), qkv, at, n);
  launch("attention_backward (dout to heads)", rows_to_heads_kernel, blocks_for(n, kThreads),
         kThreads, dy.get(), dout, at, n);

  // q, k, dO and dS are each read by two GEMMs: rounded once (at bf16 / fp16).
  const RoundedOperand q16(device, q.get(), n), k16(device, k.get(), n), dy16(device, dy.get(), n);
  head_gemm(device, false, true, T, T, hd, scale, q16.operand(), hd, T * hd, k16.operand(), hd,
            T * hd, P.get(), T, T * T, heads);
  launch("attention_backward (P)", probabilities_kernel, blocks_for(rows * T, kThreads), kThreads,
         P.get(), lse, rows, T, T, int64_t{0}, T, int64_t{0}, KeyMask{KeyRuns{T}, docs}, NH);
  // dV = Pᵀ·dO
  head_gemm(device, true, false, T, hd, T, 1.0f, P.get(), T, T * T, dy16.operand(), hd, T * hd,
            dv.get(), hd, T * hd, heads);
  // dP = dO·Vᵀ, then dS in place
  head_gemm(device, false, true, T, T, hd, 1.0f, dy16.operand(), hd, T * hd, v.get(), hd, T * hd,
            dP.get(), T, T * T, heads);
  launch("attention_backward (dS)", softmax_backward_kernel, blocks_for(rows * T, kThreads),
         kThreads, dP.get(), P.get(), D, scale, rows, T);
  // dQ = dS·K, dK = dSᵀ·Q
  const RoundedOperand dS16(device, dP.get(), heads * T * T);
  head_gemm(device, false, false, T, hd, T, 1.0f, dS16.operand(), T, T * T, k16.operand(), hd,
            T * hd, dq.get(), hd, T * hd, heads);
  head_gemm(device, true, false, T, hd, T, 1.0f, dS16.operand(), T, T * T, q16.operand(), hd,
            T * hd, dk.get(), hd, T * hd, heads);
  launch("attention_backward (merge heads)", merge_heads_kernel, blocks_for(n, kThreads), kThreads,
         dqkv, dq.get(), dk.get(), dv.get(), at, n);
}

// D = rowsum(dout ∘ out) per head row into `D` (B·NH·T), `dout` of type DO, `out` of type Out.
template <typename DO, typename Out>
void row_dots(float* D, const DO* dout, const Out* out, int64_t B, int64_t T, int64_t C,
              int64_t NH) {
  const int64_t rows = B * NH * T;
  launch("attention_backward (D)", row_dot_kernel<DO, Out>, blocks_of(rows, kRowsPerBlock),
         kRowsPerBlock * 32, D, dout, out, HeadIndex{T, C, NH, C / NH}, rows);
}

// The backward writing dqkv in the 16-bit type of `out` (Out): by the flash kernels themselves
// where they apply, else the fp32 dqkv rounded.
template <typename Out>
void attention_backward_rounded_from(int device, void* dqkv, GemmOperand dout, GemmOperand qkv,
                                     const Out* out, const float* lse, int64_t B, int64_t T,
                                     int64_t C, int64_t NH, int64_t KV, cpu::DocumentStarts docs) {
  Scratch<float> D(device, B * NH * T);
  const bool dout_bf16 = dout.rounded_to == MatmulPrecision::kBf16;
  if (dout_bf16)
    row_dots(D.get(), static_cast<const __nv_bfloat16*>(dout.data), out, B, T, C, NH);
  else
    row_dots(D.get(), static_cast<const float*>(dout.data), out, B, T, C, NH);
  if (flash_attention_applies(C, NH, B)) {
    flash_attention_backward_bf16_dqkv(device, dqkv, dout.data, dout_bf16, qkv.data,
                                       qkv.rounded_to == MatmulPrecision::kBf16, lse, D.get(), B, T,
                                       C, NH, KV, docs);
    return;
  }
  Scratch<float> full(device, 3 * B * T * C);
  attention_backward_given_D(device, full.get(), static_cast<const float*>(dout.data),
                             static_cast<const float*>(qkv.data), D.get(), lse, B, T, C, NH, NH,
                             docs);
  (void)round_for_gemm(device, dqkv, full.get(), 3 * B * T * C);
}

// A 16-bit qkv or dout is for the flash kernels only (attention_takes_rounded_qkv).
void expect_usable_qkv(GemmOperand qkv, int64_t B, int64_t C, int64_t NH, const char* what,
                       const char* name = "qkv") {
  if (qkv.rounded_to == MatmulPrecision::kFp32) return;
  qkv.expect_usable_at(matmul_precision(), name);
  if (!attention_takes_rounded_qkv(C, NH, B))
    fail(what, ": a 16-bit ", name,
         " needs the flash kernels (bf16, head size 64 or 128), which do not apply");
}

}  // namespace

bool attention_takes_rounded_qkv(int64_t C, int64_t NH, int64_t B) {
  return flash_attention_applies(C, NH, B);
}

void attention_backward(int device, float* dqkv, const float* dout, const float* qkv,
                        const float* out, const float* lse, int64_t B, int64_t T, int64_t C,
                        int64_t NH, cpu::DocumentStarts docs, int64_t KV) {
  check_shapes(C, NH);
  KV = kv_heads_of("attention_backward", C, NH, KV, B);
  if (B * T == 0) return;
  DeviceGuard guard(device);
  Scratch<float> D(device, B * NH * T);
  row_dots(D.get(), dout, out, B, T, C, NH);
  attention_backward_given_D(device, dqkv, dout, qkv, D.get(), lse, B, T, C, NH, KV, docs);
}

GemmOperand attention_forward_rounded(int device, void* out, float* lse, GemmOperand qkv, int64_t B,
                                      int64_t T, int64_t C, int64_t NH, cpu::DocumentStarts docs,
                                      int64_t KV) {
  check_shapes(C, NH);
  KV = kv_heads_of("attention_forward_rounded", C, NH, KV, B);
  expect_usable_qkv(qkv, B, C, NH, "attention_forward_rounded");
  DeviceGuard guard(device);
  if (B * T > 0 && flash_attention_applies(C, NH, B)) {
    flash_attention_forward_bf16_out(device, out, lse, qkv.data,
                                     qkv.rounded_to == MatmulPrecision::kBf16, B, T, C, NH, KV,
                                     docs);
    return GemmOperand(out, MatmulPrecision::kBf16);
  }
  // The batched-GEMM path writes fp32: rounded after.
  Scratch<float> full(device, B * T * C);
  attention_forward(device, full.get(), lse, static_cast<const float*>(qkv.data), B, T, C, NH,
                    docs);
  return round_for_gemm(device, out, full.get(), B * T * C);
}

GemmOperand attention_backward_rounded(int device, void* dqkv, GemmOperand dout, GemmOperand qkv,
                                       GemmOperand out, const float* lse, int64_t B, int64_t T,
                                       int64_t C, int64_t NH, cpu::DocumentStarts docs,
                                       int64_t KV) {
  check_shapes(C, NH);
  KV = kv_heads_of("attention_backward_rounded", C, NH, KV, B);
  out.expect_usable_at(matmul_precision(), "out");
  expect_usable_qkv(qkv, B, C, NH, "attention_backward_rounded");
  expect_usable_qkv(dout, B, C, NH, "attention_backward_rounded", "dout");
  if (dout.rounded_to != MatmulPrecision::kFp32 && qkv.rounded_to == MatmulPrecision::kFp32)
    fail("attention_backward_rounded: a 16-bit dout needs a 16-bit qkv too");
  DeviceGuard guard(device);
  if (B * T > 0) {
    switch (out.rounded_to) {
      case MatmulPrecision::kBf16:
        attention_backward_rounded_from(device, dqkv, dout, qkv,
                                        static_cast<const __nv_bfloat16*>(out.data), lse, B, T, C,
                                        NH, KV, docs);
        break;
      case MatmulPrecision::kFp16:
        attention_backward_rounded_from(device, dqkv, dout, qkv,
                                        static_cast<const __half*>(out.data), lse, B, T, C, NH, KV,
                                        docs);
        break;
      case MatmulPrecision::kTf32:
      case MatmulPrecision::kFp32:
        fail("attention_backward_rounded: out is not a 16-bit operand");
    }
  }
  return GemmOperand(dqkv, out.rounded_to);
}

// ---- Context parallelism: the attention of some query rows --------------------------------------

namespace {

// q (B, Tq, ldq) → qh (B·NH, Tq, hd); kv (B, T, ldkv) → kh, vh (B·NH, T, hd), query head h
// reading key/value head h / (NH/KV).
__global__ void rows_split_q_kernel(float* qh, const float* q, int64_t ldq, int64_t Tq, int64_t NH,
                                    int64_t hd, int64_t n) {
  LOOM_FOR_EACH(i, n) {
    const int64_t d = i % hd, t = (i / hd) % Tq, bh = i / (hd * Tq);
    const int64_t b = bh / NH, h = bh % NH;
    qh[i] = q[(b * Tq + t) * ldq + h * hd + d];
  }
}
__global__ void rows_split_kv_kernel(float* kh, float* vh, const float* kv, int64_t ldkv, int64_t T,
                                     int64_t NH, int64_t KV, int64_t hd, int64_t n) {
  LOOM_FOR_EACH(i, n) {
    const int64_t d = i % hd, t = (i / hd) % T, bh = i / (hd * T);
    const int64_t b = bh / NH, g = (bh % NH) / (NH / KV);
    const float* row = kv + (b * T + t) * ldkv;
    kh[i] = row[g * hd + d];
    vh[i] = row[(KV + g) * hd + d];
  }
}
// dqh (B·NH, Tq, hd) → dq's columns [0, NH·hd) (B, Tq, ldq).
__global__ void rows_merge_dq_kernel(float* dq, int64_t ldq, const float* dqh, int64_t Tq,
                                     int64_t NH, int64_t hd, int64_t n) {
  LOOM_FOR_EACH(i, n) {
    const int64_t d = i % hd, t = (i / hd) % Tq, bh = i / (hd * Tq);
    const int64_t b = bh / NH, h = bh % NH;
    dq[(b * Tq + t) * ldq + h * hd + d] = dqh[i];
  }
}
// dkh, dvh (B·NH, T, hd) → dkv (B, T, ldkv): each key/value head the sum of its query heads', in
// ascending order. n = B·KV·T·hd.
__global__ void rows_merge_dkv_kernel(float* dkv, int64_t ldkv, const float* dkh, const float* dvh,
                                      int64_t T, int64_t NH, int64_t KV, int64_t hd, int64_t n) {
  LOOM_FOR_EACH(i, n) {
    const int64_t d = i % hd, t = (i / hd) % T, bg = i / (hd * T);
    const int64_t b = bg / KV, g = bg % KV, group = NH / KV;
    float k = 0.0f, v = 0.0f;
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const int64_t at = ((b * NH + h) * T + t) * hd + d;
      k += dkh[at];
      v += dvh[at];
    }
    float* row = dkv + (b * T + t) * ldkv;
    row[g * hd + d] = k;
    row[(KV + g) * hd + d] = v;
  }
}
// dS = P ∘ (dP − D) · scale over those rows, in place over dP.
__global__ void rows_softmax_backward_kernel(float* dP, const float* P, const float* D, float scale,
                                             int64_t rows, int64_t n_rows, int64_t keys, int64_t Tq,
                                             int64_t at) {
  LOOM_FOR_EACH(e, rows * keys) {
    const int64_t row = e / keys, bh = row / n_rows, r = row % n_rows;
    dP[e] = P[e] * (dP[e] - D[bh * Tq + at + r]) * scale;
  }
}
__global__ void copy_columns_to_bf16_kernel(__nv_bfloat16* dst, int64_t ld_dst, const float* src,
                                            int64_t ld_src, int64_t width, int64_t n) {
  LOOM_FOR_EACH(i, n) {
    round_to(dst[(i / width) * ld_dst + i % width], src[(i / width) * ld_src + i % width]);
  }
}
template <typename E>
__global__ void copy_columns_kernel(E* dst, int64_t ld_dst, const E* src, int64_t ld_src,
                                    int64_t width, int64_t n) {
  LOOM_FOR_EACH(i, n) dst[(i / width) * ld_dst + i % width] = src[(i / width) * ld_src + i % width];
}
// The ring's merge, cpu::attention_merge_rows' formula and order of operations: per (b, h, row)
// of out (B, Tq, NH·hd) and lse (B, NH, Tq), with m the larger lse, w = e^(lse − m) and pw =
// e^(part − m): out' = w/(w + pw)·out + pw/(w + pw)·part_out, lse' = m + log(w + pw). A part
// that saw no key (lse -inf) leaves the row; a row that had none takes the part. One thread a
// row.
__global__ void merge_rows_kernel(float* out, float* lse, const float* part_out,
                                  const float* part_lse, int64_t Tq, int64_t NH, int64_t hd,
                                  int64_t n) {
  LOOM_FOR_EACH(i, n) {  // i = (b·NH + h)·Tq + t: lse's index
    const int64_t t = i % Tq, bh = i / Tq, b = bh / NH, h = bh % NH;
    const float l = lse[i], pl = part_lse[i];
    if (pl == -INFINITY) continue;
    float* o = out + (b * Tq + t) * NH * hd + h * hd;
    const float* po = part_out + (b * Tq + t) * NH * hd + h * hd;
    if (l == -INFINITY) {
      for (int64_t d = 0; d < hd; ++d) o[d] = po[d];
      lse[i] = pl;
      continue;
    }
    const float m = fmaxf(l, pl);
    const float w = expf(l - m), pw = expf(pl - m), sum = w + pw;
    const float a = w / sum, pa = pw / sum;
    for (int64_t d = 0; d < hd; ++d) o[d] = a * o[d] + pa * po[d];
    lse[i] = m + logf(sum);
  }
}
// Rows [at, at + n) of each head's (Tq, hd) rows of y set to 0, and (lse non-null) their lse
// to -inf: a piece of rows that sees no key. e over heads × n × hd.
__global__ void fill_rows_kernel(float* y, float* lse, int64_t Tq, int64_t n, int64_t hd,
                                 int64_t at, int64_t count) {
  LOOM_FOR_EACH(e, count) {
    const int64_t d = e % hd, r = (e / hd) % n, bh = e / (hd * n);
    y[(bh * Tq + at + r) * hd + d] = 0.0f;
    if (lse != nullptr && d == 0) lse[bh * Tq + at + r] = -INFINITY;
  }
}

// The query rows cut into pieces whose scores (heads × rows × keys floats, a piece's keys the
// positions up to its last row) stay within attention_score_bytes(): a long sequence's scores
// would not fit a GPU's memory whole, and a piece whose rows come early sees fewer keys.
int64_t score_bytes = int64_t{256} << 20;
std::vector<cpu::RowRange> score_pieces(std::span<const cpu::RowRange> rows, int64_t heads) {
  std::vector<cpu::RowRange> out;
  for (const cpu::RowRange& r : rows) {
    const int64_t n = std::max<int64_t>(1, score_bytes / (4 * heads * std::max<int64_t>(r.end, 1)));
    for (int64_t i0 = r.begin; i0 < r.end; i0 += n) out.push_back({i0, std::min(r.end, i0 + n)});
  }
  return out;
}

// Checks the shapes, the rows and the key runs (none: the keys are positions 0..T-1, and the rows
// must lie within them; else ascending runs of T positions in all) and returns the key runs.
KeyRuns check_rows(const char* what, int64_t NH, int64_t KV, int64_t hd, int64_t T,
                   std::span<const cpu::RowRange> rows, std::span<const cpu::RowRange> keys) {
  if (NH <= 0 || KV <= 0 || NH % KV != 0 || hd <= 0)
    fail(what, ": ", KV, " key/value heads do not serve ", NH, " query heads evenly");
  for (const cpu::RowRange& r : rows)
    if (r.begin < 0 || r.end < r.begin || (keys.empty() && r.end > T))
      fail(what, ": query rows [", r.begin, ", ", r.end, ") outside the sequence of ", T);
  return key_runs_of(what, T, keys);
}

// D = rowsum(dout ∘ out) per (b, h, local row) of the rows' attention (B, Tq, NH·hd each); out
// f32, or 16-bit as kept for the projection.
void rows_row_dots(float* D, const float* dout, GemmOperand out, int64_t B, int64_t Tq,
                   int64_t NH, int64_t hd) {
  const int64_t n = B * NH * Tq;
  if (n == 0) return;
  const HeadIndex at{Tq, NH * hd, NH, hd};
  const auto dots = [&](auto zero) {
    using Out = decltype(zero);
    launch("attention_gqa_backward_rows (D)", row_dot_kernel<float, Out>,
           blocks_of(n, kRowsPerBlock), kRowsPerBlock * 32, D, dout,
           static_cast<const Out*>(out.data), at, n);
  };
  switch (out.rounded_to) {
    case MatmulPrecision::kFp32:
    case MatmulPrecision::kTf32:
      return dots(float{});
    case MatmulPrecision::kBf16:
      return dots(__nv_bfloat16{});
    case MatmulPrecision::kFp16:
      return dots(__half{});
  }
}

void expect_bf16_rows(const char* what, int64_t NH, int64_t hd, int64_t B,
                      std::span<const cpu::RowRange> rows, std::span<const cpu::RowRange> keys) {
  if (!flash_attention_applies_to_rows(NH, hd, B, rows, keys))
    fail(what, ": a bf16 q and kv are for the flash kernels only (bf16 matmuls, head size 64 or ",
         "128, at most 8 runs of rows and of keys), which do not apply");
}

}  // namespace

void set_attention_score_bytes(int64_t bytes) { score_bytes = std::max<int64_t>(bytes, 4); }
int64_t attention_score_bytes() { return score_bytes; }

void copy_columns(int device, float* dst, int64_t ld_dst, const float* src, int64_t ld_src,
                  int64_t rows, int64_t width) {
  const int64_t n = rows * width;
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("copy_columns", copy_columns_kernel<float>, blocks_for(n, kThreads), kThreads, dst,
         ld_dst, src, ld_src, width, n);
}

void copy_columns_16(int device, void* dst, int64_t ld_dst, const void* src, int64_t ld_src,
                     int64_t rows, int64_t width) {
  const int64_t n = rows * width;
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("copy_columns (16-bit)", copy_columns_kernel<uint16_t>, blocks_for(n, kThreads), kThreads,
         static_cast<uint16_t*>(dst), ld_dst, static_cast<const uint16_t*>(src), ld_src, width, n);
}

void copy_columns_to_bf16(int device, void* dst, int64_t ld_dst, const float* src, int64_t ld_src,
                          int64_t rows, int64_t width) {
  const int64_t n = rows * width;
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("copy_columns_to_bf16", copy_columns_to_bf16_kernel, blocks_for(n, kThreads), kThreads,
         static_cast<__nv_bfloat16*>(dst), ld_dst, src, ld_src, width, n);
}

bool attention_rows_take_bf16(int64_t NH, int64_t hd, int64_t B,
                              std::span<const cpu::RowRange> rows,
                              std::span<const cpu::RowRange> keys) {
  return flash_attention_applies_to_rows(NH, hd, B, rows, keys);
}

void attention_merge_rows(int device, float* out, float* lse, const float* part_out,
                          const float* part_lse, int64_t B, int64_t Tq, int64_t NH, int64_t hd) {
  const int64_t n = B * NH * Tq;
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("attention_merge_rows", merge_rows_kernel, blocks_for(n, kThreads), kThreads, out, lse,
         part_out, part_lse, Tq, NH, hd, n);
}

void attention_gqa_forward_rows_bf16(int device, void* out, bool out_bf16, float* lse,
                                     const void* q, int64_t ldq, const void* kv, int64_t ldkv,
                                     int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                     std::span<const cpu::RowRange> rows,
                                     std::span<const cpu::RowRange> keys,
                                     cpu::DocumentStarts docs) {
  check_rows("attention_gqa_forward_rows_bf16", NH, KV, hd, T, rows, keys);
  expect_bf16_rows("attention_gqa_forward_rows_bf16", NH, hd, B, rows, keys);
  if (B * cpu::rows_in(rows) == 0) return;
  if (out_bf16)
    flash_attention_forward_rows_bf16_out(device, out, lse, q, ldq, kv, ldkv, B, T, NH, KV, hd,
                                          rows, keys, docs);
  else
    flash_attention_forward_rows(device, static_cast<float*>(out), lse, q, ldq, kv, ldkv, true, B,
                                 T, NH, KV, hd, rows, keys, docs);
}

void attention_gqa_backward_rows_bf16(int device, float* dq, int64_t lddq, float* dkv,
                                      const float* dout, const void* q, int64_t ldq, const void* kv,
                                      int64_t ldkv, GemmOperand out, const float* lse, int64_t B,
                                      int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                      std::span<const cpu::RowRange> rows,
                                      std::span<const cpu::RowRange> keys,
                                      cpu::DocumentStarts docs) {
  check_rows("attention_gqa_backward_rows_bf16", NH, KV, hd, T, rows, keys);
  expect_bf16_rows("attention_gqa_backward_rows_bf16", NH, hd, B, rows, keys);
  const int64_t Tq = cpu::rows_in(rows);
  DeviceGuard guard(device);
  Scratch<float> D(device, B * NH * Tq);
  rows_row_dots(D.get(), dout, out, B, Tq, NH, hd);
  flash_attention_backward_rows(device, dq, lddq, dkv, dout, q, ldq, kv, ldkv, true, lse, D.get(),
                                B, T, NH, KV, hd, rows, keys, docs);
}

// Per piece [first, end) of query rows (at: its first local row), over heads h = B·NH, with
// `cols` = the key rows the piece's last row sees (0..end - 1 over the whole sequence):
//   S = Q[at:at+n]·K[0:cols]ᵀ / sqrt(hd);  P = causal softmax (row r sees the key rows at
//   positions up to first + r);  Y[at:at+n] = P·V[0:cols].
// A piece that sees no key (a ring's block of later positions) gets Y = 0 and lse -inf.
void attention_gqa_forward_rows(int device, float* out, float* lse, const float* q, int64_t ldq,
                                const float* kv, int64_t ldkv, int64_t B, int64_t T, int64_t NH,
                                int64_t KV, int64_t hd, std::span<const cpu::RowRange> rows,
                                std::span<const cpu::RowRange> keys, cpu::DocumentStarts docs) {
  const KeyRuns seen = check_rows("attention_gqa_forward_rows", NH, KV, hd, T, rows, keys);
  const int64_t Tq = cpu::rows_in(rows), heads = B * NH, C = NH * hd;
  if (B * Tq == 0) return;
  if (flash_attention_applies_to_rows(NH, hd, B, rows, keys)) {
    flash_attention_forward_rows(device, out, lse, q, ldq, kv, ldkv, false, B, T, NH, KV, hd, rows,
                                 keys, docs);
    return;
  }
  DeviceGuard guard(device);
  Scratch<float> qh(device, heads * Tq * hd), kh(device, heads * T * hd),
      vh(device, heads * T * hd);
  Scratch<float> yh(device, heads * Tq * hd);
  launch("attention_gqa_forward_rows (split q)", rows_split_q_kernel,
         blocks_for(heads * Tq * hd, kThreads), kThreads, qh.get(), q, ldq, Tq, NH, hd,
         heads * Tq * hd);
  launch("attention_gqa_forward_rows (split kv)", rows_split_kv_kernel,
         blocks_for(heads * T * hd, kThreads), kThreads, kh.get(), vh.get(), kv, ldkv, T, NH, KV,
         hd, heads * T * hd);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  int64_t at = 0;
  for (const cpu::RowRange& r : score_pieces(rows, heads)) {
    const int64_t n = r.size(), cols = seen.visible(r.end - 1);
    if (cols == 0) {  // every row of the piece: output 0, lse -inf
      launch("attention_gqa_forward_rows (no keys)", fill_rows_kernel,
             blocks_for(heads * n * hd, kThreads), kThreads, yh.get(), lse, Tq, n, hd, at,
             heads * n * hd);
      at += n;
      continue;
    }
    Scratch<float> S(device, heads * n * cols);
    head_gemm(device, false, true, n, cols, hd, scale, qh.get() + at * hd, hd, Tq * hd, kh.get(),
              hd, T * hd, S.get(), cols, n * cols, heads);
    launch("attention_gqa_forward_rows (softmax)", causal_softmax_kernel,
           blocks_of(heads * n, kRowsPerBlock), kRowsPerBlock * 32, S.get(), lse, heads * n, n,
           cols, r.begin, Tq, at, KeyMask{seen, docs}, NH);
    head_gemm(device, false, false, n, hd, cols, 1.0f, S.get(), cols, n * cols, vh.get(), hd,
              T * hd, yh.get() + at * hd, hd, Tq * hd, heads);
    at += n;
  }
  const HeadIndex out_at{Tq, C, NH, hd};
  launch("attention_gqa_forward_rows (merge heads)", heads_to_rows_kernel,
         blocks_for(heads * Tq * hd, kThreads), kThreads, out, yh.get(), out_at, heads * Tq * hd);
}

// Per piece, with P recomputed from lse and D_r = Σ_d dO·O:
//   dV[0:cols] += Pᵀ·dO_r,  dP = dO_r·V[0:cols]ᵀ,  dS = P ∘ (dP − D) / sqrt(hd),
//   dQ[at:at+n] = dS·K[0:cols],  dK[0:cols] += dSᵀ·Q_r.
// A piece that sees no key adds nothing and gets dQ = 0.
void attention_gqa_backward_rows(int device, float* dq, int64_t lddq, float* dkv, const float* dout,
                                 const float* q, int64_t ldq, const float* kv, int64_t ldkv,
                                 const float* out, const float* lse, int64_t B, int64_t T,
                                 int64_t NH, int64_t KV, int64_t hd,
                                 std::span<const cpu::RowRange> rows,
                                 std::span<const cpu::RowRange> keys, cpu::DocumentStarts docs) {
  const KeyRuns seen = check_rows("attention_gqa_backward_rows", NH, KV, hd, T, rows, keys);
  const int64_t Tq = cpu::rows_in(rows), heads = B * NH, C = NH * hd;
  DeviceGuard guard(device);
  const HeadIndex local{Tq, C, NH, hd};
  Scratch<float> D(device, heads * Tq);
  rows_row_dots(D.get(), dout, out, B, Tq, NH, hd);
  if (flash_attention_applies_to_rows(NH, hd, B, rows, keys)) {
    flash_attention_backward_rows(device, dq, lddq, dkv, dout, q, ldq, kv, ldkv, false, lse,
                                  D.get(), B, T, NH, KV, hd, rows, keys, docs);
    return;
  }
  Scratch<float> kh(device, heads * T * hd), vh(device, heads * T * hd);
  Scratch<float> dkh(device, heads * T * hd), dvh(device, heads * T * hd);
  LOOM_CUDA_CHECK(cudaMemsetAsync(dkh.get(), 0, static_cast<size_t>(heads * T * hd) * 4, nullptr));
  LOOM_CUDA_CHECK(cudaMemsetAsync(dvh.get(), 0, static_cast<size_t>(heads * T * hd) * 4, nullptr));
  if (B * Tq > 0) {
    Scratch<float> qh(device, heads * Tq * hd), dy(device, heads * Tq * hd);
    Scratch<float> dqh(device, heads * Tq * hd);
    launch("attention_gqa_backward_rows (split q)", rows_split_q_kernel,
           blocks_for(heads * Tq * hd, kThreads), kThreads, qh.get(), q, ldq, Tq, NH, hd,
           heads * Tq * hd);
    launch("attention_gqa_backward_rows (split kv)", rows_split_kv_kernel,
           blocks_for(heads * T * hd, kThreads), kThreads, kh.get(), vh.get(), kv, ldkv, T, NH, KV,
           hd, heads * T * hd);
    launch("attention_gqa_backward_rows (dout to heads)", rows_to_heads_kernel,
           blocks_for(heads * Tq * hd, kThreads), kThreads, dy.get(), dout, local, heads * Tq * hd);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    int64_t at = 0;
    for (const cpu::RowRange& r : score_pieces(rows, heads)) {
      const int64_t n = r.size(), cols = seen.visible(r.end - 1);
      const int64_t rows_n = heads * n;
      if (cols == 0) {  // dQ of these rows 0; no key's gradient changes
        launch("attention_gqa_backward_rows (no keys)", fill_rows_kernel,
               blocks_for(heads * n * hd, kThreads), kThreads, dqh.get(), nullptr, Tq, n, hd, at,
               heads * n * hd);
        at += n;
        continue;
      }
      Scratch<float> P(device, rows_n * cols), dP(device, rows_n * cols);
      head_gemm(device, false, true, n, cols, hd, scale, qh.get() + at * hd, hd, Tq * hd, kh.get(),
                hd, T * hd, P.get(), cols, n * cols, heads);
      launch("attention_gqa_backward_rows (P)", probabilities_kernel,
             blocks_for(rows_n * cols, kThreads), kThreads, P.get(), lse, rows_n, n, cols, r.begin,
             Tq, at, KeyMask{seen, docs}, NH);
      // dV[0:end] += Pᵀ·dO
      gemm(device, true, false, cols, hd, n, 1.0f, P.get(), cols, dy.get() + at * hd, hd, 1.0f,
           dvh.get(), hd, nullptr, GemmBatch{heads, n * cols, Tq * hd, T * hd});
      // dP = dO·Vᵀ, then dS in place
      head_gemm(device, false, true, n, cols, hd, 1.0f, dy.get() + at * hd, hd, Tq * hd, vh.get(),
                hd, T * hd, dP.get(), cols, n * cols, heads);
      launch("attention_gqa_backward_rows (dS)", rows_softmax_backward_kernel,
             blocks_for(rows_n * cols, kThreads), kThreads, dP.get(), P.get(), D.get(), scale,
             rows_n, n, cols, Tq, at);
      // dQ = dS·K, dK[0:end] += dSᵀ·Q
      head_gemm(device, false, false, n, hd, cols, 1.0f, dP.get(), cols, n * cols, kh.get(), hd,
                T * hd, dqh.get() + at * hd, hd, Tq * hd, heads);
      gemm(device, true, false, cols, hd, n, 1.0f, dP.get(), cols, qh.get() + at * hd, hd, 1.0f,
           dkh.get(), hd, nullptr, GemmBatch{heads, n * cols, Tq * hd, T * hd});
      at += n;
    }
    launch("attention_gqa_backward_rows (merge dq)", rows_merge_dq_kernel,
           blocks_for(heads * Tq * hd, kThreads), kThreads, dq, lddq, dqh.get(), Tq, NH, hd,
           heads * Tq * hd);
  }
  launch("attention_gqa_backward_rows (merge dkv)", rows_merge_dkv_kernel,
         blocks_for(B * KV * T * hd, kThreads), kThreads, dkv, ldkv, dkh.get(), dvh.get(), T, NH,
         KV, hd, B * KV * T * hd);
}

}  // namespace loom::cuda
