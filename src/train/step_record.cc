#include "train/step_record.h"

#include <cstdio>

namespace loom {

nlohmann::json step_record(const StepFigures& f) {
  constexpr double kMiB = 1048576.0;
  const auto ms = [&f](const AxisFigures& a) {
    nlohmann::json j = {
        {"dp", a.dp * 1e3}, {"pp", a.pp * 1e3}, {"tp", a.tp * 1e3}, {"cp", a.cp * 1e3}};
    if (f.expert_parallel) j["ep"] = a.ep * 1e3;
    return j;
  };
  const double flops_per_s = f.flops_per_step / f.seconds;
  nlohmann::json record = {
      {"step", f.step},
      {"loss", f.loss},
      {"lr", f.lr},
      {"grad_norm", f.grad_norm},
      {"tokens_per_s", static_cast<double>(f.tokens_per_step) / f.seconds},
      {"step_ms", f.seconds * 1e3},
      {"comm_wait_ms", f.comm_wait_seconds * 1e3},
      {"data_ms", f.data_seconds * 1e3},
      {"comm_ms", ms(f.comm_seconds)},
      {"compute_ms", f.compute_seconds() * 1e3},
      {"tflops", flops_per_s / 1e12},
      {"mfu", flops_per_s / (f.peak_tflops * 1e12 * f.world_size)},
      {"tokens", f.tokens_total >= 0 ? f.tokens_total : f.step * f.tokens_per_step},
      {"peak_mem_mb", static_cast<double>(f.peak_bytes) / kMiB},
      {"mem_params_mb", static_cast<double>(f.state_bytes.params) / kMiB},
      {"mem_grads_mb", static_cast<double>(f.state_bytes.grads) / kMiB},
      {"mem_optimizer_mb", static_cast<double>(f.state_bytes.optimizer) / kMiB},
      {"mem_activations_peak_mb", static_cast<double>(f.peak_bytes - f.held_bytes) / kMiB}};
  if (f.batch_size > 0) record["batch_size"] = f.batch_size;
  if (f.val_loss) record["val_loss"] = *f.val_loss;
  for (const auto& [name, val] : f.val_losses) record["val_losses"][name] = val;
  for (size_t d = 0; d < f.data_epochs.size(); ++d)
    record["data_epochs"][std::to_string(d + 1)] = f.data_epochs[d];
  if (f.loss_scale) record["loss_scale"] = *f.loss_scale;
  if (f.z_loss) record["z_loss"] = *f.z_loss;
  if (f.moe_aux_loss) record["moe_aux_loss"] = *f.moe_aux_loss;
  if (f.moe_expert_load) record["moe_expert_load"] = *f.moe_expert_load;
  if (f.moe_dropped) record["moe_dropped"] = *f.moe_dropped;
  if (f.skipped) record["skipped"] = true;
  record["comm_bytes"] = {{"dp", f.comm_bytes.dp},
                          {"pp", f.comm_bytes.pp},
                          {"tp", f.comm_bytes.tp},
                          {"cp", f.comm_bytes.cp}};
  if (f.expert_parallel) record["comm_bytes"]["ep"] = f.comm_bytes.ep;
  if (f.dp_replicate_bytes) record["comm_bytes"]["dp_replicate"] = *f.dp_replicate_bytes;
  if (f.pipeline) {
    const PipelineFigures& p = *f.pipeline;
    record["bubble"] = p.bubble;
    record["bubble_theory"] = p.bubble_theory;
    record["bubble_by_pp_rank"] = p.bubble_by_pp_rank;
    record["pp_bytes_sent"] = p.bytes_sent;
    if (p.max_deferred_bytes)
      record["pp_deferred_mb"] = static_cast<double>(*p.max_deferred_bytes) / kMiB;
  }
  return record;
}

std::string validation_message(const StepFigures& f) {
  if (!f.val_loss && f.val_losses.empty()) return "";
  std::string text = "step " + std::to_string(f.step) + ": val loss";
  const char* separator = " ";
  char value[48];
  if (f.val_loss) {
    std::snprintf(value, sizeof value, " %.4f", *f.val_loss);
    text += value;
    separator = " | ";
  }
  for (const auto& [name, val] : f.val_losses) {
    std::snprintf(value, sizeof value, " %.4f", val);
    text += separator + name + value;
    separator = " | ";
  }
  return text;
}

}  // namespace loom
