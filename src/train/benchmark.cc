#include "train/benchmark.h"

#include <sys/resource.h>

#include <algorithm>
#include <mutex>
#include <thread>

#include "base/error.h"
#include "base/thread_pool.h"
#include "base/timer.h"
#include "device/allocator.h"
#include "device/cuda/cuda_backend.h"
#include "kernels/cpu/fma_peak.h"
#include "kernels/ops.h"
#include "comm/local/local_backend.h"
#ifdef LOOM_WITH_NCCL
#include "comm/nccl/nccl_backend.h"
#endif
#include "optim/adamw.h"
#include "parallel/data_parallel.h"
#include "parallel/expert_parallel.h"
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

// Llama's form (models/gpt2.h): RMSNorm, rotary attention with kv_heads key/value heads, a SwiGLU
// of width ffn, no biases, the LM head tied to the token embedding.
BenchShape make_llama_shape(const std::string& name, int64_t vocab, int64_t block, int64_t d,
                            int64_t layers, int64_t heads, int64_t kv_heads, int64_t ffn,
                            double rope_theta, int64_t batch, int64_t seq) {
  BenchShape s = make_shape(name, vocab, block, d, layers, heads, batch, seq);
  s.model.arch = Arch::kLlama;
  s.model.n_kv_heads = kv_heads;
  s.model.ffn_hidden = ffn;
  s.model.rope_theta = rope_theta;
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
  // The two shapes of shared/peers/gpt_bench.py (same block sizes), plus a tiny one for tests;
  // Llama 3.2 1B's shape (1.24 B parameters: d_model 2048, 16 layers, 32 query heads sharing 8
  // key/value heads, SwiGLU of 8192, the 128256-token vocabulary, tied head) at T = 1024, and a
  // tiny Llama for tests.
  static const std::vector<BenchShape> shapes = {
      make_shape("bench-s", 8192, 256, 384, 6, 6, 8, 256),
      make_shape("gpt2-124m", 50304, 1024, 768, 12, 12, 4, 256),
      make_shape("tiny", 256, 32, 64, 2, 4, 4, 32),
      make_llama_shape("llama-1b", 128256, 1024, 2048, 16, 32, 8, 8192, 500000, 4, 1024),
      // Llama 3 8B's layers (d_model 4096, 32 query heads of 128 sharing 8, SwiGLU of 14336),
      // four of them, at T = 4096: the flash kernels at head size 128 on a real model's width.
      make_llama_shape("llama-8b-4l", 128256, 8192, 4096, 4, 32, 8, 14336, 500000, 2, 4096),
      // bench-s's sizes in Llama's form (6 query heads sharing 2 key/value heads, a SwiGLU 1024
      // wide), for the CPU comparison with transformers' LlamaForCausalLM
      // (bench/peers/llama_bench.py).
      make_llama_shape("llama-s", 8192, 256, 384, 6, 6, 2, 1024, 10000, 8, 256),
      // llama-s with a mixture of 8 SwiGLU experts (each 1024 wide, 2 per token) in each block,
      // Mixtral's form, for the comparison with transformers' MixtralForCausalLM.
      [] {
        BenchShape s = make_llama_shape("moe-s", 8192, 256, 384, 6, 6, 2, 1024, 10000, 8, 256);
        s.model.moe_experts = 8;
        s.model.moe_top_k = 2;
        return s;
      }(),
      make_llama_shape("llama-tiny", 256, 32, 64, 2, 4, 2, 176, 10000, 4, 32),
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

namespace {

// One rank's timed loop; rank 0 fills `r`. A GPU rank's gradients are reduced by nccl (a group
// of one, as the trainer runs one GPU), not by the host communicator, which takes host tensors.
void bench_rank(Communicator& host, const BenchShape& shape, const BenchOptions& o, BenchResult& r) {
  ThreadPool pool(o.threads);
  const Device device = o.device == "cuda" ? Device::cuda(host.rank()) : Device::cpu(host.rank());
  std::unique_ptr<Communicator> gpu_comm;
#ifdef LOOM_WITH_NCCL
  if (device.is_cuda()) gpu_comm = make_nccl_world(host, device.index);
#endif
  Communicator& comm = gpu_comm ? *gpu_comm : host;
  // --ep: the experts split over groups of ranks (parallel/expert_parallel.h), as the trainer.
  ExpertGroups expert_groups;
  std::unique_ptr<ExpertParallel> experts;
  if (o.ep > 1) {
    expert_groups = split_expert_groups(comm, o.ep);
    experts = std::make_unique<ExpertParallel>(*expert_groups.ep, o.ep_dispatch == "all_to_all");
  }
  Gpt2 model(shape.model, Gpt2Part{}, experts.get());
  DataParallelConfig dp_config;
  dp_config.zero = o.zero;
  dp_config.experts_data_parallel = expert_groups.experts_dp.get();
  dp_config.expert_parallel = expert_groups.ep.get();
  auto engine = DataParallel::create(model.params(), comm, pool, device, dp_config, AdamWConfig{}, 1337);
  Context ctx{&pool, device, DType::kF32, engine.get()};
  ctx.rounded_weights = engine->rounded_weights();  // nn/rounded_weights.h

  const int64_t B = shape.batch, T = shape.seq_len;  // with --batch / --seq applied
  // Made on the host, then copied to the device outside the timed part.
  Tensor host_inputs = Tensor::empty({B, T}, DType::kI32);
  Tensor host_targets = Tensor::empty({B, T}, DType::kI32);
  Tensor inputs = Tensor::empty({B, T}, DType::kI32, device);
  Tensor targets = Tensor::empty({B, T}, DType::kI32, device);
  RandomStream rng(1337, "bench.tokens." + std::to_string(comm.rank()));
  std::vector<double> total, fwd, bwd, opt, wait;
  allocator_for(device).reset_peak();
  for (int64_t step = 0; step < o.warmup + o.steps; ++step) {
    for (int64_t i = 0; i < B * T; ++i) {
      host_inputs.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % shape.model.vocab_size);
      host_targets.data<int32_t>()[i] = static_cast<int32_t>(rng.next_u32() % shape.model.vocab_size);
    }
    inputs.copy_from(host_inputs);
    targets.copy_from(host_targets);
    synchronize(device);
    if (o.profile && step == o.warmup) ops::start_profile();
    (void)comm.take_device_wait_seconds();  // restarts the count of the GPU stream's stalls
    const double t0 = now_seconds();
    engine->begin_step();
    engine->begin_micro_batch(0, 1);
    model.forward(ctx, inputs, targets);  // waits for the GPU: the loss comes back
    const double t1 = now_seconds();
    model.backward(ctx);
    engine->end_micro_batch();
    synchronize(device);
    const double t2 = now_seconds();
    engine->clip_grad_norm(1.0);
    engine->optimizer_step(3e-4f);
    synchronize(device);
    const double t3 = now_seconds();
    if (step >= o.warmup) {
      total.push_back(t3 - t0);
      fwd.push_back(t1 - t0);
      bwd.push_back(t2 - t1);
      opt.push_back(t3 - t2);
      // The host's waits, and under nccl the compute stream's (the host does not wait there).
      wait.push_back(engine->step_stats().wait_seconds + comm.take_device_wait_seconds());
    }
  }
  if (o.profile) r.ops = ops::stop_profile();
  if (comm.rank() != 0) return;
  const double step_s = median(total);
  r.step_ms = step_s * 1e3;
  r.forward_ms = median(fwd) * 1e3;
  r.backward_ms = median(bwd) * 1e3;
  r.optimizer_ms = median(opt) * 1e3;
  r.comm_wait_ms = median(wait) * 1e3;
  r.comm_wait_fraction = r.comm_wait_ms / r.step_ms;
  r.tokens_per_s = static_cast<double>(comm.size() * B * T) / step_s;
  r.gflops = r.flops_per_token * r.tokens_per_s / 1e9;
  if (o.gpu_peak_tflops > 0) r.mfu = r.gflops / (o.gpu_peak_tflops * 1e3 * comm.size());
  r.peak_alloc_mb = static_cast<double>(allocator_for(device).stats().peak_bytes_in_use) / 1048576.0;
  r.rank_parameters = model.params().parameter_numel();
  r.state_mb = static_cast<double>(engine->memory().state()) / 1048576.0;
}

BenchResult finish_with_rss(BenchResult& r) {
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  r.peak_rss_mb = static_cast<double>(usage.ru_maxrss) / 1024.0;
  return r;
}

}  // namespace

BenchResult benchmark_training(const BenchShape& shape, const BenchOptions& o) {
  if (o.threads < 1) fail("--threads must be >= 1, got ", o.threads);
  if (o.ranks < 1) fail("--ranks must be >= 1, got ", o.ranks);
  if (o.ep_dispatch != "all_gather" && o.ep_dispatch != "all_to_all")
    fail("--ep-dispatch must be all_gather or all_to_all, got '", o.ep_dispatch, "'");
  if (o.ep < 1 || o.ranks % o.ep != 0) fail("--ep ", o.ep, " must divide --ranks ", o.ranks);
  if (o.ep > 1 && !shape.model.moe())
    fail("--ep ", o.ep, " splits a mixture's experts: shape ", shape.name, " has none (moe-s has)");
  if (o.ep > 1 && shape.model.moe_experts % o.ep != 0)
    fail("--ep ", o.ep, " does not divide the ", shape.model.moe_experts, " experts of ",
         shape.name);
  if (o.steps < 1) fail("--steps must be >= 1, got ", o.steps);
  if (o.device != "cpu" && o.device != "cuda") fail("--device must be cpu or cuda, got '", o.device, "'");
  if (o.device != "cuda" && o.precision != "fp32" && o.precision != "bf16" && o.precision != "fp8")
    fail("--precision ", o.precision,
         " needs --device cuda: CPU ranks run fp32, bf16 or fp8 GEMMs");
  if (o.profile && o.ranks != 1)
    fail("--profile times one rank (--ranks 1); got --ranks ", o.ranks);
  if (o.batch < 0 || o.seq_len < 0)
    fail("--batch and --seq must be >= 0 (0: the shape's), got ", o.batch, " and ", o.seq_len);
  if (o.seq_len > shape.model.max_seq_len)
    fail("--seq ", o.seq_len, " exceeds the block size ", shape.model.max_seq_len, " of ", shape.name);
  if (o.device == "cuda") {
    if (!cuda_available()) fail("--device cuda: no usable GPU (", cuda::unavailable_reason(), ")");
    // Thread ranks, GPU r each, gradients reduced by nccl (which refuses two ranks on one GPU).
    if (o.ranks > cuda::device_count())
      fail("--device cuda --ranks ", o.ranks, ": one GPU per rank, and only ",
           cuda::device_count(), " GPU(s) are visible");
  }
  const ops::MatmulPrecisionScope precision(o.precision);
  BenchResult r;
  r.shape = shape.name;
  r.threads = o.threads;
  r.ranks = o.ranks;
  r.zero = o.zero;
  r.ep = o.ep;
  r.ep_dispatch = o.ep_dispatch;
  r.steps = o.steps;
  r.num_parameters = shape.model.num_parameters();
  r.device = o.device;
  r.precision = o.precision;
  // The shape as run: --batch and --seq replace its defaults.
  BenchShape run = shape;
  if (o.batch > 0) run.batch = o.batch;
  if (o.seq_len > 0) run.seq_len = o.seq_len;
  r.batch = run.batch;
  r.seq_len = run.seq_len;
  r.flops_per_token = shape.model.flops_per_token(r.seq_len);
  std::vector<std::unique_ptr<Communicator>> world = make_local_world(o.ranks);
  if (o.ranks == 1) {
    bench_rank(*world[0], run, o, r);
  } else {
    std::vector<std::thread> threads;
    std::mutex mutex;
    std::string error;
    for (int rank = 0; rank < o.ranks; ++rank)
      threads.emplace_back([&, rank] {
        try {
          bench_rank(*world[rank], run, o, r);
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> lock(mutex);
          if (error.empty()) {
            error = e.what();
            dynamic_cast<LocalCommunicator&>(*world[0]).abort(e.what());
          }
        }
      });
    for (auto& t : threads) t.join();
    if (!error.empty()) fail(error);
  }
  if (o.device == "cuda") return finish_with_rss(r);
  // The ceiling, measured right after the run with as many threads as it computed on.
  // At bf16 the ceiling is that of the instruction the bf16 GEMM runs (vdpbf16ps, or FMAs).
  const cpu::FmaPeak peak = cpu::measure_fma_peak(
      o.ranks * o.threads, 0.3,
      o.precision == "fp32" ? cpu::PeakKind::kFp32Fma : cpu::PeakKind::kBf16Gemm);
  r.fma_peak_gflops = peak.gflops;
  r.fma_isa = peak.isa;
  r.cpu_gemm = cpu::cpu_gemm_name();
  r.roofline_share = r.gflops / peak.gflops;
  return finish_with_rss(r);
}

}  // namespace loom
