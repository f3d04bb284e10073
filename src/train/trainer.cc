#include "train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>

#include "base/error.h"
#include "base/thread_pool.h"
#include "base/timer.h"
#include "checkpoint/checkpoint.h"
#include "comm/counting.h"
#include "comm/directed_p2p.h"
#include "data/dataset.h"
#include "data/documents.h"
#include "data/shard.h"
#include "device/allocator.h"
#include "device/cuda/cuda_backend.h"
#include "kernels/cpu/fma_peak.h"
#include "kernels/ops.h"
#include "mesh/device_mesh.h"
#include "models/gpt2.h"
#include "monitor/metrics_log.h"
#include "monitor/step_reporter.h"
#include "monitor/trace.h"
#include "nn/step_losses.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "parallel/context_parallel.h"
#include "parallel/data_parallel.h"
#include "parallel/expert_parallel.h"
#include "parallel/pipeline_parallel.h"
#include "parallel/tensor_parallel_gpt2.h"
#include "train/async_checkpoint.h"
#include "train/evaluate.h"
#include "train/layout_report.h"
#include "train/run_control.h"
#include "train/run_timeline.h"
#include "train/sharded_io.h"
#include "train/step_record.h"
#include "train/train_data.h"

namespace loom {
namespace fs = std::filesystem;

Gpt2Config model_config_of(const Config& config) {
  Gpt2Config m;
  m.arch = parse_arch(config.model.arch);
  m.vocab_size = config.model.vocab_size;
  m.max_seq_len = config.model.resolved_max_seq_len();
  m.d_model = config.model.d_model;
  m.n_layers = config.model.n_layers;
  m.n_heads = config.model.n_heads;
  m.init_std = static_cast<float>(config.model.init_std);
  m.recompute = parse_recompute(config.resolved_recompute());
  m.tie_embeddings = config.model.tie_embeddings;
  m.embedding_multiplier = static_cast<float>(config.model.embedding_multiplier);
  if (m.llama()) {
    m.n_kv_heads = config.model.resolved_n_kv_heads();
    m.qkv_bias = config.model.qkv_bias;
    m.head_width = config.model.head_dim;
    m.qk_norm = config.model.qk_norm;
    m.qk_norm_full = config.model.qk_norm_scope == "full";
    m.query_pre_attn_scalar = config.model.query_pre_attn_scalar;
    m.post_norm = config.model.norm_placement == "post";
    m.sandwich_norm = config.model.norm_placement == "sandwich";
    m.rope_local_theta = config.model.rope_local_theta;
    m.ffn_activation = config.model.ffn_activation == "gelu_tanh" ? GatedActivation::kGeluTanh
                                                                  : GatedActivation::kSilu;
    m.sliding_window = config.model.sliding_window;
    m.full_attention_every = config.model.full_attention_every;
    m.ffn_hidden = config.model.resolved_ffn_hidden();
    m.rope_theta = config.model.rope_theta;
    if (config.model.rope_scaling == "llama3") {
      m.rope_scaling_factor = config.model.rope_scaling_factor;
      m.rope_low_freq_factor = config.model.rope_low_freq_factor;
      m.rope_high_freq_factor = config.model.rope_high_freq_factor;
      m.rope_original_max_seq_len = config.model.rope_original_max_seq_len;
    } else if (config.model.rope_scaling == "linear") {
      m.rope_scaling_factor = config.model.rope_scaling_factor;
      m.rope_scaling_linear = true;
    }
    m.norm_eps = config.model.norm_eps;
    m.moe_experts = config.model.moe_experts;
    m.moe_top_k = config.model.moe_top_k;
    m.moe_aux_loss_coef = static_cast<float>(config.model.moe_aux_loss_coef);
    m.moe_router_z_loss_coef = static_cast<float>(config.model.moe_router_z_loss_coef);
    m.moe_shared_experts = config.model.moe_shared_experts;
    m.moe_capacity = {
        config.model.moe_capacity_factor,
        parse_token_drop_policy(config.model.moe_token_drop_policy, "model.moe_token_drop_policy")};
    m.moe_router_score = parse_router_score(config.model.moe_router_score_function,
                                            "model.moe_router_score_function");
    if (config.model.moe_router_num_groups > 0) {
      m.moe_router_groups = config.model.moe_router_num_groups;
      m.moe_router_group_topk = config.model.moe_router_group_topk;
    }
    m.moe_router_topk_scaling_factor = config.model.moe_router_topk_scaling_factor;
    m.moe_router_norm_topk_prob = config.model.moe_router_norm_topk_prob;
  }
  return m;
}

namespace {

// The tokens per expert of the step's expert counts (Gpt2Stage::add_expert_tokens): all but the
// last, the pairs dropped.
std::vector<double> per_expert(const std::vector<double>& counts) {
  return {counts.begin(), counts.end() - (counts.empty() ? 0 : 1)};
}

// The busiest expert's tokens over the mean expert's, in the block where that is largest (1:
// perfectly spread; moe_experts / moe_top_k: every token to the same k) — of the step's whole
// batch, so the same whatever the layout.
double expert_load(const std::vector<double>& tokens, int64_t experts) {
  double worst = 0;
  for (size_t first = 0; first + static_cast<size_t>(experts) <= tokens.size();
       first += static_cast<size_t>(experts)) {
    double most = 0, sum = 0;
    for (int64_t e = 0; e < experts; ++e) {
      most = std::max(most, tokens[first + static_cast<size_t>(e)]);
      sum += tokens[first + static_cast<size_t>(e)];
    }
    if (sum > 0) worst = std::max(worst, most * static_cast<double>(experts) / sum);
  }
  return worst;
}

// parallel.tp_backward_overlap: "auto" overlaps on GPUs only — on CPU ranks the collective's
// reduction needs the cores the weight-gradient GEMM runs on (bench/tp_overlap.sh: no gain).
bool tp_backward_overlap(const Config& config, Device device) {
  const std::string& v = config.parallel.tp_backward_overlap;
  return v == "on" || (v == "auto" && device.is_cuda());
}

// The peak one rank computes at, TFLOP/s, for the MFU: metrics.peak_tflops, else measured once
// per process and device kind: on a CPU the fp32 FMA rate of one thread (50 ms; at bf16 matmul
// precision that of the bf16 GEMM's instruction, cpu::PeakKind::kBf16Gemm) times the rank's compute
// threads, on a GPU its dense GEMM rate at the run's matmul precision.
cpu::PeakKind cpu_peak_kind(const Config& config) {
  return config.runtime.matmul_precision == "fp32" ? cpu::PeakKind::kFp32Fma
                                                   : cpu::PeakKind::kBf16Gemm;
}

double rank_peak_tflops(const Config& config, Device device) {
  if (config.metrics.peak_tflops > 0) return config.metrics.peak_tflops;
  static std::mutex mutex;
  static std::map<std::string, double> measured;  // TFLOP/s of one CPU thread, or of a GPU
  const std::string key = (device.is_cuda() ? config.runtime.device : std::string("cpu")) + "/" +
                          config.runtime.matmul_precision;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = measured.find(key);
  if (it == measured.end()) {
#ifdef LOOM_CUDA_EMULATE
    const int64_t n = 128;  // the CUDA emulator runs kernels on CPU fibers: its rate means nothing
#else
    const int64_t n = 4096;  // a few tenths of a second on a GPU
#endif
    // At fp8 a GPU's GEMMs run at bf16 (the quantized operands are exact there): its bf16 rate.
    const std::string gemm_precision =
        config.runtime.matmul_precision == "fp8" ? "bf16" : config.runtime.matmul_precision;
    const double tflops = device.is_cuda()
                              ? ops::measure_gpu_gemm_tflops(device, gemm_precision, n, 5)
                              : cpu::measure_fma_peak(1, 0.05, cpu_peak_kind(config)).gflops / 1e3;
    it = measured.emplace(key, tflops).first;
  }
  return device.is_cuda() ? it->second : it->second * config.runtime.resolved_threads_per_rank();
}

// The optimizer's, the schedule's, the loss scaler's and the data-parallel engine's settings, as
// the config gives them.
AdamWConfig adamw_config_of(const TrainConfig& tc) {
  AdamWConfig c;
  c.beta1 = static_cast<float>(tc.beta1);
  c.beta2 = static_cast<float>(tc.beta2);
  c.eps = static_cast<float>(tc.eps);
  c.weight_decay = static_cast<float>(tc.weight_decay);
  return c;
}

LrSchedule lr_schedule_of(const TrainConfig& tc) {
  LrSchedule s;
  s.decay = parse_lr_decay(tc.lr_schedule);
  // In full batches: with a batch-size ramp-up the run's sequences over batch_size.
  s.total = static_cast<double>(tc.samples_before(tc.steps)) / static_cast<double>(tc.batch_size);
  s.warmup = tc.warmup_steps;
  s.lr = static_cast<float>(tc.lr);
  s.min_ratio = static_cast<float>(tc.min_lr_ratio);
  s.decay_fraction = tc.lr_decay_fraction;
  return s;
}

LossScalerConfig loss_scaler_config_of(const Config& config) {
  const TrainConfig& tc = config.train;
  LossScalerConfig c;
  c.mode = parse_loss_scale_mode(tc.loss_scale, config.runtime.matmul_precision);
  c.init = tc.loss_scale_init;
  c.window = tc.loss_scale_window;
  c.min = tc.loss_scale_min;
  return c;
}

// (Its tensor-parallel group is the trainer's to set.)
DataParallelConfig data_parallel_config_of(const ParallelConfig& p) {
  DataParallelConfig c;
  c.zero = p.zero;
  c.bucket_bytes = static_cast<int64_t>(p.bucket_mb * 1048576.0);
  c.reduce_dtype = p.grad_reduce_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  c.gather_dtype = p.param_gather_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  return c;
}

// The pipeline's settings for this rank: its micro-batches of `local_seq` positions (with context
// parallelism `sequence`'s), its tensor-parallel group if any. Token ids are checked by the
// trainer's loader.
PipelineConfig pipeline_config_of(const Config& config, int64_t local_seq,
                                  ContextParallel* sequence, Communicator* tensor_parallel,
                                  bool tp_backward_overlap) {
  PipelineConfig pc;
  pc.schedule = config.parallel.schedule;
  pc.virtual_stages = config.parallel.virtual_stages;
  pc.microbatches = static_cast<int>(config.grad_accum_steps());
  pc.micro_batch_size = config.train.micro_batch_size;
  pc.seq_len = local_seq;
  pc.sequence = sequence;
  pc.ids_checked = true;
  pc.layer_split = config.parallel.layer_split;
  pc.tensor_parallel = tensor_parallel;
  pc.sequence_parallel = config.parallel.sequence_parallel;
  pc.tp_backward_overlap = tp_backward_overlap;
  pc.z_loss = static_cast<float>(config.train.z_loss);
  pc.reset_position_ids = config.data.reset_position_ids;
  pc.send_dtype = config.parallel.pp_send_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  return pc;
}

// Resumes from a checkpoint of either format (train/sharded_io.h): every rank reads the
// layout-free checkpoint by parameter name and keeps its part; the loader and the loss scaler
// continue where it left them. Returns its step; *data_note is what the loader has to say
// (TrainData::resume: a data mix changed), or "". *expert_bias: the mixture's balancing biases it
// holds (empty: none).
// A checkpoint's model against the config's where the shapes do not tell them apart (another
// architecture's checkpoint would fail on its first parameter's shape; say why). `what`: how the
// checkpoint is used ("resume with the config it was trained with (RUN_DIR/config.toml)").
void check_checkpoint_model(const std::string& checkpoint, const Config& config,
                            const std::string& what) {
  const Gpt2Config saved = read_checkpoint_model(checkpoint), wanted = model_config_of(config);
  // The heads' width named where it differs (model.head_dim).
  const bool heads_differ =
      saved.llama() && wanted.llama() && saved.head_dim() != wanted.head_dim();
  if (saved.arch != wanted.arch || saved.tie_embeddings != wanted.tie_embeddings ||
      saved.qkv_bias != wanted.qkv_bias || saved.qk_norm != wanted.qk_norm || heads_differ ||
      saved.qk_norm_full != wanted.qk_norm_full || saved.post_norm != wanted.post_norm ||
      saved.sandwich_norm != wanted.sandwich_norm ||
      saved.ffn_activation != wanted.ffn_activation ||
      saved.embedding_multiplier != wanted.embedding_multiplier ||
      saved.rope_local_theta != wanted.rope_local_theta ||
      saved.sliding_window != wanted.sliding_window ||
      saved.full_attention_every != wanted.full_attention_every)
    fail("checkpoint ", checkpoint, " holds a ", arch_name(saved.arch),
         saved.tie_embeddings ? "" : " with an untied head",
         saved.qkv_bias ? " with qkv biases" : "",
         saved.qk_norm ? (saved.qk_norm_full ? " with full qk norms" : " with qk norms") : "",
         saved.post_norm ? " with post-norms" : "",
         saved.sandwich_norm ? " with sandwich norms" : "",
         saved.ffn_activation == GatedActivation::kGeluTanh ? " with GeGLU MLPs" : "",
         saved.embedding_multiplier != 1
             ? detail::concat(" with its embedding times ", saved.embedding_multiplier)
             : std::string(),
         saved.rope_local_theta > 0
             ? detail::concat(" with a local rotary base of ", saved.rope_local_theta)
             : std::string(),
         heads_differ ? detail::concat(" with heads of ", saved.head_dim()) : std::string(),
         saved.sliding_window > 0
             ? detail::concat(
                   " with a window of ", saved.sliding_window,
                   saved.full_attention_every > 0
                       ? detail::concat(" (every ", saved.full_attention_every, "th block whole)")
                       : std::string())
             : std::string(),
         " model, but model.arch = \"", config.model.arch, "\"",
         wanted.tie_embeddings ? "" : " with model.tie_embeddings = false",
         wanted.qkv_bias ? " with model.qkv_bias = true" : "",
         wanted.qk_norm ? " with model.qk_norm = true" : "",
         wanted.qk_norm_full ? " with model.qk_norm_scope = \"full\"" : "",
         wanted.post_norm ? " with model.norm_placement = \"post\"" : "",
         wanted.sandwich_norm ? " with model.norm_placement = \"sandwich\"" : "",
         wanted.ffn_activation == GatedActivation::kGeluTanh
             ? " with model.ffn_activation = \"gelu_tanh\""
             : "",
         wanted.embedding_multiplier != 1
             ? detail::concat(" with model.embedding_multiplier = ", wanted.embedding_multiplier)
             : std::string(),
         wanted.rope_local_theta > 0
             ? detail::concat(" with model.rope_local_theta = ", wanted.rope_local_theta)
             : std::string(),
         heads_differ ? detail::concat(" with heads of ", wanted.head_dim(), " (model.head_dim)")
                      : std::string(),
         wanted.sliding_window > 0
             ? detail::concat(" with model.sliding_window = ", wanted.sliding_window,
                              wanted.full_attention_every > 0
                                  ? detail::concat(", model.full_attention_every = ",
                                                   wanted.full_attention_every)
                                  : std::string())
             : std::string(),
         ": ", what);
  const auto shared_of = [](const Gpt2Config& c) {
    return c.moe_shared_experts > 0 ? detail::concat(", ", c.moe_shared_experts, " shared")
                                    : std::string();
  };
  if (saved.moe_experts != wanted.moe_experts || saved.moe_top_k != wanted.moe_top_k ||
      saved.moe_shared_experts != wanted.moe_shared_experts)
    fail("checkpoint ", checkpoint, " holds ",
         saved.moe() ? detail::concat("a mixture of ", saved.moe_experts, " experts, top ",
                                      saved.moe_top_k, shared_of(saved))
                     : std::string("a dense model"),
         ", but the config asks for ",
         wanted.moe() ? detail::concat("a mixture of ", wanted.moe_experts, " experts, top ",
                                       wanted.moe_top_k, shared_of(wanted))
                      : std::string("a dense model"),
         " (model.moe_experts, model.moe_top_k, model.moe_shared_experts): ", what);
}

int64_t resume(const std::string& checkpoint, const std::vector<Gpt2Stage*>& parts,
               const std::vector<DataParallel*>& engines, const Config& config, TrainData& data,
               LossScaler& scaler, std::string* data_note, std::vector<float>* expert_bias) {
  check_checkpoint_model(checkpoint, config,
                         "resume with the config it was trained with (RUN_DIR/config.toml)");
  const TrainingState st = load_layout_checkpoint(checkpoint, parts, engines, config);
  if (st.step > config.train.steps)
    fail("checkpoint ", checkpoint, " is at step ", st.step,
         ", past train.steps = ", config.train.steps);
  *data_note = data.resume(st, checkpoint);
  if (st.loss_scaler) scaler.set_state(*st.loss_scaler);
  *expert_bias = st.expert_bias;
  return st.step;
}

// What this rank runs batches through: its whole model (one device's, or its tensor-parallel
// shard) under `ctx`, or its pipeline's chunks; with context parallelism its positions of each
// sequence.
struct RankModel {
  Gpt2Stage* whole = nullptr;
  PipelineParallel* pipe = nullptr;
  Context* ctx = nullptr;        // the whole model's
  StepLosses* losses = nullptr;  // where the whole model's head queues its losses
  ContextParallel* sequence = nullptr;
  Communicator* cp = nullptr;  // the cp group, with `sequence`
};

// A validation corpus: data.val's (name "", reported as val_loss) or a data.val_sets set's.
struct ValCorpus {
  std::string name;
  std::vector<std::string> shards;
};

// The run's validation corpora, data.val's first; none when train.eval_every = 0. Their shards'
// headers — and with data.loss_mask their masks' — are checked now, as the train loader checks
// its own: a bad validation shard is an error before the first step, not at the first
// evaluation, maybe hours in.
std::vector<ValCorpus> validation_corpora(const Config& config) {
  std::vector<ValCorpus> corpora;
  if (config.train.eval_every <= 0) return corpora;
  if (!config.data.val.empty())
    corpora.push_back({"", resolve_shards(config.data.val, "data.val")});
  if (!config.data.val_sets.empty())
    for (const ValSet& set : parse_val_sets(config.data.val_sets))
      corpora.push_back({set.name, resolve_shards(set.spec, "data.val_sets '" + set.name + "'")});
  for (const ValCorpus& corpus : corpora)
    for (const std::string& path : corpus.shards) {
      const ShardInfo info = read_shard_header(path);
      if (config.data.loss_mask) (void)has_loss_mask(path, info.num_tokens);
    }
  return corpora;
}

// The validation loss (train/evaluate.h), the same on every rank. Data-parallel replicas (whole
// pipelines when pp > 1) share the micro-batches out; under ZeRO-3 every forward gathers
// parameters over dp, so there every rank runs them all — but under hybrid sharding only over a
// shard group: the shard groups share them out (`replicas`, the replicate group: a shard group's
// ranks are all its rank r, and run batches r, r + R, ...). The replicas are dp's: a cp group
// evaluates one batch together, each rank its positions, and their losses' mean is the batch's
// (equal token counts).
double validation_loss(const RankModel& model, const Config& config, DeviceMesh& mesh,
                       const std::vector<std::string>& shards, Device device,
                       Communicator* replicas) {
  // Under expert parallelism too: an expert-parallel group's ranks run every forward together.
  Communicator* split = config.parallel.ep > 1     ? nullptr
                        : config.parallel.zero < 3 ? &mesh.axis("dp")
                                                   : replicas;
  // The batches queue their losses (nn/step_losses.h) and the host reads them once, as a step's:
  // on a GPU no wait per batch. A pipeline's come from its last stage, summed over pp once; a cp
  // group's ranks each sum their positions' means, averaged over cp once (equal token counts).
  // With context parallelism the loader's batches stay on the host, where each rank cuts its
  // positions and uploads only those, queued; with document masking too, where the documents'
  // starts are found (and uploaded with the batch).
  const bool cut_on_host = model.sequence != nullptr;
  const bool masked = config.data.document_mask;
  const bool on_host = cut_on_host || masked;
  Context& ctx = *model.ctx;
  // A host batch to a GPU, queued; on a CPU it stays where it is.
  const auto to_device = [&](const Tensor& t) {
    return device.is_cuda() ? t.to_queued(device) : t;
  };
  const auto micro_batch_loss = [&](const Tensor& full_in, const Tensor& full_tg) {
    Tensor in = full_in, tg = full_tg, documents;
    if (masked) {
      documents = Tensor::empty(full_in.shape(), DType::kI32, Device::cpu());
      document_starts(documents.data<int32_t>(), full_in.data<int32_t>(), full_in.dim(0),
                      full_in.dim(1), static_cast<int32_t>(config.data.eot_token));
      documents = to_device(documents);
    }
    if (cut_on_host) {
      in = to_device(shard_tokens(full_in, model.sequence->positions()));
      tg = to_device(shard_tokens(full_tg, model.sequence->positions()));
    } else if (on_host) {
      in = to_device(full_in);
      tg = to_device(full_tg);
    }
    if (model.pipe != nullptr)
      return model.pipe->evaluate(in, tg, model.losses, masked ? &documents : nullptr);
    ctx.losses = model.losses;  // read after the last batch
    ctx.documents = masked ? &documents : nullptr;
    model.whole->forward_part(ctx, in, tg, nullptr);
    ctx.documents = nullptr;
    ctx.losses = nullptr;
    model.whole->clear_cache();
    return 0.0;
  };
  const auto queued_sum = [&] {
    double sum = 0;
    if (model.pipe != nullptr) {
      sum = model.pipe->queued_loss_sum(*model.losses);
    } else {
      for (double mean : model.losses->take()) sum += mean;
    }
    return cut_on_host ? all_reduce_value(*model.cp, sum, ReduceOp::kAvg) : sum;
  };
  ctx.ids_checked = true;  // by evaluate's loader, naming the shard
  // The validation loss is the cross-entropy: the heads queue no z-loss terms for it.
  const float z_loss = ctx.z_loss;
  ctx.z_loss = 0;
  const double val =
      evaluate(micro_batch_loss, shards, config.train.micro_batch_size, config.model.seq_len,
               config.train.eval_batches, on_host && device.is_cuda() ? Device::cpu() : device,
               split, config.model.vocab_size, queued_sum,
               config.data.eod_mask_loss ? static_cast<int32_t>(config.data.eot_token) : -1,
               config.data.loss_mask);
  ctx.ids_checked = false;
  ctx.z_loss = z_loss;
  return val;
}

// The start-up table (train/layout_report.h): every rank's coordinates, parameters and expected
// memory, gathered over the world (collective). Sets *activation_bytes to rank 0's estimate.
std::string startup_layout_report(Communicator& world, DeviceMesh& mesh, const Config& config,
                                  const std::vector<Gpt2Stage*>& parts,
                                  const DataParallelMemory& state_bytes,
                                  int64_t* activation_bytes) {
  int64_t parameters = 0, blocks = 0;
  for (Gpt2Stage* part : parts) {
    for (const auto& p : part->params().parameters()) parameters += p->numel();
    blocks += part->part().end_block - part->part().first_block;  // parts are resolved
  }
  const std::vector<double> all = all_gather_values(
      world, {static_cast<double>(parameters), static_cast<double>(state_bytes.state()),
              static_cast<double>(expected_activation_bytes(config, mesh.coord("pp"), blocks))});
  std::vector<RankFootprint> footprints;
  for (int r = 0; r < world.size(); ++r) {
    const double* f = all.data() + 3 * r;
    footprints.push_back(
        {static_cast<int64_t>(f[0]), static_cast<int64_t>(f[1]), static_cast<int64_t>(f[2])});
  }
  *activation_bytes = footprints[0].activation_bytes;
  return layout_report(config, mesh.shape(), footprints);
}

}  // namespace

// One rank's training loop. Rank 0 of the world writes the run directory (metrics, config,
// checkpoints, progress); every rank computes.
TrainSummary train_on(Communicator& world, const Config& config_in, const TrainOptions& options,
                      Device device, Communicator* pipeline_world) {
  Config config = config_in;
  resolve_parallel_degrees(config.parallel, world.size());  // a check when already resolved
  validate(config);
  const TrainConfig& tc = config.train;
  const bool leader = world.rank() == 0;
  // This rank's timeline (metrics.trace_from_step, below). Declared before everything that may
  // wait on communication, the counting communicators and the engines: they report their waits
  // to it, also from their destructors.
  Tracer tracer(world.rank());
  const TestFault fault = TestFault::from_env();
  const int64_t seq_len = config.model.seq_len;
  const int64_t micro = tc.micro_batch_size;
  const int64_t accum = config.grad_accum_steps();
  const bool pipelined = config.parallel.pp > 1;
  const bool tensor_parallel = config.parallel.tp > 1;
  // pp × dp × tp, tp innermost (neighbouring ranks, the fastest links), pp outermost, as
  // Megatron-LM: only activations cross the pp axis, the least traffic (docs/hybrid_parallel.md).
  // With context parallelism a cp axis between dp and tp: pp × dp × cp × tp.
  const int cp_degree = config.parallel.cp;
  const bool context_parallel = cp_degree > 1;
  const MeshShape shape =
      training_mesh_shape(config.parallel.dp, config.parallel.pp, config.parallel.tp, cp_degree);
  DeviceMesh mesh(world, shape);
  std::unique_ptr<DeviceMesh> pipeline_mesh;  // the same coordinates over pipeline_world
  if (pipeline_world != nullptr) pipeline_mesh = std::make_unique<DeviceMesh>(*pipeline_world, shape);
  // Every strategy talks through counting wrappers, for the per-axis volume in the metrics.
  // The gradients' group: dp, or with context parallelism dp × cp — the cp ranks of a replica
  // hold the same parameters and each computed its positions' share of their gradients
  // (parallel/context_parallel.h), so ZeRO shards and the all-reduce span both axes.
  std::unique_ptr<Communicator> dp_cp;
  if (context_parallel) {
    const int tp_size = config.parallel.tp;
    dp_cp = world.split(mesh.coord("pp") * tp_size + mesh.coord("tp"),
                        mesh.coord("dp") * cp_degree + mesh.coord("cp"));
  }
  CountingCommunicator dp_count(context_parallel ? *dp_cp : mesh.axis("dp")),
      tp_count(mesh.axis("tp"));
  // cp's own traffic, the attention's gathers (with context parallelism).
  std::unique_ptr<CountingCommunicator> cp_count;
  std::unique_ptr<ContextParallel> sequence_shard;
  if (context_parallel) {
    cp_count = std::make_unique<CountingCommunicator>(mesh.axis("cp"));
    sequence_shard = std::make_unique<ContextParallel>(*cp_count, seq_len,
                                                       config.parallel.cp_comm == "ring");
  }
  // Expert parallelism (parallel/expert_parallel.h): a mixture's experts split over groups of
  // parallel.ep dp ranks; the experts' gradients reduced over the ranks holding the same ones.
  // Metrics: the token exchange as axis "ep", the experts' gradient reductions with dp's.
  ExpertGroups expert_groups;
  std::unique_ptr<CountingCommunicator> ep_count, experts_dp_count;
  std::unique_ptr<ExpertParallel> expert_exchange;
  if (config.parallel.ep > 1) {
    // Under context parallelism the experts' gradients are reduced over dp × cp.
    expert_groups = split_expert_groups(mesh.axis("dp"), config.parallel.ep,
                                        context_parallel ? dp_cp.get() : nullptr);
    ep_count = std::make_unique<CountingCommunicator>(*expert_groups.ep);
    experts_dp_count = std::make_unique<CountingCommunicator>(*expert_groups.experts_dp);
    expert_exchange =
        std::make_unique<ExpertParallel>(*ep_count, config.parallel.ep_dispatch == "all_to_all");
  }
  // Hybrid sharding (parallel.dp_shard < dp; parallel/data_parallel.h): ZeRO's state sharded over
  // groups of dp_shard dp ranks (× cp), the groups replicas of each other. Metrics: both with
  // dp's, the replicas' all-reduces also on their own (comm_bytes.dp_replicate: what crosses
  // nodes when a shard group is a node).
  ShardGroups shard_groups;
  std::unique_ptr<CountingCommunicator> shard_count, replicate_count;
  if (config.parallel.hybrid_sharding()) {
    shard_groups = split_shard_groups(context_parallel ? *dp_cp : mesh.axis("dp"),
                                      config.parallel.dp_shard, cp_degree);
    shard_count = std::make_unique<CountingCommunicator>(*shard_groups.shard);
    replicate_count = std::make_unique<CountingCommunicator>(*shard_groups.replicate);
  }
  // What this rank's micro-batches hold of each sequence: its positions (all without cp).
  const int64_t local_seq = context_parallel ? sequence_shard->local_length() : seq_len;
  Communicator* pp_axis = &(pipeline_mesh ? *pipeline_mesh : mesh).axis("pp");
  // nccl's sends block until received, in issue order: the pipeline's messages go one
  // communicator per direction (comm/directed_p2p.h), so crossed sends cannot deadlock.
  std::unique_ptr<Communicator> directed_pp;
  if (pipelined && pp_axis->backend() == "nccl") {
    directed_pp = std::make_unique<DirectedP2pCommunicator>(*pp_axis);
    pp_axis = directed_pp.get();
  }
  CountingCommunicator pp_count(*pp_axis);
  Communicator& dp = dp_count;

  ThreadPool pool(config.runtime.resolved_threads_per_rank());
  const AdamWConfig opt_config = adamw_config_of(tc);
  const LrSchedule lr_schedule = lr_schedule_of(tc);
  LossScaler scaler(loss_scaler_config_of(config));
  DataParallelConfig dp_config = data_parallel_config_of(config.parallel);
  const bool overlap_tp_backward = tp_backward_overlap(config, device);
  if (tensor_parallel) dp_config.tensor_parallel = &tp_count;
  dp_config.experts_data_parallel = experts_dp_count.get();
  dp_config.expert_parallel = ep_count.get();
  dp_config.shard_group = shard_count.get();
  dp_config.replicate_group = replicate_count.get();
  // What this rank trains: its whole model (one device's, or its tensor-parallel shard) under
  // one DataParallel engine, or its pipeline chunks, each under its own engine
  // (parallel/pipeline_parallel.h).
  std::unique_ptr<Gpt2Stage> whole;
  std::unique_ptr<DataParallel> whole_engine;
  std::unique_ptr<PipelineParallel> pipe;
  std::vector<Gpt2Stage*> parts;
  std::vector<DataParallel*> engines;
  if (pipelined) {
    PipelineConfig pc =
        pipeline_config_of(config, local_seq, sequence_shard.get(),
                           tensor_parallel ? &tp_count : nullptr, overlap_tp_backward);
    pc.experts = expert_exchange.get();
    pipe = std::make_unique<PipelineParallel>(model_config_of(config), pp_count, dp, pool,
                                              device, pc, dp_config, opt_config,
                                              static_cast<uint64_t>(tc.seed));
    for (int c = 0; c < pipe->chunks(); ++c) {
      parts.push_back(&pipe->chunk(c));
      engines.push_back(&pipe->chunk_engine(c));
    }
  } else {
    if (tensor_parallel)
      whole = std::make_unique<TpGpt2>(model_config_of(config), tp_count,
                                       config.parallel.sequence_parallel, Gpt2Part{},
                                       expert_exchange.get());
    else
      whole = std::make_unique<Gpt2>(model_config_of(config), Gpt2Part{}, expert_exchange.get());
    whole_engine = DataParallel::create(whole->params(), dp, pool, device, dp_config, opt_config,
                                        static_cast<uint64_t>(tc.seed));
    parts.push_back(whole.get());
    engines.push_back(whole_engine.get());
  }
  Context ctx{&pool, device, DType::kF32, whole_engine.get()};
  ctx.sequence = sequence_shard.get();
  ctx.tp_backward_overlap = overlap_tp_backward;
  ctx.z_loss = static_cast<float>(tc.z_loss);
  ctx.reset_position_ids = config.data.reset_position_ids;
  // The weights' 16-bit copies on a GPU at bf16 / fp16 (nn/rounded_weights.h), kept by the engine.
  if (whole_engine) ctx.rounded_weights = whole_engine->rounded_weights();
  StepLosses step_losses(device);  // nn/step_losses.h
  const RankModel rank_model{whole.get(),  pipe.get(),           &ctx,
                             &step_losses, sequence_shard.get(), cp_count.get()};

  // The loader's ranks are the data-parallel replicas: a cp group reads one replica's batch.
  // Every id is checked by it, on the host, naming the shard: the GPU's kernels need not check
  // them again (a wait for the GPU per op: kernels/exec.h).
  TrainData train_data(config, micro, seq_len, mesh.coord("dp"), config.parallel.dp);
  const std::vector<ValCorpus> val_corpora = validation_corpora(config);

  // Run directory and resume.
  const std::string checkpoints_dir = (fs::path(options.run_dir) / "checkpoints").string();
  if (leader) {
    std::error_code ec;
    fs::create_directories(options.run_dir, ec);
    if (ec) fail("cannot create run directory ", options.run_dir, ": ", ec.message());
  }
  ProgressLine progress(tc.steps, leader && options.progress && isatty(STDERR_FILENO));
  auto message = [&](const std::string& text) {
    if (leader && options.progress) progress.message(text);
  };
  std::string resume_from;
  if (options.resume == "auto") {
    resume_from = find_latest_checkpoint(checkpoints_dir);
    if (resume_from.empty()) message("no checkpoint in " + checkpoints_dir + ": starting from step 0");
  } else if (!options.resume.empty()) {
    resume_from = options.resume;
    if (!fs::is_directory(resume_from)) fail("--resume ", resume_from, ": no such checkpoint directory");
  }
  TrainSummary summary;
  // A mixture's balancing biases (model.moe_bias_update_rate; nn/moe_mlp.h), n_layers × experts:
  // moved after every applied step, kept by checkpoints — a checkpoint's are kept (unmoved at
  // rate 0) when resuming. Empty: none.
  std::vector<float> expert_bias;
  const double bias_rate = config.model.moe_bias_update_rate;
  if (!resume_from.empty()) {
    std::string data_note;
    summary.start_step =
        resume(resume_from, parts, engines, config, train_data, scaler, &data_note, &expert_bias);
    message("resumed from " + resume_from);
    if (!data_note.empty()) message(data_note);
  } else if (!tc.init_from.empty()) {
    // A Loom checkpoint (a step_N, or a run directory: its newest), or a HuggingFace directory.
    std::string checkpoint;
    if (!fs::exists(fs::path(tc.init_from) / "config.json"))
      if (const std::vector<std::string> found = checkpoints_at(tc.init_from); !found.empty())
        checkpoint = found.back();
    if (!checkpoint.empty()) {
      check_checkpoint_model(checkpoint, config,
                             "train.init_from starts from a checkpoint of the config's model");
      expert_bias = init_layout_from_checkpoint(checkpoint, parts, engines, config);
      message("weights from " + checkpoint);
    } else {
      init_layout_from_hf(tc.init_from, parts, engines, config);
      message("weights from " + tc.init_from);
    }
  }
  if (bias_rate > 0 && expert_bias.empty())
    expert_bias.assign(static_cast<size_t>(config.model.n_layers * config.model.moe_experts), 0.0f);
  for (Gpt2Stage* part : parts)
    if (!expert_bias.empty()) part->set_expert_biases(expert_bias);
  // metrics.jsonl, and TensorBoard and Prometheus as config [metrics] says (world rank 0).
  std::unique_ptr<StepReporter> reporter;
  if (leader) {
    std::ofstream out(fs::path(options.run_dir) / "config.toml");
    out << to_toml(config);
    reporter = std::make_unique<StepReporter>(
        options.run_dir,
        StepSinks{config.metrics.tensorboard, config.metrics.prometheus_textfile,
                  config.metrics.prometheus_port},
        resume_from.empty() ? -1 : summary.start_step);
    if (reporter->prometheus_port() > 0)
      message("serving the step metrics for Prometheus on port " +
              std::to_string(reporter->prometheus_port()) + " (GET /metrics)");
  }

  // Tokens are read on the host; a GPU gets a copy of each micro-batch.
  const Device host = device.is_cpu() ? device : Device::cpu();
  std::vector<Tensor> inputs, targets;  // one per micro-batch, on the device
  std::vector<Tensor> host_inputs, host_targets;  // what the loader fills (the same on a cpu)
  // Document masking: each micro-batch's document starts (data/documents.h), of the whole
  // sequences also under context parallelism (the attention masks by position), on the device.
  const bool masked = config.data.document_mask;
  std::vector<Tensor> documents, host_documents;
  for (int64_t m = 0; masked && m < accum; ++m) {
    host_documents.push_back(Tensor::empty({micro, seq_len}, DType::kI32, host));
    documents.push_back(device.is_cpu() ? host_documents.back()
                                        : Tensor::empty({micro, seq_len}, DType::kI32, device));
  }
  for (int64_t m = 0; m < accum; ++m) {
    host_inputs.push_back(Tensor::empty({micro, seq_len}, DType::kI32, host));
    host_targets.push_back(Tensor::empty({micro, seq_len}, DType::kI32, host));
    inputs.push_back(device.is_cpu() && !context_parallel
                         ? host_inputs.back()
                         : Tensor::empty({micro, local_seq}, DType::kI32, device));
    targets.push_back(device.is_cpu() && !context_parallel
                          ? host_targets.back()
                          : Tensor::empty({micro, local_seq}, DType::kI32, device));
  }
  // The timeline of the steps metrics.trace_from_step names (train/run_timeline.h).
  RunTimeline timeline(tracer, config.metrics, device,
                       {{"dp", &dp_count},
                        {"tp", &tp_count},
                        {"cp", cp_count.get()},
                        {"pp", &pp_count},
                        {"ep", ep_count.get()},
                        {"dp", experts_dp_count.get()},
                        {"dp", shard_count.get()},
                        {"dp_replicate", replicate_count.get()}},
                       world, options.run_dir, message);
  double data_seconds = 0;  // this step's time in the loader (and copies to the device)
  // data.eod_mask_loss: no target after an end-of-text input; data.loss_mask: none where the
  // shards' masks say so (the loader leaves them kIgnoredTarget). This rank's targets that count
  // in this step so far.
  const bool targets_masked = config.data.eod_mask_loss || config.data.loss_mask;
  int64_t step_counted_targets = 0;
  auto next_batch = [&](size_t m) {
    const double t = now_seconds();
    train_data.next_batch(host_inputs[m].data<int32_t>(), host_targets[m].data<int32_t>());
    if (config.data.eod_mask_loss)  // which also counts what is left
      step_counted_targets +=
          mask_targets_after_eot(host_targets[m].data<int32_t>(), host_inputs[m].data<int32_t>(),
                                 micro * seq_len, static_cast<int32_t>(config.data.eot_token));
    else if (targets_masked)
      step_counted_targets += counted_targets(host_targets[m].data<int32_t>(), micro * seq_len);
    if (masked) {
      document_starts(host_documents[m].data<int32_t>(), host_inputs[m].data<int32_t>(), micro,
                      seq_len, static_cast<int32_t>(config.data.eot_token));
      if (!device.is_cpu()) documents[m].copy_from_host_queued(host_documents[m]);
    }
    // To a GPU queued behind the last micro-batch's work, not waiting for it (which would also
    // count that work's time as the loader's).
    if (context_parallel) {  // this rank's positions of each sequence, cut on the host
      inputs[m].copy_from_host_queued(shard_tokens(host_inputs[m], sequence_shard->positions()));
      targets[m].copy_from_host_queued(shard_tokens(host_targets[m], sequence_shard->positions()));
    } else if (!device.is_cpu()) {
      inputs[m].copy_from_host_queued(host_inputs[m]);
      targets[m].copy_from_host_queued(host_targets[m]);
    }
    const double t1 = now_seconds();
    tracer.span("data", "data", t, t1);
    data_seconds += t1 - t;
  };
  Allocator& allocator = allocator_for(device);
  DataParallelMemory state_bytes;
  for (DataParallel* e : engines) {
    state_bytes.params += e->memory().params;
    state_bytes.grads += e->memory().grads;
    state_bytes.optimizer += e->memory().optimizer;
  }
  // Start-up: the layout, each rank's coordinates, parameters and expected memory.
  summary.layout_report = startup_layout_report(world, mesh, config, parts, state_bytes,
                                                &summary.expected_activation_bytes);
  summary.layout_report += train_data.describe(tc.samples_before(tc.steps) * seq_len);
  if (const std::optional<BatchRampup> ramp = parse_batch_rampup(tc.batch_rampup)) {
    int64_t ramp_steps = 0;
    for (int64_t read = 0; tc.batch_size_at(read) < tc.batch_size; ++ramp_steps)
      read += tc.batch_size_at(read);
    summary.layout_report +=
        detail::concat("train.batch_rampup: the batch grows from ", ramp->start, " by ",
                       ramp->increment, " to ", tc.batch_size, " over the first ", ramp->samples,
                       " sequences (steps 1-", ramp_steps, ")\n");
  }
  if (config.data.reset_position_ids)
    summary.layout_report +=
        model_config_of(config).position_rows() > 0
            ? "data.reset_position_ids: each token reads the position row of its place in its "
              "document\n"
            : "data.reset_position_ids: rotary positions are relative, the same within each "
              "document already: nothing to reset\n";
  if (tc.z_loss > 0)
    summary.layout_report += detail::concat("train.z_loss: ", tc.z_loss,
                                            " x lse^2 in each position's gradient (the loss "
                                            "shown is the cross-entropy)\n");
  if (leader && options.progress) std::fputs(summary.layout_report.c_str(), stderr);
  const int64_t end_step = options.stop_after > 0 ? std::min(options.stop_after, tc.steps) : tc.steps;
  // Model flops of a token and the peak of one rank, for tflops and the MFU.
  const double flops_per_token = model_config_of(config).flops_per_token(seq_len);
  const size_t expert_counts = model_config_of(config).expert_counts_size();
  const double peak_tflops = leader ? rank_peak_tflops(config, device) : 0;
  double time_total = 0;
  int64_t steps_timed = 0;
  double tokens_timed = 0;
  // train.batch_rampup: each step's global batch from the sequences read before it (the same
  // on every rank and layout, and on a resume); its micro-batches per rank, `accum` at most.
  int64_t consumed = tc.samples_before(summary.start_step);
  // The run's saves (train/async_checkpoint.h): staged here, from this rank's parts of the model,
  // written now or in the background, published once every rank wrote its files.
  RunCheckpoints saves(world, checkpoints_dir, tc.keep_checkpoints, leader, message);
  auto checkpoint = [&](int64_t step) {
    const bool async = tc.async_checkpoint;
    saves.save(
        step,
        [&] {
          TrainingState st;
          st.step = step;
          st.optimizer_steps = engines[0]->optimizer_steps();
          st.seed = static_cast<uint64_t>(tc.seed);
          st.config_toml = to_toml(config);
          st.loss_scaler = scaler.state();
          st.expert_bias = expert_bias;
          train_data.save(st);
          // Staged (train/sharded_io.h): with `async`, with copies of its own that training does
          // not touch.
          StagedCheckpoint staged = stage_layout_checkpoint(checkpoints_dir, parts, engines, mesh,
                                                            config, st, async, ep_count.get());
          if (async && leader && fault.fails_save(step))
            staged.write = [step] {
              fail("LOOM_TEST_FAULT: the checkpoint write of step ", step, " fails");
            };
          return staged;
        },
        async);
  };

  summary.last_step = summary.start_step;
  const std::vector<CountingCommunicator*> axis_counts = {
      &dp_count,         &pp_count,
      &tp_count,         cp_count.get(),
      ep_count.get(),    experts_dp_count.get(),
      shard_count.get(), replicate_count.get()};  // not eval's
  // Communication the GPU waited for (Work::wait_on_device) reports its failures here, before
  // the numbers it fed are judged: a timeout named as one, not a loss that "diverged".
  const auto check_axes = [&] {
    for (CountingCommunicator* c : axis_counts)
      if (c != nullptr) c->check();
  };
  // The schedule's bubble at unit costs, beside each step's measured one (a ramp-up step's
  // schedule's own).
  const auto bubble_theory = [&] { return pipelined ? theoretical_bubble(pipe->schedule()) : 0.0; };
  for (int64_t step = summary.start_step + 1; step <= end_step; ++step) {
    const double t0 = now_seconds();
    const int64_t step_batch = tc.batch_size_at(consumed);
    const int64_t step_accum = step_batch / (micro * config.parallel.dp);
    const int64_t step_tokens = step_batch * seq_len;
    consumed += step_batch;
    for (CountingCommunicator* c : axis_counts) {
      if (c == nullptr) continue;
      c->take_bytes();
      c->take_wait_seconds();
    }
    data_seconds = 0;
    StepFigures figures;
    figures.step = step;
    figures.held_bytes = allocator.stats().bytes_in_use;
    allocator.reset_peak();
    double loss = 0, grad_norm = 0, comm_wait = 0;
    double mean_lse_square = 0;  // with train.z_loss: the step's mean lse² (its z-loss / z_loss)
    double aux_loss = 0;  // a mixture of experts' balance losses, the mean over micro-batches
    // With a mixture of experts: the step's tokens per expert, n_layers × experts block-major,
    // then the pairs their capacity dropped (Gpt2Stage::add_expert_tokens).
    std::vector<double> expert_tokens(expert_counts);
    // The schedule follows the sequences consumed, in full batches: step - 1 and step but for a
    // batch-size ramp-up's steps.
    const auto full_batches = [&](int64_t sequences) {
      return static_cast<double>(sequences) / static_cast<double>(tc.batch_size);
    };
    const float lr =
        lr_schedule.at_progress(full_batches(consumed - step_batch), full_batches(consumed));
    // Backward runs on loss × S; the norm comes back unscaled, non-finite on an overflow, and
    // every rank sees the same norm, so all of them skip the same steps (optim/loss_scaler.h).
    // A skipped step still consumes its batch and advances the LR schedule (step is the data
    // position); AdamW's own step count does not move.
    const double loss_scale = scaler.scale();
    // The heads take each micro-batch's mean over all its positions; with data.eod_mask_loss or
    // data.loss_mask the step's loss is the mean over the targets that count in the whole batch
    // (every layout's the same): one factor, positions / counted, on the loss and on the gradients
    // — folded into their unscaling, so no pass of its own. Known once the step's batches are read.
    const auto masked_loss_factor = [&] {
      if (!targets_masked) return 1.0;
      // Over the data-parallel group, whose ranks under context parallelism include each cp
      // group's, which counts its sequences once a rank: the factor the same.
      const double counted = all_reduce_value(dp, static_cast<double>(step_counted_targets));
      step_counted_targets = 0;
      const double positions = static_cast<double>(step_accum * micro * seq_len * dp.size());
      return counted > 0 ? positions / counted : 1.0;  // none counted: no loss, no gradient
    };
    bool applied = true;
    timeline.begin_step(step);
    TraceScope step_span(&tracer, "step ", "step", step);
    if (pipelined) {
      for (int64_t m = 0; m < step_accum; ++m) next_batch(static_cast<size_t>(m));
      {
        TraceScope span(&tracer, "pipeline: forward + backward of every micro-batch", "compute");
        // The step's micro-batches (a ramp-up step's are the first few) under a schedule for
        // their count (made again only when the count changes).
        const auto first = [&](const std::vector<Tensor>& all) {
          return std::vector<Tensor>(all.begin(), all.begin() + (all.empty() ? 0 : step_accum));
        };
        const std::vector<Tensor> step_documents = first(documents);
        pipe->set_microbatches(static_cast<int>(step_accum));
        loss = pipe->train_step(first(inputs), first(targets), loss_scale,
                                masked ? &step_documents : nullptr);
      }
      const double factor = masked_loss_factor();
      loss *= factor;
      mean_lse_square = pipe->stats().mean_lse_square * factor;
      aux_loss = pipe->stats().aux_loss;
      expert_tokens = pipe->stats().expert_tokens;
      TraceScope span(&tracer, "optimizer", "compute");
      grad_norm = pipe->clip_grad_norm(tc.grad_clip, loss_scale / factor);
      applied = scaler.update(grad_norm);
      if (applied) pipe->optimizer_step(lr);
      comm_wait = pipe->stats().recv_wait_seconds;
    } else {
      DataParallel& engine = *whole_engine;
      engine.begin_step();
      // Each micro-batch's loss read at the step's end, not after its forward; its ids checked by
      // the loader.
      ctx.losses = &step_losses;
      ctx.ids_checked = true;
      ctx.documents = masked ? &documents[0] : nullptr;  // refilled by each next_batch(0)
      for (int64_t m = 0; m < step_accum; ++m) {
        engine.begin_micro_batch(m, step_accum);
        next_batch(0);
        TraceScope span(&tracer, "forward + backward, micro-batch ", "compute", m);
        whole->forward_part(ctx, inputs[0], targets[0], nullptr);
        aux_loss += whole->aux_loss() / static_cast<double>(step_accum);
        whole->add_expert_tokens(expert_tokens);
        whole->backward_part(ctx, Tensor(), loss_scale / static_cast<double>(step_accum));
        engine.end_micro_batch();
      }
      ctx.losses = nullptr;
      ctx.ids_checked = false;
      ctx.documents = nullptr;
      for (double mean : step_losses.take()) loss += mean / static_cast<double>(step_accum);
      for (double mean : step_losses.taken_lse_square_means())
        mean_lse_square += mean / static_cast<double>(step_accum);
      // The loss of the global batch: the mean of the ranks' means (equal token counts); the
      // z-loss's mean lse² (0 without it), the balance losses and a mixture's tokens per expert
      // in the same all-reduce (the counts' mean times the ranks, rounded: their integer sum).
      std::vector<double> values = {loss, mean_lse_square, aux_loss};
      values.insert(values.end(), expert_tokens.begin(), expert_tokens.end());
      const std::vector<double> means = all_reduce_values(dp, values, ReduceOp::kAvg);
      loss = means[0];
      mean_lse_square = means[1];
      aux_loss = means[2];
      for (size_t i = 0; i < expert_tokens.size(); ++i)
        expert_tokens[i] = std::round(means[3 + i] * dp.size());
      const double factor = masked_loss_factor();
      loss *= factor;
      mean_lse_square *= factor;
      TraceScope span(&tracer, "optimizer", "compute");
      grad_norm = engine.clip_grad_norm(tc.grad_clip, loss_scale / factor);
      applied = scaler.update(grad_norm);
      if (applied) engine.optimizer_step(lr);
      comm_wait = engine.step_stats().wait_seconds;
    }
    step_span.end();
    check_axes();
    tracer.resolve_device_spans();  // those the stream has passed
    // The balancing biases follow the step's load (every rank's counts are the batch's).
    if (applied && bias_rate > 0) {
      update_expert_biases(expert_bias, per_expert(expert_tokens), config.model.moe_experts,
                           bias_rate);
      for (Gpt2Stage* part : parts) part->set_expert_biases(expert_bias);
    }
    if (!applied) {
      ++summary.skipped_steps;
      char buf[128];
      std::snprintf(buf, sizeof buf,
                    "step %ld: gradients overflowed at loss scale %g, step skipped",
                    static_cast<long>(step), loss_scale);
      message(buf);
    }
    const double dt = now_seconds() - t0;
    figures.comm_bytes = {dp_count.take_bytes(), pp_count.take_bytes(), tp_count.take_bytes(),
                          cp_count ? cp_count->take_bytes() : 0};
    // Expert parallelism: its token exchange on an axis of its own, the experts' gradient
    // reductions (over the ranks holding them) with dp's.
    figures.expert_parallel = ep_count != nullptr;
    if (ep_count) figures.comm_bytes.ep = ep_count->take_bytes();
    if (experts_dp_count) figures.comm_bytes.dp += experts_dp_count->take_bytes();
    if (shard_count) {
      figures.dp_replicate_bytes = replicate_count->take_bytes();
      figures.comm_bytes.dp += shard_count->take_bytes() + *figures.dp_replicate_bytes;
    }
    // Where the step's time went on this rank: the loader, blocked on each axis' communication
    // (a pipeline's bubble is its stages waiting for each other: pp), and the rest computing.
    figures.comm_seconds = {dp_count.take_wait_seconds(), pp_count.take_wait_seconds(),
                            tp_count.take_wait_seconds(),
                            cp_count ? cp_count->take_wait_seconds() : 0.0};
    if (ep_count) figures.comm_seconds.ep = ep_count->take_wait_seconds();
    if (experts_dp_count) figures.comm_seconds.dp += experts_dp_count->take_wait_seconds();
    if (shard_count)
      figures.comm_seconds.dp +=
          shard_count->take_wait_seconds() + replicate_count->take_wait_seconds();
    // Each pipeline rank's bubble (rank 0's pipeline group): the busiest stage is the one that
    // waits least, so rank 0's alone does not say where the step's time went.
    // On GPUs under nccl the host does not wait for the stages' messages, the compute stream does:
    // the bubble is then the stream's stalls on the pp axis over the step.
    // Likewise comm_wait_ms: the stream's stalls on dp (on pp with a pipeline), not the host's ~0.
    const bool stream_waits = pp_count.tensor_device().is_cuda();
    if (stream_waits) comm_wait = pipelined ? figures.comm_seconds.pp : figures.comm_seconds.dp;
    if (pipelined) {
      PipelineFigures p;
      p.bubble =
          stream_waits ? (dt > 0 ? figures.comm_seconds.pp / dt : 0.0) : pipe->stats().bubble();
      p.bubble_by_pp_rank =
          all_gather_values((pipeline_mesh ? *pipeline_mesh : mesh).axis("pp"), {p.bubble});
      p.bubble_theory = bubble_theory();
      p.bytes_sent = pipe->stats().bytes_sent;
      if (pipe->schedule().name.rfind("zb-", 0) == 0)
        p.max_deferred_bytes = pipe->stats().max_deferred_bytes;
      figures.pipeline = std::move(p);
    }
    if (!std::isfinite(loss))
      fail("loss is ", loss, " at step ", step, ": training diverged (lower train.lr?)");

    time_total += dt;
    ++steps_timed;
    tokens_timed += static_cast<double>(step_tokens);
    if (step == summary.start_step + 1) summary.first_loss = loss;
    summary.last_loss = loss;
    summary.last_step = step;
    figures.peak_bytes = allocator.stats().peak_bytes_in_use;
    summary.peak_bytes = std::max(summary.peak_bytes, figures.peak_bytes);
    summary.activation_peak_bytes =
        std::max(summary.activation_peak_bytes, figures.peak_bytes - figures.held_bytes);
    summary.comm_wait_s += comm_wait;
    const bool last = step == tc.steps;
    if (!val_corpora.empty() && (step % tc.eval_every == 0 || last)) {
      for (const ValCorpus& corpus : val_corpora) {
        const double val = validation_loss(rank_model, config, mesh, corpus.shards, device,
                                           shard_groups.replicate.get());
        if (corpus.name.empty()) {
          figures.val_loss = val;
          summary.last_val_loss = val;
        } else {
          figures.val_losses.emplace_back(corpus.name, val);
          summary.last_val_losses[corpus.name] = val;
        }
      }
      check_axes();  // as after the step: before the losses are believed
    }
    if (leader) {
      figures.loss = loss;
      if (tc.z_loss > 0) figures.z_loss = tc.z_loss * mean_lse_square;
      if (config.model.arch == "llama" && config.model.moe_experts > 0) {
        figures.moe_aux_loss = aux_loss;
        const std::vector<double> tokens = per_expert(expert_tokens);
        figures.moe_expert_load = expert_load(tokens, config.model.moe_experts);
        if (config.model.moe_capacity_factor > 0)
          figures.moe_dropped =
              expert_tokens.back() / std::max(1.0, std::reduce(tokens.begin(), tokens.end()));
      }
      figures.lr = lr;
      figures.grad_norm = grad_norm;
      figures.seconds = dt;
      figures.data_seconds = data_seconds;
      figures.comm_wait_seconds = comm_wait;
      figures.tokens_per_step = step_tokens;
      figures.tokens_total = consumed * seq_len;
      figures.batch_size = step_batch;
      figures.flops_per_step = flops_per_token * static_cast<double>(step_tokens);
      figures.peak_tflops = peak_tflops;
      figures.world_size = world.size();
      figures.state_bytes = state_bytes;
      if (scaler.enabled()) figures.loss_scale = loss_scale;
      figures.skipped = !applied;
      figures.data_epochs = train_data.epochs_read();
      reporter->report(step, step_record(figures));
      if (options.progress && (step % tc.log_every == 0 || last || step == end_step)) {
        const double mean_dt = time_total / static_cast<double>(steps_timed);
        progress.step(step, loss, lr, grad_norm, static_cast<double>(step_tokens) / dt,
                      mean_dt * static_cast<double>(end_step - step));
        const std::string val_text = validation_message(figures);
        if (!val_text.empty()) progress.message(val_text);
      }
    }
    if (leader && summary.start_step == 0) fault.strike_at(step);
    // Every rank sees the same answer, at the same step, whenever the signal reached each.
    const int signalled =
        options.stop_on_signal && !last
            ? static_cast<int>(all_reduce_value(world, stop_signal_received(), ReduceOp::kMax))
            : 0;
    const bool stopping =
        (options.stop_after > 0 && step == options.stop_after && !last) || signalled != 0;
    saves.commit_pending(false);  // the save in flight, if every rank has written it
    if ((tc.save_every > 0 && (step % tc.save_every == 0 || last)) || stopping) checkpoint(step);
    timeline.end_step(step);
    if (signalled) {
      summary.stopped_by_signal = signalled;
      break;
    }
  }
  saves.finish();  // the run's last save, if still being written
  summary.last_checkpoint = saves.last_checkpoint();
  summary.checkpoint_stall_s = saves.stall_seconds();
  timeline.finish(summary.last_step);
  if (leader) progress.finish();
  summary.tokens_per_s = steps_timed > 0 ? tokens_timed / time_total : 0;
  summary.memory = state_bytes;
  return summary;
}

}  // namespace loom
