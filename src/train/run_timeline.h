// RunTimeline — the timeline of a run's steps metrics.trace_from_step ..
// trace_from_step + trace_steps - 1 (monitor/trace.h): each rank's phases and its waits on each
// axis' communication, and on a GPU the row of its compute stream (the phases as the stream ran
// them, its stalls on communication) on the host's clock; written by every rank after the last
// traced step and merged by world rank 0 into RUN_DIR/trace.json.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "comm/counting.h"
#include "config/config.h"
#include "device/device.h"
#include "monitor/trace.h"

namespace loom {

class RunTimeline {
 public:
  // `axes`: each axis' name ("dp") and its counting communicator (null: not in this run); their
  // waits, and on a GPU the stream's stalls, become "wait: <axis>" spans. The timeline is written
  // under `run_dir`, collectively over `world`; `message` says where (world rank 0).
  RunTimeline(Tracer& tracer, const MetricsConfig& metrics, Device device,
              std::vector<std::pair<std::string, CountingCommunicator*>> axes, Communicator& world,
              std::string run_dir, std::function<void(const std::string&)> message);

  // Turns the tracer on for a traced step (off for the others); on a GPU anchors the stream's
  // clock at the first one.
  void begin_step(int64_t step);
  // After step `step`: when it was the last traced one, writes the timeline (below).
  void end_step(int64_t step);
  // At the run's end, at `last_step`: a run that stopped inside the traced steps writes what
  // there is.
  void finish(int64_t last_step);

 private:
  // Each rank writes its spans, world rank 0 merges them. Collective: every rank calls it at the
  // same step.
  void write();

  Tracer& tracer_;
  const Device device_;
  const int64_t first_, last_;  // the traced steps; first_ = 0: none
  std::vector<std::pair<std::string, CountingCommunicator*>> axes_;
  Communicator& world_;
  const std::string run_dir_;
  std::function<void(const std::string&)> message_;
  bool written_ = false;
};

}  // namespace loom
