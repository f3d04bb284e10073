// Pipeline schedules (issue 6): generators, the deadlock check and the text timeline.
//
// gpipe, 1f1b and interleaved share one shape, which is why they are one function: a rank's compute
// order is "w warm-up forwards, then alternate one forward / one backward, then the remaining
// backwards", over a sequence of (micro-batch, chunk) forward slots and backward slots. The
// schedules differ only in the warm-up length w and in how slot k maps to (micro-batch, chunk):
//   gpipe        w = m                                    (all forwards, then all backwards)
//   1f1b         w = min(pp − r − 1, m)                   (≤ pp − r micro-batches in flight)
//   interleaved  w = min(2(pp − r − 1) + (v − 1)·pp, m·v)  (Megatron-LM; all of m·v when m = pp)
// Communication is then wrapped around each compute: the receive right before the compute that
// needs it (so the engine blocks as late as possible) and the send right after the compute that
// produces it (so the neighbour can start as early as possible).
//
// The zero-bubble schedules (zb-h1, zb-interleaved, zb-v) are built in zero_bubble_schedules.cc;
// what both files share is pipeline_schedule_detail.h.
#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <iomanip>
#include <set>
#include <sstream>
#include <tuple>

#include "base/check.h"
#include "base/error.h"
#include "config/config.h"
#include "parallel/pipeline_schedule_detail.h"

namespace loom {
using namespace pipeline_detail;

namespace {

const char* kind_name(K k) {
  switch (k) {
    case K::kRecvForward: return "RecvForward";
    case K::kForward: return "Forward";
    case K::kSendForward: return "SendForward";
    case K::kRecvBackward: return "RecvBackward";
    case K::kBackward: return "Backward";
    case K::kSendBackward: return "SendBackward";
    case K::kBackwardInput: return "BackwardInput";
    case K::kBackwardWeight: return "BackwardWeight";
  }
  return "?";
}

std::string describe(const PipelineSchedule& s, int rank, const PipeAction& a) {
  return detail::concat(kind_name(a.kind), " of micro-batch ", a.microbatch, " chunk ", a.chunk,
                        " (stage ", s.stage_of(rank, a.chunk), ")");
}

// A message is named by its direction, micro-batch and the stage that receives it; the engine's
// tags carry the same triple, so messages match by name, not by arrival order.
int64_t message_key(const PipelineSchedule& s, bool forward, int microbatch, int to_stage) {
  return ((forward ? 0 : 1) * int64_t{s.microbatches} + microbatch) * s.stages() + to_stage;
}

// The timeline's: a backward computes two gradients per weight use (input and weight), twice a
// forward's work; each half of a split one is one unit.
constexpr Costs kTimelineCosts{1, 2, 1, 1};

// Checks every action's fields, that each (micro-batch, chunk) has exactly the actions its stage
// needs, once each, in a usable order on its rank. Because every stage below the last sends
// each micro-batch forward exactly once and every stage above the first receives it exactly
// once (and mirrored backwards), sends and receives then pair up one to one.
void check_structure(const PipelineSchedule& s) {
  const int m = s.microbatches, v = s.virtual_stages, S = s.stages();
  for (int r = 0; r < s.pp; ++r) {
    const auto& acts = s.actions[r];
    // pos[kind][microbatch·v + chunk] = index of that action on this rank, −1 if absent.
    std::array<std::vector<int64_t>, 8> pos;
    for (auto& p : pos) p.assign(static_cast<size_t>(m) * v, -1);
    for (size_t i = 0; i < acts.size(); ++i) {
      const PipeAction& a = acts[i];
      if (a.microbatch < 0 || a.microbatch >= m || a.chunk < 0 || a.chunk >= v)
        fail("pipeline schedule \"", s.name, "\": rank ", r, " action #", i, " (", kind_name(a.kind),
             ") has micro-batch ", a.microbatch, " chunk ", a.chunk, ", outside 0..", m - 1,
             " and 0..", v - 1);
      int64_t& p = pos[static_cast<int>(a.kind)][static_cast<size_t>(a.microbatch) * v + a.chunk];
      if (p >= 0)
        fail("pipeline schedule \"", s.name, "\": rank ", r, " has ", describe(s, r, a),
             " twice (actions #", p, " and #", i, ")");
      p = static_cast<int64_t>(i);
    }
    for (int mb = 0; mb < m; ++mb) {
      for (int c = 0; c < v; ++c) {
        const int stage = s.stage_of(r, c);
        auto at = [&](K k) { return pos[static_cast<int>(k)][static_cast<size_t>(mb) * v + c]; };
        auto need = [&](K k, bool wanted) {
          if ((at(k) >= 0) == wanted) return;
          fail("pipeline schedule \"", s.name, "\": rank ", r, wanted ? " lacks " : " has a needless ",
               describe(s, r, {k, mb, c}),
               wanted ? "" : (stage == 0 ? "; stage 0 has no previous stage" : "; it is the last stage"));
        };
        need(K::kForward, true);
        // A backward whole, or split into its input and weight halves.
        const bool split = at(K::kBackwardInput) >= 0 || at(K::kBackwardWeight) >= 0;
        need(K::kBackward, !split);
        need(K::kBackwardInput, split);
        need(K::kBackwardWeight, split);
        // What sends the input gradient and what needs the output gradient.
        const K backward = split ? K::kBackwardInput : K::kBackward;
        need(K::kRecvForward, stage > 0);
        need(K::kSendBackward, stage > 0);
        need(K::kSendForward, stage < S - 1);
        need(K::kRecvBackward, stage < S - 1);
        auto before = [&](K first, K second) {
          if (at(first) < 0 || at(second) < 0 || at(first) < at(second)) return;
          fail("pipeline schedule \"", s.name, "\": rank ", r, " runs ", describe(s, r, {second, mb, c}),
               " (action #", at(second), ") before ", kind_name(first), " (action #", at(first), ")");
        };
        before(K::kRecvForward, K::kForward);
        before(K::kForward, K::kSendForward);
        before(K::kForward, backward);
        before(K::kRecvBackward, backward);
        before(backward, K::kSendBackward);
        before(K::kBackwardInput, K::kBackwardWeight);
      }
    }
  }
}

std::string cell_label(const PipelineSchedule& s, const PipeAction& a) {
  // (Built by appending: GCC 12 warns falsely (-Wrestrict) about "F" + std::to_string(...).)
  std::string label(1, a.kind == K::kForward ? 'F' : a.kind == K::kBackwardWeight ? 'W' : 'B');
  label += std::to_string(a.microbatch);
  if (s.virtual_stages > 1) label += static_cast<char>('a' + a.chunk % 26);
  return label;
}

}  // namespace

namespace pipeline_detail {

int64_t message_of(const PipelineSchedule& s, int rank, const PipeAction& a) {
  const int stage = s.stage_of(rank, a.chunk);
  switch (a.kind) {
    case K::kRecvForward: return message_key(s, true, a.microbatch, stage);
    case K::kSendForward: return message_key(s, true, a.microbatch, stage + 1);
    case K::kRecvBackward: return message_key(s, false, a.microbatch, stage);
    case K::kSendBackward: return message_key(s, false, a.microbatch, stage - 1);
    default: return -1;
  }
}

Simulation simulate(const PipelineSchedule& s, const Costs& costs) {
  const int pp = s.pp;
  Simulation sim;
  sim.next.assign(pp, 0);
  sim.clock.assign(pp, 0);
  sim.start.resize(pp);
  for (int r = 0; r < pp; ++r) sim.start[r].assign(s.actions[r].size(), -1);
  std::vector<double> sent_at(2 * static_cast<size_t>(s.microbatches) * s.stages(), -1);
  for (bool moved = true; moved;) {
    moved = false;
    for (int r = 0; r < pp; ++r) {
      const auto& acts = s.actions[r];
      for (size_t& i = sim.next[r]; i < acts.size(); ++i) {
        const PipeAction& a = acts[i];
        if (is_recv(a.kind)) {
          const double t = sent_at[message_of(s, r, a)];
          if (t < 0) break;  // blocked: its send has not been issued yet
          sim.clock[r] = std::max(sim.clock[r], t);
        } else if (is_send(a.kind)) {
          sent_at[message_of(s, r, a)] = sim.clock[r];
        } else {
          sim.start[r][i] = sim.clock[r];
          sim.clock[r] += costs.of(a.kind, s.stage_of(r, a.chunk));
        }
        moved = true;
      }
    }
  }
  for (int r = 0; r < pp; ++r) sim.finished = sim.finished && sim.next[r] == s.actions[r].size();
  return sim;
}

// Checks that between every two ranks the receiver takes the messages in the order the sender
// sends them. nccl matches point-to-point messages by issue order, not by tag (the engine's tags
// only name them for the host backends), so a schedule that receives out of order would pair a
// receive with another message of the same shape: wrong numbers, or a hang.
void check_pair_order(const PipelineSchedule& s) {
  const int pp = s.pp;
  // sent[a][b]: the messages rank a sends to rank b, in its order; received likewise.
  std::vector<std::vector<std::vector<int64_t>>> sent(pp, std::vector<std::vector<int64_t>>(pp));
  std::vector<std::vector<std::vector<size_t>>> received(pp, std::vector<std::vector<size_t>>(pp));
  for (int r = 0; r < pp; ++r)
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const PipeAction& a = s.actions[r][i];
      if (!is_send(a.kind) && !is_recv(a.kind)) continue;
      const int stage = s.stage_of(r, a.chunk);
      const int other =
          s.rank_of_stage(stage + (is_forward_dir(a.kind) == is_send(a.kind) ? 1 : -1));
      if (other == r) continue;  // between two stages of one rank: kept in memory
      if (is_send(a.kind))
        sent[r][other].push_back(message_of(s, r, a));
      else
        received[r][other].push_back(i);
    }
  for (int to = 0; to < pp; ++to)
    for (int from = 0; from < pp; ++from) {
      const auto& order = sent[from][to];
      const auto& recvs = received[to][from];
      for (size_t k = 0; k < recvs.size() && k < order.size(); ++k) {
        const PipeAction& a = s.actions[to][recvs[k]];
        if (message_of(s, to, a) == order[k]) continue;
        fail("pipeline schedule \"", s.name, "\": rank ", to, "'s receive #", k, " from rank ",
             from, " (action #", recvs[k], ", ", describe(s, to, a), ") is not rank ", from,
             "'s send #", k,
             " to it: nccl pairs point-to-point messages in issue order, so a "
             "rank must receive them in the order they were sent");
      }
    }
}

}  // namespace pipeline_detail

PipelineSchedule make_schedule(const std::string& name, int pp, int microbatches, int virtual_stages,
                               const StageCosts& costs) {
  if (!is_pipeline_schedule(name)) {
    std::string known;
    for (std::string_view s : kPipelineSchedules)
      known += detail::concat(known.empty() ? "" : ", ", "\"", s, "\"");
    fail("parallel.schedule = \"", name, "\" is not one of ", known);
  }
  const bool chunks = schedule_takes_chunks(name);
  const bool groups = schedule_takes_groups_of_pp(name);
  if (pp < 1) fail("parallel.pp = ", pp, " must be at least 1");
  if (microbatches < 1)
    fail("the micro-batch count ", microbatches,
         " must be at least 1 (train.batch_size / (train.micro_batch_size × parallel.dp))");
  if (virtual_stages < 1) fail("parallel.virtual_stages = ", virtual_stages, " must be at least 1");
  if (virtual_stages > 1 && !chunks)
    fail("parallel.virtual_stages = ", virtual_stages,
         " needs parallel.schedule = \"interleaved\", \"zb-interleaved\" or \"zb-v\", not \"", name,
         "\"");
  if (name == "zb-v" && virtual_stages != 2)
    fail(
        "parallel.schedule = \"zb-v\" runs two chunks per rank in a V: it needs "
        "parallel.virtual_stages = 2, got ",
        virtual_stages);
  if (groups && microbatches % pp != 0)
    fail("parallel.schedule = \"", name, "\" needs the micro-batch count ", microbatches,
         " to be a multiple of parallel.pp = ", pp);

  PipelineSchedule s;
  s.name = name;
  s.pp = pp;
  s.microbatches = microbatches;
  s.virtual_stages = virtual_stages;
  s.actions.resize(pp);
  if (name == "zb-h1") {
    zero_bubble_h1(s);
    return s;
  }
  s.v_placement = stage_placement(name, pp, virtual_stages).v_placement;
  if (name == "zb-v") {
    for (const std::vector<double>* c : {&costs.forward, &costs.backward_input, &costs.backward_weight})
      LOOM_CHECK_MSG(c->empty() || static_cast<int>(c->size()) == s.stages(),
                     "zb-v: stage costs for another number of stages");
    s.costs = costs;
    zero_bubble_v(s);
    return s;
  }
  const int m = microbatches, v = virtual_stages, total = m * v;
  for (int r = 0; r < pp; ++r) {
    int warmup = 0;
    if (name == "gpipe") {
      warmup = m;
    } else if (name == "1f1b") {
      // Rank r's first backward needs micro-batch 0 to have passed the pp − r − 1 ranks after
      // it; the forwards it can do meanwhile are the warm-up.
      warmup = std::min(pp - r - 1, m);
    } else {
      // Megatron-LM: rank r's first backward (micro-batch 0 of the last chunk) comes after the
      // whole first group of pp micro-batches has gone through the first v − 1 chunks, plus
      // the round trip to the last rank and back. With m = pp there is no steady state.
      warmup = m == pp ? total : std::min(2 * (pp - r - 1) + (v - 1) * pp, total);
    }
    // Slot k → (micro-batch, chunk): micro-batches go in groups of pp; a group runs through
    // chunk 0, then chunk 1, ... (forward) or chunk v−1 down to 0 (backward), so each chunk sees
    // pp micro-batches in a row and the next rank's chunk is fed before this rank needs it back.
    auto slot = [&](int k, bool forward) {
      const int group = k / (pp * v), in_group = k % (pp * v);
      const int chunk = forward ? in_group / pp : v - 1 - in_group / pp;
      return std::pair{group * pp + in_group % pp, chunk};
    };
    auto& acts = s.actions[r];
    auto forward = [&](int k) {
      const auto [mb, c] = slot(k, true);
      const int stage = s.stage_of(r, c);
      if (stage > 0) acts.push_back({K::kRecvForward, mb, c});
      acts.push_back({K::kForward, mb, c});
      if (stage < s.stages() - 1) acts.push_back({K::kSendForward, mb, c});
    };
    auto backward = [&](int k) {
      const auto [mb, c] = slot(k, false);
      const int stage = s.stage_of(r, c);
      if (stage < s.stages() - 1) acts.push_back({K::kRecvBackward, mb, c});
      acts.push_back({K::kBackward, mb, c});
      if (stage > 0) acts.push_back({K::kSendBackward, mb, c});
    };
    for (int k = 0; k < warmup; ++k) forward(k);
    for (int k = 0; k < total - warmup; ++k) {
      forward(warmup + k);
      backward(k);
    }
    for (int k = total - warmup; k < total; ++k) backward(k);
  }
  if (name == "zb-interleaved") fill_idle_with_weight_grads(s, pp);
  return s;
}

PipelineSchedule stage_placement(const std::string& name, int pp, int virtual_stages) {
  PipelineSchedule s;
  s.name = name;
  s.pp = pp;
  s.virtual_stages = virtual_stages;
  s.v_placement = name == "zb-v";
  return s;
}

void check_schedule(const PipelineSchedule& s) {
  if (s.pp < 1 || s.microbatches < 1 || s.virtual_stages < 1)
    fail("pipeline schedule \"", s.name, "\": pp ", s.pp, ", micro-batches ", s.microbatches,
         " and virtual stages ", s.virtual_stages, " must all be at least 1");
  if (static_cast<int>(s.actions.size()) != s.pp)
    fail("pipeline schedule \"", s.name, "\" has action lists for ", s.actions.size(), " ranks, not pp = ", s.pp);
  check_structure(s);
  check_pair_order(s);
  const Simulation sim = simulate(s, Costs{});
  if (sim.finished) return;
  std::ostringstream os;
  os << "pipeline schedule \"" << s.name << "\" deadlocks:";
  const char* sep = " ";
  for (int r = 0; r < s.pp; ++r) {
    if (sim.next[r] == s.actions[r].size()) continue;
    // Only receives block, so every stuck rank is at a receive.
    const PipeAction& a = s.actions[r][sim.next[r]];
    const int stage = s.stage_of(r, a.chunk);
    const int from = is_forward_dir(a.kind) ? stage - 1 : stage + 1;
    os << sep << "rank " << r << " is stuck at action #" << sim.next[r] << " " << describe(s, r, a)
       << ", waiting for " << (is_forward_dir(a.kind) ? "SendForward" : "SendBackward")
       << " of micro-batch " << a.microbatch << " from stage " << from << " on rank "
       << s.rank_of_stage(from);
    sep = "; ";
  }
  fail(os.str());
}

namespace {
// The idle fraction of a finished unit-cost simulation: 1 − busy / (ranks × makespan).
double idle_fraction(const PipelineSchedule& s, const Simulation& sim, const Costs& costs) {
  double busy = 0;
  for (int r = 0; r < s.pp; ++r)
    for (const PipeAction& a : s.actions[r]) busy += costs.of(a.kind, s.stage_of(r, a.chunk));
  const double makespan = *std::max_element(sim.clock.begin(), sim.clock.end());
  return makespan == 0 ? 0.0 : 1.0 - busy / (makespan * s.pp);
}
}  // namespace

double simulated_bubble(const PipelineSchedule& s) {
  const Simulation sim = simulate(s, kTimelineCosts);
  if (!sim.finished)
    fail("pipeline schedule \"", s.name, "\" deadlocks (check_schedule says where)");
  return idle_fraction(s, sim, kTimelineCosts);
}

double simulated_bubble(const PipelineSchedule& s, const StageCosts& costs) {
  Costs c;
  c.stages = &costs;
  const Simulation sim = simulate(s, c);
  if (!sim.finished)
    fail("pipeline schedule \"", s.name, "\" deadlocks (check_schedule says where)");
  return idle_fraction(s, sim, c);
}

std::string render_timeline(const PipelineSchedule& s) {
  check_schedule(s);
  const Simulation sim = simulate(s, kTimelineCosts);
  const auto makespan = static_cast<int64_t>(*std::max_element(sim.clock.begin(), sim.clock.end()));
  std::vector<std::vector<std::string>> cells(s.pp, std::vector<std::string>(makespan, "."));
  size_t width = 1;
  for (int r = 0; r < s.pp; ++r) {
    for (size_t i = 0; i < s.actions[r].size(); ++i) {
      const PipeAction& a = s.actions[r][i];
      if (sim.start[r][i] < 0) continue;  // communication takes no time
      const auto cost = static_cast<int64_t>(kTimelineCosts.of(a.kind, 0));
      const std::string label = cell_label(s, a);
      width = std::max(width, label.size());
      const auto begin = static_cast<int64_t>(sim.start[r][i]);
      for (int64_t t = begin; t < begin + cost; ++t) cells[r][t] = label;
    }
  }
  std::ostringstream os;
  os << s.name << ": pp " << s.pp << ", " << s.microbatches << " micro-batches";
  if (s.virtual_stages > 1) os << ", " << s.virtual_stages << " chunks per rank (a, b, ...)";
  const bool split = std::any_of(s.actions.begin(), s.actions.end(), [](const auto& acts) {
    return std::any_of(acts.begin(), acts.end(),
                       [](const PipeAction& a) { return a.kind == K::kBackwardWeight; });
  });
  os << (split ? "; forward, backward input (B) and weight (W) 1 unit each per column\n"
               : "; forward 1 unit, backward 2 units per column\n");
  const size_t rank_width = std::to_string(s.pp - 1).size();
  for (int r = 0; r < s.pp; ++r) {
    std::ostringstream row;
    row << "rank " << std::left << std::setw(static_cast<int>(rank_width)) << r << " |";
    for (const auto& c : cells[r]) row << ' ' << std::setw(static_cast<int>(width)) << c;
    std::string line = row.str();
    line.erase(line.find_last_not_of(' ') + 1);  // no trailing blanks after a final "."
    os << line << '\n';
  }
  const double bubble = idle_fraction(s, sim, kTimelineCosts);
  const char* formula = s.name == "interleaved"      ? "(p-1)/(m+p-1)/v"
                        : s.name == "zb-interleaved" ? "as simulated"
                        : s.name == "zb-v"           ? "as simulated"
                        : s.name != "zb-h1"          ? "(p-1)/(m+p-1)"
                        : s.microbatches >= s.pp     ? "(p-1)/(3m+p-1)"
                                                     : "(2p-m-1)/(2m+2p-1), m < p";
  os << std::fixed << std::setprecision(3) << "bubble (simulated): " << bubble << '\n'
     << "bubble (theory, " << formula << "): " << theoretical_bubble(s) << '\n';
  return os.str();
}

double theoretical_bubble(const PipelineSchedule& s) {
  const double p = s.pp, m = s.microbatches;
  // zb-interleaved's W's sit where its generator's unit-cost simulation found idle time: its
  // theory is that simulation's bubble (the timeline's, F, B and W one unit each).
  if (s.name == "zb-interleaved") return simulated_bubble(s);
  if (s.name == "zb-v") return simulated_bubble(s, s.costs);
  // zb-h1: each rank computes 3m units; with m ≥ p the step takes 3m + p − 1 (the fill's p − 1
  // units; the drain is filled with W's). With m < p rank 0 runs out of forwards before micro-
  // batch 0's gradient is back: it starts its first B at 2p − 1 and then alternates B, W to the
  // end, 2m + 2p − 1.
  if (s.name == "zb-h1")
    return m >= p ? (p - 1) / (3 * m + p - 1) : (2 * p - 1 - m) / (2 * m + 2 * p - 1);
  const double b = (p - 1) / (m + p - 1);
  return s.name == "interleaved" ? b / s.virtual_stages : b;
}

}  // namespace loom
