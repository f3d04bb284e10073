// Runs a generic lambda with the C++ scalar type of a compute dtype: f32 in training, f64 in
// gradient checks. Usage: dispatch_float(t.dtype(), [&](auto zero) { using T = decltype(zero); ... });
#pragma once

#include "base/error.h"
#include "tensor/dtype.h"

namespace loom {

template <typename F>
decltype(auto) dispatch_float(DType dtype, F&& fn) {
  switch (dtype) {
    case DType::kF32: return fn(float{});
    case DType::kF64: return fn(double{});
    default: break;
  }
  fail("compute dtype ", dtype_name(dtype), " is not supported here (f32 or f64)");
}

}  // namespace loom
