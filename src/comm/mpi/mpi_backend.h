// MpiCommunicator — the Communicator over an MPI communicator: ranks are processes started by
// mpirun or srun, possibly on several machines (issue 3).
//
// Each collective maps onto MPI's own BLOCKING one (MPI_Allreduce, MPI_Reduce_scatter_block,
// MPI_Allgather, MPI_Bcast, MPI_Reduce, MPI_Alltoall, MPI_Barrier), run on a progress thread of
// its own per communicator, in issue order (a FIFO queue, one worker thread): Open MPI's tuned
// blocking collectives are much faster than its libnbc non-blocking ones (64 MiB f32 all-reduce,
// 2 ranks: ~0.43 GB/s with MPI_Iallreduce, ~1.2 GB/s with MPI_Allreduce). The Work handle of a
// collective waits on a condition variable: test() says whether the worker finished it, wait()
// waits until then or until CommOptions::timeout expires, then throws CommError. After a timeout
// the worker stays blocked inside MPI (a blocking collective cannot be cancelled): a later wait()
// may still succeed if the late ranks arrive, but if they never do, the job must be aborted
// (destroying the communicator would wait for the worker forever).
// send/recv map onto MPI_Isend/MPI_Irecv with the tag, issued on the calling thread; their Work
// handle wraps the MPI_Request: test() is MPI_Test, wait() polls MPI_Test until done or timeout.
// With MPI_THREAD_SERIALIZED only (not MPI_THREAD_MULTIPLE), every MPI call, the worker's
// blocking collectives included, holds one process-wide lock; a send/recv or another group's
// collective then waits for the running collective to finish, so programs must not make a
// collective's completion depend on a later send/recv or another group's operation.
//
// - bf16/f16 reductions use user-defined MPI ops over 2-byte elements that widen to f32, combine
//   and round back, so every pairwise combine rounds to 16 bits.
// - avg is a sum followed, on each rank once the MPI op completed, by a division by size()
//   (integer division for i32/i64).
// - Determinism: Open MPI's tuned collectives choose an algorithm from (group size, element
//   count, element size) only, and each algorithm combines in a fixed order, so the same inputs
//   on the same group give the same bits on every run; every rank of an all-reduce receives
//   identical bits (tested with random floats). Changing the group size or Open MPI's
//   coll_tuned_* parameters may change the bits.
// - Every MPI call is checked (communicators use MPI_ERRORS_RETURN); a failure throws CommError
//   with MPI_Error_string's text.
// Leaves out: on timeout we cannot name the ranks that did not arrive (the message says so);
// split() is MPI_Comm_split and blocks without a timeout; tensors must be on the host (no
// CUDA-aware MPI); counts above INT_MAX elements are rejected (no MPI-4 large counts in 4.1).
#pragma once

#include <mpi.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"

namespace loom {

struct MpiTask;  // a queued collective (mpi_backend.cc)

class MpiCommunicator final : public Communicator {
 public:
  // Wraps `comm` (MPI must be initialised: use make_mpi_world). With `owned`, MPI_Comm_free on
  // destruction.
  MpiCommunicator(MPI_Comm comm, bool owned, std::string name, const CommOptions& options);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }
  std::string backend() const override { return "mpi"; }

  WorkHandle all_reduce_async(Tensor& tensor, ReduceOp op) override;
  WorkHandle reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) override;
  WorkHandle all_gather_async(const Tensor& input, Tensor& output) override;
  WorkHandle broadcast_async(Tensor& tensor, int root) override;
  WorkHandle reduce_async(Tensor& tensor, int root, ReduceOp op) override;
  WorkHandle all_to_all_async(const Tensor& input, Tensor& output) override;
  WorkHandle barrier_async() override;
  WorkHandle send_async(const Tensor& tensor, int dst, int tag) override;
  WorkHandle recv_async(Tensor& tensor, int src, int tag) override;
  std::unique_ptr<Communicator> split(int color, int key) override;

  // The underlying communicator, for code that calls MPI directly (the MPI_Allreduce baseline
  // of `loom bench comm`).
  MPI_Comm comm() const { return comm_; }
  const CommOptions& options() const { return options_; }

 private:
  // The next collective's description "all_reduce #7 (sum, 1001 × f32)"; with debug checks on,
  // first verifies that every rank issues the same collective (a blocking MPI_Allgather).
  std::string begin_collective(int op_code, const char* op_name, const Tensor* tensor,
                               int64_t count, int root, const std::string& args);
  // A point-to-point request issued on the calling thread.
  WorkHandle make_work(MPI_Request request, std::string what, std::vector<Tensor> keep);
  // Queues `run` (a blocking MPI call; the MPI lock is held around it) for the worker thread;
  // `on_done` runs on the worker after `run` succeeded; `keep` lives until completion.
  WorkHandle enqueue(std::function<void()> run, std::string what, std::vector<Tensor> keep,
                     std::function<void()> on_done = {});
  void worker_loop();

  MPI_Comm comm_;
  bool owned_;
  std::string name_;
  CommOptions options_;
  int rank_ = 0;
  int size_ = 1;
  int64_t next_seq_ = 0;      // collectives issued on this group
  int64_t next_p2p_seq_ = 0;  // sends and receives issued by this rank

  // The progress thread and its FIFO queue of collectives (issue order).
  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<MpiTask>> queue_;
  bool stopping_ = false;
  std::thread worker_;  // started last in the constructor
};

// Initialises MPI once per process (MPI_Init_thread asking for MPI_THREAD_MULTIPLE, accepting
// MPI_THREAD_SERIALIZED, in which case every MPI call is serialised by a lock; finalised at
// exit when Loom initialised it) and wraps MPI_COMM_WORLD as the group "world".
std::unique_ptr<Communicator> make_mpi_world(const CommOptions& options = {});

}  // namespace loom
