// The mpi backend's Work handles: MpiTask (a collective queued for a communicator's worker
// thread) and the handles of point-to-point requests. Internal to src/comm/mpi; see
// mpi_backend.h for the design.
#pragma once

#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi/mpi_flight.h"

namespace loom::mpi_internal {

constexpr uint64_t kNotRecorded = std::numeric_limits<uint64_t>::max();  // no flight record

// A collective queued for the communicator's worker thread. `mutex` guards done/error.
struct MpiTask {
  std::function<void()> run;      // the blocking MPI call
  std::function<void()> on_done;  // after a successful run (the avg division)
  std::vector<Tensor> keep;       // buffers MPI reads or writes until completion
  std::shared_ptr<const MpiGroupInfo> group;
  int64_t seq = 0;                      // the group's sequence number (for the timeout message)
  uint64_t flight_id = kNotRecorded;    // its flight record
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
};

// Runs a dequeued task on the worker thread (the MPI lock held around the MPI call), records it
// and signals its waiters.
void run_task(MpiTask& task);

// The handle of a queued collective: wait() waits for the worker, at most `timeout`; on expiry
// it names the ranks that did not arrive, dumps the flight recorder and throws.
WorkHandle make_task_work(std::shared_ptr<MpiTask> task, std::string what,
                          std::chrono::milliseconds timeout);

// The handle of a send/recv request issued on the calling thread.
WorkHandle make_request_work(MPI_Request request, std::string what,
                             std::chrono::milliseconds timeout, std::vector<Tensor> keep,
                             std::shared_ptr<const MpiGroupInfo> group, uint64_t flight_id);

// Completes the requests whose handles were dropped (their buffers are kept until then).
void reap_orphans();

}  // namespace loom::mpi_internal
