// ProbingCommunicator — forwards every call to another communicator and calls `on_issue` when a
// collective that reduces (all_reduce, reduce_scatter) is issued and `on_wait` when the caller
// waits for it (wait or wait_on_device): a test checks there what the layer has computed so far,
// e.g. whether a weight gradient was computed before or after its layer issued a collective.
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "comm/forwarding.h"

namespace loom::testing {

class ProbingCommunicator final : public ForwardingCommunicator {
 public:
  explicit ProbingCommunicator(Communicator& inner) : ForwardingCommunicator(inner) {}

  std::function<void()> on_issue, on_wait;

  WorkHandle all_reduce_async(Tensor& t, ReduceOp op) override {
    return probed(inner().all_reduce_async(t, op));
  }
  WorkHandle reduce_scatter_async(const Tensor& in, Tensor& out, ReduceOp op) override {
    return probed(inner().reduce_scatter_async(in, out, op));
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
};

// Whether a layer had computed `grad` (f32, host memory; zero until computed) when each reducing
// collective was issued and when it was waited for: watch() sets the communicator's probes.
struct GradientProbe {
  std::vector<bool> computed_at_issue, computed_at_wait;

  void watch(ProbingCommunicator& comm, const Tensor& grad) {
    comm.on_issue = [this, &grad] { computed_at_issue.push_back(any_nonzero(grad)); };
    comm.on_wait = [this, &grad] { computed_at_wait.push_back(any_nonzero(grad)); };
  }
  static bool any_nonzero(const Tensor& t) {
    for (int64_t i = 0; i < t.numel(); ++i)
      if (t.data<float>()[i] != 0.0f) return true;
    return false;
  }
};

}  // namespace loom::testing
