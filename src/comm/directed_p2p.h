// DirectedP2pCommunicator — point-to-point messages over one communicator per direction, for
// backends whose sends block until received and whose operations run in issue order (nccl): a
// message to a higher rank goes over `up`, one to a lower rank over `down`, everything else over
// the wrapped communicator. With two neighbouring pipeline stages that send to each other before
// receiving (1F1B's steady state), one shared communicator would deadlock (each send waits for a
// receive queued behind the other's send); with one per direction, the activations flowing to
// later stages and the gradients flowing back never queue behind each other. What it is for: the
// pipeline axis on GPUs under nccl (train/trainer.cc), GPU to GPU instead of through the host.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace loom {

class DirectedP2pCommunicator final : public Communicator {
 public:
  // Wraps `base` (not owned; it must outlive this) and splits the two directions' communicators
  // from it: collective over base's ranks, like any split.
  explicit DirectedP2pCommunicator(Communicator& base);

  int rank() const override { return base_.rank(); }
  int size() const override { return base_.size(); }
  std::string name() const override { return base_.name(); }
  std::string backend() const override { return base_.backend(); }
  Device tensor_device() const override { return base_.tensor_device(); }

  WorkHandle all_reduce_async(Tensor& tensor, ReduceOp op) override {
    return base_.all_reduce_async(tensor, op);
  }
  WorkHandle reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) override {
    return base_.reduce_scatter_async(input, output, op);
  }
  WorkHandle all_gather_async(const Tensor& input, Tensor& output) override {
    return base_.all_gather_async(input, output);
  }
  WorkHandle broadcast_async(Tensor& tensor, int root) override {
    return base_.broadcast_async(tensor, root);
  }
  WorkHandle reduce_async(Tensor& tensor, int root, ReduceOp op) override {
    return base_.reduce_async(tensor, root, op);
  }
  WorkHandle all_to_all_async(const Tensor& input, Tensor& output) override {
    return base_.all_to_all_async(input, output);
  }
  WorkHandle barrier_async() override { return base_.barrier_async(); }
  WorkHandle send_async(const Tensor& tensor, int dst, int tag) override;
  WorkHandle recv_async(Tensor& tensor, int src, int tag) override;
  // A plain sub-communicator of the base (collectives only need one).
  std::unique_ptr<Communicator> split(int color, int key) override {
    return base_.split(color, key);
  }
  void check() override {
    base_.check();
    up_->check();
    down_->check();
  }
  double take_device_wait_seconds() override {
    return base_.take_device_wait_seconds() + up_->take_device_wait_seconds() +
           down_->take_device_wait_seconds();
  }
  void on_device_wait(std::function<void(double, double)> observer) override {
    base_.on_device_wait(observer);
    up_->on_device_wait(observer);
    down_->on_device_wait(std::move(observer));
  }

 private:
  Communicator& base_;
  std::unique_ptr<Communicator> up_, down_;  // messages to higher ranks / to lower ranks
};

}  // namespace loom
