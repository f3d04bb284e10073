// A mixture of experts' routing and token movement (kernels/cpu/moe.h): the CPU's formulas, a
// token (or an expert's row, or a sequence's expert) a thread, sums in double in the CPU's order,
// so routing decisions — comparisons of probabilities — come out as the CPU's.
#include <cmath>

#include "base/error.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

// The best of the values value(0 .. n−1) ordered after (last_value, last) in (value descending,
// index ascending), among those allowed(i); −1 if none: a pass of the CPU's partial sort.
template <typename Value, typename Allowed>
__device__ int64_t next_best(int64_t n, Value value, Allowed allowed, int64_t last,
                             double last_value) {
  int64_t best = -1;
  double best_value = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!allowed(i)) continue;
    const double v = value(i);
    const bool after_last = last < 0 || v < last_value || (v == last_value && i > last);
    if (after_last && (best < 0 || v > best_value)) {
      best = i;
      best_value = v;
    }
  }
  return best;
}

// The most groups kernels/moe_routing.h's group-limited routing takes on a GPU (a bit mask).
constexpr int64_t kMaxGroups = 64;

// Token t's softmax (or each logit's sigmoid), then its top K: pass j takes the best expert
// ordered after pass j − 1's in (score descending, index ascending) — the CPU's partial sort's
// order. The score: p_e, or with a bias p_e + bias[e] in double. With groups, the candidates are
// the best group_topk groups' experts, a group's score the sum of its best K / group_topk scores
// taken in the same passes (descending), as the CPU sums them.
__global__ void moe_route_kernel(float* probs, int32_t* choice, float* weight, float* lse,
                                 const float* logits, int64_t N, int64_t E, int64_t K,
                                 MoeRouting routing) {
  const float* bias = routing.bias;
  const bool sigmoid = routing.sigmoid;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < N;
       t += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const float* l = logits + t * E;
    float* p = probs + t * E;
    float top = l[0];
    for (int64_t e = 1; e < E; ++e) top = fmaxf(top, l[e]);
    const double max = top;
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += exp(static_cast<double>(l[e]) - max);
    for (int64_t e = 0; e < E; ++e)
      p[e] = static_cast<float>(sigmoid ? 1 / (1 + exp(-static_cast<double>(l[e])))
                                        : exp(static_cast<double>(l[e]) - max) / sum);
    lse[t] = static_cast<float>(max + log(sum));
    const auto score = [&](int64_t e) {
      return static_cast<double>(p[e]) + (bias != nullptr ? static_cast<double>(bias[e]) : 0.0);
    };
    const int64_t G = routing.groups, per_group = E / G;
    uint64_t allowed_groups = ~uint64_t{0};
    if (G > 1) {
      const auto group_score = [&](int64_t g) {
        const auto in_group = [&](int64_t i) { return score(g * per_group + i); };
        const auto any = [](int64_t) { return true; };
        double sum = 0, last_value = 0;
        int64_t last = -1;
        for (int64_t i = 0; i < K / routing.group_topk; ++i) {
          last = next_best(per_group, in_group, any, last, last_value);
          if (last < 0) break;
          last_value = in_group(last);
          sum += last_value;
        }
        return sum;
      };
      allowed_groups = 0;
      double last_value = 0;
      int64_t last = -1;
      for (int64_t i = 0; i < routing.group_topk; ++i) {
        last = next_best(
            G, group_score, [](int64_t) { return true; }, last, last_value);
        if (last < 0) break;
        last_value = group_score(last);
        allowed_groups |= uint64_t{1} << last;
      }
    }
    const auto candidate = [&](int64_t e) { return (allowed_groups >> (e / per_group)) & 1; };
    double last_score = 0;
    int64_t last = -1;
    double chosen = 0;
    for (int64_t j = 0; j < K; ++j) {
      int64_t best = next_best(E, score, candidate, last, last_score);
      if (best < 0) best = j;  // every probability NaN (a diverged run): still an expert's index
      choice[t * K + j] = static_cast<int32_t>(best);
      last = best;
      last_score = score(best);
      chosen += static_cast<double>(p[best]);
    }
    if (!routing.normalize) chosen = 1;
    for (int64_t j = 0; j < K; ++j)
      weight[t * K + j] =
          static_cast<float>(routing.scale * static_cast<double>(p[choice[t * K + j]]) / chosen);
  }
}

// A token's scores' sum, in order, in double (sigmoid scores' normalisation).
__device__ double score_sum(const float* p, int64_t E) {
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += static_cast<double>(p[e]);
  return sum;
}

// One block of kThreads per sequence b. The sequence's tokens a chunk of kThreads at a time: each
// thread sums one token's scores (sigmoid scores' normalisation: E terms a token, not E² as a
// thread per expert recomputing them would), then each thread adds the chunk's terms of its
// experts e = threadIdx.x + j · kThreads, in token order — the same sums as the CPU's.
constexpr int kProbSumExperts = 4;  // experts a thread keeps: up to 4 · kThreads = 1024

__global__ void moe_prob_sums_kernel(double* sums, const float* probs, int64_t B, int64_t T,
                                     int64_t E, bool sigmoid) {
  __shared__ double token_sum[kThreads];
  const int64_t b = blockIdx.x;
  double acc[kProbSumExperts] = {0, 0, 0, 0};
  for (int64_t chunk = 0; chunk < T; chunk += kThreads) {
    const int64_t n = T - chunk < kThreads ? T - chunk : kThreads;
    if (sigmoid && threadIdx.x < n)
      token_sum[threadIdx.x] = score_sum(probs + (b * T + chunk + threadIdx.x) * E, E);
    __syncthreads();
    for (int j = 0; j < kProbSumExperts; ++j) {
      const int64_t e = threadIdx.x + static_cast<int64_t>(j) * kThreads;
      if (e >= E) break;
      for (int64_t i = 0; i < n; ++i)
        acc[j] += static_cast<double>(probs[(b * T + chunk + i) * E + e]) /
                  (sigmoid ? token_sum[i] : 1.0);
    }
    __syncthreads();  // the chunk's sums read before the next chunk's are written
  }
  for (int j = 0; j < kProbSumExperts; ++j) {
    const int64_t e = threadIdx.x + static_cast<int64_t>(j) * kThreads;
    if (e < E) sums[b * E + e] = acc[j];
  }
}

// 16-bit units: every row here is whole floats or 16-bit values.
__global__ void moe_gather_rows_kernel(uint16_t* out, const uint16_t* in, const int32_t* rows,
                                       int64_t n, int64_t units) {
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < n * units;
       u += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t i = u / units, c = u % units;
    out[u] = in[int64_t{rows[i]} * units + c];
  }
}

__global__ void moe_scatter_add_kernel(float* y, const float* src, const int32_t* rows,
                                       const int32_t* slots, const float* weight, int64_t n,
                                       int64_t C, int64_t K) {
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < n * C;
       u += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t i = u / C, c = u % C;
    float* yt = y + int64_t{rows[i]} * C + c;
    if (weight == nullptr) *yt += src[u];
    else *yt += weight[int64_t{rows[i]} * K + slots[i]] * src[u];
  }
}

__global__ void moe_expert_output_grad_kernel(float* g, float* dweight, const float* out,
                                              const int32_t* rows, const int32_t* slots,
                                              const float* weight, int64_t n, int64_t C,
                                              int64_t K) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t slot = int64_t{rows[i]} * K + slots[i];
    float* gi = g + i * C;
    const float* oi = out + i * C;
    double dot = 0;
    for (int64_t c = 0; c < C; ++c) dot += static_cast<double>(gi[c]) * static_cast<double>(oi[c]);
    dweight[slot] = static_cast<float>(dot);
    const float w = weight[slot];
    for (int64_t c = 0; c < C; ++c) gi[c] *= w;
  }
}

// dp lives in dlogits' row (as double's worth is not needed: the CPU's double dp is recomputed
// per expert from its parts, in the same order).
__global__ void moe_router_backward_kernel(float* dlogits, const float* probs,
                                           const int32_t* choice, const float* weight,
                                           const float* dweight, const double* balance,
                                           const float* lse, double z, int64_t B, int64_t T,
                                           int64_t E, int64_t K, bool sigmoid, double scale,
                                           bool normalize) {
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < B * T;
       t += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const float* p = probs + t * E;
    const double* bal = balance + (t / T) * E;
    double chosen = 0, weighed = 0;
    for (int64_t j = 0; j < K; ++j) {
      chosen += static_cast<double>(p[choice[t * K + j]]);
      weighed += static_cast<double>(weight[t * K + j]) * static_cast<double>(dweight[t * K + j]);
    }
    if (!normalize) chosen = 1, weighed = 0;  // w_j = scale · p_j: dp_j = scale · dweight_j
    // dp_e = bal_e (sigmoid scores: at q = p / Σ p, (bal_e − Σ_e' bal_e'·q_e') / Σ p), plus the
    // renormalisation's term where e is chosen.
    double all = 1, bq = 0;
    if (sigmoid) {
      all = score_sum(p, E);
      for (int64_t e = 0; e < E; ++e) bq += bal[e] * static_cast<double>(p[e]) / all;
    }
    const auto dp = [&](int64_t e) {
      double d = sigmoid ? (bal[e] - bq) / all : bal[e];
      for (int64_t j = 0; j < K; ++j)
        if (choice[t * K + j] == e)
          d += (scale * static_cast<double>(dweight[t * K + j]) - weighed) / chosen;
      return d;
    };
    if (sigmoid) {
      for (int64_t e = 0; e < E; ++e) {
        const double pe = static_cast<double>(p[e]);
        dlogits[t * E + e] = static_cast<float>(dp(e) * pe * (1 - pe));
      }
      continue;
    }
    double pdp = 0;
    for (int64_t e = 0; e < E; ++e) pdp += static_cast<double>(p[e]) * dp(e);
    const double z_term = z != 0 ? 2 * z * static_cast<double>(lse[t]) : 0;
    for (int64_t e = 0; e < E; ++e)
      dlogits[t * E + e] = static_cast<float>(static_cast<double>(p[e]) * (dp(e) - pdp + z_term));
  }
}

}  // namespace

void moe_route(int device, float* probs, int32_t* choice, float* weight, float* lse,
               const float* logits, int64_t N, int64_t E, int64_t K, const MoeRouting& routing) {
  if (N == 0) return;
  LOOM_CHECK_MSG(routing.groups <= kMaxGroups, "moe_route: at most 64 expert groups on a GPU");
  DeviceGuard guard(device);
  launch("moe_route", moe_route_kernel, blocks_for(N, kThreads), kThreads, probs, choice, weight,
         lse, logits, N, E, K, routing);
}

void moe_prob_sums(int device, double* sums, const float* probs, int64_t B, int64_t T, int64_t E,
                   bool sigmoid) {
  if (B * E == 0) return;
  // ModelLimits::kExperts (1024): the config refuses more.
  if (E > kProbSumExperts * kThreads)
    fail("moe_prob_sums: ", E, " experts, at most ", kProbSumExperts * kThreads);
  DeviceGuard guard(device);
  launch("moe_prob_sums", moe_prob_sums_kernel, static_cast<unsigned>(B), kThreads, sums, probs, B,
         T, E, sigmoid);
}

void gather_rows(int device, void* out, const void* in, const int32_t* rows, int64_t n,
                 int64_t row_bytes) {
  LOOM_CHECK_MSG(row_bytes % 2 == 0, "gather_rows: rows of whole 16-bit units");
  if (n * row_bytes == 0) return;
  DeviceGuard guard(device);
  const int64_t units = row_bytes / 2;
  launch("gather_rows", moe_gather_rows_kernel, blocks_for(n * units, kThreads), kThreads,
         static_cast<uint16_t*>(out), static_cast<const uint16_t*>(in), rows, n, units);
}

void moe_scatter_add(int device, float* y, const float* src, const int32_t* rows,
                     const int32_t* slots, const float* weight, int64_t n, int64_t C, int64_t K) {
  if (n * C == 0) return;
  DeviceGuard guard(device);
  launch("moe_scatter_add", moe_scatter_add_kernel, blocks_for(n * C, kThreads), kThreads, y, src,
         rows, slots, weight, n, C, K);
}

void moe_expert_output_grad(int device, float* g, float* dweight, const float* out,
                            const int32_t* rows, const int32_t* slots, const float* weight,
                            int64_t n, int64_t C, int64_t K) {
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("moe_expert_output_grad", moe_expert_output_grad_kernel, blocks_for(n, kThreads),
         kThreads, g, dweight, out, rows, slots, weight, n, C, K);
}

void moe_router_backward(int device, float* dlogits, const float* probs, const int32_t* choice,
                         const float* weight, const float* dweight, const double* balance,
                         const float* lse, double z, int64_t B, int64_t T, int64_t E, int64_t K,
                         bool sigmoid, double scale, bool normalize) {
  if (B * T == 0) return;
  DeviceGuard guard(device);
  launch("moe_router_backward", moe_router_backward_kernel, blocks_for(B * T, kThreads), kThreads,
         dlogits, probs, choice, weight, dweight, balance, lse, z, B, T, E, K, sigmoid, scale,
         normalize);
}

}  // namespace loom::cuda
