// Shared helpers for the CPU kernel tests: random data, a central finite-difference gradient
// check, and comparisons between float and double runs or between repeated runs.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "base/thread_pool.h"

namespace loom::cpu::ktest {

inline std::vector<double> random_vector(int64_t n, uint64_t seed, double lo = -1.0,
                                         double hi = 1.0) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = dist(gen);
  return v;
}

inline std::vector<double> nan_vector(int64_t n) {
  return std::vector<double>(n, std::numeric_limits<double>::quiet_NaN());
}

template <typename To, typename From>
std::vector<To> convert(const std::vector<From>& v) {
  return std::vector<To>(v.begin(), v.end());
}

// Σ out·R: a scalar loss whose gradient with respect to out is R.
inline double weighted_sum(const std::vector<double>& out, const std::vector<double>& R) {
  double s = 0;
  for (size_t i = 0; i < out.size(); ++i) s += out[i] * R[i];
  return s;
}

// Checks grad[i] against (loss(x + h e_i) - loss(x - h e_i)) / 2h for every stride-th i; loss()
// must read x. Double precision makes the truncation (~h²) and rounding (~1e-16/h) errors both
// far below the tolerance.
inline void expect_gradient(const std::string& what, std::vector<double>& x,
                            const std::function<double()>& loss, const std::vector<double>& grad,
                            int64_t stride = 1, double rtol = 1e-6, double atol = 1e-8) {
  ASSERT_EQ(x.size(), grad.size()) << what;
  constexpr double h = 1e-6;
  int failures = 0;
  for (size_t i = 0; i < x.size(); i += stride) {
    const double saved = x[i];
    x[i] = saved + h;
    const double up = loss();
    x[i] = saved - h;
    const double down = loss();
    x[i] = saved;
    const double numeric = (up - down) / (2 * h);
    if (!(std::abs(numeric - grad[i]) <= rtol * std::abs(numeric) + atol) && ++failures <= 5)
      ADD_FAILURE() << what << "[" << i << "]: analytic " << grad[i] << ", numeric " << numeric;
  }
}

// |actual - expected| <= tol · max(1, max|expected|) elementwise, i.e. relative to the scale of
// the tensor, which is what float rounding errors follow.
// C = alpha·op(A)·op(B) + beta·C, one dot product per element in double; op(X) = Xᵀ when t_x.
// beta == 0 ignores C's old contents (NaN included), as BLAS does.
template <typename Real, typename CReal>
void naive_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const Real* A,
                int64_t lda, const Real* B, int64_t ldb, double beta, CReal* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k)
        acc += double(ta ? A[k * lda + i] : A[i * lda + k]) *
               double(tb ? B[j * ldb + k] : B[k * ldb + j]);
      const double old = beta == 0 ? 0.0 : beta * double(C[i * ldc + j]);
      C[i * ldc + j] = static_cast<CReal>(alpha * acc + old);
    }
}

template <typename A, typename E>
void expect_close(const std::string& what, const std::vector<A>& actual,
                  const std::vector<E>& expected, double tol) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  double scale = 1;
  for (E e : expected) scale = std::max(scale, std::abs(static_cast<double>(e)));
  int failures = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double a = static_cast<double>(actual[i]), e = static_cast<double>(expected[i]);
    if (!(std::abs(a - e) <= tol * scale) && ++failures <= 5)
      ADD_FAILURE() << what << "[" << i << "]: " << a << " vs " << e << " (tol " << tol * scale
                    << ")";
  }
}

template <typename Real>
bool bitwise_equal(const std::vector<Real>& a, const std::vector<Real>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(Real)) == 0;
}

// Runs run(pool) twice on a 1-thread and on a 3-thread pool; each must reproduce itself bitwise.
// Returns the first result of each pool size, for comparisons across sizes.
template <typename Fn>
auto expect_reproducible(const std::string& what, const Fn& run) {
  using Result = decltype(run(std::declval<ThreadPool&>()));
  std::vector<Result> by_size;
  for (int threads : {1, 3}) {
    ThreadPool pool(threads);
    Result first = run(pool);
    Result second = run(pool);
    EXPECT_TRUE(bitwise_equal(first, second)) << what << ", " << threads << " threads";
    by_size.push_back(std::move(first));
  }
  return by_size;
}

}  // namespace loom::cpu::ktest
