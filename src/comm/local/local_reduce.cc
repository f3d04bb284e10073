// Reductions and chunking for the local backend (see local_reduce.h).
#include "comm/local/local_reduce.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace loom::local {
namespace {

template <typename T>
struct PlainCodec {
  using S = T;
  using Acc = T;
  static Acc load(S v) { return v; }
  static S store(Acc a) { return a; }
};
struct Bf16Codec {
  using S = uint16_t;
  using Acc = float;
  static Acc load(S v) { return bf16_to_float(v); }
  static S store(Acc a) { return float_to_bf16(a); }
};
struct F16Codec {
  using S = uint16_t;
  using Acc = float;
  static Acc load(S v) { return f16_to_float(v); }
  static S store(Acc a) { return float_to_f16(a); }
};

template <typename A>
A add(A a, A b) {
  if constexpr (std::is_integral_v<A>) {  // wrap instead of signed overflow
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}

// outs[k][i] = op over r in 0..n-1 of ins[r][i], for i in [0, count), in blocks that stay in L1.
template <typename C>
void reduce_blocks(ReduceOp op, const std::vector<const std::byte*>& ins,
                   const std::vector<std::byte*>& outs, int64_t count) {
  using S = typename C::S;
  using Acc = typename C::Acc;
  constexpr int64_t kBlock = 2048;
  Acc acc[kBlock];
  const int n = static_cast<int>(ins.size());
  for (int64_t b = 0; b < count; b += kBlock) {
    const int64_t len = std::min(kBlock, count - b);
    const S* in0 = reinterpret_cast<const S*>(ins[0]) + b;
    for (int64_t i = 0; i < len; ++i) acc[i] = C::load(in0[i]);
    for (int r = 1; r < n; ++r) {
      const S* in = reinterpret_cast<const S*>(ins[r]) + b;
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kAvg:
          for (int64_t i = 0; i < len; ++i) acc[i] = add<Acc>(acc[i], C::load(in[i]));
          break;
        case ReduceOp::kMax:
          for (int64_t i = 0; i < len; ++i) {
            Acc v = C::load(in[i]);
            acc[i] = v > acc[i] ? v : acc[i];
          }
          break;
        case ReduceOp::kMin:
          for (int64_t i = 0; i < len; ++i) {
            Acc v = C::load(in[i]);
            acc[i] = v < acc[i] ? v : acc[i];
          }
          break;
      }
    }
    if (op == ReduceOp::kAvg) {
      const Acc divisor = static_cast<Acc>(n);
      for (int64_t i = 0; i < len; ++i) acc[i] = acc[i] / divisor;
    }
    for (std::byte* out_bytes : outs) {
      S* out = reinterpret_cast<S*>(out_bytes) + b;
      for (int64_t i = 0; i < len; ++i) out[i] = C::store(acc[i]);
    }
  }
}

}  // namespace

void reduce_buffers(DType dtype, ReduceOp op, const std::vector<const std::byte*>& ins,
                    const std::vector<std::byte*>& outs, int64_t count) {
  if (count == 0) return;
  // A group of one reducing in place: every op is the identity (avg divides by 1 exactly), so
  // skip the read and write of the whole buffer.
  if (ins.size() == 1 && outs.size() == 1 && outs[0] == ins[0]) return;
  switch (dtype) {
    case DType::kF32:
      return reduce_blocks<PlainCodec<float>>(op, ins, outs, count);
    case DType::kF64:
      return reduce_blocks<PlainCodec<double>>(op, ins, outs, count);
    case DType::kBF16:
      return reduce_blocks<Bf16Codec>(op, ins, outs, count);
    case DType::kF16:
      return reduce_blocks<F16Codec>(op, ins, outs, count);
    case DType::kI32:
      return reduce_blocks<PlainCodec<int32_t>>(op, ins, outs, count);
    case DType::kI64:
      return reduce_blocks<PlainCodec<int64_t>>(op, ins, outs, count);
  }
}

// Chunk r of n elements split over `parts` ranks, boundaries on 64-byte multiples so that two
// ranks never write the same cache line.
std::pair<int64_t, int64_t> chunk_range(int64_t n, size_t elem, int parts, int r) {
  const int64_t unit = std::max<int64_t>(1, 64 / static_cast<int64_t>(elem));
  const int64_t units = (n + unit - 1) / unit;
  const int64_t per = units / parts, rem = units % parts;
  auto start = [&](int i) { return std::min(n, (i * per + std::min<int64_t>(i, rem)) * unit); };
  return {start(r), start(r + 1)};
}

void copy_bytes(std::byte* dst, const std::byte* src, size_t bytes) {
  if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
}

}  // namespace loom::local
