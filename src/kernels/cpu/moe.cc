#include "kernels/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

namespace loom::cpu {
namespace {
// Tokens (or rows) per parallel range.
constexpr int64_t kGrain = 64;

// A token's scores' sum, in order, in double (sigmoid scores' normalisation).
template <typename Real>
double score_sum(const Real* p, int64_t E) {
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += static_cast<double>(p[e]);
  return sum;
}
}  // namespace

template <typename Real>
void moe_route(ThreadPool& pool, Real* probs, int32_t* choice, Real* weight, Real* lse,
               const Real* logits, int64_t N, int64_t E, int64_t K, const MoeRouting& routing) {
  const float* bias = routing.bias;
  const bool sigmoid = routing.sigmoid;
  const int64_t G = routing.groups, per_group = E / G, best_of_group = K / routing.group_topk;
  pool.parallel_for(N, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> order(static_cast<size_t>(E));
    std::vector<double> group_score(static_cast<size_t>(G)),
        in_group(static_cast<size_t>(per_group));
    std::vector<int32_t> groups(static_cast<size_t>(G));
    for (int64_t t = begin; t < end; ++t) {
      const Real* l = logits + t * E;
      Real* p = probs + t * E;
      const double max = static_cast<double>(*std::max_element(l, l + E));
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(l[e]) - max);
      for (int64_t e = 0; e < E; ++e)
        p[e] = static_cast<Real>(sigmoid ? 1 / (1 + std::exp(-static_cast<double>(l[e])))
                                         : std::exp(static_cast<double>(l[e]) - max) / sum);
      lse[t] = static_cast<Real>(max + std::log(sum));
      // Without biases the score is p itself (a float widened exactly: the same order).
      const auto score = [&](int32_t e) {
        return static_cast<double>(p[e]) + (bias != nullptr ? static_cast<double>(bias[e]) : 0.0);
      };
      const auto before = [&](int32_t a, int32_t b) {
        return score(a) > score(b) || (score(a) == score(b) && a < b);
      };
      // The candidates: every expert, or those of the best group_topk groups.
      auto candidates = order.end();
      std::iota(order.begin(), order.end(), 0);
      if (G > 1) {
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t i = 0; i < per_group; ++i)
            in_group[static_cast<size_t>(i)] = score(static_cast<int32_t>(g * per_group + i));
          std::partial_sort(in_group.begin(), in_group.begin() + best_of_group, in_group.end(),
                            std::greater<>());
          double best = 0;
          for (int64_t i = 0; i < best_of_group; ++i) best += in_group[static_cast<size_t>(i)];
          group_score[static_cast<size_t>(g)] = best;
        }
        std::iota(groups.begin(), groups.end(), 0);
        std::partial_sort(groups.begin(), groups.begin() + routing.group_topk, groups.end(),
                          [&](int32_t a, int32_t b) {
                            const double sa = group_score[static_cast<size_t>(a)],
                                         sb = group_score[static_cast<size_t>(b)];
                            return sa > sb || (sa == sb && a < b);
                          });
        candidates = std::stable_partition(order.begin(), order.end(), [&](int32_t e) {
          const int32_t g = static_cast<int32_t>(e / per_group);
          return std::find(groups.begin(), groups.begin() + routing.group_topk, g) !=
                 groups.begin() + routing.group_topk;
        });
      }
      std::partial_sort(order.begin(), order.begin() + K, candidates, before);
      double chosen = 0;
      for (int64_t j = 0; j < K; ++j) chosen += static_cast<double>(p[order[static_cast<size_t>(j)]]);
      if (!routing.normalize) chosen = 1;
      for (int64_t j = 0; j < K; ++j) {
        const int32_t e = order[static_cast<size_t>(j)];
        choice[t * K + j] = e;
        weight[t * K + j] = static_cast<Real>(routing.scale * static_cast<double>(p[e]) / chosen);
      }
    }
  });
}

template <typename Real>
void moe_prob_sums(ThreadPool& pool, double* sums, const Real* probs, int64_t B, int64_t T,
                   int64_t E, bool sigmoid) {
  // Sigmoid scores: each token's score sum once (E terms), not once per expert (E² a token).
  // Kept by the calling thread (a rank's) between calls: no fresh pages every layer.
  // (The pool's threads reach it through this pointer: a thread_local named in their lambda
  // would be their own.)
  thread_local std::vector<double> token_sums;
  double* divisors = nullptr;
  if (sigmoid) {
    token_sums.resize(static_cast<size_t>(B * T));
    divisors = token_sums.data();
    pool.parallel_for(B * T, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) divisors[t] = score_sum(probs + t * E, E);
    });
  }
  pool.parallel_for(B * E, 1, [&](int64_t begin, int64_t end) {
    for (int64_t be = begin; be < end; ++be) {
      const int64_t b = be / E, e = be % E;
      double s = 0;
      for (int64_t t = b * T; t < (b + 1) * T; ++t)
        s += static_cast<double>(probs[t * E + e]) / (divisors != nullptr ? divisors[t] : 1.0);
      sums[be] = s;
    }
  });
}

void gather_rows(ThreadPool& pool, void* out, const void* in, const int32_t* rows, int64_t n,
                 int64_t row_bytes) {
  pool.parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      std::memcpy(static_cast<char*>(out) + i * row_bytes,
                  static_cast<const char*>(in) + int64_t{rows[i]} * row_bytes,
                  static_cast<size_t>(row_bytes));
  });
}

template <typename Real>
void moe_scatter_add(ThreadPool& pool, Real* y, const Real* src, const int32_t* rows,
                     const int32_t* slots, const Real* weight, int64_t n, int64_t C, int64_t K) {
  pool.parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      Real* yt = y + int64_t{rows[i]} * C;
      const Real* s = src + i * C;
      if (weight == nullptr) {
        for (int64_t c = 0; c < C; ++c) yt[c] += s[c];
        continue;
      }
      const Real w = weight[int64_t{rows[i]} * K + slots[i]];
      for (int64_t c = 0; c < C; ++c) yt[c] += w * s[c];
    }
  });
}

template <typename Real>
void moe_expert_output_grad(ThreadPool& pool, Real* g, Real* dweight, const Real* out,
                            const int32_t* rows, const int32_t* slots, const Real* weight,
                            int64_t n, int64_t C, int64_t K) {
  pool.parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = int64_t{rows[i]} * K + slots[i];
      Real* gi = g + i * C;
      const Real* oi = out + i * C;
      double dot = 0;
      for (int64_t c = 0; c < C; ++c) dot += static_cast<double>(gi[c]) * static_cast<double>(oi[c]);
      dweight[slot] = static_cast<Real>(dot);
      const Real w = weight[slot];
      for (int64_t c = 0; c < C; ++c) gi[c] *= w;
    }
  });
}

template <typename Real>
void moe_router_backward(ThreadPool& pool, Real* dlogits, const Real* probs, const int32_t* choice,
                         const Real* weight, const Real* dweight, const double* balance,
                         const Real* lse, double z, int64_t B, int64_t T, int64_t E, int64_t K,
                         bool sigmoid, double scale, bool normalize) {
  pool.parallel_for(B * T, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<double> dp(static_cast<size_t>(E));
    for (int64_t t = begin; t < end; ++t) {
      const Real* p = probs + t * E;
      const double* bal = balance + (t / T) * E;
      double chosen = 0, weighed = 0;
      for (int64_t j = 0; j < K; ++j) {
        chosen += static_cast<double>(p[choice[t * K + j]]);
        weighed += static_cast<double>(weight[t * K + j]) * static_cast<double>(dweight[t * K + j]);
      }
      if (!normalize) chosen = 1, weighed = 0;  // w_j = scale · p_j: dp_j = scale · dweight_j
      if (sigmoid) {
        // The balance term is at q = p / Σ p: dp_e = (bal_e − Σ_e' bal_e'·q_e') / Σ p.
        const double all = score_sum(p, E);
        double bq = 0;
        for (int64_t e = 0; e < E; ++e) bq += bal[e] * static_cast<double>(p[e]) / all;
        for (int64_t e = 0; e < E; ++e) dp[static_cast<size_t>(e)] = (bal[e] - bq) / all;
      } else {
        for (int64_t e = 0; e < E; ++e) dp[static_cast<size_t>(e)] = bal[e];
      }
      for (int64_t j = 0; j < K; ++j)
        dp[static_cast<size_t>(choice[t * K + j])] +=
            (scale * static_cast<double>(dweight[t * K + j]) - weighed) / chosen;
      if (sigmoid) {
        for (int64_t e = 0; e < E; ++e) {
          const double pe = static_cast<double>(p[e]);
          dlogits[t * E + e] = static_cast<Real>(dp[static_cast<size_t>(e)] * pe * (1 - pe));
        }
        continue;
      }
      double pdp = 0;
      for (int64_t e = 0; e < E; ++e) pdp += static_cast<double>(p[e]) * dp[static_cast<size_t>(e)];
      const double z_term = z != 0 ? 2 * z * static_cast<double>(lse[t]) : 0;
      for (int64_t e = 0; e < E; ++e)
        dlogits[t * E + e] = static_cast<Real>(static_cast<double>(p[e]) *
                                               (dp[static_cast<size_t>(e)] - pdp + z_term));
    }
  });
}

#define LOOM_MOE_INSTANTIATE(Real)                                                                 \
  template void moe_route<Real>(ThreadPool&, Real*, int32_t*, Real*, Real*, const Real*, int64_t,  \
                                int64_t, int64_t, const MoeRouting&);                              \
  template void moe_prob_sums<Real>(ThreadPool&, double*, const Real*, int64_t, int64_t, int64_t,  \
                                    bool);                                                         \
  template void moe_scatter_add<Real>(ThreadPool&, Real*, const Real*, const int32_t*,             \
                                      const int32_t*, const Real*, int64_t, int64_t, int64_t);     \
  template void moe_expert_output_grad<Real>(ThreadPool&, Real*, Real*, const Real*,               \
                                             const int32_t*, const int32_t*, const Real*, int64_t, \
                                             int64_t, int64_t);                                    \
  template void moe_router_backward<Real>(                                                         \
      ThreadPool&, Real*, const Real*, const int32_t*, const Real*, const Real*, const double*,    \
      const Real*, double, int64_t, int64_t, int64_t, int64_t, bool, double, bool);
LOOM_MOE_INSTANTIATE(float)
LOOM_MOE_INSTANTIATE(double)
#undef LOOM_MOE_INSTANTIATE

}  // namespace loom::cpu
