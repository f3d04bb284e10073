#include "kernels/cpu/embedding.h"

#include <gtest/gtest.h>

#include "base/error.h"
#include "kernel_test_util.h"
#include "kernels/cpu/vocab_shard.h"

namespace loom::cpu {
namespace {

using ktest::convert;
using ktest::random_vector;

// Tokens with repeats (several rows update the same dwte row) and both ends of the vocabulary.
std::vector<int32_t> make_tokens(int64_t n, int64_t V) {
  std::vector<int32_t> tokens(n);
  for (int64_t i = 0; i < n; ++i) tokens[i] = static_cast<int32_t>((i * 7 + i / 3) % V);
  tokens[0] = 0;
  tokens[n - 1] = static_cast<int32_t>(V - 1);
  return tokens;
}

TEST(Embedding, ForwardMatchesNaive) {
  ThreadPool pool(3);
  const int64_t B = 2, T = 5, C = 8, V = 11, maxT = 7;
  const auto tokens = make_tokens(B * T, V);
  const auto wte = random_vector(V * C, 1), wpe = random_vector(maxT * C, 2);
  std::vector<double> out(B * T * C);
  embedding_forward(pool, out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, V);
  std::vector<double> expected(B * T * C);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c)
        expected[(b * T + t) * C + c] = wte[tokens[b * T + t] * C + c] + wpe[t * C + c];
  EXPECT_EQ(out, expected);  // one addition per element: exact
}

TEST(Embedding, BackwardMatchesFiniteDifferences) {
  ThreadPool pool(3);
  const int64_t B = 2, T = 5, C = 8, V = 11, maxT = 7;
  const auto tokens = make_tokens(B * T, V);
  auto wte = random_vector(V * C, 1), wpe = random_vector(maxT * C, 2);
  const auto R = random_vector(B * T * C, 3);
  auto loss = [&] {
    std::vector<double> out(B * T * C);
    embedding_forward(pool, out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, V);
    return ktest::weighted_sum(out, R);
  };
  const auto dwte0 = random_vector(V * C, 4), dwpe0 = random_vector(maxT * C, 5);
  auto dwte = dwte0, dwpe = dwpe0;
  embedding_backward(pool, dwte.data(), dwpe.data(), R.data(), tokens.data(), B, T, C);
  for (size_t i = 0; i < dwte.size(); ++i) dwte[i] -= dwte0[i];
  for (size_t i = 0; i < dwpe.size(); ++i) dwpe[i] -= dwpe0[i];
  ktest::expect_gradient("dwte", wte, loss, dwte);
  ktest::expect_gradient("dwpe", wpe, loss, dwpe);  // rows T..maxT-1 must stay untouched
}

// Without a position table (wpe and dwpe null: Llama's positions enter in the attention): the
// token rows alone, and dwte exactly what it is with one.
TEST(Embedding, WithoutAPositionTableIsTheTokenRows) {
  ThreadPool pool(3);
  const int64_t B = 2, T = 5, C = 8, V = 11;
  const auto tokens = make_tokens(B * T, V);
  const auto wte = ktest::convert<float>(random_vector(V * C, 1));
  const auto wpe = ktest::convert<float>(random_vector(T * C, 2));
  std::vector<float> out(B * T * C, -1.0f);
  embedding_forward<float>(pool, out.data(), tokens.data(), wte.data(), nullptr, B, T, C, V);
  std::vector<float> expected(B * T * C);
  for (int64_t i = 0; i < B * T; ++i)
    for (int64_t c = 0; c < C; ++c) expected[i * C + c] = wte[tokens[i] * C + c];
  EXPECT_EQ(out, expected);

  const auto dout = ktest::convert<float>(random_vector(B * T * C, 3));
  const auto dwte0 = ktest::convert<float>(random_vector(V * C, 4));
  std::vector<float> without = dwte0, with = dwte0, dwpe(T * C, 0.0f);
  embedding_backward<float>(pool, without.data(), nullptr, dout.data(), tokens.data(), B, T, C);
  embedding_backward<float>(pool, with.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  EXPECT_EQ(without, with);
  EXPECT_NE(without, dwte0);

  // The vocabulary-parallel twin: a null table adds nothing even where add_positions says so.
  const VocabShard shard{3, 6, 7, V};
  std::vector<float> shard_out(B * T * C, -1.0f), shard_plain(B * T * C, -2.0f);
  vocab_shard_embedding_forward(pool, shard_out.data(), tokens.data(), wte.data(), nullptr, B * T,
                                T, C, shard, true);
  vocab_shard_embedding_forward(pool, shard_plain.data(), tokens.data(), wte.data(), wpe.data(),
                                B * T, T, C, shard, false);
  EXPECT_EQ(shard_out, shard_plain);
  std::vector<float> shard_without(shard.rows * C, 0.5f), shard_with = shard_without;
  std::vector<float> shard_dwpe(T * C, 0.0f);
  vocab_shard_embedding_backward(pool, shard_without.data(), nullptr, dout.data(), tokens.data(),
                                 B * T, T, C, shard);
  vocab_shard_embedding_backward(pool, shard_with.data(), shard_dwpe.data(), dout.data(),
                                 tokens.data(), B * T, T, C, shard);
  EXPECT_EQ(shard_without, shard_with);
  EXPECT_NE(shard_dwpe, std::vector<float>(T * C, 0.0f)) << "the table's gradient, with one";
}

// Positions reset at each document (data.reset_position_ids): each position's place in its
// document, of the whole sequence or of the positions a context-parallel shard holds.
TEST(Embedding, DocumentPositionsRestartAtEachDocument) {
  ThreadPool pool(2);
  const int64_t B = 2, T = 7;
  const std::vector<int32_t> starts = {0, 0, 0, 3, 3, 5, 5,   // row 0: documents at 0, 3, 5
                                       0, 1, 2, 2, 2, 2, 2};  // row 1: at 0, 1, 2
  std::vector<int32_t> ids(B * T, -1);
  document_positions(pool, ids.data(), starts.data(), nullptr, B, T, T);
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 2, 0, 1, 0, 1, 0, 0, 0, 1, 2, 3, 4}));
  const std::vector<int32_t> global = {1, 5, 6, 0};  // a shard's positions, in its order
  std::vector<int32_t> shard(B * 4, -1);
  document_positions(pool, shard.data(), starts.data(), global.data(), B, 4, T);
  EXPECT_EQ(shard, (std::vector<int32_t>{1, 0, 1, 0, 0, 3, 4, 0}));
}

// add_rows_by_id adds each token's row of the table; embedding_backward with the ids as tokens
// (and no position table) is its gradient. With ids = each token's position, the two are bit for
// bit the embedding's own position path, forward and backward.
TEST(Embedding, RowsByIdAreThePositionRowsAndTheirGradient) {
  ThreadPool pool(3);
  const int64_t B = 2, T = 5, C = 8, V = 11, maxT = 7;
  const auto tokens = make_tokens(B * T, V);
  const std::vector<int32_t> ids = {0, 1, 0, 1, 2, 3, 0, 1, 2, 3};
  auto wte = random_vector(V * C, 1), wpe = random_vector(maxT * C, 2);
  const auto R = random_vector(B * T * C, 3);
  auto forward = [&] {
    std::vector<double> out(B * T * C);
    embedding_forward<double>(pool, out.data(), tokens.data(), wte.data(), nullptr, B, T, C, V);
    add_rows_by_id(pool, out.data(), wpe.data(), ids.data(), B * T, C);
    return out;
  };
  const std::vector<double> out = forward();
  for (int64_t i = 0; i < B * T; ++i)
    for (int64_t c = 0; c < C; ++c)
      ASSERT_EQ(out[i * C + c], wte[tokens[i] * C + c] + wpe[ids[i] * C + c]) << i << ", " << c;
  const auto dwpe0 = random_vector(maxT * C, 5);
  auto dwpe = dwpe0;
  embedding_backward<double>(pool, dwpe.data(), nullptr, R.data(), ids.data(), 1, B * T, C);
  for (size_t i = 0; i < dwpe.size(); ++i) dwpe[i] -= dwpe0[i];
  ktest::expect_gradient(
      "dwpe", wpe, [&] { return ktest::weighted_sum(forward(), R); }, dwpe);

  // ids = position t of each row: the embedding's own forward and backward, bit for bit.
  const auto wte_f = convert<float>(wte), wpe_f = convert<float>(wpe), R_f = convert<float>(R);
  std::vector<int32_t> positions(B * T);
  for (int64_t i = 0; i < B * T; ++i) positions[i] = static_cast<int32_t>(i % T);
  std::vector<float> by_id(B * T * C), table(B * T * C);
  embedding_forward<float>(pool, by_id.data(), tokens.data(), wte_f.data(), nullptr, B, T, C, V);
  add_rows_by_id<float>(pool, by_id.data(), wpe_f.data(), positions.data(), B * T, C);
  embedding_forward<float>(pool, table.data(), tokens.data(), wte_f.data(), wpe_f.data(), B, T, C,
                           V);
  EXPECT_EQ(by_id, table);
  const auto d0 = convert<float>(random_vector(maxT * C, 6));
  std::vector<float> dwte(V * C, 0.0f), d_table = d0, d_by_id = d0;
  embedding_backward<float>(pool, dwte.data(), d_table.data(), R_f.data(), tokens.data(), B, T, C);
  embedding_backward<float>(pool, d_by_id.data(), nullptr, R_f.data(), positions.data(), 1, B * T,
                            C);
  EXPECT_EQ(d_by_id, d_table);
}

TEST(Embedding, BadTokenThrowsNamingIt) {
  ThreadPool pool(2);
  const int64_t B = 2, T = 3, C = 4, V = 11;
  const auto wte = random_vector(V * C, 1), wpe = random_vector(T * C, 2);
  std::vector<double> out(B * T * C);
  for (int32_t bad : {11, -1}) {
    std::vector<int32_t> tokens(B * T, 3);
    tokens[4] = bad;  // batch 1, position 1
    try {
      embedding_forward(pool, out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, V);
      ADD_FAILURE() << "token " << bad << " accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("token id " + std::to_string(bad)), std::string::npos) << msg;
      EXPECT_NE(msg.find("batch 1, position 1"), std::string::npos) << msg;
      EXPECT_NE(msg.find("[0, 11)"), std::string::npos) << msg;
    }
  }
}

TEST(Embedding, FloatMatchesDoubleAndIsBitwiseSameForAnyPoolSize) {
  const int64_t B = 4, T = 16, C = 64, V = 9, maxT = 16;  // 64 channels: 3 slices on 3 threads
  const auto tokens = make_tokens(B * T, V);
  const auto wte = random_vector(V * C, 1), wpe = random_vector(maxT * C, 2);
  const auto dout = random_vector(B * T * C, 3);
  auto run = [&](ThreadPool& pool, auto zero) {
    using Real = decltype(zero);
    const auto wte_r = convert<Real>(wte), wpe_r = convert<Real>(wpe), dout_r = convert<Real>(dout);
    std::vector<Real> out(B * T * C), dwte(V * C, 0), dwpe(maxT * C, 0);
    embedding_forward(pool, out.data(), tokens.data(), wte_r.data(), wpe_r.data(), B, T, C, V);
    embedding_backward(pool, dwte.data(), dwpe.data(), dout_r.data(), tokens.data(), B, T, C);
    out.insert(out.end(), dwte.begin(), dwte.end());
    out.insert(out.end(), dwpe.begin(), dwpe.end());
    return out;
  };
  auto runs =
      ktest::expect_reproducible("embedding", [&](ThreadPool& pool) { return run(pool, 0.f); });
  EXPECT_TRUE(ktest::bitwise_equal(runs[0], runs[1]));
  ThreadPool pool(2);
  ktest::expect_close("float vs double", runs[0], run(pool, 0.0), 1e-6);
}

}  // namespace
}  // namespace loom::cpu
