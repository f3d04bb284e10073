#include "monitor/trace.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/timer.h"

namespace loom {

void Tracer::span(const std::string& name, const std::string& category, double begin, double end,
                  Lane lane) {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.push_back({name, category, begin, end, lane});
}

void Tracer::device_span(const std::string& name, const std::string& category, DeviceMark begin,
                         DeviceMark end) {
  if (!begin || !end) return;
  std::lock_guard<std::mutex> lock(mutex_);
  pending_.push_back({name, category, std::move(begin), std::move(end)});
}

void Tracer::resolve_device_spans() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::erase_if(pending_, [&](const PendingSpan& p) {
    const std::optional<double> begin = p.begin(), end = p.end();
    if (!begin || !end) return false;
    spans_.push_back({p.name, p.category, *begin, *end, kDevice});
    return true;
  });
}

void Tracer::write(const std::string& path) const {
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"},
                    {"ph", "M"},
                    {"pid", rank_},
                    {"args", {{"name", "rank " + std::to_string(rank_)}}}});
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool device_row =
        std::ranges::any_of(spans_, [](const Span& s) { return s.lane == kDevice; });
    if (device_row)  // the rows named, when there are two
      for (const auto& [lane, name] : {std::pair{kHost, "host"}, std::pair{kDevice, "GPU stream"}})
        events.push_back({{"name", "thread_name"},
                          {"ph", "M"},
                          {"pid", rank_},
                          {"tid", static_cast<int>(lane)},
                          {"args", {{"name", name}}}});
    for (const Span& s : spans_)
      events.push_back({{"name", s.name},
                        {"cat", s.category},
                        {"ph", "X"},  // a complete event: start and duration
                        {"ts", s.begin * 1e6},
                        {"dur", (s.end - s.begin) * 1e6},
                        {"pid", rank_},
                        {"tid", static_cast<int>(s.lane)}});
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
    : tracer_(tracer), name_(name), category_(category), number_(number), begin_(now_seconds()) {
  if (tracer_ != nullptr && tracer_->active()) device_begin_ = tracer_->device_mark();
}

void TraceScope::end() {
  if (!open_) return;
  open_ = false;
  if (tracer_ == nullptr || !tracer_->active()) return;
  const double end_time = now_seconds();
  const std::string name = number_ >= 0 ? name_ + std::to_string(number_) : std::string(name_);
  tracer_->span(name, category_, begin_, end_time);
  if (device_begin_) tracer_->device_span(name, category_, device_begin_, tracer_->device_mark());
}

}  // namespace loom
