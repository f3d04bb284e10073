// ForwardingCommunicator — a communicator that hands every call to another one (not owned; it
// must outlive this). What it is for: wrappers that change a few calls and pass the rest through
// unchanged — counting bytes and waits (comm/counting.h), routing point-to-point messages by
// direction (comm/directed_p2p.h), a test's probes — each overriding only what it changes.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "comm/communicator.h"

namespace loom {

class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(Communicator& inner) : inner_(inner) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string name() const override { return inner_.name(); }
  std::string backend() const override { return inner_.backend(); }
  Device tensor_device() const override { return inner_.tensor_device(); }

  WorkHandle all_reduce_async(Tensor& tensor, ReduceOp op) override {
    return inner_.all_reduce_async(tensor, op);
  }
  WorkHandle reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) override {
    return inner_.reduce_scatter_async(input, output, op);
  }
  WorkHandle all_gather_async(const Tensor& input, Tensor& output) override {
    return inner_.all_gather_async(input, output);
  }
  WorkHandle broadcast_async(Tensor& tensor, int root) override {
    return inner_.broadcast_async(tensor, root);
  }
  WorkHandle reduce_async(Tensor& tensor, int root, ReduceOp op) override {
    return inner_.reduce_async(tensor, root, op);
  }
  WorkHandle all_to_all_async(const Tensor& input, Tensor& output) override {
    return inner_.all_to_all_async(input, output);
  }
  WorkHandle all_to_all_v_async(const Tensor& input, const std::vector<int64_t>& send_counts,
                                Tensor& output, const std::vector<int64_t>& recv_counts) override {
    return inner_.all_to_all_v_async(input, send_counts, output, recv_counts);
  }
  WorkHandle barrier_async() override { return inner_.barrier_async(); }
  WorkHandle send_async(const Tensor& tensor, int dst, int tag) override {
    return inner_.send_async(tensor, dst, tag);
  }
  WorkHandle recv_async(Tensor& tensor, int src, int tag) override {
    return inner_.recv_async(tensor, src, tag);
  }
  // The inner backend's own pairing (one NCCL group under nccl). A wrapper that reroutes
  // send_async / recv_async overrides this too, or the pair would bypass its routing.
  WorkHandle send_recv_async(const Tensor& to_send, int dst, Tensor& into, int src,
                             int tag) override {
    return inner_.send_recv_async(to_send, dst, into, src, tag);
  }
  // A plain sub-communicator of the inner one: the wrapper's behaviour does not carry over.
  std::unique_ptr<Communicator> split(int color, int key) override {
    return inner_.split(color, key);
  }
  void check() override { inner_.check(); }
  double take_device_wait_seconds() override { return inner_.take_device_wait_seconds(); }
  void on_device_wait(std::function<void(double, double)> observer) override {
    inner_.on_device_wait(std::move(observer));
  }

 protected:
  Communicator& inner() const { return inner_; }

 private:
  Communicator& inner_;
};

}  // namespace loom
