// Timelines of chosen steps (`metrics.trace_from_step`, `metrics.trace_steps`) in the Chrome trace
// event format, which Perfetto (ui.perfetto.dev) and chrome://tracing open: one row per rank
// (pid = world rank), spans for each step and its phases (data, forward + backward of each
// micro-batch, the optimizer) and for every wait on communication, named by mesh axis. Each rank
// writes RUN_DIR/trace/rank_R.json; world rank 0 merges them into RUN_DIR/trace.json.
//
// Times are microseconds of the monotonic clock, the same for every process of one machine;
// processes on other machines have clocks of their own (their rows are shifted by the clocks'
// difference).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace loom {

class Tracer {
 public:
  explicit Tracer(int rank) : rank_(rank) {}

  void set_active(bool active) { active_ = active; }
  bool active() const { return active_; }
  bool empty() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return spans_.empty();
  }
  // A span [begin, end) in seconds of now_seconds(); dropped while inactive. Thread-safe.
  void span(const std::string& name, const std::string& category, double begin, double end);

  // Writes this rank's spans to `path` (a JSON object with "traceEvents").
  void write(const std::string& path) const;

 private:
  struct Span {
    std::string name, category;
    double begin, end;
  };
  int rank_;
  std::atomic<bool> active_{false};
  mutable std::mutex mutex_;
  std::vector<Span> spans_;
};

// Merges rank files (as Tracer::write makes them) into one trace file.
void merge_traces(const std::vector<std::string>& rank_files, const std::string& path);

// Times a span from construction to destruction (or end()). The name is `name`, followed by
// `number` when it is >= 0 ("step 12"); it is made only when the tracer records, so a scope on
// the training step's path costs two clock reads while no timeline is taken.
class TraceScope {
 public:
  TraceScope(Tracer* tracer, const char* name, const char* category, int64_t number = -1);
  ~TraceScope() { end(); }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;
  void end();

 private:
  Tracer* tracer_;
  const char* name_;
  const char* category_;
  int64_t number_;
  double begin_;
  bool open_ = true;
};

}  // namespace loom
