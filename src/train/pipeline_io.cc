#include "train/pipeline_io.h"

#include "data/loader.h"
#include "train/trainer.h"

namespace loom {

double evaluate_pipeline(PipelineParallel& pipe, const std::vector<std::string>& shards,
                         int64_t batch, int64_t seq_len, int64_t batches, Device device) {
  DataLoader loader(shards, batch, seq_len);
  Tensor inputs = Tensor::empty({batch, seq_len}, DType::kI32, device);
  Tensor targets = Tensor::empty({batch, seq_len}, DType::kI32, device);
  double total = 0;
  for (int64_t i = 0; i < batches; ++i) {
    loader.next_batch(inputs.data<int32_t>(), targets.data<int32_t>());
    total += pipe.evaluate(inputs, targets);
  }
  return total / static_cast<double>(batches);
}

std::string save_pipeline_checkpoint(const std::string& dir, PipelineParallel& pipe,
                                     DeviceMesh& mesh, const Config& config,
                                     const TrainingState& st) {
  std::vector<FlatModelState> mine;
  for (int c = 0; c < pipe.chunks(); ++c) mine.push_back(pipe.chunk_engine(c).gather_state());
  if (mesh.coord("dp") != 0) return "";
  Communicator& pp = mesh.axis("pp");
  if (pp.rank() != 0) {
    for (const FlatModelState& s : mine)
      for (const Tensor* t : {&s.values, &s.exp_avg, &s.exp_avg_sq}) pp.send(*t, 0, 0);
    return "";
  }
  Gpt2 layout(model_config_of(config));  // the whole model's layout, on rank 0 only
  layout.params().allocate(DType::kF32, Device::cpu(), AllocateOptions{16, false, false});
  const int64_t n = layout.params().numel();
  FlatModelState full{Tensor::zeros({n}, DType::kF32), Tensor::zeros({n}, DType::kF32),
                      Tensor::zeros({n}, DType::kF32)};
  auto place = [&](Gpt2& part, const FlatModelState& s) {
    for (const auto& p : part.params().parameters()) {
      const Parameter& dst = layout.params().get(p->name);
      full.values.narrow(dst.offset, dst.numel()).copy_from(s.values.narrow(p->offset, p->numel()));
      full.exp_avg.narrow(dst.offset, dst.numel()).copy_from(s.exp_avg.narrow(p->offset, p->numel()));
      full.exp_avg_sq.narrow(dst.offset, dst.numel()).copy_from(s.exp_avg_sq.narrow(p->offset, p->numel()));
    }
  };
  for (int c = 0; c < pipe.chunks(); ++c) place(pipe.chunk(c), mine[static_cast<size_t>(c)]);
  for (int r = 1; r < pp.size(); ++r) {
    for (int c = 0; c < pipe.chunks(); ++c) {
      // Rank r's chunk c: the same part as on rank r, rebuilt here for its layout.
      Gpt2 part(model_config_of(config), pipe.part_of_stage(pipe.schedule().stage_of(r, c)));
      // The layout the sender's DataParallel engine made (data_parallel.cc: unit padding).
      const int64_t multiple = config.parallel.zero == 0 ? 16 : 16 * int64_t{config.parallel.dp};
      part.params().allocate(DType::kF32, Device::cpu(), AllocateOptions{multiple, false, false});
      const int64_t pn = part.params().numel();
      FlatModelState got{Tensor::empty({pn}, DType::kF32), Tensor::empty({pn}, DType::kF32),
                         Tensor::empty({pn}, DType::kF32)};
      for (Tensor* t : {&got.values, &got.exp_avg, &got.exp_avg_sq}) pp.recv(*t, r, 0);
      place(part, got);
    }
  }
  return save_checkpoint(dir, layout.params(), layout.config(), full, st);
}

}  // namespace loom
