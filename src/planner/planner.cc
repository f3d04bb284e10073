#include "planner/planner.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <mutex>
#include <tuple>

#include "base/error.h"
#include "models/gpt2.h"
#include "parallel/pipeline_parallel.h"
#include "train/layout_report.h"
#include "train/trainer.h"

namespace loom {

const std::vector<Hardware>& known_hardware() {
  // Dense bf16 rates and link speeds from the vendors' data sheets; bandwidths per GPU and
  // direction (NVLink 4: 900 GB/s both ways; PCIe 5 x16: 64 GB/s, ~50 in practice; one
  // 400 Gb/s NDR or 200 Gb/s HDR InfiniBand port per GPU).
  static const std::vector<Hardware> list = {
      {"h100", 989, 80, 450, 50, 8, "H100 SXM: NVLink 4 in the node, InfiniBand NDR between"},
      {"h200", 989, 141, 450, 50, 8, "H200 SXM: NVLink 4 in the node, InfiniBand NDR between"},
      {"a100-80g", 312, 80, 300, 25, 8, "A100 SXM 80 GB: NVLink 3, InfiniBand HDR"},
      {"a100-40g", 312, 40, 300, 25, 8, "A100 SXM 40 GB: NVLink 3, InfiniBand HDR"},
      {"h100-pcie", 756, 80, 50, 50, 8, "H100 PCIe: PCIe 5 in the node, InfiniBand NDR between"},
      {"l40s", 362, 48, 25, 25, 8, "L40S: PCIe 4 in the node, 200 Gb/s Ethernet between"},
  };
  return list;
}

const Hardware& find_hardware(const std::string& name) {
  std::string names;
  for (const Hardware& h : known_hardware()) {
    if (h.name == name) return h;
    names += (names.empty() ? "" : ", ") + h.name;
  }
  fail("--hardware ", name, ": unknown; known: ", names);
}

std::string LayoutPlan::name() const {
  // "dp tp pp", then cp (and its ring) and ep (and its all-to-all) where they split, then ZeRO.
  std::string out =
      "dp" + std::to_string(dp) + " tp" + std::to_string(tp) + " pp" + std::to_string(pp);
  if (cp > 1) out += " cp" + std::to_string(cp) + (cp_comm == "ring" ? " ring" : "");
  if (ep > 1) out += " ep" + std::to_string(ep) + (ep_dispatch == "all_to_all" ? " a2a" : "");
  out += " zero" + std::to_string(zero);
  if (dp_shard > 0 && dp_shard < dp) out += " shard" + std::to_string(dp_shard);
  if (pp > 1) out += " " + schedule;
  if (pp > 1 && virtual_stages > 1) out += " v" + std::to_string(virtual_stages);
  return out;
}

double all_reduce_seconds(double bytes, int n, double gbps) {
  if (n <= 1 || bytes <= 0) return 0;
  return 2.0 * (n - 1) / n * bytes / (gbps * 1e9);
}

namespace {
// zb-v's unit-cost idle fraction, simulated once per (pp, micro-batches, chunks): `loom plan`
// asks for the same few hundreds of times (every tp, cp, ZeRO stage and sharding of a pipeline
// layout), and building the schedule of hundreds of micro-batches is most of a plan's time.
double zb_v_unit_cost_bubble(int pp, int microbatches, int virtual_stages) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int>, double> known;
  const std::tuple<int, int, int> key{pp, microbatches, virtual_stages};
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = known.find(key); it != known.end()) return it->second;
  }
  const double b = simulated_bubble(make_schedule("zb-v", pp, microbatches, virtual_stages));
  std::lock_guard<std::mutex> lock(mutex);
  known.emplace(key, b);
  return b;
}

// One of a rank's model chunks (virtual stages): its pipeline stage and blocks [first, end), as
// the trainer partitions them (pipeline_partition, stage_placement).
struct ChunkBlocks {
  int stage = 0;
  int64_t first = 0, end = 0;
};
std::vector<ChunkBlocks> rank_chunks(const Config& config, int pp_rank) {
  const ParallelConfig& par = config.parallel;
  const PipelineSchedule placement = stage_placement(par.schedule, par.pp, par.virtual_stages);
  const std::vector<int64_t> bounds =
      pipeline_partition(model_config_of(config), config.model.seq_len, par.pp * par.virtual_stages,
                         par.layer_split, placement.v_placement);
  std::vector<ChunkBlocks> chunks;
  for (int c = 0; c < par.virtual_stages; ++c) {
    const int stage = placement.stage_of(pp_rank, c);
    chunks.push_back({stage, bounds[stage], bounds[stage + 1]});
  }
  return chunks;
}
}  // namespace

namespace {
struct PlannedUnit {
  int64_t numel = 0;
  bool experts = false;  // a block's experts under expert parallelism
};
std::vector<std::vector<PlannedUnit>> planned_units(const Config& config, int pp_rank) {
  const ParallelConfig& par = config.parallel;
  const Gpt2Config model = model_config_of(config);
  const int64_t d = model.d_model, P = par.tp;
  const int64_t vocab_rows = P > 1 ? (model.vocab_size + P - 1) / P : model.vocab_size;
  // GPT-2: the matrices and their column-parallel biases split over tp; the LayerNorms and the
  // row-parallel biases replicated. Llama: the matrices split, the two RMSNorms replicated; a
  // mixture of experts every expert's SwiGLU and the shared experts' split likewise, its router
  // replicated; Qwen 2's qkv bias split with qkv's rows, Qwen 3's two head norms replicated
  // (OLMo 2's over all the heads split).
  // Under expert parallelism a block's E/ep experts are a unit of their own.
  const int64_t ep = model.moe() ? std::max(par.ep, 1) : 1;
  const int64_t expert_unit = ep > 1 ? model.moe_experts / ep * 3 * d * model.hidden() / P : 0;
  const int64_t mlp = model.moe() ? (ep > 1 ? 0 : model.moe_experts * 3 * d * model.hidden()) +
                                        model.moe_shared_experts * 3 * d * model.hidden()
                                  : 3 * d * model.hidden();
  const int64_t router = model.moe() ? d * model.moe_experts : 0;
  const int64_t llama_matrices = d * model.qkv_width() + model.attention_width() * d + mlp;
  const int64_t qkv_bias = model.llama() && model.qkv_bias ? model.qkv_width() / P : 0;
  // OLMo 2's full-width query/key norms are split over tp with the heads (nn/split_rms_norm.h).
  const int64_t qk_norm = model.qk_norm_params() / (model.qk_norm_full ? P : 1);
  const int64_t norms = model.sandwich_norm ? 4 * d : 2 * d;  // Gemma's sandwich: four a block
  const int64_t per_block = model.llama() ? llama_matrices / P + qkv_bias + qk_norm + router + norms
                            : P > 1       ? 12 * d * d / P + 7 * d / P + 6 * d
                                          : 12 * d * d + 13 * d;
  const int64_t ln_f = model.llama() ? d : 2 * d;
  const int stages = par.pp * par.virtual_stages;
  std::vector<std::vector<PlannedUnit>> chunks;
  for (const ChunkBlocks& chunk : rank_chunks(config, pp_rank)) {
    std::vector<PlannedUnit>& units = chunks.emplace_back();
    const int stage = chunk.stage;
    int64_t root = 0;
    if (stage == 0) root += vocab_rows * d + model.position_rows() * d;         // wte, wpe
    // ln_f, and the head's copy of the tied wte (on a later stage) or its own lm_head.weight
    if (stage == stages - 1)
      root += ln_f + (stages > 1 || !model.tie_embeddings ? vocab_rows * d : 0);
    if (root > 0) units.push_back({root, false});
    for (int64_t b = chunk.first; b < chunk.end; ++b) {
      units.push_back({per_block, false});
      if (expert_unit > 0) units.push_back({expert_unit, true});
    }
  }
  return chunks;
}
}  // namespace

std::vector<std::vector<int64_t>> rank_units(const Config& config, int pp_rank) {
  std::vector<std::vector<int64_t>> out;
  for (const std::vector<PlannedUnit>& chunk : planned_units(config, pp_rank)) {
    std::vector<int64_t>& units = out.emplace_back();
    for (const PlannedUnit& u : chunk) units.push_back(u.numel);
  }
  return out;
}

std::vector<int64_t> rank_state_buffers(const Config& config, int pp_rank) {
  // The engines' group is dp × cp (context parallelism's ranks hold the same parameters); an
  // expert unit's the dp/ep ranks holding its experts.
  const int64_t dp = int64_t{config.parallel.dp} * std::max(config.parallel.cp, 1);
  const int64_t experts_dp = dp / std::max(config.parallel.ep, 1);
  // Hybrid sharding: dense units' chunks over the shard group (dp_shard × cp ranks).
  const int64_t shard_ranks =
      config.parallel.hybrid_sharding()
          ? int64_t{config.parallel.dp_shard} * std::max(config.parallel.cp, 1)
          : dp;
  const int64_t zero = config.parallel.zero;
  const int64_t multiple = zero == 0 ? 16 : 16 * dp;
  std::vector<int64_t> buffers;
  for (const std::vector<PlannedUnit>& units : planned_units(config, pp_rank)) {
    // The chunk's flat buffers (every unit padded) and its shard (each unit's chunk).
    int64_t n = 0, shard = 0;
    for (const PlannedUnit& u : units) {
      const int64_t padded = (u.numel + multiple - 1) / multiple * multiple;
      n += padded;
      shard += padded / (u.experts ? experts_dp : shard_ranks);
    }
    buffers.push_back(4 * (zero >= 3 ? shard : n));  // values
    buffers.push_back(4 * (zero >= 2 ? shard : n));  // gradients
    buffers.push_back(4 * (zero >= 1 ? shard : n));  // first moment
    buffers.push_back(4 * (zero >= 1 ? shard : n));  // second moment
  }
  // On a GPU at bf16 / fp16 under ZeRO 0-2: each chunk's engine keeps its GEMM weights' 16-bit
  // copies (nn/rounded_weights.h), each padded to 8 values.
  if (gpu_sixteen_bit_operands(config) && zero < 3)
    for (int64_t values : rank_weight_copy_values(config, pp_rank)) buffers.push_back(2 * values);
  return buffers;
}

std::vector<int64_t> rank_weight_copy_values(const Config& config, int pp_rank) {
  const ParallelConfig& par = config.parallel;
  const Gpt2Config model = model_config_of(config);
  const int64_t d = model.d_model, P = par.tp;
  const int64_t vocab_rows = P > 1 ? (model.vocab_size + P - 1) / P : model.vocab_size;
  const auto padded = [](int64_t n) { return (n + 7) / 8 * 8; };
  // A block's Linears: qkv and the MLP's fc split by rows over tp, the two projections by
  // columns (a Llama's gate and up are one fc of 2H rows); a mixture's router (whole) and each
  // expert's fc and proj (split as the SwiGLU's).
  const int64_t fc_rows = model.llama() ? 2 * model.hidden() : model.hidden();
  const int64_t shared = model.moe_shared_experts * model.hidden();  // the shared experts' width
  const int64_t held_experts = model.moe_experts / std::max(par.ep, 1);  // this rank's
  const int64_t mlp =
      model.moe()
          ? padded(model.moe_experts * d) +
                held_experts * (padded(fc_rows / P * d) + padded(d * (model.hidden() / P))) +
                (shared > 0 ? padded(2 * shared / P * d) + padded(d * (shared / P)) : 0)
          : padded(fc_rows / P * d) + padded(d * (model.hidden() / P));
  const int64_t per_block =
      padded(model.qkv_width() / P * d) + padded(d * (model.attention_width() / P)) + mlp;
  const int stages = par.pp * par.virtual_stages;
  std::vector<int64_t> chunks;
  for (const ChunkBlocks& chunk : rank_chunks(config, pp_rank)) {
    int64_t values = (chunk.end - chunk.first) * per_block;
    // The LM head's weight on the last stage (tied or not; under tp its vocabulary rows).
    if (chunk.stage == stages - 1) values += padded(vocab_rows * d);
    chunks.push_back(values);
  }
  return chunks;
}

LayoutPlan estimate_layout(const Config& config_in, const PlanOptions& o) {
  Config config = config_in;
  // The activation inventory of a GPU run at bf16 (layout_report.h).
  config.runtime.device = "cuda";
  config.runtime.matmul_precision = "bf16";
  config.runtime.ranks = o.devices;
  resolve_parallel_degrees(config.parallel, o.devices);
  validate(config);
  const ParallelConfig& par = config.parallel;
  const Hardware& hw = o.hardware;
  LayoutPlan plan;
  plan.dp = par.dp;
  plan.tp = par.tp;
  plan.pp = par.pp;
  plan.cp = par.cp;
  plan.cp_comm = par.cp_comm;
  plan.zero = par.zero;
  plan.dp_shard = par.hybrid_sharding() ? par.dp_shard : 0;
  plan.ep = par.ep;
  plan.ep_dispatch = par.ep_dispatch;
  plan.schedule = par.schedule;
  plan.virtual_stages = par.virtual_stages;

  int64_t most_blocks = 0, most_params = 0, most_expert_params = 0;
  for (int r = 0; r < par.pp; ++r) {
    int64_t params = 0, blocks = 0, state = 0, expert_params = 0;
    for (const std::vector<PlannedUnit>& units : planned_units(config, r))
      for (const PlannedUnit& u : units) {
        params += u.numel;
        if (u.experts) expert_params += u.numel;
      }
    for (int64_t b : rank_state_buffers(config, r)) state += b;
    for (const ChunkBlocks& chunk : rank_chunks(config, r)) blocks += chunk.end - chunk.first;
    const int64_t activations = expected_activation_bytes(config, r, blocks);
    if (state + activations > plan.total_bytes()) {
      plan.state_bytes = state;
      plan.activation_bytes = activations;
      plan.parameters = params;
    }
    most_blocks = std::max(most_blocks, blocks);
    most_params = std::max(most_params, params);
    most_expert_params = std::max(most_expert_params, expert_params);
  }
  plan.fits = static_cast<double>(plan.total_bytes()) <= 0.9 * hw.memory_gib * 1073741824.0;

  // Compute: the model's FLOPs shared by every device at `efficiency` of the peak; full
  // recomputation runs each forward twice (4/3 of the FLOPs).
  const double tokens = static_cast<double>(config.train.batch_size * config.model.seq_len);
  const double flops = model_config_of(config).flops_per_token(config.model.seq_len) * tokens;
  const double recompute = config.resolved_recompute() == "full" ? 4.0 / 3.0 : 1.0;
  plan.compute_s = flops * recompute / (o.devices * hw.peak_tflops * 1e12 * o.efficiency);
  const double m = static_cast<double>(config.grad_accum_steps());
  // The schedule's fill and drain: (pp - 1) micro-batch slots of (v) chunks; zb-h1 fills the
  // drain with weight gradients, leaving (pp - 1) slots of a third of a micro-batch's work (F, B
  // and W taken as equal), and zb-interleaved a third of a chunk's (pipeline_schedules.md: its
  // unit-cost floor, which its generator reaches with m ≥ 2·pp). zb-v's order is itself a
  // simulation, good for any m (far from its floor with fewer micro-batches than ranks): its
  // unit-cost schedule's idle fraction b (stages of equal cost, as the other schedules' figures
  // take them) makes the bubble b / (1 − b) of the compute.
  if (par.pp > 1 && par.schedule == "zb-v") {
    const double b = zb_v_unit_cost_bubble(par.pp, static_cast<int>(m), par.virtual_stages);
    plan.bubble_s = plan.compute_s * b / (1 - b);
  } else if (par.pp > 1) {
    plan.bubble_s = plan.compute_s * (par.pp - 1) /
                    (par.schedule == "interleaved"      ? m * par.virtual_stages
                     : par.schedule == "zb-h1"          ? 3 * m
                     : par.schedule == "zb-interleaved" ? 3 * m * par.virtual_stages
                                                        : m);
  }
  // Links: tp innermost (neighbouring ranks), then dp, then pp.
  const auto gbps = [&](int span) {
    return span <= hw.devices_per_node ? hw.intra_node_gbps : hw.inter_node_gbps;
  };
  // A micro-batch's activations on a rank: its seq_len / cp positions.
  const double activation = static_cast<double>(config.train.micro_batch_size *
                                                config.model.seq_len * config.model.d_model) *
                            4 / par.cp;
  // Tensor parallelism, on the critical path, per block and micro-batch in all-reduces of a
  // micro-batch's f32 activations (an all-gather or a reduce-scatter moves half of one): forward
  // two — without sequence parallelism an all-reduce after each row-parallel layer; with it an
  // all-gather before each column-parallel one, of the norms' 16-bit outputs on these GPUs (a
  // quarter), and a reduce-scatter after each row-parallel one — backward two, and with sequence
  // parallelism the column-parallel layers' kept rows gathered again (Megatron-LM's: counted on
  // the path, though the input gradient's GEMM runs beside it) — the norm outputs' 16 bits, or
  // with selective recomputation rebuilt in f32; full recomputation runs the forward's again.
  const bool sp = par.sequence_parallel;
  const double tp_forward = sp ? 2 * (0.25 + 0.5) : 2.0;
  double tp_per_block = tp_forward + 2;
  const std::string recompute_mode = config.resolved_recompute();
  if (recompute_mode == "full") tp_per_block += tp_forward;
  if (sp) tp_per_block += 2 * (recompute_mode == "selective" ? 0.5 : 0.25);
  plan.tp_comm_s = static_cast<double>(most_blocks) * m * tp_per_block *
                   all_reduce_seconds(activation, par.tp, gbps(par.tp));
  // Data parallelism over the gradients of the largest rank's parameters: f32, or bf16 with
  // parallel.grad_reduce_dtype = "bf16"; ZeRO's parameter all-gathers f32, or for ZeRO-3's
  // forward and backward bf16 with parallel.param_gather_dtype = "bf16".
  // Under expert parallelism the experts' share goes over their dp/ep ranks instead.
  const double expert_share =
      most_params > 0 ? static_cast<double>(most_expert_params) / static_cast<double>(most_params)
                      : 0.0;
  const double params_bytes = static_cast<double>(most_params) * 4;
  const double grads_bytes = params_bytes * (config.parallel.grad_reduce_dtype == "bf16" ? 0.5 : 1);
  const double gathered_bytes =
      params_bytes * (config.parallel.param_gather_dtype == "bf16" ? 0.5 : 1);
  // The gradient group: dp × cp (context parallelism's ranks hold the same parameters).
  const int grad_ranks = par.dp * par.cp;
  const int expert_grad_ranks = grad_ranks / std::max(par.ep, 1);
  const double dp_gbps = gbps(par.tp * par.cp * par.dp);
  // A reduce-scatter's (or all-gather's) time: half an all-reduce's.
  const auto half_over = [&](double bytes, int ranks) {
    return ranks > 1 ? (ranks - 1.0) / ranks * bytes / (dp_gbps * 1e9) : 0;
  };
  const auto half_reduce = [&](double bytes) {
    return half_over(bytes * (1 - expert_share), grad_ranks) +
           half_over(bytes * expert_share, expert_grad_ranks);
  };
  double grads_half = half_reduce(grads_bytes), params_half = half_reduce(params_bytes),
         gathered_half = half_reduce(gathered_bytes);
  // The stage 0 all-reduce spans every dp rank whatever the sharding.
  const double all_reduce_half = grads_half;
  // Hybrid sharding: the dense share's reduce-scatters and gathers within a shard group (its
  // link: a node's when tp × cp × dp_shard fit one), then stages 2/3 all-reduce the reduced
  // chunk — 1/(dp_shard × cp) of the gradients — over the replicas, across the whole dp span.
  double replica_reduce = 0;
  if (par.hybrid_sharding()) {
    const int shard_ranks = par.dp_shard * par.cp;
    const double shard_gbps = gbps(par.tp * par.cp * par.dp_shard);
    const auto half_in_shard = [&](double bytes) {
      const double dense = bytes * (1 - expert_share);
      return (shard_ranks > 1 ? (shard_ranks - 1.0) / shard_ranks * dense / (shard_gbps * 1e9)
                              : 0) +
             half_over(bytes * expert_share, expert_grad_ranks);
    };
    grads_half = half_in_shard(grads_bytes);
    params_half = half_in_shard(params_bytes);
    gathered_half = half_in_shard(gathered_bytes);
    const int replicas = par.dp / par.dp_shard;
    replica_reduce = 2.0 * (replicas - 1) / replicas * grads_bytes * (1 - expert_share) /
                     shard_ranks / (dp_gbps * 1e9);
  }
  const double backward_s = plan.compute_s * 2.0 / 3.0;  // backward is ~2/3 of the FLOPs
  // Stages 0/1 reduce on the step's last micro-batch only: behind its backward alone.
  const double last_backward_s = backward_s / m;
  if (grad_ranks > 1) {
    if (par.zero == 0) plan.dp_comm_s = std::max(0.0, 2 * all_reduce_half - last_backward_s);
    // Stage 1: each unit's gradient reduce-scattered once a step behind backward (and the
    // replicas' all-reduce of the chunk; under pipelining too, the tied embedding's after the
    // backward, a small share left out), then the updated chunks all-gathered (exposed).
    if (par.zero == 1)
      plan.dp_comm_s = std::max(0.0, grads_half + replica_reduce - last_backward_s) + params_half;
    // Stage 2: a reduce-scatter per micro-batch behind backward (and the replicas' all-reduce),
    // the all-gather after the step.
    if (par.zero == 2)
      plan.dp_comm_s = std::max(0.0, m * (grads_half + replica_reduce) - backward_s) + params_half;
    // Stage 3: per micro-batch, the values gathered for forward and for backward and the
    // gradients reduce-scattered, prefetched behind the compute.
    if (par.zero == 3)
      plan.dp_comm_s =
          std::max(0.0, m * (2 * gathered_half + grads_half + replica_reduce) - plan.compute_s);
  }
  // Pipeline messages: each micro-batch's activations forward and their gradients back, per
  // chunk.
  // (In bf16 with parallel.pp_send_dtype = "bf16".)
  if (par.pp > 1)
    plan.pp_comm_s = 2 * m * par.virtual_stages * activation *
                     (config.parallel.pp_send_dtype == "bf16" ? 0.5 : 1.0) /
                     (gbps(par.tp * par.dp * par.pp) * 1e9);
  // Context parallelism (parallel/context_parallel.h), per block and micro-batch. kv_bytes: the
  // whole sequence's keys and values of the rank's heads in fp32; in bf16 where the flash kernels
  // take the rows (head size 64 or 128 at the plan's bf16: nn/sequence_shard.h).
  if (par.cp > 1) {
    const Gpt2Config model = model_config_of(config);
    const double cp = par.cp, link = gbps(par.tp * par.cp) * 1e9;
    const double kv_bytes =
        static_cast<double>(config.train.micro_batch_size * config.model.seq_len) * 2.0 *
        static_cast<double>(model.kv_heads() * model.head_dim()) * 4 / par.tp;
    const double kept =
        !model.qk_norm && (model.head_dim() == 64 || model.head_dim() == 128) ? 0.5 : 1.0;
    const double passes = recompute_mode == "full" ? 2 : 1;  // full recomputation: forward again
    double per_block = 0;
    if (par.cp_comm == "ring") {
      // The ring: each of cp − 1 steps passes a block (1/cp of kv_bytes) while the attention
      // computes on the one before, so only what the transfer takes beyond that compute is on
      // the critical path. A rank's attention per step: the causal attention's FLOPs (forward
      // 2·T²·C a sequence, its heads over tp; backward twice that) over cp ranks and cp blocks.
      // Backward: each step passes the next block and the gradient sum of the last; the last
      // sum's trip home follows the last compute.
      // With a sliding window the attention multiplies the window's pairs only (Σ_p min(p + 1,
      // W) for T²/2, a mean over the blocks it windows), while the ring still passes every block.
      const double block = kept * kv_bytes / cp / link, grad = kv_bytes / cp / link;
      const int64_t T = config.model.seq_len;
      double pairs = 0;  // a block's mean (query, key) pairs of a sequence, doubled
      for (int64_t l = 0; l < model.n_layers; ++l) {
        const int64_t w = model.window_of(l);
        pairs += w > 0 && w < T ? 2.0 * (static_cast<double>(T) * w - 0.5 * w * (w - 1))
                                : static_cast<double>(T) * T;
      }
      pairs /= static_cast<double>(model.n_layers);
      const double forward_step = 2.0 * static_cast<double>(config.train.micro_batch_size) * pairs *
                                  static_cast<double>(model.attention_width()) / par.tp /
                                  (cp * cp) / (hw.peak_tflops * 1e12 * o.efficiency);
      per_block = passes * (cp - 1) * std::max(0.0, block - forward_step) +
                  (cp - 1) * std::max(0.0, block + grad - 2 * forward_step) + grad;
    } else {
      // The all-gather, on the critical path: the keys and values gathered forward, their
      // gradient reduce-scattered backward in fp32; (cp − 1)/cp of kv_bytes each.
      per_block = (passes * kept + 1) * (cp - 1) / cp * kv_bytes / link;
    }
    plan.cp_comm_s = static_cast<double>(most_blocks) * m * per_block;
  }
  // Expert parallelism (parallel/expert_parallel.h), per block and micro-batch, on the critical
  // path: forward the tokens all-gathered over the ep group (in the norm's 16 bits at the plan's
  // bf16) and the outputs reduce-scattered (f32), backward the outputs' gradients gathered and the
  // inputs' reduce-scattered (f32); full recomputation exchanges the forward's again. Each moves
  // (ep − 1) × a rank's rows over the group's links (tp innermost, then the ep group's dp ranks).
  // The all-to-all dispatcher sends a token's row to each chosen expert's rank: of a rank's
  // N·k pairs, (ep − 1) / ep go to other ranks (routing spread evenly), k / ep of the gather's
  // rows, the blocks padded to the fullest (taken as even here).
  if (par.ep > 1) {
    const double rows = static_cast<double>(config.train.micro_batch_size * config.model.seq_len *
                                            config.model.d_model);
    const double forward = rows * (2 + 4), backward = rows * (4 + 4);
    const double passes = recompute_mode == "full" ? 2 : 1;
    const double share = par.ep_dispatch == "all_to_all"
                             ? static_cast<double>(config.model.moe_top_k) / par.ep
                             : 1.0;
    plan.ep_comm_s = static_cast<double>(most_blocks) * m * (par.ep - 1) * share *
                     (passes * forward + backward) / (gbps(par.tp * par.ep) * 1e9);
  }
  plan.tokens_per_s = tokens / plan.step_s();
  plan.mfu = flops / (plan.step_s() * o.devices * hw.peak_tflops * 1e12);
  return plan;
}

std::vector<LayoutPlan> plan_layouts(const Config& config, const PlanOptions& o) {
  std::vector<LayoutPlan> plans;
  std::vector<int> cps = {std::max(config.parallel.cp, 1)};
  if (o.every_cp) {
    cps = {1};
    for (int cp = 2; cp <= o.devices; cp *= 2)
      if (config.model.seq_len % (2 * cp) == 0) cps.push_back(cp);
  }
  // The exchanges to try at cp > 1: the config's, and with every_cp both.
  std::vector<std::string> cp_comms = {config.parallel.cp_comm};
  if (o.every_cp) cp_comms = {"all_gather", "ring"};
  for (int cp : cps) {
    for (const std::string& cp_comm : cp_comms) {
      if (cp == 1 && cp_comm != cp_comms.front()) continue;  // one exchange is none at cp 1
      for (int tp = 1; tp <= o.devices; ++tp) {
        if (o.devices % (tp * cp) != 0) continue;
        for (int pp = 1; pp <= o.devices / (tp * cp); ++pp) {
          if ((o.devices / (tp * cp)) % pp != 0) continue;
          // Expert parallelism for a mixture: every ep dividing dp and the experts.
          const int dp = o.devices / (tp * pp * cp);
          std::vector<int> eps = {1};
          if (config.model.moe_experts > 0)
            for (int ep = 2; ep <= dp; ++ep)
              if (dp % ep == 0 && config.model.moe_experts % ep == 0) eps.push_back(ep);
          for (int ep : eps)
            for (const char* ep_dispatch : {"all_gather", "all_to_all"})
              for (int zero = 0; zero <= (pp > 1 ? 1 : 3); ++zero) {
                if (ep == 1 && std::string(ep_dispatch) != "all_gather") continue;
                // The pipeline schedules to try: the config's, and with every_schedule the others.
                std::vector<std::pair<std::string, int>> schedules = {
                    {config.parallel.schedule, config.parallel.virtual_stages}};
                if (pp == 1) {
                  schedules = {{"1f1b", 1}};
                } else if (o.every_schedule) {
                  for (const auto& s :
                       std::vector<std::pair<std::string, int>>{{"1f1b", 1},
                                                                {"zb-h1", 1},
                                                                {"interleaved", 2},
                                                                {"zb-interleaved", 2},
                                                                {"zb-v", 2}})
                    if (std::find(schedules.begin(), schedules.end(), s) == schedules.end())
                      schedules.push_back(s);
                }
                // Hybrid sharding: the state over groups of dp_shard of the dp ranks — the
                // largest group within a node (the model's smaller ones hold more and send
                // more between nodes).
                std::vector<int> dp_shards = {0};
                if (!o.every_dp_shard) {
                  dp_shards = {config.parallel.dp_shard};
                } else if (zero > 0) {
                  int largest = 0;
                  for (int s = 1; s < dp; ++s)
                    if (dp % s == 0 && tp * cp * s <= o.hardware.devices_per_node) largest = s;
                  if (largest >= 2) dp_shards.push_back(largest);
                }
                for (int dp_shard : dp_shards)
                  for (const auto& [schedule, chunks] : schedules) {
                    Config c = config;
                    c.parallel.dp = dp;
                    c.parallel.dp_shard = dp_shard;
                    c.parallel.ep = ep;
                    c.parallel.ep_dispatch = ep_dispatch;
                    c.parallel.cp = cp;
                    c.parallel.cp_comm = cp_comm;
                    c.parallel.tp = tp;
                    c.parallel.pp = pp;
                    c.parallel.zero = zero;
                    c.parallel.schedule = schedule;
                    c.parallel.virtual_stages = chunks;
                    c.parallel.layer_split.clear();
                    try {
                      plans.push_back(estimate_layout(c, o));
                    } catch (const Error&) {
                      // A layout the config cannot run (tp not dividing the heads, dp not dividing
                      // the batch, more stages than blocks, chunks without the micro-batches in
                      // groups of pp): not a candidate.
                    }
                  }
              }
        }
      }
    }
  }
  std::stable_sort(plans.begin(), plans.end(), [](const LayoutPlan& a, const LayoutPlan& b) {
    if (a.fits != b.fits) return a.fits;
    return a.step_s() < b.step_s();
  });
  return plans;
}

namespace {
std::string parameter_count(int64_t n) {  // "124.5 M", or the count itself below a million
  if (n < 1000000) return std::to_string(n);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f M", static_cast<double>(n) / 1e6);
  return buf;
}
}  // namespace

std::string format_plan(const Config& config, const PlanOptions& o,
                        const std::vector<LayoutPlan>& plans, size_t top) {
  const Gpt2Config model = model_config_of(config);
  const Hardware& hw = o.hardware;
  char line[512];
  std::string out;
  std::snprintf(
      line, sizeof line,
      "model: %s parameters; global batch %ld x %ld tokens, micro-batch %ld\n"
      "devices: %d x %s (%.0f TFLOP/s bf16 at %.0f%% efficiency, %.0f GiB; %s: %.0f / %.0f "
      "GB/s within / between nodes of %d)\n\n",
      parameter_count(model.num_parameters()).c_str(), static_cast<long>(config.train.batch_size),
      static_cast<long>(config.model.seq_len), static_cast<long>(config.train.micro_batch_size),
      o.devices, hw.name.c_str(), hw.peak_tflops, o.efficiency * 100, hw.memory_gib,
      hw.link.c_str(), hw.intra_node_gbps, hw.inter_node_gbps, hw.devices_per_node);
  out += line;
  // The layout column as wide as its longest name (pipeline layouts name their schedule).
  int width = 20;
  for (const LayoutPlan& p : plans) width = std::max(width, static_cast<int>(p.name().size()));
  std::snprintf(line, sizeof line, "%-*s ", width, "layout");
  out += line;
  // A mixture's plans have expert parallelism's exchange as a column of its own.
  const bool experts = model.moe();
  out +=
      "state GiB  activ. GiB  fits  step s   compute  bubble   tp comm  "
      "dp comm  pp comm  cp comm  ";
  out += experts ? "ep comm  tokens/s     MFU\n" : "tokens/s     MFU\n";
  const double gib = 1073741824.0;
  size_t shown = 0, not_fitting = 0;
  for (const LayoutPlan& p : plans) {
    if (!p.fits) ++not_fitting;
    if (shown == top) continue;
    ++shown;
    std::snprintf(line, sizeof line,
                  "%-*s %9.1f %11.1f  %-4s %7.3f  %7.3f %7.3f  %8.3f %8.3f %8.3f %8.3f ", width,
                  p.name().c_str(), p.state_bytes / gib, p.activation_bytes / gib,
                  p.fits ? "yes" : "NO", p.step_s(), p.compute_s, p.bubble_s, p.tp_comm_s,
                  p.dp_comm_s, p.pp_comm_s, p.cp_comm_s);
    out += line;
    if (experts) {
      std::snprintf(line, sizeof line, "%8.3f ", p.ep_comm_s);
      out += line;
    }
    std::snprintf(line, sizeof line, " %8.0f  %5.1f%%\n", p.tokens_per_s, p.mfu * 100);
    out += line;
  }
  std::snprintf(line, sizeof line,
                "\n%zu layouts, %zu of them beyond %.0f GiB (90%% of the device's memory)%s\n",
                plans.size(), not_fitting, 0.9 * hw.memory_gib,
                shown < plans.size() ? "; --top shows more" : "");
  out += line;
  return out;
}

}  // namespace loom
