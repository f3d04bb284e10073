#include "train/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "base/error.h"

namespace loom {

std::vector<int32_t> generate(Context& ctx, Gpt2& model, std::vector<int32_t> tokens,
                              const SampleOptions& options, RandomStream& rng) {
  const int64_t V = model.config().vocab_size;  // the logits' rows
  const int64_t max_t = model.config().max_seq_len;
  if (options.vocab < 0 || options.vocab > V)
    fail("sampling from the first ", options.vocab, " ids of a model of vocab_size ", V);
  const int64_t drawn = options.vocab > 0 ? options.vocab : V;  // the ids that may be drawn
  if (tokens.empty()) fail("sampling needs a non-empty prompt");
  if (options.temperature < 0) fail("--temperature must be >= 0, got ", options.temperature);
  if (options.tokens < 0) fail("--tokens must be >= 0, got ", options.tokens);
  if (options.top_k < 0) fail("--top-k must be >= 0, got ", options.top_k);
  if (!(options.top_p > 0 && options.top_p <= 1))
    fail("--top-p must be in (0, 1], got ", options.top_p);
  if (options.stop_token < -1 || options.stop_token >= drawn)
    fail("--stop-token ", options.stop_token, " is outside the vocabulary [0, ", drawn, ")");
  for (int32_t t : tokens)
    if (t < 0 || t >= V) fail("prompt token ", t, " is outside the vocabulary [0, ", V, ")");
  std::vector<double> probs(static_cast<size_t>(drawn));
  std::vector<int32_t> order(static_cast<size_t>(drawn));
  KvCache cache;
  int64_t cache_start = -1;  // the index in `tokens` of the cache's position 0
  for (int64_t i = 0; i < options.tokens; ++i) {
    const int64_t len = static_cast<int64_t>(tokens.size());
    const int64_t T = std::min<int64_t>(len, max_t);
    Tensor logits;
    const float* last = nullptr;
    if (options.kv_cache) {
      // The context is tokens [len − T, len); a window that moved (past max_seq_len) puts other
      // positions on every token, so the cache starts over (its buffers kept).
      if (len - T != cache_start) {
        cache.length = 0;
        cache_start = len - T;
      }
      const int64_t fresh = len - cache_start - cache.length;
      Tensor input = Tensor::empty({1, fresh}, DType::kI32);
      std::copy(tokens.end() - fresh, tokens.end(), input.data<int32_t>());
      logits = model.decode(ctx, input, cache);
      last = logits.data<float>() + (fresh - 1) * V;
    } else {
      Tensor input = Tensor::empty({1, T}, DType::kI32);
      std::copy(tokens.end() - T, tokens.end(), input.data<int32_t>());
      logits = model.logits(ctx, input);
      last = logits.data<float>() + (T - 1) * V;
    }
    int32_t next = 0;
    if (options.temperature == 0) {
      next = static_cast<int32_t>(std::max_element(last, last + drawn) - last);
    } else {
      // Keep the top-k logits (ties broken by index, for determinism), softmax, draw.
      std::iota(order.begin(), order.end(), 0);
      int64_t k = options.top_k > 0 ? std::min(options.top_k, drawn) : drawn;
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
        return last[a] != last[b] ? last[a] > last[b] : a < b;
      });
      const double mx = last[order[0]];
      double total = 0;
      for (int64_t j = 0; j < k; ++j) {
        probs[j] = std::exp((last[order[j]] - mx) / options.temperature);
        total += probs[j];
      }
      if (options.top_p < 1) {  // the nucleus: the first tokens (in order) reaching top_p
        // probs[0] = 1 (the top logit) and top_p > 0: the nucleus holds at least that token.
        const double reach = options.top_p * total;
        double kept = 0;
        int64_t nucleus = 0;
        while (nucleus < k && kept < reach) kept += probs[nucleus++];
        k = nucleus;
        total = kept;
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
    if (next == options.stop_token) break;
  }
  return tokens;
}

}  // namespace loom
