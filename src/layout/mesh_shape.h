// MeshShape — the pure arithmetic of a device mesh: named axes with sizes, the last axis
// innermost (consecutive ranks), e.g. {dp: 2, pp: 2, tp: 2} puts tp groups on neighbouring ranks,
// the fastest links of one node. Shared by the runtime mesh (mesh/device_mesh.h) and the planner.
//
// "axis" is a mesh axis; "dim" is a tensor dimension.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace loom {

class MeshShape {
 public:
  // Axis names must be unique and non-empty, sizes >= 1; throws loom::Error naming the axis.
  explicit MeshShape(std::vector<std::pair<std::string, int>> axes);

  int ndim() const { return static_cast<int>(axes_.size()); }
  int size() const { return size_; }  // total ranks
  const std::string& axis_name(int axis) const { return axes_[axis].first; }
  int axis_size(int axis) const { return axes_[axis].second; }
  int axis_index(const std::string& name) const;  // throws naming the axis and the known ones
  bool has_axis(const std::string& name) const;
  int axis_size(const std::string& name) const { return axis_size(axis_index(name)); }

  std::vector<int> coords(int rank) const;        // rank -> coordinate per axis
  int rank_of(const std::vector<int>& coords) const;
  // The ranks that share every coordinate with `rank` except along `axis`, ordered by that axis:
  // `rank`'s group along the axis.
  std::vector<int> axis_group(int rank, int axis) const;
  // A number identifying `rank`'s group along `axis` (equal for ranks of the same group), usable
  // as a split color.
  int axis_group_id(int rank, int axis) const;
  std::string str() const;  // "dp=2 x pp=2 x tp=2"

 private:
  std::vector<std::pair<std::string, int>> axes_;
  std::vector<int> strides_;
  int size_ = 1;
};

// The training mesh: pp × dp × tp — tp innermost (neighbouring ranks: its per-layer collectives
// get the fastest links), then dp, pp outermost (only activations cross it), as Megatron-LM
// orders them. With context parallelism (cp > 1) a cp axis between dp and tp: pp × dp × cp × tp
// (its all-gathers, once per layer, next to tp's).
MeshShape training_mesh_shape(int dp, int pp, int tp, int cp = 1);

}  // namespace loom
