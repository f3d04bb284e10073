// The vocabulary-shard kernels of kernels/cpu/vocab_shard.h on a GPU. The embedding's are bitwise
// the CPU's (one owner per output element, additions in position order); the cross-entropy
// pieces run a block per row and agree to rounding.
#include "base/error.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/targets.h"

namespace loom::cuda {
namespace {

__global__ void shard_embedding_forward_kernel(float* out, const int32_t* tokens, const float* wte,
                                               const float* wpe, int64_t N, int64_t T, int64_t C,
                                               VocabShard shard, bool add_positions) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < N * C;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t i = e / C, c = e % C;
    const int64_t row = tokens[i] - shard.first_row;
    float v = row >= 0 && row < shard.real_rows ? wte[row * C + c] : 0.0f;
    if (add_positions) v += wpe[(i % T) * C + c];
    out[e] = v;
  }
}

// dwpe[t, c] += dout[i, c] for i ≡ t (mod T), in increasing i: the CPU's order.
__global__ void shard_embedding_wpe_kernel(float* dwpe, const float* dout, int64_t N, int64_t T,
                                           int64_t C) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // t·C + c
  if (e >= T * C) return;
  const int64_t t = e / C, c = e % C;
  float acc = dwpe[e];
  for (int64_t i = t; i < N; i += T) acc += dout[i * C + c];
  dwpe[e] = acc;
}

// Thread (c, p): channel c of the shard's rows r with r mod kVocabPartitions == p, tokens in order.
__global__ void shard_embedding_wte_kernel(float* dwte, const float* dout, const int32_t* tokens,
                                           int64_t N, int64_t C, VocabShard shard) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int p = static_cast<int>(blockIdx.y);
  if (c >= C) return;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t row = __ldg(tokens + i) - shard.first_row;
    if (row >= 0 && row < shard.real_rows && row % kVocabPartitions == p)
      dwte[row * C + c] += dout[i * C + c];
  }
}

__global__ void shard_loss_sum_kernel(double* result, const float* sum, const float* max,
                                      const float* target_logit, const int32_t* targets,
                                      int64_t N) {
  __shared__ double shared[32];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x)
    if (targets[i] != kIgnoredTarget)
      acc += log(static_cast<double>(sum[i])) + max[i] - target_logit[i];
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) *result = acc;
}

// The cross-entropy pieces read logits of type L: fp32, or the 16-bit values the head's GEMM
// wrote at bf16 / fp16 (widened exactly); the backward writes the gradient over them in L.
template <typename L>
__global__ void shard_logit_max_kernel(float* max, float* target_logit, const L* logits,
                                       const int32_t* targets, VocabShard shard) {
  __shared__ float shared[32];
  const int64_t i = blockIdx.x;
  const L* l = logits + i * shard.rows;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < shard.real_rows; j += blockDim.x) m = fmaxf(m, widen(l[j]));
  m = block_max(m, shared);
  if (threadIdx.x == 0) {
    max[i] = m;
    const int64_t t = targets[i] - shard.first_row;
    if (t >= 0 && t < shard.real_rows) target_logit[i] = widen(l[t]);
  }
}

template <typename L>
__global__ void shard_sum_exp_kernel(float* sum, const L* logits, const float* max,
                                     VocabShard shard) {
  __shared__ double shared[32];
  const int64_t i = blockIdx.x;
  const L* l = logits + i * shard.rows;
  const float m = max[i];
  double s = 0;
  for (int64_t j = threadIdx.x; j < shard.real_rows; j += blockDim.x)
    s += exp(double(widen(l[j]) - m));
  s = block_sum(s, shared);
  if (threadIdx.x == 0) sum[i] = static_cast<float>(s);
}

__device__ inline void store_as(float& out, float x) {
  out = x;
}
template <typename Half>
__device__ inline void store_as(Half& out, float x) {
  round_to(out, x);
}

template <typename L>
__global__ void shard_ce_backward_kernel(L* logits, const float* max, const float* sum,
                                         const int32_t* targets, float k, VocabShard shard,
                                         float z_loss) {
  const int64_t i = blockIdx.x;
  L* l = logits + i * shard.rows;
  const float m = max[i], s = sum[i];
  const int64_t t = targets[i] - shard.first_row;
  const float row_k = targets[i] == kIgnoredTarget ? 0.0f : k;  // an ignored row: zeros
  const float softmax_factor = 1.0f + 2.0f * z_loss * (m + logf(s));  // the z-loss's; else 1
  for (int64_t j = threadIdx.x; j < shard.rows; j += blockDim.x) {
    const float p = j < shard.real_rows ? expf(widen(l[j]) - m) / s * softmax_factor : 0.0f;
    store_as(l[j], (p - (j == t ? 1.0f : 0.0f)) * row_k);
  }
}

}  // namespace

void vocab_shard_loss_sum(int device, double* result, const float* sum, const float* max,
                          const float* target_logit, const int32_t* targets, int64_t N) {
  DeviceGuard guard(device);
  launch("vocab_shard_loss_sum", shard_loss_sum_kernel, 1, kThreads, result, sum, max, target_logit,
         targets, N);
}

void vocab_shard_embedding_forward(int device, float* out, const int32_t* tokens, const float* wte,
                                   const float* wpe, int64_t N, int64_t T, int64_t C,
                                   const VocabShard& shard, bool add_positions, bool ids_checked) {
  if (N == 0) return;
  DeviceGuard guard(device);
  int32_t bad = 0;
  if (const int64_t i = ids_checked ? -1 : first_out_of_range(tokens, N, shard.vocab, &bad); i >= 0)
    fail("embedding: token ", bad, " at position ", i, " outside [0, ", shard.vocab, ")");
  launch("vocab_shard_embedding_forward", shard_embedding_forward_kernel,
         blocks_for(N * C, kThreads), kThreads, out, tokens, wte, wpe, N, T, C, shard,
         add_positions && wpe != nullptr);
}

void vocab_shard_embedding_backward(int device, float* dwte, float* dwpe, const float* dout,
                                    const int32_t* tokens, int64_t N, int64_t T, int64_t C,
                                    const VocabShard& shard) {
  if (N == 0) return;
  DeviceGuard guard(device);
  if (dwpe != nullptr)  // null: no position table
    launch("vocab_shard_embedding_backward (dwpe)", shard_embedding_wpe_kernel,
           static_cast<unsigned>((T * C + kThreads - 1) / kThreads), kThreads, dwpe, dout, N, T, C);
  const dim3 grid(static_cast<unsigned>((C + 127) / 128), kVocabPartitions);
  launch("vocab_shard_embedding_backward (dwte)", shard_embedding_wte_kernel, grid, 128, dwte, dout,
         tokens, N, C, shard);
}

void vocab_shard_logit_max(int device, float* max, float* target_logit, const float* logits,
                           const int32_t* targets, int64_t N, const VocabShard& shard) {
  if (N == 0) return;
  DeviceGuard guard(device);
  launch("vocab_shard_logit_max", shard_logit_max_kernel<float>, static_cast<unsigned>(N), kThreads,
         max, target_logit, logits, targets, shard);
}

void vocab_shard_sum_exp(int device, float* sum, const float* logits, const float* max, int64_t N,
                         const VocabShard& shard) {
  if (N == 0) return;
  DeviceGuard guard(device);
  launch("vocab_shard_sum_exp", shard_sum_exp_kernel<float>, static_cast<unsigned>(N), kThreads,
         sum, logits, max, shard);
}

void vocab_shard_cross_entropy_backward(int device, float* logits, const float* max,
                                        const float* sum, const int32_t* targets, float k,
                                        int64_t N, const VocabShard& shard, float z_loss) {
  if (N == 0) return;
  DeviceGuard guard(device);
  launch("vocab_shard_cross_entropy_backward", shard_ce_backward_kernel<float>,
         static_cast<unsigned>(N), kThreads, logits, max, sum, targets, k, shard, z_loss);
}

void vocab_shard_logit_max_rounded(int device, float* max, float* target_logit, const void* logits,
                                   const int32_t* targets, int64_t N, const VocabShard& shard) {
  if (N == 0) return;
  DeviceGuard guard(device);
  with_rounded_type("vocab_shard_logit_max_rounded", [&](auto zero) {
    using Half = decltype(zero);
    launch("vocab_shard_logit_max (16-bit logits)", shard_logit_max_kernel<Half>,
           static_cast<unsigned>(N), kThreads, max, target_logit, static_cast<const Half*>(logits),
           targets, shard);
  });
}

void vocab_shard_sum_exp_rounded(int device, float* sum, const void* logits, const float* max,
                                 int64_t N, const VocabShard& shard) {
  if (N == 0) return;
  DeviceGuard guard(device);
  with_rounded_type("vocab_shard_sum_exp_rounded", [&](auto zero) {
    using Half = decltype(zero);
    launch("vocab_shard_sum_exp (16-bit logits)", shard_sum_exp_kernel<Half>,
           static_cast<unsigned>(N), kThreads, sum, static_cast<const Half*>(logits), max, shard);
  });
}

void vocab_shard_cross_entropy_backward_rounded(int device, void* logits, const float* max,
                                                const float* sum, const int32_t* targets, float k,
                                                int64_t N, const VocabShard& shard, float z_loss) {
  if (N == 0) return;
  DeviceGuard guard(device);
  with_rounded_type("vocab_shard_cross_entropy_backward_rounded", [&](auto zero) {
    using Half = decltype(zero);
    launch("vocab_shard_cross_entropy_backward (16-bit logits, in place)",
           shard_ce_backward_kernel<Half>, static_cast<unsigned>(N), kThreads,
           static_cast<Half*>(logits), max, sum, targets, k, shard, z_loss);
  });
}

}  // namespace loom::cuda
