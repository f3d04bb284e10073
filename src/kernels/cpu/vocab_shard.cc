#include "kernels/cpu/vocab_shard.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/error.h"
#include "kernels/targets.h"

namespace loom::cpu {

void vocab_shard_embedding_forward(ThreadPool& pool, float* out, const int32_t* tokens,
                                   const float* wte, const float* wpe, int64_t N, int64_t T,
                                   int64_t C, const VocabShard& shard, bool add_positions) {
  for (int64_t i = 0; i < N; ++i)
    if (tokens[i] < 0 || tokens[i] >= shard.vocab)
      fail("embedding: token ", tokens[i], " at position ", i, " outside [0, ", shard.vocab, ")");
  pool.parallel_for(N, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float* o = out + i * C;
      const int64_t row = tokens[i] - shard.first_row;
      if (row >= 0 && row < shard.real_rows)
        for (int64_t c = 0; c < C; ++c) o[c] = wte[row * C + c];
      else
        for (int64_t c = 0; c < C; ++c) o[c] = 0.0f;
      if (add_positions && wpe != nullptr)
        for (int64_t c = 0; c < C; ++c) o[c] += wpe[(i % T) * C + c];
    }
  });
}

void vocab_shard_embedding_backward(ThreadPool& pool, float* dwte, float* dwpe, const float* dout,
                                    const int32_t* tokens, int64_t N, int64_t T, int64_t C,
                                    const VocabShard& shard) {
  // Threads own channel slices, rows summed in position order: deterministic.
  pool.parallel_for(C, 8, [&](int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < N; ++i) {
      const float* g = dout + i * C;
      const int64_t row = tokens[i] - shard.first_row;
      for (int64_t c = c0; c < c1; ++c) {
        if (row >= 0 && row < shard.real_rows) dwte[row * C + c] += g[c];
        if (dwpe != nullptr) dwpe[(i % T) * C + c] += g[c];
      }
    }
  });
}

void vocab_shard_logit_max(ThreadPool& pool, float* max, float* target_logit, const float* logits,
                           const int32_t* targets, int64_t N, const VocabShard& shard) {
  // Padding columns (j >= real_rows) take no part.
  pool.parallel_for(N, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* l = logits + i * shard.rows;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < shard.real_rows; ++j) m = std::max(m, l[j]);
      max[i] = m;
      const int64_t t = targets[i] - shard.first_row;
      if (t >= 0 && t < shard.real_rows) target_logit[i] = l[t];
    }
  });
}

void vocab_shard_sum_exp(ThreadPool& pool, float* sum, const float* logits, const float* max,
                         int64_t N, const VocabShard& shard) {
  pool.parallel_for(N, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const float* l = logits + i * shard.rows;
      const float m = max[i];
      double s = 0;
      for (int64_t j = 0; j < shard.real_rows; ++j) s += std::exp(static_cast<double>(l[j] - m));
      sum[i] = static_cast<float>(s);
    }
  });
}

void vocab_shard_loss_sum(ThreadPool&, double* result, const float* sum, const float* max,
                          const float* target_logit, const int32_t* targets, int64_t N) {
  double loss = 0;
  for (int64_t i = 0; i < N; ++i)
    if (targets[i] != kIgnoredTarget)
      loss += std::log(static_cast<double>(sum[i])) + max[i] - target_logit[i];
  *result = loss;
}

void vocab_shard_cross_entropy_backward(ThreadPool& pool, float* logits, const float* max,
                                        const float* sum, const int32_t* targets, float k,
                                        int64_t N, const VocabShard& shard, float z_loss) {
  pool.parallel_for(N, 8, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float* l = logits + i * shard.rows;
      if (targets[i] == kIgnoredTarget) {
        std::fill(l, l + shard.rows, 0.0f);
        continue;
      }
      const float m = max[i], s = sum[i];
      const int64_t t = targets[i] - shard.first_row;
      const float softmax_factor = 1.0f + 2.0f * z_loss * (m + std::log(s));  // 1 without z-loss
      for (int64_t j = 0; j < shard.rows; ++j) {
        const float p = j < shard.real_rows ? std::exp(l[j] - m) / s * softmax_factor : 0.0f;
        l[j] = (p - (j == t ? 1.0f : 0.0f)) * k;
      }
    }
  });
}

}  // namespace loom::cpu
