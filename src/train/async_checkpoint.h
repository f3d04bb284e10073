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
#include <exception>
#include <functional>
#include <thread>

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

}  // namespace loom
