// Where a run's step records go: RUN_DIR/metrics.jsonl always, and as configured TensorBoard
// event files (RUN_DIR/tensorboard/), a Prometheus textfile (RUN_DIR/metrics.prom) and a
// Prometheus HTTP endpoint. World rank 0 owns one; the trainer hands it each step's record.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "monitor/metrics_log.h"
#include "monitor/prometheus.h"
#include "monitor/tensorboard.h"

namespace loom {

struct StepSinks {
  bool tensorboard = false;
  bool prometheus_textfile = false;
  int prometheus_port = 0;  // 0: no endpoint
};

class StepReporter {
 public:
  // keep_until_step: as MetricsLog's (a resumed run keeps the records up to its step).
  StepReporter(const std::string& run_dir, const StepSinks& sinks, int64_t keep_until_step);
  void report(int64_t step, const nlohmann::json& record);
  // The endpoint's port (the configured one, or the one the system chose), 0 without one.
  int prometheus_port() const { return server_ ? server_->port() : 0; }

 private:
  MetricsLog log_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::unique_ptr<PrometheusServer> server_;
  std::string prometheus_file_;  // "" = none
  PrometheusMetrics prometheus_;
};

}  // namespace loom
