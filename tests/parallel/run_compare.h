// Comparing a parallel training run with the single-device one, shared by the parallelism
// tests: the runs' metrics.jsonl and their final whole-model checkpoints. The measures live in
// src/train/run_compare.h, shared with `loom check`.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train/run_compare.h"

namespace loom::testing {

// RUN_DIR/metrics.jsonl, one record per step.
inline std::vector<nlohmann::json> read_metrics(const std::filesystem::path& run_dir) {
  return loom::read_metrics(run_dir);
}

// Every parameter tensor of two model.safetensors within `rel` relative L2 error,
// ‖got − reference‖₂ ≤ rel · ‖reference‖₂ (why not elementwise: src/train/run_compare.h).
inline void expect_weights_match(const std::filesystem::path& reference,
                                 const std::filesystem::path& got, const std::string& name,
                                 double rel = 1e-4) {
  const WeightsDeviation d = compare_weights(reference, got);  // throws on other names/shapes
  for (const TensorDeviation& t : d.tensors) EXPECT_LE(t.rel_l2, rel) << name << ": " << t.name;
}

}  // namespace loom::testing
