#include "train/tensor_parallel_io.h"

#include "base/error.h"
#include "train/trainer.h"

namespace loom {
namespace {

// The whole model's flat layout (names, offsets), no buffers.
std::unique_ptr<Gpt2> whole_layout(const Config& config) {
  auto layout = std::make_unique<Gpt2>(model_config_of(config));
  layout->params().allocate(DType::kF32, Device::cpu(), AllocateOptions{16, false, false});
  return layout;
}

// Copies between a local parameter (in `local_flat`, the shard's layout) and its blocks of the
// whole parameter (in `whole_flat`, the whole model's layout). to_whole: local → whole.
void copy_pieces(const Parameter& p, const Parameter& whole, Tensor& local_flat, Tensor& whole_flat,
                 bool to_whole) {
  float* local = local_flat.data<float>() + p.offset;
  float* full = whole_flat.data<float>() + whole.offset;
  if (p.pieces.empty()) {
    if (to_whole) std::copy(local, local + p.numel(), full);
    else std::copy(full, full + p.numel(), local);
    return;
  }
  const int64_t local_cols = p.shape.size() > 1 ? p.shape[1] : 1;
  const int64_t full_cols = p.full_shape.size() > 1 ? p.full_shape[1] : 1;
  for (const ShardPiece& piece : p.pieces) {
    const int64_t row0 = piece.region.offset[0];
    const int64_t col0 = piece.region.offset.size() > 1 ? piece.region.offset[1] : 0;
    for (int64_t i = 0; i < piece.rows; ++i) {
      float* l = local + (piece.local_row + i) * local_cols;
      float* f = full + (row0 + i) * full_cols + col0;
      if (to_whole) std::copy(l, l + local_cols, f);
      else std::copy(f, f + local_cols, l);
    }
  }
}

}  // namespace

std::string save_tensor_parallel_checkpoint(const std::string& dir, TpGpt2& model,
                                            DataParallel& engine, DeviceMesh& mesh,
                                            const Config& config, const TrainingState& st) {
  FlatModelState mine = engine.gather_state();  // collective over dp
  if (mesh.coord("dp") != 0) return "";
  Communicator& tp = mesh.axis("tp");
  auto layout = whole_layout(config);
  const int64_t n = layout->params().numel();
  FlatModelState whole{Tensor::zeros({n}, DType::kF32), Tensor::zeros({n}, DType::kF32),
                       Tensor::zeros({n}, DType::kF32)};
  for (const auto& p : model.params().parameters()) {
    if (p->pieces.empty() && tp.rank() != 0) continue;  // replicated: rank 0's copy
    const Parameter& w = layout->params().get(p->name);
    copy_pieces(*p, w, mine.values, whole.values, true);
    copy_pieces(*p, w, mine.exp_avg, whole.exp_avg, true);
    copy_pieces(*p, w, mine.exp_avg_sq, whole.exp_avg_sq, true);
  }
  // The pieces are disjoint and everything else is zero: a sum assembles the whole model.
  for (Tensor* t : {&whole.values, &whole.exp_avg, &whole.exp_avg_sq}) tp.reduce(*t, 0, ReduceOp::kSum);
  if (tp.rank() != 0) return "";
  return save_checkpoint(dir, layout->params(), layout->config(), whole, st);
}

TrainingState load_tensor_parallel_checkpoint(const std::string& checkpoint_dir, TpGpt2& model,
                                              DataParallel& engine, const Config& config) {
  auto layout = whole_layout(config);
  const int64_t n = layout->params().numel();
  FlatModelState whole{Tensor::zeros({n}, DType::kF32), Tensor::zeros({n}, DType::kF32),
                       Tensor::zeros({n}, DType::kF32)};
  const TrainingState st = load_checkpoint(checkpoint_dir, layout->params(), whole);
  const int64_t local_n = model.params().numel();
  FlatModelState mine{Tensor::zeros({local_n}, DType::kF32), Tensor::zeros({local_n}, DType::kF32),
                      Tensor::zeros({local_n}, DType::kF32)};
  for (const auto& p : model.params().parameters()) {
    const Parameter& w = layout->params().get(p->name);
    copy_pieces(*p, w, mine.values, whole.values, false);
    copy_pieces(*p, w, mine.exp_avg, whole.exp_avg, false);
    copy_pieces(*p, w, mine.exp_avg_sq, whole.exp_avg_sq, false);
  }
  engine.load_state(mine, st.optimizer_steps);
  return st;
}

}  // namespace loom
