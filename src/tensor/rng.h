// Counter-based random numbers (Philox4x32-10, Salmon et al., "Parallel random numbers: as easy
// as 1, 2, 3", SC 2011).
//
// A parameter's element value depends only on (seed, parameter name, global element index):
// the key is derived from (seed, name) and the counter is the element's index in the full,
// unsharded tensor. A shard therefore initialises to exactly the slice of the full tensor,
// whatever the layout, and no rank ever generates numbers it does not keep.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "layout/region.h"
#include "tensor/tensor.h"

namespace loom {

using PhiloxKey = std::array<uint32_t, 2>;
using PhiloxCounter = std::array<uint32_t, 4>;

// Ten rounds of Philox4x32 on `counter` under `key`.
PhiloxCounter philox4x32(PhiloxCounter counter, PhiloxKey key);

// Key of a named stream: a 64-bit hash (FNV-1a, then a mix) of the name, combined with the seed.
PhiloxKey philox_key(uint64_t seed, std::string_view name);

// The i-th standard normal / uniform [0,1) of a stream; pure functions of (key, i).
float normal_at(PhiloxKey key, uint64_t index);
float uniform_at(PhiloxKey key, uint64_t index);

// Fills `local` (f32 or f64, host), which holds `region` of a tensor named `name`, with
// N(mean, std²) values: element (i0, i1, ...) of the local tensor gets normal_at(key, g) where g
// is the row-major index of (offset0 + i0, offset1 + i1, ...) in region.global_shape.
void init_normal(Tensor& local, uint64_t seed, std::string_view name, float mean, float std,
                 const Region& region);
inline void init_normal(Tensor& whole, uint64_t seed, std::string_view name, float mean,
                        float std) {
  init_normal(whole, seed, name, mean, std, Region::whole(whole.shape()));
}
void init_constant(Tensor& t, double value);

// A sequential stream for sampling and synthetic data; its whole state is (key, position), so
// it can be saved in a checkpoint and resumed exactly.
class RandomStream {
 public:
  RandomStream(uint64_t seed, std::string_view name) : key_(philox_key(seed, name)) {}
  uint32_t next_u32();
  float next_uniform();  // [0, 1)
  uint64_t position() const { return position_; }
  void set_position(uint64_t position) { position_ = position; }

 private:
  PhiloxKey key_;
  uint64_t position_ = 0;  // number of u32 drawn
};

}  // namespace loom
