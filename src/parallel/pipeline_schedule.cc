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
// zb-h1 (zero_bubble_h1 below) follows the paper's steady-state rule instead: rank r runs, for
// x = 0, 1, ..., m + pp − 2, the triple (F of micro-batch x, B of x − (pp − 1 − r), W of
// x − (pp − 1)), each where its micro-batch exists.
//
// zb-interleaved (fill_idle_with_weight_grads below) is interleaved 1F1B with every backward
// split into B and W, the W's placed by a unit-cost simulation: where a rank would wait for a
// message it runs its oldest owed W instead, and it never owes more than pp of them.
//
// zb-v (zero_bubble_v below) is a list schedule: a unit-time simulation in which every idle rank
// picks its next compute from what its messages allow, under a memory bound.
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

namespace loom {
namespace {

using K = PipeActionKind;

bool is_recv(K k) { return k == K::kRecvForward || k == K::kRecvBackward; }
bool is_send(K k) { return k == K::kSendForward || k == K::kSendBackward; }
bool is_forward_dir(K k) { return k == K::kRecvForward || k == K::kForward || k == K::kSendForward; }

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

// The message a communication action sends or receives.
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

// Runs the schedule as the engine would: each rank executes its actions in order; a send
// completes when issued, a receive blocks until its send has been issued. With durations it is
// also the unit-time simulation of the timeline: a rank's clock jumps to a message's send time
// when it has to wait for it. Sweeping the ranks until nothing moves reaches the same state in
// any sweep order, because a blocked receive only ever waits on a send, never on time.
struct Simulation {
  std::vector<size_t> next;                  // [rank] index of the first action not run
  std::vector<double> clock;                 // [rank] time after its last action
  std::vector<std::vector<double>> start;    // [rank][action] start time of computes
  bool finished = true;
};

// Time units a compute takes in the simulation; with `stages`, the stage's own costs instead
// (a whole backward then costs B + W).
struct Costs {
  double forward = 1, backward = 1, backward_input = 1, backward_weight = 1;
  const StageCosts* stages = nullptr;
  double of(K k, int stage) const {
    if (stages != nullptr) {
      const auto at = [&](const std::vector<double>& c) {
        return c.empty() ? 1.0 : c[static_cast<size_t>(stage)];
      };
      switch (k) {
        case K::kForward: return at(stages->forward);
        case K::kBackward: return at(stages->backward_input) + at(stages->backward_weight);
        case K::kBackwardInput: return at(stages->backward_input);
        case K::kBackwardWeight: return at(stages->backward_weight);
        default: return 0;
      }
    }
    switch (k) {
      case K::kForward: return forward;
      case K::kBackward: return backward;
      case K::kBackwardInput: return backward_input;
      case K::kBackwardWeight: return backward_weight;
      default: return 0;
    }
  }
};
// The timeline's: a backward computes two gradients per weight use (input and weight), twice a
// forward's work; each half of a split one is one unit.
constexpr Costs kTimelineCosts{1, 2, 1, 1};

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

std::string cell_label(const PipelineSchedule& s, const PipeAction& a) {
  // (Built by appending: GCC 12 warns falsely (-Wrestrict) about "F" + std::to_string(...).)
  std::string label(1, a.kind == K::kForward ? 'F' : a.kind == K::kBackwardWeight ? 'W' : 'B');
  label += std::to_string(a.microbatch);
  if (s.virtual_stages > 1) label += static_cast<char>('a' + a.chunk % 26);
  return label;
}

// ZB-H1 (Qi et al. 2023, the "H1" variant: 1F1B's memory): rank r's steady state is the triple
// (F x, B x − (pp − 1 − r), W x − (pp − 1)). Its forwards and input-gradient backwards are
// 1F1B's order — the same pp − r − 1 warm-up forwards, so at most pp − r micro-batches between
// F and B —, and its W's trail its B's by r micro-batches: none on the first rank, pp − 1 on
// the last. The drain that 1F1B spends waiting for backwards to come back, ZB-H1 fills with
// those W's; with F = B = W = 1 unit a rank idles pp − 1 units a step instead of 3(pp − 1).
void zero_bubble_h1(PipelineSchedule& s) {
  const int pp = s.pp, m = s.microbatches, last = pp - 1;
  for (int r = 0; r < pp; ++r) {
    auto& acts = s.actions[r];
    for (int x = 0; x < m + pp - 1; ++x) {
      if (x < m) {
        if (r > 0) acts.push_back({K::kRecvForward, x, 0});
        acts.push_back({K::kForward, x, 0});
        if (r < last) acts.push_back({K::kSendForward, x, 0});
      }
      if (const int b = x - (last - r); b >= 0 && b < m) {
        if (r < last) acts.push_back({K::kRecvBackward, b, 0});
        acts.push_back({K::kBackwardInput, b, 0});
        if (r > 0) acts.push_back({K::kSendBackward, b, 0});
      }
      if (const int w = x - last; w >= 0 && w < m) acts.push_back({K::kBackwardWeight, w, 0});
    }
  }
}

// zb-interleaved: `s` (interleaved 1F1B) with each Backward split in two. Its receives, sends,
// forwards and input-gradient backwards keep their order on every rank; the W's are put where a
// time-stepped simulation (F, B, W one unit each, communication free) finds the rank idle:
// waiting for a message, or after its last B. W's run oldest first — each chunk's in micro-batch
// order, as its backwards ran in interleaved 1F1B, so every gradient sums the same products in
// the same order (bit for bit interleaved) — and a rank owing `max_owed` W's runs one before its
// next compute, which bounds what B's deferred work keeps alive. Inserting computes that neither
// send nor receive cannot deadlock a schedule that did not.
void fill_idle_with_weight_grads(PipelineSchedule& s, int max_owed) {
  const int pp = s.pp;
  std::vector<std::vector<PipeAction>> base = std::move(s.actions);
  for (auto& acts : base)
    for (PipeAction& a : acts)
      if (a.kind == K::kBackward) a.kind = K::kBackwardInput;
  s.actions.assign(pp, {});
  std::vector<size_t> next(pp, 0);
  std::vector<std::vector<PipeAction>> owed(pp);  // FIFO of W's not yet placed
  std::vector<int64_t> sent_at(2 * static_cast<size_t>(s.microbatches) * s.stages(), -1);
  const auto done = [&] {
    for (int r = 0; r < pp; ++r)
      if (next[r] < base[r].size() || !owed[r].empty()) return false;
    return true;
  };
  const auto run_oldest_w = [&](int r) {
    s.actions[r].push_back(owed[r].front());
    owed[r].erase(owed[r].begin());
  };
  size_t total = 0;
  for (const auto& acts : base) total += 2 * acts.size();  // every compute and every W, one unit
  for (int64_t t = 0; !done(); ++t) {
    LOOM_CHECK_MSG(t <= static_cast<int64_t>(total), "zb-interleaved: the base schedule stalls");
    // At time t: every rank issues its sends and passes the receives already sent (a send at t
    // is visible at t), until nothing moves; then each rank spends [t, t + 1) on one compute.
    for (bool moved = true; moved;) {
      moved = false;
      for (int r = 0; r < pp; ++r) {
        for (; next[r] < base[r].size(); ++next[r], moved = true) {
          const PipeAction& a = base[r][next[r]];
          if (is_send(a.kind)) {
            sent_at[message_of(s, r, a)] = t;
          } else if (is_recv(a.kind)) {
            const int64_t at = sent_at[message_of(s, r, a)];
            if (at < 0 || at > t) break;
          } else {
            break;
          }
          s.actions[r].push_back(a);
        }
      }
    }
    for (int r = 0; r < pp; ++r) {
      const bool compute_next = next[r] < base[r].size() && !is_recv(base[r][next[r]].kind);
      if (compute_next && static_cast<int>(owed[r].size()) < max_owed) {
        const PipeAction a = base[r][next[r]++];
        s.actions[r].push_back(a);
        if (a.kind == K::kBackwardInput)
          owed[r].push_back({K::kBackwardWeight, a.microbatch, a.chunk});
      } else if (!owed[r].empty()) {
        run_oldest_w(r);  // idle (waiting, or nothing left but W's), or owing too many
      }
    }
  }
}

// ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", 2023, §6): two chunks per rank in the V
// placement, every backward split into B and W, built by list scheduling on the stages' costs
// (F, B and W one unit each where none are given, as the timeline counts; communication free).
// Each free rank runs one compute, chosen from what is ready by a policy (VPolicy): a B whose
// output gradient has arrived first (the critical path: it frees the next stage down; or, by
// policy, an F first), else an F whose input has arrived, if the rank then holds at most `limit`
// chunk micro-batches between their F and their W, else its oldest owed W, else it idles. A
// chunk's F's, B's and W's each go in micro-batch order, so every gradient sums the same products
// in the same order as interleaved 1F1B's (its W's are B's order per chunk). With limit = 2·pp a rank holds what a 1F1B rank holds:
// pp micro-batches of a stage twice as deep as a chunk. The V is what takes the fill's bubble away:
// rank 0 runs the first and the last stage, so the backward starts on the rank that began the
// forward, and the W's fill the drain. A greedy choice is not always best (the last ranks fill
// their memory with warm-up forwards and then starve the pipeline of the last micro-batches), so
// zero_bubble_v tries ~32·pp policies and keeps the shortest step, as the paper's scheduler tries
// its variants.
struct VPolicy {
  bool b_chunk1_first = false;  // of two ready B's, chunk 1's; else the older micro-batch's
  int max_owed = 0;             // a rank owing this many W's runs one before anything else
  bool w_when_full = false;     // a rank whose memory bound stops a ready F runs a W before a B
  // Chunk 0's F's leave the last slot under the bound to chunk 1's: a rank full of chunk 0
  // micro-batches could not start the forward the next backward depends on (with stages of
  // unequal cost the plain greedy order can deadlock that way).
  bool keep_a_slot_for_chunk1 = false;
  // Of a ready B and a ready F within the bound, the F: the forward runs ahead while memory
  // allows. With a few more micro-batches than ranks (pp < m < 2·pp) the B-first order leaves
  // the last ranks without forwards at the end; this one reaches the unit-cost floor there.
  bool f_before_b = false;
};

// Fills s.actions by the policy; returns the step's length in the costs' unit, or −1 where the
// policy stalls (its bounds leave nothing to run). Event-driven: the rank that is free earliest
// (the lowest of equals) picks its next compute from the messages that have arrived by then; a
// message arrives when the compute that sends it ends (communication free); a rank with nothing
// ready waits for the next end of a compute anywhere. With unit costs this is the unit-time
// simulation the timeline draws.
double list_schedule_v(PipelineSchedule& s, const StageCosts& costs, int limit,
                       const VPolicy& policy) {
  const int pp = s.pp, m = s.microbatches, S = s.stages();
  Costs cost;
  cost.stages = &costs;
  struct Lane {
    int next_forward = 0, next_backward = 0;
  };
  std::vector<std::array<Lane, 2>> lanes(pp);
  std::vector<std::deque<PipeAction>> owed(pp);  // W's not yet run, oldest first
  std::vector<int> held(pp, 0);                  // chunk micro-batches after F, before W
  std::vector<double> free_at(pp, 0.0);          // when each rank's last compute ends
  // When the input (forward) or output gradient (backward) of micro-batch i reaches stage st:
  // arrive[dir][i·S + st], −1 until its sender has been scheduled.
  std::array<std::vector<double>, 2> arrive;
  for (auto& a : arrive) a.assign(static_cast<size_t>(m) * S, -1.0);
  const auto arrived = [&](int dir, int i, int stage, double t) {
    const double at = arrive[dir][static_cast<size_t>(i) * S + stage];
    return at >= 0 && at <= t;
  };
  // Messages sent from rank a to rank b and not yet received, oldest first, as b's receive
  // actions. nccl pairs messages in issue order (check_pair_order), so a rank that needs a later
  // message receives the earlier ones of that sender first (sent earlier: no wait in the
  // simulation) and keeps them for their computes.
  std::vector<std::vector<std::deque<PipeAction>>> in_transit(
      pp, std::vector<std::deque<PipeAction>>(pp));
  std::set<std::tuple<K, int, int>> received;  // (kind, micro-batch, stage)
  const auto send = [&](int from, int to_stage, const PipeAction& recv_there) {
    in_transit[from][s.rank_of_stage(to_stage)].push_back(recv_there);
  };
  const auto receive = [&](int r, int from, const PipeAction& wanted) {
    const auto key = [&](const PipeAction& a) {
      return std::tuple{a.kind, a.microbatch, s.stage_of(r, a.chunk)};
    };
    if (received.count(key(wanted))) return;
    for (auto& queue = in_transit[from][r];;) {
      LOOM_CHECK(!queue.empty());
      const PipeAction a = queue.front();
      queue.pop_front();
      s.actions[r].push_back(a);
      received.insert(key(a));
      if (a == wanted) break;
    }
  };
  // Of the chunks whose next compute of a kind is ready, the one to run, or −1: the older
  // micro-batch's (a tie: chunk 0's), or chunk 1's if `chunk1_first`.
  const auto choose = [](const std::array<bool, 2>& ready, const std::array<int, 2>& microbatch,
                         bool chunk1_first) {
    if (!ready[0] || !ready[1]) return ready[0] ? 0 : ready[1] ? 1 : -1;
    return chunk1_first || microbatch[1] < microbatch[0] ? 1 : 0;
  };
  int64_t remaining = int64_t{3} * m * S;  // computes still to place
  double makespan = 0;
  // waiting[r]: r found nothing to run at free_at[r]. Computes take time, so nothing decided at a
  // time makes anything ready at that same time.
  std::vector<char> waiting(pp, 0);
  while (remaining > 0) {
    int r = 0;  // the earliest free rank, one still to decide before one waiting
    for (int q = 1; q < pp; ++q)
      if (std::tie(free_at[q], waiting[q]) < std::tie(free_at[r], waiting[r])) r = q;
    const double t = free_at[r];
    if (waiting[r]) {
      // Every rank free at t waits: move them all on to the next end of a compute.
      double next = -1;
      for (int q = 0; q < pp; ++q)
        if (free_at[q] > t && (next < 0 || free_at[q] < next)) next = free_at[q];
      if (next < 0) return -1;  // stalled: no compute is under way that could change anything
      for (int q = 0; q < pp; ++q)
        if (waiting[q] && free_at[q] == t) {
          free_at[q] = next;
          waiting[q] = 0;
        }
      continue;
    }
    auto& acts = s.actions[r];
    std::array<bool, 2> b_ready{}, f_ready{};
    std::array<int, 2> b_mb{}, f_mb{};
    bool f_waits_for_memory = false;  // an F's input is here, but the bound stops it
    for (int c = 0; c < 2; ++c) {
      const Lane& lane = lanes[r][c];
      const int stage = s.stage_of(r, c);
      b_mb[c] = lane.next_backward;
      b_ready[c] = b_mb[c] < lane.next_forward && (stage == S - 1 || arrived(1, b_mb[c], stage, t));
      f_mb[c] = lane.next_forward;
      const bool input = f_mb[c] < m && (stage == 0 || arrived(0, f_mb[c], stage, t));
      const int bound =
          c == 0 && policy.keep_a_slot_for_chunk1 && lanes[r][1].next_forward < m ? limit - 1 : limit;
      f_ready[c] = input && held[r] < bound;
      f_waits_for_memory = f_waits_for_memory || (input && held[r] >= limit);
    }
    const int b_chunk = choose(b_ready, b_mb, policy.b_chunk1_first);
    const int f_chunk = choose(f_ready, f_mb, false);
    const bool owes = !owed[r].empty();
    const bool w_first =
        owes && ((policy.max_owed > 0 && static_cast<int>(owed[r].size()) >= policy.max_owed) ||
                 (policy.w_when_full && f_waits_for_memory));
    double end = -1;
    if (b_chunk >= 0 && !w_first && !(policy.f_before_b && f_chunk >= 0)) {
      const int c = b_chunk, stage = s.stage_of(r, c), i = lanes[r][c].next_backward++;
      if (stage < S - 1) receive(r, s.rank_of_stage(stage + 1), {K::kRecvBackward, i, c});
      acts.push_back({K::kBackwardInput, i, c});
      end = t + cost.of(K::kBackwardInput, stage);
      if (stage > 0) {
        acts.push_back({K::kSendBackward, i, c});
        arrive[1][static_cast<size_t>(i) * S + stage - 1] = end;
        send(r, stage - 1, {K::kRecvBackward, i, s.chunk_of_stage(stage - 1)});
      }
      owed[r].push_back({K::kBackwardWeight, i, c});
    } else if (f_chunk >= 0 && !w_first) {
      const int c = f_chunk, stage = s.stage_of(r, c), i = lanes[r][c].next_forward++;
      if (stage > 0) receive(r, s.rank_of_stage(stage - 1), {K::kRecvForward, i, c});
      acts.push_back({K::kForward, i, c});
      end = t + cost.of(K::kForward, stage);
      if (stage < S - 1) {
        acts.push_back({K::kSendForward, i, c});
        arrive[0][static_cast<size_t>(i) * S + stage + 1] = end;
        send(r, stage + 1, {K::kRecvForward, i, s.chunk_of_stage(stage + 1)});
      }
      ++held[r];
    } else if (owes) {
      const PipeAction w = owed[r].front();
      owed[r].pop_front();
      acts.push_back(w);
      end = t + cost.of(K::kBackwardWeight, s.stage_of(r, w.chunk));
      --held[r];
    }
    if (end >= 0) {
      free_at[r] = end;
      makespan = std::max(makespan, end);
      --remaining;
      continue;
    }
    waiting[r] = 1;  // idle until another rank's compute ends
  }
  return makespan;
}

// The V schedule of the policies tried with the shortest step (the first found of equals): the
// plain greedy one first, then with W's forced at each count owed, or where memory stops an F,
// then all of those keeping a slot for chunk 1, then all of those running F's before B's. With
// stage costs, each policy is also scheduled as if the stages cost the same, and that order timed
// on the real costs: the greedy choices on the real costs are not always better. The costs are
// s.costs.
void zero_bubble_v(PipelineSchedule& s) {
  const int pp = s.pp;
  const StageCosts& costs = s.costs;
  const bool unequal = !costs.forward.empty() || !costs.backward_input.empty() ||
                       !costs.backward_weight.empty();
  Costs timed;
  timed.stages = &costs;
  double best_step = -1;
  std::vector<std::vector<PipeAction>> best;
  std::vector<VPolicy> policies;  // in the order above
  for (const bool f_before_b : {false, true})
    for (const bool keep_a_slot : {false, true})
      for (int max_owed = 0; max_owed <= 2 * pp; ++max_owed)
        for (const bool w_when_full : {false, true})
          for (const bool b_chunk1_first : {false, true})
            policies.push_back({.b_chunk1_first = b_chunk1_first,
                                .max_owed = max_owed,
                                .w_when_full = w_when_full,
                                .keep_a_slot_for_chunk1 = keep_a_slot,
                                .f_before_b = f_before_b});
  for (const VPolicy& p : policies)
    for (const bool on_unit_costs : {false, true}) {
      if (on_unit_costs && !unequal) continue;
      s.actions.assign(pp, {});
      double step = list_schedule_v(s, on_unit_costs ? StageCosts{} : costs, 2 * pp, p);
      if (step > 0 && on_unit_costs) {
        const Simulation sim = simulate(s, timed);
        step = *std::max_element(sim.clock.begin(), sim.clock.end());
      }
      if (step > 0 && (best_step < 0 || step < best_step)) {
        best_step = step;
        best = s.actions;
      }
    }
  LOOM_CHECK_MSG(best_step > 0, "zb-v: no policy schedules this pipeline");
  s.actions = std::move(best);
}

}  // namespace

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
