#include "train/layout_report.h"

#include <algorithm>
#include <cstdio>

#include "parallel/pipeline_schedule.h"

namespace loom {

bool gpu_sixteen_bit_operands(const Config& config) {
  return config.runtime.device.rfind("cuda", 0) == 0 &&
         (config.runtime.matmul_precision == "bf16" || config.runtime.matmul_precision == "fp16");
}

int64_t expected_activation_bytes(const Config& config, int pp_rank, int64_t blocks_on_rank) {
  const ParallelConfig& par = config.parallel;
  // With context parallelism a rank holds seq_len / cp positions of each sequence, but the
  // attention keeps the whole sequence's keys and values, gathered — unless they go round a
  // ring (nn/sequence_shard.h).
  const double cp = std::max(par.cp, 1);
  const double N = static_cast<double>(config.train.micro_batch_size * config.model.seq_len) / cp;
  const double C = static_cast<double>(config.model.d_model);
  const double V = static_cast<double>(config.model.vocab_size);
  const double P = par.tp, rows = par.sequence_parallel ? N / P : N;
  const std::string mode = config.resolved_recompute();
  // On a GPU at bf16 / fp16 matmul precision a model holds its GEMM inputs in 16 bits, half a
  // float each: the LayerNorms', the attention's and the GELU's outputs; and fc's output, the
  // GELU's input, which fc's GEMM writes in 16 bits with the GELU in its epilogue (nn/mlp.h; under
  // tp parallel/tensor_parallel_block.cc); a Llama likewise (below). The logits too, the
  // unsharded head's (models/gpt2.cc) and the vocabulary-parallel head's shard alike.
  const bool gpu_sixteen_bit = gpu_sixteen_bit_operands(config);
  const double half = gpu_sixteen_bit ? 0.5 : 1.0;
  // Where a GPU's fused flash kernels run (bf16, head size 64 or 128): qkv is 16-bit too
  // (nn/causal_self_attention, parallel/tensor_parallel_block.cc), and so are cp's queries and
  // gathered keys and values (nn/sequence_shard.h), at any tp.
  // Not with qk_norm: the attention then reads an fp32 qkv (nn/causal_self_attention.h).
  const ModelConfig& model = config.model;
  const int64_t head_dim = model.resolved_head_dim();
  const bool flash_kernels = gpu_sixteen_bit && config.runtime.matmul_precision == "bf16" &&
                             model.n_heads > 0 && (head_dim == 64 || head_dim == 128) &&
                             !(model.arch == "llama" && model.qk_norm);
  const double flash_half = flash_kernels ? 0.5 : 1.0;
  // Under cp the attention keeps its queries (this rank's positions), the keys and values of
  // every position (cp × as many; with the ring exchange only its own) and its output — in 16
  // bits where the flash kernels run, proj's rounded input, at any tp — per position, in floats.
  const double kv_width = model.n_heads > 0 ? 2.0 * static_cast<double>(model.resolved_n_kv_heads()) /
                                                  static_cast<double>(model.n_heads)
                                            : 2.0;
  const double kv_kept = par.cp_comm == "ring" ? 1.0 : cp;
  const double cp_attention = (1 + kv_width * kv_kept) * flash_half + flash_half;
  // Without cp: qkv (3) and the output, proj's rounded input (1) at any tp.
  const double gpt2_attention = cp > 1 ? cp_attention : 3 * flash_half + half;
  // Per block, in floats: the block's input and x1 (kept by the LayerNorms) and the LayerNorms'
  // outputs (by qkv and fc), rows each; qkv's output (3), the attention output (1), fc's output
  // (4) and the GELU's (4), N·C/P each.
  double everything = (2 + 2 * half) * rows * C + (gpt2_attention + 8 * half) * N * C / P;
  double selective = 2 * rows * C + (gpt2_attention + 4 * half) * N * C / P;
  if (config.model.arch == "llama") {
    // Llama (nn/causal_self_attention.h, nn/swiglu_mlp.h, nn/rms_norm.h): the compact qkv, q and
    // k turned ((n_heads + 2·n_kv_heads)·head_dim wide: the shared heads are read in place), in
    // 16 bits where the flash kernels read it; the attention output (1), proj's input; fc's
    // output, gate and up (2·H), and the SwiGLU's output (H, proj's input) — at 16 bits all but
    // a non-flash qkv in half a float, as the GEMMs read them. The widths in d_model's: the heads
    // n_heads·head_dim wide in all (model.head_dim), Qwen 3's head norms keeping their fp32
    // inputs, the query and key heads, and a number per head (nn/qk_norm.h).
    const double H = static_cast<double>(config.model.resolved_ffn_hidden());
    const double heads = static_cast<double>(model.n_heads * head_dim) / C;
    const double qkv_width = model.n_heads > 0
        ? static_cast<double>(model.n_heads + 2 * model.resolved_n_kv_heads()) / static_cast<double>(model.n_heads)
        : 3.0;
    // OLMo 2's full form: the same inputs, a number per row for each of the two norms (on every
    // tp rank: the rows' whole sums, nn/split_rms_norm.h).
    const double qk_heads = static_cast<double>(model.n_heads + model.resolved_n_kv_heads());
    const double qk_norm = !model.qk_norm || model.n_heads <= 0 ? 0.0
                           : model.qk_norm_scope == "full"      ? (qk_heads * head_dim + 2 * P) / C
                                                                : qk_heads * (head_dim + 1) / C;
    const double attention =
        heads * (cp > 1 ? cp_attention : qkv_width * flash_half + half) + qk_norm;
    everything = (2 + 2 * half) * rows * C + attention * N * C / P + 3 * half * N * H / P;
    selective = 2 * rows * C + attention * N * C / P + 2 * half * N * H / P;
    // Post-norms (OLMo 2): the norms keep the branches' outputs instead of the block's input and
    // x1, which the Linears keep as they read them — the same count —; selective recomputation
    // drops no Linear's input (there is no norm output to rebuild it from), only the
    // activation's output; a mixture drops its rows and keeps x1 (fp32) to restore them.
    if (model.norm_placement == "post")
      selective += (model.moe_experts > 0 ? half + 1 : 2 * half) * rows * C;
    // Sandwich norms (Gemma's): the pre-norm block's, and the output norms' fp32 inputs (the
    // branches' summed outputs, this rank's rows).
    if (model.norm_placement == "sandwich") {
      everything += 2 * rows * C;
      selective += 2 * rows * C;
    }
    if (model.moe_experts > 0) {
      // A mixture of experts (nn/moe_mlp.h): in place of the SwiGLU's, the router's
      // probabilities (E) and log-sum-exp (1), each token's choices and weights and the experts'
      // rows and slots (4·k), and for each of a token's k experts its gathered input and output
      // (2·C), h and SwiGLU output (3·H); selective drops the gathered inputs and the SwiGLU
      // outputs (tests/models/llama_test.cc counts a block's cache exactly). Under tp every rank
      // keeps all of the batch's tokens' rows, and 1/tp of the experts' widths.
      const double E = static_cast<double>(model.moe_experts);
      const double k = static_cast<double>(model.moe_top_k);
      // The shared experts (S · H wide) keep their h and SwiGLU output for every token.
      const double S = static_cast<double>(model.moe_shared_experts);
      everything += N * (E + 1 + 4 * k + 2 * k * C + 3 * (k + S) * H / P) - 3 * half * N * H / P;
      selective += N * (E + 1 + 4 * k + k * C + 2 * (k + S) * H / P) - 2 * half * N * H / P;
    }
  }
  // With sequence parallelism a column-parallel layer's backward holds its input gathered again
  // (its kept rows all-gathered: parallel/tensor_parallel_linear.h) and its input gradient
  // before the reduce-scatter, each P × a rank's rows: (N − rows)·C more of each than the block's
  // own rows, on top of what it keeps.
  const double sp_backward = (1 + half) * (N - rows) * C;
  double per_block = everything;
  if (mode == "full") per_block = rows * C;
  else if (mode == "selective") per_block = selective;
  double per_micro_batch = per_block * static_cast<double>(blocks_on_rank);
  // The last stage's rank, where the schedule places it (rank 0 in zb-v's V).
  const bool last =
      pp_rank == stage_placement(par.schedule, std::max(par.pp, 1), par.virtual_stages)
                     .rank_of_stage(std::max(par.pp, 1) * par.virtual_stages - 1);
  if (last)
    per_micro_batch += N * V / P * half + N * C;  // the logits and the final LayerNorm's output
  double in_flight = 1;
  if (par.pp > 1) {
    const double m = static_cast<double>(config.grad_accum_steps());
    if (par.schedule == "gpipe") in_flight = m;
    else if (par.schedule == "interleaved") in_flight = std::min(m * par.virtual_stages, static_cast<double>(par.pp) * par.virtual_stages);
    // zb-h1: pp − r micro-batches between F and B as 1F1B, plus the r whose W trails their B
    // (counted whole: they keep their Linears' inputs and output gradients).
    else if (par.schedule == "zb-h1") in_flight = std::min(m, static_cast<double>(par.pp));
    // zb-interleaved: interleaved's, plus up to pp owed W's of one chunk (1/v of the rank) each.
    else if (par.schedule == "zb-interleaved")
      in_flight =
          std::min(m * par.virtual_stages, static_cast<double>(par.pp) * par.virtual_stages) +
          std::min(m, static_cast<double>(par.pp)) / par.virtual_stages;
    // zb-v: at most 2·pp chunk micro-batches between F and W, pp of the rank's two chunks.
    else if (par.schedule == "zb-v")
      in_flight = std::min(m, static_cast<double>(par.pp));
    else in_flight = std::min(m, static_cast<double>(par.pp - pp_rank));
  }
  // While a block runs backward it holds all of its activations again (recomputed) and their
  // gradients: one block's worth on top.
  return static_cast<int64_t>((per_micro_batch * in_flight + everything + sp_backward) * 4);
}

std::string layout_report(const Config& config, const MeshShape& mesh,
                          const std::vector<RankFootprint>& ranks) {
  const ParallelConfig& par = config.parallel;
  char line[256];
  std::snprintf(
      line, sizeof line,
      "layout %s (%d rank%s): zero %d%s, %s%s%s, %ld micro-batch%s of %ld per dp rank, "
      "recompute %s\n",
      mesh.str().c_str(), mesh.size(), mesh.size() == 1 ? "" : "s", par.zero,
      par.hybrid_sharding()
          ? (" sharded over groups of dp_shard = " + std::to_string(par.dp_shard) + " dp ranks, " +
             std::to_string(par.dp / par.dp_shard) + " replicas")
                .c_str()
          : "",
      par.ep > 1 ? ("experts over groups of ep = " + std::to_string(par.ep) + " dp ranks, ").c_str()
                 : "",
      par.pp > 1 ? ("schedule " + par.schedule).c_str() : "no pipeline",
      par.tp > 1 && par.sequence_parallel ? ", sequence parallel" : "",
      static_cast<long>(config.grad_accum_steps()), config.grad_accum_steps() == 1 ? "" : "es",
      static_cast<long>(config.train.micro_batch_size), config.resolved_recompute().c_str());
  std::string out = line;
  out += "rank";
  for (int a = 0; a < mesh.ndim(); ++a) out += "  " + mesh.axis_name(a);
  out += "   parameters   state MiB   activations MiB (est.)   total MiB\n";
  auto mib = [](int64_t b) { return static_cast<double>(b) / 1048576.0; };
  for (int r = 0; r < mesh.size(); ++r) {
    std::snprintf(line, sizeof line, "%4d", r);
    out += line;
    const std::vector<int> c = mesh.coords(r);
    for (int a = 0; a < mesh.ndim(); ++a) {
      std::snprintf(line, sizeof line, "  %*d", static_cast<int>(mesh.axis_name(a).size()), c[a]);
      out += line;
    }
    const RankFootprint& f = ranks[static_cast<size_t>(r)];
    std::snprintf(line, sizeof line, "  %11ld  %10.1f  %23.1f  %10.1f\n",
                  static_cast<long>(f.parameters), mib(f.state_bytes), mib(f.activation_bytes),
                  mib(f.state_bytes + f.activation_bytes));
    out += line;
  }
  return out;
}

}  // namespace loom
