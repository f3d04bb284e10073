// DeviceMesh — the ranks of a job arranged on named axes (e.g. dp × pp × tp, tp innermost), with
// one communicator per axis for this rank. Built collectively from the world communicator by
// splitting it once per axis; passed explicitly to whoever needs it (no globals).
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "layout/mesh_shape.h"

namespace loom {

class DeviceMesh {
 public:
  // Collective over `world`; world.size() must equal shape.size() (an error naming both).
  DeviceMesh(Communicator& world, MeshShape shape);

  const MeshShape& shape() const { return shape_; }
  int rank() const { return rank_; }
  const std::vector<int>& coords() const { return coords_; }
  int coord(const std::string& axis) const { return coords_[shape_.axis_index(axis)]; }
  Communicator& world() { return world_; }
  // This rank's group along an axis; its rank in the group equals its coordinate on the axis.
  Communicator& axis(const std::string& name) { return *axis_comms_[shape_.axis_index(name)]; }

 private:
  Communicator& world_;
  MeshShape shape_;
  int rank_;
  std::vector<int> coords_;
  std::vector<std::unique_ptr<Communicator>> axis_comms_;
};

}  // namespace loom
