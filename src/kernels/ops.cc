#include "kernels/ops.h"

#include <atomic>

#include "device/cuda/cuda_backend.h"

namespace loom::ops {

namespace {
cuda::MatmulPrecision parse_precision(const std::string& name) {
  if (name == "fp32") return cuda::MatmulPrecision::kFp32;
  if (name == "tf32") return cuda::MatmulPrecision::kTf32;
  if (name == "bf16") return cuda::MatmulPrecision::kBf16;
  if (name == "fp16") return cuda::MatmulPrecision::kFp16;
  fail("matmul precision '", name, "': expected fp32, tf32, bf16, fp16 or fp8");
}
}  // namespace

void set_matmul_precision(const std::string& name) {
  if (name == "fp8") {  // the Linears quantize to fp8 (fp8_block), the GEMMs run at bf16
    cpu::set_matmul_precision(cpu::CpuMatmulPrecision::kFp8);
    if constexpr (detail::kCudaBuild) cuda::set_matmul_precision(cuda::MatmulPrecision::kBf16);
    return;
  }
  const cuda::MatmulPrecision precision = parse_precision(name);
  // CPU ranks round GEMM operands at bf16 only (config validation refuses tf32 / fp16 there).
  cpu::set_matmul_precision(precision == cuda::MatmulPrecision::kBf16
                                ? cpu::CpuMatmulPrecision::kBf16
                                : cpu::CpuMatmulPrecision::kFp32);
  if constexpr (detail::kCudaBuild) cuda::set_matmul_precision(precision);
}

MatmulPrecisionScope::MatmulPrecisionScope(const std::string& name, int64_t fp8_block)
    : cpu_before_(cpu::matmul_precision()) {
  if constexpr (detail::kCudaBuild) cuda_before_ = cuda::matmul_precision();
  fp8_block_before_ = cpu::fp8_block_setting();
  try {
    cpu::set_fp8_block(fp8_block);
    set_matmul_precision(name);
  } catch (...) {  // no destructor runs for a constructor that throws: restore here
    cpu::set_fp8_block(fp8_block_before_);
    cpu::set_matmul_precision(cpu_before_);
    if constexpr (detail::kCudaBuild) cuda::set_matmul_precision(cuda_before_);
    throw;
  }
}

MatmulPrecisionScope::~MatmulPrecisionScope() {
  cpu::set_fp8_block(fp8_block_before_);
  cpu::set_matmul_precision(cpu_before_);
  if constexpr (detail::kCudaBuild) cuda::set_matmul_precision(cuda_before_);
}

void set_fp8_tensor_cores(bool on) {
  if constexpr (detail::kCudaBuild) cuda::set_fp8_tensor_cores(on);
}

bool fp8_tensor_cores() {
  if constexpr (detail::kCudaBuild) return cuda::fp8_tensor_cores();
  return false;
}

int64_t fp8_block(const Exec& ex) {
  (void)ex;  // the same setting on CPU ranks and GPUs (set_matmul_precision("fp8"))
  return cpu::fp8_block();
}

void matmul_forward_fp8(const Exec& ex, float* out, const float* inp, const float* weight,
                        const float* bias, int64_t N, int64_t C, int64_t OC) {
  const int64_t block = fp8_block(ex);
  if (block == 0)
    fail("matmul_forward_fp8 on ", ex.device.str(), ": the matmul precision is not fp8");
  const detail::OpScope op_scope_("matmul_forward", ex, [&] {
    return detail::work_of<float>(detail::matmul_forward_counts(N, C, OC, bias != nullptr));
  });
  if (detail::on_gpu<float>(ex, "matmul_forward_fp8")) {
    if constexpr (detail::kCudaBuild)
      cuda::matmul_forward_fp8(ex.device.index, out, inp, weight, bias, N, C, OC, block);
    return;
  }
  cpu::matmul_forward_fp8(*ex.pool, out, inp, weight, bias, N, C, OC, block);
}

void matmul_backward_fp8(const Exec& ex, float* dinp, float* dweight, float* dbias,
                         const float* dout, const float* inp, const float* weight, int64_t N,
                         int64_t C, int64_t OC) {
  const int64_t block = fp8_block(ex);
  if (block == 0)
    fail("matmul_backward_fp8 on ", ex.device.str(), ": the matmul precision is not fp8");
  const detail::OpScope op_scope_("matmul_backward", ex, [&] {
    return detail::work_of<float>(detail::matmul_backward_counts(
        N, C, OC, dinp != nullptr, dbias != nullptr, dweight != nullptr));
  });
  if (detail::on_gpu<float>(ex, "matmul_backward_fp8")) {
    if constexpr (detail::kCudaBuild)
      cuda::matmul_backward_fp8(ex.device.index, dinp, dweight, dbias, dout, inp, weight, N, C, OC,
                                block);
    return;
  }
  cpu::matmul_backward_fp8(*ex.pool, dinp, dweight, dbias, dout, inp, weight, N, C, OC, block);
}

namespace {
// Fails naming `what` unless `device` is a GPU this process can use.
void expect_usable_gpu(Device device, const char* what) {
  if (!device.is_cuda()) fail(what, " on ", device.str(), ": not a GPU");
  if constexpr (detail::kCudaBuild) {
    if (device.index >= cuda::device_count())
      fail(what, " on ", device.str(), ": ", cuda::device_count(), " GPU(s) visible",
           cuda::device_count() == 0 ? " (" + cuda::unavailable_reason() + ")" : std::string());
  } else {
    fail(what, " on ", device.str(), ": Loom was built without CUDA (LOOM_CUDA=OFF)");
  }
}
}  // namespace

double measure_gpu_gemm_tflops(Device device, const std::string& precision, int64_t n, int iters) {
  if (precision == "fp8") {  // the E4M3 tensor cores (cuda::gemm_fp8)
    expect_usable_gpu(device, "GEMM rate");
    if constexpr (detail::kCudaBuild) return cuda::measure_fp8_gemm_tflops(device.index, n, iters);
    return 0;
  }
  const cuda::MatmulPrecision p = parse_precision(precision);
  expect_usable_gpu(device, "GEMM rate");
  if constexpr (detail::kCudaBuild) return cuda::measure_gemm_tflops(device.index, p, n, iters);
  return 0;
}

double measure_gpu_copy_gbps(Device device, int64_t bytes, int iters) {
  expect_usable_gpu(device, "memory bandwidth");
  if constexpr (detail::kCudaBuild) return cuda::measure_copy_gbps(device.index, bytes, iters);
  return 0;
}

namespace {
// The matmul precision a 16-bit operand of Loom dtype `dtype` was rounded for; fails naming `op`
// (on `ex`'s device) for anything else.
cuda::MatmulPrecision rounded_precision(const Exec& ex, DType dtype, const char* op) {
  (void)detail::on_gpu<float>(ex, op);  // a GPU in a build without CUDA: its clear error
  if (ex.device.is_cuda() && dtype == DType::kBF16) return cuda::MatmulPrecision::kBf16;
  if (ex.device.is_cuda() && dtype == DType::kF16) return cuda::MatmulPrecision::kFp16;
  fail(op, " on ", ex.device.str(), ": ", dtype_name(dtype),
       " is not a 16-bit GEMM operand on a GPU");
}

// An operand as the GPU kernels take it: f32 values, or 16-bit values of the matmul precision.
cuda::GemmOperand operand_of(const Exec& ex, const void* data, DType dtype, const char* what) {
  if (dtype == DType::kF32) return cuda::GemmOperand(static_cast<const float*>(data));
  return cuda::GemmOperand(data, rounded_precision(ex, dtype, what));
}

// weight_copy_reads(): the copies weight_operand has handed on.
std::atomic<int64_t> g_weight_copy_reads{0};

// A weight as the GPU's GEMMs take it: its 16-bit copy where the caller has one (of the type
// GEMM inputs are rounded to now, else it fails naming `op`), else its fp32 values.
cuda::GemmOperand weight_operand(const Exec& ex, const GemmWeight& weight, const char* op) {
  if (weight.rounded == nullptr) return cuda::GemmOperand(weight.values);
  g_weight_copy_reads.fetch_add(1, std::memory_order_relaxed);
  if (weight.rounded_dtype != matmul_input_dtype(ex, DType::kF32))
    fail(op, " on ", ex.device.str(), ": a weight rounded to ", dtype_name(weight.rounded_dtype),
         ", but GEMM inputs are ", dtype_name(matmul_input_dtype(ex, DType::kF32)), " here");
  return cuda::GemmOperand(weight.rounded, rounded_precision(ex, weight.rounded_dtype, op));
}

// A forward's input as its GEMM operand: 16-bit values rounded already (`inp_dtype`), or f32
// values rounded here into `inp_rounded` (n values), which the layer keeps for its backward.
cuda::GemmOperand forward_input(const Exec& ex, const void* inp, DType inp_dtype, void* inp_rounded,
                                int64_t n, const char* what) {
  if (inp_dtype != DType::kF32) return operand_of(ex, inp, inp_dtype, what);
  if constexpr (detail::kCudaBuild)
    return cuda::round_for_gemm(ex.device.index, inp_rounded, static_cast<const float*>(inp), n);
  return cuda::GemmOperand(static_cast<const float*>(inp));
}

// Fails naming `op` unless `dtype` is what a GPU rounds GEMM inputs to now.
void expect_rounded_output(const Exec& ex, DType dtype, const char* op) {
  const DType want = matmul_input_dtype(ex, DType::kF32);
  if (want == DType::kF32 || dtype != want)
    fail(op, " on ", ex.device.str(), ": output dtype ", dtype_name(dtype),
         want == DType::kF32 ? std::string(", but GEMM inputs are not rounded to 16 bits there")
                             : ", but GEMM inputs are rounded to " + std::string(dtype_name(want)));
}
}  // namespace

int64_t weight_copy_reads() {
  return g_weight_copy_reads.load(std::memory_order_relaxed);
}

void document_positions(const Exec& ex, int32_t* ids, const int32_t* starts, const int32_t* global,
                        int64_t B, int64_t Tl, int64_t T) {
  const detail::OpScope op_scope_("document_positions", ex, [&] {
    return detail::work_of<int32_t>(0, 2.0 * B * Tl + (global != nullptr ? 1.0 * Tl : 0.0));
  });
  if (detail::on_gpu<float>(ex, "document_positions")) {
    if constexpr (detail::kCudaBuild)
      return cuda::document_positions(ex.device.index, ids, starts, global, B, Tl, T);
  }
  cpu::document_positions(*ex.pool, ids, starts, global, B, Tl, T);
}

void window_starts(const Exec& ex, int32_t* out, const int32_t* starts, int64_t B, int64_t T,
                   int64_t window) {
  const detail::OpScope op_scope_("window_starts", ex, [&] {
    return detail::work_of<int32_t>(0, (starts != nullptr ? 2.0 : 1.0) * B * T);
  });
  if (detail::on_gpu<float>(ex, "window_starts")) {
    if constexpr (detail::kCudaBuild)
      return cuda::window_starts(ex.device.index, out, starts, B, T, window);
  }
  cpu::window_starts(*ex.pool, out, starts, B, T, window);
}

void round_weight(const Exec& ex, void* out, DType dtype, const float* weight, int64_t n) {
  const detail::OpScope op_scope_("round_weight", ex,
                                  [&] { return detail::work_of<float>(0, 1.5 * n); });
  expect_rounded_output(ex, dtype, "round_weight");
  if constexpr (detail::kCudaBuild) (void)cuda::round_for_gemm(ex.device.index, out, weight, n);
}

void round_for_matmul(const Exec& ex, void* out, DType dtype, const float* in, int64_t n) {
  const detail::OpScope op_scope_("round_for_matmul", ex,
                                  [&] { return detail::work_of<float>(0, 1.5 * n); });
  expect_rounded_output(ex, dtype, "round_for_matmul");
  if constexpr (detail::kCudaBuild) (void)cuda::round_for_gemm(ex.device.index, out, in, n);
}

DType matmul_input_dtype(const Exec& ex, DType dtype) {
  if constexpr (detail::kCudaBuild) {
    // At fp8 the Linears quantize fp32 inputs themselves (fp8_block): nothing is kept rounded.
    if (ex.device.is_cuda() && dtype == DType::kF32 && fp8_block(ex) == 0) {
      switch (cuda::matmul_precision()) {
        case cuda::MatmulPrecision::kBf16:
          return DType::kBF16;
        case cuda::MatmulPrecision::kFp16:
          return DType::kF16;
        case cuda::MatmulPrecision::kTf32:
        case cuda::MatmulPrecision::kFp32:
          break;
      }
    }
  }
  return dtype;
}

namespace {
void matmul_forward_on_gpu(const Exec& ex, float* out, cuda::GemmOperand inp,
                           cuda::GemmOperand weight, const float* bias, int64_t N, int64_t C,
                           int64_t OC, const float* residual) {
  if constexpr (detail::kCudaBuild) {
    if (residual != nullptr)
      cuda::matmul_forward_adding(ex.device.index, out, inp, weight, bias, residual, N, C, OC);
    else
      cuda::matmul_forward(ex.device.index, out, inp, weight, bias, N, C, OC);
  }
}
}  // namespace

void matmul_forward_keeping_rounded_input(const Exec& ex, float* out, void* inp_rounded,
                                          const float* inp, GemmWeight weight, const float* bias,
                                          int64_t N, int64_t C, int64_t OC, const float* residual) {
  const cuda::GemmOperand weight_op =
      weight_operand(ex, weight, "matmul_forward_keeping_rounded_input");
  const detail::OpScope op_scope_("matmul_forward", ex, [&] {
    return detail::work_of<float>(
        detail::matmul_forward_counts(N, C, OC, bias != nullptr, residual != nullptr));
  });
  expect_rounded_output(ex, matmul_input_dtype(ex, DType::kF32),
                        "matmul_forward_keeping_rounded_input");
  if constexpr (detail::kCudaBuild) {
    const cuda::GemmOperand kept = cuda::round_for_gemm(ex.device.index, inp_rounded, inp, N * C);
    matmul_forward_on_gpu(ex, out, kept, weight_op, bias, N, C, OC, residual);
  }
}

void matmul_forward_from_rounded_input(const Exec& ex, float* out, const void* inp, DType inp_dtype,
                                       GemmWeight weight, const float* bias, int64_t N, int64_t C,
                                       int64_t OC, const float* residual) {
  const cuda::GemmOperand weight_op =
      weight_operand(ex, weight, "matmul_forward_from_rounded_input");
  const detail::OpScope op_scope_("matmul_forward", ex, [&] {
    return detail::work_of<float>(
        detail::matmul_forward_counts(N, C, OC, bias != nullptr, residual != nullptr));
  });
  const cuda::GemmOperand kept(
      inp, rounded_precision(ex, inp_dtype, "matmul_forward_from_rounded_input"));
  matmul_forward_on_gpu(ex, out, kept, weight_op, bias, N, C, OC, residual);
}

void matmul_forward_rounded_output(const Exec& ex, void* out, DType out_dtype, const void* inp,
                                   DType inp_dtype, void* inp_rounded, GemmWeight weight,
                                   const float* bias, int64_t N, int64_t C, int64_t OC) {
  const cuda::GemmOperand weight_op = weight_operand(ex, weight, "matmul_forward_rounded_output");
  // The 16-bit output is written at half an f32 element's bytes.
  const detail::OpScope op_scope_("matmul_forward", ex, [&] {
    detail::OpCounts c = detail::matmul_forward_counts(N, C, OC, bias != nullptr);
    c.elements -= 0.5 * N * OC;
    return detail::work_of<float>(c);
  });
  expect_rounded_output(ex, out_dtype, "matmul_forward_rounded_output");
  const cuda::GemmOperand operand =
      forward_input(ex, inp, inp_dtype, inp_rounded, N * C, "matmul_forward_rounded_output");
  if constexpr (detail::kCudaBuild)
    cuda::matmul_forward_rounded_output(ex.device.index, out, operand, weight_op, bias, N, C, OC);
}

void matmul_forward_gelu(const Exec& ex, void* gelu_out, void* pre, DType dtype, const void* inp,
                         DType inp_dtype, void* inp_rounded, GemmWeight weight, const float* bias,
                         int64_t N, int64_t C, int64_t OC) {
  const cuda::GemmOperand weight_op = weight_operand(ex, weight, "matmul_forward_gelu");
  // Two 16-bit outputs: an f32 output's bytes.
  const detail::OpScope op_scope_("matmul_forward_gelu", ex, [&] {
    detail::OpCounts c = detail::matmul_forward_counts(N, C, OC, bias != nullptr);
    if (inp_dtype != DType::kF32) c.elements -= 0.5 * N * C;
    return detail::work_of<float>(c);
  });
  expect_rounded_output(ex, dtype, "matmul_forward_gelu");
  const cuda::GemmOperand operand =
      forward_input(ex, inp, inp_dtype, inp_rounded, N * C, "matmul_forward_gelu");
  if constexpr (detail::kCudaBuild)
    cuda::matmul_forward_gelu(ex.device.index, gelu_out, pre, operand, weight_op, bias, N, C, OC);
}

void matmul_backward_into_gelu(const Exec& ex, void* dpre, DType dtype, float* dweight,
                               float* dbias, const float* dout, const void* inp, GemmWeight weight,
                               const void* pre, int64_t N, int64_t C, int64_t OC) {
  const cuda::GemmOperand weight_op = weight_operand(ex, weight, "matmul_backward_into_gelu");
  // matmul_backward's, its dinp and inp in 16 bits, plus pre's 16 bits (read with dpre).
  const detail::OpScope op_scope_("matmul_backward_into_gelu", ex, [&] {
    detail::OpCounts c = detail::matmul_backward_counts(N, C, OC, dpre != nullptr, dbias != nullptr,
                                                        dweight != nullptr);
    if (dweight != nullptr) c.elements -= 0.5 * N * C;
    return detail::work_of<float>(c);
  });
  expect_rounded_output(ex, dtype, "matmul_backward_into_gelu");
  const cuda::GemmOperand kept(inp, rounded_precision(ex, dtype, "matmul_backward_into_gelu"));
  if constexpr (detail::kCudaBuild)
    cuda::matmul_backward_into_gelu(ex.device.index, dpre, dweight, dbias, dout, kept, weight_op,
                                    pre, N, C, OC);
}

void gelu_forward_of_rounded(const Exec& ex, void* out, const void* pre, DType dtype, int64_t n) {
  const detail::OpScope op_scope_("gelu_forward", ex,
                                  [&] { return detail::work_of<float>(0, 1.0 * n); });
  expect_rounded_output(ex, dtype, "gelu_forward_of_rounded");
  if constexpr (detail::kCudaBuild) cuda::gelu_forward_of_rounded(ex.device.index, out, pre, n);
}

void vocab_shard_logit_max_rounded(const Exec& ex, float* max, float* target_logit,
                                   const void* logits, DType dtype, const int32_t* targets,
                                   int64_t N, const VocabShard& shard) {
  const detail::OpScope op_scope_("vocab_shard_logit_max", ex, [&] {
    return detail::work_of<float>(0, 0.5 * N * shard.rows + 3.0 * N);
  });
  expect_rounded_output(ex, dtype, "vocab_shard_logit_max_rounded");
  if constexpr (detail::kCudaBuild)
    cuda::vocab_shard_logit_max_rounded(ex.device.index, max, target_logit, logits, targets, N,
                                        shard);
}

void vocab_shard_sum_exp_rounded(const Exec& ex, float* sum, const void* logits, DType dtype,
                                 const float* max, int64_t N, const VocabShard& shard) {
  const detail::OpScope op_scope_("vocab_shard_sum_exp", ex, [&] {
    return detail::work_of<float>(0, 0.5 * N * shard.rows + 2.0 * N);
  });
  expect_rounded_output(ex, dtype, "vocab_shard_sum_exp_rounded");
  if constexpr (detail::kCudaBuild)
    cuda::vocab_shard_sum_exp_rounded(ex.device.index, sum, logits, max, N, shard);
}

void vocab_shard_cross_entropy_backward_rounded(const Exec& ex, void* logits, DType dtype,
                                                const float* max, const float* sum,
                                                const int32_t* targets, float k, int64_t N,
                                                const VocabShard& shard, float z_loss) {
  const detail::OpScope op_scope_("vocab_shard_cross_entropy_backward", ex, [&] {
    return detail::work_of<float>(0, 1.0 * N * shard.rows + 3.0 * N);
  });
  expect_rounded_output(ex, dtype, "vocab_shard_cross_entropy_backward_rounded");
  if constexpr (detail::kCudaBuild)
    cuda::vocab_shard_cross_entropy_backward_rounded(ex.device.index, logits, max, sum, targets, k,
                                                     N, shard, z_loss);
}

void layernorm_forward_rounded(const Exec& ex, void* out, DType out_dtype, float* mean, float* rstd,
                               const float* inp, const float* weight, const float* bias, int64_t N,
                               int64_t C) {
  const detail::OpScope op_scope_("layernorm_forward", ex, [&] {
    return detail::work_of<float>(0, 1.5 * N * C + 2.0 * C + 2.0 * N);
  });
  expect_rounded_output(ex, out_dtype, "layernorm_forward_rounded");
  if constexpr (detail::kCudaBuild)
    cuda::layernorm_forward_rounded(ex.device.index, out, mean, rstd, inp, weight, bias, N, C);
}

void matmul_backward_from_rounded_input(const Exec& ex, float* dinp, float* dweight, float* dbias,
                                        const float* dout, const void* inp_rounded, DType inp_dtype,
                                        GemmWeight weight, int64_t N, int64_t C, int64_t OC) {
  const cuda::GemmOperand weight_op =
      weight_operand(ex, weight, "matmul_backward_from_rounded_input");
  const detail::OpScope op_scope_("matmul_backward", ex, [&] {
    return detail::work_of<float>(detail::matmul_backward_counts(
        N, C, OC, dinp != nullptr, dbias != nullptr, dweight != nullptr));
  });
  // gemm refuses the operand if the matmul precision changed since it was rounded.
  const cuda::GemmOperand kept(
      inp_rounded, rounded_precision(ex, inp_dtype, "matmul_backward_from_rounded_input"));
  if constexpr (detail::kCudaBuild)
    cuda::matmul_backward(ex.device.index, dinp, dweight, dbias, dout, kept, weight_op, N, C, OC);
}

void adamw_update_runs(const Exec& ex, float* values, const float* grads, float* m, float* v,
                       const std::vector<AdamWRun>& runs, const AdamWRun* runs_on_gpu, double lr,
                       double beta1, double beta2, double eps, double weight_decay, int64_t step,
                       float grad_scale) {
  double elements = 0;
  for (const AdamWRun& r : runs) elements += static_cast<double>(r.numel);
  const detail::OpScope op_scope_("adamw_update", ex,
                                  [&] { return detail::work_of<float>(0, 7.0 * elements); });
  if (detail::on_gpu<float>(ex, "adamw_update")) {
    if (runs.empty()) return;
    if constexpr (detail::kCudaBuild)
      cuda::adamw_update_runs(ex.device.index, values, grads, m, v, runs_on_gpu,
                              static_cast<int64_t>(runs.size()), adamw_chunk_count(runs), lr, beta1,
                              beta2, eps, weight_decay, step, grad_scale);
    return;
  }
  for (const AdamWRun& r : runs)
    cpu::adamw_update<float>(*ex.pool, values + r.value_offset, grads + r.grad_offset,
                             m + r.state_offset, v + r.state_offset, r.numel, lr, beta1, beta2, eps,
                             r.decay != 0 ? weight_decay : 0.0, step, grad_scale);
}

void lm_head_forward_rounded_logits(const Exec& ex, float* losses, float* lse, void* logits,
                                    DType logits_dtype, const float* inp, GemmWeight weight,
                                    const int32_t* targets, int64_t N, int64_t C, int64_t V) {
  const cuda::GemmOperand weight_op = weight_operand(ex, weight, "lm_head_forward_rounded_logits");
  // 16-bit logits written and read once: one fp32 element's bytes per logit.
  const detail::OpScope op_scope_("lm_head_forward", ex, [&] {
    return detail::work_of<float>(2.0 * N * C * V,
                                  1.0 * N * V + 1.0 * N * C + 1.0 * V * C + 3.0 * N);
  });
  expect_rounded_output(ex, logits_dtype, "lm_head_forward_rounded_logits");
  if constexpr (detail::kCudaBuild)
    cuda::lm_head_forward_rounded_logits(ex.device.index, losses, lse, logits, inp, weight_op,
                                         targets, N, C, V, ex.ids_checked);
}

void lm_head_backward_from_rounded_logits(const Exec& ex, float* dinp, float* dweight, void* logits,
                                          DType logits_dtype, const float* lse,
                                          const int32_t* targets, float dloss, const float* inp,
                                          GemmWeight weight, int64_t N, int64_t C, int64_t V,
                                          float z_loss) {
  const cuda::GemmOperand weight_op =
      weight_operand(ex, weight, "lm_head_backward_from_rounded_logits");
  // Without dweight (a zero-bubble schedule's B), the logits' gradient and dinp alone.
  const double weights = dweight != nullptr ? 1.0 : 0.0;
  const detail::OpScope op_scope_("lm_head_backward", ex, [&] {
    return detail::work_of<float>(
        (2.0 + 2.0 * weights) * N * C * V,
        1.0 * N * V + N * C + V * C + weights * (N * C + 2.0 * V * C) + 2.0 * N);
  });
  const cuda::GemmOperand kept(
      logits, rounded_precision(ex, logits_dtype, "lm_head_backward_from_rounded_logits"));
  if constexpr (detail::kCudaBuild) {
    // Refused before the kernel reads them as another type, if the precision changed since.
    kept.expect_usable_at(cuda::matmul_precision(), "logits");
    cuda::lm_head_backward_from_rounded_logits(ex.device.index, dinp, dweight, logits, lse, targets,
                                               dloss, inp, weight_op, N, C, V, z_loss);
  }
}

bool attention_takes_rounded_qkv(const Exec& ex, int64_t C, int64_t NH, int64_t B) {
  if (!ex.device.is_cuda() || matmul_input_dtype(ex, DType::kF32) == DType::kF32) return false;
  if constexpr (detail::kCudaBuild)
    return NH > 0 && C % NH == 0 && cuda::attention_takes_rounded_qkv(C, NH, B);
  return false;
}

bool attention_rows_take_bf16(const Exec& ex, int64_t NH, int64_t hd, int64_t B,
                              std::span<const cpu::RowRange> rows,
                              std::span<const cpu::RowRange> keys) {
  if (!ex.device.is_cuda() || matmul_input_dtype(ex, DType::kF32) != DType::kBF16) return false;
  if constexpr (detail::kCudaBuild) return cuda::attention_rows_take_bf16(NH, hd, B, rows, keys);
  return false;
}

namespace {
void expect_bf16_rows(const Exec& ex, int64_t NH, int64_t hd, int64_t B,
                      std::span<const cpu::RowRange> rows, std::span<const cpu::RowRange> keys,
                      const char* op) {
  if (!attention_rows_take_bf16(ex, NH, hd, B, rows, keys))
    fail(op, " on ", ex.device.str(), ": bf16 queries and keys/values are for a GPU's flash ",
         "kernels at bf16 matmul precision (head size 64 or 128, at most 8 runs of rows and of ",
         "keys)");
}
}  // namespace

void copy_columns_to_bf16(const Exec& ex, void* dst, int64_t ld_dst, const float* src,
                          int64_t ld_src, int64_t rows, int64_t width) {
  const detail::OpScope op_scope_("copy_columns", ex, [&] {
    return detail::work_of<float>(0, 1.5 * rows * width);
  });
  if (!ex.device.is_cuda()) fail("copy_columns_to_bf16 on ", ex.device.str(), ": GPUs only");
  if constexpr (detail::kCudaBuild)
    cuda::copy_columns_to_bf16(ex.device.index, dst, ld_dst, src, ld_src, rows, width);
}

void copy_columns_16(const Exec& ex, void* dst, int64_t ld_dst, const void* src, int64_t ld_src,
                     int64_t rows, int64_t width) {
  const detail::OpScope op_scope_("copy_columns", ex, [&] {
    return detail::work_of<float>(0, 1.0 * rows * width);
  });
  if (!ex.device.is_cuda()) fail("copy_columns_16 on ", ex.device.str(), ": GPUs only");
  if constexpr (detail::kCudaBuild)
    cuda::copy_columns_16(ex.device.index, dst, ld_dst, src, ld_src, rows, width);
}

void attention_gqa_forward_rows_bf16(const Exec& ex, void* out, DType out_dtype, float* lse,
                                     const void* q, int64_t ldq, const void* kv, int64_t ldkv,
                                     int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                     std::span<const cpu::RowRange> rows,
                                     std::span<const cpu::RowRange> keys,
                                     cpu::DocumentStarts docs) {
  const int64_t Tq = cpu::rows_in(rows);
  if (out_dtype != DType::kF32 && out_dtype != DType::kBF16)
    fail("attention_gqa_forward_rows_bf16: out is f32 or bf16, not ", dtype_name(out_dtype));
  const double out_bytes = out_dtype == DType::kBF16 ? 0.5 : 1.0;
  // q and kv (and a bf16 out) at half an f32 element's bytes.
  const detail::OpScope op_scope_("attention_gqa_forward_rows", ex, [&] {
    return detail::work_of<float>(
        2.0 * B * Tq * T * NH * hd,
        0.5 * B * (Tq * NH + 2 * T * KV) * hd + out_bytes * B * Tq * NH * hd);
  });
  expect_bf16_rows(ex, NH, hd, B, rows, keys, "attention_gqa_forward_rows_bf16");
  if constexpr (detail::kCudaBuild)
    cuda::attention_gqa_forward_rows_bf16(ex.device.index, out, out_dtype == DType::kBF16, lse, q,
                                          ldq, kv, ldkv, B, T, NH, KV, hd, rows, keys, docs);
}

void attention_gqa_backward_rows_bf16(const Exec& ex, float* dq, int64_t lddq, float* dkv,
                                      const float* dout, const void* q, int64_t ldq, const void* kv,
                                      int64_t ldkv, const void* out, DType out_dtype,
                                      const float* lse, int64_t B, int64_t T, int64_t NH,
                                      int64_t KV, int64_t hd, std::span<const cpu::RowRange> rows,
                                      std::span<const cpu::RowRange> keys,
                                      cpu::DocumentStarts docs) {
  const int64_t Tq = cpu::rows_in(rows);
  const detail::OpScope op_scope_("attention_gqa_backward_rows", ex, [&] {
    return detail::work_of<float>(5.0 * B * Tq * T * NH * hd,
                                  1.0 * B * (Tq * NH + 2 * T * KV) * hd + 3.0 * B * Tq * NH * hd);
  });
  expect_bf16_rows(ex, NH, hd, B, rows, keys, "attention_gqa_backward_rows_bf16");
  if constexpr (detail::kCudaBuild)
    cuda::attention_gqa_backward_rows_bf16(
        ex.device.index, dq, lddq, dkv, dout, q, ldq, kv, ldkv,
        operand_of(ex, out, out_dtype, "attention_gqa_backward_rows_bf16"), lse, B, T, NH, KV, hd,
        rows, keys, docs);
}

void attention_forward_rounded(const Exec& ex, void* out, DType dtype, float* lse, const void* qkv,
                               DType qkv_dtype, int64_t B, int64_t T, int64_t C, int64_t NH,
                               cpu::DocumentStarts docs) {
  // A 16-bit qkv is read at half an f32 element's bytes.
  const double qkv_elements = (qkv_dtype == DType::kF32 ? 3.0 : 1.5) * B * T * C;
  const detail::OpScope op_scope_("attention_forward", ex, [&] {
    return detail::work_of<float>(2.0 * B * T * T * C,
                                  qkv_elements + 0.5 * B * T * C + 1.0 * B * NH * T);
  });
  expect_rounded_output(ex, dtype, "attention_forward_rounded");
  const cuda::GemmOperand qkv_op = operand_of(ex, qkv, qkv_dtype, "attention_forward_rounded");
  if constexpr (detail::kCudaBuild)
    cuda::attention_forward_rounded(ex.device.index, out, lse, qkv_op, B, T, C, NH, docs);
}

void attention_backward_rounded(const Exec& ex, void* dqkv, const void* dout, DType dout_dtype,
                                const void* qkv, DType qkv_dtype, const void* out, DType dtype,
                                const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH,
                                cpu::DocumentStarts docs) {
  const double qkv_elements = (qkv_dtype == DType::kF32 ? 3.0 : 1.5) * B * T * C;
  const double dout_elements = (dout_dtype == DType::kF32 ? 1.0 : 0.5) * B * T * C;
  const detail::OpScope op_scope_("attention_backward", ex, [&] {
    return detail::work_of<float>(
        5.0 * B * T * T * C, qkv_elements + dout_elements + 2.0 * B * T * C + 1.0 * B * NH * T);
  });
  const cuda::GemmOperand kept(out, rounded_precision(ex, dtype, "attention_backward_rounded"));
  const cuda::GemmOperand qkv_op = operand_of(ex, qkv, qkv_dtype, "attention_backward_rounded");
  const cuda::GemmOperand dout_op = operand_of(ex, dout, dout_dtype, "attention_backward_rounded");
  if constexpr (detail::kCudaBuild)
    cuda::attention_backward_rounded(ex.device.index, dqkv, dout_op, qkv_op, kept, lse, B, T, C, NH,
                                     docs);
}

void rmsnorm_forward_rounded(const Exec& ex, void* out, DType out_dtype, float* rstd,
                             const float* inp, const float* weight, int64_t N, int64_t C,
                             double eps) {
  const detail::OpScope op_scope_("rmsnorm_forward", ex, [&] {
    return detail::work_of<float>(0, 1.5 * N * C + 1.0 * C + 1.0 * N);
  });
  expect_rounded_output(ex, out_dtype, "rmsnorm_forward_rounded");
  if constexpr (detail::kCudaBuild)
    cuda::rmsnorm_forward_rounded(ex.device.index, out, rstd, inp, weight, N, C, eps);
}

namespace {
// rope_forward_rounded (back false) or rope_backward_rounded (back true), timed as `op`.
void rope_rounded(const Exec& ex, const char* op, bool back, void* qkv, DType dtype,
                  const float* cos_sin, int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  const detail::OpScope op_scope_(op, ex, [&] {
    return detail::work_of<float>(0, 1.0 * B * T * (NH + KV) * hd + 1.0 * T * hd);
  });
  expect_rounded_output(ex, dtype, back ? "rope_backward_rounded" : "rope_forward_rounded");
  if constexpr (detail::kCudaBuild) {
    if (back)
      cuda::rope_backward_rounded(ex.device.index, qkv, cos_sin, B, T, NH, KV, hd);
    else
      cuda::rope_forward_rounded(ex.device.index, qkv, cos_sin, B, T, NH, KV, hd);
  }
}
}  // namespace

void rope_forward_rounded(const Exec& ex, void* qkv, DType dtype, const float* cos_sin, int64_t B,
                          int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  rope_rounded(ex, "rope_forward", false, qkv, dtype, cos_sin, B, T, NH, KV, hd);
}

void rope_backward_rounded(const Exec& ex, void* dqkv, DType dtype, const float* cos_sin, int64_t B,
                           int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  rope_rounded(ex, "rope_backward", true, dqkv, dtype, cos_sin, B, T, NH, KV, hd);
}

void swiglu_forward_rounded(const Exec& ex, void* out, const void* h, DType dtype, int64_t N,
                            int64_t H, GatedActivation act) {
  const detail::OpScope op_scope_("swiglu_forward", ex,
                                  [&] { return detail::work_of<float>(0, 1.5 * N * H); });
  expect_rounded_output(ex, dtype, "swiglu_forward_rounded");
  if constexpr (detail::kCudaBuild)
    cuda::swiglu_forward_rounded(ex.device.index, out, h, N, H, act);
}

void swiglu_backward_rounded(const Exec& ex, void* dh, const void* dout, const void* h, DType dtype,
                             int64_t N, int64_t H, GatedActivation act) {
  const detail::OpScope op_scope_("swiglu_backward", ex,
                                  [&] { return detail::work_of<float>(0, 2.5 * N * H); });
  expect_rounded_output(ex, dtype, "swiglu_backward_rounded");
  if constexpr (detail::kCudaBuild)
    cuda::swiglu_backward_rounded(ex.device.index, dh, dout, h, N, H, act);
}

void attention_gqa_forward_rounded(const Exec& ex, void* out, DType dtype, float* lse,
                                   const void* qkv, DType qkv_dtype, int64_t B, int64_t T,
                                   int64_t NH, int64_t KV, int64_t hd, cpu::DocumentStarts docs) {
  // The compact qkv read (16-bit at half an f32 element's bytes), the output written in 16 bits.
  const double qkv_elements = (qkv_dtype == DType::kF32 ? 1.0 : 0.5) * B * T * (NH + 2 * KV) * hd;
  const detail::OpScope op_scope_("attention_gqa_forward", ex, [&] {
    return detail::work_of<float>(2.0 * B * T * T * NH * hd,
                                  qkv_elements + 0.5 * B * T * NH * hd + 1.0 * B * NH * T);
  });
  expect_rounded_output(ex, dtype, "attention_gqa_forward_rounded");
  const cuda::GemmOperand qkv_op =
      operand_of(ex, qkv, qkv_dtype, "attention_gqa_forward_rounded");
  if constexpr (detail::kCudaBuild)
    cuda::attention_gqa_forward_rounded(ex.device.index, out, lse, qkv_op, B, T, NH, KV, hd, docs);
}

void attention_gqa_backward_rounded(const Exec& ex, void* dqkv, const void* dout, DType dout_dtype,
                                    const void* qkv, DType qkv_dtype, const void* out, DType dtype,
                                    const float* lse, int64_t B, int64_t T, int64_t NH, int64_t KV,
                                    int64_t hd, cpu::DocumentStarts docs) {
  const double compact = 1.0 * B * T * (NH + 2 * KV) * hd, C = 1.0 * NH * hd;
  const double qkv_elements = (qkv_dtype == DType::kF32 ? 1.0 : 0.5) * compact;
  const double dout_elements = (dout_dtype == DType::kF32 ? 1.0 : 0.5) * B * T * C;
  const detail::OpScope op_scope_("attention_gqa_backward", ex, [&] {
    return detail::work_of<float>(5.0 * B * T * T * C, qkv_elements + dout_elements +
                                                           0.5 * B * T * C + 0.5 * compact +
                                                           1.0 * B * NH * T);
  });
  const cuda::GemmOperand kept(out,
                               rounded_precision(ex, dtype, "attention_gqa_backward_rounded"));
  const cuda::GemmOperand qkv_op =
      operand_of(ex, qkv, qkv_dtype, "attention_gqa_backward_rounded");
  const cuda::GemmOperand dout_op =
      operand_of(ex, dout, dout_dtype, "attention_gqa_backward_rounded");
  if constexpr (detail::kCudaBuild)
    cuda::attention_gqa_backward_rounded(ex.device.index, dqkv, dout_op, qkv_op, kept, lse, B, T,
                                         NH, KV, hd, docs);
}

void matmul_backward_rounded_dinp(const Exec& ex, void* dinp, DType dinp_dtype, float* dweight,
                                  float* dbias, const float* dout, const void* inp, DType inp_dtype,
                                  GemmWeight weight, int64_t N, int64_t C, int64_t OC) {
  const cuda::GemmOperand weight_op = weight_operand(ex, weight, "matmul_backward_rounded_dinp");
  // The 16-bit dinp is written at half an f32 element's bytes.
  const detail::OpScope op_scope_("matmul_backward", ex, [&] {
    detail::OpCounts c = detail::matmul_backward_counts(N, C, OC, dinp != nullptr, dbias != nullptr,
                                                        dweight != nullptr);
    c.elements -= 0.5 * N * C *
                  ((dinp != nullptr ? 1.0 : 0.0) +
                   (dweight != nullptr && inp_dtype != DType::kF32 ? 1.0 : 0.0));
    return detail::work_of<float>(c);
  });
  expect_rounded_output(ex, dinp_dtype, "matmul_backward_rounded_dinp");
  const cuda::GemmOperand inp_op = operand_of(ex, inp, inp_dtype, "matmul_backward_rounded_dinp");
  if constexpr (detail::kCudaBuild)
    cuda::matmul_backward_rounded_dinp(ex.device.index, dinp, dweight, dbias, dout, inp_op,
                                       weight_op, N, C, OC);
}

void matmul_backward_from_rounded(const Exec& ex, float* dinp, float* dweight, float* dbias,
                                  const void* dout, DType dtype, const void* inp, DType inp_dtype,
                                  GemmWeight weight, int64_t N, int64_t C, int64_t OC) {
  const cuda::GemmOperand weight_op = weight_operand(ex, weight, "matmul_backward_from_rounded");
  const detail::OpScope op_scope_("matmul_backward", ex, [&] {
    return detail::work_of<float>(detail::matmul_backward_counts(
        N, C, OC, dinp != nullptr, dbias != nullptr, dweight != nullptr));
  });
  const cuda::MatmulPrecision precision =
      rounded_precision(ex, dtype, "matmul_backward_from_rounded");
  if (inp_dtype != DType::kF32 && inp_dtype != dtype)
    fail("matmul_backward_from_rounded on ", ex.device.str(), ": input of ", dtype_name(inp_dtype),
         " with a ", dtype_name(dtype), " dout");
  const cuda::GemmOperand inp_operand =
      operand_of(ex, inp, inp_dtype, "matmul_backward_from_rounded");
  if constexpr (detail::kCudaBuild)
    cuda::matmul_backward_from_rounded_dout(ex.device.index, dinp, dweight, dbias,
                                            cuda::GemmOperand(dout, precision), inp_operand,
                                            weight_op, N, C, OC);
}

}  // namespace loom::ops
