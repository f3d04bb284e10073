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
// - Ranks that did not arrive: when every rank runs on one node, issuing a collective stores its
//   sequence number into this rank's row of a shared-memory "arrival board" (one atomic store, no
//   message; mpi_flight.h); a rank whose wait times out reads its group's rows and names the
//   ranks that have not issued that sequence number ("rank(s) 2 did not arrive (last issued on
//   this group: rank 2 #6)"). Ranks on several nodes: the message says they cannot be named
//   (passive-target RMA would need target progress, not measured). split() is recorded as a
//   collective of the parent group and takes one of its sequence numbers, as in local.
// - Flight recorder: each world (make_mpi_world) owns one FlightRecorder
//   (CommOptions::flight_capacity records), shared with the communicators split from it; every
//   group is registered with its members' world ranks. Collectives and splits are recorded as
//   issued (calling thread), started and completed/failed (worker) with the group's sequence
//   number, op, dtype and count; send/recv under "<name>:p2p" as in local_backend.h.
//   Dumps (only with CommOptions::flight_dir; each rank once per world, to
//   flight_dir/rank_NNNNN.json):
//   - a rank whose wait times out dumps before wait() throws, and raises its world's timeout
//     counter on the arrival board;
//   - every other rank of that world dumps as soon as it sees the counter: a per-process
//     watchdog thread polls it every 100 ms (so a rank stuck in compute, or waiting in another
//     collective, dumps too), and the rank checks it before recording any new operation (so its
//     dump shows where it was, not the late operation it issues next); the world communicator's
//     destruction and process exit check it once more;
//   - SIGTERM (mpirun tearing the job down after a rank failed) and SIGABRT: the handler wakes the
//     watchdog, waits up to 2 s for it to dump every world, then re-raises the signal with its
//     previous disposition. Best effort: mpirun may SIGKILL sooner, and a rank killed without a
//     signal (SIGKILL, node loss) or one that never created a world writes nothing, which
//     `loom debug hang` reports as "no dump from rank(s) R". Several nodes: no board, so only
//     the timed-out ranks and the signal path dump.
// Leaves out: naming missing ranks across nodes; split() is MPI_Comm_split and blocks without a
// timeout; tensors must be on the host (no CUDA-aware MPI); counts above INT_MAX elements are
// rejected (no MPI-4 large counts in 4.1).
// Files: mpi_ops.{h,cc} (MPI state, dtypes, bf16/f16 ops), mpi_work.{h,cc} (Work handles),
// mpi_flight.{h,cc} (arrival board, flight dumps, watchdog), mpi_backend.cc (the communicator).
#pragma once

#include <mpi.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/flight_recorder.h"

namespace loom {

namespace mpi_internal {
struct MpiTask;       // a queued collective (mpi_work.h)
struct MpiGroupInfo;  // the group as its operations see it (mpi_flight.h)
class MpiFlight;      // the world's flight recorder and dumps (mpi_flight.h)
}  // namespace mpi_internal

class MpiCommunicator final : public Communicator {
 public:
  // Wraps `comm` (MPI must be initialised: use make_mpi_world). With `owned`, MPI_Comm_free on
  // destruction.
  // `flight`: the world's flight state, shared with the communicators split from it (null: a new
  // world of its own); `board_id`: the group's id on the arrival board (-1: none).
  MpiCommunicator(MPI_Comm comm, bool owned, std::string name, const CommOptions& options,
                  std::shared_ptr<mpi_internal::MpiFlight> flight = nullptr, int board_id = -1);
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
  // This rank's flight recorder (shared by all its communicators of one world).
  const FlightRecorder& flight_recorder() const;

 private:
  // A collective as issued: its sequence number, description and flight record.
  struct Issued {
    int64_t seq = 0;
    std::string what;  // "all_reduce #7 (sum, 1001 × f32) on group ..."
    uint64_t flight_id = 0;
  };
  // Takes the next sequence number, marks it on the arrival board and records it; with debug
  // checks on, first verifies that every rank issues the same collective (a blocking
  // MPI_Allgather).
  Issued begin_collective(int op_code, const char* op_name, const Tensor* tensor, int64_t count,
                          int root, const std::string& args);
  void debug_check(const Issued& issued, int op_code, const Tensor* tensor, int64_t count,
                   int root);
  // Records a send/recv (flight group "<name>:p2p", as the local backend does); returns its id.
  uint64_t record_p2p(bool send, int peer, int tag, const Tensor& tensor);
  WorkHandle start_p2p(uint64_t flight_id, std::string what, const Tensor& tensor,
                       const std::function<void(MPI_Request*)>& issue);
  // Queues `run` (a blocking MPI call; the MPI lock is held around it) for the worker thread;
  // `on_done` runs on the worker after `run` succeeded; `keep` lives until completion.
  WorkHandle enqueue(std::function<void()> run, Issued issued, std::vector<Tensor> keep,
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
  // (peer, tag) → messages so far: the seq of a send/recv's flight record, as in local.
  std::map<std::pair<int, int>, int64_t> send_count_, recv_count_;
  std::shared_ptr<const mpi_internal::MpiGroupInfo> group_;  // name, members, board, flight

  // The progress thread and its FIFO queue of collectives (issue order).
  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::shared_ptr<mpi_internal::MpiTask>> queue_;
  bool stopping_ = false;
  std::thread worker_;  // started last in the constructor
};

// Initialises MPI once per process (MPI_Init_thread asking for MPI_THREAD_MULTIPLE, accepting
// MPI_THREAD_SERIALIZED, in which case every MPI call is serialised by a lock; finalised at
// exit when Loom initialised it) and wraps MPI_COMM_WORLD as the group "world", a new world
// with its own flight recorder. The first call is collective over MPI_COMM_WORLD (it creates
// the arrival board); every rank must create its worlds in the same order (their board ids are
// their creation order).
std::unique_ptr<Communicator> make_mpi_world(const CommOptions& options = {});

}  // namespace loom
