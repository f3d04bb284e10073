// ProbingCommunicator — forwards every call to another communicator and calls `on_issue` when a
// collective that reduces (all_reduce, reduce_scatter) is issued and `on_wait` when the caller
// waits for it (wait or wait_on_device): a test checks there what the layer has computed so far,
// e.g. whether a weight gradient was computed before or after its layer issued a collective.
#pragma once

#include <functional>
#include <memory>
#include <utility>

#include "comm/communicator.h"

namespace loom::testing {

class ProbingCommunicator final : public Communicator {
 public:
  explicit ProbingCommunicator(Communicator& inner) : inner_(inner) {}

  std::function<void()> on_issue, on_wait;

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string name() const override { return inner_.name(); }
  std::string backend() const override { return inner_.backend(); }
  Device tensor_device() const override { return inner_.tensor_device(); }
  WorkHandle all_reduce_async(Tensor& t, ReduceOp op) override {
    return probed(inner_.all_reduce_async(t, op));
  }
  WorkHandle reduce_scatter_async(const Tensor& in, Tensor& out, ReduceOp op) override {
    return probed(inner_.reduce_scatter_async(in, out, op));
  }
  WorkHandle all_gather_async(const Tensor& in, Tensor& out) override {
    return inner_.all_gather_async(in, out);
  }
  WorkHandle broadcast_async(Tensor& t, int root) override {
    return inner_.broadcast_async(t, root);
  }
  WorkHandle reduce_async(Tensor& t, int root, ReduceOp op) override {
    return inner_.reduce_async(t, root, op);
  }
  WorkHandle all_to_all_async(const Tensor& in, Tensor& out) override {
    return inner_.all_to_all_async(in, out);
  }
  WorkHandle barrier_async() override { return inner_.barrier_async(); }
  WorkHandle send_async(const Tensor& t, int dst, int tag) override {
    return inner_.send_async(t, dst, tag);
  }
  WorkHandle recv_async(Tensor& t, int src, int tag) override {
    return inner_.recv_async(t, src, tag);
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    return inner_.split(color, key);
  }

 private:
  class ProbedWork final : public Work {
   public:
    ProbedWork(WorkHandle inner, std::function<void()> on_wait)
        : inner_(std::move(inner)), on_wait_(std::move(on_wait)) {}
    void wait() override {
      if (on_wait_) on_wait_();
      inner_->wait();
    }
    bool test() override { return inner_->test(); }
    void wait_on_device() override {
      if (on_wait_) on_wait_();
      inner_->wait_on_device();
    }

   private:
    WorkHandle inner_;
    std::function<void()> on_wait_;
  };

  WorkHandle probed(WorkHandle work) {
    if (on_issue) on_issue();
    return std::make_shared<ProbedWork>(std::move(work), on_wait);
  }

  Communicator& inner_;
};

}  // namespace loom::testing
