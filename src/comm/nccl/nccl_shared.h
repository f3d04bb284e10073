// The nccl backend's insides, shared by its files (private to src/comm/nccl):
//   nccl_shared.cc  NcclShared: the NCCL communicator, its streams, its watchdog, its failure
//   nccl_work.cc    NcclWork (an operation's handle) and launch(), which enqueues one
//   nccl_flight.cc  NcclFlight: a rank's flight recorder for one nccl world
//   nccl_backend.cc the collectives; nccl_p2p.cc send / recv; nccl_setup.cc init and split
// How the backend behaves is described in nccl_backend.h.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "comm/flight_recorder.h"

namespace loom {
namespace nccl {

using Clock = std::chrono::steady_clock;

// Every failure of this backend is a CommError "nccl: ...", so callers catch one type.
template <typename... Args>
[[noreturn]] void comm_fail(Args&&... args) {
  throw CommError(detail::concat("nccl: ", std::forward<Args>(args)...));
}

std::string seconds_str(std::chrono::milliseconds d);  // "5.0 s", "0.050 s"

void cuda_call(cudaError_t err, const char* call);  // comm_fail when err is not cudaSuccess
#define LOOM_NCCL_CUDA(expr) ::loom::nccl::cuda_call((expr), #expr)

// Non-blocking communicators: a call returns ncclInProgress and the communicator's state says
// when it is done. Polls until it leaves ncclInProgress or `deadline` (then ncclInProgress).
ncclResult_t poll_state(ncclComm_t comm, ncclResult_t result, Clock::time_point deadline);

ncclConfig_t nonblocking_config();
ncclDataType_t nccl_type(DType dtype);
ncclRedOp_t nccl_op(ReduceOp op);
inline size_t count(const Tensor& t) {
  return static_cast<size_t>(t.numel());
}

// A completion event, shared by the handle and the watchdog's list (destroyed with the last).
using EventRef = std::shared_ptr<std::remove_pointer_t<cudaEvent_t>>;
EventRef owned_event(cudaEvent_t event);
EventRef timing_event();  // an event that records time (the stalls'), or CommError

// An operation as its handle, the watchdog and the error messages know it: "all_reduce #7 (sum,
// 1001 × f32) on group ...", its sequence number in the group (collectives; -1 for messages),
// and its flight records.
struct OpInfo {
  OpInfo(std::string what_, int64_t seq_ = -1) : what(std::move(what_)), seq(seq_) {}
  std::string what;
  int64_t seq = -1;
  std::vector<uint64_t> flight_ids;
};

// What an operation puts in the flight recorder (flight_recorder.h).
struct FlightNote {
  bool p2p = false;  // recorded under "<group>:p2p", numbered per peer, as the local backend does
  int64_t seq = 0;
  std::string op;
  std::string dtype;
  int64_t count = 0;
};

struct NcclFlight;

// The ranks of one nccl world that this process drives (thread ranks; one per process under
// mpirun), by world rank: a rank that fails dumps its in-process peers' records with its own,
// and names those that did not arrive at a collective. Registered by the world's ncclUniqueId.
struct NcclWorldPeers {
  std::mutex mutex;
  std::map<int, std::weak_ptr<NcclFlight>> by_rank;

  std::shared_ptr<NcclFlight> find(int world_rank);
  std::vector<std::shared_ptr<NcclFlight>> all();
};

// The registry of the worlds of this process, by their id: one NcclWorldPeers each.
std::shared_ptr<NcclWorldPeers> world_peers(const ncclUniqueId& id);

// One rank's flight recorder for one nccl world, shared by the world communicator and every
// communicator split from it. States: issued (asked for), started (enqueued on the
// communicator's stream), completed (its event seen done: by a wait, the watchdog, the next
// operation's reaping or the dump), failed (the operation that failed). Dumps once, to
// CommOptions::flight_dir/rank_NNNNN.nccl.json, when the first of its communicators fails.
struct NcclFlight {
  NcclFlight(const CommOptions& options, int rank, int ranks, std::shared_ptr<NcclWorldPeers> p)
      : recorder(options.flight_capacity),
        dir(options.flight_dir),
        world_rank(rank),
        world_size(ranks),
        peers(std::move(p)) {}

  FlightRecorder recorder;
  const std::string dir;
  const int world_rank;
  const int world_size;
  const std::shared_ptr<NcclWorldPeers> peers;

  std::mutex mutex;  // guards pending and dumped; taken after a communicator's, never before
  struct Pending {
    uint64_t id;
    EventRef done;
    const void* owner;  // the communicator's NcclShared
  };
  std::vector<Pending> pending;  // started, not yet seen complete
  bool dumped = false;

  void started(const std::vector<uint64_t>& ids, const EventRef& done, const void* owner);
  // Marks the operations whose event completed.
  void reap();
  void reap_locked();
  // Dumps once (with a flight_dir); returns a note for the error message when the dump failed.
  std::string dump(const std::string& reason);
  void failed(const std::vector<uint64_t>& ids);
  // A communicator aborted: its unfinished operations stay as they are (NCCL's killed kernels
  // complete their events too, which proves nothing).
  void abandon(const void* owner);
  // This rank's dump, then its in-process peers' (where they are now), so that `loom debug hang`
  // sees every rank of a thread-rank world at once.
  std::string dump_world(const std::string& reason);
  // The end of a timeout's message for collective `seq` of `group` (members by world rank): the
  // members in this process that never issued it, or where to look for those elsewhere.
  std::string not_arrived(const std::string& group, int64_t seq,
                          const std::vector<int>& members) const;
};

}  // namespace nccl

// What the communicator and its Work handles share; `mutex` serialises every NCCL call on
// `comm` (abort from a waiting thread vs. an enqueue) and guards the fields below it.
struct NcclShared {
  using Clock = nccl::Clock;
  using EventRef = nccl::EventRef;
  using OpInfo = nccl::OpInfo;

  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t inputs_ready = nullptr;  // recorded on the legacy stream before each enqueue
  // Reads a received message's header back once the recv completed: a stream of its own, so
  // that the read waits neither for the compute stream's kernels (a copy on the legacy stream
  // would: a drain per message) nor for operations queued on `stream` after the recv.
  cudaStream_t readback = nullptr;
  int device = 0;
  int rank = 0;
  int size = 1;
  std::string name;
  CommOptions options;
  Tensor scratch;  // barrier's one f32

  std::mutex mutex;
  std::string aborted;  // why the communicator refuses calls (aborted, destroyed); empty: usable
  bool failed = false;  // aborted after a failure: results of unfinished operations are garbage
  struct Parked {
    EventRef event;
    std::vector<Tensor> keep;
  };
  std::vector<Parked> parked;  // buffers of dropped handles, until their event completes
  // Operations the compute stream waits for (Work::wait_on_device): the watchdog thread runs
  // their checks once they complete and aborts the communicator when one fails or outlives the
  // timeout, which releases the stream (NCCL's kernels return on abort).
  struct Watched {
    EventRef event;
    std::vector<Tensor> keep;
    OpInfo op;
    Clock::time_point deadline;
    std::function<void()> on_done;  // a recv's header check
  };
  std::vector<Watched> watched;
  // The compute stream's stall at each wait_on_device: timing events recorded just before and
  // after its cudaStreamWaitEvent, so their interval is how long the stream waited for the
  // communication (0 when it was done in time). Summed as they complete, until taken.
  std::vector<std::pair<EventRef, EventRef>> stalls;
  double stalled_seconds = 0;
  std::function<void(double, double)> on_stall;  // each stall on the host's clock (a timeline)
  // Timing events of stalls already summed, for the next waits: creating and destroying two
  // events per wait would cost the host a few µs each, a hundred times a micro-batch under tp.
  std::vector<EventRef> spare_timing;
  static constexpr size_t kSpareTiming = 64;
  std::thread watchdog;  // started by the first wait_on_device
  std::condition_variable watched_changed;
  bool stopping = false;
  std::map<int, std::deque<Tensor>> self_messages;  // tag -> sends to oneself, FIFO
  std::vector<int64_t> sent, received;              // per peer: messages so far
  int64_t next_seq = 0;
  // This rank's flight recorder (shared with the world and its splits); the group's name there
  // ("nccl:<name>") and its members' world ranks. Null while the communicator is being set up.
  std::shared_ptr<nccl::NcclFlight> flight;
  std::string flight_group;
  std::vector<int> world_ranks;

  ~NcclShared();

  std::string group() const;  // "group 'world' (size 2, rank 0)"

  // Aborts the NCCL communicator once, remembering why; later calls refuse with `why`. The
  // operation that failed (`op`, when one did) is marked in the flight recorder, which dumps
  // (this rank's and its in-process peers') before the abort. Returns a note when the dump
  // failed.
  std::string abort_locked(const std::string& why, const OpInfo* op = nullptr);
  [[noreturn]] void fail_locked(const std::string& why, const OpInfo* op = nullptr);
  // "timed out after 5.0 s waiting for all_reduce #7 (...) on group ...; rank(s) 1 did not
  // arrive": the arrival part from the flight records of the ranks in this process.
  std::string timed_out(const std::string& doing, const OpInfo& op) const;
  void check_usable_locked(const std::string& what) const;
  // Waits for an NCCL call's result (see poll_state); on failure or timeout aborts and throws.
  void settle_locked(ncclResult_t result, const char* call, const OpInfo& op);
  // Frees the parked buffers whose operation completed and sums the completed stalls.
  void reap_locked();
  EventRef timing_event_locked();  // a spare timing event, or a new one
  // Hands a device-waited operation to the watchdog (started now if it is not yet).
  void watch_locked(Watched w);
  // The watchdog's round: completed operations leave the list after their check (none once the
  // communicator failed: their results are garbage and the failure is what gets reported); an
  // unfinished one fails the communicator on NCCL's asynchronous error or past its deadline.
  void sweep_locked();
  // Flushes and frees the NCCL communicator (bounded by the timeout, then aborted), then waits
  // for the stream so that no parked buffer is still in use. Never throws.
  void close() noexcept;

 private:
  void watch_loop();
  void stop_watchdog();
};

namespace nccl {

// Creates the stream and scratch of a freshly initialised (settled) NCCL communicator; aborts
// it when that fails.
std::shared_ptr<NcclShared> wrap(ncclComm_t comm, int device, std::string name,
                                 const CommOptions& options);

// Enqueues `call` (NCCL calls on s.comm / s.stream, returning the last result) after the work
// of the legacy default stream, records it in the flight recorder (`notes`: one per operation
// it carries), and returns a handle on its completion event; `on_done` runs once it completed
// (a recv's header check).
WorkHandle launch(const std::shared_ptr<NcclShared>& shared, OpInfo op, const char* call_name,
                  const std::function<ncclResult_t()>& call, std::vector<Tensor> keep,
                  const std::vector<FlightNote>& notes, std::function<void()> on_done = {});

// An NCCL group: `body` issues the calls; ncclGroupEnd is always called so the group closes.
ncclResult_t grouped(const std::function<ncclResult_t()>& body);

void expect_on_gpu(const Tensor& t, int device, const char* op, const char* what);

// Every rank's `words` (the same number each), by rank: uploaded, all-gathered on the
// communicator's stream outside its sequence numbers and flight records, and read back with a
// host wait. For set-up and checks, not for a step's data.
std::vector<int64_t> all_gather_words(const std::shared_ptr<NcclShared>& s,
                                      const std::vector<int64_t>& words, const std::string& what);

}  // namespace nccl
}  // namespace loom
