#include "base/thread_pool.h"

#include <algorithm>
#include <atomic>

#include "base/check.h"

namespace loom {

ThreadPool::ThreadPool(int threads) : threads_(std::max(1, threads)) {
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    (*job)(index);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t parts = std::min<int64_t>(threads_, (n + grain - 1) / grain);
  bool nested;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    nested = busy_;
  }
  if (parts <= 1 || nested) {
    fn(0, n);
    return;
  }
  const std::function<void(int)> job = [&](int participant) {
    if (participant >= parts) return;
    const int64_t begin = n * participant / parts;
    const int64_t end = n * (participant + 1) / parts;
    if (begin < end) fn(begin, end);
  };
  {
    std::lock_guard<std::mutex> lock(mutex_);
    busy_ = true;
    job_ = &job;
    pending_ = threads_ - 1;
    ++generation_;
  }
  wake_.notify_all();
  job(0);
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
  busy_ = false;
}

void ThreadPool::parallel_tasks(int64_t tasks, const std::function<void(int64_t)>& fn) {
  if (tasks <= 0) return;
  std::atomic<int64_t> next{0};
  parallel_for(threads_, 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) fn(t);
  });
}

}  // namespace loom
