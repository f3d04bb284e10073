// `loom check`: do the losses differ between layouts? Trains the config's model for a few steps
// once on one device (the reference) and once per layout on thread ranks of the local backend,
// all on the same global batch and data, and reports per layout the largest relative deviation
// of the loss over the steps and the relative L2 deviation of the final parameters from the
// reference's.
//
// Each run is a copy of the config with train.steps = steps, warm-up capped at steps, evaluation
// off, a checkpoint at the last step, the layout's parallel settings, runtime.backend = "local"
// and runtime.ranks = dp × tp × pp. A layout that cannot run (it does not divide the batch, is
// not implemented, fails validation) is a row with its error; only a failing reference throws.
// See docs/check.md.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "config/config.h"

namespace loom {

// One layout: dp, tp, pp (1 when not given) and optional settings that otherwise follow the
// config where they apply (zero when dp > 1, schedule and virtual_stages when pp > 1,
// sequence_parallel when tp > 1) and are off / 1 where they do not.
struct CheckLayout {
  int dp = 1, tp = 1, pp = 1, cp = 1;
  int ep = 1;  // expert parallelism (parallel.ep): within dp, no ranks of its own
  std::optional<std::string> ep_dispatch;  // all_gather or all_to_all (parallel.ep_dispatch)
  std::optional<int> zero;
  std::optional<int> dp_shard;  // hybrid sharding (parallel.dp_shard): within dp, no ranks
  std::optional<std::string> schedule;
  std::optional<int> virtual_stages;
  std::optional<bool> sequence_parallel;
  std::optional<int64_t> micro_batch_size;
  std::optional<std::string> recompute;  // none, full or selective (parallel.recompute)
  std::optional<std::string> cp_comm;    // all_gather or ring (parallel.cp_comm)

  int ranks() const { return dp * tp * pp * cp; }
  // Canonical text: the degrees above 1, then the optional settings given, "dp=2,tp=2,zero=1";
  // "one device" when nothing is set.
  std::string name() const;
};

// `;`-separated layouts, each `,`-separated key=value items. Keys: dp, tp, pp, cp, ep, zero,
// dp_shard, schedule, virtual_stages (v), sequence_parallel (sp, 0/1/true/false), micro_batch_size
// (mbs). Throws loom::Error naming the offending item (and its layout) for an unknown key, a
// missing `=`, a repeated key or a value that is not a positive integer / known schedule.
std::vector<CheckLayout> parse_layouts(std::string_view text);

inline constexpr const char* kDefaultCheckLayouts = "dp=2;tp=2;pp=2;dp=2,tp=2;dp=2,pp=2;pp=2,tp=2";

// `loom check`'s tolerance at bf16 / fp16 matmul precision when none is given: layouts sum in
// other orders, and values an fp32 ulp apart round to 16 bits differently now and then
// (docs/check.md).
inline constexpr double kSixteenBitCheckTolerance = 1e-2;

struct LayoutCheckOptions {
  int64_t steps = 6;
  std::string out_dir;       // run dirs go here (kept); "" = a fresh temp dir
  bool keep = false;         // keep the fresh temp dir
  int64_t max_layers = 0;    // > 0: cap model.n_layers
  int64_t max_seq_len = 0;   // > 0: cap model.seq_len
  double tolerance = 1e-4;   // a row "DIFFERS" when a deviation exceeds it
  // Called before each run with (index, count, name); index 0 is the reference.
  std::function<void(int, int, const std::string&)> on_run;
};

struct LayoutCheckRow {
  std::string layout;         // CheckLayout::name()
  int ranks = 1;
  int zero = 0;
  bool sequence_parallel = false;
  std::string schedule;       // "" when pp = 1
  int virtual_stages = 1;
  int64_t micro_batch_size = 0;
  std::string recompute = "none";
  std::string status;         // "ok", "DIFFERS" or "error"
  std::string error;          // the message when status is "error"
  double loss_max_rel_dev = 0;   // max over steps of |loss − ref| / |ref|
  int64_t loss_worst_step = 0;
  // Max over steps of |grad_norm − ref| / ref: the gradient itself, before clipping, which a
  // layout's reduction gets wrong (a group left out of the norm's sum) before its losses show it.
  double grad_norm_max_rel_dev = 0;
  int64_t grad_norm_worst_step = 0;
  // Parameters at the last step (measures: train/run_compare.h). What decides the status:
  double param_rel_dev = 0;          // whole model, ‖p − ref‖₂ / ‖ref‖₂ over all parameters
  std::string param_largest_tensor;  // the tensor with the largest ‖p − ref‖₂
  // Diagnostics (JSON only):
  double param_tensor_max_rel_dev = 0;  // max over tensors of ‖p − ref‖₂ / ‖ref‖₂
  std::string param_tensor_worst;       // that tensor
  double param_elem_max_rel_dev = 0;    // max over tensors of max|p − ref| / max|ref|
  std::string run_dir;        // where it ran ("" after removal)
  double seconds = 0;
};

struct LayoutCheckResult {
  int64_t steps = 0;
  int64_t n_layers = 0, seq_len = 0;           // the model shape used
  int64_t config_n_layers = 0, config_seq_len = 0;  // and the config's
  int64_t batch_size = 0;
  double tolerance = 0;
  std::vector<double> reference_losses;
  std::vector<double> reference_grad_norms;
  int64_t reference_micro_batch_size = 0;
  double reference_seconds = 0;
  std::string out_dir;   // "" when the temp dir was removed
  std::vector<LayoutCheckRow> rows;

  bool all_ok() const;
};

LayoutCheckResult check_layouts(const Config& config, const std::vector<CheckLayout>& layouts,
                                const LayoutCheckOptions& options);

// The table `loom check` prints: a header, the reference line, one line per layout.
std::string format_layout_check(const LayoutCheckResult& result);
// The result as one JSON document (settings, reference losses, rows).
std::string layout_check_json(const LayoutCheckResult& result);

}  // namespace loom
