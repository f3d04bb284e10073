// ThreadPool — a rank's compute threads.
//
// Every rank owns one pool of `threads_per_rank` threads (the caller counts as one of them), and
// every kernel parallelises through it. With many ranks on few cores this keeps the total number
// of busy threads at ranks × threads_per_rank instead of oversubscribing the machine, which a
// process-wide OpenMP or OpenBLAS pool would do. OpenBLAS itself runs single-threaded under us.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace loom {

class ThreadPool {
 public:
  // threads >= 1; threads - 1 workers are started, the caller of parallel_for is the last one.
  explicit ThreadPool(int threads = 1);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return threads_; }

  // Splits [0, n) into at most size() contiguous ranges of at least `grain` items and runs
  // fn(begin, end) on each, in parallel; returns when all are done. Ranges are a pure function
  // of (n, grain, size()), so results are deterministic whenever fn writes disjoint outputs.
  // Not reentrant: fn must not call parallel_for on the same pool (it runs inline if it does).
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  // Runs fn(task) for task in [0, tasks), tasks handed out one at a time (dynamic balancing).
  // Use for uneven work, e.g. causal-attention rows. fn must write disjoint outputs per task.
  void parallel_tasks(int64_t tasks, const std::function<void(int64_t)>& fn);

 private:
  void worker_loop(int index);

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  // The current job, guarded by mutex_ (workers copy what they need under the lock).
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  bool busy_ = false;
};

}  // namespace loom
