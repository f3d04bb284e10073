// MpiCommunicator — the Communicator over an MPI communicator: ranks are processes started by
// mpirun or srun, possibly on several machines (issue 3).
//
// Each collective maps onto MPI's own non-blocking one (MPI_Iallreduce, MPI_Ireduce_scatter_block,
// MPI_Iallgather, MPI_Ibcast, MPI_Ireduce, MPI_Ialltoall, MPI_Ibarrier; send/recv onto
// MPI_Isend/MPI_Irecv with the tag). The Work handle wraps the MPI_Request: test() is MPI_Test,
// wait() polls MPI_Test until done or CommOptions::timeout expires, then throws CommError.
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

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace loom {

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
  WorkHandle make_work(MPI_Request request, std::string what, std::vector<Tensor> keep,
                       std::function<void()> on_done = {});

  MPI_Comm comm_;
  bool owned_;
  std::string name_;
  CommOptions options_;
  int rank_ = 0;
  int size_ = 1;
  int64_t next_seq_ = 0;      // collectives issued on this group
  int64_t next_p2p_seq_ = 0;  // sends and receives issued by this rank
};

// Initialises MPI once per process (MPI_Init_thread asking for MPI_THREAD_MULTIPLE, accepting
// MPI_THREAD_SERIALIZED, in which case every MPI call is serialised by a lock; finalised at
// exit when Loom initialised it) and wraps MPI_COMM_WORLD as the group "world".
std::unique_ptr<Communicator> make_mpi_world(const CommOptions& options = {});

}  // namespace loom
