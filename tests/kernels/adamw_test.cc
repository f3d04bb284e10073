#include "kernels/cpu/adamw.h"

#include <gtest/gtest.h>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using ktest::convert;
using ktest::random_vector;

constexpr double kLr = 1e-2, kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8, kWeightDecay = 0.1;

// The update as written in Loshchilov & Hutter (Algorithm 2) with PyTorch's placement of eps.
void reference_step(std::vector<double>& p, const std::vector<double>& g, std::vector<double>& m,
                    std::vector<double>& v, int64_t step) {
  for (size_t i = 0; i < p.size(); ++i) {
    p[i] *= 1 - kLr * kWeightDecay;
    m[i] = kBeta1 * m[i] + (1 - kBeta1) * g[i];
    v[i] = kBeta2 * v[i] + (1 - kBeta2) * g[i] * g[i];
    const double m_hat = m[i] / (1 - std::pow(kBeta1, step));
    const double v_hat = v[i] / (1 - std::pow(kBeta2, step));
    p[i] -= kLr * m_hat / (std::sqrt(v_hat) + kEps);
  }
}

TEST(AdamW, FirstStepMovesEachParameterByLrTimesSign) {
  // At step 1 the bias corrections make m̂ = g and v̂ = g², so the step is lr·g/(|g| + eps).
  ThreadPool pool(1);
  std::vector<double> p{1.0, -2.0, 0.5}, g{0.3, -4.0, 1e-3}, m(3, 0.0), v(3, 0.0);
  adamw_update(pool, p.data(), g.data(), m.data(), v.data(), 3, kLr, kBeta1, kBeta2, kEps,
               kWeightDecay, 1);
  const double decay = 1 - kLr * kWeightDecay;
  EXPECT_NEAR(p[0], 1.0 * decay - kLr * 0.3 / (0.3 + kEps), 1e-15);
  EXPECT_NEAR(p[1], -2.0 * decay + kLr * 4.0 / (4.0 + kEps), 1e-15);
  EXPECT_NEAR(p[2], 0.5 * decay - kLr * 1e-3 / (1e-3 + kEps), 1e-15);
  EXPECT_NEAR(m[1], -0.4, 1e-15);
  EXPECT_NEAR(v[1], 0.8, 1e-15);
}

TEST(AdamW, SeveralStepsMatchReference) {
  const int64_t n = 40000;  // several parallel ranges
  auto p = random_vector(n, 1);
  std::vector<double> m(n, 0.0), v(n, 0.0);
  auto p_ref = p, m_ref = m, v_ref = v;
  auto p_f = convert<float>(p), m_f = convert<float>(m), v_f = convert<float>(v);
  ThreadPool pool(3);
  for (int64_t step = 1; step <= 5; ++step) {
    const auto g = random_vector(n, 100 + step, -3, 3);
    const auto g_f = convert<float>(g);
    adamw_update(pool, p.data(), g.data(), m.data(), v.data(), n, kLr, kBeta1, kBeta2, kEps,
                 kWeightDecay, step);
    adamw_update(pool, p_f.data(), g_f.data(), m_f.data(), v_f.data(), n, kLr, kBeta1, kBeta2, kEps,
                 kWeightDecay, step);
    reference_step(p_ref, g, m_ref, v_ref, step);
    const std::string at = " after step " + std::to_string(step);
    ktest::expect_close("param" + at, p, p_ref, 1e-13);
    ktest::expect_close("m" + at, m, m_ref, 1e-13);
    ktest::expect_close("v" + at, v, v_ref, 1e-13);
    ktest::expect_close("float param" + at, p_f, p_ref, 1e-6);
  }
}

TEST(AdamW, FloatBitsDoNotDependOnTheSplitOrTheVectorPath) {
  // One call over n elements (8-wide AVX2 body where built, scalar tail) against one call per
  // element (scalar path only) and a 3-thread pool: the same bits everywhere.
  const int64_t n = 40003;
  auto p = convert<float>(random_vector(n, 7)), m = convert<float>(random_vector(n, 8, -0.1, 0.1));
  auto v = convert<float>(random_vector(n, 9, 0, 0.01));
  const auto g = convert<float>(random_vector(n, 10, -3, 3));
  auto p1 = p, m1 = m, v1 = v, p3 = p, m3 = m, v3 = v;
  ThreadPool one(1), three(3);
  adamw_update(one, p1.data(), g.data(), m1.data(), v1.data(), n, kLr, kBeta1, kBeta2, kEps,
               kWeightDecay, 4);
  adamw_update(three, p3.data(), g.data(), m3.data(), v3.data(), n, kLr, kBeta1, kBeta2, kEps,
               kWeightDecay, 4);
  for (int64_t i = 0; i < n; ++i)
    adamw_update(one, &p[i], &g[i], &m[i], &v[i], 1, kLr, kBeta1, kBeta2, kEps, kWeightDecay, 4);
  EXPECT_EQ(p1, p);
  EXPECT_EQ(m1, m);
  EXPECT_EQ(v1, v);
  EXPECT_EQ(p3, p);
  EXPECT_EQ(m3, m);
  EXPECT_EQ(v3, v);
}

TEST(AdamW, GradScaleEqualsScalingTheGradientsFirst) {
  // Clipping folds its factor into the update: the result must be bitwise what scaling the
  // stored gradients and then updating gives.
  const int64_t n = 1000;
  auto p = convert<float>(random_vector(n, 11)), m = convert<float>(random_vector(n, 12, -0.1, 0.1));
  auto v = convert<float>(random_vector(n, 13, 0, 0.01));
  auto g = convert<float>(random_vector(n, 14, -3, 3));
  const float coef = 0.37f;
  auto ps = p, ms = m, vs = v;
  ThreadPool pool(2);
  adamw_update(pool, ps.data(), g.data(), ms.data(), vs.data(), n, kLr, kBeta1, kBeta2, kEps,
               kWeightDecay, 2, coef);
  for (float& x : g) x *= coef;
  adamw_update(pool, p.data(), g.data(), m.data(), v.data(), n, kLr, kBeta1, kBeta2, kEps,
               kWeightDecay, 2);
  EXPECT_EQ(ps, p);
  EXPECT_EQ(ms, m);
  EXPECT_EQ(vs, v);
  EXPECT_NE(ps[0], convert<float>(random_vector(n, 11))[0]) << "the update moved nothing";
}

}  // namespace
}  // namespace loom::cpu
