// Region — where a local tensor sits inside its global (unsharded) tensor: the global shape and
// the offset of the local block along each dim. Pure arithmetic, shared by initialisation,
// sharding and checkpoint resharding. The whole tensor is Region::whole(shape).
#pragma once

#include <cstdint>
#include <vector>

namespace loom {

struct Region {
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offset;  // same rank as global_shape

  static Region whole(const std::vector<int64_t>& shape) {
    return {shape, std::vector<int64_t>(shape.size(), 0)};
  }
  // The block [start, start + length) of dim `dim`, everything of the other dims.
  static Region slice(const std::vector<int64_t>& shape, int dim, int64_t start) {
    Region r = whole(shape);
    r.offset[dim] = start;
    return r;
  }
};

}  // namespace loom
