// Communicator — a process group and its collectives (issue 3).
//
// Every parallel strategy talks through this interface; backends implement it: local/ (ranks are
// threads of one process, shared memory), mpi/ (processes under mpirun/srun), nccl/ (CUDA).
// A group of size 1 is a real, trivial group, never a stub.
//
// Semantics shared by all backends:
// - Collectives are issued by every rank of the group in the same order; each gets the group's
//   next sequence number (used in error messages and the flight recorder).
// - The *_async forms return a handle; the blocking forms are async + wait(). Tensors are shared
//   handles, so a pending operation keeps its buffers alive; the caller must not touch a buffer
//   until wait() (or test() == true) on its handle.
// - Reductions are deterministic: a fixed reduction order, so the same inputs give the same bits
//   on every run, and every rank of an all-reduce receives identical bits.
// - Every blocking wait has a timeout (CommOptions::timeout). On expiry the waiting rank throws a
//   CommError naming the operation, its sequence number, the group and the ranks that did not
//   arrive.
// - wait_on_device() is wait() for what runs on the tensors' device: on a GPU backend (nccl) the
//   compute stream waits for the operation and the host goes on queueing work, so it never drains
//   the GPU; the timeout and the backend's checks then run beside the host (a watchdog) and a
//   failure is thrown by the communicator's next call or by check(). Host backends block there.
//   For operations whose results only device work reads (a layer's all-reduce, a gradient
//   bucket, a ring step); a value the host reads goes through a copy, which waits anyway.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "base/error.h"
#include "tensor/tensor.h"

namespace loom {

enum class ReduceOp { kSum, kAvg, kMax, kMin };
std::string_view reduce_op_name(ReduceOp op);

// A communication failure: a timeout, a peer that failed, a mismatched call. Derives from
// loom::Error so the CLI reports it as one clear line.
class CommError : public Error {
 public:
  using Error::Error;
};

struct CommOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Check that all ranks of a group call the same collective with the same element count and
  // dtype; report the first mismatch by rank and sequence number. Also on with LOOM_COMM_DEBUG=1.
  bool debug_checks = false;
  // Flight recorder (flight_recorder.h): every rank records its last `flight_capacity`
  // operations. When a wait times out (or the world is aborted), each rank dumps them to
  // flight_dir/rank_NNNNN.json for `loom debug hang`; empty = record, but never dump.
  std::string flight_dir;
  size_t flight_capacity = 4096;
};

// The handle of an asynchronous operation.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation completed; throws CommError on failure or timeout.
  virtual void wait() = 0;
  // True when the operation completed (successfully or not: wait() then reports).
  virtual bool test() = 0;
  // Orders the device work queued after this call behind the operation, without blocking the
  // host where the backend can (nccl); a failure or timeout is then thrown by a later call on the
  // communicator or by Communicator::check(), and this handle's wait() and test() return at once
  // (copies to the host are queued behind the operation, so they see its result). Host
  // backends: wait().
  virtual void wait_on_device() { wait(); }
};
using WorkHandle = std::shared_ptr<Work>;

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // A readable name for messages: "world", "world/split(color=1)", "dp[tp=0,pp=1]"...
  virtual std::string name() const = 0;
  virtual std::string backend() const = 0;  // "local", "mpi", "nccl"
  // Where this communicator's tensors must live: host memory for local and mpi (any cpu index),
  // the rank's GPU for nccl.
  virtual Device tensor_device() const { return Device::cpu(); }

  // In place: every rank ends with op over all ranks' `tensor`.
  virtual WorkHandle all_reduce_async(Tensor& tensor, ReduceOp op) = 0;
  // input: size() × n elements (rank r's chunk is [r·n, (r+1)·n)); output: n elements, the
  // reduction of chunk rank() over all ranks.
  virtual WorkHandle reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) = 0;
  // input: n elements; output: size() × n, rank r's input at [r·n, (r+1)·n).
  virtual WorkHandle all_gather_async(const Tensor& input, Tensor& output) = 0;
  // In place: every rank ends with root's tensor.
  virtual WorkHandle broadcast_async(Tensor& tensor, int root) = 0;
  // In place at root (other ranks' tensors are left unchanged).
  virtual WorkHandle reduce_async(Tensor& tensor, int root, ReduceOp op) = 0;
  // input and output: size() × n; chunk j of rank i's input lands in chunk i of rank j's output.
  virtual WorkHandle all_to_all_async(const Tensor& input, Tensor& output) = 0;
  // Blocks of any size (MPI_Alltoallv; Megatron-LM's all_to_all_single with split sizes):
  // `input` holds send_counts[j] elements for rank j, block after block in rank order; `output`
  // receives recv_counts[i] elements from rank i likewise. recv_counts[i] must be what rank i
  // sends this one (the caller exchanges the counts first). The default is a ring of pairwise
  // exchanges — at step k a block to rank + k and one from rank − k (send_recv_async: one NCCL
  // group under nccl) — skipping empty blocks, this rank's own block copied.
  virtual WorkHandle all_to_all_v_async(const Tensor& input,
                                        const std::vector<int64_t>& send_counts, Tensor& output,
                                        const std::vector<int64_t>& recv_counts);
  // all_to_all_v's checks (counts per rank, none negative, summing to the tensors, the same
  // dtype, this rank's own block as long both ways; CommError naming the group otherwise) and
  // the blocks' offsets: send's, then receive's, each size() + 1 long.
  std::pair<std::vector<int64_t>, std::vector<int64_t>> all_to_all_v_offsets(
      const Tensor& input, const std::vector<int64_t>& send_counts, const Tensor& output,
      const std::vector<int64_t>& recv_counts) const;
  // Rank r's block of a flat tensor laid out by the offsets `at` (all_to_all_v_offsets').
  static Tensor all_to_all_v_block(const Tensor& t, const std::vector<int64_t>& at, int r);
  // The tag of all_to_all_v's messages (a pair's are matched in order).
  static constexpr int kAllToAllVTag = 0x2a2a;
  virtual WorkHandle barrier_async() = 0;
  // Point to point; a send matches the recv of the same (source, destination, tag), in order.
  virtual WorkHandle send_async(const Tensor& tensor, int dst, int tag) = 0;
  virtual WorkHandle recv_async(Tensor& tensor, int src, int tag) = 0;
  // Both at once, one handle: `to_send` to dst and `into` from src — a ring's step, where every
  // rank sends to its next and receives from its previous. A backend whose sends block until
  // received and whose operations run in issue order (nccl) posts the two together, so that a
  // ring of sends cannot wait on itself; the default posts send_async, then recv_async.
  virtual WorkHandle send_recv_async(const Tensor& to_send, int dst, Tensor& into, int src,
                                     int tag);

  // Collective over this group: ranks with the same color form a new group, ordered by (key,
  // old rank). color < 0 → nullptr for that rank (it joins no group).
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  // Throws the CommError of an operation waited for with wait_on_device() that failed or timed
  // out since (the backend's watchdog aborted the communicator then). The trainer calls it once
  // a step, after reading the step's losses and before judging them. Host backends: nothing.
  virtual void check() {}
  // Seconds the device's compute stream spent waiting for this communicator's operations at
  // wait_on_device since the last call (what the host no longer sees: on a GPU it does not
  // block). Host backends: 0 (their waits block the host, which times them).
  virtual double take_device_wait_seconds() { return 0.0; }
  // Called with each of those stalls as (begin, end) on the host's clock (now_seconds()) once
  // the stream passed it, where the device's clock is anchored (cuda::anchor_clock): the GPU's
  // row of a timeline. Set before the operations it should see. Host backends: never called.
  virtual void on_device_wait(std::function<void(double, double)> observer) { (void)observer; }

  // Blocking forms.
  void all_reduce(Tensor& tensor, ReduceOp op = ReduceOp::kSum) { all_reduce_async(tensor, op)->wait(); }
  void reduce_scatter(const Tensor& input, Tensor& output, ReduceOp op = ReduceOp::kSum) {
    reduce_scatter_async(input, output, op)->wait();
  }
  void all_gather(const Tensor& input, Tensor& output) { all_gather_async(input, output)->wait(); }
  void broadcast(Tensor& tensor, int root) { broadcast_async(tensor, root)->wait(); }
  void reduce(Tensor& tensor, int root, ReduceOp op = ReduceOp::kSum) {
    reduce_async(tensor, root, op)->wait();
  }
  void all_to_all(const Tensor& input, Tensor& output) { all_to_all_async(input, output)->wait(); }
  void all_to_all_v(const Tensor& input, const std::vector<int64_t>& send_counts, Tensor& output,
                    const std::vector<int64_t>& recv_counts) {
    all_to_all_v_async(input, send_counts, output, recv_counts)->wait();
  }
  void barrier() { barrier_async()->wait(); }
  void send(const Tensor& tensor, int dst, int tag = 0) { send_async(tensor, dst, tag)->wait(); }
  void recv(Tensor& tensor, int src, int tag = 0) { recv_async(tensor, src, tag)->wait(); }
  void send_recv(const Tensor& to_send, int dst, Tensor& into, int src, int tag = 0) {
    send_recv_async(to_send, dst, into, src, tag)->wait();
  }
};

// Host values through any communicator, staged through its tensor_device() (a GPU under nccl):
// the few scalars a training loop exchanges (losses, norms, memory figures). Blocking.
double all_reduce_value(Communicator& comm, double value, ReduceOp op = ReduceOp::kSum);
// The same for several values at once (one operation, one wait).
std::vector<double> all_reduce_values(Communicator& comm, const std::vector<double>& values,
                                      ReduceOp op = ReduceOp::kSum);
// Every rank's `mine` (the same length on each), rank r's at [r·n, (r+1)·n).
std::vector<double> all_gather_values(Communicator& comm, const std::vector<double>& mine);
// What every rank sends this one, from `to_each` (size() values, to_each[r] for rank r): element
// r of the result is rank r's value for this rank (an all_to_all of counts, say).
std::vector<int64_t> all_to_all_values(Communicator& comm, const std::vector<int64_t>& to_each);

}  // namespace loom
