#include "monitor/step_reporter.h"

#include <filesystem>

namespace loom {
namespace fs = std::filesystem;

StepReporter::StepReporter(const std::string& run_dir, const StepSinks& sinks,
                           int64_t keep_until_step)
    : log_((fs::path(run_dir) / "metrics.jsonl").string(), keep_until_step) {
  if (sinks.tensorboard)
    tensorboard_ =
        std::make_unique<TensorBoardWriter>((fs::path(run_dir) / "tensorboard").string());
  if (sinks.prometheus_textfile) prometheus_file_ = (fs::path(run_dir) / "metrics.prom").string();
  if (sinks.prometheus_port > 0)
    server_ = std::make_unique<PrometheusServer>(sinks.prometheus_port);
}

void StepReporter::report(int64_t step, const nlohmann::json& record) {
  log_.write(record);
  if (tensorboard_) tensorboard_->scalars(step, record);
  if (server_ || !prometheus_file_.empty()) {
    prometheus_.update(record);
    const std::string text = prometheus_.text();
    if (!prometheus_file_.empty()) write_prometheus_textfile(prometheus_file_, text);
    if (server_) server_->publish(text);
  }
}

}  // namespace loom
