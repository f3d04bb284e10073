#include "monitor/trace.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/timer.h"

namespace loom {

void Tracer::span(const std::string& name, const std::string& category, double begin, double end) {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.push_back({name, category, begin, end});
}

void Tracer::write(const std::string& path) const {
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", rank_},
                    {"args", {{"name", "rank " + std::to_string(rank_)}}}});
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Span& s : spans_)
      events.push_back({{"name", s.name},
                        {"cat", s.category},
                        {"ph", "X"},  // a complete event: start and duration
                        {"ts", s.begin * 1e6},
                        {"dur", (s.end - s.begin) * 1e6},
                        {"pid", rank_},
                        {"tid", 0}});
  }
  std::ofstream out(path);
  out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << "\n";
  if (!out) fail("cannot write the trace ", path);
}

void merge_traces(const std::vector<std::string>& rank_files, const std::string& path) {
  nlohmann::json events = nlohmann::json::array();
  for (const std::string& file : rank_files) {
    std::ifstream in(file);
    if (!in) fail("cannot read the trace ", file);
    nlohmann::json rank = nlohmann::json::parse(in);
    for (auto& e : rank.at("traceEvents")) events.push_back(std::move(e));
  }
  std::ofstream out(path);
  out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << "\n";
  if (!out) fail("cannot write the trace ", path);
}

TraceScope::TraceScope(Tracer* tracer, const char* name, const char* category, int64_t number)
    : tracer_(tracer), name_(name), category_(category), number_(number), begin_(now_seconds()) {}

void TraceScope::end() {
  if (!open_) return;
  open_ = false;
  if (tracer_ == nullptr || !tracer_->active()) return;
  const double end_time = now_seconds();
  tracer_->span(number_ >= 0 ? name_ + std::to_string(number_) : std::string(name_), category_,
                begin_, end_time);
}

}  // namespace loom
