// DirectedP2pCommunicator — point-to-point messages over one communicator per direction, for
// backends whose sends block until received and whose operations run in issue order (nccl): a
// message to a higher rank goes over `up`, one to a lower rank over `down`, everything else
// (collectives, split) over the wrapped communicator. With two neighbouring pipeline stages that
// send to each other before receiving (1F1B's steady state), one shared communicator would deadlock
// (each send waits for a receive queued behind the other's send); with one per direction, the
// activations flowing to later stages and the gradients flowing back never queue behind each other.
// What it is for: the pipeline axis on GPUs under nccl (train/trainer.cc), GPU to GPU instead of
// through the host.
#pragma once

#include <memory>

#include "comm/forwarding.h"

namespace loom {

class DirectedP2pCommunicator final : public ForwardingCommunicator {
 public:
  // Wraps `base` (not owned; it must outlive this) and splits the two directions' communicators
  // from it: collective over base's ranks, like any split.
  explicit DirectedP2pCommunicator(Communicator& base);

  WorkHandle send_async(const Tensor& tensor, int dst, int tag) override;
  WorkHandle recv_async(Tensor& tensor, int src, int tag) override;
  // The send and the receive each over its direction's communicator (Communicator's default,
  // not the base's pairing: a ring step's two messages go different ways).
  WorkHandle send_recv_async(const Tensor& to_send, int dst, Tensor& into, int src,
                             int tag) override {
    return Communicator::send_recv_async(to_send, dst, into, src, tag);
  }
  void check() override {
    inner().check();
    up_->check();
    down_->check();
  }
  double take_device_wait_seconds() override {
    return inner().take_device_wait_seconds() + up_->take_device_wait_seconds() +
           down_->take_device_wait_seconds();
  }
  void on_device_wait(std::function<void(double, double)> observer) override {
    inner().on_device_wait(observer);
    up_->on_device_wait(observer);
    down_->on_device_wait(std::move(observer));
  }

 private:
  std::unique_ptr<Communicator> up_, down_;  // messages to higher ranks / to lower ranks
};

}  // namespace loom
