#include "train/async_checkpoint.h"

#include "base/check.h"

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

}  // namespace loom
