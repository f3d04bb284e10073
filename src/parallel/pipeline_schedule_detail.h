// Pipeline schedules' insides, shared by pipeline_schedule.cc (the generators, the checks, the
// simulation and the timeline) and zero_bubble_schedules.cc: private to src/parallel.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/pipeline_schedule.h"

namespace loom::pipeline_detail {

using K = PipeActionKind;

inline bool is_recv(K k) { return k == K::kRecvForward || k == K::kRecvBackward; }
inline bool is_send(K k) { return k == K::kSendForward || k == K::kSendBackward; }
inline bool is_forward_dir(K k) {
  return k == K::kRecvForward || k == K::kForward || k == K::kSendForward;
}

// The message a send or receive action moves, as a number unique in the schedule (its direction,
// micro-batch and the stage it goes to); -1 for a compute.
int64_t message_of(const PipelineSchedule& s, int rank, const PipeAction& a);

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

Simulation simulate(const PipelineSchedule& s, const Costs& costs);

// Checks that between every two ranks the receiver takes the messages in the order the sender
// sends them; fails naming the first that is not.
void check_pair_order(const PipelineSchedule& s);

// The zero-bubble schedules (zero_bubble_schedules.cc): zb-h1 built into an empty `s`,
// zb-interleaved from interleaved 1F1B's actions in `s`, zb-v into an empty `s` from s.costs.
void zero_bubble_h1(PipelineSchedule& s);
void fill_idle_with_weight_grads(PipelineSchedule& s, int max_owed);
void zero_bubble_v(PipelineSchedule& s);

}  // namespace loom::pipeline_detail
