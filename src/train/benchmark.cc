#include "train/benchmark.h"

#include <sys/resource.h>

#include <algorithm>

#include "base/error.h"
#include "base/thread_pool.h"
#include "base/timer.h"
#include "device/allocator.h"
#include "optim/adamw.h"
#include "tensor/rng.h"

namespace loom {

namespace {
BenchShape make_shape(const std::string& name, int64_t vocab, int64_t block, int64_t d,
                      int64_t layers, int64_t heads, int64_t batch, int64_t seq) {
  BenchShape s;
  s.name = name;
  s.model.vocab_size = vocab;
  s.model.max_seq_len = block;
  s.model.d_model = d;
  s.model.n_layers = layers;
  s.model.n_heads = heads;
  s.batch = batch;
  s.seq_len = seq;
  return s;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
}  // namespace

const std::vector<BenchShape>& bench_shapes() {
  // The two shapes of shared/peers/gpt_bench.py (same block sizes), plus a tiny one for tests.
  static const std::vector<BenchShape> shapes = {
      make_shape("bench-s", 8192, 256, 384, 6, 6, 8, 256),
      make_shape("gpt2-124m", 50304, 1024, 768, 12, 12, 4, 256),
      make_shape("tiny", 256, 32, 64, 2, 4, 4, 32),
  };
  return shapes;
}

const BenchShape& find_bench_shape(const std::string& name) {
  std::string known;
  for (const auto& s : bench_shapes()) {
    if (s.name == name) return s;
    known += (known.empty() ? "" : ", ") + s.name;
  }
  fail("unknown benchmark shape '", name, "' (known: ", known, ")");
}

BenchResult benchmark_training(const BenchShape& shape, int threads, int64_t steps,
                               int64_t warmup) {
  if (threads < 1) fail("--threads must be >= 1, got ", threads);
  if (steps < 1) fail("--steps must be >= 1, got ", steps);
  ThreadPool pool(threads);
  const Device device = Device::cpu(0);
  Context ctx{&pool, device, DType::kF32};
  Gpt2 model(shape.model);
  model.build(DType::kF32, device, 1337);
  AdamW optimizer(model.params(), AdamWConfig{});

  BenchResult r;
  r.shape = shape.name;
  r.threads = threads;
  r.steps = steps;
  r.num_parameters = shape.model.num_parameters();
  const int64_t n_flop_params = shape.model.num_parameters() -
                                shape.model.max_seq_len * shape.model.d_model;
  r.flops_per_token = 6.0 * static_cast<double>(n_flop_params) +
                      12.0 * static_cast<double>(shape.model.n_layers * shape.model.d_model *
                                                 shape.seq_len);

  const int64_t B = shape.batch, T = shape.seq_len;
  Tensor inputs = Tensor::empty({B, T}, DType::kI32);
  Tensor targets = Tensor::empty({B, T}, DType::kI32);
  RandomStream rng(1337, "bench.tokens");
  std::vector<double> total, fwd, bwd, opt;
  for (int64_t step = 0; step < warmup + steps; ++step) {
    for (int64_t i = 0; i < B * T; ++i) {
      inputs.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % shape.model.vocab_size);
      targets.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % shape.model.vocab_size);
    }
    const double t0 = now_seconds();
    model.params().zero_grads();
    model.forward(ctx, inputs, targets);
    const double t1 = now_seconds();
    model.backward(ctx);
    const double t2 = now_seconds();
    clip_grad_norm(pool, model.params(), 1.0);
    optimizer.step(pool, 3e-4f);
    const double t3 = now_seconds();
    if (step >= warmup) {
      total.push_back(t3 - t0);
      fwd.push_back(t1 - t0);
      bwd.push_back(t2 - t1);
      opt.push_back(t3 - t2);
    }
  }
  const double step_s = median(total);
  r.step_ms = step_s * 1e3;
  r.forward_ms = median(fwd) * 1e3;
  r.backward_ms = median(bwd) * 1e3;
  r.optimizer_ms = median(opt) * 1e3;
  r.tokens_per_s = static_cast<double>(B * T) / step_s;
  r.gflops = r.flops_per_token * r.tokens_per_s / 1e9;
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  r.peak_rss_mb = static_cast<double>(usage.ru_maxrss) / 1024.0;
  r.peak_alloc_mb = static_cast<double>(allocator_for(device).stats().peak_bytes_in_use) / 1048576.0;
  return r;
}

}  // namespace loom
