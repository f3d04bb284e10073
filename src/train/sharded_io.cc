#include "train/sharded_io.h"

#include <map>
#include <memory>
#include <set>

#include "base/error.h"
#include "checkpoint/checkpoint_reader.h"
#include "checkpoint/export.h"
#include "checkpoint/sharded_checkpoint.h"
#include "models/gpt2.h"
#include "train/trainer.h"

namespace loom {
namespace {

// The whole model's flat layout (names, offsets), no buffers.
std::unique_ptr<Gpt2> whole_layout(const Config& config) {
  auto layout = std::make_unique<Gpt2>(model_config_of(config));
  layout->params().allocate(DType::kF32, Device::cpu(), AllocateOptions{16, false, false});
  return layout;
}

FlatModelState zero_state(int64_t n) {
  return {Tensor::zeros({n}, DType::kF32), Tensor::zeros({n}, DType::kF32),
          Tensor::zeros({n}, DType::kF32)};
}

// The runs a local parameter shares with the whole one: run(local offset, whole offset, count),
// offsets in elements from each one's first.
template <typename Run>
void for_each_run(const Parameter& p, Run run) {
  if (p.pieces.empty()) {
    run(int64_t{0}, int64_t{0}, p.numel());
    return;
  }
  const int64_t local_cols = p.shape.size() > 1 ? p.shape[1] : 1;
  const int64_t full_cols = p.full_shape.size() > 1 ? p.full_shape[1] : 1;
  for (const ShardPiece& piece : p.pieces) {
    const int64_t row0 = piece.region.offset[0];
    const int64_t col0 = piece.region.offset.size() > 1 ? piece.region.offset[1] : 0;
    for (int64_t i = 0; i < piece.rows; ++i)
      run((piece.local_row + i) * local_cols, (row0 + i) * full_cols + col0, local_cols);
  }
}

// Copies between a local parameter (in `local_flat`, the part's layout) and its blocks of the
// whole parameter (in `whole_flat`, the whole model's layout). to_whole: local → whole.
void copy_pieces(const Parameter& p, const Parameter& whole, Tensor& local_flat, Tensor& whole_flat,
                 bool to_whole) {
  float* local = local_flat.data<float>() + p.offset;
  float* full = whole_flat.data<float>() + whole.offset;
  for_each_run(p, [&](int64_t l, int64_t f, int64_t n) {
    if (to_whole)
      std::copy(local + l, local + l + n, full + f);
    else
      std::copy(full + f, full + f + n, local + l);
  });
}

void copy_state(const Parameter& p, const Parameter& whole, FlatModelState& local,
                FlatModelState& full, bool to_whole) {
  copy_pieces(p, whole, local.values, full.values, to_whole);
  copy_pieces(p, whole, local.exp_avg, full.exp_avg, to_whole);
  copy_pieces(p, whole, local.exp_avg_sq, full.exp_avg_sq, to_whole);
}

// A reduction to rank 0 of a host tensor, staged through the communicator's device (a GPU under
// nccl).
void reduce_to_first(Communicator& comm, Tensor& host) {
  if (comm.tensor_device().is_cpu()) {
    comm.reduce(host, 0, ReduceOp::kSum);
    return;
  }
  Tensor staged = host.to(comm.tensor_device());
  comm.reduce(staged, 0, ReduceOp::kSum);
  host.copy_from(staged);
}

// The parameters of a part this rank leaves to another: the tied wte in a part that is not the
// first stage, and, on tp ranks but the first, the parameters every tp rank holds whole.
std::set<std::string> left_to_others(Gpt2Stage& part, int tp_rank) {
  std::set<std::string> skip;
  const Parameter* duplicate = part.tied_head_copy();
  for (const auto& p : part.params().parameters())
    if (p.get() == duplicate || (tp_rank != 0 && p->pieces.empty() && p->shape == p->full_shape))
      skip.insert(p->name);
  return skip;
}

StagedCheckpoint stage_per_rank(const std::string& dir, const std::vector<Gpt2Stage*>& parts,
                                const std::vector<DataParallel*>& engines, DeviceMesh& mesh,
                                const Config& config, const TrainingState& st,
                                bool private_copies) {
  Communicator& world = mesh.world();
  auto slices = std::make_shared<std::vector<ShardSlice>>();
  std::vector<FlatModelState> owned;
  int64_t total = 0;
  for (size_t k = 0; k < parts.size(); ++k) {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    const FlatModelState state = engines[k]->owned_state(ranges);
    owned.push_back(private_copies ? private_host_copy(state) : on_host(state));
    for (ShardSlice s :
         slices_of(parts[k]->params(), ranges, left_to_others(*parts[k], mesh.coord("tp")))) {
      s.at += total;  // the parts' arrays follow one another in the file
      slices->push_back(std::move(s));
    }
    total += owned.back().values.numel();
  }
  // One part (no interleaved stages): its arrays as they are; several: one after another.
  auto arrays = std::make_shared<FlatModelState>(owned[0]);
  if (owned.size() > 1) {
    *arrays = zero_state(total);
    int64_t at = 0;
    for (const FlatModelState& o : owned) {
      const int64_t n = o.values.numel();
      arrays->values.narrow(at, n).copy_from(o.values);
      arrays->exp_avg.narrow(at, n).copy_from(o.exp_avg);
      arrays->exp_avg_sq.narrow(at, n).copy_from(o.exp_avg_sq);
      at += n;
    }
  }
  const bool leader = world.rank() == 0;
  if (leader) begin_sharded_checkpoint(dir, st.step);
  world.barrier();  // step_N.tmp exists, empty
  const std::string tmp = checkpoint_tmp_dir(dir, st.step);
  const int rank = world.rank(), ranks = world.size();
  StagedCheckpoint staged;
  staged.write = [tmp, rank, slices, arrays] { write_shard(tmp, rank, *slices, *arrays); };
  staged.commit = [&world, tmp, ranks, leader, config, st]() -> std::string {
    world.barrier();  // every shard is on the disk
    if (!leader) return "";
    auto layout = whole_layout(config);
    return finish_sharded_checkpoint(tmp, ranks, layout->params(), layout->config(), st, true);
  };
  return staged;
}

// The parameters of a part's expert units (expert parallelism): each rank of an expert-parallel
// group holds its own block of them.
std::set<const Parameter*> expert_params(Gpt2Stage& part) {
  std::set<const Parameter*> out;
  for (const ParamUnit& unit : part.params().units())
    if (unit.experts) out.insert(unit.params.begin(), unit.params.end());
  return out;
}

StagedCheckpoint stage_whole(const std::string& dir, const std::vector<Gpt2Stage*>& parts,
                             const std::vector<DataParallel*>& engines, DeviceMesh& mesh,
                             const Config& config, const TrainingState& st,
                             Communicator* expert_parallel) {
  LOOM_CHECK(parts.size() == engines.size());
  Communicator& world = mesh.world();
  StagedCheckpoint staged;
  staged.write = [] {};
  staged.commit = [&world]() -> std::string {
    world.barrier();  // the writer (the rank at (0, 0, 0)) has published it
    return "";
  };
  std::vector<FlatModelState> mine;
  for (DataParallel* e : engines) mine.push_back(on_host(e->gather_state()));  // collective over dp
  // One replica writes: dp's first, and of its context-parallel ranks (the same parameters) cp's;
  // under expert parallelism the first expert-parallel group, whose ranks hold every expert.
  const int ep = expert_parallel != nullptr ? expert_parallel->size() : 1;
  if (mesh.coord("dp") >= ep || (mesh.shape().has_axis("cp") && mesh.coord("cp") != 0))
    return staged;
  const bool ep_first = mesh.coord("dp") == 0;
  Communicator& pp = mesh.axis("pp");
  Communicator& tp = mesh.axis("tp");
  std::shared_ptr<Gpt2> layout = whole_layout(config);
  auto whole = std::make_shared<FlatModelState>(zero_state(layout->params().numel()));
  for (size_t k = 0; k < parts.size(); ++k) {
    const Parameter* duplicate = parts[k]->tied_head_copy();
    const std::set<const Parameter*> experts = expert_params(*parts[k]);
    for (const auto& p : parts[k]->params().parameters()) {
      if (p.get() == duplicate) continue;                  // the first stage's copy is written
      if (p->pieces.empty() && tp.rank() != 0) continue;  // replicated: tp rank 0's copy
      if (!ep_first && !experts.contains(p.get())) continue;  // the rest: ep rank 0's copy
      copy_state(*p, layout->params().get(p->name), mine[k], *whole, true);
    }
  }
  // The pieces are disjoint and everything else is zero: sums assemble the whole model.
  if (ep > 1) {
    for (Tensor* t : {&whole->values, &whole->exp_avg, &whole->exp_avg_sq})
      reduce_to_first(*expert_parallel, *t);
    if (!ep_first) return staged;
  }
  for (Tensor* t : {&whole->values, &whole->exp_avg, &whole->exp_avg_sq}) reduce_to_first(pp, *t);
  if (pp.rank() != 0) return staged;
  for (Tensor* t : {&whole->values, &whole->exp_avg, &whole->exp_avg_sq}) reduce_to_first(tp, *t);
  if (tp.rank() != 0) return staged;
  // `whole` is this function's own buffer: the write reads nothing training changes.
  auto path = std::make_shared<std::string>();
  staged.write = [dir, layout, whole, st, path] {
    *path = save_checkpoint(dir, layout->params(), layout->config(), *whole, st);
  };
  staged.commit = [&world, path]() -> std::string {
    world.barrier();
    return *path;
  };
  return staged;
}

// The whole format when every rank holds the whole model (no pipeline, no tensor parallelism):
// the engine gathers its state over its group (collective) and world rank 0 writes it.
StagedCheckpoint stage_replica(const std::string& dir, Gpt2Stage& model, DataParallel& engine,
                               DeviceMesh& mesh, const TrainingState& st, bool private_copies) {
  const FlatModelState gathered = engine.gather_state();
  auto full = std::make_shared<FlatModelState>(private_copies ? private_host_copy(gathered)
                                                              : on_host(gathered));
  auto path = std::make_shared<std::string>();
  // The store's names and offsets, which the write reads, do not change while training runs.
  const ParameterStore* store = &model.params();
  StagedCheckpoint staged;
  staged.write = [] {};
  if (mesh.world().rank() == 0)
    staged.write = [dir, store, config = model.config(), full, st, path] {
      *path = save_checkpoint(dir, *store, config, *full, st);
    };
  staged.commit = [path] { return *path; };
  return staged;
}

}  // namespace

FlatModelState private_host_copy(const FlatModelState& state) {
  const auto copy = [](const Tensor& t) {
    if (!t.defined()) return t;
    return t.device().is_cpu() ? t.clone() : t.to(Device::cpu());
  };
  return {copy(state.values), copy(state.exp_avg), copy(state.exp_avg_sq)};
}

StagedCheckpoint stage_layout_checkpoint(const std::string& dir,
                                         const std::vector<Gpt2Stage*>& parts,
                                         const std::vector<DataParallel*>& engines,
                                         DeviceMesh& mesh, const Config& config,
                                         const TrainingState& st, bool private_copies,
                                         Communicator* expert_parallel) {
  LOOM_CHECK(parts.size() == engines.size());
  if (config.train.checkpoint_format == "sharded")
    return stage_per_rank(dir, parts, engines, mesh, config, st, private_copies);
  if (config.parallel.pp == 1 && config.parallel.tp == 1 && expert_parallel == nullptr)
    return stage_replica(dir, *parts[0], *engines[0], mesh, st, private_copies);
  return stage_whole(dir, parts, engines, mesh, config, st, expert_parallel);
}

TrainingState load_layout_checkpoint(const std::string& checkpoint_dir,
                                     const std::vector<Gpt2Stage*>& parts,
                                     const std::vector<DataParallel*>& engines,
                                     const Config& config) {
  LOOM_CHECK(parts.size() == engines.size());
  if (is_sharded_checkpoint(checkpoint_dir)) {
    std::vector<FlatModelState> local;
    for (Gpt2Stage* part : parts) local.push_back(zero_state(part->params().numel()));
    std::vector<ShardTarget> targets;
    for (size_t k = 0; k < parts.size(); ++k) targets.push_back({&parts[k]->params(), &local[k]});
    const TrainingState st = load_sharded_checkpoint_into(checkpoint_dir, targets);
    for (size_t k = 0; k < parts.size(); ++k) engines[k]->load_state(local[k], st.optimizer_steps);
    return st;
  }
  auto layout = whole_layout(config);
  FlatModelState whole = zero_state(layout->params().numel());
  const TrainingState st = load_checkpoint(checkpoint_dir, layout->params(), whole);
  for (size_t k = 0; k < parts.size(); ++k) {
    FlatModelState local = zero_state(parts[k]->params().numel());
    for (const auto& p : parts[k]->params().parameters())
      copy_state(*p, layout->params().get(p->name), local, whole, false);
    engines[k]->load_state(local, st.optimizer_steps);
  }
  return st;
}

// One parameter at a time (for_each_hf_parameter): each part keeps its blocks of it, and nothing
// the size of the whole model is ever in memory — the directory's tensors are read as they are
// needed, and no whole-model state is made (a 27 B model's would be 324 GB).
namespace {

// Fine-tuning's start from whole parameters handed over one at a time: `each(take)` calls
// take(whole parameter, its values) for every parameter of the whole model; each part keeps its
// blocks, its moments zero and its step count 0.
template <typename EachParameter>
void init_layout_from(const std::vector<Gpt2Stage*>& parts,
                      const std::vector<DataParallel*>& engines, const EachParameter& each) {
  LOOM_CHECK(parts.size() == engines.size());
  std::vector<FlatModelState> local;
  std::vector<std::map<std::string, const Parameter*>> by_name(parts.size());
  for (size_t k = 0; k < parts.size(); ++k) {
    local.push_back(zero_state(parts[k]->params().numel()));
    for (const auto& p : parts[k]->params().parameters()) by_name[k][p->name] = p.get();
  }
  each([&](const Parameter& whole, const float* values) {
    for (size_t k = 0; k < parts.size(); ++k) {
      const auto it = by_name[k].find(whole.name);
      if (it == by_name[k].end()) continue;
      const Parameter& p = *it->second;
      float* dst = local[k].values.data<float>() + p.offset;
      for_each_run(p, [&](int64_t l, int64_t f, int64_t n) {
        std::copy(values + f, values + f + n, dst + l);
      });
    }
  });
  for (size_t k = 0; k < parts.size(); ++k) engines[k]->load_state(local[k], 0);
}

}  // namespace

void init_layout_from_hf(const std::string& hf_dir, const std::vector<Gpt2Stage*>& parts,
                         const std::vector<DataParallel*>& engines, const Config& config) {
  auto layout = whole_layout(config);  // offsets only: no values allocated
  init_layout_from(parts, engines, [&](const HfParameterSink& take) {
    for_each_hf_parameter(hf_dir, layout->params(), model_config_of(config), take);
  });
}

std::vector<float> init_layout_from_checkpoint(const std::string& checkpoint_dir,
                                               const std::vector<Gpt2Stage*>& parts,
                                               const std::vector<DataParallel*>& engines,
                                               const Config& config) {
  auto layout = whole_layout(config);             // offsets only: no values allocated
  const CheckpointReader reader(checkpoint_dir);  // the files' digests checked here
  for (const auto& p : layout->params().parameters()) {
    if (!reader.has(p->name))
      fail("train.init_from: checkpoint ", checkpoint_dir, " has no parameter '", p->name,
           "' (a checkpoint of another model?)");
    if (reader.shape(p->name) != p->full_shape)
      fail("train.init_from: checkpoint ", checkpoint_dir, ": '", p->name, "' has shape ",
           shape_str(reader.shape(p->name)), " but the model expects ", shape_str(p->full_shape));
  }
  init_layout_from(parts, engines, [&](const HfParameterSink& take) {
    for (const auto& p : layout->params().parameters())
      take(*p, reader.read(p->name).data<float>());
  });
  return reader.state().expert_bias;
}

}  // namespace loom
