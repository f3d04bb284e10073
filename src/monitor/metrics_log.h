// RUN_DIR/metrics.jsonl: one JSON object per training step (docs/formats.md), flushed per line so
// that a killed run keeps every completed step. On resume the log is cut back to the resumed
// step, so a run that crashed after its last checkpoint does not list those steps twice.
#pragma once

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace loom {

class MetricsLog {
 public:
  // Starts a fresh log, or (keep_until_step >= 0) keeps the existing records with
  // step <= keep_until_step and appends after them.
  MetricsLog(const std::string& path, int64_t keep_until_step);
  void write(const nlohmann::json& record);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
};

// The live progress line: rewritten in place on a terminal, one line per report otherwise.
class ProgressLine {
 public:
  ProgressLine(int64_t total_steps, bool terminal) : total_(total_steps), terminal_(terminal) {}
  void step(int64_t step, double loss, double lr, double grad_norm, double tokens_per_s,
            double eta_s);
  void message(const std::string& text);  // a line of its own (eval results, checkpoints)
  void finish();

 private:
  int64_t total_;
  bool terminal_;
  bool open_line_ = false;
};

std::string format_duration(double seconds);  // "1h02m", "3m07s", "12s"

}  // namespace loom
