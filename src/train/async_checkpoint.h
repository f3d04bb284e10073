// Asynchronous checkpoints (train.async_checkpoint): a checkpoint's files written by a thread of
// their own while training goes on. The trainer stages the state into host buffers of the save's
// own (train/sharded_io.h: StagedCheckpoint), starts its write here, and at every later step
// boundary asks every rank whether its write is done (one all-reduce of a flag while a save is
// in flight); at the first step at which all are, it commits the save (published, older ones
// pruned). A new save, the run's end and a stop wait for the one in flight first. A write that
// failed fails the run at its commit, naming the error; the checkpoints published before it
// are untouched (a save is published only whole: step_N.tmp renamed).
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <thread>

#include "comm/communicator.h"
#include "train/sharded_io.h"

namespace loom {

class CheckpointWriter {
 public:
  CheckpointWriter() = default;
  // Waits for a write still running (its error, if any, is dropped: the run is failing already).
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Runs `write` on a new thread. One write at a time: the previous one must have been waited.
  void start(std::function<void()> write);
  // Whether a write was started and not yet waited for.
  bool busy() const { return thread_.joinable(); }
  // Whether the write in flight has returned (or thrown); false when none is.
  bool done() const { return busy() && done_.load(std::memory_order_acquire); }
  // Joins the write and rethrows what it threw. Nothing when none is in flight.
  void wait();

 private:
  std::thread thread_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
};

// A run's saves as the trainer makes them: each staged save written now or, asynchronously, by a
// CheckpointWriter; published once every rank's files are on disk (staged.commit), then said and
// the older checkpoints pruned (train.keep_checkpoints). Collective: every rank calls save() and
// commit_pending() at the same points.
class RunCheckpoints {
 public:
  // `message` says what was saved and pruned (the trainer's progress line); `leader` (world rank
  // 0) prunes and keeps the published path.
  RunCheckpoints(Communicator& world, std::string checkpoints_dir, int64_t keep_checkpoints,
                 bool leader, std::function<void(const std::string&)> message);

  // The save of `step`: after the save in flight, if any, is published (one at a time), stages
  // it (`stage`: collective) and writes and publishes it now, or with `async` starts its write and
  // leaves it in flight.
  void save(int64_t step, const std::function<StagedCheckpoint()>& stage, bool async);
  // Publishes the save in flight once every rank's write is done: without `wait` only if they all
  // are already (one all-reduce of a flag), else after waiting for them. A write that failed on
  // any rank fails the run on every rank, naming the error.
  void commit_pending(bool wait);
  // commit_pending(true), timed as a stall: the run's end.
  void finish();

  const std::string& last_checkpoint() const { return last_checkpoint_; }  // the leader's
  double stall_seconds() const { return stall_seconds_; }  // training held up by saves

 private:
  void published(int64_t step, const std::string& path);

  Communicator& world_;
  const std::string dir_;
  const int64_t keep_;
  const bool leader_;
  std::function<void(const std::string&)> message_;
  CheckpointWriter writer_;
  std::function<std::string()> pending_commit_;
  int64_t pending_step_ = 0;
  std::string last_checkpoint_;
  double stall_seconds_ = 0;
};

}  // namespace loom
