#include "train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "base/error.h"
#include "base/thread_pool.h"
#include "base/timer.h"
#include "checkpoint/checkpoint.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "device/allocator.h"
#include "models/gpt2.h"
#include "monitor/metrics_log.h"
#include "optim/adamw.h"

namespace loom {
namespace fs = std::filesystem;

Gpt2Config model_config_of(const Config& config) {
  Gpt2Config m;
  m.vocab_size = config.model.vocab_size;
  m.max_seq_len = config.model.resolved_max_seq_len();
  m.d_model = config.model.d_model;
  m.n_layers = config.model.n_layers;
  m.n_heads = config.model.n_heads;
  m.init_std = static_cast<float>(config.model.init_std);
  m.recompute = config.train.recompute;
  return m;
}

namespace {

// Mean loss over `batches` validation micro-batches, read from the start of the split every time
// so evaluations are comparable across steps and across resumed runs.
double evaluate(Context& ctx, Gpt2& model, const std::vector<std::string>& shards, int64_t batch,
                int64_t seq_len, int64_t batches) {
  DataLoader loader(shards, batch, seq_len);
  Tensor inputs = Tensor::empty({batch, seq_len}, DType::kI32);
  Tensor targets = Tensor::empty({batch, seq_len}, DType::kI32);
  double total = 0;
  for (int64_t i = 0; i < batches; ++i) {
    loader.next_batch(inputs.data<int32_t>(), targets.data<int32_t>());
    total += model.forward(ctx, inputs, targets);
    model.clear_cache();
  }
  return total / static_cast<double>(batches);
}

}  // namespace

TrainSummary run_training(const Config& config, const TrainOptions& options) {
  validate(config);
  if (config.parallel.dp * config.parallel.tp * config.parallel.pp != 1 || config.runtime.ranks != 1)
    fail("parallel layouts (parallel.dp/tp/pp, runtime.ranks > 1) are not implemented yet: "
         "this build trains on one device");
  const Device device = Device::parse(config.runtime.device);
  if (!device.is_cpu()) fail("runtime.device = '", config.runtime.device, "': training runs on the cpu for now");

  const TrainConfig& tc = config.train;
  const int64_t seq_len = config.model.seq_len;
  const int64_t micro = tc.micro_batch_size;
  const int64_t accum = config.grad_accum_steps();
  const int64_t tokens_per_step = tc.batch_size * seq_len;

  ThreadPool pool(config.runtime.resolved_threads_per_rank());
  Context ctx{&pool, device, DType::kF32};

  Gpt2 model(model_config_of(config));
  model.build(DType::kF32, device, static_cast<uint64_t>(tc.seed));
  AdamWConfig opt_config;
  opt_config.beta1 = static_cast<float>(tc.beta1);
  opt_config.beta2 = static_cast<float>(tc.beta2);
  opt_config.eps = static_cast<float>(tc.eps);
  opt_config.weight_decay = static_cast<float>(tc.weight_decay);
  AdamW optimizer(model.params(), opt_config);

  DataLoader train_loader(resolve_shards(config.data.train, "data.train"), micro, seq_len);
  std::vector<std::string> val_shards;
  if (!config.data.val.empty() && tc.eval_every > 0)
    val_shards = resolve_shards(config.data.val, "data.val");

  // Run directory and resume.
  std::error_code ec;
  fs::create_directories(options.run_dir, ec);
  if (ec) fail("cannot create run directory ", options.run_dir, ": ", ec.message());
  const std::string checkpoints_dir = (fs::path(options.run_dir) / "checkpoints").string();
  ProgressLine progress(tc.steps, options.progress && isatty(STDERR_FILENO));
  std::string resume_from;
  if (options.resume == "auto") {
    resume_from = find_latest_checkpoint(checkpoints_dir);
    if (resume_from.empty() && options.progress)
      progress.message("no checkpoint in " + checkpoints_dir + ": starting from step 0");
  } else if (!options.resume.empty()) {
    resume_from = options.resume;
    if (!fs::is_directory(resume_from)) fail("--resume ", resume_from, ": no such checkpoint directory");
  }
  TrainSummary summary;
  if (!resume_from.empty()) {
    TrainingState st = load_checkpoint(resume_from, model, &optimizer);
    if (st.step > tc.steps)
      fail("checkpoint ", resume_from, " is at step ", st.step, ", past train.steps = ", tc.steps);
    train_loader.set_state({st.loader_shard, st.loader_offset, st.loader_epoch});
    summary.start_step = st.step;
    if (options.progress) progress.message("resumed from " + resume_from);
  }
  {
    std::ofstream out(fs::path(options.run_dir) / "config.toml");
    out << to_toml(config);
  }
  MetricsLog metrics((fs::path(options.run_dir) / "metrics.jsonl").string(),
                     resume_from.empty() ? -1 : summary.start_step);

  Tensor inputs = Tensor::empty({micro, seq_len}, DType::kI32, device);
  Tensor targets = Tensor::empty({micro, seq_len}, DType::kI32, device);
  Allocator& allocator = allocator_for(device);
  const int64_t end_step = options.stop_after > 0 ? std::min(options.stop_after, tc.steps) : tc.steps;
  double time_total = 0;
  int64_t steps_timed = 0;
  auto checkpoint = [&](int64_t step) {
    const LoaderState ls = train_loader.state();
    TrainingState st{step, optimizer.steps_taken(), ls.shard, ls.offset, ls.epoch,
                     static_cast<uint64_t>(tc.seed), to_toml(config)};
    summary.last_checkpoint = save_checkpoint(checkpoints_dir, model, &optimizer, st);
    if (options.progress) progress.message("saved " + summary.last_checkpoint);
  };

  summary.last_step = summary.start_step;
  for (int64_t step = summary.start_step + 1; step <= end_step; ++step) {
    const double t0 = now_seconds();
    model.params().zero_grads();
    double loss = 0;
    for (int64_t m = 0; m < accum; ++m) {
      train_loader.next_batch(inputs.data<int32_t>(), targets.data<int32_t>());
      loss += model.forward(ctx, inputs, targets) / static_cast<double>(accum);
      model.backward(ctx, 1.0 / static_cast<double>(accum));
    }
    const double grad_norm = clip_grad_norm(pool, model.params(), tc.grad_clip);
    const float lr = lr_schedule(step - 1, tc.steps, tc.warmup_steps, static_cast<float>(tc.lr),
                                 static_cast<float>(tc.min_lr_ratio));
    optimizer.step(pool, lr);
    const double dt = now_seconds() - t0;
    if (!std::isfinite(loss))
      fail("loss is ", loss, " at step ", step, ": training diverged (lower train.lr?)");

    time_total += dt;
    ++steps_timed;
    if (step == summary.start_step + 1) summary.first_loss = loss;
    summary.last_loss = loss;
    summary.last_step = step;
    nlohmann::json record = {{"step", step},
                             {"loss", loss},
                             {"lr", lr},
                             {"grad_norm", grad_norm},
                             {"tokens_per_s", tokens_per_step / dt},
                             {"step_ms", dt * 1e3},
                             {"tokens", step * tokens_per_step},
                             {"peak_mem_mb", allocator.stats().peak_bytes_in_use / 1048576.0}};
    const bool last = step == tc.steps;
    if (!val_shards.empty() && (step % tc.eval_every == 0 || last)) {
      const double val = evaluate(ctx, model, val_shards, micro, seq_len, tc.eval_batches);
      record["val_loss"] = val;
      summary.last_val_loss = val;
    }
    metrics.write(record);
    if (options.progress && (step % tc.log_every == 0 || last || step == end_step)) {
      const double mean_dt = time_total / static_cast<double>(steps_timed);
      progress.step(step, loss, lr, grad_norm, tokens_per_step / dt,
                    mean_dt * static_cast<double>(end_step - step));
      if (record.contains("val_loss")) {
        char buf[96];
        std::snprintf(buf, sizeof buf, "step %ld: val loss %.4f", static_cast<long>(step),
                      record["val_loss"].get<double>());
        progress.message(buf);
      }
    }
    const bool stopping = options.stop_after > 0 && step == options.stop_after && !last;
    if ((tc.save_every > 0 && (step % tc.save_every == 0 || last)) || stopping) checkpoint(step);
  }
  progress.finish();
  summary.tokens_per_s =
      steps_timed > 0 ? tokens_per_step * static_cast<double>(steps_timed) / time_total : 0;
  summary.peak_bytes = allocator.stats().peak_bytes_in_use;
  return summary;
}

}  // namespace loom
