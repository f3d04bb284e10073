#include "monitor/metrics_log.h"

#include <cstdio>
#include <filesystem>
#include <sstream>
#include <vector>

#include "base/error.h"

namespace loom {

MetricsLog::MetricsLog(const std::string& path, int64_t keep_until_step) : path_(path) {
  std::vector<std::string> kept;
  if (keep_until_step >= 0) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      try {
        if (nlohmann::json::parse(line).value("step", int64_t{-1}) <= keep_until_step)
          kept.push_back(line);
      } catch (const nlohmann::json::exception&) {
        break;  // a torn last line from a killed run
      }
    }
  }
  out_.open(path, std::ios::trunc);
  if (!out_) fail("cannot open metrics log ", path);
  for (const auto& line : kept) out_ << line << '\n';
  out_.flush();
}

void MetricsLog::write(const nlohmann::json& record) {
  out_ << record.dump() << '\n';
  out_.flush();
  if (!out_) fail("cannot write metrics log ", path_);
}

std::string format_duration(double seconds) {
  if (!(seconds >= 0) || seconds > 1e8) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", static_cast<long>(s / 3600), static_cast<long>(s % 3600 / 60));
  else if (s >= 60)
    std::snprintf(buf, sizeof buf, "%ldm%02lds", static_cast<long>(s / 60), static_cast<long>(s % 60));
  else
    std::snprintf(buf, sizeof buf, "%lds", static_cast<long>(s));
  return buf;
}

void ProgressLine::step(int64_t step, double loss, double lr, double grad_norm,
                        double tokens_per_s, double eta_s) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "step %5ld/%ld | loss %.4f | lr %.3e | grad norm %.3f | %.0f tok/s | ETA %s",
                static_cast<long>(step), static_cast<long>(total_), loss, lr, grad_norm,
                tokens_per_s, format_duration(eta_s).c_str());
  if (terminal_) {
    std::fprintf(stderr, "\r\033[2K%s", buf);
    open_line_ = true;
  } else {
    std::fprintf(stderr, "%s\n", buf);
  }
  std::fflush(stderr);
}

void ProgressLine::message(const std::string& text) {
  if (open_line_) std::fprintf(stderr, "\n");
  open_line_ = false;
  std::fprintf(stderr, "%s\n", text.c_str());
  std::fflush(stderr);
}

void ProgressLine::finish() {
  if (open_line_) std::fprintf(stderr, "\n");
  open_line_ = false;
}

}  // namespace loom
