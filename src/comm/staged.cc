#include "comm/staged.h"

#include <utility>

namespace loom {

namespace {

// The host operation's handle, plus what to copy back to the GPU once it completes (exactly once,
// whether wait() or a successful test() sees the completion first). Holding the host buffers
// keeps them alive while the host backend still reads or writes them.
class StagedWork final : public Work {
 public:
  StagedWork(WorkHandle inner, Tensor device_out, Tensor host_out, Tensor keep_alive = {})
      : inner_(std::move(inner)), device_out_(std::move(device_out)),
        host_out_(std::move(host_out)), keep_alive_(std::move(keep_alive)) {}
  void wait() override {
    inner_->wait();
    finish();
  }
  bool test() override {
    if (!inner_->test()) return false;
    finish();
    return true;
  }

 private:
  void finish() {
    if (device_out_.defined()) device_out_.copy_from(host_out_);
    device_out_ = Tensor();
  }
  WorkHandle inner_;
  Tensor device_out_, host_out_, keep_alive_;
};

}  // namespace

StagedCommunicator::StagedCommunicator(Communicator& inner, Device host)
    : inner_(&inner), host_(host) {}

StagedCommunicator::StagedCommunicator(std::unique_ptr<Communicator> inner, Device host)
    : owned_(std::move(inner)), inner_(owned_.get()), host_(host) {}

bool StagedCommunicator::staged(const Tensor& t) const {
  return t.defined() && t.device() != host_;
}

Tensor StagedCommunicator::to_host(const Tensor& t, bool contents) const {
  if (!staged(t)) return t;
  Tensor h = Tensor::empty(t.shape(), t.dtype(), host_);
  if (contents) h.copy_from(t);
  return h;
}

WorkHandle StagedCommunicator::all_reduce_async(Tensor& tensor, ReduceOp op) {
  if (!staged(tensor)) return inner_->all_reduce_async(tensor, op);
  Tensor h = to_host(tensor, true);
  return std::make_shared<StagedWork>(inner_->all_reduce_async(h, op), tensor, h);
}

template <typename Issue>
WorkHandle StagedCommunicator::in_out(const Tensor& input, Tensor& output, Issue issue) {
  Tensor in = to_host(input, true), out = to_host(output, false);
  WorkHandle w = issue(in, out);
  if (!staged(output)) return std::make_shared<StagedWork>(w, Tensor(), Tensor(), in);
  return std::make_shared<StagedWork>(w, output, out, in);
}

WorkHandle StagedCommunicator::reduce_scatter_async(const Tensor& input, Tensor& output,
                                                    ReduceOp op) {
  return in_out(input, output, [&](const Tensor& in, Tensor& out) {
    return inner_->reduce_scatter_async(in, out, op);
  });
}

WorkHandle StagedCommunicator::all_gather_async(const Tensor& input, Tensor& output) {
  return in_out(input, output,
                [&](const Tensor& in, Tensor& out) { return inner_->all_gather_async(in, out); });
}

WorkHandle StagedCommunicator::broadcast_async(Tensor& tensor, int root) {
  if (!staged(tensor)) return inner_->broadcast_async(tensor, root);
  Tensor h = to_host(tensor, rank() == root);
  return std::make_shared<StagedWork>(inner_->broadcast_async(h, root), tensor, h);
}

WorkHandle StagedCommunicator::reduce_async(Tensor& tensor, int root, ReduceOp op) {
  if (!staged(tensor)) return inner_->reduce_async(tensor, root, op);
  Tensor h = to_host(tensor, true);
  WorkHandle w = inner_->reduce_async(h, root, op);
  // Only the root's tensor changes (the others' stay as they were: nothing to copy back).
  if (rank() != root) return std::make_shared<StagedWork>(w, Tensor(), Tensor(), h);
  return std::make_shared<StagedWork>(w, tensor, h);
}

WorkHandle StagedCommunicator::all_to_all_async(const Tensor& input, Tensor& output) {
  return in_out(input, output,
                [&](const Tensor& in, Tensor& out) { return inner_->all_to_all_async(in, out); });
}

WorkHandle StagedCommunicator::send_async(const Tensor& tensor, int dst, int tag) {
  if (!staged(tensor)) return inner_->send_async(tensor, dst, tag);
  Tensor h = to_host(tensor, true);
  return std::make_shared<StagedWork>(inner_->send_async(h, dst, tag), Tensor(), Tensor(), h);
}

WorkHandle StagedCommunicator::recv_async(Tensor& tensor, int src, int tag) {
  if (!staged(tensor)) return inner_->recv_async(tensor, src, tag);
  Tensor h = to_host(tensor, false);
  return std::make_shared<StagedWork>(inner_->recv_async(h, src, tag), tensor, h);
}

std::unique_ptr<Communicator> StagedCommunicator::split(int color, int key) {
  return std::make_unique<StagedCommunicator>(inner_->split(color, key), host_);
}

}  // namespace loom
