// The zero-bubble pipeline schedules (Qi et al. 2023), each backward split into B (the input
// gradient, which the previous stage waits for) and W (the weight gradients, which nobody waits
// for); make_schedule (pipeline_schedule.cc) calls them:
//
// zb-h1 (zero_bubble_h1) follows the paper's steady-state rule: rank r runs, for x = 0, 1, ...,
// m + pp − 2, the triple (F of micro-batch x, B of x − (pp − 1 − r), W of x − (pp − 1)), each
// where its micro-batch exists.
//
// zb-interleaved (fill_idle_with_weight_grads) is interleaved 1F1B with every backward split into
// B and W, the W's placed by a unit-cost simulation: where a rank would wait for a message it runs
// its oldest owed W instead, and it never owes more than pp of them.
//
// zb-v (zero_bubble_v) is a list schedule: a unit-time simulation in which every idle rank picks
// its next compute from what its messages allow, under a memory bound.
#include <algorithm>
#include <cstdint>
#include <deque>
#include <tuple>
#include <vector>

#include "base/check.h"
#include "base/error.h"
#include "parallel/pipeline_schedule_detail.h"

namespace loom::pipeline_detail {

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

namespace {

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
// policy stalls (its bounds leave nothing to run) or its step grows past `give_up_after` (> 0;
// the makespan only grows as computes are placed, so such a policy cannot end shorter).
// Event-driven: the rank that is free earliest (the lowest of equals) picks its next compute from
// the messages that have arrived by then; a message arrives when the compute that sends it ends
// (communication free); a rank with nothing ready waits for the next end of a compute anywhere.
// With unit costs this is the unit-time simulation the timeline draws.
double list_schedule_v(PipelineSchedule& s, const StageCosts& costs, int limit,
                       const VPolicy& policy, double give_up_after = -1) {
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
  // Received already: [(backward ? m : 0) + micro-batch) · S + stage].
  std::vector<char> received(static_cast<size_t>(2) * m * S, 0);
  const auto send = [&](int from, int to_stage, const PipeAction& recv_there) {
    in_transit[from][s.rank_of_stage(to_stage)].push_back(recv_there);
  };
  const auto receive = [&](int r, int from, const PipeAction& wanted) {
    const auto key = [&](const PipeAction& a) {
      LOOM_CHECK(a.kind == K::kRecvForward || a.kind == K::kRecvBackward);
      return (static_cast<size_t>(a.kind == K::kRecvBackward ? m : 0) + a.microbatch) * S +
             s.stage_of(r, a.chunk);
    };
    if (received[key(wanted)]) return;
    for (auto& queue = in_transit[from][r];;) {
      LOOM_CHECK(!queue.empty());
      const PipeAction a = queue.front();
      queue.pop_front();
      s.actions[r].push_back(a);
      received[key(a)] = 1;
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
      if (give_up_after > 0 && makespan > give_up_after) return -1;
      --remaining;
      continue;
    }
    waiting[r] = 1;  // idle until another rank's compute ends
  }
  return makespan;
}

}  // namespace

// The V schedule of the policies tried with the shortest step (the first found of equals): the
// plain greedy one first, then with W's forced at each count owed, or where memory stops an F,
// then all of those keeping a slot for chunk 1, then all of those running F's before B's. With
// stage costs, each policy is also scheduled as if the stages cost the same, and that order timed
// on the real costs: the greedy choices on the real costs are not always better. The costs are
// s.costs. The same schedule as trying them all, sooner: a policy scheduled on the real costs is
// given up once its step passes the best so far (`loom plan` times hundreds of these).
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
      double step = list_schedule_v(s, on_unit_costs ? StageCosts{} : costs, 2 * pp, p,
                                    on_unit_costs ? -1 : best_step);
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

}  // namespace loom::pipeline_detail
