// The layout planner behind `loom plan`: for a model and a batch on N devices of a kind, every
// dp × tp × pp × ZeRO layout Loom can run, with each rank's memory and a step-time estimate,
// before a GPU is rented (docs/planner.md).
//
// Memory is counted, not guessed: each rank's parameter elements from the model's shapes (the
// pipeline's stage split, tensor-parallel shards with the vocabulary padded, replicated
// parameters whole), times 4 bytes for the values, 4 for the gradients and 8 for AdamW's moments,
// each divided by dp (dp_shard under hybrid sharding) where the ZeRO stage shards it; plus the
// activation inventory of train/layout_report.h. The step time is a model: the GEMM FLOPs at a
// fraction of the device's peak (`efficiency`), the pipeline bubble of the schedule, the
// tensor-parallel all-reduces on the critical path, the data-parallel gradient reduction less what
// backward hides, the ZeRO gathers and the pipeline's activation messages, each at the bandwidth of
// the link the group crosses (NVLink or PCIe within a node, the network between nodes; tp
// innermost, then dp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"

namespace loom {

struct Hardware {
  std::string name;
  double peak_tflops = 0;      // dense bf16 matrix rate of one device
  double memory_gib = 0;       // per device
  double intra_node_gbps = 0;  // per device and direction, to the others of its node
  double inter_node_gbps = 0;  // per device and direction, across nodes
  int devices_per_node = 8;
  std::string link;  // "NVLink 4 + InfiniBand NDR", for the report
};

// The kinds `loom plan --hardware` knows (h100, h200, a100-80g, a100-40g, h100-pcie, l40s).
const std::vector<Hardware>& known_hardware();
// Throws loom::Error listing the known names for an unknown one.
const Hardware& find_hardware(const std::string& name);

struct PlanOptions {
  int devices = 8;
  Hardware hardware;
  double efficiency = 0.5;  // the share of the peak the GEMMs reach (PyTorch / llm.c: ~0.4-0.6)
  // With pp > 1, plan_layouts tries every pipeline schedule (1f1b, zb-h1, and with 2 chunks
  // per rank interleaved, zb-interleaved and zb-v, where the micro-batches and blocks allow), not
  // only the config's (`loom plan --schedules config`: the config's alone).
  bool every_schedule = true;
  // Context parallelism: plan_layouts also splits sequences over cp = 2, 4, ... ranks where
  // model.seq_len allows (a multiple of 2·cp), each with both exchanges (parallel.cp_comm =
  // "all_gather" and "ring") — `loom plan --cp config`: the config's cp and exchange alone.
  bool every_cp = true;
  // Hybrid sharding: plan_layouts also shards ZeRO 1-3's state over groups of dp_shard dp ranks,
  // the largest dp_shard below dp dividing it whose group (tp × cp × dp_shard devices) fits in a
  // node — smaller groups hold more state and send more between nodes in the model (`loom plan
  // --dp-shard config`: the config's alone).
  bool every_dp_shard = true;
};

struct LayoutPlan {
  int dp = 1, tp = 1, pp = 1, cp = 1, zero = 0;
  int ep = 1;  // expert parallelism (a mixture of experts): groups of ep of the dp ranks
  // Hybrid sharding (parallel.dp_shard): ZeRO's state sharded over groups of dp_shard dp ranks,
  // replicated over dp / dp_shard; 0 = over all of dp.
  int dp_shard = 0;
  std::string ep_dispatch = "all_gather";  // with ep > 1: parallel.ep_dispatch
  std::string cp_comm = "all_gather";  // with cp > 1: parallel.cp_comm
  std::string schedule = "1f1b";       // with pp > 1
  int virtual_stages = 1;
  // The rank with the most bytes.
  int64_t parameters = 0;        // its parameter elements (its shards)
  int64_t state_bytes = 0;       // values + gradients + AdamW moments, as its ZeRO stage keeps them
  int64_t activation_bytes = 0;  // at its peak (layout_report.h)
  int64_t total_bytes() const { return state_bytes + activation_bytes; }
  bool fits = false;  // total within the device's memory (less 10% for the runtime)
  // The step, seconds.
  double compute_s = 0, bubble_s = 0, tp_comm_s = 0, dp_comm_s = 0, pp_comm_s = 0, cp_comm_s = 0;
  double ep_comm_s = 0;  // expert parallelism's token exchange, on the critical path
  double step_s() const {
    return compute_s + bubble_s + tp_comm_s + dp_comm_s + pp_comm_s + cp_comm_s + ep_comm_s;
  }
  double tokens_per_s = 0, mfu = 0;
  // "dp4 tp2 pp1 zero1", "dp2 tp1 pp4 zero1 zb-interleaved v2", "dp2 tp2 pp1 cp2 zero1",
  // "dp1 tp1 pp1 cp4 ring zero0" (the ring exchange), "dp8 tp1 pp1 ep4 zero1" (experts split),
  // "dp8 tp1 pp1 ep4 a2a zero1" (by the all-to-all dispatcher), "dp16 tp1 pp1 zero3 shard8"
  // (hybrid sharding)
  std::string name() const;
};

// The parameter elements of each unit (an engine's unit of communication: a block, or the root
// of embeddings / final LayerNorm / head) the rank at pipeline coordinate pp_rank holds under the
// config's layout: its chunks' blocks, embeddings on the first stage, the final LayerNorm and the
// tied head's copy on the last; tensor-parallel shards of the matrices and of the biases of
// column-parallel layers, the vocabulary padded to a multiple of tp, everything else whole.
// One list per model chunk of the rank (virtual stages), each held by an engine of its own.
// Under expert parallelism (parallel.ep) each block of a mixture is two units, as the engines
// hold it: the block's replicated parameters, then its E/ep experts (ParamUnit::experts).
std::vector<std::vector<int64_t>> rank_units(const Config& config, int pp_rank);
// The state buffers, in bytes, of the rank at pp_rank: for each of its chunks' engines the
// values, the gradients and AdamW's two moments, each unit padded as the engine pads it (to 16
// elements, 16 × dp under ZeRO), 4 bytes an element, divided by dp (by dp_shard under hybrid
// sharding) where the ZeRO stage shards the buffer (moments from 1, gradients from 2, values at
// 3) — expert units by dp/ep; dp counting cp's ranks. What the
// engines ask their allocator for; a caching allocator rounds each request up (CPU: up to 12.5%).
// On a GPU at bf16 / fp16 under ZeRO 0-2 also each chunk's 16-bit weight copies
// (rank_weight_copy_values × 2 bytes).
std::vector<int64_t> rank_state_buffers(const Config& config, int pp_rank);
// The values of the 16-bit weight copies each of the rank's chunks keeps on a GPU at bf16 / fp16
// (nn/rounded_weights.h): its blocks' Linears' weights and, on the last stage, the LM head's (its
// vocabulary rows under tensor parallelism), each padded to 8 values.
std::vector<int64_t> rank_weight_copy_values(const Config& config, int pp_rank);

// One layout (the config's parallel section, resolved for options.devices ranks).
LayoutPlan estimate_layout(const Config& config, const PlanOptions& options);

// Every layout of options.devices ranks the config allows (dp × tp × pp × cp = devices, tp dividing
// the heads, dp dividing the batch into micro-batches, ZeRO 0-3, 0-1 with pp; for a mixture of
// experts every ep dividing dp and the experts, with either dispatcher), fitting ones first, each
// group by step time.
std::vector<LayoutPlan> plan_layouts(const Config& config, const PlanOptions& options);

std::string format_plan(const Config& config, const PlanOptions& options,
                        const std::vector<LayoutPlan>& plans, size_t top);

// The time of a ring all-reduce (or reduce-scatter + all-gather) of `bytes` over `n` ranks at
// `gbps` per rank and direction: 2 (n - 1) / n · bytes / bandwidth. 0 for n = 1.
double all_reduce_seconds(double bytes, int n, double gbps);

}  // namespace loom
