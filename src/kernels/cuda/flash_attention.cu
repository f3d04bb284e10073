// Fused causal attention (FlashAttention-2's schedule) for head size 64 — every GPT-2 size — with
// bf16 operands on the tensor cores (wmma 16×16×16, fp32 accumulation): what attention.cu uses
// when the matmul precision is bf16. No (T, T) score matrix ever reaches memory: a block of 64
// threads (2 warps × 16 rows) owns 32 rows and walks the 32-wide tiles of the other side through
// shared memory.
//
//  - forward, per query tile: S = Q·Kᵀ per key tile, online softmax (running max m and sum l per
//    row, the output rescaled by exp(m_old - m_new)), O += P·V; then O / l and lse = m + log l.
//  - backward, deterministic (no float atomics), in two passes that each recompute P from lse:
//    per key tile, over the query tiles at or after it: dV += Pᵀ·dO, dPᵀ = V·dOᵀ,
//    dSᵀ = Pᵀ ∘ (dPᵀ - D) / sqrt(hd), dK += dSᵀ·Q; and per query tile, over its key tiles:
//    dP = dO·Vᵀ, dS likewise, dQ += dS·K. D = rowsum(dO ∘ O) comes from attention.cu.
//
// Each lane owns one row of its warp's 16 and half of that row's columns for the element-wise
// steps (softmax, dS): the pair of lanes combines row maxima and sums with one shuffle. Warps only
// touch their own rows of the per-warp tiles, so __syncwarp orders those; tiles both warps read
// (the other side's K, V or Q, dO) are reloaded between two __syncthreads.
#include <cmath>
#include <cstdlib>
#include <string>

#ifdef __CUDACC__
#include <mma.h>
#endif

#include "kernels/cuda/flash_attention.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

using namespace nvcuda;
using bf16 = __nv_bfloat16;

constexpr int kHd = 64;            // head size
constexpr int kTile = 32;          // rows per block, and the other side's tile
constexpr int kFlashThreads = 64;  // 2 warps × 16 rows
// Leading dimensions of the shared tiles, padded against bank conflicts; wmma wants multiples of
// 8 (bf16) or 4 (fp32) elements and 32-byte aligned tile starts, which these keep.
constexpr int kLdH = kHd + 8;    // bf16, hd columns
constexpr int kLdS = kTile + 4;  // fp32, tile columns
constexpr int kLdP = kTile + 8;  // bf16, tile columns
constexpr int kLdO = kHd + 4;    // fp32, hd columns

using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
using RowA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using RowB = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using ColB = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;

// Rows [row0, row0 + 32) of a head's hd columns (row t at src + t·width) into a bf16 tile;
// zeros past T.
__device__ void load_tile(bf16* tile, const float* src, int64_t row0, int64_t T, int64_t width) {
  for (int e = threadIdx.x; e < kTile * kHd; e += blockDim.x) {
    const int r = e / kHd, c = e % kHd;
    const int64_t t = row0 + r;
    tile[r * kLdH + c] = __float2bfloat16_rn(t < T ? src[t * width + c] : 0.0f);
  }
}

// out (this warp's 16 rows × 32, fp32, ld kLdS) = A (16 × 64 rows of a, ld kLdH) · Bᵀ, B the
// 32 × 64 tile b: the scores of 16 rows against a tile.
__device__ void rows_times_tile_t(float* out, const bf16* a, const bf16* b) {
  for (int n = 0; n < kTile / 16; ++n) {
    Acc acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < kHd / 16; ++kk) {
      RowA fa;
      ColB fb;
      wmma::load_matrix_sync(fa, a + kk * 16, kLdH);
      wmma::load_matrix_sync(fb, b + n * 16 * kLdH + kk * 16, kLdH);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + n * 16, acc, kLdS, wmma::mem_row_major);
  }
}

// acc[n] += P (16 × 32, bf16, ld kLdP) · X (32 × 64 tile, ld kLdH), n over the 4 column blocks.
__device__ void accumulate_p_times_tile(Acc* acc, const bf16* p, const bf16* x) {
  for (int n = 0; n < kHd / 16; ++n)
    for (int kk = 0; kk < kTile / 16; ++kk) {
      RowA fa;
      RowB fb;
      wmma::load_matrix_sync(fa, p + kk * 16, kLdP);
      wmma::load_matrix_sync(fb, x + kk * 16 * kLdH + n * 16, kLdH);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
}

// Writes this warp's 16 rows of the four accumulators (row r of the block's tile is global row
// row0 + r, at dst + row·width) through `stage`; rows past T are dropped. `Out`: fp32, or a GEMM
// operand's 16-bit type (rounded from the same fp32 values).
template <typename Out>
__device__ void store_rows(Out* dst, int64_t width, const Acc* acc, float* stage, int64_t row0,
                           int64_t T) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncwarp();
  for (int n = 0; n < kHd / 16; ++n)
    wmma::store_matrix_sync(stage + warp * 16 * kLdO + n * 16, acc[n], kLdO, wmma::mem_row_major);
  __syncwarp();
  const int r = warp * 16 + lane / 2, c0 = lane % 2 * 32;
  if (row0 + r < T)
    for (int c = c0; c < c0 + 32; ++c) round_to(dst[(row0 + r) * width + c], stage[r * kLdO + c]);
  __syncwarp();
}

// `Out`: fp32, or bf16 for an output only the next GEMM (and D = rowsum(dO ∘ O)) reads.
template <typename Out>
__global__ void flash_forward_kernel(Out* out, float* lse, const float* qkv, int64_t T, int64_t C,
                                     int64_t NH, float scale) {
  __shared__ __align__(32) bf16 q[kTile * kLdH];
  __shared__ __align__(32) bf16 k[kTile * kLdH];
  __shared__ __align__(32) bf16 v[kTile * kLdH];
  __shared__ __align__(32) float s[kTile * kLdS];
  __shared__ __align__(32) bf16 p[kTile * kLdP];
  __shared__ __align__(32) float o[kTile * kLdO];
  __shared__ __align__(32) float pv[kTile * kLdO];
  const int64_t bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const float* head = qkv + b * T * 3 * C + h * kHd;  // part p of row t: head + t·3C + p·C
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = warp * 16 + lane / 2, c0 = lane % 2 * (kTile / 2);  // this lane's row, columns
  const int64_t i = q0 + r;

  load_tile(q, head, q0, T, 3 * C);
  for (int e = threadIdx.x; e < kTile * kLdO; e += blockDim.x) o[e] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  const int64_t kv_end = q0 + kTile < T ? q0 + kTile : T;  // causal: keys up to the last row
  for (int64_t k0 = 0; k0 < kv_end; k0 += kTile) {
    __syncthreads();  // every warp is done with the previous k, v
    load_tile(k, head + C, k0, T, 3 * C);
    load_tile(v, head + 2 * C, k0, T, 3 * C);
    __syncthreads();
    rows_times_tile_t(s + warp * 16 * kLdS, q + warp * 16 * kLdH, k);
    __syncwarp();
    float mx = -INFINITY;
    for (int c = c0; c < c0 + kTile / 2; ++c)
      if (k0 + c <= i) mx = fmaxf(mx, s[r * kLdS + c] * scale);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    const float m_new = fmaxf(m, mx);
    float sum = 0.0f;
    for (int c = c0; c < c0 + kTile / 2; ++c) {
      const float e = k0 + c <= i && i < T ? expf(s[r * kLdS + c] * scale - m_new) : 0.0f;
      p[r * kLdP + c] = __float2bfloat16_rn(e);
      sum += e;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    const float alpha = m == -INFINITY ? 0.0f : expf(m - m_new);
    l = alpha * l + sum;
    m = m_new;
    __syncwarp();
    Acc acc[kHd / 16];
    for (Acc& a : acc) wmma::fill_fragment(a, 0.0f);
    accumulate_p_times_tile(acc, p + warp * 16 * kLdP, v);
    for (int n = 0; n < kHd / 16; ++n)
      wmma::store_matrix_sync(pv + warp * 16 * kLdO + n * 16, acc[n], kLdO, wmma::mem_row_major);
    __syncwarp();
    for (int c = lane % 2 * 32; c < lane % 2 * 32 + 32; ++c)
      o[r * kLdO + c] = alpha * o[r * kLdO + c] + pv[r * kLdO + c];
  }
  if (i < T) {
    Out* dst = out + (b * T + i) * C + h * kHd;
    for (int c = lane % 2 * 32; c < lane % 2 * 32 + 32; ++c) round_to(dst[c], o[r * kLdO + c] / l);
    if (lane % 2 == 0) lse[bh * T + i] = m + logf(l);
  }
}

// dK and dV of one key tile.
template <typename Out>
__global__ void flash_backward_kv_kernel(Out* dqkv, const float* dout, const float* qkv,
                                         const float* lse, const float* D, int64_t T, int64_t C,
                                         int64_t NH, float scale) {
  __shared__ __align__(32) bf16 k[kTile * kLdH];
  __shared__ __align__(32) bf16 v[kTile * kLdH];
  __shared__ __align__(32) bf16 q[kTile * kLdH];
  __shared__ __align__(32) bf16 dy[kTile * kLdH];
  __shared__ __align__(32) float st[kTile * kLdS];   // Sᵀ, then Pᵀ in fp32
  __shared__ __align__(32) float dpt[kTile * kLdS];  // dPᵀ
  __shared__ __align__(32) bf16 pt[kTile * kLdP];    // Pᵀ, then dSᵀ
  __shared__ __align__(32) float stage[kTile * kLdO];
  __shared__ float lse_q[kTile], d_q[kTile];
  const int64_t bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const float* head = qkv + b * T * 3 * C + h * kHd;
  const float* dhead = dout + b * T * C + h * kHd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int jr = warp * 16 + lane / 2, c0 = lane % 2 * (kTile / 2);  // key row, query columns
  const int64_t j = k0 + jr;

  load_tile(k, head + C, k0, T, 3 * C);
  load_tile(v, head + 2 * C, k0, T, 3 * C);
  Acc dk[kHd / 16], dv[kHd / 16];
  for (int n = 0; n < kHd / 16; ++n) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }
  for (int64_t q0 = k0; q0 < T; q0 += kTile) {  // causal: earlier queries see none of these keys
    __syncthreads();
    load_tile(q, head, q0, T, 3 * C);
    load_tile(dy, dhead, q0, T, C);
    for (int e = threadIdx.x; e < kTile; e += blockDim.x) {
      lse_q[e] = q0 + e < T ? lse[bh * T + q0 + e] : 0.0f;
      d_q[e] = q0 + e < T ? D[bh * T + q0 + e] : 0.0f;
    }
    __syncthreads();
    rows_times_tile_t(st + warp * 16 * kLdS, k + warp * 16 * kLdH, q);
    __syncwarp();
    for (int c = c0; c < c0 + kTile / 2; ++c) {
      const int64_t i = q0 + c;
      const float prob =
          i >= j && i < T && j < T ? expf(st[jr * kLdS + c] * scale - lse_q[c]) : 0.0f;
      st[jr * kLdS + c] = prob;
      pt[jr * kLdP + c] = __float2bfloat16_rn(prob);
    }
    __syncwarp();
    accumulate_p_times_tile(dv, pt + warp * 16 * kLdP, dy);               // dV += Pᵀ·dO
    rows_times_tile_t(dpt + warp * 16 * kLdS, v + warp * 16 * kLdH, dy);  // dPᵀ = V·dOᵀ
    __syncwarp();
    for (int c = c0; c < c0 + kTile / 2; ++c)
      pt[jr * kLdP + c] =
          __float2bfloat16_rn(st[jr * kLdS + c] * (dpt[jr * kLdS + c] - d_q[c]) * scale);
    __syncwarp();
    accumulate_p_times_tile(dk, pt + warp * 16 * kLdP, q);  // dK += dSᵀ·Q
  }
  Out* dk_rows = dqkv + b * T * 3 * C + C + h * kHd;
  store_rows(dk_rows, 3 * C, dk, stage, k0, T);
  store_rows(dk_rows + C, 3 * C, dv, stage, k0, T);
}

// dQ of one query tile.
template <typename Out>
__global__ void flash_backward_q_kernel(Out* dqkv, const float* dout, const float* qkv,
                                        const float* lse, const float* D, int64_t T, int64_t C,
                                        int64_t NH, float scale) {
  __shared__ __align__(32) bf16 q[kTile * kLdH];
  __shared__ __align__(32) bf16 dy[kTile * kLdH];
  __shared__ __align__(32) bf16 k[kTile * kLdH];
  __shared__ __align__(32) bf16 v[kTile * kLdH];
  __shared__ __align__(32) float s[kTile * kLdS];
  __shared__ __align__(32) float dp[kTile * kLdS];
  __shared__ __align__(32) bf16 ds[kTile * kLdP];
  __shared__ __align__(32) float stage[kTile * kLdO];
  const int64_t bh = blockIdx.y, b = bh / NH, h = bh % NH;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const float* head = qkv + b * T * 3 * C + h * kHd;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = warp * 16 + lane / 2, c0 = lane % 2 * (kTile / 2);
  const int64_t i = q0 + r;
  const float lse_i = i < T ? lse[bh * T + i] : 0.0f, d_i = i < T ? D[bh * T + i] : 0.0f;

  load_tile(q, head, q0, T, 3 * C);
  load_tile(dy, dout + b * T * C + h * kHd, q0, T, C);
  Acc dq[kHd / 16];
  for (Acc& a : dq) wmma::fill_fragment(a, 0.0f);
  const int64_t kv_end = q0 + kTile < T ? q0 + kTile : T;
  for (int64_t k0 = 0; k0 < kv_end; k0 += kTile) {
    __syncthreads();
    load_tile(k, head + C, k0, T, 3 * C);
    load_tile(v, head + 2 * C, k0, T, 3 * C);
    __syncthreads();
    rows_times_tile_t(s + warp * 16 * kLdS, q + warp * 16 * kLdH, k);    // S = Q·Kᵀ
    rows_times_tile_t(dp + warp * 16 * kLdS, dy + warp * 16 * kLdH, v);  // dP = dO·Vᵀ
    __syncwarp();
    for (int c = c0; c < c0 + kTile / 2; ++c) {
      const int64_t jj = k0 + c;
      const float prob = jj <= i && i < T ? expf(s[r * kLdS + c] * scale - lse_i) : 0.0f;
      ds[r * kLdP + c] = __float2bfloat16_rn(prob * (dp[r * kLdS + c] - d_i) * scale);
    }
    __syncwarp();
    accumulate_p_times_tile(dq, ds + warp * 16 * kLdP, k);  // dQ += dS·K
  }
  store_rows(dqkv + b * T * 3 * C + h * kHd, 3 * C, dq, stage, q0, T);
}

bool flash_disabled_by_environment() {
  static const bool disabled = [] {
    const char* v = std::getenv("LOOM_CUDA_FLASH_ATTENTION");
    return v != nullptr && std::string(v) == "0";
  }();
  return disabled;
}

dim3 flash_grid(int64_t B, int64_t T, int64_t NH) {
  return dim3(blocks_of(T, kTile), static_cast<unsigned>(B * NH));
}

}  // namespace

bool flash_attention_applies(int64_t C, int64_t NH, int64_t B) {
  return NH > 0 && C == NH * kHd && B * NH <= 65535 &&
         matmul_precision() == MatmulPrecision::kBf16 && !flash_disabled_by_environment();
}

void flash_attention_forward(int device, float* out, float* lse, const float* qkv, int64_t B,
                             int64_t T, int64_t C, int64_t NH) {
  DeviceGuard guard(device);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHd));
  launch("attention_forward (flash)", flash_forward_kernel<float>, flash_grid(B, T, NH),
         kFlashThreads, out, lse, qkv, T, C, NH, scale);
}

void flash_attention_forward_bf16_out(int device, void* out, float* lse, const float* qkv,
                                      int64_t B, int64_t T, int64_t C, int64_t NH) {
  DeviceGuard guard(device);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHd));
  launch("attention_forward (flash, bf16 out)", flash_forward_kernel<bf16>, flash_grid(B, T, NH),
         kFlashThreads, static_cast<bf16*>(out), lse, qkv, T, C, NH, scale);
}

namespace {
template <typename Out>
void flash_backward(int device, Out* dqkv, const float* dout, const float* qkv, const float* lse,
                    const float* D, int64_t B, int64_t T, int64_t C, int64_t NH) {
  DeviceGuard guard(device);
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHd));
  launch("attention_backward (flash dK, dV)", flash_backward_kv_kernel<Out>, flash_grid(B, T, NH),
         kFlashThreads, dqkv, dout, qkv, lse, D, T, C, NH, scale);
  launch("attention_backward (flash dQ)", flash_backward_q_kernel<Out>, flash_grid(B, T, NH),
         kFlashThreads, dqkv, dout, qkv, lse, D, T, C, NH, scale);
}
}  // namespace

void flash_attention_backward(int device, float* dqkv, const float* dout, const float* qkv,
                              const float* lse, const float* D, int64_t B, int64_t T, int64_t C,
                              int64_t NH) {
  flash_backward(device, dqkv, dout, qkv, lse, D, B, T, C, NH);
}

void flash_attention_backward_bf16_dqkv(int device, void* dqkv, const float* dout, const float* qkv,
                                        const float* lse, const float* D, int64_t B, int64_t T,
                                        int64_t C, int64_t NH) {
  flash_backward(device, static_cast<bf16*>(dqkv), dout, qkv, lse, D, B, T, C, NH);
}

}  // namespace loom::cuda
