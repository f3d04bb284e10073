#include "train/async_checkpoint.h"

#include "base/check.h"
#include "base/error.h"
#include "base/timer.h"
#include "checkpoint/checkpoint.h"

namespace loom {

CheckpointWriter::~CheckpointWriter() {
  if (thread_.joinable()) thread_.join();
}

void CheckpointWriter::start(std::function<void()> write) {
  LOOM_CHECK_MSG(!busy(), "a checkpoint write is already in flight");
  done_.store(false, std::memory_order_relaxed);
  error_ = nullptr;
  thread_ = std::thread([this, write = std::move(write)] {
    try {
      write();
    } catch (...) {
      error_ = std::current_exception();  // read by wait(), after the join
    }
    done_.store(true, std::memory_order_release);
  });
}

void CheckpointWriter::wait() {
  if (!thread_.joinable()) return;
  thread_.join();
  if (error_) {
    std::exception_ptr error = error_;
    error_ = nullptr;
    std::rethrow_exception(error);
  }
}

RunCheckpoints::RunCheckpoints(Communicator& world, std::string checkpoints_dir,
                               int64_t keep_checkpoints, bool leader,
                               std::function<void(const std::string&)> message)
    : world_(world),
      dir_(std::move(checkpoints_dir)),
      keep_(keep_checkpoints),
      leader_(leader),
      message_(std::move(message)) {}

void RunCheckpoints::published(int64_t step, const std::string& path) {
  if (leader_) last_checkpoint_ = path;
  message_("saved " + last_checkpoint_);
  // Only now that the new one is complete on disk.
  if (leader_ && keep_ > 0)
    for (const std::string& old : prune_checkpoints(dir_, keep_, step))
      message_("removed " + old + " (train.keep_checkpoints = " + std::to_string(keep_) + ")");
}

void RunCheckpoints::commit_pending(bool wait) {
  if (!pending_commit_) return;
  if (!wait && all_reduce_value(world_, writer_.done() ? 1.0 : 0.0, ReduceOp::kMin) == 0) return;
  std::string error;
  try {
    writer_.wait();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const int64_t step = pending_step_;
  std::function<std::string()> commit = std::move(pending_commit_);
  pending_commit_ = nullptr;
  if (all_reduce_value(world_, error.empty() ? 1.0 : 0.0, ReduceOp::kMin) == 0)
    fail("the asynchronous checkpoint of step ", step, " failed",
         error.empty() ? std::string(" on another rank") : ": " + error,
         "; the checkpoints published before it are intact");
  published(step, commit());
}

void RunCheckpoints::save(int64_t step, const std::function<StagedCheckpoint()>& stage,
                          bool async) {
  const double t0 = now_seconds();
  commit_pending(true);  // one save in flight at a time
  StagedCheckpoint staged = stage();
  if (async) {
    writer_.start(std::move(staged.write));
    pending_commit_ = std::move(staged.commit);
    pending_step_ = step;
  } else {
    staged.write();
    published(step, staged.commit());
  }
  stall_seconds_ += now_seconds() - t0;
}

void RunCheckpoints::finish() {
  const double t0 = now_seconds();
  commit_pending(true);
  stall_seconds_ += now_seconds() - t0;
}

}  // namespace loom
