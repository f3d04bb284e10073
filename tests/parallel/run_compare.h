// Comparing a parallel training run with the single-device one, shared by the parallelism
// tests: the runs' metrics.jsonl and their final whole-model checkpoints.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"

namespace loom::testing {

// RUN_DIR/metrics.jsonl, one record per step.
inline std::vector<nlohmann::json> read_metrics(const std::filesystem::path& run_dir) {
  std::ifstream in(run_dir / "metrics.jsonl");
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Every parameter tensor of two model.safetensors within `rel` relative L2 error. (Elementwise,
// layouts sum in another order — gradients differ by ~1e-7 relative — and AdamW's m/√v magnifies
// that for the few elements whose gradient is near zero, so single elements may differ by ~1e-3.)
inline void expect_weights_match(const std::filesystem::path& reference,
                                 const std::filesystem::path& got, const std::string& name,
                                 double rel = 1e-4) {
  const SafetensorsFile a = load_safetensors(reference.string());
  const SafetensorsFile b = load_safetensors(got.string());
  ASSERT_EQ(a.tensors.size(), b.tensors.size()) << name;
  for (const auto& [key, x] : a.tensors) {
    const Tensor& y = b.tensors.at(key);
    ASSERT_EQ(x.shape(), y.shape()) << name << ": " << key;
    double diff2 = 0, norm2 = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double u = x.data<float>()[i], v = y.data<float>()[i];
      diff2 += (u - v) * (u - v);
      norm2 += u * u;
    }
    EXPECT_LE(std::sqrt(diff2), rel * std::sqrt(norm2)) << name << ": " << key;
  }
}

}  // namespace loom::testing
