// CountingCommunicator — forwards every call to another communicator and counts the bytes this
// rank hands to it, for the per-axis communication volume in the step metrics, and the time the
// rank spent blocked in wait() on the operations it issued (blocking calls are async + wait), for
// the per-axis communication time (on a GPU communicator, the compute stream's stalls at
// wait_on_device instead, which the backend times). The count is the
// payload of each call as issued: all_reduce / broadcast / reduce / send: the tensor;
// reduce_scatter / all_gather / all_to_all: the input; recv and barrier: nothing. (What the
// algorithm moves on the wire depends on the backend: a ring all-reduce sends 2(n−1)/n of it.)
// Not thread-safe: the rank's thread issues its operations, as for any communicator.
#pragma once

#include <atomic>
#include <functional>
#include <memory>

#include "base/timer.h"
#include "comm/forwarding.h"

namespace loom {

// The waits on one communicator's operations: their total, and whom to tell of each (a timeline).
struct WaitLog {
  std::atomic<double> blocked{0.0};             // seconds
  std::function<void(double, double)> on_wait;  // (begin, end) in now_seconds(); set before use
};

// A handle whose wait() adds the seconds it blocked to the communicator's WaitLog. On a device
// communicator (nccl) wait_on_device() does not block the host and the backend times the device's
// stall itself (take_device_wait_seconds), so it is not timed here.
class TimedWork final : public Work {
 public:
  TimedWork(WorkHandle inner, std::shared_ptr<WaitLog> log, bool device)
      : inner_(std::move(inner)), log_(std::move(log)), device_(device) {}
  void wait() override {
    timed([&] { inner_->wait(); });
  }
  bool test() override { return inner_->test(); }
  void wait_on_device() override {
    if (device_)
      inner_->wait_on_device();
    else
      timed([&] { inner_->wait_on_device(); });
  }

 private:
  template <typename Wait>
  void timed(Wait wait) {
    const double t0 = now_seconds();
    wait();
    const double t1 = now_seconds();
    log_->blocked.fetch_add(t1 - t0, std::memory_order_relaxed);
    if (log_->on_wait) log_->on_wait(t0, t1);
  }
  WorkHandle inner_;
  std::shared_ptr<WaitLog> log_;
  bool device_;
};

class CountingCommunicator final : public ForwardingCommunicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : ForwardingCommunicator(inner) {}

  int64_t bytes() const { return bytes_; }
  int64_t take_bytes() {  // returns the count and restarts it
    const int64_t b = bytes_;
    bytes_ = 0;
    return b;
  }
  // Time blocked in wait() since the last call, and on a device communicator the device's
  // stalls at wait_on_device (the host's time there is ~0).
  double take_wait_seconds() {
    return log_->blocked.exchange(0.0, std::memory_order_relaxed) +
           inner().take_device_wait_seconds();
  }
  // Called with (begin, end) of every wait from now on (before any operation is issued).
  void on_wait(std::function<void(double, double)> observer) {
    log_->on_wait = std::move(observer);
  }

  WorkHandle all_reduce_async(Tensor& t, ReduceOp op) override {
    count(t);
    return timed(inner().all_reduce_async(t, op));
  }
  WorkHandle reduce_scatter_async(const Tensor& in, Tensor& out, ReduceOp op) override {
    count(in);
    return timed(inner().reduce_scatter_async(in, out, op));
  }
  WorkHandle all_gather_async(const Tensor& in, Tensor& out) override {
    count(in);
    return timed(inner().all_gather_async(in, out));
  }
  WorkHandle broadcast_async(Tensor& t, int root) override {
    count(t);
    return timed(inner().broadcast_async(t, root));
  }
  WorkHandle reduce_async(Tensor& t, int root, ReduceOp op) override {
    count(t);
    return timed(inner().reduce_async(t, root, op));
  }
  WorkHandle all_to_all_async(const Tensor& in, Tensor& out) override {
    count(in);
    return timed(inner().all_to_all_async(in, out));
  }
  WorkHandle all_to_all_v_async(const Tensor& in, const std::vector<int64_t>& send_counts,
                                Tensor& out, const std::vector<int64_t>& recv_counts) override {
    int64_t elements = 0;
    for (int64_t c : send_counts) elements += c;
    bytes_ += elements * static_cast<int64_t>(dtype_size(in.dtype()));
    return timed(inner().all_to_all_v_async(in, send_counts, out, recv_counts));
  }
  WorkHandle barrier_async() override { return timed(inner().barrier_async()); }
  WorkHandle send_async(const Tensor& t, int dst, int tag) override {
    count(t);
    return timed(inner().send_async(t, dst, tag));
  }
  WorkHandle recv_async(Tensor& t, int src, int tag) override {
    return timed(inner().recv_async(t, src, tag));
  }
  WorkHandle send_recv_async(const Tensor& t, int dst, Tensor& into, int src, int tag) override {
    count(t);
    return timed(inner().send_recv_async(t, dst, into, src, tag));
  }

 private:
  WorkHandle timed(WorkHandle w) {
    return std::make_shared<TimedWork>(std::move(w), log_, inner().tensor_device().is_cuda());
  }
  void count(const Tensor& t) {
    bytes_ += static_cast<int64_t>(t.numel()) * static_cast<int64_t>(dtype_size(t.dtype()));
  }
  int64_t bytes_ = 0;
  std::shared_ptr<WaitLog> log_ = std::make_shared<WaitLog>();
};

}  // namespace loom
