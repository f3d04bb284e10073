#include "comm/directed_p2p.h"

#include "base/error.h"

namespace loom {

DirectedP2pCommunicator::DirectedP2pCommunicator(Communicator& base)
    : ForwardingCommunicator(base),
      up_(base.split(0, base.rank())),
      down_(base.split(0, base.rank())) {
  if (!up_ || !down_) fail("DirectedP2pCommunicator: splitting '", base.name(), "' failed");
}

// A message to oneself stays on the base, whose backends handle it without the network.
WorkHandle DirectedP2pCommunicator::send_async(const Tensor& tensor, int dst, int tag) {
  if (dst == rank()) return inner().send_async(tensor, dst, tag);
  return (dst > rank() ? up_ : down_)->send_async(tensor, dst, tag);
}

WorkHandle DirectedP2pCommunicator::recv_async(Tensor& tensor, int src, int tag) {
  if (src == rank()) return inner().recv_async(tensor, src, tag);
  return (src < rank() ? up_ : down_)->recv_async(tensor, src, tag);
}

}  // namespace loom
