#include "layout/mesh_shape.h"

#include "base/error.h"

namespace loom {

MeshShape::MeshShape(std::vector<std::pair<std::string, int>> axes) : axes_(std::move(axes)) {
  if (axes_.empty()) fail("a device mesh needs at least one axis");
  for (size_t i = 0; i < axes_.size(); ++i) {
    const auto& [name, n] = axes_[i];
    if (name.empty()) fail("mesh axis ", i, " has an empty name");
    if (n < 1) fail("mesh axis '", name, "' has size ", n, " (must be >= 1)");
    for (size_t j = 0; j < i; ++j)
      if (axes_[j].first == name) fail("mesh axis '", name, "' appears twice");
  }
  strides_.assign(axes_.size(), 1);
  for (int a = ndim() - 2; a >= 0; --a) strides_[a] = strides_[a + 1] * axes_[a + 1].second;
  for (const auto& axis : axes_) size_ *= axis.second;
}

int MeshShape::axis_index(const std::string& name) const {
  for (int a = 0; a < ndim(); ++a)
    if (axes_[a].first == name) return a;
  fail("mesh ", str(), " has no axis '", name, "'");
}

std::vector<int> MeshShape::coords(int rank) const {
  if (rank < 0 || rank >= size_) fail("rank ", rank, " is outside mesh ", str(), " of ", size_, " ranks");
  std::vector<int> c(axes_.size());
  for (int a = 0; a < ndim(); ++a) c[a] = rank / strides_[a] % axes_[a].second;
  return c;
}

int MeshShape::rank_of(const std::vector<int>& coords) const {
  if (static_cast<int>(coords.size()) != ndim()) fail("mesh ", str(), ": expected ", ndim(), " coordinates");
  int rank = 0;
  for (int a = 0; a < ndim(); ++a) {
    if (coords[a] < 0 || coords[a] >= axes_[a].second)
      fail("mesh ", str(), ": coordinate ", coords[a], " out of range on axis '", axes_[a].first, "'");
    rank += coords[a] * strides_[a];
  }
  return rank;
}

std::vector<int> MeshShape::axis_group(int rank, int axis) const {
  std::vector<int> c = coords(rank);
  std::vector<int> group;
  for (int i = 0; i < axes_[axis].second; ++i) {
    c[axis] = i;
    group.push_back(rank_of(c));
  }
  return group;
}

int MeshShape::axis_group_id(int rank, int axis) const {
  std::vector<int> c = coords(rank);
  c[axis] = 0;
  return rank_of(c);  // the group's first rank identifies it
}

bool MeshShape::has_axis(const std::string& name) const {
  for (const auto& axis : axes_)
    if (axis.first == name) return true;
  return false;
}

std::string MeshShape::str() const {
  std::string s;
  for (int a = 0; a < ndim(); ++a)
    s += (a ? " x " : "") + axes_[a].first + "=" + std::to_string(axes_[a].second);
  return s;
}

MeshShape training_mesh_shape(int dp, int pp, int tp, int cp) {
  if (cp > 1) return MeshShape({{"pp", pp}, {"dp", dp}, {"cp", cp}, {"tp", tp}});
  return MeshShape({{"pp", pp}, {"dp", dp}, {"tp", tp}});
}

}  // namespace loom
