// Pipeline schedules as data (issue 6): for each pipeline rank, the ordered list of actions it
// performs in one training step. One engine (pipeline_parallel.h) executes any schedule; the
// generators below make GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1, interleaved zero
// bubble and ZB-V; check_schedule() proves a schedule free of deadlocks before it runs.
//
// Model stages: with pp ranks and v virtual stages (chunks) per rank, the model is cut into
// S = pp·v stages. Looped placement (every schedule but zb-v): stage s runs on rank s % pp as its
// chunk s / pp (Megatron's interleaved assignment; v = 1 gives stage s = rank s). V placement
// (zb-v, v = 2): chunk 0 of rank r is stage r and chunk 1 is stage 2pp − 1 − r, so the model goes
// down the ranks and back up: rank 0 holds the first and the last stage, and rank pp − 1 hands
// stage pp − 1's output to its own stage pp (a message to itself, which the engine keeps in
// memory). Stage 0 holds the embedding, stage S−1 the final LayerNorm, LM head and loss.
//
// Data flow of micro-batch i: Forward(i, s) needs the activation Stage s−1 sent (s > 0);
// Backward(i, s) needs Forward(i, s) done on this rank and the activation gradient stage s+1
// sent (s < S−1; the last stage starts backward from its own loss).
// Actions: kRecvForward(i, c) receives stage s−1's output of micro-batch i for chunk c (absent on
// stage 0), kForward(i, c), kSendForward(i, c) sends to stage s+1 (absent on stage S−1);
// kRecvBackward / kBackward / kSendBackward mirror them towards stage s−1.
// Zero-bubble schedules split kBackward in two (Qi et al., "Zero Bubble Pipeline Parallelism",
// 2023): kBackwardInput (B) computes the input gradient, which kSendBackward then sends, and
// kBackwardWeight (W), later on the same rank, the weight gradients, which no other stage waits
// for (nn/deferred_weight_grads.h). A (micro-batch, chunk) has either kBackward or both halves.
// Execution model (what check_schedule simulates and the engine does): sends are non-blocking
// (they complete once issued; the engine waits for them at the end of the step), receives block
// until the matching send has been issued.
#pragma once

#include <string>
#include <vector>

namespace loom {

enum class PipeActionKind {
  kRecvForward,
  kForward,
  kSendForward,
  kRecvBackward,
  kBackward,
  kSendBackward,
  kBackwardInput,
  kBackwardWeight
};

struct PipeAction {
  PipeActionKind kind;
  int microbatch = 0;
  int chunk = 0;  // virtual stage on this rank, 0..v−1; model stage = chunk·pp + rank
  bool operator==(const PipeAction&) const = default;
};

// What one micro-batch's forward, input-gradient backward (B) and weight-gradient backward (W)
// cost on each stage (any unit, one entry per stage); empty = one unit each.
struct StageCosts {
  std::vector<double> forward, backward_input, backward_weight;
};

struct PipelineSchedule {
  std::string name;        // "gpipe", "1f1b", "interleaved", "zb-h1", "zb-interleaved", "zb-v"
  int pp = 1;              // pipeline ranks
  int microbatches = 1;    // m
  int virtual_stages = 1;  // v (chunks per rank)
  bool v_placement = false;  // odd chunks run the ranks backwards (zb-v); else looped
  StageCosts costs;          // what zb-v's order was simulated on (empty: one unit each)
  std::vector<std::vector<PipeAction>> actions;  // [rank] -> ordered actions

  int stages() const { return pp * virtual_stages; }
  int stage_of(int rank, int chunk) const {
    return v_placement && chunk % 2 == 1 ? (chunk + 1) * pp - 1 - rank : chunk * pp + rank;
  }
  int rank_of_stage(int stage) const {
    return v_placement && (stage / pp) % 2 == 1 ? pp - 1 - stage % pp : stage % pp;
  }
  int chunk_of_stage(int stage) const { return stage / pp; }
};

// Builds a schedule: "gpipe" (all forwards, then all backwards), "1f1b" (warm-up forwards, then
// one forward one backward, at most pp micro-batches in flight on the first stage),
// "interleaved" (1F1B over v chunks per rank; needs microbatches % pp == 0), or "zb-h1" (1F1B
// with each backward split into B and W, the W's put off to fill the drain: a third of 1F1B's
// bubble when F, B and W cost the same, and no more micro-batches in flight than 1F1B), or
// "zb-interleaved" (interleaved with each backward split into B and W, the W's filling the
// time a rank would wait, at most pp owed per rank; the same order of gradient sums), or "zb-v"
// (two chunks per rank in the V placement, v = 2, any m: F, B and W placed by a list scheduler
// that keeps at most 2·pp chunk micro-batches between F and W on a rank — 1F1B's activations,
// each chunk being half a 1F1B stage — a ready B first, then the oldest ready F, then an owed W,
// simulated on `costs` where given (the stages' own: unequal stages shift the best order), else
// one unit each; each chunk's B's and W's in micro-batch order, so the gradients sum as
// interleaved's do). Throws loom::Error naming the parameter for an unknown name or an invalid
// combination (pp, m, v < 1; v > 1 without "interleaved", "zb-interleaved" or "zb-v"; those two
// with m not a multiple of pp; "zb-v" with v ≠ 2).
PipelineSchedule make_schedule(const std::string& name, int pp, int microbatches, int virtual_stages = 1,
                               const StageCosts& costs = {});

// Where a schedule puts the stages: a PipelineSchedule with no actions, its placement fields set
// (v_placement for "zb-v"), for code that only asks stage_of / rank_of_stage (the planner).
PipelineSchedule stage_placement(const std::string& name, int pp, int virtual_stages);

// Simulates the schedule (non-blocking sends, blocking receives) and checks that every rank runs
// to the end, that every micro-batch goes forward then backward through every stage exactly
// once, and that sends and receives pair up. Throws loom::Error naming the rank, the action and
// what it waits for on a deadlock or a malformed schedule.
void check_schedule(const PipelineSchedule& schedule);

// A text timeline, one row per rank, one column per time unit of a unit-cost simulation
// (forward 1 unit, backward 2 units — or its halves B and W 1 unit each —, communication free):
// "F3" / "B3" / "W3" cells (micro-batch; with chunks "F3a", "F3b"...), "." idle. Followed by the
// simulated bubble fraction and the theoretical one. For `loom schedule` and the docs. Runs
// check_schedule() first, so a malformed schedule throws the same loom::Error instead of being
// drawn.
std::string render_timeline(const PipelineSchedule& schedule);

// (p − 1) / (m + p − 1), divided by v for interleaved: the idle fraction of 1F1B and GPipe
// with forward and backward of equal cost per stage; for zb-h1 (p − 1) / (3m + p − 1), its idle
// fraction when F, B and W cost one unit each (the drain of p − 1 units, not 3(p − 1)), or
// (2p − m − 1) / (2m + 2p − 1) with fewer micro-batches than ranks; for zb-interleaved, whose
// W's its generator placed by simulation, simulated_bubble(); for zb-v the simulation on the
// stage costs its order was built for (simulated_bubble(s, s.costs)).
double theoretical_bubble(const PipelineSchedule& schedule);

// The idle fraction of the timeline's unit-cost simulation (render_timeline's costs).
double simulated_bubble(const PipelineSchedule& schedule);
// The idle fraction of a simulation on the stages' own costs (a whole backward costs B + W).
double simulated_bubble(const PipelineSchedule& schedule, const StageCosts& costs);

}  // namespace loom
