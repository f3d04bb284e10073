// Softmax cross-entropy over the vocabulary: one block per row. As on the CPU, exp is taken of
// the row shifted by its max and summed in double (V is large: 50304 for GPT-2).
#include "base/error.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/targets.h"

namespace loom::cuda {
namespace {

constexpr int kRowThreads = 512;  // one block per row of V logits

// Rows are read kVec values at a time (load_pack: 16 bytes, 8 bf16 or 4 floats) where V is a
// multiple of kVec and the logits are aligned to it — GPT-2's 50304 is — else one at a time
// (kVec = 1). Either way each value is read once, by one thread.
//
// One pass over the row (the logits are the largest activation: 16384 × 50304 fp32 at GPT-2
// 124M, T = 1024, batch 16, far beyond L2, so a second pass would read them from memory again):
// each thread keeps its running max and its sum of exp relative to it (online softmax), then the
// block rescales every thread's sum to the row's max and adds them in a fixed order. `In`: fp32
// logits, or logits stored in a GEMM operand's 16-bit type (widened exactly).
template <typename In, int kVec>
__global__ void cross_entropy_forward_kernel(float* losses, float* lse, const In* logits,
                                             const int32_t* targets, int64_t V) {
  __shared__ float shared_max[32];
  __shared__ double shared_sum[32];
  const int64_t r = blockIdx.x;
  const In* x = logits + r * V;
  float m = -INFINITY;
  double sum = 0;
  for (int64_t v0 = static_cast<int64_t>(threadIdx.x) * kVec; v0 < V;
       v0 += static_cast<int64_t>(blockDim.x) * kVec) {
    float xs[kVec];
    load_pack<kVec>(x + v0, xs);
    for (int k = 0; k < kVec; ++k) {
      const float xv = xs[k];
      if (xv > m) {
        sum = sum * static_cast<double>(expf(m - xv)) + 1.0;
        m = xv;
      } else if (xv != -INFINITY) {  // a masked logit adds nothing (and -inf - -inf is NaN)
        sum += static_cast<double>(expf(xv - m));
      }
    }
  }
  const float mx = block_max(m, shared_max);
  sum = block_sum(m == -INFINITY ? 0.0 : sum * static_cast<double>(expf(m - mx)), shared_sum);
  if (threadIdx.x == 0) {
    const float l = mx + static_cast<float>(log(sum));
    lse[r] = l;
    const int32_t t = targets[r];
    losses[r] = t == kIgnoredTarget ? 0.0f : l - widen(x[t]);
  }
}

// dlogits (fp32, or rounded to a 16-bit GEMM operand type) may alias logits (`In`, fp32 or that
// 16-bit type): each element is read, then written, by one thread. kVec as above.
template <typename Out, typename In, int kVec>
__global__ void cross_entropy_backward_kernel(Out* dlogits, const In* logits, const float* lse,
                                              const int32_t* targets, float dloss, int64_t V,
                                              float z_loss) {
  const int64_t r = blockIdx.x;
  const In* x = logits + r * V;
  Out* dx = dlogits + r * V;
  const float l = lse[r];
  const int32_t t = targets[r];
  if (t == kIgnoredTarget) dloss = 0.0f;  // an ignored row's gradient: zeros (exp(x - l) <= 1)
  // The z-loss's d(z · lse²) = 2 · z · lse · softmax: the softmax's factor (dloss without it).
  const float softmax_factor = dloss * (1.0f + 2.0f * z_loss * l);
  for (int64_t v0 = static_cast<int64_t>(threadIdx.x) * kVec; v0 < V;
       v0 += static_cast<int64_t>(blockDim.x) * kVec) {
    float xs[kVec];
    load_pack<kVec>(x + v0, xs);
    for (int k = 0; k < kVec; ++k) {
      const float p = expf(xs[k] - l) * softmax_factor;
      xs[k] = v0 + k == t ? p - dloss : p;
    }
    store_pack<kVec>(dx + v0, xs);
  }
}

// The values of a pack: 16 bytes of the wider of the two types. Rows go by packs where every row
// starts on a 16-byte boundary (V a multiple of the pack, both buffers aligned), else by values.
template <typename In, typename Out>
inline constexpr int kPack = 16 /
                             static_cast<int>(sizeof(In) > sizeof(Out) ? sizeof(In) : sizeof(Out));

template <typename In, typename Out>
bool rows_go_by_packs(const In* logits, const Out* dlogits, int64_t V) {
  return V % kPack<In, Out> == 0 && aligned_to(logits, 16) && aligned_to(dlogits, 16);
}

template <typename In>
void launch_cross_entropy_forward(const char* name, float* losses, float* lse, const In* logits,
                                  const int32_t* targets, int64_t N, int64_t V) {
  if (rows_go_by_packs(logits, logits, V))
    launch(name, cross_entropy_forward_kernel<In, kPack<In, In>>, static_cast<unsigned>(N),
           kRowThreads, losses, lse, logits, targets, V);
  else
    launch(name, cross_entropy_forward_kernel<In, 1>, static_cast<unsigned>(N), kRowThreads, losses,
           lse, logits, targets, V);
}

template <typename Out, typename In>
void launch_cross_entropy_backward(const char* name, Out* dlogits, const In* logits,
                                   const float* lse, const int32_t* targets, float dloss, int64_t N,
                                   int64_t V, float z_loss) {
  if (rows_go_by_packs(logits, dlogits, V))
    launch(name, cross_entropy_backward_kernel<Out, In, kPack<In, Out>>, static_cast<unsigned>(N),
           kRowThreads, dlogits, logits, lse, targets, dloss, V, z_loss);
  else
    launch(name, cross_entropy_backward_kernel<Out, In, 1>, static_cast<unsigned>(N), kRowThreads,
           dlogits, logits, lse, targets, dloss, V, z_loss);
}

__global__ void lse_square_sum_kernel(double* result, const float* lse, const float* sum,
                                      const int32_t* targets, int64_t N) {
  __shared__ double shared[32];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    if (targets[i] == kIgnoredTarget) continue;
    const double l = sum != nullptr ? lse[i] + log(static_cast<double>(sum[i])) : lse[i];
    acc += l * l;
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) *result = acc;
}

}  // namespace

void lse_square_sum(int device, double* result, const float* lse, const float* sum,
                    const int32_t* targets, int64_t N) {
  DeviceGuard guard(device);
  launch("lse_square_sum", lse_square_sum_kernel, 1, kRowThreads, result, lse, sum, targets, N);
}

void cross_entropy_forward(int device, float* losses, float* lse, const float* logits,
                           const int32_t* targets, int64_t N, int64_t V, bool ids_checked) {
  if (N == 0) return;
  DeviceGuard guard(device);
  int32_t bad = 0;
  if (const int64_t i = ids_checked ? -1 : first_out_of_range(targets, N, V, &bad, true); i >= 0)
    fail("cross_entropy: target ", bad, " in row ", i, " is outside the vocabulary [0, ", V,
         ") and not the ignored target ", kIgnoredTarget);
  launch_cross_entropy_forward("cross_entropy_forward", losses, lse, logits, targets, N, V);
}

void cross_entropy_backward(int device, float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, float dloss, int64_t N, int64_t V,
                            float z_loss) {
  if (N == 0) return;
  DeviceGuard guard(device);
  launch_cross_entropy_backward("cross_entropy_backward", dlogits, logits, lse, targets, dloss, N,
                                V, z_loss);
}

void lm_head_backward(int device, float* dinp, float* dweight, float* logits, const float* lse,
                      const int32_t* targets, float dloss, const float* inp, const float* weight,
                      int64_t N, int64_t C, int64_t V, float z_loss) {
  if (N == 0) return;
  if (!rounds_to_16_bits(matmul_precision())) {
    cross_entropy_backward(device, logits, logits, lse, targets, dloss, N, V, z_loss);
    matmul_backward(device, dinp, dweight, nullptr, logits, inp, weight, N, C, V);
    return;
  }
  DeviceGuard guard(device);
  const RoundedOperand dlogits(device, N * V);
  with_rounded_type("lm_head_backward", [&](auto zero) {
    using Half = decltype(zero);
    launch_cross_entropy_backward("lm_head_backward (16-bit dlogits)",
                                  static_cast<Half*>(dlogits.bits()), logits, lse, targets, dloss,
                                  N, V, z_loss);
  });
  matmul_backward_gemms(device, dinp, dweight, dlogits.operand(), inp, weight, N, C, V);
}

void lm_head_forward_rounded_logits(int device, float* losses, float* lse, void* logits,
                                    GemmOperand inp, GemmOperand weight, const int32_t* targets,
                                    int64_t N, int64_t C, int64_t V, bool ids_checked) {
  DeviceGuard guard(device);
  int32_t bad = 0;
  if (const int64_t i = ids_checked ? -1 : first_out_of_range(targets, N, V, &bad, true); i >= 0)
    fail("cross_entropy: target ", bad, " in row ", i, " is outside the vocabulary [0, ", V,
         ") and not the ignored target ", kIgnoredTarget);
  // logits (N, V) = inp (N, C) · weight (V, C)ᵀ, stored in 16 bits.
  (void)gemm_rounded_output(device, false, true, N, V, C, inp, C, weight, C, logits, V);
  if (N == 0) return;
  with_rounded_type("lm_head_forward_rounded_logits", [&](auto zero) {
    using Half = decltype(zero);
    launch_cross_entropy_forward("cross_entropy_forward (16-bit logits)", losses, lse,
                                 static_cast<const Half*>(logits), targets, N, V);
  });
}

void lm_head_backward_from_rounded_logits(int device, float* dinp, float* dweight, void* logits,
                                          const float* lse, const int32_t* targets, float dloss,
                                          GemmOperand inp, GemmOperand weight, int64_t N, int64_t C,
                                          int64_t V, float z_loss) {
  if (N == 0) return;
  DeviceGuard guard(device);
  const MatmulPrecision precision = with_rounded_type("lm_head_backward", [&](auto zero) {
    using Half = decltype(zero);
    Half* x = static_cast<Half*>(logits);
    launch_cross_entropy_backward("lm_head_backward (16-bit logits, in place)", x,
                                  static_cast<const Half*>(x), lse, targets, dloss, N, V, z_loss);
  });
  matmul_backward_gemms(device, dinp, dweight, GemmOperand(logits, precision), inp, weight, N, C,
                        V);
}

}  // namespace loom::cuda
