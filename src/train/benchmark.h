// `loom bench train`: trains a named shape on random tokens for a few steps after warm-up, on one
// rank or on data-parallel thread ranks (PyTorch DDP's setting in the peer script), on the CPU or
// on GPUs (--device cuda: rank r on GPU r, timings taken after synchronising the GPU), and
// reports throughput, achieved FLOP/s and peak memory. FLOPs per token = 6·N + 12·L·d·T with N
// all parameters except the position embedding (the tied token embedding counted once), as in
// shared/peers/gpt_bench.py, so the figures compare directly with PyTorch's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/op_profile.h"
#include "models/gpt2.h"

namespace loom {

struct BenchShape {
  std::string name;
  Gpt2Config model;
  int64_t batch = 1;
  int64_t seq_len = 1;
};

// bench-s, gpt2-124m, tiny; llama-1b, llama-8b-4l, llama-s, llama-tiny (Llama's form:
// Gpt2Config::arch = kLlama)
const std::vector<BenchShape>& bench_shapes();
const BenchShape& find_bench_shape(const std::string& name);  // throws naming the known ones

struct BenchOptions {
  int threads = 1;      // compute threads per rank
  int ranks = 1;        // data-parallel thread ranks of the local backend (batch is per rank)
  int zero = 0;         // ZeRO stage
  int ep = 1;           // expert parallelism over the ranks (a mixture's shape: moe-s)
  std::string ep_dispatch = "all_gather";  // or all_to_all (parallel.ep_dispatch)
  int64_t steps = 5;    // timed steps
  int64_t warmup = 2;   // untimed steps first
  std::string device = "cpu";  // cpu, or cuda: rank r computes on GPU r
  int64_t batch = 0;    // sequences per rank; 0 = the shape's
  int64_t seq_len = 0;  // tokens per sequence (<= the shape's block size); 0 = the shape's
  std::string precision = "fp32";  // cuda: GEMM inputs in fp32, tf32, bf16 or fp16
  double gpu_peak_tflops = 0;  // cuda: the GPU's peak for the precision run, for the MFU
  bool profile = false;  // time every op kind over the timed steps (kernels/op_profile.h); 1 rank
};

struct BenchResult {
  std::string shape;
  int threads = 1;
  int ranks = 1;
  int zero = 0;
  int ep = 1;
  std::string ep_dispatch = "all_gather";
  int64_t steps = 0;
  double tokens_per_s = 0;   // median over timed steps
  double gflops = 0;         // achieved, at the median step time
  double step_ms = 0;        // median
  double forward_ms = 0, backward_ms = 0, optimizer_ms = 0;  // medians
  double peak_rss_mb = 0;    // process peak resident set
  double peak_alloc_mb = 0;  // tensor allocator peak (rank 0)
  int64_t rank_parameters = 0;  // the parameters rank 0 holds (under expert parallelism a part)
  double state_mb = 0;  // rank 0's parameters, gradients and AdamW moments (DataParallelMemory)
  double comm_wait_ms = 0;   // median per step, rank 0 blocked on data-parallel communication
                             // (on a GPU: its compute stream, waiting on nccl)
  double comm_wait_fraction = 0;  // comm_wait_ms / step_ms
  double flops_per_token = 0;
  int64_t num_parameters = 0;
  // The machine's fp32 FMA ceiling for ranks × threads threads, measured in the same run
  // (kernels/cpu/fma_peak.h), and the share of it the training achieved.
  double fma_peak_gflops = 0;
  std::string fma_isa;
  std::string cpu_gemm;       // the CPU GEMM the run used (cpu::cpu_gemm_name() during it)
  double roofline_share = 0;  // gflops / fma_peak_gflops
  // cuda runs: the device, the sequences and tokens per rank they ran, and the model FLOP
  // utilisation against BenchOptions::gpu_peak_tflops (0 when no peak was given).
  std::string device = "cpu", precision = "fp32";
  int64_t batch = 0, seq_len = 0;
  double mfu = 0;
  // With BenchOptions::profile: each op kind's time summed over the timed steps, the most
  // expensive first (ms / steps per step; their sum is below step_ms by the host's own work
  // and, on a GPU, the idle gaps between kernels).
  std::vector<ops::OpTime> ops;
};

// Global batch = ranks × shape.batch sequences; tokens/s counts all ranks.
BenchResult benchmark_training(const BenchShape& shape, const BenchOptions& options);

}  // namespace loom
