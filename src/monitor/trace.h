// Timelines of chosen steps (`metrics.trace_from_step`, `metrics.trace_steps`) in the Chrome trace
// event format, which Perfetto (ui.perfetto.dev) and chrome://tracing open: one row per rank
// (pid = world rank), spans for each step and its phases (data, forward + backward of each
// micro-batch, the optimizer) and for every wait on communication, named by mesh axis. Each rank
// writes RUN_DIR/trace/rank_R.json; world rank 0 merges them into RUN_DIR/trace.json.
//
// Times are microseconds of the monotonic clock, the same for every process of one machine;
// processes on other machines have clocks of their own (their rows are shifted by the clocks'
// difference).
//
// On a GPU the host's spans say when it queued the work; the GPU's row (tid 1, "GPU stream")
// says when the compute stream ran it: the same phases, between marks the stream passes (events,
// placed on the host's clock by an anchor: cuda::anchor_clock), and the stream's stalls on
// communication. The trainer gives the tracer its marks (set_device_marks) and resolves the
// spans once the stream has passed them (resolve_device_spans).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
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
  // The rows of a rank: what the host does, and what its GPU's compute stream runs.
  enum Lane { kHost = 0, kDevice = 1 };
  // A span [begin, end) in seconds of now_seconds(); dropped while inactive. Thread-safe.
  void span(const std::string& name, const std::string& category, double begin, double end,
            Lane lane = kHost);

  // A point of the GPU's stream, recorded when made: when the stream passed it, on the host's
  // clock, or nullopt while it has not.
  using DeviceMark = std::function<std::optional<double>()>;
  // Makes a mark now (a GPU rank's trainer sets it); TraceScopes then time the GPU's row too.
  void set_device_marks(std::function<DeviceMark()> make) { make_mark_ = std::move(make); }
  // A mark now, while active with device marks; else an empty function.
  DeviceMark device_mark() const { return active_ && make_mark_ ? make_mark_() : DeviceMark(); }
  // A span of the GPU's row between two marks, added by resolve_device_spans once both resolve.
  void device_span(const std::string& name, const std::string& category, DeviceMark begin,
                   DeviceMark end);
  // Adds the pending device spans whose marks the stream passed (after a synchronisation, all).
  void resolve_device_spans();

  // Writes this rank's spans to `path` (a JSON object with "traceEvents").
  void write(const std::string& path) const;

 private:
  struct Span {
    std::string name, category;
    double begin, end;
    Lane lane;
  };
  struct PendingSpan {
    std::string name, category;
    DeviceMark begin, end;
  };
  int rank_;
  std::atomic<bool> active_{false};
  std::function<DeviceMark()> make_mark_;
  mutable std::mutex mutex_;
  std::vector<Span> spans_;
  std::vector<PendingSpan> pending_;
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
  Tracer::DeviceMark device_begin_;  // the GPU's row, on GPU ranks while tracing
  bool open_ = true;
};

}  // namespace loom
