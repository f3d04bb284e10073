#include "tensor/rng.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "base/error.h"

namespace loom {
namespace {
constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;

inline void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

// 24 random bits -> [0, 1): exactly representable in f32.
inline float to_unit(uint32_t x) { return static_cast<float>(x >> 8) * (1.0f / 16777216.0f); }
}  // namespace

PhiloxCounter philox4x32(PhiloxCounter c, PhiloxKey k) {
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMul0, c[0], hi0, lo0);
    mulhilo(kMul1, c[2], hi1, lo1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
    k[0] += kWeyl0;
    k[1] += kWeyl1;
  }
  return c;
}

PhiloxKey philox_key(uint64_t seed, std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64
  for (unsigned char ch : name) {
    h ^= ch;
    h *= 0x100000001b3ull;
  }
  // splitmix64 finaliser over (hash, seed), so nearby seeds give unrelated keys.
  uint64_t z = h ^ (seed + 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return {static_cast<uint32_t>(z), static_cast<uint32_t>(z >> 32)};
}

float uniform_at(PhiloxKey key, uint64_t index) {
  const PhiloxCounter r =
      philox4x32({static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32), 0, 0}, key);
  return to_unit(r[0]);
}

float normal_at(PhiloxKey key, uint64_t index) {
  // Box-Muller on the first two words; computed in double so the value does not depend on the
  // compiler's choice of float transcendental implementation.
  const PhiloxCounter r =
      philox4x32({static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32), 0, 0}, key);
  const double u1 = (static_cast<double>(r[0]) + 1.0) / 4294967297.0;  // (0, 1)
  const double u2 = static_cast<double>(r[1]) / 4294967296.0;            // [0, 1)
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

void init_normal(Tensor& local, uint64_t seed, std::string_view name, float mean, float std,
                 const Region& region) {
  const int nd = local.ndim();
  if (static_cast<int>(region.global_shape.size()) != nd ||
      static_cast<int>(region.offset.size()) != nd)
    fail("init '", name, "': region rank does not match local shape ", shape_str(local.shape()));
  for (int d = 0; d < nd; ++d)
    if (region.offset[d] < 0 || region.offset[d] + local.dim(d) > region.global_shape[d])
      fail("init '", name, "': local block ", shape_str(local.shape()), " at offset ",
           shape_str(region.offset), " does not fit in ", shape_str(region.global_shape));
  if (!local.device().is_cpu()) fail("init '", name, "': initialise on the host, then copy");
  if (local.dtype() != DType::kF32 && local.dtype() != DType::kF64)
    fail("init '", name, "': dtype ", dtype_name(local.dtype()), " (init into f32 and convert)");
  const PhiloxKey key = philox_key(seed, name);
  // Global row-major strides.
  std::vector<int64_t> gstride(nd, 1);
  for (int d = nd - 2; d >= 0; --d) gstride[d] = gstride[d + 1] * region.global_shape[d + 1];
  // Elements [i0, i1) of the local block, in row-major order. Each value depends only on its
  // global index, so any split of the block gives the same bits.
  auto fill = [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> idx(nd, 0);
    for (int64_t d = nd - 1, rest = i0; d >= 0; --d) {
      idx[d] = rest % local.dim(static_cast<int>(d));
      rest /= local.dim(static_cast<int>(d));
    }
    for (int64_t i = i0; i < i1; ++i) {
      int64_t g = 0;
      for (int d = 0; d < nd; ++d) g += (region.offset[d] + idx[d]) * gstride[d];
      const double v = static_cast<double>(mean) + static_cast<double>(std) * normal_at(key, g);
      if (local.dtype() == DType::kF32) {
        local.data<float>()[i] = static_cast<float>(v);
      } else {
        local.data<double>()[i] = v;
      }
      for (int d = nd - 1; d >= 0; --d) {
        if (++idx[d] < local.dim(d)) break;
        idx[d] = 0;
      }
    }
  };
  // ~60 ns an element (Philox + Box-Muller in double): a 124M-parameter model took 8 s on one
  // core. Large blocks are split over the machine's cores; this runs once, at start-up, before
  // any rank's thread pool is busy.
  constexpr int64_t kPerThread = int64_t{1} << 20;
  const int64_t n = local.numel();
  const int64_t threads = std::min<int64_t>(
      std::max(1u, std::thread::hardware_concurrency()), (n + kPerThread - 1) / kPerThread);
  if (threads <= 1) {
    fill(0, n);
    return;
  }
  std::vector<std::thread> workers;
  for (int64_t t = 1; t < threads; ++t)
    workers.emplace_back(fill, n * t / threads, n * (t + 1) / threads);
  fill(0, n / threads);
  for (std::thread& w : workers) w.join();
}

void init_constant(Tensor& t, double value) {
  if (t.dtype() == DType::kF32) {
    float* p = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(value);
  } else if (t.dtype() == DType::kF64) {
    double* p = t.data<double>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = value;
  } else {
    fail("init_constant: dtype ", dtype_name(t.dtype()));
  }
}

uint32_t RandomStream::next_u32() {
  const uint64_t block = position_ / 4;
  const PhiloxCounter r =
      philox4x32({static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 1, 0}, key_);
  return r[position_++ % 4];
}

float RandomStream::next_uniform() { return to_unit(next_u32()); }

}  // namespace loom
