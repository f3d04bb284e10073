// Comparing training runs: a run's per-step losses (RUN_DIR/metrics.jsonl) and the parameters of
// two whole-model checkpoints (model.safetensors). Used by `loom check` (train/layout_check.h)
// and by the parallelism equivalence tests (tests/parallel/run_compare.h).
//
// The parameter measures are norm-wise. Elementwise relative errors are not useful here: layouts
// sum in another order (gradients differ by ~1e-7 relative), and AdamW's m/√v magnifies that
// for elements whose gradient is (near) zero, so single elements may differ by ~1e-3 of their
// own size. Per tensor, the same holds for a tensor made mostly of such elements: the key part
// of attention's qkv bias has an exactly zero gradient (softmax ignores a constant added to
// every key), so its updates are rounding noise that differs between layouts, and after a few
// steps the whole qkv.bias differs by ~1e-4 of its (small) norm while every other tensor agrees
// to ~1e-7. The whole-model measure ‖p − ref‖₂ / ‖ref‖₂ over all parameters does not have that
// blind spot and still sees a tensor that is wrong (it moves the sum by that tensor's norm).
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace loom {

// RUN_DIR/metrics.jsonl, one JSON object per line (per step). Throws loom::Error naming the
// file when it is missing or a line is not JSON.
std::vector<nlohmann::json> read_metrics(const std::filesystem::path& run_dir);

// The "loss" of each record, in file order; throws loom::Error naming the file and line when a
// record has no numeric loss.
std::vector<double> read_losses(const std::filesystem::path& run_dir);

struct LossDeviation {
  double max_rel = 0;     // max over steps of |loss − ref| / |ref|
  int64_t worst_step = 0; // 1-based step of that maximum (0 when equal everywhere)
};
// Throws loom::Error when the runs have different step counts.
LossDeviation compare_losses(const std::vector<double>& reference, const std::vector<double>& got);

// The "grad_norm" of each record (NaN where it is null: a step skipped on an overflow), and how
// far a run's are from the reference's — as compare_losses, but a step where both norms are not
// finite (both runs skipped it) matches.
std::vector<double> read_grad_norms(const std::filesystem::path& run_dir);
LossDeviation compare_grad_norms(const std::vector<double>& reference,
                                 const std::vector<double>& got);

struct TensorDeviation {
  std::string name;
  double rel_l2 = 0;   // ‖p − ref‖₂ / ‖ref‖₂ (‖p − ref‖₂ itself when ref is all zeros)
  double rel_max = 0;  // max|p − ref| / max|ref|, the same fallback
};

struct WeightsDeviation {
  std::vector<TensorDeviation> tensors;  // in the reference's name order
  double rel_l2 = 0;        // whole model: ‖p − ref‖₂ / ‖ref‖₂ over all parameters
  std::string largest;      // the tensor with the largest ‖p − ref‖₂ (its share of rel_l2)
  double max_rel_l2 = 0;    // max over tensors of their rel_l2
  std::string worst;        // the tensor with that maximum
};

// Compares every tensor of two safetensors files (f32, f64 or bf16/f16, read as double).
// Throws loom::Error naming the files when the tensor names or a tensor's shape differ.
WeightsDeviation compare_weights(const std::filesystem::path& reference,
                                 const std::filesystem::path& got);

}  // namespace loom
