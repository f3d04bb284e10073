#include "comm/nccl/nccl_backend.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iomanip>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "comm/flight_recorder.h"
#include "device/cuda/clock.h"
#include "device/cuda/cuda_check.h"

static_assert(NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0), "ncclCommSplit needs NCCL >= 2.18");
static_assert(sizeof(ncclUniqueId) == 32 * sizeof(int32_t), "the id travels as 32 i32");

namespace loom {
namespace {

using Clock = std::chrono::steady_clock;

// Every failure of this backend is a CommError "nccl: ...", so callers catch one type.
template <typename... Args>
[[noreturn]] void comm_fail(Args&&... args) {
  throw CommError(detail::concat("nccl: ", std::forward<Args>(args)...));
}

std::string seconds_str(std::chrono::milliseconds d) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(d.count() < 100 ? 3 : 1) << d.count() / 1000.0 << " s";
  return os.str();
}

void cuda_call(cudaError_t err, const char* call) {
  if (err != cudaSuccess)
    comm_fail(call, " failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
}
#define LOOM_NCCL_CUDA(expr) cuda_call((expr), #expr)

// Non-blocking communicators: a call returns ncclInProgress and the communicator's state says
// when it is done. Polls until it leaves ncclInProgress or `deadline` (then ncclInProgress).
ncclResult_t poll_state(ncclComm_t comm, ncclResult_t result, Clock::time_point deadline) {
  for (int polls = 0; result == ncclInProgress; ++polls) {
    if (Clock::now() > deadline) return ncclInProgress;
    if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (ncclCommGetAsyncError(comm, &result) != ncclSuccess) return ncclInternalError;
  }
  return result;
}

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kF64:
      return ncclFloat64;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    case DType::kI32:
      return ncclInt32;
    case DType::kI64:
      return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

// A completion event, shared by the handle and the watchdog's list (destroyed with the last).
using EventRef = std::shared_ptr<std::remove_pointer_t<cudaEvent_t>>;
EventRef owned_event(cudaEvent_t event) {
  return EventRef(event, [](cudaEvent_t e) { (void)cudaEventDestroy(e); });
}

EventRef timing_event() {
  cudaEvent_t e = nullptr;
  const cudaError_t err = cudaEventCreate(&e);
  if (err != cudaSuccess)
    throw CommError(detail::concat("nccl: cudaEventCreate failed: ", cudaGetErrorName(err)));
  return owned_event(e);
}

std::atomic<int64_t> g_host_waits{0};

// "nccl: why" thrown by a check, stored without its prefix (fail_locked adds it back).
std::string without_prefix(const std::string& message) {
  return message.rfind("nccl: ", 0) == 0 ? message.substr(6) : message;
}

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

std::string join(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

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

  std::shared_ptr<NcclFlight> find(int world_rank) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = by_rank.find(world_rank);
    return it == by_rank.end() ? nullptr : it->second.lock();
  }
  std::vector<std::shared_ptr<NcclFlight>> all() {
    std::lock_guard<std::mutex> lock(mutex);
    std::vector<std::shared_ptr<NcclFlight>> out;
    for (auto& [rank, flight] : by_rank)
      if (auto f = flight.lock()) out.push_back(std::move(f));
    return out;
  }
};

std::shared_ptr<NcclWorldPeers> world_peers(const ncclUniqueId& id) {
  static std::mutex mutex;
  static std::map<std::string, std::weak_ptr<NcclWorldPeers>> worlds;
  std::lock_guard<std::mutex> lock(mutex);
  std::erase_if(worlds, [](const auto& w) { return w.second.expired(); });
  std::weak_ptr<NcclWorldPeers>& slot = worlds[std::string(id.internal, sizeof id.internal)];
  std::shared_ptr<NcclWorldPeers> peers = slot.lock();
  if (!peers) {
    peers = std::make_shared<NcclWorldPeers>();
    slot = peers;
  }
  return peers;
}

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

  void started(const std::vector<uint64_t>& ids, const EventRef& done, const void* owner) {
    std::lock_guard<std::mutex> lock(mutex);
    for (uint64_t id : ids) {
      recorder.started(id);
      pending.push_back({id, done, owner});
    }
  }

  // Marks the operations whose event completed.
  void reap_locked() {
    std::erase_if(pending, [&](const Pending& p) {
      const cudaError_t state = cudaEventQuery(p.done.get());
      if (state == cudaErrorNotReady) return false;
      if (state == cudaSuccess)
        recorder.completed(p.id);
      else
        recorder.failed(p.id);
      return true;
    });
  }
  void reap() {
    std::lock_guard<std::mutex> lock(mutex);
    reap_locked();
  }

  // Dumps once (with a flight_dir); returns a note for the error message when the dump failed.
  std::string dump(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex);
    if (dir.empty() || dumped) return "";
    dumped = true;
    reap_locked();
    try {
      recorder.dump(dir, world_rank, world_size, reason, "nccl");
      return "";
    } catch (const std::exception& e) {
      return std::string(" (flight recorder dump failed: ") + e.what() + ")";
    }
  }

  void failed(const std::vector<uint64_t>& ids) {
    std::lock_guard<std::mutex> lock(mutex);
    for (uint64_t id : ids) recorder.failed(id);
    std::erase_if(pending, [&](const Pending& p) { return std::ranges::count(ids, p.id) > 0; });
  }
  // A communicator aborted: its unfinished operations stay as they are (NCCL's killed kernels
  // complete their events too, which proves nothing).
  void abandon(const void* owner) {
    std::lock_guard<std::mutex> lock(mutex);
    std::erase_if(pending, [&](const Pending& p) { return p.owner == owner; });
  }

  // This rank's dump, then its in-process peers' (where they are now), so that `loom debug hang`
  // sees every rank of a thread-rank world at once.
  std::string dump_world(const std::string& reason) {
    const std::string note = dump(reason);
    for (const auto& peer : peers->all())
      if (peer.get() != this)
        (void)peer->dump(detail::concat("rank ", world_rank, " failed: ", reason));
    return note;
  }

  // The end of a timeout's message for collective `seq` of `group` (members by world rank): the
  // members in this process that never issued it, or where to look for those elsewhere.
  std::string not_arrived(const std::string& group, int64_t seq,
                          const std::vector<int>& members) const {
    std::vector<int> absent, elsewhere;
    for (int m : members) {
      if (m == world_rank) continue;
      const std::shared_ptr<NcclFlight> peer = peers->find(m);
      if (!peer)
        elsewhere.push_back(m);
      else if (peer->recorder.last_seq(group) < seq)
        absent.push_back(m);
    }
    std::string out;
    if (!absent.empty())
      out = detail::concat("; rank(s) ", join(absent), " did not arrive");
    else if (elsewhere.empty())
      out = "; every rank issued it";
    if (!elsewhere.empty())
      out += detail::concat("; whether rank(s) ", join(elsewhere),
                            " arrived is unknown here (other processes)");
    if (!dir.empty() && !elsewhere.empty())
      out += detail::concat(": `loom debug hang` reads the flight dumps in ", dir);
    return out;
  }
};

}  // namespace

// What the communicator and its Work handles share; `mutex` serialises every NCCL call on
// `comm` (abort from a waiting thread vs. an enqueue) and guards the fields below it.
struct NcclShared {
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
  std::shared_ptr<NcclFlight> flight;
  std::string flight_group;
  std::vector<int> world_ranks;

  std::string group() const {
    return detail::concat("group '", name, "' (size ", size, ", rank ", rank, ")");
  }

  // Aborts the NCCL communicator once, remembering why; later calls refuse with `why`. The
  // operation that failed (`op`, when one did) is marked in the flight recorder, which dumps
  // (this rank's and its in-process peers') before the abort. Returns a note when the dump
  // failed.
  std::string abort_locked(const std::string& why, const OpInfo* op = nullptr) {
    if (aborted.empty()) aborted = why;
    const bool first = !failed;
    failed = true;
    std::string note;
    if (flight) {
      if (op != nullptr) flight->failed(op->flight_ids);
      if (first) note = flight->dump_world(why);
      flight->abandon(this);
    }
    if (comm != nullptr) {
      (void)ncclCommAbort(comm);
      comm = nullptr;
    }
    return note;
  }

  [[noreturn]] void fail_locked(const std::string& why, const OpInfo* op = nullptr) {
    const std::string note = abort_locked(why, op);
    comm_fail(why, "; communicator aborted", note);
  }

  // "timed out after 5.0 s waiting for all_reduce #7 (...) on group ...; rank(s) 1 did not
  // arrive": the arrival part from the flight records of the ranks in this process.
  std::string timed_out(const std::string& doing, const OpInfo& op) const {
    std::string arrival;
    if (flight && op.seq >= 0)
      arrival = flight->not_arrived(flight_group, op.seq, world_ranks);
    else if (flight && !flight->dir.empty())
      arrival = "; `loom debug hang` names the ranks that did not arrive from the flight dumps in " +
                flight->dir;
    else
      arrival = "; ranks that did not arrive: unknown with the nccl backend";
    return detail::concat("timed out after ", seconds_str(options.timeout), " ", doing, op.what,
                          arrival);
  }

  void check_usable_locked(const std::string& what) const {
    if (!aborted.empty()) comm_fail(what, ": communicator aborted: ", aborted);
  }

  // Waits for an NCCL call's result (see poll_state); on failure or timeout aborts and throws.
  void settle_locked(ncclResult_t result, const char* call, const OpInfo& op) {
    result = poll_state(comm, result, Clock::now() + options.timeout);
    if (result == ncclSuccess) return;
    fail_locked(result == ncclInProgress
                    ? timed_out(detail::concat("in ", call, " for "), op)
                    : detail::concat(op.what, ": ", call, " failed: ", ncclGetErrorString(result),
                                     ": ", ncclGetLastError(comm)),
                &op);
  }

  void reap_locked() {
    std::erase_if(parked, [](const Parked& p) {
      return cudaEventQuery(p.event.get()) != cudaErrorNotReady;
    });
    std::erase_if(stalls, [&](const auto& stall) {
      if (cudaEventQuery(stall.second.get()) == cudaErrorNotReady) return false;
      float ms = 0;
      if (cudaEventElapsedTime(&ms, stall.first.get(), stall.second.get()) == cudaSuccess)
        stalled_seconds += ms / 1000.0;
      if (on_stall) {
        const std::optional<double> begin = cuda::event_seconds(device, stall.first.get()),
                                    end = cuda::event_seconds(device, stall.second.get());
        if (begin && end) on_stall(*begin, *end);
      }
      // Both recorded and complete (the second follows the first on the stream): reusable.
      for (const EventRef& e : {stall.first, stall.second})
        if (spare_timing.size() < kSpareTiming) spare_timing.push_back(e);
      return true;
    });
  }

  EventRef timing_event_locked() {
    if (spare_timing.empty()) return timing_event();
    EventRef e = std::move(spare_timing.back());
    spare_timing.pop_back();
    return e;
  }

  // Hands a device-waited operation to the watchdog (started now if it is not yet).
  void watch_locked(Watched w) {
    watched.push_back(std::move(w));
    if (!watchdog.joinable()) watchdog = std::thread([this] { watch_loop(); });
    watched_changed.notify_one();
  }

  // The watchdog's round: completed operations leave the list after their check (none once the
  // communicator failed: their results are garbage and the failure is what gets reported); an
  // unfinished one fails the communicator on NCCL's asynchronous error or past its deadline.
  void sweep_locked() {
    const auto now = Clock::now();
    ncclResult_t async = ncclSuccess;
    bool async_read = false;
    std::erase_if(watched, [&](Watched& w) {
      const cudaError_t state = cudaEventQuery(w.event.get());
      if (state == cudaErrorNotReady) {
        if (failed) return false;  // the abort releases it soon
        if (!async_read && comm != nullptr) {
          async_read = true;
          if (ncclCommGetAsyncError(comm, &async) != ncclSuccess) async = ncclInternalError;
        }
        if (async != ncclSuccess && async != ncclInProgress)
          abort_locked(detail::concat(w.op.what, " failed: ", ncclGetErrorString(async), ": ",
                                      ncclGetLastError(comm)),
                       &w.op);
        else if (now > w.deadline)
          abort_locked(timed_out("waiting (on the GPU) for ", w.op), &w.op);
        return false;
      }
      if (failed) return true;
      if (state != cudaSuccess) {
        abort_locked(
            detail::concat(w.op.what, ": cudaEventQuery failed: ", cudaGetErrorName(state)),
            &w.op);
      } else if (w.on_done) {
        try {
          w.on_done();
        } catch (const std::exception& e) {
          abort_locked(without_prefix(e.what()), &w.op);
        }
      }
      return true;
    });
  }

  void watch_loop() {
    std::unique_lock<std::mutex> lock(mutex);
    try {
      cuda::DeviceGuard guard(device);
      while (!stopping) {
        if (watched.empty()) {
          watched_changed.wait(lock);
          continue;
        }
        sweep_locked();
        watched_changed.wait_for(lock, std::chrono::milliseconds(1));
      }
    } catch (const std::exception& e) {  // a broken CUDA runtime: nothing can be watched
      abort_locked(detail::concat("the watchdog of ", group(), " failed: ", e.what()));
    }
  }

  void stop_watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stopping = true;
    }
    watched_changed.notify_all();
    if (watchdog.joinable()) watchdog.join();
  }

  // Flushes and frees the NCCL communicator (bounded by the timeout, then aborted), then waits
  // for the stream so that no parked buffer is still in use. Never throws.
  void close() noexcept try {
    stop_watchdog();
    std::lock_guard<std::mutex> lock(mutex);
    cuda::DeviceGuard guard(device);
    if (comm != nullptr) {
      const auto deadline = Clock::now() + options.timeout;
      if (poll_state(comm, ncclCommFinalize(comm), deadline) == ncclSuccess) {
        (void)ncclCommDestroy(comm);
        comm = nullptr;
      } else {
        abort_locked("communicator destroyed before its operations completed");
      }
    }
    if (aborted.empty()) aborted = "communicator destroyed";
    (void)cudaStreamSynchronize(stream);
    reap_locked();
    watched.clear();  // complete after the synchronisation; unchecked, as nobody is left to tell
    stalls.clear();
    spare_timing.clear();
  } catch (...) {
    // Only DeviceGuard can throw (a broken CUDA runtime): nothing more can be freed then.
  }

  ~NcclShared() {
    stop_watchdog();
    if (inputs_ready != nullptr) (void)cudaEventDestroy(inputs_ready);
    if (readback != nullptr) (void)cudaStreamDestroy(readback);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

namespace {

// Creates the stream and scratch of a freshly initialised (settled) NCCL communicator; aborts
// it when that fails.
std::shared_ptr<NcclShared> wrap(ncclComm_t comm, int device, std::string name,
                                 const CommOptions& options) {
  auto s = std::make_shared<NcclShared>();
  s->comm = comm;
  s->device = device;
  s->name = std::move(name);
  s->options = options;
  try {
    cuda::DeviceGuard guard(device);
    LOOM_NCCL_CUDA(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking));
    LOOM_NCCL_CUDA(cudaStreamCreateWithFlags(&s->readback, cudaStreamNonBlocking));
    LOOM_NCCL_CUDA(cudaEventCreateWithFlags(&s->inputs_ready, cudaEventDisableTiming));
    if (ncclCommUserRank(comm, &s->rank) != ncclSuccess ||
        ncclCommCount(comm, &s->size) != ncclSuccess)
      comm_fail("ncclCommUserRank/ncclCommCount failed on group '", s->name, "'");
    s->sent.assign(static_cast<size_t>(s->size), 0);
    s->received.assign(static_cast<size_t>(s->size), 0);
    s->scratch = Tensor::zeros({1}, DType::kF32, Device::cuda(device));
  } catch (...) {
    s->abort_locked("could not be set up");  // nobody else holds `s` yet
    throw;
  }
  return s;
}

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclShared> shared, EventRef event, OpInfo op,
           std::vector<Tensor> keep, std::function<void()> on_done)
      : s_(std::move(shared)),
        event_(std::move(event)),
        op_(std::move(op)),
        keep_(std::move(keep)),
        on_done_(std::move(on_done)) {}

  ~NcclWork() override {
    if (done_) return;
    std::lock_guard<std::mutex> lock(s_->mutex);
    s_->parked.push_back({std::move(event_), std::move(keep_)});
  }

  bool test() override {
    if (done_) return true;
    const cudaError_t state = cudaEventQuery(event_.get());
    {
      std::lock_guard<std::mutex> lock(s_->mutex);
      // After a failure NCCL's kernels were killed: a completed event proves nothing.
      if (s_->failed || state == cudaErrorNotReady) s_->check_usable_locked(op_.what);
      if (state == cudaErrorNotReady) {
        ncclResult_t async = ncclSuccess;
        if (ncclCommGetAsyncError(s_->comm, &async) == ncclSuccess &&
            (async == ncclSuccess || async == ncclInProgress))
          return false;
        s_->fail_locked(detail::concat(op_.what, " failed: ", ncclGetErrorString(async), ": ",
                                       ncclGetLastError(s_->comm)),
                        &op_);
      }
    }
    LOOM_NCCL_CUDA(state);
    done_ = true;
    event_.reset();
    keep_.clear();
    if (on_done_) on_done_();  // the recv header check: may throw, once
    return true;
  }

  // Yields for the first polls (short operations), then sleeps briefly so waiting ranks do not
  // take every core; on timeout aborts the communicator (NCCL cannot cancel one operation).
  void wait() override {
    if (!done_) g_host_waits.fetch_add(1, std::memory_order_relaxed);
    const auto deadline = Clock::now() + s_->options.timeout;
    for (int polls = 0; !test(); ++polls) {
      if (Clock::now() > deadline) {
        std::lock_guard<std::mutex> lock(s_->mutex);
        s_->fail_locked(s_->timed_out("waiting for ", op_), &op_);
      }
      if (polls < 2000)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // The compute stream (the legacy default stream) waits for the event; the watchdog takes the
  // buffers, the deadline and the recv's check. The event is held here until the stream waits on
  // it (the watchdog may finish with it first). Outside the mutex: the emulator's default stream
  // waits on the host, until the operation completes or the watchdog aborts it.
  void wait_on_device() override {
    if (done_) return;
    cuda::DeviceGuard guard(s_->device);
    EventRef before, after, event = event_;
    {
      std::lock_guard<std::mutex> lock(s_->mutex);
      s_->check_usable_locked(op_.what);
      // Taken first: once the watchdog has the operation, nothing may fail before the wait.
      before = s_->timing_event_locked();
      after = s_->timing_event_locked();
      s_->watch_locked({std::move(event_), std::move(keep_), op_,
                        Clock::now() + s_->options.timeout, std::move(on_done_)});
    }
    done_ = true;
    LOOM_NCCL_CUDA(cudaEventRecord(before.get(), cudaStreamLegacy));
    LOOM_NCCL_CUDA(cudaStreamWaitEvent(cudaStreamLegacy, event.get(), 0));
    LOOM_NCCL_CUDA(cudaEventRecord(after.get(), cudaStreamLegacy));
    std::lock_guard<std::mutex> lock(s_->mutex);
    s_->stalls.emplace_back(before, after);
  }

 private:
  std::shared_ptr<NcclShared> s_;
  EventRef event_;
  OpInfo op_;
  std::vector<Tensor> keep_;  // buffers NCCL reads or writes until the event completes
  std::function<void()> on_done_;
  bool done_ = false;
};

// Enqueues `call` (NCCL calls on s.comm / s.stream, returning the last result) after the work
// of the legacy default stream, records it in the flight recorder (`notes`: one per operation
// it carries), and returns a handle on its completion event.
WorkHandle launch(const std::shared_ptr<NcclShared>& shared, OpInfo op, const char* call_name,
                  const std::function<ncclResult_t()>& call, std::vector<Tensor> keep,
                  const std::vector<FlightNote>& notes, std::function<void()> on_done = {}) {
  NcclShared& s = *shared;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.check_usable_locked(op.what);
  s.reap_locked();
  if (s.flight) {
    s.flight->reap();
    for (const FlightNote& n : notes)
      op.flight_ids.push_back(s.flight->recorder.issued(
          n.p2p ? s.flight_group + ":p2p" : s.flight_group, n.seq, n.op, n.dtype, n.count));
  }
  cuda::DeviceGuard guard(s.device);
  LOOM_NCCL_CUDA(cudaEventRecord(s.inputs_ready, cudaStreamLegacy));
  LOOM_NCCL_CUDA(cudaStreamWaitEvent(s.stream, s.inputs_ready, 0));
  if (call) s.settle_locked(call(), call_name, op);
  cudaEvent_t created = nullptr;
  LOOM_NCCL_CUDA(cudaEventCreateWithFlags(&created, cudaEventDisableTiming));
  EventRef done = owned_event(created);
  LOOM_NCCL_CUDA(cudaEventRecord(done.get(), s.stream));
  if (s.flight) s.flight->started(op.flight_ids, done, &s);
  return std::make_shared<NcclWork>(shared, std::move(done), std::move(op), std::move(keep),
                                    std::move(on_done));
}

// An NCCL group: `body` issues the calls; ncclGroupEnd is always called so the group closes.
ncclResult_t grouped(const std::function<ncclResult_t()>& body) {
  ncclResult_t result = ncclGroupStart();
  if (result != ncclSuccess) return result;
  result = body();
  const ncclResult_t end = ncclGroupEnd();
  return result != ncclSuccess ? result : end;
}

void expect_on_gpu(const Tensor& t, int device, const char* op, const char* what) {
  if (!t.defined()) comm_fail(op, ": ", what, " tensor is undefined");
  if (!t.device().is_cuda() || t.device().index != device)
    comm_fail(op, ": ", what, " tensor is on ", t.device().str(),
              "; the nccl backend needs tensors on cuda:", device, " (its communicator's GPU)");
}
}  // namespace

// ---- NcclCommunicator ----------------------------------------------------------------------

NcclCommunicator::NcclCommunicator(std::shared_ptr<NcclShared> shared, std::string name)
    : shared_(std::move(shared)),
      name_(std::move(name)),
      rank_(shared_->rank),
      size_(shared_->size) {}

NcclCommunicator::~NcclCommunicator() {
  shared_->close();
}

int NcclCommunicator::cuda_device() const {
  return shared_->device;
}

void NcclCommunicator::check() {
  NcclShared& s = *shared_;
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.failed) s.sweep_locked();  // the completed operations' checks, now
  if (s.failed) comm_fail(s.aborted, "; communicator aborted");
}

void NcclCommunicator::on_device_wait(std::function<void(double, double)> observer) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  shared_->on_stall = std::move(observer);
}

double NcclCommunicator::take_device_wait_seconds() {
  NcclShared& s = *shared_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.reap_locked();
  return std::exchange(s.stalled_seconds, 0.0);
}

int64_t nccl_host_waits() {
  return g_host_waits.load(std::memory_order_relaxed);
}

namespace {
size_t count(const Tensor& t) {
  return static_cast<size_t>(t.numel());
}

void expect_pair(const Tensor& input, const Tensor& output, int device, const char* op) {
  expect_on_gpu(input, device, op, "input");
  expect_on_gpu(output, device, op, "output");
  if (input.dtype() != output.dtype())
    comm_fail(op, ": input is ", dtype_name(input.dtype()), " but output is ",
              dtype_name(output.dtype()));
}

void expect_root(int root, int size, const std::string& name, const char* op) {
  if (root < 0 || root >= size)
    comm_fail(op, " on group '", name, "': root ", root, " outside [0, ", size, ")");
}

// Every rank's `words` (the same number each), by rank: uploaded, all-gathered on the
// communicator's stream outside its sequence numbers and flight records, and read back with a
// host wait. For set-up and checks, not for a step's data.
std::vector<int64_t> all_gather_words(const std::shared_ptr<NcclShared>& s,
                                      const std::vector<int64_t>& words, const std::string& what) {
  const auto n = static_cast<int64_t>(words.size());
  Tensor mine = Tensor::empty({n}, DType::kI64);
  std::copy(words.begin(), words.end(), mine.data<int64_t>());
  const Tensor sent = mine.to(Device::cuda(s->device));
  Tensor all = Tensor::empty({s->size * n}, DType::kI64, Device::cuda(s->device));
  launch(s, {what}, "ncclAllGather",
         [&] {
           return ncclAllGather(sent.raw(), all.raw(), static_cast<size_t>(n), ncclInt64, s->comm,
                                s->stream);
         },
         {sent, all}, {})
      ->wait();
  const Tensor rows = all.to(Device::cpu());
  return std::vector<int64_t>(rows.data<int64_t>(), rows.data<int64_t>() + rows.numel());
}

// CommOptions::debug_checks: every rank's sequence number and collective as text ("all_reduce(sum,
// 5 × f32)") gathered before the collective is enqueued; the first rank whose differ is named and
// the collective is not enqueued (mismatched NCCL collectives hang, or read or write past a
// buffer). One all-gather and one host wait a collective: for debugging. The group stays usable.
void debug_check(const std::shared_ptr<NcclShared>& s, int64_t seq, const std::string& text) {
  constexpr size_t kWords = 12;  // the sequence number, then up to 87 bytes of text and a 0
  std::vector<int64_t> words(kWords, 0);
  words[0] = seq;
  std::memcpy(words.data() + 1, text.data(), std::min(text.size(), 8 * (kWords - 1) - 1));
  const std::vector<int64_t> rows = all_gather_words(
      s, words, detail::concat("the debug check before ", text, " #", seq, " on ", s->group()));
  for (int r = 0; r < s->size; ++r) {
    const int64_t* row = rows.data() + static_cast<size_t>(r) * kWords;
    if (std::equal(row, row + kWords, words.begin())) continue;
    throw CommError(detail::concat(
        "nccl debug check: at sequence number ", seq, " on group '", s->name, "' rank ", s->rank,
        " calls ", text, " but rank ", r, " calls ", reinterpret_cast<const char*>(row + 1),
        " (its sequence number ", row[0], ")"));
  }
}

// Names the group's next collective ("all_reduce #7 (sum, 1001 × f32) on group ...") and
// enqueues `call`; an empty `t` enqueues nothing NCCL-side (NCCL gains nothing from it).
WorkHandle collective(const std::shared_ptr<NcclShared>& s, const char* op, const Tensor* t,
                      const std::string& args, const char* call_name,
                      std::function<ncclResult_t()> call, std::vector<Tensor> keep) {
  std::string inner = args;
  if (t != nullptr) {
    inner += detail::concat(args.empty() ? "" : ", ", t->numel(), " × ", dtype_name(t->dtype()));
    if (t->numel() == 0) call = nullptr;
  }
  int64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(s->mutex);
    seq = s->next_seq++;
  }
  if (s->options.debug_checks)
    debug_check(s, seq, detail::concat(op, inner.empty() ? "" : "(" + inner + ")"));
  OpInfo info(
      detail::concat(op, " #", seq, inner.empty() ? "" : " (" + inner + ")", " on ", s->group()),
      seq);
  FlightNote note{false, seq, op, t ? std::string(dtype_name(t->dtype())) : "",
                  t ? t->numel() : 0};
  return launch(s, std::move(info), call_name, call, std::move(keep), {note});
}
}  // namespace

WorkHandle NcclCommunicator::all_reduce_async(Tensor& tensor, ReduceOp op) {
  expect_on_gpu(tensor, shared_->device, "all_reduce", "the");
  NcclShared& s = *shared_;
  return collective(
      shared_, "all_reduce", &tensor, std::string(reduce_op_name(op)), "ncclAllReduce",
      [&] {
        return ncclAllReduce(tensor.raw(), tensor.raw(), count(tensor), nccl_type(tensor.dtype()),
                             nccl_op(op), s.comm, s.stream);
      },
      {tensor});
}

WorkHandle NcclCommunicator::reduce_scatter_async(const Tensor& input, Tensor& output,
                                                  ReduceOp op) {
  expect_pair(input, output, shared_->device, "reduce_scatter");
  if (input.numel() != output.numel() * size_)
    comm_fail("reduce_scatter on group '", name_, "': input has ", input.numel(),
              " elements, expected size ", size_, " × output ", output.numel());
  NcclShared& s = *shared_;
  return collective(
      shared_, "reduce_scatter", &output, std::string(reduce_op_name(op)), "ncclReduceScatter",
      [&] {
        return ncclReduceScatter(input.raw(), output.raw(), count(output), nccl_type(input.dtype()),
                                 nccl_op(op), s.comm, s.stream);
      },
      {input, output});
}

WorkHandle NcclCommunicator::all_gather_async(const Tensor& input, Tensor& output) {
  expect_pair(input, output, shared_->device, "all_gather");
  if (output.numel() != input.numel() * size_)
    comm_fail("all_gather on group '", name_, "': output has ", output.numel(),
              " elements, expected size ", size_, " × input ", input.numel());
  NcclShared& s = *shared_;
  return collective(shared_, "all_gather", &input, "", "ncclAllGather",
                    [&] {
                      return ncclAllGather(input.raw(), output.raw(), count(input),
                                           nccl_type(input.dtype()), s.comm, s.stream);
                    },
                    {input, output});
}

WorkHandle NcclCommunicator::broadcast_async(Tensor& tensor, int root) {
  expect_on_gpu(tensor, shared_->device, "broadcast", "the");
  expect_root(root, size_, name_, "broadcast");
  NcclShared& s = *shared_;
  return collective(shared_, "broadcast", &tensor, detail::concat("root ", root), "ncclBroadcast",
                    [&] {
                      return ncclBroadcast(tensor.raw(), tensor.raw(), count(tensor),
                                           nccl_type(tensor.dtype()), root, s.comm, s.stream);
                    },
                    {tensor});
}

WorkHandle NcclCommunicator::reduce_async(Tensor& tensor, int root, ReduceOp op) {
  expect_on_gpu(tensor, shared_->device, "reduce", "the");
  expect_root(root, size_, name_, "reduce");
  NcclShared& s = *shared_;
  // In place: recvbuff is only written at root, so the other ranks keep their tensors.
  return collective(
      shared_, "reduce", &tensor, detail::concat(reduce_op_name(op), ", root ", root), "ncclReduce",
      [&] {
        return ncclReduce(tensor.raw(), tensor.raw(), count(tensor), nccl_type(tensor.dtype()),
                          nccl_op(op), root, s.comm, s.stream);
      },
      {tensor});
}

WorkHandle NcclCommunicator::all_to_all_async(const Tensor& input, Tensor& output) {
  expect_pair(input, output, shared_->device, "all_to_all");
  if (input.numel() != output.numel() || input.numel() % size_ != 0)
    comm_fail("all_to_all on group '", name_, "': input has ", input.numel(), " and output ",
              output.numel(), " elements; both must be the same multiple of size ", size_);
  NcclShared& s = *shared_;
  return collective(shared_, "all_to_all", &input, "", "ncclSend/ncclRecv group",
                    [&] {
                      return grouped([&] {
                        const size_t n = count(input) / static_cast<size_t>(s.size);
                        const size_t bytes = n * dtype_size(input.dtype());
                        const auto* in = static_cast<const char*>(input.raw());
                        auto* out = static_cast<char*>(output.raw());
                        const ncclDataType_t type = nccl_type(input.dtype());
                        for (int peer = 0; peer < s.size; ++peer) {
                          const size_t at = static_cast<size_t>(peer) * bytes;
                          ncclResult_t r = ncclSend(in + at, n, type, peer, s.comm, s.stream);
                          if (r == ncclSuccess)
                            r = ncclRecv(out + at, n, type, peer, s.comm, s.stream);
                          if (r != ncclSuccess) return r;
                        }
                        return ncclSuccess;
                      });
                    },
                    {input, output});
}

WorkHandle NcclCommunicator::barrier_async() {
  NcclShared& s = *shared_;
  return collective(shared_, "barrier", nullptr, "", "ncclAllReduce",
                    [&] {
                      return ncclAllReduce(s.scratch.raw(), s.scratch.raw(), 1, ncclFloat32,
                                           ncclSum, s.comm, s.stream);
                    },
                    {s.scratch});
}

// ---- point to point --------------------------------------------------------------------------

namespace {
enum HeaderField { kTag, kCount, kDType, kNumber, kHeaderFields };

// A message, checked and numbered: "send(dst=1, tag=3) #4 on group ...", where #4 counts the
// earlier messages this rank sent to (received from) that peer; its flight record likewise.
struct P2p {
  std::string what;
  int64_t number = 0;
  FlightNote note;
};
P2p p2p_op(NcclShared& s, const char* op, const char* peer_name, int peer, int tag,
           std::vector<int64_t>& counter, const Tensor& t) {
  if (peer < 0 || peer >= s.size)
    comm_fail(op, " on group '", s.name, "': ", peer_name, " ", peer, " outside [0, ", s.size, ")");
  int64_t number = 0;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    number = counter[static_cast<size_t>(peer)]++;
  }
  std::string name = detail::concat(op, "(", peer_name, "=", peer, ", tag=", tag, ")");
  return {detail::concat(name, " #", number, " on ", s.group()), number,
          FlightNote{true, number, std::move(name), std::string(dtype_name(t.dtype())),
                     t.numel()}};
}

// A message's header on the tensor's GPU: its tag, size, dtype and number, which the receiver
// compares with what it expects (NCCL matches a recv with the peer's next send, whatever its tag).
// Uploaded queued on the compute stream, which the send's stream waits for, so the host does
// not wait for the GPU's work before each send.
Tensor header_of(const Tensor& tensor, int tag, int64_t number) {
  Tensor host = Tensor::empty({kHeaderFields}, DType::kI64);
  const int64_t fields[kHeaderFields] = {tag, tensor.numel(), static_cast<int64_t>(tensor.dtype()),
                                         number};
  std::memcpy(host.raw(), fields, sizeof fields);
  return host.to_queued(tensor.device());
}

// The receiver's check of a header that arrived into `header`, run once the recv completed (its
// event done, so the bytes are there for any stream): read on the readback stream.
std::function<void()> header_check(const std::shared_ptr<NcclShared>& shared, const Tensor& header,
                                   const std::string& what, int tag, const Tensor& into,
                                   int64_t number) {
  return [shared, header, what, tag, n = into.numel(), dtype = into.dtype(), number] {
    int64_t h[kHeaderFields] = {};
    {
      cuda::DeviceGuard guard(shared->device);
      LOOM_NCCL_CUDA(cudaMemcpyAsync(h, header.raw(), sizeof h, cudaMemcpyDeviceToHost,
                                     shared->readback));
      LOOM_NCCL_CUDA(cudaStreamSynchronize(shared->readback));
    }
    if (h[kTag] == tag && h[kCount] == n && h[kDType] == static_cast<int64_t>(dtype)) return;
    comm_fail(what, ": got a message with tag ", h[kTag], ", ", h[kCount], " × ",
              dtype_name(static_cast<DType>(h[kDType])), " (the peer's send #", h[kNumber],
              "), expected tag ", tag, ", ", n, " × ", dtype_name(dtype), " (recv #", number,
              "); NCCL matches messages by order, so post recvs in the order of the sends");
  };
}

// The NCCL calls of a send (header, then payload) and of a recv, inside a group.
ncclResult_t nccl_send(NcclShared& s, const Tensor& header, const Tensor& tensor, int dst) {
  ncclResult_t r = ncclSend(header.raw(), kHeaderFields, ncclInt64, dst, s.comm, s.stream);
  if (r == ncclSuccess && tensor.numel() > 0)
    r = ncclSend(tensor.raw(), count(tensor), nccl_type(tensor.dtype()), dst, s.comm, s.stream);
  return r;
}
ncclResult_t nccl_recv(NcclShared& s, const Tensor& header, Tensor& tensor, int src) {
  ncclResult_t r = ncclRecv(header.raw(), kHeaderFields, ncclInt64, src, s.comm, s.stream);
  if (r == ncclSuccess && tensor.numel() > 0)
    r = ncclRecv(tensor.raw(), count(tensor), nccl_type(tensor.dtype()), src, s.comm, s.stream);
  return r;
}

ncclResult_t copy_on_stream(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return ncclSuccess;
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream) == cudaSuccess
             ? ncclSuccess
             : ncclUnhandledCudaError;
}
}  // namespace

WorkHandle NcclCommunicator::send_async(const Tensor& tensor, int dst, int tag) {
  expect_on_gpu(tensor, shared_->device, "send", "the");
  NcclShared& s = *shared_;
  P2p send = p2p_op(s, "send", "dst", dst, tag, s.sent, tensor);
  if (dst == rank_) {
    // To oneself: an eager copy, queued for the recv (NCCL would need both in one group).
    Tensor copy = Tensor::empty(tensor.shape(), tensor.dtype(), tensor.device());
    WorkHandle work =
        launch(shared_, {send.what}, "cudaMemcpyAsync",
               [&] { return copy_on_stream(copy.raw(), tensor.raw(), tensor.nbytes(), s.stream); },
               {tensor, copy}, {send.note});
    std::lock_guard<std::mutex> lock(s.mutex);
    s.self_messages[tag].push_back(copy);
    return work;
  }
  const Tensor header = header_of(tensor, tag, send.number);
  return launch(shared_, {send.what}, "ncclSend",
                [&] { return grouped([&] { return nccl_send(s, header, tensor, dst); }); },
                {tensor, header}, {send.note});
}

WorkHandle NcclCommunicator::recv_async(Tensor& tensor, int src, int tag) {
  expect_on_gpu(tensor, shared_->device, "recv", "the");
  NcclShared& s = *shared_;
  P2p recv = p2p_op(s, "recv", "src", src, tag, s.received, tensor);
  const std::string& what = recv.what;
  if (src == rank_) {
    Tensor message;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      auto& box = s.self_messages[tag];
      if (!box.empty()) {
        message = box.front();
        box.pop_front();
      }
    }
    // The stream runs in issue order, so a recv from oneself can never wait for a later send.
    if (!message.defined())
      comm_fail(what, ": no message from this rank to itself with tag ", tag,
                " (a recv from oneself must follow its send)");
    if (message.numel() != tensor.numel() || message.dtype() != tensor.dtype())
      comm_fail(what, ": rank ", src, " sent ", message.numel(), " × ", dtype_name(message.dtype()),
                ", expected ", tensor.numel(), " × ", dtype_name(tensor.dtype()));
    return launch(
        shared_, {what}, "cudaMemcpyAsync",
        [&] { return copy_on_stream(tensor.raw(), message.raw(), tensor.nbytes(), s.stream); },
        {tensor, message}, {recv.note});
  }
  Tensor header = Tensor::empty({kHeaderFields}, DType::kI64, tensor.device());
  return launch(shared_, {what}, "ncclRecv",
                [&] { return grouped([&] { return nccl_recv(s, header, tensor, src); }); },
                {tensor, header}, {recv.note},
                header_check(shared_, header, what, tag, tensor, recv.number));
}

WorkHandle NcclCommunicator::send_recv_async(const Tensor& to_send, int dst, Tensor& into, int src,
                                             int tag) {
  // A message to or from oneself goes through the eager self-copy of send_async / recv_async.
  if (dst == rank_ || src == rank_)
    return Communicator::send_recv_async(to_send, dst, into, src, tag);
  expect_on_gpu(to_send, shared_->device, "send", "the");
  expect_on_gpu(into, shared_->device, "recv", "the");
  NcclShared& s = *shared_;
  const P2p send = p2p_op(s, "send", "dst", dst, tag, s.sent, to_send);
  const P2p recv = p2p_op(s, "recv", "src", src, tag, s.received, into);
  const Tensor out_header = header_of(to_send, tag, send.number);
  Tensor in_header = Tensor::empty({kHeaderFields}, DType::kI64, into.device());
  return launch(shared_, {send.what + " with " + recv.what}, "ncclSend/ncclRecv",
                [&] {
                  return grouped([&] {
                    const ncclResult_t r = nccl_send(s, out_header, to_send, dst);
                    return r == ncclSuccess ? nccl_recv(s, in_header, into, src) : r;
                  });
                },
                {to_send, into, out_header, in_header}, {send.note, recv.note},
                header_check(shared_, in_header, recv.what, tag, into, recv.number));
}

// ---- split and construction ------------------------------------------------------------------

namespace {
// Waits for a new communicator (init or split, non-blocking) to be ready; on failure or timeout
// aborts it and throws "nccl: <where>: <call> <why>".
void settle_new(ncclComm_t comm, ncclResult_t result, std::chrono::milliseconds timeout,
                const char* call, const std::string& where, const char* hint) {
  if (comm != nullptr) result = poll_state(comm, result, Clock::now() + timeout);
  if (result == ncclSuccess) return;
  const std::string why =
      result == ncclInProgress
          ? "timed out after " + seconds_str(timeout) + hint
          : detail::concat("failed: ", ncclGetErrorString(result), ": ", ncclGetLastError(comm));
  if (comm != nullptr) (void)ncclCommAbort(comm);
  comm_fail(where, ": ", call, " ", why);
}
}  // namespace

namespace {
// The world ranks of a new communicator's members, by its ranks: one all-gather of a word each
// over it (ncclCommSplit orders them by key, then by parent rank; only the members know theirs).
std::vector<int> gather_world_ranks(const std::shared_ptr<NcclShared>& s, int world_rank) {
  const std::vector<int64_t> ranks =
      all_gather_words(s, {world_rank}, "the exchange of world ranks on " + s->group());
  return std::vector<int>(ranks.begin(), ranks.end());
}

// Gives a set-up communicator its flight state: this rank's recorder, its group's name there
// ("nccl:<name>") and its members' world ranks.
void join_flight(const std::shared_ptr<NcclShared>& s, std::shared_ptr<NcclFlight> flight,
                 std::vector<int> world_ranks) {
  std::lock_guard<std::mutex> lock(s->mutex);
  s->flight_group = "nccl:" + s->name;
  flight->recorder.add_group(s->flight_group, world_ranks);
  s->world_ranks = std::move(world_ranks);
  s->flight = std::move(flight);
}
}  // namespace

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) {
  NcclShared& s = *shared_;
  ncclComm_t child = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    const int64_t seq = s.next_seq++;
    OpInfo op(detail::concat("split #", seq, " (color ", color, ", key ", key, ") on ", s.group()),
              seq);
    const std::string& what = op.what;
    s.check_usable_locked(what);
    // In the flight records as the local backend has it: completed once the child is ready.
    if (s.flight) op.flight_ids = {s.flight->recorder.issued(s.flight_group, seq, "split", "", 0)};
    const auto record = [&](void (FlightRecorder::*state)(uint64_t)) {
      for (uint64_t id : op.flight_ids) (s.flight->recorder.*state)(id);
    };
    cuda::DeviceGuard guard(s.device);
    ncclConfig_t config = nonblocking_config();
    const ncclResult_t r =
        ncclCommSplit(s.comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config);
    // Without a child (color < 0, or an error) the parent's state says how the split went.
    if (child == nullptr || r != ncclInProgress) s.settle_locked(r, "ncclCommSplit", op);
    if (child != nullptr) {
      try {
        settle_new(child, r, s.options.timeout, "ncclCommSplit", what, "");
      } catch (...) {
        record(&FlightRecorder::failed);
        throw;
      }
    }
    record(&FlightRecorder::completed);
    if (child == nullptr) return nullptr;
  }
  const std::string child_name = detail::concat(name_, "/split(color=", color, ")");
  std::shared_ptr<NcclShared> made = wrap(child, s.device, child_name, s.options);
  // A new communicator aborts and frees itself when a later step fails (~NcclCommunicator).
  auto result = std::make_unique<NcclCommunicator>(made, child_name);
  if (s.flight) join_flight(made, s.flight, gather_world_ranks(made, s.flight->world_rank));
  return result;
}

std::unique_ptr<Communicator> make_nccl_world(Communicator& bootstrap, int cuda_device,
                                              const CommOptions& options) {
  const std::string where =
      detail::concat("creating group '", bootstrap.name(), "' (size ", bootstrap.size(), ", rank ",
                     bootstrap.rank(), ") on cuda:", cuda_device);
  int gpus = 0;
  const cudaError_t err = cudaGetDeviceCount(&gpus);
  if (err != cudaSuccess)
    comm_fail(where, ": no GPU: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  if (cuda_device < 0 || cuda_device >= gpus)
    comm_fail(where, ": this machine has ", gpus, " GPU(s)");

  // Rank 0's id, as 32 i32 through the bootstrap (a host tensor, any host backend).
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  Tensor bytes = Tensor::zeros({32}, DType::kI32);
  if (bootstrap.rank() == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) comm_fail(where, ": ncclGetUniqueId failed: ", ncclGetErrorString(r));
    std::memcpy(bytes.raw(), &id, sizeof id);
  }
  bootstrap.broadcast(bytes, 0);
  std::memcpy(&id, bytes.raw(), sizeof id);

  cuda::DeviceGuard guard(cuda_device);
  ncclConfig_t config = nonblocking_config();
  ncclComm_t comm = nullptr;
  const ncclResult_t r =
      ncclCommInitRankConfig(&comm, bootstrap.size(), id, bootstrap.rank(), &config);
  settle_new(comm, r, options.timeout, "ncclCommInitRankConfig", where,
             " (did every rank call make_nccl_world?)");
  CommOptions opts = options;
  if (const char* env = std::getenv("LOOM_COMM_DEBUG"); env && std::string_view(env) == "1")
    opts.debug_checks = true;
  std::shared_ptr<NcclShared> made = wrap(comm, cuda_device, bootstrap.name(), opts);
  // The ranks of this world in this process find each other by its id (thread ranks).
  std::shared_ptr<NcclWorldPeers> peers = world_peers(id);
  auto flight = std::make_shared<NcclFlight>(opts, bootstrap.rank(), bootstrap.size(), peers);
  {
    std::lock_guard<std::mutex> lock(peers->mutex);
    peers->by_rank[bootstrap.rank()] = flight;
  }
  std::vector<int> world_ranks(static_cast<size_t>(bootstrap.size()));
  for (int i = 0; i < bootstrap.size(); ++i) world_ranks[static_cast<size_t>(i)] = i;
  join_flight(made, std::move(flight), std::move(world_ranks));
  return std::make_unique<NcclCommunicator>(made, bootstrap.name());
}

}  // namespace loom
