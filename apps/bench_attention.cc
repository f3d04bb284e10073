#include "bench_attention.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <span>
#include <vector>

#include "base/error.h"
#include "base/thread_pool.h"
#include "device/allocator.h"
#include "kernels/ops.h"
#include "parallel/context_parallel.h"
#include "tensor/tensor.h"

namespace loom {
namespace {

// The best of `iters` timed runs of f, after one untimed (first allocations, cold caches).
double best_seconds(Device device, int iters, const std::function<void()>& f) {
  double best = 1e300;
  for (int i = 0; i <= iters; ++i) {
    synchronize(device);
    const auto t0 = std::chrono::steady_clock::now();
    f();
    synchronize(device);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) best = std::min(best, s);
  }
  return best;
}

// The (query, key) pairs the causal mask lets query rows `rows` see, per (batch, head).
double pairs_seen(std::span<const cpu::RowRange> rows) {
  double n = 0;
  for (const cpu::RowRange& r : rows)  // Σ_{p = begin}^{end − 1} (p + 1)
    n += 0.5 * static_cast<double>(r.end) * static_cast<double>(r.end + 1) -
         0.5 * static_cast<double>(r.begin) * static_cast<double>(r.begin + 1);
  return n;
}

// Rows `rows` of (B, T, width) values, columns [from, from + n) of each: (B, Σ sizes, n).
std::vector<float> rows_of(const std::vector<float>& v, int64_t B, int64_t T, int64_t width,
                           int64_t from, int64_t n, std::span<const cpu::RowRange> rows) {
  std::vector<float> out;
  for (int64_t b = 0; b < B; ++b)
    for (const cpu::RowRange& r : rows)
      for (int64_t t = r.begin; t < r.end; ++t) {
        const auto at = v.begin() + (b * T + t) * width + from;
        out.insert(out.end(), at, at + n);
      }
  return out;
}

Tensor on(Device device, const std::vector<float>& values) {
  return Tensor::from_vector(values, {static_cast<int64_t>(values.size())}).to(device);
}

// A copy of f32 `t` as bf16 values (rounded on the GPU as the flash kernels would).
Tensor rounded(const Exec& ex, const Tensor& t, int64_t rows, int64_t width) {
  Tensor out = Tensor::empty({rows * width}, DType::kBF16, ex.device);
  ops::copy_columns_to_bf16(ex, out.raw(), width, t.data<float>(), width, rows, width);
  return out;
}

}  // namespace

int cmd_bench_attention(const BenchAttentionArgs& a) {
  const int64_t B = a.batch, T = a.seq_len, NH = a.heads, hd = a.head_dim;
  const int64_t KV = a.kv_heads > 0 ? a.kv_heads : NH;
  if (B < 1 || T < 1 || NH < 1 || hd < 1 || a.threads < 1 || a.iters < 1)
    fail("--batch, --seq, --heads, --head-dim, --threads and --iters must be at least 1");
  if (NH % KV != 0) fail("--kv-heads ", KV, " does not divide --heads ", NH);
  if (a.documents < 0) fail("--documents must be 0 (none) or a document length");
  if (a.window < 0) fail("--window must be 0 (none) or a sliding window's length");
  if (a.cp < 1 || T % (2 * a.cp) != 0)
    fail("--seq ", T, " must split into 2 x --cp = ", 2 * a.cp, " equal chunks");
  const Device device = Device::parse(a.device);
  if (a.precision != "fp32" && a.precision != "bf16")
    fail("--precision must be fp32 or bf16, got '", a.precision, "'");
  if (device.is_cuda())
    ops::set_matmul_precision(a.precision);
  else if (a.precision != "fp32")
    fail("--precision ", a.precision, " is for a GPU: the CPU's attention runs in fp32");
  ThreadPool pool(a.threads);
  const Exec ex{&pool, device};
  const int64_t C = NH * hd, W = (NH + 2 * KV) * hd, kvw = 2 * KV * hd;
  const std::vector<cpu::RowRange> rows = zigzag_positions(T, a.cp, 0);
  const int64_t Tq = cpu::rows_in(rows);
  const std::vector<cpu::RowRange> every = {{0, T}};

  std::mt19937_64 gen(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> qkv_h(static_cast<size_t>(B * T * W)), dout_h(static_cast<size_t>(B * T * C));
  for (float& x : qkv_h) x = dist(gen);
  for (float& x : dout_h) x = dist(gen);
  const Tensor qkv = on(device, qkv_h), dout = on(device, dout_h);

  // The whole sequence, as one device's attention runs: on a GPU at bf16 with the flash kernels,
  // qkv and the output in bf16 as the projections write and read them.
  const bool whole16 = ops::attention_takes_rounded_qkv(ex, C, NH, B);
  const Tensor qkv16 = whole16 ? rounded(ex, qkv, B * T, W) : Tensor();
  Tensor out = Tensor::empty({B * T * C}, whole16 ? DType::kBF16 : DType::kF32, device);
  Tensor lse = Tensor::empty({B * NH * T}, DType::kF32, device);
  Tensor dqkv = Tensor::empty({B * T * W}, whole16 ? DType::kBF16 : DType::kF32, device);
  // With --documents: each sequence's documents of that many tokens (the last one shorter); with
  // --window each query's first position raised to its window's (nn/sliding_window.h).
  Tensor starts;
  cpu::DocumentStarts docs;
  const bool masked = a.documents > 0 || a.window > 0;
  double masked_pairs_per_sequence = 0;  // the (query, key) pairs the mask leaves
  if (masked) {
    Tensor host_starts = Tensor::zeros({B, T}, DType::kI32, Device::cpu());
    for (int64_t i = 0; a.documents > 0 && i < B * T; ++i)
      host_starts.data<int32_t>()[i] = static_cast<int32_t>(i % T / a.documents * a.documents);
    if (a.window > 0)
      ops::window_starts({&pool, Device::cpu()}, host_starts.data<int32_t>(),
                         host_starts.data<int32_t>(), B, T, a.window);
    for (int64_t p = 0; p < T; ++p)
      masked_pairs_per_sequence += static_cast<double>(p - host_starts.data<int32_t>()[p] + 1);
    starts = host_starts.to(device);
    docs = {starts.data<int32_t>(), T};
  }
  const auto whole_forward_masked = [&](cpu::DocumentStarts d) {
    if (whole16)
      ops::attention_gqa_forward_rounded(ex, out.raw(), DType::kBF16, lse.data<float>(),
                                         qkv16.raw(), DType::kBF16, B, T, NH, KV, hd, d);
    else
      ops::attention_gqa_forward<float>(ex, out.data<float>(), lse.data<float>(), qkv.data<float>(),
                                        B, T, NH, KV, hd, d);
  };
  const auto whole_backward_masked = [&](cpu::DocumentStarts d) {
    if (whole16)
      ops::attention_gqa_backward_rounded(ex, dqkv.raw(), dout.data<float>(), DType::kF32,
                                          qkv16.raw(), DType::kBF16, out.raw(), DType::kBF16,
                                          lse.data<float>(), B, T, NH, KV, hd, d);
    else
      ops::attention_gqa_backward<float>(ex, dqkv.data<float>(), dout.data<float>(),
                                         qkv.data<float>(), out.data<float>(), lse.data<float>(), B,
                                         T, NH, KV, hd, d);
  };
  const auto whole_forward = [&] { whole_forward_masked({}); };
  const auto whole_backward = [&] { whole_backward_masked({}); };

  // Rank 0's rows, as context parallelism holds them: its queries (B, Tq, C), every position's
  // keys and values (B, T, 2·KV·hd) — in bf16 where the flash kernels take the rows.
  const bool rows16 = ops::attention_rows_take_bf16(ex, NH, hd, B, rows);
  const Tensor q = on(device, rows_of(qkv_h, B, T, W, 0, C, rows));
  const Tensor kv = on(device, rows_of(qkv_h, B, T, W, C, kvw, every));
  const Tensor dout_r = on(device, rows_of(dout_h, B, T, C, 0, C, rows));
  const Tensor q16 = rows16 ? rounded(ex, q, B * Tq, C) : Tensor();
  const Tensor kv16 = rows16 ? rounded(ex, kv, B * T, kvw) : Tensor();
  Tensor out_r = Tensor::empty({B * Tq * C}, DType::kF32, device);
  Tensor lse_r = Tensor::empty({B * NH * Tq}, DType::kF32, device);
  Tensor dq = Tensor::empty({B * Tq * C}, DType::kF32, device);
  Tensor dkv = Tensor::empty({B * T * kvw}, DType::kF32, device);
  const auto rows_forward = [&] {
    if (rows16)
      ops::attention_gqa_forward_rows_bf16(ex, out_r.raw(), DType::kF32, lse_r.data<float>(),
                                           q16.raw(), C, kv16.raw(), kvw, B, T, NH, KV, hd, rows);
    else
      ops::attention_gqa_forward_rows<float>(ex, out_r.data<float>(), lse_r.data<float>(),
                                             q.data<float>(), C, kv.data<float>(), kvw, B, T, NH,
                                             KV, hd, rows);
  };
  const auto rows_backward = [&] {
    if (rows16)
      ops::attention_gqa_backward_rows_bf16(
          ex, dq.data<float>(), C, dkv.data<float>(), dout_r.data<float>(), q16.raw(), C,
          kv16.raw(), kvw, out_r.raw(), DType::kF32, lse_r.data<float>(), B, T, NH, KV, hd,
          rows);
    else
      ops::attention_gqa_backward_rows<float>(
          ex, dq.data<float>(), C, dkv.data<float>(), dout_r.data<float>(), q.data<float>(), C,
          kv.data<float>(), kvw, out_r.data<float>(), lse_r.data<float>(), B, T, NH, KV, hd, rows);
  };

  // The same rows as the ring computes them (parallel.cp_comm = "ring"): over every rank's block
  // of keys and values in ring order from rank 0's own, each block's partial result merged by
  // log-sum-exp; the backward per block with the merged result, dQ summed. The compute of a
  // rank's ring step, without the transfers it overlaps.
  std::vector<std::vector<cpu::RowRange>> block_keys;
  std::vector<Tensor> blocks;
  for (int s = 0; s < a.cp; ++s) {
    block_keys.push_back(zigzag_positions(T, a.cp, (a.cp - s) % a.cp));
    const Tensor block = on(device, rows_of(qkv_h, B, T, W, C, kvw, block_keys.back()));
    blocks.push_back(rows16 ? rounded(ex, block, B * Tq, kvw) : block);
  }
  Tensor out_ring = Tensor::empty({B * Tq * C}, DType::kF32, device);
  Tensor lse_ring = Tensor::empty({B * NH * Tq}, DType::kF32, device);
  Tensor part = Tensor::empty({B * Tq * C}, DType::kF32, device);
  Tensor part_lse = Tensor::empty({B * NH * Tq}, DType::kF32, device);
  Tensor dkv_block = Tensor::empty({B * Tq * kvw}, DType::kF32, device);
  const auto ring_forward = [&] {
    for (int s = 0; s < a.cp; ++s) {
      float* o = (s == 0 ? out_ring : part).data<float>();
      float* l = (s == 0 ? lse_ring : part_lse).data<float>();
      const std::vector<cpu::RowRange>& keys = block_keys[static_cast<size_t>(s)];
      const Tensor& block = blocks[static_cast<size_t>(s)];
      if (rows16)
        ops::attention_gqa_forward_rows_bf16(ex, o, DType::kF32, l, q16.raw(), C, block.raw(), kvw,
                                             B, Tq, NH, KV, hd, rows, keys);
      else
        ops::attention_gqa_forward_rows<float>(ex, o, l, q.data<float>(), C, block.data<float>(),
                                               kvw, B, Tq, NH, KV, hd, rows, keys);
      if (s > 0)
        ops::attention_merge_rows<float>(ex, out_ring.data<float>(), lse_ring.data<float>(),
                                         part.data<float>(), part_lse.data<float>(), B, Tq, NH, hd);
    }
  };
  const auto ring_backward = [&] {
    for (int s = 0; s < a.cp; ++s) {
      float* d = (s == 0 ? dq : part).data<float>();
      const std::vector<cpu::RowRange>& keys = block_keys[static_cast<size_t>(s)];
      const Tensor& block = blocks[static_cast<size_t>(s)];
      if (rows16)
        ops::attention_gqa_backward_rows_bf16(ex, d, C, dkv_block.data<float>(),
                                              dout_r.data<float>(), q16.raw(), C, block.raw(), kvw,
                                              out_ring.raw(), DType::kF32, lse_ring.data<float>(),
                                              B, Tq, NH, KV, hd, rows, keys);
      else
        ops::attention_gqa_backward_rows<float>(
            ex, d, C, dkv_block.data<float>(), dout_r.data<float>(), q.data<float>(), C,
            block.data<float>(), kvw, out_ring.data<float>(), lse_ring.data<float>(), B, Tq, NH,
            KV, hd, rows, keys);
      if (s > 0) ops::add_inplace<float>(ex, dq.data<float>(), part.data<float>(), B * Tq * C);
    }
  };

  const double whole_f = best_seconds(device, a.iters, whole_forward);
  const double whole_b = best_seconds(device, a.iters, whole_backward);
  const double rows_f = best_seconds(device, a.iters, rows_forward);
  const double rows_b = best_seconds(device, a.iters, rows_backward);
  const double ring_f = a.cp > 1 ? best_seconds(device, a.iters, ring_forward) : rows_f;
  const double ring_b = a.cp > 1 ? best_seconds(device, a.iters, ring_backward) : rows_b;

  // The rows' output against the whole sequence's rows: the same attention (to the rounding of
  // the whole path's bf16 output, where it has one).
  const std::vector<float> whole_out = out.to(Device::cpu()).to(DType::kF32).to_vector();
  const std::vector<float> mine = out_r.to_vector();
  const std::vector<float> want = rows_of(whole_out, B, T, C, 0, C, rows);
  double max_diff = 0;
  for (size_t i = 0; i < want.size(); ++i)
    max_diff = std::max(max_diff, std::abs(static_cast<double>(mine[i]) - want[i]));
  // The ring's merged output against the gathered rows' (the merge reorders the softmax's sums).
  double ring_diff = 0;
  if (a.cp > 1) {
    const std::vector<float> merged = out_ring.to_vector();
    for (size_t i = 0; i < mine.size(); ++i)
      ring_diff = std::max(ring_diff, std::abs(static_cast<double>(merged[i]) - mine[i]));
  }

  // The masked attention timed last, after the comparisons above read the causal output (it
  // leaves out and lse masked).
  double doc_f = 0, doc_b = 0;
  if (masked) {
    doc_f = best_seconds(device, a.iters, [&] { whole_forward_masked(docs); });
    doc_b = best_seconds(device, a.iters, [&] { whole_backward_masked(docs); });
  }

  // Flops of the causal products: forward S = Q·Kᵀ and O = P·V, 2 each per (query, key, column);
  // backward S again, dV, dP, dK and dQ.
  const double per_pair = static_cast<double>(B * NH * hd);
  const double whole_pairs = pairs_seen(every) * per_pair;
  const double rows_pairs = pairs_seen(rows) * per_pair;
  const auto tflops = [](double flops, double s) { return flops / s * 1e-12; };
  // 1 when the rank's rows take 1/cp of the whole sequence's time.
  const double eff_f = whole_f / a.cp / rows_f, eff_b = whole_b / a.cp / rows_b;
  const char* path = whole16 ? "flash kernels, bf16" : device.is_cuda() ? "batched GEMMs" : "CPU";
  if (a.json) {
    std::printf(
        "{\"device\": \"%s\", \"precision\": \"%s\", \"threads\": %d, \"batch\": %ld, \"seq\": "
        "%ld, \"heads\": %ld, \"kv_heads\": %ld, \"head_dim\": %ld, \"cp\": %d, "
        "\"whole_fwd_ms\": %.3f, \"whole_bwd_ms\": %.3f, \"rows_fwd_ms\": %.3f, "
        "\"rows_bwd_ms\": %.3f, \"whole_fwd_tflops\": %.3f, \"whole_bwd_tflops\": %.3f, "
        "\"rows_fwd_tflops\": %.3f, \"rows_bwd_tflops\": %.3f, \"cp_fwd_efficiency\": %.3f, "
        "\"cp_bwd_efficiency\": %.3f, \"max_diff\": %.3g, \"ring_fwd_ms\": %.3f, "
        "\"ring_bwd_ms\": %.3f, \"ring_fwd_vs_rows\": %.3f, \"ring_bwd_vs_rows\": %.3f, "
        "\"ring_max_diff\": %.3g, \"documents\": %ld, \"window\": %ld, \"doc_fwd_ms\": %.3f, "
        "\"doc_bwd_ms\": %.3f, \"doc_pairs_fraction\": %.4f}\n",
        device.str().c_str(), a.precision.c_str(), a.threads, static_cast<long>(B),
        static_cast<long>(T), static_cast<long>(NH), static_cast<long>(KV), static_cast<long>(hd),
        a.cp, whole_f * 1e3, whole_b * 1e3, rows_f * 1e3, rows_b * 1e3,
        tflops(4 * whole_pairs, whole_f), tflops(10 * whole_pairs, whole_b),
        tflops(4 * rows_pairs, rows_f), tflops(10 * rows_pairs, rows_b), eff_f, eff_b, max_diff,
        ring_f * 1e3, ring_b * 1e3, ring_f / rows_f, ring_b / rows_b, ring_diff,
        static_cast<long>(a.documents), static_cast<long>(a.window), doc_f * 1e3, doc_b * 1e3,
        masked_pairs_per_sequence * per_pair / whole_pairs);
    return 0;
  }
  std::printf("causal attention, B %ld, T %ld, %ld query / %ld key-value heads of %ld, on %s (%s",
              static_cast<long>(B), static_cast<long>(T), static_cast<long>(NH),
              static_cast<long>(KV), static_cast<long>(hd), device.str().c_str(), path);
  if (!device.is_cuda()) std::printf(", %d threads", a.threads);
  std::printf("); best of %d\n", a.iters);
  std::printf("%-34s %12s %12s %14s %14s\n", "", "forward ms", "backward ms", "fwd TFLOP/s",
              "bwd TFLOP/s");
  std::printf("%-34s %12.3f %12.3f %14.3f %14.3f\n", "whole sequence", whole_f * 1e3, whole_b * 1e3,
              tflops(4 * whole_pairs, whole_f), tflops(10 * whole_pairs, whole_b));
  char label[96];
  std::snprintf(label, sizeof label, "cp %d rank 0's rows (%ld of %ld)", a.cp,
                static_cast<long>(Tq), static_cast<long>(T));
  std::printf("%-34s %12.3f %12.3f %14.3f %14.3f\n", label, rows_f * 1e3, rows_b * 1e3,
              tflops(4 * rows_pairs, rows_f), tflops(10 * rows_pairs, rows_b));
  std::printf("cp efficiency (whole / cp / rows; 1 = perfect split): forward %.3f, backward %.3f\n",
              eff_f, eff_b);
  if (a.cp > 1) {
    std::snprintf(label, sizeof label, "the same rows by the ring (%d blocks)", a.cp);
    std::printf("%-34s %12.3f %12.3f %14.3f %14.3f\n", label, ring_f * 1e3, ring_b * 1e3,
                tflops(4 * rows_pairs, ring_f), tflops(10 * rows_pairs, ring_b));
    std::printf("ring / gathered rows (the ring's compute, transfers aside): forward %.3f, "
                "backward %.3f\n",
                ring_f / rows_f, ring_b / rows_b);
  }
  if (masked) {
    if (a.documents > 0 && a.window > 0)
      std::snprintf(label, sizeof label, "whole, documents of %ld, window %ld",
                    static_cast<long>(a.documents), static_cast<long>(a.window));
    else if (a.documents > 0)
      std::snprintf(label, sizeof label, "whole, documents of %ld", static_cast<long>(a.documents));
    else
      std::snprintf(label, sizeof label, "whole, sliding window of %ld",
                    static_cast<long>(a.window));
    const double doc_pairs = masked_pairs_per_sequence * per_pair;
    std::printf("%-34s %12.3f %12.3f %14.3f %14.3f\n", label, doc_f * 1e3, doc_b * 1e3,
                tflops(4 * doc_pairs, doc_f), tflops(10 * doc_pairs, doc_b));
    std::printf("%s: %.3f of the causal pairs; time masked / causal: forward %.3f, backward %.3f\n",
                a.documents > 0 ? "document masking" : "sliding window", doc_pairs / whole_pairs,
                doc_f / whole_f, doc_b / whole_b);
  }
  std::printf("rows' output against the whole sequence's rows: max |difference| %.3g\n", max_diff);
  if (a.cp > 1)
    std::printf("the ring's merged output against the gathered rows': max |difference| %.3g\n",
                ring_diff);
  return 0;
}

}  // namespace loom
