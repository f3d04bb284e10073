// Pipeline schedules as data: every generated schedule is deadlock-free and complete (and takes
// each neighbour's messages in the order they were sent, as nccl needs), 1F1B bounds the
// micro-batches in flight, the unit-time bubble matches the formula, and malformed
// schedules or arguments are errors that name the culprit.
#include "parallel/pipeline_schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "base/error.h"
#include "parallel/pipeline_parallel.h"
#include "harness/error_of.h"

namespace loom {
namespace {

using testutil::error_of;

using K = PipeActionKind;

// Every allowed (schedule, pp, m, v) of the test grid.
std::vector<std::tuple<std::string, int, int, int>> grid() {
  std::vector<std::tuple<std::string, int, int, int>> out;
  for (int pp : {1, 2, 4}) {
    for (int m = 1; m <= 9; ++m) {
      out.emplace_back("gpipe", pp, m, 1);
      out.emplace_back("1f1b", pp, m, 1);
      out.emplace_back("zb-h1", pp, m, 1);
      if (m % pp == 0)
        for (int v : {1, 2, 3}) {
          out.emplace_back("interleaved", pp, m, v);
          out.emplace_back("zb-interleaved", pp, m, v);
        }
      out.emplace_back("zb-v", pp, m, 2);
    }
  }
  return out;
}

// The most micro-batches (chunk activations with v > 1) a rank holds: forwards done minus
// backwards (or their input halves) done, maximised over its action list. `until` = the action
// that ends a micro-batch's stay: kBackwardWeight counts those whose weight gradients wait too.
int peak_in_flight(const std::vector<PipeAction>& actions, K until = K::kBackward) {
  int live = 0, peak = 0;
  for (const PipeAction& a : actions) {
    if (a.kind == K::kForward) peak = std::max(peak, ++live);
    if (a.kind == until || (until == K::kBackward && a.kind == K::kBackwardInput)) --live;
  }
  return peak;
}

// The most micro-batches whose W waits after their B on one rank.
int peak_deferred(const std::vector<PipeAction>& actions) {
  int live = 0, peak = 0;
  for (const PipeAction& a : actions) {
    if (a.kind == K::kBackwardInput) peak = std::max(peak, ++live);
    if (a.kind == K::kBackwardWeight) --live;
  }
  return peak;
}

struct Timeline {
  std::vector<int> columns;  // [rank] cells in its row
  double simulated = -1, theory = -1;
};

Timeline parse(const std::string& text) {
  Timeline t;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("rank ", 0) == 0) {
      std::istringstream row(line.substr(line.find('|') + 1));
      int n = 0;
      for (std::string cell; row >> cell;) ++n;
      t.columns.push_back(n);
    } else if (line.rfind("bubble (simulated): ", 0) == 0) {
      t.simulated = std::stod(line.substr(line.rfind(' ') + 1));
    } else if (line.rfind("bubble (theory", 0) == 0) {
      t.theory = std::stod(line.substr(line.rfind(' ') + 1));
    }
  }
  return t;
}

TEST(PipelineSchedule, EveryGeneratedSchedulePassesTheCheck) {
  for (const auto& [name, pp, m, v] : grid()) {
    SCOPED_TRACE(name + " pp " + std::to_string(pp) + " m " + std::to_string(m) + " v " + std::to_string(v));
    const PipelineSchedule s = make_schedule(name, pp, m, v);
    ASSERT_EQ(s.actions.size(), static_cast<size_t>(pp));
    EXPECT_NO_THROW(check_schedule(s));
    for (int r = 0; r < pp; ++r) {
      // Per (micro-batch, chunk): forward + backward (zb-h1: its two halves), plus a receive
      // and a send in each direction except at the ends of the model.
      const size_t computes = name.rfind("zb-", 0) == 0 ? 3 : 2;
      size_t expected = 0;
      for (int c = 0; c < v; ++c) {
        const int stage = s.stage_of(r, c);
        expected += static_cast<size_t>(m) *
                    (computes + (stage > 0 ? 2 : 0) + (stage < s.stages() - 1 ? 2 : 0));
      }
      EXPECT_EQ(s.actions[r].size(), expected) << "rank " << r;
    }
  }
}

TEST(PipelineSchedule, CommunicationSitsNextToItsCompute) {
  const PipelineSchedule s = make_schedule("1f1b", 4, 8);
  EXPECT_EQ(s.actions[0].front(), (PipeAction{K::kForward, 0, 0}));  // stage 0: no RecvForward
  EXPECT_EQ(s.actions[0].back(), (PipeAction{K::kBackward, 7, 0}));  // nor SendBackward
  EXPECT_EQ(s.actions[3][0], (PipeAction{K::kRecvForward, 0, 0}));
  EXPECT_EQ(s.actions[3][1], (PipeAction{K::kForward, 0, 0}));
  EXPECT_EQ(s.actions[3][2], (PipeAction{K::kBackward, 0, 0}));  // last stage: loss, no recv
  EXPECT_EQ(s.actions[3][3], (PipeAction{K::kSendBackward, 0, 0}));
  for (const auto& acts : s.actions)
    for (size_t i = 0; i < acts.size(); ++i) {
      const K k = acts[i].kind;
      if (k == K::kRecvForward || k == K::kRecvBackward) {
        EXPECT_EQ(acts[i + 1].kind, k == K::kRecvForward ? K::kForward : K::kBackward);
      }
      if (k == K::kSendForward || k == K::kSendBackward) {
        EXPECT_EQ(acts[i - 1].kind, k == K::kSendForward ? K::kForward : K::kBackward);
      }
    }
}

TEST(PipelineSchedule, OneFOneBBoundsMicroBatchesInFlight) {
  for (int pp : {1, 2, 4})
    for (int m = 1; m <= 9; ++m) {
      const PipelineSchedule f = make_schedule("1f1b", pp, m);
      const PipelineSchedule g = make_schedule("gpipe", pp, m);
      for (int r = 0; r < pp; ++r) {
        EXPECT_EQ(peak_in_flight(f.actions[r]), std::min(pp - r, m)) << "pp " << pp << " m " << m << " rank " << r;
        EXPECT_EQ(peak_in_flight(g.actions[r]), m) << "pp " << pp << " m " << m << " rank " << r;
      }
    }
}

TEST(PipelineSchedule, ZeroBubbleKeepsOneFOneBsOrderAndMemory) {
  for (int pp : {1, 2, 4})
    for (int m = 1; m <= 9; ++m) {
      SCOPED_TRACE("pp " + std::to_string(pp) + " m " + std::to_string(m));
      const PipelineSchedule z = make_schedule("zb-h1", pp, m);
      const PipelineSchedule f = make_schedule("1f1b", pp, m);
      for (int r = 0; r < pp; ++r) {
        // Forwards and input-gradient backwards in 1F1B's order: the same warm-up, the same
        // pp − r micro-batches at most between F and B.
        std::vector<PipeAction> zb_order, one_order;
        for (PipeAction a : z.actions[r]) {
          if (a.kind == K::kBackwardWeight) continue;
          if (a.kind == K::kBackwardInput) a.kind = K::kBackward;
          zb_order.push_back(a);
        }
        for (const PipeAction& a : f.actions[r]) one_order.push_back(a);
        EXPECT_EQ(zb_order, one_order) << "rank " << r;
        EXPECT_EQ(peak_in_flight(z.actions[r]), std::min(pp - r, m)) << "rank " << r;
        // W trails B by r micro-batches (none on the first rank), and no rank holds more than
        // pp micro-batches between F and W: 1F1B's first-rank peak.
        EXPECT_EQ(peak_deferred(z.actions[r]), std::min(r, m) + (r < m ? 1 : 0)) << "rank " << r;
        EXPECT_LE(peak_in_flight(z.actions[r], K::kBackwardWeight), std::min(pp, m))
            << "rank " << r;
        // W's come in micro-batch order: the weight gradients accumulate as in 1F1B.
        int next_w = 0;
        for (const PipeAction& a : z.actions[r]) {
          if (a.kind == K::kBackwardWeight) {
            EXPECT_EQ(a.microbatch, next_w++);
          }
        }
      }
    }
}

TEST(PipelineSchedule, ZeroBubbleCutsTheBubbleToAThird) {
  // F, B and W one unit each: rank 0 waits p − 1 units for its first gradient, and the drain
  // that 1F1B idles through is filled with W's: (p−1)/(3m+p−1) against 1F1B's (p−1)/(m+p−1)
  // (with its backward's 2 units), the makespan 3m + p − 1 against 3(m + p − 1).
  for (int pp : {1, 2, 4})
    for (int m = 1; m <= 9; ++m) {
      SCOPED_TRACE("pp " + std::to_string(pp) + " m " + std::to_string(m));
      const PipelineSchedule s = make_schedule("zb-h1", pp, m);
      const Timeline t = parse(render_timeline(s));
      const int makespan = m >= pp ? 3 * m + pp - 1 : 2 * m + 2 * pp - 1;
      for (int cols : t.columns) EXPECT_EQ(cols, makespan);
      const double expected = 1.0 - 3.0 * m / makespan;
      EXPECT_NEAR(theoretical_bubble(s), expected, 1e-12);
      EXPECT_NEAR(t.simulated, expected, 6e-4);
      EXPECT_NEAR(t.theory, expected, 6e-4);
      if (m >= pp) {
        EXPECT_DOUBLE_EQ(theoretical_bubble(s), (pp - 1.0) / (3.0 * m + pp - 1.0));
      }
      if (pp > 1) {
        EXPECT_LT(t.simulated, parse(render_timeline(make_schedule("1f1b", pp, m))).simulated);
      }
    }
}

// zb-interleaved is interleaved 1F1B with its backwards split and the W's put into the idle
// time: the same order of forwards, input-gradient backwards and messages on every rank; each
// chunk's W's in micro-batch order (its gradients sum as in interleaved); at most pp owed W's;
// and a bubble below interleaved's, no more than zb-h1's with chunks, and from m = 2pp on the
// unit-cost floor of a chunk's fill, (p−1)/(3mv+p−1).
TEST(PipelineSchedule, InterleavedZeroBubbleKeepsInterleavedsOrderAndFillsItsBubble) {
  for (int pp : {2, 4})
    for (int m : {pp, 2 * pp, 4 * pp})
      for (int v : {1, 2, 3}) {
        SCOPED_TRACE("pp " + std::to_string(pp) + " m " + std::to_string(m) + " v " +
                     std::to_string(v));
        const PipelineSchedule z = make_schedule("zb-interleaved", pp, m, v);
        const PipelineSchedule i = make_schedule("interleaved", pp, m, v);
        for (int r = 0; r < pp; ++r) {
          std::vector<PipeAction> order;
          std::vector<int> next_w(v, 0);
          for (PipeAction a : z.actions[r]) {
            if (a.kind == K::kBackwardWeight) {
              EXPECT_EQ(a.microbatch, next_w[a.chunk]++) << "rank " << r << " chunk " << a.chunk;
              continue;
            }
            if (a.kind == K::kBackwardInput) a.kind = K::kBackward;
            order.push_back(a);
          }
          EXPECT_EQ(order, i.actions[r]) << "rank " << r;
          EXPECT_EQ(peak_in_flight(z.actions[r]), peak_in_flight(i.actions[r])) << "rank " << r;
          EXPECT_LE(peak_deferred(z.actions[r]), pp) << "rank " << r;
        }
        const double zb = simulated_bubble(z);
        EXPECT_DOUBLE_EQ(theoretical_bubble(z), zb);
        EXPECT_LT(zb, simulated_bubble(i));
        const double floor = (pp - 1.0) / (3.0 * m * v + pp - 1.0);
        EXPECT_GE(zb, floor - 1e-12);
        if (v > 1) {
          EXPECT_LE(zb, simulated_bubble(make_schedule("zb-h1", pp, m)) + 1e-12);
        }
        // With a steady state (m ≥ 2pp) the W's fill every wait but the fill: the floor itself,
        // 1/v of zb-h1's bubble.
        if (m >= 2 * pp) {
          EXPECT_NEAR(zb, floor, 1e-12);
        }
      }
}

// zb-v: the V placement (rank 0 holds the first and the last stage), each chunk's B's and W's
// in micro-batch order (its gradients sum as interleaved's), no more than 2·pp chunk
// micro-batches between F and W on any rank (1F1B's activations: pp micro-batches of a stage
// twice a chunk's depth; zb-interleaved's rank 0 holds more), any m (no groups of pp), and a
// bubble at the unit-cost floor (p−1)/(6m+p−1) — rank pp−1 cannot start before p−1 units, then
// computes 6m — for every m from pp on (m = pp + 1 needs the policies that run F's before B's:
// without them pp 5, m 6 gave 0.122 for 0.100), never above zb-h1's or zb-interleaved's.
TEST(PipelineSchedule, ZbVHoldsOneFOneBsActivationsAtTheFloorOfTheBubble) {
  for (int pp : {2, 3, 4, 5, 6, 8})
    for (int m = 1; m <= 3 * pp; ++m) {
      SCOPED_TRACE("pp " + std::to_string(pp) + " m " + std::to_string(m));
      const PipelineSchedule z = make_schedule("zb-v", pp, m, 2);
      ASSERT_TRUE(z.v_placement);
      for (int r = 0; r < pp; ++r) {
        EXPECT_EQ(z.stage_of(r, 0), r);
        EXPECT_EQ(z.stage_of(r, 1), 2 * pp - 1 - r);
        for (int c = 0; c < 2; ++c) {
          EXPECT_EQ(z.rank_of_stage(z.stage_of(r, c)), r);
          EXPECT_EQ(z.chunk_of_stage(z.stage_of(r, c)), c);
        }
        std::vector<int> next_b(2, 0), next_w(2, 0);
        for (const PipeAction& a : z.actions[r]) {
          if (a.kind == K::kBackwardInput) {
            EXPECT_EQ(a.microbatch, next_b[a.chunk]++) << "rank " << r << " chunk " << a.chunk;
          }
          if (a.kind == K::kBackwardWeight) {
            EXPECT_EQ(a.microbatch, next_w[a.chunk]++) << "rank " << r << " chunk " << a.chunk;
          }
        }
        EXPECT_LE(peak_in_flight(z.actions[r], K::kBackwardWeight), 2 * pp) << "rank " << r;
      }
      EXPECT_EQ(z.rank_of_stage(0), 0);
      EXPECT_EQ(z.rank_of_stage(2 * pp - 1), 0);
      const double zb = simulated_bubble(z);
      EXPECT_DOUBLE_EQ(theoretical_bubble(z), zb);
      const double floor = (pp - 1.0) / (6.0 * m + pp - 1.0);
      EXPECT_GE(zb, floor - 1e-12);
      if (m >= pp) {
        EXPECT_NEAR(zb, floor, 1e-12);
      }
      // Never worse than zb-h1 with its chunks twice as deep (zb-h1's floor is 2·zb-v's).
      EXPECT_LE(zb, simulated_bubble(make_schedule("zb-h1", pp, m)) + 1e-12);
      if (m % pp == 0) {
        const PipelineSchedule zi = make_schedule("zb-interleaved", pp, m, 2);
        EXPECT_LE(zb, simulated_bubble(zi) + 1e-12);
        EXPECT_LE(peak_in_flight(z.actions[0], K::kBackwardWeight),
                  peak_in_flight(zi.actions[0], K::kBackwardWeight));
      }
    }
}

// zb-v's list scheduler on the stages' own costs: unequal stages (a GPT-2's cost-balanced
// partition, whose last stage carries the LM head, and random ones) still give a valid schedule
// — no deadlock, each neighbour's messages in send order, each chunk's B's and W's in
// micro-batch order, at most 2·pp chunk micro-batches held — and, simulated on those costs, a
// bubble no larger than the unit-cost schedule's on the same costs.
TEST(PipelineSchedule, ZbVSchedulesOnTheStagesOwnCosts) {
  Gpt2Config gpt;  // GPT-2 124M's shape
  gpt.n_layers = 12;
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> spread(0.5, 2.0);
  for (int pp : {2, 4})
    for (int m : {pp, 2 * pp, 3 * pp}) {
      std::vector<StageCosts> cases = {
          pipeline_stage_costs(gpt, 1024, pipeline_partition(gpt, 1024, 2 * pp, ""))};
      for (int k = 0; k < 3; ++k) {
        StageCosts& c = cases.emplace_back();
        for (int st = 0; st < 2 * pp; ++st) {
          c.forward.push_back(spread(rng));
          c.backward_input.push_back(c.forward.back() * spread(rng));
          c.backward_weight.push_back(c.forward.back() * spread(rng));
        }
      }
      for (size_t k = 0; k < cases.size(); ++k) {
        SCOPED_TRACE("pp " + std::to_string(pp) + " m " + std::to_string(m) + " costs #" +
                     std::to_string(k));
        const PipelineSchedule z = make_schedule("zb-v", pp, m, 2, cases[k]);
        EXPECT_NO_THROW(check_schedule(z));
        for (int r = 0; r < pp; ++r) {
          std::vector<int> next_b(2, 0), next_w(2, 0);
          for (const PipeAction& a : z.actions[r]) {
            if (a.kind == K::kBackwardInput) {
              EXPECT_EQ(a.microbatch, next_b[a.chunk]++);
            }
            if (a.kind == K::kBackwardWeight) {
              EXPECT_EQ(a.microbatch, next_w[a.chunk]++);
            }
          }
          EXPECT_LE(peak_in_flight(z.actions[r], K::kBackwardWeight), 2 * pp) << "rank " << r;
        }
        const double aware = simulated_bubble(z, cases[k]);
        const double unit = simulated_bubble(make_schedule("zb-v", pp, m, 2), cases[k]);
        EXPECT_LE(aware, unit + 1e-12);
      }
    }
}

TEST(PipelineSchedule, InterleavedHoldsSlightlyMoreThanOneFOneB) {
  // Rank 0 holds its warm-up plus one chunk activations: 2(pp−1) + (v−1)·pp + 1 of m·v, i.e.
  // pp + (pp−1)/v micro-batches' worth (a chunk is 1/v of a stage) — against pp for 1F1B.
  const int pp = 4, m = 16, v = 2;
  const PipelineSchedule s = make_schedule("interleaved", pp, m, v);
  EXPECT_EQ(peak_in_flight(s.actions[0]), 2 * (pp - 1) + (v - 1) * pp + 1);
  EXPECT_EQ(peak_in_flight(make_schedule("interleaved", 4, 4, 2).actions[0]), 8);  // m = pp: all
}

TEST(PipelineSchedule, SimulatedBubbleMatchesTheFormula) {
  // With forward 1 and backward 2 units, micro-batch 0 reaches the last rank at p−1, every rank
  // computes for 3m units, and the last backward leaves rank 0 2(p−1) units after the last
  // rank finished: the step takes 3(m+p−1) units, so idle / total = (p−1)/(m+p−1) exactly.
  for (const std::string name : {"gpipe", "1f1b"})
    for (int pp : {1, 2, 4})
      for (int m = 1; m <= 9; ++m) {
        SCOPED_TRACE(name + " pp " + std::to_string(pp) + " m " + std::to_string(m));
        const PipelineSchedule s = make_schedule(name, pp, m);
        const Timeline t = parse(render_timeline(s));
        ASSERT_EQ(t.columns.size(), static_cast<size_t>(pp));
        for (int cols : t.columns) EXPECT_EQ(cols, 3 * (m + pp - 1));
        const double expected = (pp - 1.0) / (m + pp - 1.0);
        EXPECT_DOUBLE_EQ(theoretical_bubble(s), expected);
        EXPECT_NEAR(t.simulated, expected, 6e-4);
        EXPECT_NEAR(t.theory, expected, 6e-4);
      }
}

TEST(PipelineSchedule, InterleavingShrinksTheBubble) {
  for (int pp : {2, 4})
    for (int m : {pp, 2 * pp}) {
      const double one = parse(render_timeline(make_schedule("1f1b", pp, m))).simulated;
      for (int v : {2, 3}) {
        const PipelineSchedule s = make_schedule("interleaved", pp, m, v);
        const Timeline t = parse(render_timeline(s));
        EXPECT_LT(t.simulated, one) << "pp " << pp << " m " << m << " v " << v;
        EXPECT_DOUBLE_EQ(theoretical_bubble(s), (pp - 1.0) / (m + pp - 1.0) / v);
      }
    }
}

TEST(PipelineSchedule, TimelineLooksLikeTheDocs) {
  const std::string text = render_timeline(make_schedule("1f1b", 2, 2));
  EXPECT_NE(text.find("rank 0 | F0 F1 .  .  B0 B0 .  B1 B1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 1 | .  F0 B0 B0 F1 B1 B1 .  .\n"), std::string::npos) << text;
  EXPECT_NE(text.find("bubble (simulated): 0.333\nbubble (theory, (p-1)/(m+p-1)): 0.333\n"), std::string::npos) << text;
  const std::string inter = render_timeline(make_schedule("interleaved", 2, 2, 2));
  EXPECT_NE(inter.find("F0a"), std::string::npos) << inter;
  EXPECT_NE(inter.find("B1b"), std::string::npos) << inter;
  EXPECT_NE(inter.find("(p-1)/(m+p-1)/v): 0.167"), std::string::npos) << inter;
  const std::string zb = render_timeline(make_schedule("zb-h1", 2, 2));
  EXPECT_NE(zb.find("rank 0 | F0 F1 .  B0 W0 B1 W1\n"), std::string::npos) << zb;
  EXPECT_NE(zb.find("rank 1 | .  F0 B0 F1 B1 W0 W1\n"), std::string::npos) << zb;
  EXPECT_NE(zb.find("bubble (theory, (p-1)/(3m+p-1)): 0.143\n"), std::string::npos) << zb;
}

TEST(PipelineSchedule, DeadlockNamesTheStuckRanks) {
  // Rank 0 waits for micro-batch 0's gradient before sending its activation on; rank 1 waits
  // for that activation: a cycle, though each list on its own is well formed.
  PipelineSchedule s;
  s.name = "handmade";
  s.pp = 2;
  s.actions = {{{K::kForward, 0, 0}, {K::kRecvBackward, 0, 0}, {K::kSendForward, 0, 0}, {K::kBackward, 0, 0}},
               {{K::kRecvForward, 0, 0}, {K::kForward, 0, 0}, {K::kBackward, 0, 0}, {K::kSendBackward, 0, 0}}};
  const std::string e = error_of([&] { check_schedule(s); });
  EXPECT_NE(e.find("deadlocks"), std::string::npos) << e;
  EXPECT_NE(e.find("rank 0 is stuck at action #1 RecvBackward of micro-batch 0"), std::string::npos) << e;
  EXPECT_NE(e.find("waiting for SendBackward of micro-batch 0 from stage 1 on rank 1"), std::string::npos) << e;
  EXPECT_NE(e.find("rank 1 is stuck at action #0 RecvForward"), std::string::npos) << e;
  EXPECT_NE(error_of([&] { render_timeline(s); }).find("deadlocks"), std::string::npos);
}

TEST(PipelineSchedule, MalformedSchedulesAreRejected) {
  const PipelineSchedule good = make_schedule("1f1b", 2, 2);
  auto broken = [&](auto edit) {
    PipelineSchedule s = good;
    edit(s);
    return error_of([&] { check_schedule(s); });
  };
  EXPECT_NE(broken([](PipelineSchedule& s) { s.actions[1].pop_back(); }).find("rank 1 lacks SendBackward of micro-batch 1"),
            std::string::npos);
  EXPECT_NE(broken([](PipelineSchedule& s) { s.actions[0].push_back(s.actions[0][0]); }).find("twice"),
            std::string::npos);
  EXPECT_NE(broken([](PipelineSchedule& s) { s.actions[0][0].microbatch = 5; }).find("outside 0..1"),
            std::string::npos);
  EXPECT_NE(broken([](PipelineSchedule& s) { s.actions[0].insert(s.actions[0].begin(), {K::kRecvForward, 0, 0}); })
                .find("needless RecvForward of micro-batch 0 chunk 0 (stage 0)"),
            std::string::npos);
  // Backward of micro-batch 0 before its forward on the last rank.
  EXPECT_NE(broken([](PipelineSchedule& s) { std::swap(s.actions[1][1], s.actions[1][2]); })
                .find("before Forward"),
            std::string::npos);
  EXPECT_NE(broken([](PipelineSchedule& s) { s.actions.pop_back(); }).find("not pp = 2"), std::string::npos);
  // nccl pairs messages in issue order: rank 1 of a GPipe schedule receiving micro-batch 1's
  // activation before micro-batch 0's (both sent, so no deadlock) would take 0's data for 1.
  {
    PipelineSchedule g = make_schedule("gpipe", 2, 2);
    auto& r1 = g.actions[1];  // RecvForward 0, Forward 0, RecvForward 1, Forward 1, ...
    ASSERT_EQ(r1[0], (PipeAction{K::kRecvForward, 0, 0}));
    ASSERT_EQ(r1[2], (PipeAction{K::kRecvForward, 1, 0}));
    std::swap(r1[0], r1[2]);
    std::swap(r1[1], r1[3]);
    EXPECT_EQ(
        error_of([&] { check_schedule(g); }),
        "pipeline schedule \"gpipe\": rank 1's receive #0 from rank 0 (action #0, RecvForward "
        "of micro-batch 1 chunk 0 (stage 1)) is not rank 0's send #0 to it: nccl pairs "
        "point-to-point messages in issue order, so a rank must receive them in the order "
        "they were sent");
  }
  // A split backward needs both halves, the weight half after the input half, and not the
  // whole backward as well.
  const PipelineSchedule zb = make_schedule("zb-h1", 2, 2);
  auto broken_zb = [&](auto edit) {
    PipelineSchedule s = zb;
    edit(s);
    return error_of([&] { check_schedule(s); });
  };
  auto find_kind = [](std::vector<PipeAction>& acts, K kind, int mb) {
    return std::find_if(acts.begin(), acts.end(),
                        [&](const PipeAction& a) { return a.kind == kind && a.microbatch == mb; });
  };
  EXPECT_NE(broken_zb([&](PipelineSchedule& s) {
              s.actions[1].erase(find_kind(s.actions[1], K::kBackwardWeight, 1));
            }).find("rank 1 lacks BackwardWeight of micro-batch 1"),
            std::string::npos);
  EXPECT_NE(broken_zb([&](PipelineSchedule& s) {
              auto& a = s.actions[0];
              std::iter_swap(find_kind(a, K::kBackwardInput, 0),
                             find_kind(a, K::kBackwardWeight, 0));
            }).find("runs BackwardWeight of micro-batch 0 chunk 0 (stage 0) (action #"),
            std::string::npos);
  EXPECT_NE(broken_zb([&](PipelineSchedule& s) {
              s.actions[0].push_back({K::kBackward, 1, 0});
            }).find("needless Backward of micro-batch 1"),
            std::string::npos);
}

TEST(PipelineSchedule, InvalidArgumentsNameTheKey) {
  EXPECT_EQ(error_of([] { make_schedule("interleaved", 4, 6, 2); }),
            "parallel.schedule = \"interleaved\" needs the micro-batch count 6 to be a multiple of parallel.pp = 4");
  EXPECT_NE(error_of([] { make_schedule("zb", 2, 2); }).find("parallel.schedule = \"zb\""), std::string::npos);
  EXPECT_EQ(error_of([] { make_schedule("zb-interleaved", 4, 6, 2); }),
            "parallel.schedule = \"zb-interleaved\" needs the micro-batch count 6 to be a "
            "multiple of parallel.pp = 4");
  EXPECT_NE(error_of([] { make_schedule("1f1b", 0, 2); }).find("parallel.pp = 0"), std::string::npos);
  EXPECT_NE(error_of([] { make_schedule("1f1b", 2, 0); }).find("micro-batch count 0"), std::string::npos);
  EXPECT_NE(error_of([] { make_schedule("interleaved", 2, 2, 0); }).find("parallel.virtual_stages = 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { make_schedule("1f1b", 2, 2, 2); }).find("parallel.virtual_stages = 2 needs parallel.schedule"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              make_schedule("zb-h1", 2, 2, 2);
            }).find("parallel.virtual_stages = 2 needs parallel.schedule"),
            std::string::npos);
  for (int v : {1, 3})
    EXPECT_EQ(error_of([v] { make_schedule("zb-v", 2, 4, v); }),
              "parallel.schedule = \"zb-v\" runs two chunks per rank in a V: it needs "
              "parallel.virtual_stages = 2, got " +
                  std::to_string(v));
}

}  // namespace
}  // namespace loom
