#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_cache.h"
#include "kernels/cpu/rope.h"

#include <gtest/gtest.h>

#include "kernel_test_util.h"

namespace loom::cpu {
namespace {

using ktest::convert;
using ktest::random_vector;

struct Shape {
  int64_t B, T, C, NH;
};

std::string describe(const Shape& s) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " C=" + std::to_string(s.C) +
         " NH=" + std::to_string(s.NH);
}

// Textbook attention: materialises each head's full T×T score matrix.
void naive_attention(const std::vector<double>& qkv, const Shape& s, std::vector<double>& out,
                     std::vector<double>& lse) {
  const int64_t hd = s.C / s.NH, C3 = 3 * s.C;
  const double scale = 1 / std::sqrt(double(hd));
  out.assign(s.B * s.T * s.C, 0.0);
  lse.assign(s.B * s.NH * s.T, 0.0);
  std::vector<double> S(s.T * s.T);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.NH; ++h) {
      const double* q = qkv.data() + b * s.T * C3 + h * hd;
      const double* k = q + s.C;
      const double* v = q + 2 * s.C;
      for (int64_t i = 0; i < s.T; ++i) {
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d) dot += q[i * C3 + d] * k[j * C3 + d];
          S[i * s.T + j] = dot * scale;
          mx = std::max(mx, S[i * s.T + j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(S[i * s.T + j] - mx);
        lse[(b * s.NH + h) * s.T + i] = mx + std::log(sum);
        for (int64_t j = 0; j <= i; ++j) {
          const double p = std::exp(S[i * s.T + j] - mx) / sum;
          for (int64_t d = 0; d < hd; ++d)
            out[(b * s.T + i) * s.C + h * hd + d] += p * v[j * C3 + d];
        }
      }
    }
}

TEST(Attention, ForwardMatchesNaive) {
  ThreadPool pool(3);
  // T = 70 and 129 end in a partial row block (kAttentionRowBlock = 64); 64 fills one exactly.
  static_assert(kAttentionRowBlock == 64, "update the shapes below");
  for (Shape s :
       {Shape{2, 5, 8, 2}, Shape{1, 70, 8, 2}, Shape{1, 64, 12, 3}, Shape{2, 129, 8, 1}}) {
    for (double magnitude : {1.0, 30.0}) {  // 30: scores in the hundreds test the max shift
      const auto qkv = random_vector(s.B * s.T * 3 * s.C, 1, -magnitude, magnitude);
      std::vector<double> out = ktest::nan_vector(s.B * s.T * s.C);
      std::vector<double> lse = ktest::nan_vector(s.B * s.NH * s.T);
      attention_forward(pool, out.data(), lse.data(), qkv.data(), s.B, s.T, s.C, s.NH);
      std::vector<double> expected_out, expected_lse;
      naive_attention(qkv, s, expected_out, expected_lse);
      const std::string what = describe(s) + " magnitude=" + std::to_string(magnitude);
      ktest::expect_close("out " + what, out, expected_out, 1e-12);
      ktest::expect_close("lse " + what, lse, expected_lse, 1e-12);
    }
  }
}

// dqkv by backward, after a forward on the same qkv.
std::vector<double> attention_grad(ThreadPool& pool, const std::vector<double>& qkv,
                                   const std::vector<double>& dout, const Shape& s) {
  std::vector<double> out(s.B * s.T * s.C), lse(s.B * s.NH * s.T);
  attention_forward(pool, out.data(), lse.data(), qkv.data(), s.B, s.T, s.C, s.NH);
  auto dqkv = ktest::nan_vector(qkv.size());  // overwritten: no NaN may survive
  attention_backward(pool, dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T,
                     s.C, s.NH);
  return dqkv;
}

TEST(Attention, BackwardMatchesFiniteDifferences) {
  ThreadPool pool(3);
  // The second shape crosses a row block; checking every 7th input keeps the test fast.
  for (const auto& [shape, stride] :
       {std::pair{Shape{2, 5, 8, 2}, 1}, std::pair{Shape{1, 70, 8, 2}, 7}}) {
    const Shape s = shape;  // a plain variable, as lambdas may not capture structured bindings
    auto qkv = random_vector(s.B * s.T * 3 * s.C, 1, -2, 2);
    const auto R = random_vector(s.B * s.T * s.C, 2);
    auto loss = [&] {
      std::vector<double> out(s.B * s.T * s.C), lse(s.B * s.NH * s.T);
      attention_forward(pool, out.data(), lse.data(), qkv.data(), s.B, s.T, s.C, s.NH);
      return ktest::weighted_sum(out, R);
    };
    const auto dqkv = attention_grad(pool, qkv, R, s);
    ktest::expect_gradient("dqkv " + describe(s), qkv, loss, dqkv, stride);
  }
}

// out, lse and dqkv of one forward/backward in Real, in a row.
template <typename Real>
std::vector<Real> run_attention(ThreadPool& pool, const Shape& s) {
  const auto qkv = convert<Real>(random_vector(s.B * s.T * 3 * s.C, 1, -2, 2));
  const auto dout = convert<Real>(random_vector(s.B * s.T * s.C, 2));
  std::vector<Real> out(s.B * s.T * s.C), lse(s.B * s.NH * s.T), dqkv(qkv.size());
  attention_forward(pool, out.data(), lse.data(), qkv.data(), s.B, s.T, s.C, s.NH);
  attention_backward(pool, dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), s.B, s.T,
                     s.C, s.NH);
  out.insert(out.end(), lse.begin(), lse.end());
  out.insert(out.end(), dqkv.begin(), dqkv.end());
  return out;
}

TEST(Attention, FloatMatchesDouble) {
  ThreadPool pool(2);
  const Shape s{2, 70, 16, 2};
  ktest::expect_close("all outputs", run_attention<float>(pool, s), run_attention<double>(pool, s),
                      1e-5);
}

TEST(Attention, BitwiseSameForAnyPoolSize) {
  const Shape s{2, 70, 32, 4};
  auto runs = ktest::expect_reproducible(
      "attention", [&](ThreadPool& pool) { return run_attention<float>(pool, s); });
  EXPECT_TRUE(ktest::bitwise_equal(runs[0], runs[1]));
}

// Attention over a key/value cache (sampling): the rows first .. first+n−1 of a T-token
// sequence, their keys and values in the cache with the earlier ones', give the whole sequence's
// attention output on those rows; the same bits on 1 and 3 threads.
TEST(AttentionWithCache, NewRowsAreTheWholeSequencesRows) {
  const Shape s{1, 11, 12, 3};
  const auto qkv = random_vector(s.T * 3 * s.C, 3, -2, 2);
  std::vector<double> want, lse;
  naive_attention(qkv, s, want, lse);
  std::vector<double> k(s.T * s.C), v(s.T * s.C);
  for (int64_t t = 0; t < s.T; ++t)
    for (int64_t c = 0; c < s.C; ++c) {
      k[t * s.C + c] = qkv[t * 3 * s.C + s.C + c];
      v[t * s.C + c] = qkv[t * 3 * s.C + 2 * s.C + c];
    }
  for (const auto& [first, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 11}, {0, 1}, {4, 3}, {10, 1}}) {
    SCOPED_TRACE("first " + std::to_string(first) + ", n " + std::to_string(n));
    std::vector<std::vector<double>> runs;
    for (int threads : {1, 3}) {
      ThreadPool pool(threads);
      std::vector<double> out(n * s.C);
      attention_with_cache(pool, out.data(), qkv.data() + first * 3 * s.C, 3 * s.C, k.data(),
                           v.data(), first, n, s.C, s.NH);
      runs.push_back(out);
    }
    const std::vector<double> rows(want.begin() + first * s.C, want.begin() + (first + n) * s.C);
    ktest::expect_close("out", runs[0], rows, 1e-12);
    EXPECT_TRUE(ktest::bitwise_equal(runs[0], runs[1]));
  }
}

// Grouped-query attention reading the shared heads in place equals repeating them (rope_gqa_*
// with the identity rotation: cos 1, sin 0) into the 3C layout and running the plain kernels —
// the forward to the last bits, the backward's shared-head sums in the same ascending order.
TEST(AttentionGqa, SharedHeadsReadInPlaceEqualRepeatedHeads) {
  ThreadPool pool(3);
  const int64_t B = 2, T = 70, NH = 4, hd = 6;  // 70 rows: two row blocks, the last partial
  for (const int64_t KV : {2, 1, 4}) {
    SCOPED_TRACE("KV " + std::to_string(KV));
    const int64_t Q = (NH + 2 * KV) * hd, C = NH * hd;
    const auto qkv = random_vector(B * T * Q, 5, -2, 2);
    const auto dout = random_vector(B * T * C, 6);
    std::vector<double> identity(T * hd, 0.0);
    for (int64_t t = 0; t < T; ++t) std::fill(identity.begin() + t * hd, identity.begin() + t * hd + hd / 2, 1.0);
    std::vector<double> wide(B * T * 3 * C), out_ref(B * T * C), lse_ref(B * NH * T);
    rope_gqa_forward(pool, wide.data(), qkv.data(), identity.data(), B, T, NH, KV, hd);
    attention_forward(pool, out_ref.data(), lse_ref.data(), wide.data(), B, T, C, NH);
    std::vector<double> dwide(B * T * 3 * C), dqkv_ref(B * T * Q);
    attention_backward(pool, dwide.data(), dout.data(), wide.data(), out_ref.data(), lse_ref.data(),
                       B, T, C, NH);
    rope_gqa_backward(pool, dqkv_ref.data(), dwide.data(), identity.data(), B, T, NH, KV, hd);

    std::vector<double> out(B * T * C), lse(B * NH * T);
    attention_gqa_forward(pool, out.data(), lse.data(), qkv.data(), B, T, NH, KV, hd);
    ktest::expect_close("out", out, out_ref, 1e-13);
    ktest::expect_close("lse", lse, lse_ref, 1e-13);
    auto dqkv = ktest::nan_vector(B * T * Q);  // every element written
    attention_gqa_backward(pool, dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B,
                           T, NH, KV, hd);
    ktest::expect_close("dqkv", dqkv, dqkv_ref, 1e-12);
    ThreadPool one(1);
    auto again = dqkv;
    attention_gqa_backward(one, again.data(), dout.data(), qkv.data(), out.data(), lse.data(), B,
                           T, NH, KV, hd);
    EXPECT_TRUE(ktest::bitwise_equal(dqkv, again));
  }
}

// Document masking: with the starts of documents in each sequence, every document's rows of the
// attention, its lse and its rows of dqkv are those of the causal attention of that document as
// a sequence of its own — nothing crosses a document's edge, either way. Documents of 1 token,
// of more than a 64-row block, starting mid-block and at a block's first row; a sequence of one
// document is the causal attention; float and double; any pool size gives the same bits.
TEST(AttentionDocuments, EachDocumentAttendsAsItsOwnSequence) {
  ThreadPool pool(3);
  const int64_t B = 3, T = 150, NH = 4, KV = 2, hd = 6;
  const int64_t W = (NH + 2 * KV) * hd, C = NH * hd;
  // Each sequence's document starts (after position 0).
  const std::vector<std::vector<int64_t>> cuts = {{1, 2, 40, 64, 65, 140}, {}, {75, 149}};
  std::vector<int32_t> starts(B * T);
  for (int64_t b = 0; b < B; ++b) {
    int32_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t c : cuts[b])
        if (c == t) start = static_cast<int32_t>(t);
      starts[b * T + t] = start;
    }
  }
  const DocumentStarts docs{starts.data(), T};
  const auto qkv = random_vector(B * T * W, 11, -2, 2);
  const auto dout = random_vector(B * T * C, 12);
  std::vector<double> out(B * T * C), lse(B * NH * T);
  attention_gqa_forward(pool, out.data(), lse.data(), qkv.data(), B, T, NH, KV, hd, docs);
  auto dqkv = ktest::nan_vector(B * T * W);
  attention_gqa_backward(pool, dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T,
                         NH, KV, hd, docs);
  int checked = 0;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> edges = {0};
    edges.insert(edges.end(), cuts[b].begin(), cuts[b].end());
    edges.push_back(T);
    for (size_t d = 0; d + 1 < edges.size(); ++d) {
      const int64_t s0 = edges[d], n = edges[d + 1] - s0;
      SCOPED_TRACE("sequence " + std::to_string(b) + " document at " + std::to_string(s0));
      // The document alone: its rows of qkv and dout as a sequence of n.
      const std::vector<double> q1(qkv.begin() + (b * T + s0) * W,
                                   qkv.begin() + (b * T + s0 + n) * W);
      const std::vector<double> dy1(dout.begin() + (b * T + s0) * C,
                                    dout.begin() + (b * T + s0 + n) * C);
      std::vector<double> o1(n * C), l1(NH * n), dq1(n * W);
      attention_gqa_forward(pool, o1.data(), l1.data(), q1.data(), 1, n, NH, KV, hd);
      attention_gqa_backward(pool, dq1.data(), dy1.data(), q1.data(), o1.data(), l1.data(), 1, n,
                             NH, KV, hd);
      ktest::expect_close(
          "out",
          std::vector<double>(out.begin() + (b * T + s0) * C, out.begin() + (b * T + s0 + n) * C),
          o1, 1e-12);
      for (int64_t h = 0; h < NH; ++h)
        ktest::expect_close("lse",
                            std::vector<double>(lse.begin() + (b * NH + h) * T + s0,
                                                lse.begin() + (b * NH + h) * T + s0 + n),
                            std::vector<double>(l1.begin() + h * n, l1.begin() + (h + 1) * n),
                            1e-12);
      ktest::expect_close(
          "dqkv",
          std::vector<double>(dqkv.begin() + (b * T + s0) * W, dqkv.begin() + (b * T + s0 + n) * W),
          dq1, 1e-11);
      ++checked;
    }
  }
  EXPECT_EQ(checked, 7 + 1 + 3);
  // Without a cut the masked attention is the causal one (sequence 1 above checks its values);
  // float agrees with double and the pool size changes no bit.
  const auto run_float = [&](ThreadPool& p) {
    const std::vector<float> q = convert<float>(qkv), dy = convert<float>(dout);
    std::vector<float> o(B * T * C), l(B * NH * T), dq(B * T * W);
    attention_gqa_forward(p, o.data(), l.data(), q.data(), B, T, NH, KV, hd, docs);
    attention_gqa_backward(p, dq.data(), dy.data(), q.data(), o.data(), l.data(), B, T, NH, KV, hd,
                           docs);
    o.insert(o.end(), dq.begin(), dq.end());
    return o;
  };
  std::vector<double> both = out;
  both.insert(both.end(), dqkv.begin(), dqkv.end());
  auto runs = ktest::expect_reproducible("documents", run_float);
  ktest::expect_close("float vs double", runs[0], both, 1e-4);
  EXPECT_TRUE(ktest::bitwise_equal(runs[0], runs[1])) << "1 thread vs 3";
}

}  // namespace
}  // namespace loom::cpu
