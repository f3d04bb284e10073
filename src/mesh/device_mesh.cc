#include "mesh/device_mesh.h"

#include "base/error.h"

namespace loom {

DeviceMesh::DeviceMesh(Communicator& world, MeshShape shape)
    : world_(world), shape_(std::move(shape)), rank_(world.rank()) {
  if (world.size() != shape_.size())
    fail("device mesh ", shape_.str(), " needs ", shape_.size(), " ranks, the job has ",
         world.size());
  coords_ = shape_.coords(rank_);
  for (int a = 0; a < shape_.ndim(); ++a) {
    // Same color = same group along axis a; key = the coordinate on a, so group rank == coord.
    axis_comms_.push_back(world.split(shape_.axis_group_id(rank_, a), coords_[a]));
  }
}

}  // namespace loom
