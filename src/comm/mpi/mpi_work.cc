// The mpi backend's Work handles (see mpi_work.h).
#include "comm/mpi/mpi_work.h"

#include <thread>
#include <utility>

#include "comm/mpi/mpi_ops.h"

namespace loom::mpi_internal {
namespace {

// A pending request whose Work handle was dropped: its buffers must outlive it, so it is kept
// here and reaped when complete (sends and receives; a dropped collective stays queued or
// running on the worker, which holds its buffers until it completes).
struct Orphan {
  MPI_Request request;
  std::vector<Tensor> keep;
  std::shared_ptr<const MpiGroupInfo> group;
  uint64_t flight_id;
};

struct Orphans {
  std::mutex mutex;
  std::vector<Orphan> requests;
};

// Leaked on purpose, like the MPI runtime state: may be used late in the process's exit.
Orphans& orphans() {
  static Orphans* instance = new Orphans;
  return *instance;
}

std::string timeout_text(std::chrono::milliseconds timeout, const std::string& what) {
  return detail::concat("mpi: timed out after ", timeout.count(), " ms waiting for ", what);
}

// The Work handle of a queued collective: completion is signalled by the worker thread.
class MpiTaskWork final : public Work {
 public:
  MpiTaskWork(std::shared_ptr<MpiTask> task, std::string what, std::chrono::milliseconds timeout)
      : task_(std::move(task)), what_(std::move(what)), timeout_(timeout) {}

  bool test() override {
    std::lock_guard<std::mutex> guard(task_->mutex);
    if (!task_->done) return false;
    if (task_->error) std::rethrow_exception(task_->error);
    return true;
  }

  // On timeout the worker stays blocked in MPI; a later wait() may still see it complete.
  void wait() override {
    {
      std::unique_lock<std::mutex> lock(task_->mutex);
      if (task_->cv.wait_for(lock, timeout_, [&] { return task_->done; })) {
        if (task_->error) std::rethrow_exception(task_->error);
        return;
      }
    }
    // Unlocked: the dump may take milliseconds, and the worker must still be able to finish.
    const MpiGroupInfo& group = *task_->group;
    std::string message = timeout_text(timeout_, what_) + group.not_arrived(task_->seq);
    message += group.flight->on_timeout(message);
    throw CommError(message);
  }

 private:
  std::shared_ptr<MpiTask> task_;
  std::string what_;
  std::chrono::milliseconds timeout_;
};

class MpiRequestWork final : public Work {
 public:
  MpiRequestWork(MPI_Request request, std::string what, std::chrono::milliseconds timeout,
                 std::vector<Tensor> keep, std::shared_ptr<const MpiGroupInfo> group,
                 uint64_t flight_id)
      : request_(request),
        what_(std::move(what)),
        timeout_(timeout),
        keep_(std::move(keep)),
        group_(std::move(group)),
        flight_id_(flight_id) {}

  ~MpiRequestWork() override {
    if (done_ || mpi_finalized()) return;
    Orphans& o = orphans();
    std::lock_guard<std::mutex> guard(o.mutex);
    o.requests.push_back(Orphan{request_, std::move(keep_), std::move(group_), flight_id_});
  }

  bool test() override {
    if (done_) return true;
    int flag = 0;
    try {
      auto lock = mpi_lock();
      LOOM_MPI_CALL(MPI_Test, &request_, &flag, MPI_STATUS_IGNORE);
    } catch (...) {
      group_->flight->recorder().failed(flight_id_);
      throw;
    }
    if (flag == 0) return false;
    done_ = true;
    keep_.clear();
    group_->flight->recorder().completed(flight_id_);
    return true;
  }

  // Polls MPI_Test (which also drives MPI's progress): yields for the first polls, so a short
  // operation completes with little latency, then sleeps briefly so waiting ranks do not take
  // the cores of oversubscribed ranks.
  void wait() override {
    const auto start = std::chrono::steady_clock::now();
    for (int polls = 0; !test(); ++polls) {
      if (std::chrono::steady_clock::now() - start > timeout_) {
        std::string message = timeout_text(timeout_, what_) +
                              "; whether the peer posted the matching operation is unknown";
        message += group_->flight->on_timeout(message);
        throw CommError(message);
      }
      if (polls < 2000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

 private:
  MPI_Request request_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::vector<Tensor> keep_;  // buffers MPI reads or writes until completion
  std::shared_ptr<const MpiGroupInfo> group_;
  uint64_t flight_id_;
  bool done_ = false;
};

}  // namespace

void run_task(MpiTask& task) {
  FlightRecorder& recorder = task.group->flight->recorder();
  if (task.flight_id != kNotRecorded) recorder.started(task.flight_id);
  std::exception_ptr error;
  try {
    if (mpi_finalized()) throw CommError("mpi: MPI was finalised before the collective ran");
    {
      auto lock = mpi_lock();
      task.run();
    }
    if (task.on_done) task.on_done();
  } catch (...) {
    error = std::current_exception();
  }
  if (task.flight_id != kNotRecorded) {
    if (error) {
      recorder.failed(task.flight_id);
    } else {
      recorder.completed(task.flight_id);
    }
  }
  std::lock_guard<std::mutex> guard(task.mutex);
  task.done = true;
  task.error = error;
  task.keep.clear();
  task.run = nullptr;
  task.on_done = nullptr;
  task.cv.notify_all();
}

WorkHandle make_task_work(std::shared_ptr<MpiTask> task, std::string what,
                          std::chrono::milliseconds timeout) {
  return std::make_shared<MpiTaskWork>(std::move(task), std::move(what), timeout);
}

WorkHandle make_request_work(MPI_Request request, std::string what,
                             std::chrono::milliseconds timeout, std::vector<Tensor> keep,
                             std::shared_ptr<const MpiGroupInfo> group, uint64_t flight_id) {
  return std::make_shared<MpiRequestWork>(request, std::move(what), timeout, std::move(keep),
                                          std::move(group), flight_id);
}

void reap_orphans() {
  Orphans& o = orphans();
  std::lock_guard<std::mutex> guard(o.mutex);
  if (o.requests.empty() || mpi_finalized()) return;
  auto lock = mpi_lock();
  std::erase_if(o.requests, [](Orphan& orphan) {
    int flag = 0;
    if (MPI_Test(&orphan.request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
      orphan.group->flight->recorder().failed(orphan.flight_id);
      return true;
    }
    if (flag != 0) orphan.group->flight->recorder().completed(orphan.flight_id);
    return flag != 0;
  });
}

}  // namespace loom::mpi_internal
