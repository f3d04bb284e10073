// Double-precision finite-difference checks for modules: L = Σ y ∘ R for a fixed random R, so
// dL/dy = R; the analytic gradients from backward(R) are compared with central differences
// (L(θ + h) − L(θ − h)) / 2h on every parameter element and every input element.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "nn/parameter.h"
#include "tensor/rng.h"

namespace loom::testing {

inline Tensor random_f64(const Shape& shape, const std::string& name, double std = 1.0) {
  Tensor t = Tensor::empty(shape, DType::kF64);
  init_normal(t, 99, name, 0.0f, static_cast<float>(std));
  return t;
}

inline double dot(const Tensor& a, const Tensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.data<double>()[i] * b.data<double>()[i];
  return s;
}

inline void expect_close(double analytic, double numeric, const std::string& what) {
  const double tol = 1e-6 * std::max(1.0, std::abs(numeric)) + 1e-8;
  EXPECT_NEAR(analytic, numeric, tol) << what;
}

// forward(): runs the module and returns the scalar loss Σ y ∘ R, leaving caches for backward.
// backward(): runs backward with dy = R and returns dL/dx (or an undefined tensor if the input is
// not differentiable, e.g. token ids). clear(): drops caches after a finite-difference probe.
struct GradCheck {
  std::function<double()> forward;
  std::function<Tensor()> backward;
  std::function<void()> clear;
  double h = 1e-6;

  void run(ParameterStore& store, Tensor* input) {
    store.zero_grads();
    forward();
    Tensor dx = backward();
    auto probe = [&](double* p, double analytic, const std::string& what) {
      const double saved = *p;
      *p = saved + h;
      const double lp = forward();
      clear();
      *p = saved - h;
      const double lm = forward();
      clear();
      *p = saved;
      expect_close(analytic, (lp - lm) / (2 * h), what);
    };
    for (const auto& param : store.parameters()) {
      double* v = param->value.data<double>();
      const double* g = param->grad.data<double>();
      for (int64_t i = 0; i < param->numel(); ++i)
        probe(v + i, g[i], param->name + "[" + std::to_string(i) + "]");
    }
    if (input != nullptr) {
      ASSERT_TRUE(dx.defined());
      ASSERT_EQ(dx.shape(), input->shape());
      for (int64_t i = 0; i < input->numel(); ++i)
        probe(input->data<double>() + i, dx.data<double>()[i], "input[" + std::to_string(i) + "]");
    }
  }
};

}  // namespace loom::testing
