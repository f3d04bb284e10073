// Element types and conversions. Compute is f32 (f64 for gradient checks); bf16 and f16 are
// storage types converted with round-to-nearest-even; i32/i64 hold token ids and counters.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace loom {

enum class DType { kF32, kF64, kBF16, kF16, kI32, kI64 };

size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);     // "f32", "bf16", ...
DType parse_dtype(std::string_view name);      // throws loom::Error naming the text
bool is_floating(DType dtype);

template <typename T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::kF32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::kF64; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::kI32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::kI64; };

inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// bf16: the top 16 bits of an f32, rounded to nearest even; NaN stays NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// IEEE half precision, round to nearest even, with subnormals, infinities and NaN.
uint16_t float_to_f16(float f);
float f16_to_float(uint16_t h);

}  // namespace loom
