// NcclCommunicator — the Communicator over NCCL: every rank drives one CUDA GPU, tensors live on
// that GPU (issue 3). Built only with LOOM_CUDA=ON (then loom_comm defines LOOM_WITH_NCCL=1).
//
// Construction: make_nccl_world(bootstrap, cuda_device, options). NCCL needs one ncclUniqueId
// shared by all ranks before ncclCommInitRank; Loom has no side channel of its own, so an
// existing host communicator carries it: rank 0 of `bootstrap` calls ncclGetUniqueId and
// broadcasts its 128 bytes as an i32 host tensor of 32 elements. Two ways to run:
// - processes (mpirun/srun): bootstrap = make_mpi_world(); each process passes its GPU
//   (typically its local rank);
// - one process driving several GPUs from threads: bootstrap = make_local_world(n)[r], handed
//   to thread r, which calls make_nccl_world(*local[r], r, options) itself. The calls of all
//   threads must overlap (NCCL's init is collective), as they do in run_on_thread_ranks.
// NCCL refuses two ranks of one communicator on the same GPU: give each rank its own device.
//
// Execution: each communicator owns a non-blocking CUDA stream. An *_async call first makes that
// stream wait for the work already queued on the legacy default stream (where the device layer
// copies and computes), so the inputs are ready, then enqueues the NCCL call and records a
// cudaEvent. Work::test() is cudaEventQuery; wait() polls it until CommOptions::timeout and
// checks ncclCommGetAsyncError on every poll. Nothing after the call is ordered behind the
// communication: wait() (or test() == true) before touching the buffers, as with every backend.
// The handle keeps the tensors alive; a handle dropped before completion parks them until the
// event completes, so the caching allocator never reuses a buffer NCCL still writes.
// Work::wait_on_device() instead makes the legacy default stream wait for the event
// (cudaStreamWaitEvent) and returns at once: the GPU runs what the host queues next after the
// communication, and the host never drains it (the parallel strategies wait so for everything
// only kernels read). The communicator's watchdog thread (started by the first such wait) then
// owns the event and the buffers: it polls them every millisecond, runs a recv's header check
// when it completes, and on NCCL's asynchronous error, a failed check or the timeout (counted
// from the wait_on_device call) aborts the communicator — NCCL's kernels return, so a stream or
// a host copy stuck behind the operation is released — and remembers why. The next call on the
// communicator, or check() (the trainer calls it each step before judging the loss), throws
// that reason ("nccl: timed out after 5.0 s waiting (on the GPU) for all_reduce #7 ...").
// Timing events recorded around each such cudaStreamWaitEvent say how long the compute stream
// stalled there (take_device_wait_seconds: the step metrics' communication time on GPUs, where
// the host no longer blocks). nccl_host_waits() counts the host's waits, for the tests that
// count a step's drains.
//
// Failure: communicators are created non-blocking (ncclConfig_t::blocking = 0), so init, split
// and every enqueue return at once and are polled with the same timeout: a rank whose peers
// never arrive fails instead of hanging inside NCCL. On a timeout or an asynchronous NCCL error
// the waiting rank calls ncclCommAbort and throws CommError naming the operation, its sequence
// number, the group and, for a collective, the ranks of this process that never issued it
// ("nccl: timed out after 5.0 s waiting for all_reduce #7 (sum, 1001 × f32) on group 'world'
// (size 2, rank 0); rank(s) 1 did not arrive; communicator aborted" — ranks in other processes
// cannot be asked: the message says so, and `loom debug hang` names them from the dumps). An
// aborted communicator refuses every later call with that reason (its peers then fail by their
// own timeouts, or by NCCL's error when the connection drops).
//
// Flight recorder (comm/flight_recorder.h): each rank has one per world, shared by the world's
// communicator and its splits, recording every operation (groups "nccl:<name>", messages under
// "nccl:<name>:p2p" numbered per peer) as issued, started (enqueued on the stream), completed
// (its event seen done) or failed. A split's members' world ranks are gathered over the new
// communicator (one all-gather of a word each). The first failure of any of a rank's
// communicators dumps, with CommOptions::flight_dir set, CommOptions::flight_dir/
// rank_NNNNN.nccl.json before the abort — its own records and, through a registry of the ranks
// sharing the world's ncclUniqueId in this process, those of its thread-rank peers as they are.
//
// Semantics per collective:
// - all_reduce / reduce_scatter / reduce: ncclSum/ncclMax/ncclMin; avg is ncclAvg (floats are
//   pre-multiplied by 1/n then summed — within 2 ulp of sum/n —, integers summed then divided,
//   truncating like the other backends). f32/f64/bf16/f16/i32/i64.
// - all_gather, broadcast (in place), reduce (in place at root, others' tensors unchanged).
// - all_to_all: one NCCL group of a ncclSend and a ncclRecv per peer (self included).
// - barrier: an all-reduce of one f32 on a scratch buffer of the communicator; it completes when
//   every rank reached it on the GPU stream (what matters for ordering communication).
// - Determinism: NCCL picks algorithm and protocol from (size, bytes, topology); each combines
//   in a fixed order, so the same inputs on the same machine and group give the same bits;
//   NCCL_ALGO / NCCL_PROTO pin the choice across machines.
// - Counts of 0 elements enqueue nothing NCCL-side (the handle still completes in order).
//
// Send/recv and tags: NCCL matches point-to-point messages between a pair of ranks only by issue
// order; it has no tags. Loom therefore requires that, per (source, destination) pair, the
// receiver posts its recvs in the order the sender posted its sends, whatever the tags — the
// usual pipeline-parallel pattern. Each message is preceded by a 32-byte header (tag, count,
// dtype, per-pair message number; copied to the GPU synchronously, a few µs) sent in the same
// NCCL group; when the recv completes, wait() / test() compare it with the recv's own and throw
// CommError on a mismatch ("nccl: recv(src=1, tag=3) #4 on group 'pp' (size 2, rank 0): got a
// message with tag 5 ..."), so a reordering is loud, not silent corruption. (A count mismatch
// can also make NCCL hang: then the timeout reports it.)
// A send only completes when its matching recv is posted (NCCL's send kernel waits for the
// peer), and the communicator's stream runs operations in issue order: two ranks that both send
// first and then receive from each other deadlock (until the timeout). Order exchanges (e.g.
// even ranks send first) or use all_to_all. A send to oneself is copied into a per-tag FIFO and
// a recv from oneself takes it, as in the local backend.
//
// Debug checks (CommOptions::debug_checks, or LOOM_COMM_DEBUG=1 in the environment): before each
// collective the ranks all-gather its sequence number and description and compare them; a
// mismatch throws CommError on every rank of the group, naming both calls ("nccl debug check: at
// sequence number 3 on group 'world' rank 0 calls all_reduce(sum, 5 × f32) but rank 1 calls
// all_reduce(sum, 6 × f32) ..."), before NCCL sees it; the group stays usable. One all-gather
// and one host wait per collective: for finding a bug, not for training.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace loom {

struct NcclShared;  // the NCCL communicator, its stream and its state (nccl_shared.h)

class NcclCommunicator final : public Communicator {
 public:
  // Wraps an initialised NCCL communicator (see make_nccl_world).
  NcclCommunicator(std::shared_ptr<NcclShared> shared, std::string name);
  // Flushes outstanding operations (ncclCommFinalize, bounded by the timeout; aborts after it)
  // and frees the NCCL communicator; its stream and events go with the last Work handle.
  // Never throws.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }
  std::string backend() const override { return "nccl"; }
  int cuda_device() const;  // the GPU every tensor of this communicator must live on
  Device tensor_device() const override { return Device::cuda(cuda_device()); }

  WorkHandle all_reduce_async(Tensor& tensor, ReduceOp op) override;
  WorkHandle reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) override;
  WorkHandle all_gather_async(const Tensor& input, Tensor& output) override;
  WorkHandle broadcast_async(Tensor& tensor, int root) override;
  WorkHandle reduce_async(Tensor& tensor, int root, ReduceOp op) override;
  WorkHandle all_to_all_async(const Tensor& input, Tensor& output) override;
  // One NCCL group of every block's send and recv (each with its header), this rank's own block
  // copied on the stream first: the peers' transfers run at once, not a ring step after another.
  WorkHandle all_to_all_v_async(const Tensor& input, const std::vector<int64_t>& send_counts,
                                Tensor& output, const std::vector<int64_t>& recv_counts) override;
  WorkHandle barrier_async() override;
  WorkHandle send_async(const Tensor& tensor, int dst, int tag) override;
  WorkHandle recv_async(Tensor& tensor, int src, int tag) override;
  // The send and the recv in one NCCL group (ncclSend and ncclRecv progress together).
  WorkHandle send_recv_async(const Tensor& to_send, int dst, Tensor& into, int src,
                             int tag) override;
  // ncclCommSplit (NCCL >= 2.18); the child gets a stream of its own. Named
  // "<name>/split(color=C)".
  std::unique_ptr<Communicator> split(int color, int key) override;
  // Throws the failure the watchdog found (a device-waited operation that failed, timed out or
  // whose message header did not match), after running the checks of those now complete.
  void check() override;
  // The compute stream's stalls at this communicator's wait_on_device calls that completed since
  // the last call (timing events around each cudaStreamWaitEvent).
  double take_device_wait_seconds() override;
  // Each of those stalls, on the host's clock where the GPU's is anchored (cuda::anchor_clock).
  void on_device_wait(std::function<void(double, double)> observer) override;

 private:
  std::shared_ptr<NcclShared> shared_;
  std::string name_;
  int rank_ = 0;
  int size_ = 1;
};

// Creates the NCCL communicator spanning the ranks of `bootstrap` (same ranks, same order, same
// name) on GPU `cuda_device` of this process. Collective over `bootstrap`, whose tensors are on
// the host (local or mpi backend). Throws CommError when the GPU does not exist or NCCL fails.
std::unique_ptr<Communicator> make_nccl_world(Communicator& bootstrap, int cuda_device,
                                              const CommOptions& options = {});

// How many times this process's host waited for an nccl operation (Work::wait on one not yet
// seen complete), every communicator and rank together: each is a drain of the GPU's queue.
// For the tests and benchmarks that count a step's host waits.
int64_t nccl_host_waits();

}  // namespace loom
