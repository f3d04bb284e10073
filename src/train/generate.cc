#include "train/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/error.h"

namespace loom {

std::vector<int32_t> generate(Context& ctx, Gpt2& model, std::vector<int32_t> tokens,
                              const SampleOptions& options, RandomStream& rng) {
  const int64_t V = model.config().vocab_size;
  const int64_t max_t = model.config().max_seq_len;
  if (tokens.empty()) fail("sampling needs a non-empty prompt");
  if (options.temperature < 0) fail("--temperature must be >= 0, got ", options.temperature);
  if (options.tokens < 0) fail("--tokens must be >= 0, got ", options.tokens);
  if (options.top_k < 0) fail("--top-k must be >= 0, got ", options.top_k);
  for (int32_t t : tokens)
    if (t < 0 || t >= V) fail("prompt token ", t, " is outside the vocabulary [0, ", V, ")");
  std::vector<double> probs(static_cast<size_t>(V));
  std::vector<int32_t> order(static_cast<size_t>(V));
  for (int64_t i = 0; i < options.tokens; ++i) {
    const int64_t T = std::min<int64_t>(static_cast<int64_t>(tokens.size()), max_t);
    Tensor input = Tensor::empty({1, T}, DType::kI32);
    std::copy(tokens.end() - T, tokens.end(), input.data<int32_t>());
    Tensor logits = model.logits(ctx, input);
    const float* last = logits.data<float>() + (T - 1) * V;
    int32_t next = 0;
    if (options.temperature == 0) {
      next = static_cast<int32_t>(std::max_element(last, last + V) - last);
    } else {
      // Keep the top-k logits (ties broken by index, for determinism), softmax, draw.
      std::iota(order.begin(), order.end(), 0);
      const int64_t k = options.top_k > 0 ? std::min(options.top_k, V) : V;
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
        return last[a] != last[b] ? last[a] > last[b] : a < b;
      });
      const double mx = last[order[0]];
      double total = 0;
      for (int64_t j = 0; j < k; ++j) {
        probs[j] = std::exp((last[order[j]] - mx) / options.temperature);
        total += probs[j];
      }
      double u = static_cast<double>(rng.next_uniform()) * total;
      next = order[k - 1];
      for (int64_t j = 0; j < k; ++j) {
        u -= probs[j];
        if (u < 0) {
          next = order[j];
          break;
        }
      }
    }
    tokens.push_back(next);
  }
  return tokens;
}

}  // namespace loom
