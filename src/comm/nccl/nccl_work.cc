// An operation's handle (NcclWork: test, wait on the host, wait on the GPU) and launch(), which
// enqueues an operation on a communicator's stream behind the compute stream's work
// (nccl_shared.h).
#include <atomic>

#include "comm/nccl/nccl_backend.h"
#include "comm/nccl/nccl_shared.h"
#include "device/cuda/cuda_check.h"

namespace loom::nccl {
namespace {

std::atomic<int64_t> g_host_waits{0};

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
}  // namespace

WorkHandle launch(const std::shared_ptr<NcclShared>& shared, OpInfo op, const char* call_name,
                  const std::function<ncclResult_t()>& call, std::vector<Tensor> keep,
                  const std::vector<FlightNote>& notes, std::function<void()> on_done) {
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

}  // namespace loom::nccl

namespace loom {
int64_t nccl_host_waits() {
  return nccl::g_host_waits.load(std::memory_order_relaxed);
}
}  // namespace loom
