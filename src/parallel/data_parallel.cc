// Data parallelism, ZeRO stages 0-3: see data_parallel.h for the design.
#include "parallel/data_parallel.h"

#include <cmath>
#include <deque>
#include <optional>

#include "base/error.h"
#include "base/timer.h"
#include "device/allocator.h"
#include "kernels/ops.h"

namespace loom {
namespace {

// A stage 0 all-reduce bucket: consecutive units, taken from the last one (the first whose
// gradients backward finishes) and closed once they hold bucket_bytes.
struct Bucket {
  int64_t begin = 0, numel = 0;  // flat range
  int units = 0;                 // units in the bucket
  int units_left = 0;            // of which not final yet this step
  bool experts = false;          // expert units (reduced over their own group)
  WorkHandle work;
  Tensor wire;  // with a bf16 reduce_dtype: the bucket's gradients as reduced, in bf16
};

class ZeroDataParallel final : public DataParallel {
 public:
  ZeroDataParallel(ParameterStore& params, Communicator& dp, ThreadPool& pool, Device device,
                   const DataParallelConfig& config, const AdamWConfig& adamw, uint64_t seed);

  void begin_step() override;
  void begin_micro_batch(int64_t index, int64_t count) override;
  void end_micro_batch() override;
  double clip_grad_norm(double max_norm, double loss_scale) override;
  void set_gradient_factor(float factor) override { grad_scale_ = factor; }
  double grad_sum_squares(const Parameter* skip) override;
  void defer_reduction(const Parameter* p) override;
  void reduce_deferred() override;
  void optimizer_step(float lr) override;
  FlatModelState gather_state() override;
  void load_state(const FlatModelState& state, int64_t optimizer_steps) override;
  int64_t optimizer_steps() const override { return optimizer_->steps_taken(); }
  FlatModelState owned_state(std::vector<std::pair<int64_t, int64_t>>& ranges) override;
  int zero_stage() const override { return stage_; }

  void before_forward(size_t unit) override;
  void after_forward(size_t unit) override;
  void before_backward(size_t unit) override;
  void after_backward(size_t unit) override;

 private:
  // Unit u's chunk for this rank: flat elements [chunk_begin(u), + chunk(u)), and in the shard
  // buffers [shard_offset_[u], + chunk(u)).
  int64_t chunk(size_t u) const { return params_.units()[u].numel / size_of(u); }
  int64_t chunk_begin(size_t u) const { return params_.units()[u].begin + rank_of(u) * chunk(u); }
  // The group unit u is reduced, sharded and gathered over: dp (the shard group under hybrid
  // sharding), or for expert units the ranks holding the same experts.
  bool is_experts(size_t u) const { return params_.units()[u].experts; }
  // Hybrid sharding: unit u's reduced chunk is all-reduced over the replicas too.
  bool replicated(size_t u) const { return replicate_ != nullptr && !is_experts(u); }
  Communicator& comm_of(size_t u) const { return is_experts(u) ? *experts_dp_ : dp_; }
  int rank_of(size_t u) const { return comm_of(u).rank(); }
  int size_of(size_t u) const { return comm_of(u).size(); }
  // Expert gradients sum their expert-parallel group's tokens: divided by its size before the
  // average over experts_dp_, they are the mean over dp's batch (parallel/expert_parallel.h).
  void scale_expert_grads(Tensor& grads) const;
  Tensor shard_of(const Tensor& shard, size_t u) const { return shard.narrow(shard_offset_[u], chunk(u)); }
  bool last_micro_batch() const { return micro_index_ + 1 == micro_count_; }
  size_t num_units() const { return params_.units().size(); }

  void wait(const WorkHandle& work);
  void build_buckets(int64_t bucket_bytes);
  std::vector<AdamWSegment> shard_segments() const;
  // Stage 3: gathers unit u's values (waiting for its prefetch, if issued) and binds them.
  void gather_values(size_t u);
  void issue_gather(size_t u);
  void release_values(size_t u);
  // Stages 1-3: reduce-scatters unit u's full gradient `full` over its group (in bf16 with a
  // bf16 reduce_dtype_), then — hybrid sharding — the reduced chunk over the replicas.
  void issue_reduce_scatter(size_t u, const Tensor& full);
  // Stages 1-3: folds completed reduce-scatters in issue order into the gradient shard (stage 1:
  // over the rank's chunk of the full gradient); with `all`, waits for every outstanding one.
  void drain_reduce_scatters(bool all);
  // Hybrid sharding: waits for a pending reduce-scatter and all-reduces its chunk over the
  // replicas. Issued in unit order at fixed points (after the next unit's reduce-scatter, or
  // when draining), never on a test's outcome: every rank issues the same sequence of
  // collectives on its communicators, as nccl's streams need.
  struct PendingReduce;
  void issue_replica_reduce(PendingReduce& pending);
  // Stage 0: notes buckets whose all-reduce has completed (for the overlap statistics).
  void poll_buckets();
  // All-gathers every unit of a flat buffer from the ranks' chunks (this rank's at `shard`,
  // in shard layout) into `full` (the store's flat layout).
  void all_gather_units(const Tensor& shard, Tensor& full);

  ParameterStore& params_;
  Communicator& all_dp_;     // every data-parallel rank (stage 0's buckets)
  Communicator& dp_;         // the ranks the state is sharded over: all_dp_, or the shard group
  Communicator* replicate_;  // hybrid sharding: the ranks holding the same chunks, else null
  ThreadPool& pool_;
  Device device_;
  int stage_;
  // Stage 0: buckets all-reduced, every rank's gradient whole; else each unit reduce-scattered
  // into its chunks.
  bool all_reduces_;
  int rank_, size_;
  std::vector<int64_t> shard_offset_;  // per unit
  int64_t shard_numel_ = 0;
  std::unique_ptr<AdamW> optimizer_;
  Communicator* tensor_parallel_ = nullptr;
  Communicator* experts_dp_ = nullptr;  // expert parallelism (DataParallelConfig)
  Communicator* expert_parallel_ = nullptr;
  bool has_experts_ = false;  // the store has expert units
  // With tensor parallelism: the (offset, numel) ranges of `grads` (flat with whole gradients or
  // stage 1's chunks, the shard in 2/3) that this rank counts in the gradient norm.
  // (experts: a range of an expert unit's, which whole gradients sum over ep first.)
  struct NormRange {
    int64_t offset = 0, numel = 0;
    bool experts = false;
  };
  std::vector<NormRange> norm_ranges_;
  // Stages 1-3: each parameter's piece of the reduced chunks (shard_segments' order; stage 1:
  // where they are in the full gradient), a parameter replicated over tp on tp rank 0 only,
  // `skip`'s left out.
  std::vector<NormRange> chunk_norm_ranges(const Parameter* skip) const;
  Tensor shard_values_;  // stage 3
  Tensor shard_grads_;   // stages 2/3
  int64_t micro_index_ = 0, micro_count_ = 1;
  float grad_scale_ = 1.0f;  // clip_grad_norm's factor, applied by the next optimizer_step

  // Stage 0.
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_unit_;
  std::vector<bool> bucket_seen_done_;
  // Stages 1-3: reduce-scatters in flight, in issue order.
  struct PendingReduce {
    size_t unit;
    WorkHandle work;  // the reduce-scatter, then (hybrid sharding) the replicas' all-reduce
    Tensor output;  // chunk(unit) elements, of reduce_dtype_
    Tensor input;   // with a bf16 reduce_dtype_: the unit's gradient rounded, kept until done
    bool awaits_replicas = false;  // hybrid sharding: the all-reduce is still to be issued
  };
  DType reduce_dtype_ = DType::kF32;
  Exec exec() const { return Exec{&pool_, device_}; }
  std::deque<PendingReduce> reducing_;
  std::vector<Tensor> unit_grads_;  // full gradients of the units inside their backward
  // Stage 3.
  std::vector<Tensor> gathered_;       // full values of gathered units (undefined: not gathered)
  std::vector<WorkHandle> gathering_;  // a gather issued and not yet waited for
  // With a bf16 gather_dtype_: a gather's bf16 input (this rank's chunk rounded) and output,
  // kept until it is waited for, then widened into gathered_.
  std::vector<std::pair<Tensor, Tensor>> gather_wire_;
  DType gather_dtype_ = DType::kF32;
  // Stage 3: the unit backward visits after each (itself for the last), and whether this
  // micro-batch's backward has begun.
  std::vector<size_t> backward_next_;
  bool in_backward_ = false;
  std::vector<bool> deferred_;  // stage 1: units reduced by reduce_deferred (defer_reduction)
  // Stage 1 reduce-scatters unit u's step gradient (in place in the full buffer).
  void reduce_scatter_full(size_t u);
};

ZeroDataParallel::ZeroDataParallel(ParameterStore& params, Communicator& dp, ThreadPool& pool,
                                   Device device, const DataParallelConfig& config,
                                   const AdamWConfig& adamw, uint64_t seed)
    : params_(params),
      all_dp_(dp),
      dp_(config.shard_group != nullptr ? *config.shard_group : dp),
      replicate_(config.replicate_group),
      pool_(pool),
      device_(device),
      stage_(config.zero),
      all_reduces_(config.zero == 0),
      rank_(dp_.rank()),
      size_(dp_.size()) {
  if (stage_ < 0 || stage_ > 3) fail("parallel.zero = ", stage_, ": must be 0, 1, 2 or 3");
  LOOM_CHECK_MSG((config.shard_group == nullptr) == (replicate_ == nullptr),
                 "hybrid sharding needs both its shard and its replicate group");
  if (replicate_ != nullptr) {
    if (stage_ == 0)
      fail(
          "parallel.dp_shard: ZeRO stage 0 shards nothing; hybrid sharding needs "
          "parallel.zero = 1, 2 or 3");
    LOOM_CHECK_MSG(dp_.size() * replicate_->size() == all_dp_.size(),
                   "hybrid sharding: shard group × replicate group is not the dp group");
  }
  if (params.allocated()) fail("data parallel: the model's parameters are already allocated");
  if (config.reduce_dtype != DType::kF32 && config.reduce_dtype != DType::kBF16)
    fail("parallel.grad_reduce_dtype: gradients are reduced in fp32 or bf16, not ",
         dtype_name(config.reduce_dtype));
  // A group of one reduces nothing: its gradients stay as they are, as one device's.
  reduce_dtype_ = all_dp_.size() > 1 ? config.reduce_dtype : DType::kF32;
  if (config.gather_dtype != DType::kF32 && config.gather_dtype != DType::kBF16)
    fail("parallel.param_gather_dtype: parameters are gathered in fp32 or bf16, not ",
         dtype_name(config.gather_dtype));
  if (config.gather_dtype != DType::kF32 && stage_ != 3)
    fail("parallel.param_gather_dtype = \"bf16\" is for ZeRO-3's gathers (parallel.zero = 3), "
         "got parallel.zero = ", stage_);
  gather_dtype_ = size_ > 1 ? config.gather_dtype : DType::kF32;
  for (const ParamUnit& unit : params.units()) has_experts_ = has_experts_ || unit.experts;
  experts_dp_ = config.experts_data_parallel;
  expert_parallel_ = config.expert_parallel;
  if (has_experts_) {
    LOOM_CHECK_MSG(experts_dp_ != nullptr && expert_parallel_ != nullptr,
                   "expert units without their groups");
    LOOM_CHECK(experts_dp_->size() * expert_parallel_->size() == all_dp_.size());
  }
  Allocator& allocator = allocator_for(device);
  auto in_use = [&] { return allocator.stats().bytes_in_use; };

  // Units padded to 16·N elements: equal chunks, each 64-byte aligned. N is the whole dp group's
  // size, of which the shard group's and the expert units' group's sizes are divisors.
  AllocateOptions layout;
  layout.unit_multiple = stage_ == 0 ? 16 : 16 * static_cast<int64_t>(all_dp_.size());
  layout.values = stage_ < 3;
  layout.grads = stage_ < 2;
  int64_t before = in_use();
  params.allocate(DType::kF32, device, layout);
  const int64_t flat_bytes = in_use() - before;
  // The flat buffers are equal-sized; split the measured bytes between them.
  const int buffers = static_cast<int>(layout.values) + static_cast<int>(layout.grads);
  memory_.params = layout.values ? flat_bytes / buffers : 0;
  memory_.grads = layout.grads ? flat_bytes / buffers : 0;

  const size_t n_units = params.units().size();
  shard_offset_.resize(n_units);
  for (size_t u = 0; u < n_units; ++u) {
    shard_offset_[u] = shard_numel_;
    shard_numel_ += chunk(u);
  }
  unit_grads_.resize(n_units);
  gathered_.resize(n_units);
  gathering_.resize(n_units);
  gather_wire_.resize(n_units);

  if (stage_ == 3) {
    // Backward's order: the root (unit 0), then the blocks from the last, each block's unit
    // followed by its experts' (an expert unit follows its block's in the layout).
    std::vector<size_t> order = {0};
    for (size_t u = n_units; u-- > 1;) {
      if (is_experts(u) && u >= 2) {
        order.push_back(u - 1);
        order.push_back(u);
        --u;
      } else {
        order.push_back(u);
      }
    }
    backward_next_.resize(n_units);
    for (size_t k = 0; k < order.size(); ++k)
      backward_next_[order[k]] = k + 1 < order.size() ? order[k + 1] : order[k];
    before = in_use();
    shard_values_ = Tensor::empty({shard_numel_}, DType::kF32, device);
    memory_.params = in_use() - before;
    for (size_t u = 0; u < n_units; ++u) {
      Tensor piece = shard_of(shard_values_, u);
      params.initialize_slice(seed, chunk_begin(u), chunk(u), piece);
    }
  } else {
    params.initialize(seed);
  }
  if (stage_ >= 2) {
    before = in_use();
    shard_grads_ = Tensor::zeros({shard_numel_}, DType::kF32, device);
    memory_.grads = in_use() - before;
  }

  before = in_use();
  if (stage_ == 0)
    optimizer_ = std::make_unique<AdamW>(params, adamw);
  else
    optimizer_ = std::make_unique<AdamW>(adamw, shard_segments(), shard_numel_, device);
  memory_.optimizer = in_use() - before;
  if (all_reduces_) build_buckets(config.bucket_bytes);
  if (stage_ < 3) {
    before = in_use();
    rounded_weights_ = std::make_unique<RoundedWeights>(params, exec());
    memory_.params += in_use() - before;
  } else if (gather_dtype_ == DType::kBF16 &&
             ops::matmul_input_dtype(exec(), DType::kF32) == DType::kBF16) {
    // The gathered bf16 values are the copies (gather_values lends them).
    rounded_weights_ = std::make_unique<RoundedWeights>(params, exec(), /*own_copies=*/false);
  }
  if (rounded_weights_ && !rounded_weights_->active()) rounded_weights_.reset();
  tensor_parallel_ = config.tensor_parallel;
  if (tensor_parallel_ != nullptr) {
    const bool first = tensor_parallel_->rank() == 0;
    if (all_reduces_) {
      for (size_t u = 0; u < num_units(); ++u)
        for (const Parameter* p : params_.units()[u].params)
          if (!p->pieces.empty() || first)
            norm_ranges_.push_back({p->offset, p->numel(), is_experts(u)});
    } else {
      norm_ranges_ = chunk_norm_ranges(nullptr);
    }
  }
}

std::vector<ZeroDataParallel::NormRange> ZeroDataParallel::chunk_norm_ranges(
    const Parameter* skip) const {
  const bool first = tensor_parallel_ == nullptr || tensor_parallel_->rank() == 0;
  std::vector<NormRange> out;
  for (size_t u = 0; u < num_units(); ++u) {
    const int64_t lo_chunk = chunk_begin(u), hi_chunk = lo_chunk + chunk(u);
    for (const Parameter* p : params_.units()[u].params) {
      const int64_t lo = std::max(lo_chunk, p->offset);
      const int64_t hi = std::min(hi_chunk, p->offset + p->numel());
      if (lo < hi && p != skip && (!p->pieces.empty() || first))
        out.push_back(
            {stage_ == 1 ? lo : shard_offset_[u] + (lo - lo_chunk), hi - lo, is_experts(u)});
    }
  }
  return out;
}

void ZeroDataParallel::build_buckets(int64_t bucket_bytes) {
  const auto& units = params_.units();
  bucket_of_unit_.assign(units.size(), 0);
  for (size_t i = units.size(); i-- > 0;) {
    // A bucket is one collective over one group: expert and dense units never share one.
    if (buckets_.empty() || buckets_.back().numel * 4 >= bucket_bytes ||
        buckets_.back().experts != units[i].experts) {
      buckets_.emplace_back();
      buckets_.back().experts = units[i].experts;
    }
    Bucket& b = buckets_.back();
    b.begin = units[i].begin;  // units are visited downwards: the bucket grows to the left
    b.numel += units[i].numel;
    ++b.units;
    bucket_of_unit_[i] = buckets_.size() - 1;
  }
  bucket_seen_done_.assign(buckets_.size(), false);
}

std::vector<AdamWSegment> ZeroDataParallel::shard_segments() const {
  std::vector<AdamWSegment> segments;
  for (size_t u = 0; u < num_units(); ++u) {
    const int64_t lo_chunk = chunk_begin(u), hi_chunk = lo_chunk + chunk(u);
    for (const Parameter* p : params_.units()[u].params) {
      const int64_t lo = std::max(lo_chunk, p->offset);
      const int64_t hi = std::min(hi_chunk, p->offset + p->numel());
      if (lo >= hi) continue;
      const int64_t in_shard = shard_offset_[u] + (lo - lo_chunk);
      AdamWSegment s;
      s.value_offset = stage_ == 3 ? in_shard : lo;
      s.grad_offset = stage_ >= 2 ? in_shard : lo;
      s.state_offset = in_shard;
      s.numel = hi - lo;
      s.decay = p->weight_decay;
      segments.push_back(s);
    }
  }
  return segments;
}

void ZeroDataParallel::scale_expert_grads(Tensor& grads) const {
  const int ep = expert_parallel_->size();
  if (ep > 1)
    ops::scale_inplace<float>(exec(), grads.data<float>(), 1.0f / static_cast<float>(ep),
                              grads.numel());
}

void ZeroDataParallel::wait(const WorkHandle& work) {
  const double t0 = now_seconds();
  work->wait_on_device();
  step_stats_.wait_seconds += now_seconds() - t0;
}

void ZeroDataParallel::begin_step() {
  step_stats_ = DataParallelStepStats{};
  grad_scale_ = 1.0f;
  params_.zero_grads(pool_);
  if (shard_grads_.defined()) shard_grads_.zero_(pool_);
  for (Bucket& b : buckets_) b.units_left = b.units;
  bucket_seen_done_.assign(buckets_.size(), false);
}

void ZeroDataParallel::begin_micro_batch(int64_t index, int64_t count) {
  in_backward_ = false;
  LOOM_CHECK(index >= 0 && index < count);
  micro_index_ = index;
  micro_count_ = count;
}

void ZeroDataParallel::end_micro_batch() {
  in_backward_ = false;  // a forward after it (an evaluation) gathers and releases as forward
  if (!all_reduces_) {   // stage 1 reduce-scatters on the last micro-batch only
    if (stage_ >= 2 || last_micro_batch()) drain_reduce_scatters(true);
    return;
  }
  if (!last_micro_batch()) return;
  poll_buckets();
  for (Bucket& b : buckets_) {
    LOOM_CHECK_MSG(b.units_left == 0 && b.work, "a bucket's gradients were never finalised");
    wait(b.work);
    b.work.reset();
    if (b.wire.defined()) {  // the reduced bf16 gradients back into the fp32 ones
      ops::widen_bf16(exec(), params_.grads().narrow(b.begin, b.numel).data<float>(),
                      b.wire.data_u16(), b.numel);
      b.wire = Tensor();
    }
  }
}

void ZeroDataParallel::poll_buckets() {
  for (size_t i = 0; i < buckets_.size(); ++i) {
    if (buckets_[i].work && !bucket_seen_done_[i] && buckets_[i].work->test()) {
      bucket_seen_done_[i] = true;
      ++step_stats_.done_before_backward_end;
    }
  }
}

// ---- hooks ----------------------------------------------------------------------------------

void ZeroDataParallel::before_forward(size_t u) {
  if (stage_ != 3) return;
  gather_values(u);
  // A unit's forward inside the backward: a block recomputing its forward calls its experts'
  // hooks (under expert parallelism, a unit of their own), whose backward follows at once — kept
  // gathered for it, nothing prefetched.
  if (in_backward_) return;
  // Prefetch: forward visits the root, then blocks 1, 2, ... (each with its experts' unit after
  // it) in unit order.
  if (u + 1 < num_units()) issue_gather(u + 1);
}

void ZeroDataParallel::after_forward(size_t u) {
  if (stage_ == 3 && !in_backward_) release_values(u);
}

void ZeroDataParallel::before_backward(size_t u) {
  if (stage_ == 3) {
    in_backward_ = true;
    gather_values(u);
    // Backward visits the root (held throughout), then blocks from the last down to 1, each
    // before its experts' unit (backward_next_).
    const size_t next = backward_next_[u];
    if (next != u) issue_gather(next);
  }
  if (stage_ >= 2 && !unit_grads_[u].defined()) {
    unit_grads_[u] = Tensor::zeros({params_.units()[u].numel}, DType::kF32, device_);
    params_.bind_unit_grads(u, unit_grads_[u]);
  }
}

void ZeroDataParallel::reduce_scatter_full(size_t u) {
  Tensor full = params_.grads().narrow(params_.units()[u].begin, params_.units()[u].numel);
  if (is_experts(u)) scale_expert_grads(full);
  issue_reduce_scatter(u, full);
}

void ZeroDataParallel::defer_reduction(const Parameter* p) {
  LOOM_CHECK_MSG(stage_ == 1 && !all_reduces_, "only ZeRO-1's reduce-scatters are deferred");
  deferred_.resize(num_units(), false);
  for (size_t u = 0; u < num_units(); ++u)
    for (const Parameter* q : params_.units()[u].params)
      if (q == p) deferred_[u] = true;
}

void ZeroDataParallel::reduce_deferred() {
  for (size_t u = 0; u < deferred_.size(); ++u)
    if (deferred_[u]) reduce_scatter_full(u);
  drain_reduce_scatters(true);
}

void ZeroDataParallel::after_backward(size_t u) {
  if (stage_ == 1 && !all_reduces_) {
    // The step's gradient of the unit is complete in the full buffer: reduce-scatter it in place
    // there (drain_reduce_scatters writes the reduced chunk over the rank's own part).
    if (!last_micro_batch() || (u < deferred_.size() && deferred_[u])) return;
    reduce_scatter_full(u);
    drain_reduce_scatters(false);
    return;
  }
  if (all_reduces_) {
    if (!last_micro_batch()) return;
    Bucket& b = buckets_[bucket_of_unit_[u]];
    LOOM_CHECK(b.units_left > 0);
    if (--b.units_left == 0) {
      Tensor grads = params_.grads().narrow(b.begin, b.numel);
      if (b.experts) scale_expert_grads(grads);
      Communicator& comm = b.experts ? *experts_dp_ : all_dp_;
      if (reduce_dtype_ == DType::kBF16) {
        b.wire = Tensor::empty({b.numel}, DType::kBF16, device_);
        ops::round_to_bf16(exec(), b.wire.data_u16(), grads.data<float>(), b.numel);
        b.work = comm.all_reduce_async(b.wire, ReduceOp::kAvg);
      } else {
        b.work = comm.all_reduce_async(grads, ReduceOp::kAvg);
      }
      ++step_stats_.collectives;
    }
    poll_buckets();
    return;
  }
  // Stages 2/3: reduce-scatter the unit's full gradient into a chunk. The pending operation
  // keeps the full buffer alive until it completes; then it is freed.
  if (is_experts(u)) scale_expert_grads(unit_grads_[u]);
  issue_reduce_scatter(u, unit_grads_[u]);
  params_.bind_unit_grads(u, Tensor());
  unit_grads_[u] = Tensor();
  if (stage_ == 3) release_values(u);
  drain_reduce_scatters(false);
}

void ZeroDataParallel::issue_reduce_scatter(size_t u, const Tensor& full) {
  Tensor output = Tensor::empty({chunk(u)}, reduce_dtype_, device_);
  Tensor input = full;  // kept by the pending operation until it completes
  if (reduce_dtype_ == DType::kBF16) {
    input = Tensor::empty({full.numel()}, DType::kBF16, device_);
    ops::round_to_bf16(exec(), input.data_u16(), full.data<float>(), input.numel());
  }
  WorkHandle work = comm_of(u).reduce_scatter_async(input, output, ReduceOp::kAvg);
  ++step_stats_.collectives;
  reducing_.push_back({u, std::move(work), std::move(output), std::move(input), replicated(u)});
  // The unit before's chunk (its reduce-scatter had this unit's backward to finish) goes to the
  // replicas now, behind this unit's reduce-scatter.
  for (size_t i = 0; i + 1 < reducing_.size(); ++i)
    if (reducing_[i].awaits_replicas) issue_replica_reduce(reducing_[i]);
}

void ZeroDataParallel::issue_replica_reduce(PendingReduce& pending) {
  wait(pending.work);
  pending.work = replicate_->all_reduce_async(pending.output, ReduceOp::kAvg);
  pending.awaits_replicas = false;
  ++step_stats_.collectives;
}

void ZeroDataParallel::drain_reduce_scatters(bool all) {
  while (!reducing_.empty()) {
    PendingReduce& front = reducing_.front();
    if (front.awaits_replicas) {
      if (!all) return;  // issued at its fixed point (issue_replica_reduce's comment)
      issue_replica_reduce(front);
    }
    if (!all && !front.work->test()) return;
    if (!all) ++step_stats_.done_before_backward_end;
    wait(front.work);
    if (stage_ == 1) {
      // The step's one reduction: the chunk over the rank's own part of the full gradient (the
      // rest of the buffer keeps this rank's unreduced sums, which nothing reads).
      Tensor dst = params_.grads().narrow(chunk_begin(front.unit), chunk(front.unit));
      if (front.output.dtype() == DType::kBF16)
        ops::widen_bf16(exec(), dst.data<float>(), front.output.data_u16(), dst.numel());
      else  // in the compute stream's order, after the wait: on a GPU no host wait
        copy_bytes_queued(dst.raw(), front.output.raw(), device_, dst.nbytes());
    } else {
      Tensor dst = shard_of(shard_grads_, front.unit);
      if (front.output.dtype() == DType::kBF16)
        ops::add_widened_bf16(exec(), dst.data<float>(), front.output.data_u16(), dst.numel());
      else
        ops::add_inplace<float>(exec(), dst.data<float>(), front.output.data<float>(), dst.numel());
    }
    reducing_.pop_front();
  }
}

void ZeroDataParallel::issue_gather(size_t u) {
  if (gathered_[u].defined() || gathering_[u]) return;
  gathered_[u] = Tensor::empty({params_.units()[u].numel}, DType::kF32, device_);
  if (gather_dtype_ == DType::kBF16) {
    auto& [input, output] = gather_wire_[u];
    input = Tensor::empty({chunk(u)}, DType::kBF16, device_);
    output = Tensor::empty({params_.units()[u].numel}, DType::kBF16, device_);
    ops::round_to_bf16(exec(), input.data_u16(), shard_of(shard_values_, u).data<float>(),
                       chunk(u));
    gathering_[u] = comm_of(u).all_gather_async(input, output);
  } else {
    gathering_[u] = comm_of(u).all_gather_async(shard_of(shard_values_, u), gathered_[u]);
  }
  ++step_stats_.collectives;
}

void ZeroDataParallel::gather_values(size_t u) {
  issue_gather(u);
  if (gathering_[u]) {
    wait(gathering_[u]);
    gathering_[u].reset();
    if (auto& [input, output] = gather_wire_[u]; output.defined()) {
      ops::widen_bf16(exec(), gathered_[u].data<float>(), output.data_u16(), output.numel());
      input = Tensor();
      if (rounded_weights_) {
        // Kept while the unit is gathered: its GEMM weights' bf16 copies, in the unit's layout.
        const ParamUnit& unit = params_.units()[u];
        for (const Parameter* p : unit.params)
          if (p->gemm_operand)
            rounded_weights_->lend(*p, output.data_u16() + (p->offset - unit.begin));
      } else {
        output = Tensor();
      }
    }
    params_.bind_unit_values(u, gathered_[u]);
  }
}

void ZeroDataParallel::release_values(size_t u) {
  LOOM_CHECK(!gathering_[u]);
  params_.bind_unit_values(u, Tensor());
  gathered_[u] = Tensor();
  if (Tensor& wire = gather_wire_[u].second; wire.defined()) {
    if (rounded_weights_)
      for (const Parameter* p : params_.units()[u].params) rounded_weights_->take_back(*p);
    wire = Tensor();
  }
}

// ---- step -------------------------------------------------------------------------------------

double ZeroDataParallel::clip_grad_norm(double max_norm, double loss_scale) {
  // Scaling by a power of two is exact (also in the double sum of squares and its root), so
  // norm / loss_scale is the unscaled run's norm and clip / loss_scale an exact factor.
  const auto unscaled = [&](double scaled_norm) {
    const double norm = scaled_norm / loss_scale;
    grad_scale_ = static_cast<float>(clip_coefficient(norm, max_norm) / loss_scale);
    return norm;
  };
  Communicator* tp = tensor_parallel_;
  if (all_reduces_ && has_experts_) {
    // Dense units' gradients are every rank's, expert units' this rank's experts' (the same on
    // the ranks holding them): the experts' squares summed over the expert-parallel group. The
    // units' sums come back together (one wait on a GPU) and are added in order. Under tensor
    // parallelism the ranges of norm_ranges_ instead (each replicated parameter on tp rank 0
    // only), the total summed over tp.
    std::vector<const float*> starts;
    std::vector<int64_t> sizes;
    std::vector<bool> of_experts;
    const float* grads = params_.grads().data<float>();
    if (tp == nullptr) {
      for (size_t u = 0; u < num_units(); ++u) {
        starts.push_back(grads + params_.units()[u].begin);
        sizes.push_back(params_.units()[u].numel);
        of_experts.push_back(is_experts(u));
      }
    } else {
      for (const NormRange& r : norm_ranges_) {
        starts.push_back(grads + r.offset);
        sizes.push_back(r.numel);
        of_experts.push_back(r.experts);
      }
    }
    const std::vector<double> sums = ops::sum_squares_each(Exec{&pool_, device_}, starts, sizes);
    double dense = 0, experts = 0;
    for (size_t i = 0; i < sums.size(); ++i) (of_experts[i] ? experts : dense) += sums[i];
    const double t0 = now_seconds();
    experts = all_reduce_value(*expert_parallel_, experts, ReduceOp::kSum);
    double sum = dense + experts;
    if (tp != nullptr) sum = all_reduce_value(*tp, sum, ReduceOp::kSum);
    step_stats_.wait_seconds += now_seconds() - t0;
    return unscaled(std::sqrt(sum));
  }
  if (all_reduces_ && tp == nullptr) return unscaled(grad_norm(pool_, params_));
  if (all_reduces_) {  // under tp, without experts: norm_ranges_ (replicated ones on tp rank 0)
    std::vector<const float*> starts;
    std::vector<int64_t> sizes;
    for (const NormRange& r : norm_ranges_) {
      starts.push_back(params_.grads().data<float>() + r.offset);
      sizes.push_back(r.numel);
    }
    double sum = 0;
    for (double s : ops::sum_squares_each(Exec{&pool_, device_}, starts, sizes)) sum += s;
    const double t0 = now_seconds();
    sum = all_reduce_value(*tp, sum, ReduceOp::kSum);
    step_stats_.wait_seconds += now_seconds() - t0;
    return unscaled(std::sqrt(sum));
  }
  double sum = grad_sum_squares(nullptr);
  if (tp != nullptr) {
    const double t0 = now_seconds();
    sum = all_reduce_value(*tp, sum, ReduceOp::kSum);
    step_stats_.wait_seconds += now_seconds() - t0;
  }
  return unscaled(std::sqrt(sum));
}

double ZeroDataParallel::grad_sum_squares(const Parameter* skip) {
  LOOM_CHECK_MSG(!all_reduces_, "grad_sum_squares reads the reduced chunks of stages 1-3");
  Communicator* tp = tensor_parallel_;
  // The reduced chunks (stage 1: at their places in the full gradient).
  Tensor& grads = stage_ < 2 ? params_.grads() : shard_grads_;
  // Hybrid sharding with experts: the dense chunks partition the gradient within a shard group,
  // the expert chunks only over the whole dp group — their squares summed apart.
  const bool experts_apart = !all_reduces_ && replicate_ != nullptr && has_experts_;
  double local = 0, local_experts = 0;
  if (tp == nullptr && !experts_apart && stage_ >= 2 && skip == nullptr) {
    // The shards partition the full gradient (padding is zero).
    local = ops::sum_squares<float>(Exec{&pool_, device_}, grads.data<float>(), grads.numel());
  } else {
    // Under tensor parallelism a replicated parameter's gradient is the same on every tp rank:
    // count it on tp rank 0 only. The ranges' sums come back together (one wait on a GPU) and
    // are added in order.
    // Without tp or `skip`, each unit's chunk whole; else each parameter's piece of them.
    std::vector<NormRange> ranges;
    if (skip != nullptr) {
      ranges = chunk_norm_ranges(skip);
    } else if (tp == nullptr) {
      for (size_t u = 0; u < num_units(); ++u)
        ranges.push_back(
            {stage_ == 1 ? chunk_begin(u) : shard_offset_[u], chunk(u), is_experts(u)});
    }
    const std::vector<NormRange>& counted =
        skip == nullptr && tp != nullptr ? norm_ranges_ : ranges;
    std::vector<const float*> starts;
    std::vector<int64_t> sizes;
    for (const NormRange& r : counted) {
      starts.push_back(grads.data<float>() + r.offset);
      sizes.push_back(r.numel);
    }
    const std::vector<double> sums = ops::sum_squares_each(Exec{&pool_, device_}, starts, sizes);
    for (size_t i = 0; i < sums.size(); ++i)
      (experts_apart && counted[i].experts ? local_experts : local) += sums[i];
  }
  double sum = local;
  const double t0 = now_seconds();  // waiting for the other ranks counts as communication
  sum = all_reduce_value(dp_, sum, ReduceOp::kSum);
  if (experts_apart) sum += all_reduce_value(all_dp_, local_experts, ReduceOp::kSum);
  step_stats_.wait_seconds += now_seconds() - t0;
  return sum;
}

void ZeroDataParallel::optimizer_step(float lr) {
  if (rounded_weights_) rounded_weights_->invalidate();  // copied again at their next use
  const float gs = grad_scale_;
  grad_scale_ = 1.0f;
  switch (stage_) {
    case 0: optimizer_->step(pool_, lr, gs); return;
    case 1: optimizer_->step(pool_, lr, params_.values().data<float>(), params_.grads().data<float>(), gs); break;
    case 2: optimizer_->step(pool_, lr, params_.values().data<float>(), shard_grads_.data<float>(), gs); break;
    case 3: optimizer_->step(pool_, lr, shard_values_.data<float>(), shard_grads_.data<float>(), gs); return;
  }
  // Stages 1/2: every rank updated its chunks of the full values; gather the others'. The chunks
  // are copied in the compute stream's order, which the gathers wait for: on a GPU no wait per
  // unit.
  Tensor own = Tensor::empty({shard_numel_}, DType::kF32, device_);
  for (size_t u = 0; u < num_units(); ++u) {
    const Tensor mine = params_.values().narrow(chunk_begin(u), chunk(u));
    copy_bytes_queued(shard_of(own, u).raw(), mine.raw(), device_, mine.nbytes());
  }
  all_gather_units(own, params_.values());
}

void ZeroDataParallel::all_gather_units(const Tensor& shard, Tensor& full) {
  std::vector<WorkHandle> works;
  for (size_t u = 0; u < num_units(); ++u) {
    Tensor out = full.narrow(params_.units()[u].begin, params_.units()[u].numel);
    works.push_back(comm_of(u).all_gather_async(shard_of(shard, u), out));
    ++step_stats_.collectives;
  }
  for (const WorkHandle& w : works) wait(w);
}

FlatModelState ZeroDataParallel::gather_state() {
  if (stage_ == 0) return {params_.values(), optimizer_->m(), optimizer_->v()};
  FlatModelState state;
  const int64_t n = params_.numel();
  if (stage_ < 3) {
    state.values = params_.values();
  } else {
    state.values = Tensor::empty({n}, DType::kF32, device_);
    all_gather_units(shard_values_, state.values);
  }
  state.exp_avg = Tensor::empty({n}, DType::kF32, device_);
  state.exp_avg_sq = Tensor::empty({n}, DType::kF32, device_);
  all_gather_units(optimizer_->m(), state.exp_avg);
  all_gather_units(optimizer_->v(), state.exp_avg_sq);
  return state;
}

FlatModelState ZeroDataParallel::owned_state(std::vector<std::pair<int64_t, int64_t>>& ranges) {
  ranges.clear();
  int64_t total = 0;
  // Under hybrid sharding the replicas holding a chunk split it between them: where each piece
  // starts in the shard buffers.
  std::vector<int64_t> in_shard;
  for (size_t u = 0; u < num_units(); ++u) {
    const ParamUnit& unit = params_.units()[u];
    const int64_t rank = rank_of(u), size = size_of(u);
    int64_t begin = stage_ == 0 ? unit.begin + unit.numel * rank / size : chunk_begin(u);
    int64_t end = stage_ == 0 ? unit.begin + unit.numel * (rank + 1) / size : begin + chunk(u);
    int64_t offset = stage_ == 0 ? 0 : shard_offset_[u];
    if (stage_ > 0 && replicated(u)) {
      const int64_t replica = replicate_->rank(), replicas = replicate_->size();
      const int64_t lo = chunk(u) * replica / replicas, hi = chunk(u) * (replica + 1) / replicas;
      end = begin + hi;
      begin += lo;
      offset += lo;
    }
    ranges.emplace_back(begin, end);
    in_shard.push_back(offset);
    total += end - begin;
  }
  // The ranges of a full flat buffer, concatenated.
  auto gather_ranges = [&](const Tensor& full) {
    Tensor out = Tensor::empty({total}, DType::kF32, device_);
    int64_t at = 0;
    for (const auto& [begin, end] : ranges) {
      out.narrow(at, end - begin).copy_from(full.narrow(begin, end - begin));
      at += end - begin;
    }
    return out;
  };
  if (stage_ == 0)
    return {gather_ranges(params_.values()), gather_ranges(optimizer_->m()),
            gather_ranges(optimizer_->v())};
  // Stages 1-3: the shard buffers hold exactly these chunks, in this order (under hybrid
  // sharding, the rank's pieces of them).
  if (replicate_ == nullptr)
    return {stage_ == 3 ? shard_values_ : gather_ranges(params_.values()), optimizer_->m(),
            optimizer_->v()};
  auto gather_pieces = [&](const Tensor& shard) {
    Tensor out = Tensor::empty({total}, DType::kF32, device_);
    int64_t at = 0;
    for (size_t u = 0; u < ranges.size(); ++u) {
      const int64_t n = ranges[u].second - ranges[u].first;
      out.narrow(at, n).copy_from(shard.narrow(in_shard[u], n));
      at += n;
    }
    return out;
  };
  return {stage_ == 3 ? gather_pieces(shard_values_) : gather_ranges(params_.values()),
          gather_pieces(optimizer_->m()), gather_pieces(optimizer_->v())};
}

void ZeroDataParallel::load_state(const FlatModelState& state, int64_t optimizer_steps) {
  LOOM_CHECK(state.values.numel() == params_.numel() && state.exp_avg.defined());
  if (rounded_weights_) rounded_weights_->invalidate();
  optimizer_->set_steps_taken(optimizer_steps);
  if (stage_ == 0) {
    params_.values().copy_from(state.values);
    optimizer_->m().copy_from(state.exp_avg);
    optimizer_->v().copy_from(state.exp_avg_sq);
    return;
  }
  if (stage_ < 3) params_.values().copy_from(state.values);
  for (size_t u = 0; u < num_units(); ++u) {
    const int64_t begin = chunk_begin(u), n = chunk(u);
    if (stage_ == 3) shard_of(shard_values_, u).copy_from(state.values.narrow(begin, n));
    shard_of(optimizer_->m(), u).copy_from(state.exp_avg.narrow(begin, n));
    shard_of(optimizer_->v(), u).copy_from(state.exp_avg_sq.narrow(begin, n));
  }
}

}  // namespace

std::unique_ptr<DataParallel> DataParallel::create(ParameterStore& params, Communicator& dp,
                                                   ThreadPool& pool, Device device,
                                                   const DataParallelConfig& config,
                                                   const AdamWConfig& adamw, uint64_t seed) {
  return std::make_unique<ZeroDataParallel>(params, dp, pool, device, config, adamw, seed);
}

ShardGroups split_shard_groups(Communicator& gradients, int shard_degree, int cp) {
  LOOM_CHECK(cp >= 1 && gradients.size() % cp == 0);
  const int dp = gradients.size() / cp;
  if (shard_degree < 1 || dp % shard_degree != 0)
    fail("parallel.dp_shard = ", shard_degree, " must divide parallel.dp = ", dp,
         ": ZeRO's state is sharded over groups of dp_shard data-parallel ranks");
  const int d = gradients.rank() / cp, c = gradients.rank() % cp;
  ShardGroups groups;
  groups.shard = gradients.split(d / shard_degree, gradients.rank());
  groups.replicate = gradients.split((d % shard_degree) * cp + c, gradients.rank());
  return groups;
}

}  // namespace loom
