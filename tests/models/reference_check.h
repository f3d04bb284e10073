// What the reference tests (gpt2_reference_test.cc against PyTorch, llama_reference_test.cc
// against transformers) share: the batch tools/export_reference.cc wrote, regenerated from seed
// 1234, and the comparison of every gradient with the golden file's.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "checkpoint/safetensors.h"
#include "models/gpt2.h"
#include "tensor/rng.h"

namespace loom::testing {

// The (4, 33) token batch of tools/export_reference.cc: inputs [:, :-1], targets [:, 1:].
inline void fill_reference_batch(Tensor& tokens, Tensor& targets) {
  RandomStream rng(1234, "reference.batch");
  for (int64_t b = 0; b < 4; ++b)
    for (int64_t t = 0; t <= 32; ++t) {
      const int32_t v = static_cast<int32_t>(rng.next_u32() % 256);
      if (t < 32) tokens.data<int32_t>()[b * 32 + t] = v;
      if (t > 0) targets.data<int32_t>()[b * 32 + t - 1] = v;
    }
}

// Every parameter's gradient within `rel` of the largest magnitude of the golden "grad.<name>"
// (double); returns how many were compared.
inline int expect_gradients_match(Gpt2& model, const SafetensorsFile& golden,
                                  const std::string& reference, double rel = 1e-4) {
  int checked = 0;
  for (const auto& p : model.params().parameters()) {
    const Tensor& ref = golden.tensors.at("grad." + p->name);
    EXPECT_EQ(ref.shape(), p->shape) << p->name;
    if (ref.shape() != p->shape) continue;
    const std::vector<float> g = p->grad.to_vector();
    double max_ref = 0, max_diff = 0;
    for (int64_t i = 0; i < ref.numel(); ++i) {
      max_ref = std::max(max_ref, std::abs(ref.data<double>()[i]));
      max_diff = std::max(max_diff, std::abs(g[i] - ref.data<double>()[i]));
    }
    EXPECT_GT(max_ref, 0) << p->name;
    EXPECT_LE(max_diff, rel * max_ref) << p->name << ": max |loom - " << reference
                                       << "| = " << max_diff << ", max |" << reference
                                       << "| = " << max_ref;
    ++checked;
  }
  return checked;
}

}  // namespace loom::testing
