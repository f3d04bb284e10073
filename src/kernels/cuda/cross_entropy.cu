// Softmax cross-entropy over the vocabulary: one block per row. As on the CPU, exp is taken of
// the row shifted by its max and summed in double (V is large: 50304 for GPT-2).
#include "base/error.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

constexpr int kRowThreads = 512;  // one block per row of V logits

// One pass over the row (the logits are the largest activation: 16384 × 50304 fp32 at GPT-2
// 124M, T = 1024, batch 16, far beyond L2, so a second pass would read them from memory again):
// each thread keeps its running max and its sum of exp relative to it (online softmax), then the
// block rescales every thread's sum to the row's max and adds them in a fixed order.
__global__ void cross_entropy_forward_kernel(float* losses, float* lse, const float* logits,
                                             const int32_t* targets, int64_t V) {
  __shared__ float shared_max[32];
  __shared__ double shared_sum[32];
  const int64_t r = blockIdx.x;
  const float* x = logits + r * V;
  float m = -INFINITY;
  double sum = 0;
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float xv = x[v];
    if (xv > m) {
      sum = sum * static_cast<double>(expf(m - xv)) + 1.0;
      m = xv;
    } else if (xv != -INFINITY) {  // a masked logit adds nothing (and -inf - -inf is NaN)
      sum += static_cast<double>(expf(xv - m));
    }
  }
  const float mx = block_max(m, shared_max);
  sum = block_sum(m == -INFINITY ? 0.0 : sum * static_cast<double>(expf(m - mx)), shared_sum);
  if (threadIdx.x == 0) {
    const float l = mx + static_cast<float>(log(sum));
    lse[r] = l;
    losses[r] = l - x[targets[r]];
  }
}

// dlogits (fp32, or rounded to a 16-bit GEMM operand type) may alias logits: each element is
// read, then written, by one thread.
template <typename Out>
__global__ void cross_entropy_backward_kernel(Out* dlogits, const float* logits, const float* lse,
                                              const int32_t* targets, float dloss, int64_t V) {
  const int64_t r = blockIdx.x;
  const float* x = logits + r * V;
  Out* dx = dlogits + r * V;
  const float l = lse[r];
  const int32_t t = targets[r];
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float p = expf(x[v] - l) * dloss;
    round_to(dx[v], v == t ? p - dloss : p);
  }
}

}  // namespace

void cross_entropy_forward(int device, float* losses, float* lse, const float* logits,
                           const int32_t* targets, int64_t N, int64_t V) {
  if (N == 0) return;
  DeviceGuard guard(device);
  int32_t bad = 0;
  if (const int64_t i = first_out_of_range(targets, N, V, &bad); i >= 0)
    fail("cross_entropy: target ", bad, " in row ", i, " is outside the vocabulary [0, ", V, ")");
  launch("cross_entropy_forward", cross_entropy_forward_kernel, static_cast<unsigned>(N),
         kRowThreads, losses, lse, logits, targets, V);
}

void cross_entropy_backward(int device, float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, float dloss, int64_t N, int64_t V) {
  if (N == 0) return;
  DeviceGuard guard(device);
  launch("cross_entropy_backward", cross_entropy_backward_kernel<float>, static_cast<unsigned>(N),
         kRowThreads, dlogits, logits, lse, targets, dloss, V);
}

void lm_head_backward(int device, float* dinp, float* dweight, float* logits, const float* lse,
                      const int32_t* targets, float dloss, const float* inp, const float* weight,
                      int64_t N, int64_t C, int64_t V) {
  if (N == 0) return;
  if (!rounds_to_16_bits(matmul_precision())) {
    cross_entropy_backward(device, logits, logits, lse, targets, dloss, N, V);
    matmul_backward(device, dinp, dweight, nullptr, logits, inp, weight, N, C, V);
    return;
  }
  DeviceGuard guard(device);
  const RoundedOperand dlogits(device, N * V);
  with_rounded_type("lm_head_backward", [&](auto zero) {
    using Half = decltype(zero);
    launch("lm_head_backward (16-bit dlogits)", cross_entropy_backward_kernel<Half>,
           static_cast<unsigned>(N), kRowThreads, static_cast<Half*>(dlogits.bits()), logits, lse,
           targets, dloss, V);
  });
  matmul_backward_gemms(device, dinp, dweight, dlogits.operand(), inp, weight, N, C, V);
}

}  // namespace loom::cuda
