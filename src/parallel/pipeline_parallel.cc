// Pipeline parallelism: see pipeline_parallel.h.
#include "parallel/pipeline_parallel.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "base/error.h"
#include "base/timer.h"
#include "kernels/ops.h"
#include "nn/deferred_weight_grads.h"
#include "nn/sequence_shard.h"
#include "nn/step_losses.h"
#include "parallel/tensor_parallel_gpt2.h"

namespace loom {

PipelineParallel::PipelineParallel(const Gpt2Config& model, Communicator& pp, Communicator& dp,
                                   ThreadPool& pool, Device device, const PipelineConfig& config,
                                   const DataParallelConfig& dp_config, const AdamWConfig& adamw,
                                   uint64_t seed)
    : model_config_(model),
      pp_(pp),
      dp_(dp),
      pool_(pool),
      device_(device),
      config_(config),
      expert_parallel_(dp_config.expert_parallel),
      reduce_scatters_(dp_config.zero == 1) {
  if (dp_config.zero > 1)
    fail("parallel.zero = ", dp_config.zero, " with parallel.pp = ", pp.size(),
         ": pipeline parallelism combines with ZeRO stages 0 and 1 only");
  // Balanced by the whole sequence's cost: a context-parallel rank's queries see all of its keys.
  const int64_t cost_seq_len =
      config.sequence != nullptr ? config.sequence->full_length() : config.seq_len;
  stage_begin_ = pipeline_partition(
      model, cost_seq_len, pp.size() * config.virtual_stages, config.layer_split,
      stage_placement(config.schedule, pp.size(), config.virtual_stages).v_placement);
  // zb-v's order is simulated on the stages' costs (the others' are formulas).
  stage_costs_ = pipeline_stage_costs(model, cost_seq_len, stage_begin_);
  schedule_ = make_schedule(config.schedule, pp.size(), config.microbatches, config.virtual_stages,
                            stage_costs_);
  check_schedule(schedule_);
  for (int c = 0; c < config.virtual_stages; ++c) {
    const Gpt2Part part = part_of_stage(schedule_.stage_of(pp.rank(), c));
    if (config.tensor_parallel != nullptr)
      chunks_.push_back(std::make_unique<TpGpt2>(model, *config.tensor_parallel,
                                                 config.sequence_parallel, part, config.experts));
    else
      chunks_.push_back(std::make_unique<Gpt2>(model, part, config.experts));
    // ZeRO-1 reduce-scatters each unit's gradient (Megatron's distributed optimizer under
    // pipelining): the tied embedding's unit waits for the sum of both copies (train_step), and
    // the gradient norm sums each stage's reduced chunks (clip_grad_norm).
    engines_.push_back(
        DataParallel::create(chunks_.back()->params(), dp, pool, device, dp_config, adamw, seed));
    if (reduce_scatters_ && model.tie_embeddings) {
      if (chunks_.back()->part().embedding)
        engines_.back()->defer_reduction(chunks_.back()->head_weight());
      if (const Parameter* copy = chunks_.back()->tied_head_copy())
        engines_.back()->defer_reduction(copy);
    }
  }
  // An untied head (model.tie_embeddings = false) has nothing to share with the embedding. In
  // the V placement rank 0 holds both copies, and its group is itself.
  const bool holds_wte = model.tie_embeddings && (pp.rank() == 0 ||
                                                  pp.rank() == rank_of_stage(schedule_.stages() - 1));
  tied_ = pp.split(holds_wte ? 0 : -1, pp.rank());
}

void PipelineParallel::set_microbatches(int microbatches) {
  if (microbatches == config_.microbatches) return;
  PipelineSchedule schedule = make_schedule(config_.schedule, pp_.size(), microbatches,
                                            config_.virtual_stages, stage_costs_);
  check_schedule(schedule);
  schedule_ = std::move(schedule);
  config_.microbatches = microbatches;
}

Gpt2Part PipelineParallel::part_of_stage(int s) const {
  Gpt2Part part;
  part.first_block = stage_begin_[static_cast<size_t>(s)];
  part.end_block = stage_begin_[static_cast<size_t>(s) + 1];
  part.embedding = s == 0;
  part.head = s == schedule_.stages() - 1;
  return part;
}

namespace {
// Forward FLOPs per token of a block — 2 per weight of its matrices (GPT-2: 12·C² weights) plus
// the attention's 4·T·C — and of the LM head (2·V·C); the embedding lookup is free.
struct StageFlops {
  double block_matrices = 0, block_attention = 0, head = 0;
};
StageFlops stage_flops(const Gpt2Config& model, int64_t seq_len) {
  // T: a block's attention span, the mean over blocks where a sliding window spans fewer.
  double spans = 0;
  for (int64_t l = 0; l < model.n_layers; ++l)
    spans += static_cast<double>(model.window_of(l) > 0 ? std::min(seq_len, model.window_of(l))
                                                        : seq_len);
  const double C = static_cast<double>(model.d_model),
               T = spans / static_cast<double>(model.n_layers);
  const double A = static_cast<double>(model.attention_width());  // C unless model.head_dim
  const double matrices = C * static_cast<double>(model.qkv_width()) + A * C +
                          (model.llama() ? 3.0 : 2.0) * C * static_cast<double>(model.hidden());
  return {2 * matrices, 4 * T * A, 2 * static_cast<double>(model.vocab_size) * C};
}
}  // namespace

StageCosts pipeline_stage_costs(const Gpt2Config& model, int64_t seq_len,
                                const std::vector<int64_t>& stage_begin) {
  const StageFlops f = stage_flops(model, seq_len);
  StageCosts costs;
  const size_t stages = stage_begin.size() - 1;
  for (size_t s = 0; s < stages; ++s) {
    const double blocks = static_cast<double>(stage_begin[s + 1] - stage_begin[s]);
    const double head = s + 1 == stages ? f.head : 0;
    // B: the input gradients' GEMMs (as many FLOPs as the forward's) and the attention's
    // backward (about twice its forward); W: the weight gradients' GEMMs.
    costs.forward.push_back(blocks * (f.block_matrices + f.block_attention) + head);
    costs.backward_input.push_back(blocks * (f.block_matrices + 2 * f.block_attention) + head);
    costs.backward_weight.push_back(blocks * f.block_matrices + head);
  }
  return costs;
}

namespace {
// The V placement's partition (v_placement): rank r runs stages r and S − 1 − r, so what bounds
// the step is a rank's two stages together. Every block costs the same, so only each rank's
// count matters: blocks go one at a time to the rank whose load then stays lowest (rank 0 starts
// with the LM head), each rank at least two; then each rank's pair is split as evenly as its
// costs allow (on rank 0 the head's stage takes fewer blocks).
std::vector<int64_t> v_partition(int64_t L, int stages, double block, double head) {
  const int pp = stages / 2;
  std::vector<int64_t> per_rank(pp, 2);
  for (int64_t left = L - 2 * pp; left > 0; --left) {
    int best = 0;
    for (int r = 1; r < pp; ++r) {
      const double load = static_cast<double>(per_rank[r] + 1) * block;
      const double best_load =
          static_cast<double>(per_rank[best] + 1) * block + (best == 0 ? head : 0);
      if (load < best_load) best = r;
    }
    ++per_rank[best];
  }
  std::vector<int64_t> count(stages);
  for (int r = 0; r < pp; ++r) {
    const int64_t k = per_rank[r];
    // The later stage (S − 1 − r) takes n of the k blocks; on rank 0 it also holds the head.
    int64_t n = k / 2;
    if (r == 0) {
      n = 1;
      for (int64_t t = 1; t < k; ++t)
        if (std::max(static_cast<double>(k - t) * block, static_cast<double>(t) * block + head) <
            std::max(static_cast<double>(k - n) * block, static_cast<double>(n) * block + head))
          n = t;
    }
    count[r] = k - n;
    count[stages - 1 - r] = n;
  }
  std::vector<int64_t> begin = {0};
  for (int64_t c : count) begin.push_back(begin.back() + c);
  return begin;
}
}  // namespace

std::vector<int64_t> pipeline_partition(const Gpt2Config& model, int64_t seq_len, int stages,
                                        const std::string& split, bool v_placement) {
  const int64_t L = model.n_layers;
  if (stages > L)
    fail("parallel.pp × parallel.virtual_stages = ", stages, " stages for model.n_layers = ", L,
         ": every stage needs at least one block");
  std::vector<int64_t> begin = {0};
  if (!split.empty()) {
    size_t pos = 0;
    while (pos <= split.size()) {
      const size_t comma = std::min(split.find(',', pos), split.size());
      const std::string item = split.substr(pos, comma - pos);
      int64_t n = 0;
      try {
        size_t used = 0;
        n = std::stoll(item, &used);
        if (used != item.size()) n = 0;
      } catch (const std::exception&) {
        n = 0;
      }
      if (n <= 0) fail("parallel.layer_split = \"", split, "\": '", item, "' is not a positive block count");
      begin.push_back(begin.back() + n);
      pos = comma + 1;
    }
    if (static_cast<int>(begin.size()) - 1 != stages || begin.back() != L)
      fail("parallel.layer_split = \"", split, "\" gives ", begin.size() - 1, " stages and ",
           begin.back(), " blocks; the layout has ", stages, " stages (pp × virtual_stages) and ",
           "model.n_layers = ", L);
    return begin;
  }
  const StageFlops f = stage_flops(model, seq_len);
  const double block = f.block_matrices + f.block_attention, head = f.head;
  if (v_placement && stages % 2 == 0 && L >= stages) return v_partition(L, stages, block, head);
  // Minimise the largest stage cost over contiguous splits (dynamic programming, O(S·L²)).
  const double inf = 1e300;
  // best[s][l]: the smallest possible maximum cost of stages 0..s−1 holding blocks 0..l−1.
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(L + 1, inf));
  std::vector<std::vector<int64_t>> cut(stages + 1, std::vector<int64_t>(L + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s)
    for (int64_t l = s; l <= L; ++l)
      for (int64_t k = s - 1; k < l; ++k) {  // stage s−1 holds blocks [k, l)
        const double cost = static_cast<double>(l - k) * block + (s == stages ? head : 0);
        const double worst = std::max(best[s - 1][k], cost);
        if (worst < best[s][l]) {
          best[s][l] = worst;
          cut[s][l] = k;
        }
      }
  std::vector<int64_t> ends(stages + 1, L);
  for (int s = stages; s > 0; --s) ends[s - 1] = cut[s][ends[s]];
  return ends;
}

int PipelineParallel::tag(int microbatch, int stage, bool backward) const {
  return (microbatch * schedule_.stages() + stage) * 2 + (backward ? 1 : 0);
}

Tensor PipelineParallel::activation() const {
  const int64_t B = config_.micro_batch_size, T = config_.seq_len;
  if (config_.tensor_parallel != nullptr)
    return Tensor::empty(static_cast<const TpGpt2&>(*chunks_.front()).boundary_shape(B, T),
                         DType::kF32, device_);
  return Tensor::empty({B, T, model_config_.d_model}, DType::kF32, device_);
}

void PipelineParallel::recv(Tensor& t, int src, int tag_value) {
  recv_boundary(t, src, tag_value, true);
}

Tensor PipelineParallel::to_wire(const Tensor& t) const {
  if (config_.send_dtype != DType::kBF16) return t;
  Tensor wire = Tensor::empty(t.shape(), DType::kBF16, device_);
  ops::round_to_bf16(Exec{&pool_, device_}, wire.data_u16(), t.data<float>(), t.numel());
  return wire;
}

WorkHandle PipelineParallel::send_boundary(const Tensor& t, int dst, int tag_value) {
  Tensor wire = to_wire(t);
  if (dst == pp_.rank()) {
    // The V's turn (stage pp − 1 to pp, both on rank pp − 1): the message stays in memory, rounded
    // as on the wire, so the run is the same as where the stages sit on two ranks.
    to_self_[tag_value] = wire.dtype() == DType::kF32 ? wire.clone() : wire;
    return nullptr;
  }
  return pp_.send_async(wire, dst, tag_value);
}

void PipelineParallel::recv_boundary(Tensor& t, int src, int tag_value, bool timed) {
  const double t0 = now_seconds();
  Tensor wire =
      config_.send_dtype == DType::kBF16 ? Tensor::empty(t.shape(), DType::kBF16, device_) : t;
  if (src == pp_.rank()) {
    const auto it = to_self_.find(tag_value);
    LOOM_CHECK_MSG(it != to_self_.end(),
                   "pipeline: a stage's message to its own rank was not sent");
    wire = it->second;
    to_self_.erase(it);
    if (config_.send_dtype != DType::kBF16) {
      t = wire;
      return;
    }
  } else {
    // On GPUs (nccl) the compute stream waits for the message, not the host: the wait counted
    // below is then the host's only, ~0 (the trainer's bubble takes the stream's pp stalls).
    pp_.recv_async(wire, src, tag_value)->wait_on_device();
  }
  if (config_.send_dtype == DType::kBF16)
    ops::widen_bf16(Exec{&pool_, device_}, t.data<float>(), wire.data_u16(), t.numel());
  if (timed) stats_.recv_wait_seconds += now_seconds() - t0;
}

double PipelineParallel::train_step(const std::vector<Tensor>& tokens,
                                    const std::vector<Tensor>& targets, double loss_scale,
                                    const std::vector<Tensor>* documents) {
  const int m = config_.microbatches;
  LOOM_CHECK(static_cast<int>(tokens.size()) == m && static_cast<int>(targets.size()) == m);
  LOOM_CHECK(documents == nullptr || static_cast<int>(documents->size()) == m);
  const double t0 = now_seconds();
  stats_ = PipelineStepStats{};
  for (auto& engine : engines_) engine->begin_step();
  const int S = schedule_.stages();
  const int rank = pp_.rank();
  // Per (chunk, micro-batch): received inputs / output gradients, outputs to send, stashes.
  std::map<std::pair<int, int>, Tensor> inbox, outbox;
  std::map<std::pair<int, int>, std::vector<Tensor>> stash;
  double aux_sum = 0;  // Σ over this rank's forwards of Gpt2Stage::aux_loss
  const Gpt2Config& mc = chunks_.front()->config();
  std::vector<double> expert_tokens(mc.expert_counts_size());
  // Weight gradients a zero-bubble schedule's B left for its W (nn/deferred_weight_grads.h).
  std::map<std::pair<int, int>, DeferredWeightGrads> deferred;
  std::vector<int> backwards_done(chunks_.size(), 0);
  std::vector<WorkHandle> sends;  // (each holds the tensor it sends until it is done)
  // The last stage's micro-batch losses, read at the step's end (nn/step_losses.h).
  StepLosses losses(device_);
  Context ctx{&pool_, device_, DType::kF32, nullptr};
  ctx.sequence = config_.sequence;
  ctx.losses = &losses;
  ctx.ids_checked = config_.ids_checked;
  ctx.tp_backward_overlap = config_.tp_backward_overlap;
  ctx.z_loss = config_.z_loss;
  ctx.reset_position_ids = config_.reset_position_ids;
  for (const PipeAction& a : schedule_.actions[static_cast<size_t>(rank)]) {
    const int c = a.chunk, i = a.microbatch, s = schedule_.stage_of(rank, c);
    const auto key = std::make_pair(c, i);
    Gpt2Stage& model = *chunks_[static_cast<size_t>(c)];
    ctx.hooks = engines_[static_cast<size_t>(c)].get();
    ctx.rounded_weights = engines_[static_cast<size_t>(c)]->rounded_weights();
    // This micro-batch's documents, for its forward and for its backward (which may run the
    // forward again: recomputation).
    ctx.documents = documents != nullptr ? &(*documents)[static_cast<size_t>(i)] : nullptr;
    switch (a.kind) {
      case PipeActionKind::kRecvForward:
      case PipeActionKind::kRecvBackward: {
        const bool backward = a.kind == PipeActionKind::kRecvBackward;
        Tensor t = activation();
        recv(t, rank_of_stage(backward ? s + 1 : s - 1), tag(i, s, backward));
        inbox[key] = t;
        break;
      }
      case PipeActionKind::kForward: {
        const Tensor input = s == 0 ? tokens[static_cast<size_t>(i)] : inbox.at(key);
        inbox.erase(key);
        Tensor out = model.forward_part(ctx, input, targets[static_cast<size_t>(i)], nullptr);
        aux_sum += model.aux_loss();
        model.add_expert_tokens(expert_tokens);
        if (s != S - 1) outbox[key] = out;
        stash[key] = model.stash_activations();
        stats_.max_in_flight = std::max(stats_.max_in_flight, static_cast<int>(stash.size()));
        break;
      }
      case PipeActionKind::kBackward:
      case PipeActionKind::kBackwardInput: {
        // Split (B of a zero-bubble schedule): the Linears leave their weight gradients in
        // `later`, which also records the units' hook calls for W to replay to the engine.
        const bool split = a.kind == PipeActionKind::kBackwardInput;
        DataParallel& engine = *engines_[static_cast<size_t>(c)];
        if (!split) engine.begin_micro_batch(backwards_done[static_cast<size_t>(c)]++, m);
        model.unstash_activations(std::move(stash.at(key)));
        stash.erase(key);
        Tensor dy;
        if (s != S - 1) {
          dy = inbox.at(key);
          inbox.erase(key);
        }
        DeferredWeightGrads* later = split ? &deferred[key] : nullptr;
        if (split) ctx.hooks = later;
        ctx.deferred_weight_grads = later;
        Tensor dx = model.backward_part(ctx, dy, loss_scale / m);
        ctx.deferred_weight_grads = nullptr;
        if (split) {
          int64_t bytes = 0;
          for (const auto& [k, d] : deferred) bytes += d.bytes();
          stats_.max_deferred = std::max(stats_.max_deferred, static_cast<int>(deferred.size()));
          stats_.max_deferred_bytes = std::max(stats_.max_deferred_bytes, bytes);
        } else {
          engine.end_micro_batch();
        }
        if (s != 0) outbox[key] = dx;
        break;
      }
      case PipeActionKind::kBackwardWeight: {
        DataParallel& engine = *engines_[static_cast<size_t>(c)];
        engine.begin_micro_batch(backwards_done[static_cast<size_t>(c)]++, m);
        deferred.at(key).run(ctx.exec(), &engine);
        deferred.erase(key);
        engine.end_micro_batch();
        break;
      }
      case PipeActionKind::kSendForward:
      case PipeActionKind::kSendBackward: {
        const bool backward = a.kind == PipeActionKind::kSendBackward;
        const int to = s + (backward ? -1 : 1);
        const Tensor& t = outbox.at(key);
        if (rank_of_stage(to) != rank)
          stats_.bytes_sent += t.numel() * static_cast<int64_t>(dtype_size(config_.send_dtype));
        if (WorkHandle w = send_boundary(t, rank_of_stage(to), tag(i, to, backward)))
          sends.push_back(std::move(w));
        outbox.erase(key);
        break;
      }
    }
  }
  for (const WorkHandle& w : sends) w->wait_on_device();
  LOOM_CHECK_MSG(stash.empty() && inbox.empty() && deferred.empty() && to_self_.empty(),
                 "pipeline schedule left activations or weight gradients behind");
  // The tied embedding: the first stage's wte and the last stage's copy get the sum of both
  // gradients, so both update identically — averaged over dp already (stage 0), or this rank's
  // sums over its micro-batches, reduce-scattered after it (stage 1: the average of the sum).
  if (tied_ != nullptr && tied_->size() > 1) {
    Parameter* wte = chunks_.front()->part().embedding ? chunks_.front()->head_weight()
                                                       : chunks_.back()->head_weight();
    tied_->all_reduce_async(wte->grad, ReduceOp::kSum)->wait_on_device();
  } else if (Parameter* copy = chunks_.back()->tied_head_copy();
             copy != nullptr && chunks_.front()->part().embedding) {
    // Both copies on this rank (the V placement): the same sum, a + b, without a message.
    Parameter* wte = chunks_.front()->head_weight();
    ops::add_inplace(Exec{&pool_, device_}, wte->grad.data<float>(), copy->grad.data<float>(),
                     wte->grad.numel());
    copy->grad.copy_from(wte->grad);
  }
  if (reduce_scatters_)
    for (auto& engine : engines_) engine->reduce_deferred();
  // The loss lives on the last stage; share the mean over micro-batches (and over dp).
  // A mixture of experts' balance losses and tokens per expert are each stage's: summed over pp
  // likewise, in the same all-reduces (the counts' mean over dp times its ranks, rounded: their
  // integer sum).
  double loss_sum = 0, lse_square_sum = 0;
  for (double mean : losses.take()) loss_sum += mean;  // in the order they ran
  for (double mean : losses.taken_lse_square_means()) lse_square_sum += mean;
  std::vector<double> values = {loss_sum / m, lse_square_sum / m, aux_sum / m};
  values.insert(values.end(), expert_tokens.begin(), expert_tokens.end());
  const std::vector<double> means =
      all_reduce_values(dp_, all_reduce_values(pp_, values), ReduceOp::kAvg);
  const double loss = means[0];
  stats_.mean_lse_square = means[1];
  stats_.aux_loss = means[2];
  stats_.expert_tokens.assign(means.begin() + 3, means.end());
  for (double& count : stats_.expert_tokens) count = std::round(count * dp_.size());
  stats_.step_seconds = now_seconds() - t0;
  return loss;
}

double PipelineParallel::clip_grad_norm(double max_norm, double loss_scale) {
  Communicator* tp = config_.tensor_parallel;
  // Summed per stage, then over the stages in order: the same bits wherever the stages sit
  // (interleaved and zb-v place the same stages on other ranks).
  const int S = schedule_.stages();
  std::vector<double> per_stage(static_cast<size_t>(S), 0.0);
  if (reduce_scatters_) {
    // ZeRO-1: each engine's reduced chunks, summed over dp (and the experts' groups) by it; the
    // last stage's copy of the tied wte left out.
    for (size_t c = 0; c < chunks_.size(); ++c)
      per_stage[static_cast<size_t>(stage_of_chunk(static_cast<int>(c)))] +=
          engines_[c]->grad_sum_squares(chunks_[c]->tied_head_copy());
    return finish_clip(per_stage, max_norm, loss_scale);
  }
  // The last stage's copy of the tied wte is the same gradient as the first stage's; a
  // parameter replicated over tp (no shard pieces) counts on tp rank 0 only. Every chunk's
  // parameters' sums come back together (one wait on a GPU) and are added in order. Under
  // expert parallelism a rank holds its experts only: their squares are summed over the
  // expert-parallel group first (each stage's apart), as DataParallel::clip_grad_norm does.
  std::vector<const float*> grads;
  std::vector<int64_t> sizes;
  std::vector<size_t> chunk_of;  // of each summed parameter
  std::vector<bool> of_experts;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const Parameter* duplicate = chunks_[c]->tied_head_copy();
    for (const ParamUnit& unit : chunks_[c]->params().units())
      for (const Parameter* p : unit.params) {
        if (p == duplicate) continue;
        if (tp != nullptr && p->pieces.empty() && tp->rank() != 0) continue;
        grads.push_back(p->grad.data<float>());
        sizes.push_back(p->numel());
        chunk_of.push_back(c);
        of_experts.push_back(unit.experts);
      }
  }
  const std::vector<double> sums = ops::sum_squares_each(Exec{&pool_, device_}, grads, sizes);
  std::vector<double> experts_per_stage(static_cast<size_t>(S), 0.0);
  for (size_t i = 0; i < sums.size(); ++i) {
    const auto s = static_cast<size_t>(stage_of_chunk(static_cast<int>(chunk_of[i])));
    (of_experts[i] ? experts_per_stage[s] : per_stage[s]) += sums[i];
  }
  if (expert_parallel_ != nullptr && expert_parallel_->size() > 1)
    experts_per_stage = all_reduce_values(*expert_parallel_, experts_per_stage);
  for (size_t s = 0; s < per_stage.size(); ++s) per_stage[s] += experts_per_stage[s];
  return finish_clip(per_stage, max_norm, loss_scale);
}

double PipelineParallel::finish_clip(std::vector<double> per_stage, double max_norm,
                                     double loss_scale) {
  Communicator* tp = config_.tensor_parallel;
  per_stage = all_reduce_values(pp_, per_stage);  // each entry: one stage's sum plus zeros
  double sum = 0;
  for (double stage_sum : per_stage) sum += stage_sum;
  if (tp != nullptr) sum = all_reduce_value(*tp, sum);
  // Unscaled as DataParallel::clip_grad_norm does (exact: loss_scale is a power of two).
  const double norm = std::sqrt(sum) / loss_scale;  // NaN stays NaN: an overflow
  if (!std::isfinite(norm)) return norm;  // an overflow: the step is skipped
  // Each chunk's engine reads its gradients times the factor in the update, as after its own clip.
  const auto coef = static_cast<float>(clip_coefficient(norm, max_norm) / loss_scale);
  for (auto& engine : engines_) engine->set_gradient_factor(coef);
  return norm;
}

void PipelineParallel::optimizer_step(float lr) {
  for (auto& engine : engines_) engine->optimizer_step(lr);
}

double PipelineParallel::evaluate(const Tensor& tokens, const Tensor& targets, StepLosses* queue,
                                  const Tensor* documents) {
  // Stage by stage, forward only; each rank visits its stages in increasing order, so every
  // receive's sender is already on its way.
  Context ctx{&pool_, device_, DType::kF32, nullptr};
  ctx.sequence = config_.sequence;
  ctx.losses = queue;
  ctx.ids_checked = config_.ids_checked;  // the trainer's loaders check them, evaluation's too
  ctx.documents = documents;
  ctx.reset_position_ids = config_.reset_position_ids;
  const int S = schedule_.stages();
  double loss = 0;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const int s = schedule_.stage_of(pp_.rank(), static_cast<int>(c));
    ctx.hooks = engines_[c].get();
    ctx.rounded_weights = engines_[c]->rounded_weights();
    Tensor input = tokens;
    if (s > 0) {
      input = activation();
      recv_boundary(input, rank_of_stage(s - 1), tag(0, s, false), false);
    }
    Tensor out = chunks_[c]->forward_part(ctx, input, targets, &loss);
    chunks_[c]->clear_cache();
    if (s < S - 1)
      if (WorkHandle w = send_boundary(out, rank_of_stage(s + 1), tag(0, s + 1, false)))
        w->wait_on_device();
  }
  if (queue != nullptr) return 0.0;
  return all_reduce_value(pp_, loss);  // non-zero on the last stage's rank only
}

double PipelineParallel::queued_loss_sum(StepLosses& queue) {
  double sum = 0;
  for (double mean : queue.take()) sum += mean;  // the last stage's rank's; empty elsewhere
  return all_reduce_value(pp_, sum);
}

}  // namespace loom
