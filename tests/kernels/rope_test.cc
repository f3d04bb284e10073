#include "kernels/cpu/rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "base/error.h"
#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using ktest::convert;
using ktest::random_vector;

struct Heads {
  int64_t NH, KV;
};
// Grouped (two query heads per key/value head), multi-head (KV = NH) and multi-query (KV = 1).
constexpr Heads kHeadConfigs[] = {{4, 2}, {4, 4}, {4, 1}};

std::string name_of(Heads h) {
  return "NH=" + std::to_string(h.NH) + " KV=" + std::to_string(h.KV);
}

// HF transformers' Llama as written there: q·cos + rotate_half(q)·sin with cos, sin the table's
// halves repeated (cat(freqs, freqs)), rotate_half(x) = cat(−x[hd/2:], x[:hd/2]), and the key and
// value heads repeated for the query heads (repeat_kv: key head h / (NH/KV)).
std::vector<double> naive_rope_gqa(const std::vector<double>& qkv, const std::vector<double>& cs,
                                   int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  const int64_t half = hd / 2, n_rep = NH / KV, in_row = (NH + 2 * KV) * hd;
  std::vector<double> out(B * T * 3 * NH * hd);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const double* row = qkv.data() + (b * T + t) * in_row;
      double* o = out.data() + (b * T + t) * 3 * NH * hd;
      const auto rope = [&](const double* x, double* y) {
        for (int64_t d = 0; d < hd; ++d) {
          const double cos = cs[t * hd + d % half], sin = cs[t * hd + half + d % half];
          const double rotated = d < half ? -x[d + half] : x[d - half];
          y[d] = x[d] * cos + rotated * sin;
        }
      };
      for (int64_t h = 0; h < NH; ++h) {
        rope(row + h * hd, o + h * hd);
        rope(row + (NH + h / n_rep) * hd, o + (NH + h) * hd);
        for (int64_t d = 0; d < hd; ++d)
          o[(2 * NH + h) * hd + d] = row[(NH + KV + h / n_rep) * hd + d];
      }
    }
  return out;
}

TEST(Rope, TableHoldsTheCosinesThenTheSinesOfEachPosition) {
  const int64_t T = 3, hd = 4;
  std::vector<double> table(T * hd);
  rope_table(table.data(), T, hd, 10000.0);
  // t = 0: no rotation.
  EXPECT_EQ(table[0], 1.0);
  EXPECT_EQ(table[1], 1.0);
  EXPECT_EQ(table[2], 0.0);
  EXPECT_EQ(table[3], 0.0);
  // t = 2 with θ_0 = 1 and θ_1 = 10000^(−2/4) = 0.01: angles 2 and 0.02.
  EXPECT_NEAR(table[8], -0.4161468365471424, 1e-15);    // cos 2
  EXPECT_NEAR(table[9], 0.9998000066665778, 1e-15);     // cos 0.02
  EXPECT_NEAR(table[10], 0.9092974268256817, 1e-15);    // sin 2
  EXPECT_NEAR(table[11], 0.019998666693333080, 1e-15);  // sin 0.02
  // The float table is the double one rounded once.
  std::vector<float> table_f(T * hd);
  rope_table(table_f.data(), T, hd, 10000.0);
  for (int64_t i = 0; i < T * hd; ++i) EXPECT_EQ(table_f[i], static_cast<float>(table[i])) << i;
  // Llama 3's θ = 500000, a wider head: the last pair's frequency is θ^(−(hd − 2)/hd).
  const int64_t wide = 128;
  std::vector<double> llama3(2 * wide);
  rope_table(llama3.data(), 2, wide, 500000.0);
  const double last = std::pow(500000.0, -126.0 / 128.0);
  EXPECT_NEAR(llama3[wide + 63], std::cos(last), 1e-16);
  EXPECT_NEAR(llama3[wide + 64 + 63], std::sin(last), 1e-16);
}

TEST(Rope, ForwardMatchesNaive) {
  ThreadPool pool(3);
  const int64_t B = 2, T = 5, hd = 6;
  // A random table rather than rope_table's: every entry matters, none is 0 or 1, and cos and sin
  // swapped would show.
  const auto cs = random_vector(T * hd, 7);
  for (const Heads h : kHeadConfigs) {
    SCOPED_TRACE(name_of(h));
    const auto qkv = random_vector(B * T * (h.NH + 2 * h.KV) * hd, 8);
    std::vector<double> out = ktest::nan_vector(B * T * 3 * h.NH * hd);
    rope_gqa_forward(pool, out.data(), qkv.data(), cs.data(), B, T, h.NH, h.KV, hd);
    ktest::expect_close("out", out, naive_rope_gqa(qkv, cs, B, T, h.NH, h.KV, hd), 1e-15);
  }
}

TEST(Rope, BackwardMatchesFiniteDifferences) {
  ThreadPool pool(3);
  const int64_t B = 2, T = 3, hd = 4;
  std::vector<double> cs(T * hd);
  rope_table(cs.data(), T, hd, 10.0);  // a small θ: large angles at every position
  for (const Heads h : kHeadConfigs) {
    SCOPED_TRACE(name_of(h));
    auto qkv = random_vector(B * T * (h.NH + 2 * h.KV) * hd, 9);
    const auto R = random_vector(B * T * 3 * h.NH * hd, 10);
    auto loss = [&] {
      std::vector<double> out(B * T * 3 * h.NH * hd);
      rope_gqa_forward(pool, out.data(), qkv.data(), cs.data(), B, T, h.NH, h.KV, hd);
      return ktest::weighted_sum(out, R);
    };
    auto dqkv = ktest::nan_vector(qkv.size());
    rope_gqa_backward(pool, dqkv.data(), R.data(), cs.data(), B, T, h.NH, h.KV, hd);
    ktest::expect_gradient("dqkv", qkv, loss, dqkv);
  }
}

// Forward and backward in Real, out and dqkv in a row.
template <typename Real>
std::vector<Real> run_rope(ThreadPool& pool, int64_t B, int64_t T, int64_t NH, int64_t KV,
                           int64_t hd) {
  std::vector<Real> cs(T * hd);
  rope_table(cs.data(), T, hd, 10000.0);
  const auto qkv = convert<Real>(random_vector(B * T * (NH + 2 * KV) * hd, 11, -3, 3));
  const auto dout = convert<Real>(random_vector(B * T * 3 * NH * hd, 12));
  std::vector<Real> out(B * T * 3 * NH * hd), dqkv(qkv.size());
  rope_gqa_forward(pool, out.data(), qkv.data(), cs.data(), B, T, NH, KV, hd);
  rope_gqa_backward(pool, dqkv.data(), dout.data(), cs.data(), B, T, NH, KV, hd);
  out.insert(out.end(), dqkv.begin(), dqkv.end());
  return out;
}

TEST(Rope, FloatMatchesDoubleAndIsBitwiseSameForAnyPoolSize) {
  auto runs = ktest::expect_reproducible(
      "rope", [](ThreadPool& pool) { return run_rope<float>(pool, 3, 37, 8, 2, 16); });
  EXPECT_TRUE(ktest::bitwise_equal(runs[0], runs[1]));
  ThreadPool pool(2);
  ktest::expect_close("float vs double", runs[0], run_rope<double>(pool, 3, 37, 8, 2, 16), 1e-6);
}

TEST(Rope, RefusesHeadsItCannotShareOrRotate) {
  ThreadPool pool(1);
  std::vector<float> buf(1024), cs(64);
  const auto expect_refused = [&](int64_t NH, int64_t KV, int64_t hd, const std::string& needle) {
    try {
      rope_gqa_forward(pool, buf.data(), buf.data(), cs.data(), 1, 2, NH, KV, hd);
      ADD_FAILURE() << "accepted NH=" << NH << " KV=" << KV << " hd=" << hd;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_refused(4, 3, 8, "3 key/value heads do not divide 4 query heads");
  expect_refused(4, 2, 7, "head size 7 is not even");
}

// The rotation in place on the compact layout turns q and k as rope_gqa_forward does (with a key
// or value head per query head the layouts coincide), leaves v alone, and its backward is
// rope_gqa_backward's.
TEST(Rope, InPlaceRotationIsTheRepeatingOnesWithoutTheRepeat) {
  ThreadPool pool(3);
  const int64_t B = 2, T = 5, NH = 4, hd = 8, Q = 3 * NH * hd;
  std::vector<double> cs(T * hd);
  rope_table(cs.data(), T, hd, 10.0);
  const auto qkv = random_vector(B * T * Q, 7);
  std::vector<double> turned(B * T * Q), in_place = qkv;
  rope_gqa_forward(pool, turned.data(), qkv.data(), cs.data(), B, T, NH, NH, hd);
  rope_forward(pool, in_place.data(), cs.data(), B, T, NH, NH, hd);
  ktest::expect_close("forward", in_place, turned, 1e-15);
  std::vector<double> back(B * T * Q), back_in_place = qkv;
  rope_gqa_backward(pool, back.data(), qkv.data(), cs.data(), B, T, NH, NH, hd);
  rope_backward(pool, back_in_place.data(), cs.data(), B, T, NH, NH, hd);
  ktest::expect_close("backward", back_in_place, back, 1e-15);
  // Shared heads (KV = 2): q and k turned, v untouched, and turned back to the input.
  const int64_t KV = 2, W = (NH + 2 * KV) * hd;
  const auto compact = random_vector(B * T * W, 8);
  auto x = compact;
  rope_forward(pool, x.data(), cs.data(), B, T, NH, KV, hd);
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t c = (NH + KV) * hd; c < W; ++c) ASSERT_EQ(x[r * W + c], compact[r * W + c]);
  EXPECT_NE(x[W + 1], compact[W + 1]);  // row 1 (position 1): its first query head is turned
  rope_backward(pool, x.data(), cs.data(), B, T, NH, KV, hd);
  ktest::expect_close("round trip", x, compact, 1e-14);
}

}  // namespace
}  // namespace loom::cpu
