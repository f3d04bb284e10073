// NcclShared (nccl_shared.h): one NCCL communicator's state — its failure and abort, the
// watchdog that owns the operations the GPU waits for, the compute stream's stalls — and the
// small helpers every file of the backend uses.
#include "comm/nccl/nccl_shared.h"

#include <iomanip>
#include <sstream>

#include "device/cuda/clock.h"
#include "device/cuda/cuda_check.h"

namespace loom {
namespace nccl {

std::string seconds_str(std::chrono::milliseconds d) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(d.count() < 100 ? 3 : 1) << d.count() / 1000.0 << " s";
  return os.str();
}

void cuda_call(cudaError_t err, const char* call) {
  if (err != cudaSuccess)
    comm_fail(call, " failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
}

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

ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

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

}  // namespace nccl

using nccl::comm_fail;

namespace {
// "nccl: why" thrown by a check, stored without its prefix (fail_locked adds it back).
std::string without_prefix(const std::string& message) {
  return message.rfind("nccl: ", 0) == 0 ? message.substr(6) : message;
}
}  // namespace

std::string NcclShared::group() const {
  return detail::concat("group '", name, "' (size ", size, ", rank ", rank, ")");
}

std::string NcclShared::abort_locked(const std::string& why, const OpInfo* op) {
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

void NcclShared::fail_locked(const std::string& why, const OpInfo* op) {
  const std::string note = abort_locked(why, op);
  comm_fail(why, "; communicator aborted", note);
}

std::string NcclShared::timed_out(const std::string& doing, const OpInfo& op) const {
  std::string arrival;
  if (flight && op.seq >= 0)
    arrival = flight->not_arrived(flight_group, op.seq, world_ranks);
  else if (flight && !flight->dir.empty())
    arrival = "; `loom debug hang` names the ranks that did not arrive from the flight dumps in " +
              flight->dir;
  else
    arrival = "; ranks that did not arrive: unknown with the nccl backend";
  return detail::concat("timed out after ", nccl::seconds_str(options.timeout), " ", doing,
                        op.what, arrival);
}

void NcclShared::check_usable_locked(const std::string& what) const {
  if (!aborted.empty()) comm_fail(what, ": communicator aborted: ", aborted);
}

void NcclShared::settle_locked(ncclResult_t result, const char* call, const OpInfo& op) {
  result = nccl::poll_state(comm, result, Clock::now() + options.timeout);
  if (result == ncclSuccess) return;
  fail_locked(result == ncclInProgress
                  ? timed_out(detail::concat("in ", call, " for "), op)
                  : detail::concat(op.what, ": ", call, " failed: ", ncclGetErrorString(result),
                                   ": ", ncclGetLastError(comm)),
              &op);
}

void NcclShared::reap_locked() {
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

NcclShared::EventRef NcclShared::timing_event_locked() {
  if (spare_timing.empty()) return nccl::timing_event();
  EventRef e = std::move(spare_timing.back());
  spare_timing.pop_back();
  return e;
}

void NcclShared::watch_locked(Watched w) {
  watched.push_back(std::move(w));
  if (!watchdog.joinable()) watchdog = std::thread([this] { watch_loop(); });
  watched_changed.notify_one();
}

void NcclShared::sweep_locked() {
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

void NcclShared::watch_loop() {
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

void NcclShared::stop_watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    stopping = true;
  }
  watched_changed.notify_all();
  if (watchdog.joinable()) watchdog.join();
}

void NcclShared::close() noexcept try {
  stop_watchdog();
  std::lock_guard<std::mutex> lock(mutex);
  cuda::DeviceGuard guard(device);
  if (comm != nullptr) {
    const auto deadline = Clock::now() + options.timeout;
    if (nccl::poll_state(comm, ncclCommFinalize(comm), deadline) == ncclSuccess) {
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

NcclShared::~NcclShared() {
  stop_watchdog();
  if (inputs_ready != nullptr) (void)cudaEventDestroy(inputs_ready);
  if (readback != nullptr) (void)cudaStreamDestroy(readback);
  if (stream != nullptr) (void)cudaStreamDestroy(stream);
}

}  // namespace loom
