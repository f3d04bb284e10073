// Small host tensors for the communicator tests: made from values, read back as values, in any
// dtype.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/dtype.h"
#include "tensor/tensor.h"

namespace loom::testing {

inline Tensor filled(const std::vector<float>& values, Device device) {
  Tensor t = Tensor::empty({static_cast<int64_t>(values.size())}, DType::kF32, device);
  for (size_t i = 0; i < values.size(); ++i) t.data<float>()[i] = values[i];
  return t;
}

inline std::vector<float> values_of(const Tensor& t) {
  return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}

// Element i of host tensor t, of any dtype, set from or read as a double (the tests use small
// integers or values every dtype holds exactly).
inline void set_value(const Tensor& t, int64_t i, double v) {
  switch (t.dtype()) {
    case DType::kF32:
      t.data<float>()[i] = static_cast<float>(v);
      break;
    case DType::kF64:
      t.data<double>()[i] = v;
      break;
    case DType::kBF16:
      t.data_u16()[i] = float_to_bf16(static_cast<float>(v));
      break;
    case DType::kF16:
      t.data_u16()[i] = float_to_f16(static_cast<float>(v));
      break;
    case DType::kI32:
      t.data<int32_t>()[i] = static_cast<int32_t>(v);
      break;
    case DType::kI64:
      t.data<int64_t>()[i] = static_cast<int64_t>(v);
      break;
  }
}

inline double get_value(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kF32:
      return t.data<float>()[i];
    case DType::kF64:
      return t.data<double>()[i];
    case DType::kBF16:
      return bf16_to_float(t.data_u16()[i]);
    case DType::kF16:
      return f16_to_float(t.data_u16()[i]);
    case DType::kI32:
      return t.data<int32_t>()[i];
    case DType::kI64:
      return static_cast<double>(t.data<int64_t>()[i]);
  }
  return 0;
}

}  // namespace loom::testing
