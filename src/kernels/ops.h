// ops — every kernel once, for any device: the same arguments as the CPU kernels (kernels/cpu,
// where each is documented), with an Exec instead of the ThreadPool. On a cpu device they run
// the CPU kernel on ex.pool; on a cuda device the CUDA kernel (kernels/cuda/kernels.h) on that
// GPU, with every pointer in its memory. Real is float or double; double runs on the CPU only
// (gradient checks) and throws loom::Error on a GPU, as does any op on a GPU in a build without
// LOOM_CUDA.
//
// Models and parallel layers call these, never a device's kernels directly, so one module runs
// on either device.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "base/error.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cuda/kernels.h"
#include "kernels/exec.h"
#include "kernels/op_profile.h"
#include "tensor/dtype.h"

namespace loom::ops {

namespace detail {

#ifdef LOOM_WITH_CUDA
inline constexpr bool kCudaBuild = true;
#else
inline constexpr bool kCudaBuild = false;
#endif

// The CUDA kernels are float only; the branch calling them exists only where they do.
template <typename Real>
inline constexpr bool kRunsOnGpu = kCudaBuild&& std::is_same_v<Real, float>;

// True when `op` must run on the GPU; throws when it cannot.
template <typename Real>
bool on_gpu(const Exec& ex, const char* op) {
  if (!ex.device.is_cuda()) return false;
  if constexpr (!kCudaBuild)
    fail(op, " on ", ex.device.str(), ": Loom was built without CUDA (LOOM_CUDA=OFF)");
  else if constexpr (!kRunsOnGpu<Real>)
    fail(op, " on ", ex.device.str(), ": the CUDA kernels compute in f32 only");
  return true;
}

}  // namespace detail

// "fp32", "tf32", "bf16", "fp16" or "fp8": the GEMM input precision of this process, on the GPUs
// (cuda::set_matmul_precision) and, for "bf16" and "fp8", on the CPU too
// (cpu::set_matmul_precision: every float GEMM rounds its operands to bf16, and at fp8 the
// Linears quantize theirs to fp8 first — fp8_block(); the CPU's GEMMs stay fp32 at the others;
// at fp8 the GPUs' GEMMs run at bf16 and their Linears quantize likewise, activations staying
// fp32). Throws naming anything else, or bf16 / fp8 on a CPU without AVX-512.
void set_matmul_precision(const std::string& name);
// set_matmul_precision(name) for a scope; the settings before it come back at its end, so a
// training run or benchmark leaves the process as it found it.
class MatmulPrecisionScope {
 public:
  // fp8_block: runtime.fp8_block, the Linears' quantization block at "fp8".
  explicit MatmulPrecisionScope(const std::string& name, int64_t fp8_block = 128);
  ~MatmulPrecisionScope();
  MatmulPrecisionScope(const MatmulPrecisionScope&) = delete;
  MatmulPrecisionScope& operator=(const MatmulPrecisionScope&) = delete;

 private:
  cpu::CpuMatmulPrecision cpu_before_;
  int64_t fp8_block_before_ = 128;
  cuda::MatmulPrecision cuda_before_ = cuda::MatmulPrecision::kFp32;
};

// The Linears' fp8 quantization block when the process runs at fp8 matmul precision
// (cpu::fp8_block(), for CPU ranks and GPUs alike), else 0 — and then the plain matmul ops apply.
int64_t fp8_block(const Exec& ex);
// Whether a GPU's fp8 Linears run on the E4M3 tensor cores (cuda::set_fp8_tensor_cores; off
// unless LOOM_CUDA_FP8_TENSOR_CORES=1, until checked on a GPU). Without CUDA: nothing, false.
void set_fp8_tensor_cores(bool on);
bool fp8_tensor_cores();
// A Linear's forward and backward with its GEMM operands quantized to fp8 in blocks
// (kernels/cpu/fp8.h): cpu::matmul_forward_fp8 / matmul_backward_fp8, on a GPU
// cuda::matmul_forward_fp8 / matmul_backward_fp8 (the same quantized bits, the bf16 GEMM), timed
// as the plain matmul ops. Fail where fp8_block(ex) is 0.
void matmul_forward_fp8(const Exec& ex, float* out, const float* inp, const float* weight,
                        const float* bias, int64_t N, int64_t C, int64_t OC);
void matmul_backward_fp8(const Exec& ex, float* dinp, float* dweight, float* dbias,
                         const float* dout, const float* inp, const float* weight, int64_t N,
                         int64_t C, int64_t OC);

// The dense GEMM rate of a GPU in TFLOP/s at a precision ("fp32", "tf32", "bf16", "fp16": 16-bit
// operands stored as such, no casts; "fp8": the E4M3 tensor cores' block-scaled GEMM,
// cuda::gemm_fp8), best of `iters` n×n×n products: the peak an MFU is measured against.
double measure_gpu_gemm_tflops(Device device, const std::string& precision, int64_t n, int iters);
// The memory bandwidth of a GPU in GB/s, best of `iters` device-to-device copies of `bytes`
// (each byte read and written): the roofline of the streaming kernels.
double measure_gpu_copy_gbps(Device device, int64_t bytes, int iters);

// A weight as the 16-bit GEMM ops below take it: its fp32 values, which they round to the matmul
// precision at every call, or also a copy of them already rounded to that 16-bit type
// (`rounded`, of `rounded_dtype` = matmul_input_dtype(ex, kF32); nn/rounded_weights.h makes it
// once per optimizer step), which they read instead: a weight read by four GEMMs per micro-batch
// (forward and input gradient, each micro-batch of a step) is cast once a step.
struct GemmWeight {
  GemmWeight(const float* values_) : values(values_) {}  // NOLINT(google-explicit-constructor)
  GemmWeight(const float* values_, const void* rounded_, DType rounded_dtype_)
      : values(values_), rounded(rounded_), rounded_dtype(rounded_dtype_) {}
  const float* values;
  const void* rounded = nullptr;
  DType rounded_dtype = DType::kF32;
};
// weight's n values rounded into `out` (n values of `dtype` = matmul_input_dtype(ex, kF32), 16-bit,
// else it fails): the copy a GemmWeight carries.
void round_weight(const Exec& ex, void* out, DType dtype, const float* weight, int64_t n);
// An activation's n values rounded into `out` as a GEMM would round them (the same bits as the
// 16-bit ops below round an f32 input to): for an input kept, or sent, rounded before the GEMM
// that reads it (a sequence-parallel Linear's rows, parallel/tensor_parallel_linear.h).
void round_for_matmul(const Exec& ex, void* out, DType dtype, const float* in, int64_t n);
// How many times the ops below were given a weight's copy (process-wide, since the start): for
// the tests that show the copies are read.
int64_t weight_copy_reads();

// nn::Linear's input on a GPU at bf16 / fp16 matmul precision: rounded once in the forward and
// kept in that 16-bit type instead of fp32 for the backward's weight-gradient GEMM, which then
// needs no cast of its own (and the kept input takes half the bytes). matmul_input_dtype is the
// type a Linear of a `dtype` model keeps its input in on ex's device: DType::kBF16 / kF16 there,
// else `dtype` itself, and the plain matmul ops below apply.
DType matmul_input_dtype(const Exec& ex, DType dtype);
// matmul_forward (f32) that also leaves inp rounded in `inp_rounded`: N·C values of
// matmul_input_dtype(ex, kF32), which must be 16-bit. With a `residual`, matmul_forward_adding.
void matmul_forward_keeping_rounded_input(const Exec& ex, float* out, void* inp_rounded,
                                          const float* inp, GemmWeight weight, const float* bias,
                                          int64_t N, int64_t C, int64_t OC,
                                          const float* residual = nullptr);
// matmul_forward (f32) on an input already rounded (of type `inp_dtype`) by one of the producers
// below; kept as it is for the backward. With a `residual`, matmul_forward_adding.
void matmul_forward_from_rounded_input(const Exec& ex, float* out, const void* inp, DType inp_dtype,
                                       GemmWeight weight, const float* bias, int64_t N, int64_t C,
                                       int64_t OC, const float* residual = nullptr);
// matmul_forward writing `out` in 16 bits (`out_dtype` = matmul_input_dtype(ex, kF32)), its bias
// rounded to that type too (cuda::matmul_forward_rounded_output): an output only 16-bit readers
// take (qkv for the flash kernels: attention_takes_rounded_qkv). `inp` is rounded already
// (`inp_dtype` 16-bit), or f32 (kF32) and then rounded into `inp_rounded` (N·C values of
// out_dtype) for the backward; `inp_rounded` is unused otherwise.
void matmul_forward_rounded_output(const Exec& ex, void* out, DType out_dtype, const void* inp,
                                   DType inp_dtype, void* inp_rounded, GemmWeight weight,
                                   const float* bias, int64_t N, int64_t C, int64_t OC);
// The MLP's fc and GELU on a GPU at bf16 / fp16 (cuda::matmul_forward_gelu): pre = inp·Wᵀ + bias
// and gelu_out = GELU(pre), N·OC values each of `dtype` = matmul_input_dtype(ex, kF32), 16-bit,
// with the GELU in the GEMM's epilogue. `inp` as for matmul_forward_rounded_output.
void matmul_forward_gelu(const Exec& ex, void* gelu_out, void* pre, DType dtype, const void* inp,
                         DType inp_dtype, void* inp_rounded, GemmWeight weight, const float* bias,
                         int64_t N, int64_t C, int64_t OC);
// The backward of the Linear after it (the MLP's proj, its input `inp` that gelu_out): dweight
// and dbias as matmul_backward, and in place of its dinp dpre = GELU'(pre) ⊙ (dout·W), the
// gradient at the GELU's input, N·C values of `dtype` (cuda::matmul_backward_into_gelu) — fc's
// rounded dout (matmul_backward_from_rounded).
void matmul_backward_into_gelu(const Exec& ex, void* dpre, DType dtype, float* dweight,
                               float* dbias, const float* dout, const void* inp, GemmWeight weight,
                               const void* pre, int64_t N, int64_t C, int64_t OC);
// GELU(pre) of such a 16-bit pre, rounded to `dtype` (gelu_out rebuilt for recomputation, to an
// ulp: the forward's GELU took pre before its rounding).
void gelu_forward_of_rounded(const Exec& ex, void* out, const void* pre, DType dtype, int64_t n);
// LayerNorm forward (f32 in) for an output only a Linear reads: written straight as its rounded
// input, `out_dtype` = matmul_input_dtype(ex, kF32), 16-bit — bit for bit the fp32 output
// rounded, without it in memory.
void layernorm_forward_rounded(const Exec& ex, void* out, DType out_dtype, float* mean, float* rstd,
                               const float* inp, const float* weight, const float* bias, int64_t N,
                               int64_t C);
// matmul_backward (f32) on such a kept input, of type `inp_dtype`.
void matmul_backward_from_rounded_input(const Exec& ex, float* dinp, float* dweight, float* dbias,
                                        const float* dout, const void* inp_rounded, DType inp_dtype,
                                        GemmWeight weight, int64_t N, int64_t C, int64_t OC);

// The attention on a GPU at bf16 / fp16 matmul precision: `out` written as the attention
// projection's rounded input, and the backward on that out writing `dqkv` as the qkv
// projection's rounded dout; both of `dtype` = matmul_input_dtype(ex, kF32), 16-bit
// (cuda::attention_forward_rounded / attention_backward_rounded). `qkv` is f32 (`qkv_dtype`
// kF32), or of `dtype` where attention_takes_rounded_qkv says so; `dout` likewise f32, or (with
// such a qkv) of `dtype` as matmul_backward_rounded_dinp writes it.
void attention_forward_rounded(const Exec& ex, void* out, DType dtype, float* lse, const void* qkv,
                               DType qkv_dtype, int64_t B, int64_t T, int64_t C, int64_t NH,
                               cpu::DocumentStarts docs = {});
void attention_backward_rounded(const Exec& ex, void* dqkv, const void* dout, DType dout_dtype,
                                const void* qkv, DType qkv_dtype, const void* out, DType dtype,
                                const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH,
                                cpu::DocumentStarts docs = {});
// Grouped-query attention (attention_gqa_* below) likewise on the compact qkv (B, T,
// (NH + 2·KV)·hd), rotated already: `out` as above, `dqkv` written as the qkv projection's
// rounded dout in `dtype`, each shared head's gradient summed in fp32 and rounded once
// (cuda::attention_gqa_forward_rounded / attention_gqa_backward_rounded). `qkv` 16-bit where
// attention_takes_rounded_qkv(ex, NH·hd, NH, B), and `dout` with it.
void attention_gqa_forward_rounded(const Exec& ex, void* out, DType dtype, float* lse,
                                   const void* qkv, DType qkv_dtype, int64_t B, int64_t T,
                                   int64_t NH, int64_t KV, int64_t hd,
                                   cpu::DocumentStarts docs = {});
void attention_gqa_backward_rounded(const Exec& ex, void* dqkv, const void* dout, DType dout_dtype,
                                    const void* qkv, DType qkv_dtype, const void* out, DType dtype,
                                    const float* lse, int64_t B, int64_t T, int64_t NH, int64_t KV,
                                    int64_t hd, cpu::DocumentStarts docs = {});
// The rotary embedding in place on a 16-bit qkv (its gradient) of `dtype` = matmul_input_dtype(ex,
// kF32): the qkv projection's rounded output for the flash kernels, the gradient above. Each
// pair turned in fp32 and rounded once; cos_sin f32 (cuda::rope_forward_rounded).
void rope_forward_rounded(const Exec& ex, void* qkv, DType dtype, const float* cos_sin, int64_t B,
                          int64_t T, int64_t NH, int64_t KV, int64_t hd);
void rope_backward_rounded(const Exec& ex, void* dqkv, DType dtype, const float* cos_sin, int64_t B,
                           int64_t T, int64_t NH, int64_t KV, int64_t hd);
// SwiGLU on 16-bit activations of `dtype` = matmul_input_dtype(ex, kF32): h the fc's rounded
// output (matmul_forward_rounded_output), out proj's rounded input; dout proj's rounded dinp
// (matmul_backward_rounded_dinp), dh fc's rounded dout (matmul_backward_from_rounded). In fp32,
// rounded once (cuda::swiglu_forward_rounded).
// `act`: the gate's activation (GeGLU's with kGeluTanh).
void swiglu_forward_rounded(const Exec& ex, void* out, const void* h, DType dtype, int64_t N,
                            int64_t H, GatedActivation act = GatedActivation::kSilu);
void swiglu_backward_rounded(const Exec& ex, void* dh, const void* dout, const void* h, DType dtype,
                             int64_t N, int64_t H, GatedActivation act = GatedActivation::kSilu);
// RMSNorm forward (f32 in) for an output only a Linear reads, as layernorm_forward_rounded: bit
// for bit the fp32 output rounded.
void rmsnorm_forward_rounded(const Exec& ex, void* out, DType out_dtype, float* rstd,
                             const float* inp, const float* weight, int64_t N, int64_t C,
                             double eps);
// Whether the attention above takes qkv in 16 bits (the qkv projection's rounded output) for
// these sizes: on a GPU whose fused flash kernels apply (bf16, head size 64 or 128); never on a CPU.
bool attention_takes_rounded_qkv(const Exec& ex, int64_t C, int64_t NH, int64_t B);
// matmul_backward (f32) writing dinp in 16 bits, `dinp_dtype` = matmul_input_dtype(ex, kF32)
// (cuda::matmul_backward_rounded_dinp): the attention projection's, dO for the flash kernels
// where attention_takes_rounded_qkv. `inp` as matmul_backward_from_rounded's.
// In these 16-bit backward ops dinp (dpre) = nullptr computes the weight's gradients alone, and
// dweight = dbias = nullptr the input's alone: a zero-bubble schedule's W and B, each bit for bit
// its half of the combined op (nn/deferred_weight_grads.h).
void matmul_backward_rounded_dinp(const Exec& ex, void* dinp, DType dinp_dtype, float* dweight,
                                  float* dbias, const float* dout, const void* inp, DType inp_dtype,
                                  GemmWeight weight, int64_t N, int64_t C, int64_t OC);
// matmul_backward (f32) with dout rounded already, of 16-bit `dtype`, and inp too (`inp_dtype`
// that dtype) or f32 (kF32: an input restored for recomputation as it came).
void matmul_backward_from_rounded(const Exec& ex, float* dinp, float* dweight, float* dbias,
                                  const void* dout, DType dtype, const void* inp, DType inp_dtype,
                                  GemmWeight weight, int64_t N, int64_t C, int64_t OC);

// The LM head on a GPU at bf16 / fp16 matmul precision, its logits kept in that 16-bit type
// (`logits_dtype` = matmul_input_dtype(ex, kF32), N × V values): the forward writes them from the
// head's GEMM and takes their cross-entropy (losses, lse); the backward turns them into their
// gradient in place and runs the GEMMs (cuda::lm_head_forward_rounded_logits). Elsewhere a model
// keeps fp32 logits: matmul_forward, cross_entropy_forward and lm_head_backward. dweight = nullptr
// leaves the head's weight gradient for later (a zero-bubble schedule's B), which
// matmul_backward_from_rounded then takes from the logits' gradient (left in `logits`) and inp.
void lm_head_forward_rounded_logits(const Exec& ex, float* losses, float* lse, void* logits,
                                    DType logits_dtype, const float* inp, GemmWeight weight,
                                    const int32_t* targets, int64_t N, int64_t C, int64_t V);
void lm_head_backward_from_rounded_logits(const Exec& ex, float* dinp, float* dweight, void* logits,
                                          DType logits_dtype, const float* lse,
                                          const int32_t* targets, float dloss, const float* inp,
                                          GemmWeight weight, int64_t N, int64_t C, int64_t V,
                                          float z_loss = 0);

// AdamW over runs of the same flat buffers (kernels/adamw_factors.h), each element what
// adamw_update computes with `weight_decay` where a run's decay is set: on a GPU one launch for all
// of them, reading `runs_on_gpu`, a copy of `runs` in its memory; on the CPU the runs in turn.
void adamw_update_runs(const Exec& ex, float* values, const float* grads, float* m, float* v,
                       const std::vector<AdamWRun>& runs, const AdamWRun* runs_on_gpu, double lr,
                       double beta1, double beta2, double eps, double weight_decay, int64_t step,
                       float grad_scale);

namespace detail {
// An op's work for the profile (kernels/op_profile.h): `flops`, and `elements` of its operands
// read or written once each, in Real's size (4-byte token ids count as one).
struct OpCounts {
  double flops = 0, elements = 0;
};
template <typename Real>
OpWork work_of(OpCounts c) {
  return {c.flops, c.elements * static_cast<double>(sizeof(Real))};
}
template <typename Real>
OpWork work_of(double flops, double elements) {
  return work_of<Real>(OpCounts{flops, elements});
}
// The Linear's (shared with the kept-rounded-input variants in ops.cc).
inline OpCounts matmul_forward_counts(int64_t N, int64_t C, int64_t OC, bool bias,
                                      bool residual = false) {
  return {2.0 * N * C * OC,
          1.0 * N * C + 1.0 * OC * C + (residual ? 2.0 : 1.0) * N * OC + (bias ? OC : 0)};
}
// Without dweight (dweight = false), only the input gradient's GEMM; without dinp, only the weight
// gradient's (the two halves a zero-bubble pipeline schedule runs apart: linear_backward_input,
// linear_backward_weight).
inline OpCounts matmul_backward_counts(int64_t N, int64_t C, int64_t OC, bool dinp, bool dbias,
                                       bool dweight = true) {
  return {((dinp ? 2.0 : 0.0) + (dweight ? 2.0 : 0.0)) * N * C * OC,
          1.0 * N * OC + (dinp ? 1.0 * N * C + 1.0 * OC * C : 0.0) +
              (dweight ? 1.0 * N * C + 2.0 * OC * C : 0.0) + (dbias ? 2.0 * OC : 0.0)};
}
// matmul_backward's, plus the GELU's input h.
inline OpCounts matmul_backward_before_gelu_counts(int64_t N, int64_t C, int64_t OC, bool dinp,
                                                   bool dbias) {
  OpCounts c = matmul_backward_counts(N, C, OC, dinp, dbias);
  c.elements += 1.0 * N * OC;
  return c;
}
}  // namespace detail

// The body of every op: the CUDA kernel on a GPU, else the CPU kernel on the pool, timed while a
// profile runs (kernels/op_profile.h) with its work, `work` = (flops, elements), counted from its
// arguments.
#define LOOM_OPS_DISPATCH(name, work, ...)                                                   \
  const detail::OpScope op_scope_(#name, ex, [&] { return detail::work_of<Real> work; });    \
  if (detail::on_gpu<Real>(ex, #name)) {                                                     \
    if constexpr (detail::kRunsOnGpu<Real>) return cuda::name(ex.device.index, __VA_ARGS__); \
  }                                                                                          \
  return cpu::name(*ex.pool, __VA_ARGS__)

// LOOM_OPS_DISPATCH for an op that takes token ids: the CUDA kernel also gets ex.ids_checked
// (kernels/exec.h), whether it may skip its own check of them.
#define LOOM_OPS_DISPATCH_IDS(name, work, ...)                                              \
  const detail::OpScope op_scope_(#name, ex, [&] { return detail::work_of<Real> work; });    \
  if (detail::on_gpu<Real>(ex, #name)) {                                                     \
    if constexpr (detail::kRunsOnGpu<Real>)                                                  \
      return cuda::name(ex.device.index, __VA_ARGS__, ex.ids_checked);                       \
  }                                                                                          \
  return cpu::name(*ex.pool, __VA_ARGS__)

template <typename Real>
inline void matmul_forward(const Exec& ex, Real* out, const Real* inp, const Real* weight,
                           const Real* bias, int64_t N, int64_t C, int64_t OC) {
  LOOM_OPS_DISPATCH(matmul_forward, (detail::matmul_forward_counts(N, C, OC, bias != nullptr)), out,
                    inp, weight, bias, N, C, OC);
}

template <typename Real>
inline void matmul_backward(const Exec& ex, Real* dinp, Real* dweight, Real* dbias,
                            const Real* dout, const Real* inp, const Real* weight, int64_t N,
                            int64_t C, int64_t OC) {
  LOOM_OPS_DISPATCH(matmul_backward,
                    (detail::matmul_backward_counts(N, C, OC, dinp != nullptr, dbias != nullptr,
                                                    dweight != nullptr)),
                    dinp, dweight, dbias, dout, inp, weight, N, C, OC);
}

// Gradients communicated in bf16 (parallel.grad_reduce_dtype; cpu/elementwise.h): n floats
// rounded to bf16 bits, bf16 bits widened, and widened then added into fp32.
inline void round_to_bf16(const Exec& ex, uint16_t* out, const float* in, int64_t n) {
  using Real = float;
  LOOM_OPS_DISPATCH(round_to_bf16, (0, 1.5 * n), out, in, n);
}
inline void widen_bf16(const Exec& ex, float* out, const uint16_t* in, int64_t n) {
  using Real = float;
  LOOM_OPS_DISPATCH(widen_bf16, (0, 1.5 * n), out, in, n);
}
inline void add_widened_bf16(const Exec& ex, float* acc, const uint16_t* in, int64_t n) {
  using Real = float;
  LOOM_OPS_DISPATCH(add_widened_bf16, (0, 2.5 * n), acc, in, n);
}

template <typename Real>
inline void add_forward(const Exec& ex, Real* out, const Real* a, const Real* b, int64_t n) {
  LOOM_OPS_DISPATCH(add_forward, (0, 3.0 * n), out, a, b, n);
}

template <typename Real>
inline void add_inplace(const Exec& ex, Real* acc, const Real* x, int64_t n) {
  LOOM_OPS_DISPATCH(add_inplace, (0, 3.0 * n), acc, x, n);
}

// matmul_forward plus a residual (N × OC): out = inp·Wᵀ + bias + residual, a block's skip
// connection. On a GPU the add happens in the GEMM's epilogue (cuda::matmul_forward_adding:
// rounded once, so within the last bit of the CPU's, which adds after the GEMM).
template <typename Real>
inline void matmul_forward_adding(const Exec& ex, Real* out, const Real* inp, const Real* weight,
                                  const Real* bias, const Real* residual, int64_t N, int64_t C,
                                  int64_t OC) {
  if (detail::on_gpu<Real>(ex, "matmul_forward_adding")) {
    if constexpr (detail::kRunsOnGpu<Real>) {
      const detail::OpScope op_scope_("matmul_forward", ex, [&] {
        return detail::work_of<Real>(
            detail::matmul_forward_counts(N, C, OC, bias != nullptr, true));
      });
      return cuda::matmul_forward_adding(ex.device.index, out, inp, weight, bias, residual, N, C,
                                         OC);
    }
  }
  matmul_forward(ex, out, inp, weight, bias, N, C, OC);
  add_inplace(ex, out, residual, N * OC);
}

template <typename Real>
inline void scale_inplace(const Exec& ex, Real* x, Real s, int64_t n) {
  LOOM_OPS_DISPATCH(scale_inplace, (0, 2.0 * n), x, s, n);
}

template <typename Real>
inline double sum_squares(const Exec& ex, const Real* x, int64_t n) {
  LOOM_OPS_DISPATCH(sum_squares, (0, 1.0 * n), x, n);
}

// The sums of squares of several float arrays, each what sum_squares returns for it; on a GPU the
// host waits once for all of them instead of once each.
inline std::vector<double> sum_squares_each(const Exec& ex, std::span<const float* const> xs,
                                            std::span<const int64_t> ns) {
  std::vector<double> sums(xs.size());
  if constexpr (detail::kRunsOnGpu<float>) {
    if (ex.device.is_cuda()) {
      double work = 0;
      for (int64_t n : ns) work += static_cast<double>(n);
      const detail::OpScope op_scope_("sum_squares", ex,
                                      [&] { return detail::work_of<float>(0, work); });
      cuda::sum_squares_each(ex.device.index, xs, ns, sums.data());
      return sums;
    }
  }
  if (xs.size() != ns.size())
    fail("sum_squares_each: ", xs.size(), " arrays but ", ns.size(), " sizes");
  for (size_t i = 0; i < xs.size(); ++i) sums[i] = sum_squares<float>(ex, xs[i], ns[i]);
  return sums;
}

template <typename Real>
inline double sum(const Exec& ex, const Real* x, int64_t n) {
  LOOM_OPS_DISPATCH(sum, (0, 1.0 * n), x, n);
}

// sum's value written to `result`, a double in ex's device memory (the same bits): on a GPU
// queued, without the wait for the value that sum makes.
template <typename Real>
inline void sum_into(const Exec& ex, const Real* x, int64_t n, double* result) {
  if constexpr (detail::kRunsOnGpu<Real>) {
    if (detail::on_gpu<Real>(ex, "sum_into")) {
      const detail::OpScope op_scope_("sum", ex, [&] { return detail::work_of<Real>(0, 1.0 * n); });
      return cuda::sum_into(ex.device.index, x, n, result);
    }
  }
  *result = sum(ex, x, n);
}

template <typename Real>
inline void gelu_forward(const Exec& ex, Real* out, const Real* inp, int64_t n) {
  LOOM_OPS_DISPATCH(gelu_forward, (0, 2.0 * n), out, inp, n);
}

template <typename Real>
inline void gelu_backward(const Exec& ex, Real* dinp, const Real* inp, const Real* dout,
                          int64_t n) {
  LOOM_OPS_DISPATCH(gelu_backward, (0, 3.0 * n), dinp, inp, dout, n);
}

// matmul_backward of a Linear whose output h (N × OC) went into a GELU, the MLP's fc, from
// `dgelu`, the gradient at the GELU's output: gelu_backward in place over dgelu (scratch
// afterwards), then matmul_backward. On a GPU one op (cuda::matmul_backward_before_gelu) with the
// same results: the GELU's input gradient and the bias gradient come from one pass, written
// straight as the GEMMs' operand.
template <typename Real>
inline void matmul_backward_before_gelu(const Exec& ex, Real* dinp, Real* dweight, Real* dbias,
                                        Real* dgelu, const Real* h, const Real* inp,
                                        const Real* weight, int64_t N, int64_t C, int64_t OC) {
  if (detail::on_gpu<Real>(ex, "matmul_backward_before_gelu")) {
    if constexpr (detail::kRunsOnGpu<Real>) {
      const detail::OpScope op_scope_("matmul_backward_before_gelu", ex, [&] {
        return detail::work_of<Real>(detail::matmul_backward_before_gelu_counts(
            N, C, OC, dinp != nullptr, dbias != nullptr));
      });
      return cuda::matmul_backward_before_gelu(ex.device.index, dinp, dweight, dbias, dgelu, h, inp,
                                               weight, N, C, OC);
    }
  }
  gelu_backward(ex, dgelu, h, dgelu, N * OC);
  matmul_backward(ex, dinp, dweight, dbias, dgelu, inp, weight, N, C, OC);
}

template <typename Real>
inline void layernorm_forward(const Exec& ex, Real* out, Real* mean, Real* rstd, const Real* inp,
                              const Real* weight, const Real* bias, int64_t N, int64_t C) {
  LOOM_OPS_DISPATCH(layernorm_forward, (0, 2.0 * N * C + 2.0 * C + 2.0 * N), out, mean, rstd, inp,
                    weight, bias, N, C);
}

template <typename Real>
inline void layernorm_backward(const Exec& ex, Real* dinp, Real* dweight, Real* dbias,
                               const Real* dout, const Real* inp, const Real* weight,
                               const Real* mean, const Real* rstd, int64_t N, int64_t C) {
  LOOM_OPS_DISPATCH(layernorm_backward, (0, 3.0 * N * C + 5.0 * C + 2.0 * N), dinp, dweight, dbias,
                    dout, inp, weight, mean, rstd, N, C);
}

// layernorm_backward with the gradient of the skip connection around the LayerNorm's branch
// added: dinp = the LayerNorm's input gradient + dresidual (N × C). On a GPU one kernel
// (cuda::layernorm_backward_adding), bit for bit the two ops; the CPU runs the two.
template <typename Real>
inline void layernorm_backward_adding(const Exec& ex, Real* dinp, Real* dweight, Real* dbias,
                                      const Real* dout, const Real* inp, const Real* weight,
                                      const Real* mean, const Real* rstd, const Real* dresidual,
                                      int64_t N, int64_t C) {
  if (detail::on_gpu<Real>(ex, "layernorm_backward_adding")) {
    if constexpr (detail::kRunsOnGpu<Real>) {
      const detail::OpScope op_scope_("layernorm_backward", ex, [&] {
        return detail::work_of<Real>(0, 4.0 * N * C + 5.0 * C + 2.0 * N);
      });
      return cuda::layernorm_backward_adding(ex.device.index, dinp, dweight, dbias, dout, inp,
                                             weight, mean, rstd, dresidual, N, C);
    }
  }
  layernorm_backward(ex, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  add_inplace(ex, dinp, dresidual, N * C);
}

template <typename Real>
inline void rmsnorm_forward(const Exec& ex, Real* out, Real* rstd, const Real* inp,
                            const Real* weight, int64_t N, int64_t C, double eps) {
  LOOM_OPS_DISPATCH(rmsnorm_forward, (0, 2.0 * N * C + 1.0 * C + 1.0 * N), out, rstd, inp, weight,
                    N, C, eps);
}

template <typename Real>
inline void rmsnorm_backward(const Exec& ex, Real* dinp, Real* dweight, const Real* dout,
                             const Real* inp, const Real* weight, const Real* rstd, int64_t N,
                             int64_t C) {
  LOOM_OPS_DISPATCH(rmsnorm_backward, (0, 3.0 * N * C + 3.0 * C + 1.0 * N), dinp, dweight, dout,
                    inp, weight, rstd, N, C);
}

// rmsnorm_backward with the gradient of the skip connection around the RMSNorm's branch added:
// dinp = the RMSNorm's input gradient + dresidual (N × C). On a GPU one kernel
// (cuda::rmsnorm_backward_adding), bit for bit the two ops; the CPU runs the two.
template <typename Real>
inline void rmsnorm_backward_adding(const Exec& ex, Real* dinp, Real* dweight, const Real* dout,
                                    const Real* inp, const Real* weight, const Real* rstd,
                                    const Real* dresidual, int64_t N, int64_t C) {
  if (detail::on_gpu<Real>(ex, "rmsnorm_backward_adding")) {
    if constexpr (detail::kRunsOnGpu<Real>) {
      const detail::OpScope op_scope_("rmsnorm_backward", ex, [&] {
        return detail::work_of<Real>(0, 4.0 * N * C + 3.0 * C + 1.0 * N);
      });
      return cuda::rmsnorm_backward_adding(ex.device.index, dinp, dweight, dout, inp, weight, rstd,
                                           dresidual, N, C);
    }
  }
  rmsnorm_backward(ex, dinp, dweight, dout, inp, weight, rstd, N, C);
  add_inplace(ex, dinp, dresidual, N * C);
}

// An RMSNorm whose rows a tensor-parallel group splits (cpu/rmsnorm.h): a rank's partial sums,
// and its C columns of the forward and backward given the group's sums over C_full columns.
template <typename Real>
inline void rmsnorm_partial_sums(const Exec& ex, Real* sums, const Real* a, const Real* b,
                                 const Real* weight, int64_t N, int64_t C) {
  LOOM_OPS_DISPATCH(rmsnorm_partial_sums, (0, (weight ? 3.0 : 2.0) * N * C), sums, a, b, weight, N,
                    C);
}
template <typename Real>
inline void rmsnorm_forward_of_sums(const Exec& ex, Real* out, Real* rstd, const Real* sums,
                                    const Real* inp, const Real* weight, int64_t N, int64_t C,
                                    int64_t C_full, double eps) {
  LOOM_OPS_DISPATCH(rmsnorm_forward_of_sums, (0, 2.0 * N * C + 1.0 * C + 2.0 * N), out, rstd, sums,
                    inp, weight, N, C, C_full, eps);
}
template <typename Real>
inline void rmsnorm_backward_of_dots(const Exec& ex, Real* dinp, Real* dweight, const Real* dout,
                                     const Real* inp, const Real* weight, const Real* rstd,
                                     const Real* dots, int64_t N, int64_t C, int64_t C_full) {
  LOOM_OPS_DISPATCH(rmsnorm_backward_of_dots, (0, 3.0 * N * C + 3.0 * C + 2.0 * N), dinp, dweight,
                    dout, inp, weight, rstd, dots, N, C, C_full);
}

// Rotary position embedding and grouped-query attention's head sharing (kernels/cpu/rope.h),
// between the qkv projection and attention_forward; cos_sin is cpu::rope_table's, on ex's device.
template <typename Real>
inline void rope_gqa_forward(const Exec& ex, Real* out, const Real* qkv, const Real* cos_sin,
                             int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  LOOM_OPS_DISPATCH(rope_gqa_forward,
                    (0, 1.0 * B * T * (NH + 2 * KV) * hd + 3.0 * B * T * NH * hd + 1.0 * T * hd),
                    out, qkv, cos_sin, B, T, NH, KV, hd);
}

template <typename Real>
inline void rope_gqa_backward(const Exec& ex, Real* dqkv, const Real* dout, const Real* cos_sin,
                              int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  LOOM_OPS_DISPATCH(rope_gqa_backward,
                    (0, 3.0 * B * T * NH * hd + 1.0 * B * T * (NH + 2 * KV) * hd + 1.0 * T * hd),
                    dqkv, dout, cos_sin, B, T, NH, KV, hd);
}

// The rotation in place on the compact qkv's query and key heads, and back (kernels/cpu/rope.h):
// for attention_gqa_*, which read the shared key/value heads where the projection wrote them.
template <typename Real>
inline void rope_forward(const Exec& ex, Real* qkv, const Real* cos_sin, int64_t B, int64_t T,
                         int64_t NH, int64_t KV, int64_t hd) {
  LOOM_OPS_DISPATCH(rope_forward, (0, 2.0 * B * T * (NH + KV) * hd + 1.0 * T * hd), qkv, cos_sin,
                    B, T, NH, KV, hd);
}

template <typename Real>
inline void rope_backward(const Exec& ex, Real* dqkv, const Real* cos_sin, int64_t B, int64_t T,
                          int64_t NH, int64_t KV, int64_t hd) {
  LOOM_OPS_DISPATCH(rope_backward, (0, 2.0 * B * T * (NH + KV) * hd + 1.0 * T * hd), dqkv,
                    cos_sin, B, T, NH, KV, hd);
}

// Grouped-query attention on the compact qkv (kernels/cpu/attention.h): attention_forward /
// backward with query head h reading key/value head h / (NH/KV) in place. On a GPU the shared
// heads are repeated into scratch for the attention kernels and their gradients summed back
// (cuda::attention_gqa_*): nothing repeated is kept between the forward and the backward.
template <typename Real>
inline void attention_gqa_forward(const Exec& ex, Real* out, Real* lse, const Real* qkv, int64_t B,
                                  int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                  cpu::DocumentStarts docs = {}) {
  LOOM_OPS_DISPATCH(attention_gqa_forward,
                    (2.0 * B * T * T * NH * hd,
                     1.0 * B * T * (NH + 2 * KV) * hd + 1.0 * B * T * NH * hd + 1.0 * B * NH * T),
                    out, lse, qkv, B, T, NH, KV, hd, docs);
}

template <typename Real>
inline void attention_gqa_backward(const Exec& ex, Real* dqkv, const Real* dout, const Real* qkv,
                                   const Real* out, const Real* lse, int64_t B, int64_t T,
                                   int64_t NH, int64_t KV, int64_t hd,
                                   cpu::DocumentStarts docs = {}) {
  LOOM_OPS_DISPATCH(attention_gqa_backward,
                    (5.0 * B * T * T * NH * hd,
                     2.0 * B * T * (NH + 2 * KV) * hd + 3.0 * B * T * NH * hd + 1.0 * B * NH * T),
                    dqkv, dout, qkv, out, lse, B, T, NH, KV, hd, docs);
}

// A mixture of experts (kernels/cpu/moe.h): routing, an expert's rows gathered and scattered
// back weighed, the routing weights' and the router's gradients.
template <typename Real>
inline void moe_route(const Exec& ex, Real* probs, int32_t* choice, Real* weight, Real* lse,
                      const Real* logits, int64_t N, int64_t E, int64_t K,
                      const MoeRouting& routing = {}) {
  LOOM_OPS_DISPATCH(moe_route, (4.0 * N * E, 2.0 * N * E + 2.0 * N * K + N), probs, choice, weight,
                    lse, logits, N, E, K, routing);
}
template <typename Real>
inline void moe_prob_sums(const Exec& ex, double* sums, const Real* probs, int64_t B, int64_t T,
                          int64_t E, bool sigmoid = false) {
  LOOM_OPS_DISPATCH(moe_prob_sums, (1.0 * B * T * E, 1.0 * B * T * E), sums, probs, B, T, E,
                    sigmoid);
}
// out (n rows) = in's rows `rows`, row_bytes each: activations of any float type.
inline void gather_rows(const Exec& ex, void* out, const void* in, const int32_t* rows, int64_t n,
                        int64_t row_bytes) {
  using Real = float;  // for the dispatch: a GPU takes the CUDA kernel, whatever the rows hold
  LOOM_OPS_DISPATCH(gather_rows, (0, 0.5 * n * row_bytes / 2), out, in, rows, n, row_bytes);
}
template <typename Real>
inline void moe_scatter_add(const Exec& ex, Real* y, const Real* src, const int32_t* rows,
                            const int32_t* slots, const Real* weight, int64_t n, int64_t C,
                            int64_t K) {
  LOOM_OPS_DISPATCH(moe_scatter_add, (2.0 * n * C, 3.0 * n * C), y, src, rows, slots, weight, n, C,
                    K);
}
template <typename Real>
inline void moe_expert_output_grad(const Exec& ex, Real* g, Real* dweight, const Real* out,
                                   const int32_t* rows, const int32_t* slots, const Real* weight,
                                   int64_t n, int64_t C, int64_t K) {
  LOOM_OPS_DISPATCH(moe_expert_output_grad, (3.0 * n * C, 3.0 * n * C), g, dweight, out, rows,
                    slots, weight, n, C, K);
}
template <typename Real>
inline void moe_router_backward(const Exec& ex, Real* dlogits, const Real* probs,
                                const int32_t* choice, const Real* weight, const Real* dweight,
                                const double* balance, const Real* lse, double z, int64_t B,
                                int64_t T, int64_t E, int64_t K, bool sigmoid = false,
                                double scale = 1, bool normalize = true) {
  LOOM_OPS_DISPATCH(moe_router_backward, (6.0 * B * T * E, 2.0 * B * T * E), dlogits, probs, choice,
                    weight, dweight, balance, lse, z, B, T, E, K, sigmoid, scale, normalize);
}

// SwiGLU (kernels/cpu/swiglu.h): h (N, 2H) = [gate | up] from the fused projection, out (N, H);
// with act = kGeluTanh GeGLU.
template <typename Real>
inline void swiglu_forward(const Exec& ex, Real* out, const Real* h, int64_t N, int64_t H,
                           GatedActivation act = GatedActivation::kSilu) {
  LOOM_OPS_DISPATCH(swiglu_forward, (0, 3.0 * N * H), out, h, N, H, act);
}

template <typename Real>
inline void swiglu_backward(const Exec& ex, Real* dh, const Real* dout, const Real* h, int64_t N,
                            int64_t H, GatedActivation act = GatedActivation::kSilu) {
  LOOM_OPS_DISPATCH(swiglu_backward, (0, 5.0 * N * H), dh, dout, h, N, H, act);
}

template <typename Real>
inline void embedding_forward(const Exec& ex, Real* out, const int32_t* tokens, const Real* wte,
                              const Real* wpe, int64_t B, int64_t T, int64_t C, int64_t V) {
  LOOM_OPS_DISPATCH_IDS(embedding_forward,
                        (0, 2.0 * B * T * C + (wpe != nullptr ? 1.0 * T * C : 0.0) + 1.0 * B * T),
                        out, tokens, wte, wpe, B, T, C, V);
}

template <typename Real>
inline void embedding_backward(const Exec& ex, Real* dwte, Real* dwpe, const Real* dout,
                               const int32_t* tokens, int64_t B, int64_t T, int64_t C) {
  LOOM_OPS_DISPATCH(embedding_backward,
                    (0, 3.0 * B * T * C + (dwpe != nullptr ? 2.0 * T * C : 0.0) + 1.0 * B * T),
                    dwte, dwpe, dout, tokens, B, T, C);
}

// data.reset_position_ids: each token's place in its document (cpu::document_positions), and the
// position table's rows at those places added to the embedding (cpu::add_rows_by_id).
void document_positions(const Exec& ex, int32_t* ids, const int32_t* starts, const int32_t* global,
                        int64_t B, int64_t Tl, int64_t T);
// A sliding window in a table of first visible positions (cpu::window_starts; starts null: the
// window alone).
void window_starts(const Exec& ex, int32_t* out, const int32_t* starts, int64_t B, int64_t T,
                   int64_t window);

template <typename Real>
inline void add_rows_by_id(const Exec& ex, Real* out, const Real* table, const int32_t* ids,
                           int64_t N, int64_t C) {
  LOOM_OPS_DISPATCH(add_rows_by_id, (0, 3.0 * N * C + 1.0 * N), out, table, ids, N, C);
}

template <typename Real>
inline void attention_forward(const Exec& ex, Real* out, Real* lse, const Real* qkv, int64_t B,
                              int64_t T, int64_t C, int64_t NH, cpu::DocumentStarts docs = {}) {
  LOOM_OPS_DISPATCH(attention_forward, (2.0 * B * T * T * C, 4.0 * B * T * C + 1.0 * B * NH * T),
                    out, lse, qkv, B, T, C, NH, docs);
}

template <typename Real>
inline void attention_backward(const Exec& ex, Real* dqkv, const Real* dout, const Real* qkv,
                               const Real* out, const Real* lse, int64_t B, int64_t T, int64_t C,
                               int64_t NH, cpu::DocumentStarts docs = {}) {
  LOOM_OPS_DISPATCH(attention_backward, (5.0 * B * T * T * C, 8.0 * B * T * C + 1.0 * B * NH * T),
                    dqkv, dout, qkv, out, lse, B, T, C, NH, docs);
}

template <typename Real>
inline void cross_entropy_forward(const Exec& ex, Real* losses, Real* lse, const Real* logits,
                                  const int32_t* targets, int64_t N, int64_t V) {
  LOOM_OPS_DISPATCH_IDS(cross_entropy_forward, (0, 1.0 * N * V + 3.0 * N), losses, lse, logits,
                        targets, N, V);
}

template <typename Real>
inline void cross_entropy_backward(const Exec& ex, Real* dlogits, const Real* logits,
                                   const Real* lse, const int32_t* targets, Real dloss, int64_t N,
                                   int64_t V, float z_loss = 0) {
  LOOM_OPS_DISPATCH(cross_entropy_backward, (0, 2.0 * N * V + 2.0 * N), dlogits, logits, lse,
                    targets, dloss, N, V, z_loss);
}

// N times the mean z-loss term, Σ lse² over the rows that count (cpu::lse_square_sum), into
// *result on ex's device: on a GPU queued, read with a step's losses (nn/step_losses.h). f32.
template <typename Real>
inline void lse_square_sum(const Exec& ex, double* result, const Real* lse, const Real* sum,
                           const int32_t* targets, int64_t N) {
  LOOM_OPS_DISPATCH(lse_square_sum, (0, 2.0 * N), result, lse, sum, targets, N);
}

template <typename Real>
inline void lm_head_backward(const Exec& ex, Real* dinp, Real* dweight, Real* logits,
                             const Real* lse, const int32_t* targets, Real dloss, const Real* inp,
                             const Real* weight, int64_t N, int64_t C, int64_t V,
                             float z_loss = 0) {
  LOOM_OPS_DISPATCH(lm_head_backward,
                    (4.0 * N * C * V, 1.0 * N * V + 2.0 * N * C + 3.0 * V * C + 2.0 * N), dinp,
                    dweight, logits, lse, targets, dloss, inp, weight, N, C, V, z_loss);
}

template <typename Real>
inline void adamw_update(const Exec& ex, Real* param, const Real* grad, Real* m, Real* v, int64_t n,
                         double lr, double beta1, double beta2, double eps, double weight_decay,
                         int64_t step, Real grad_scale = Real(1)) {
  LOOM_OPS_DISPATCH(adamw_update, (0, 7.0 * n), param, grad, m, v, n, lr, beta1, beta2, eps,
                    weight_decay, step, grad_scale);
}

// A vocabulary-parallel embedding and LM head (kernels/cpu/vocab_shard.h); f32 (Real = float).
template <typename Real>
inline void vocab_shard_embedding_forward(const Exec& ex, Real* out, const int32_t* tokens,
                                          const Real* wte, const Real* wpe, int64_t N, int64_t T,
                                          int64_t C, const VocabShard& shard, bool add_positions) {
  LOOM_OPS_DISPATCH_IDS(vocab_shard_embedding_forward, (0, 2.0 * N * T * C + 1.0 * N * T), out,
                        tokens, wte, wpe, N, T, C, shard, add_positions);
}

template <typename Real>
inline void vocab_shard_embedding_backward(const Exec& ex, Real* dwte, Real* dwpe, const Real* dout,
                                           const int32_t* tokens, int64_t N, int64_t T, int64_t C,
                                           const VocabShard& shard) {
  LOOM_OPS_DISPATCH(vocab_shard_embedding_backward, (0, 3.0 * N * T * C + 1.0 * N * T), dwte, dwpe,
                    dout, tokens, N, T, C, shard);
}

template <typename Real>
inline void vocab_shard_logit_max(const Exec& ex, Real* max, Real* target_logit, const Real* logits,
                                  const int32_t* targets, int64_t N, const VocabShard& shard) {
  LOOM_OPS_DISPATCH(vocab_shard_logit_max, (0, 1.0 * N * shard.rows + 3.0 * N), max, target_logit,
                    logits, targets, N, shard);
}

// N times the mean loss of the rows (the group's sum, max and target logit; rows whose target is
// kIgnoredTarget count 0) into *result, on ex's device: on a GPU queued, read with a step's
// losses (nn/step_losses.h).
template <typename Real>
inline void vocab_shard_loss_sum(const Exec& ex, double* result, const Real* sum, const Real* max,
                                 const Real* target_logit, const int32_t* targets, int64_t N) {
  LOOM_OPS_DISPATCH(vocab_shard_loss_sum, (0, 3.0 * N), result, sum, max, target_logit, targets, N);
}

template <typename Real>
inline void vocab_shard_sum_exp(const Exec& ex, Real* sum, const Real* logits, const Real* max,
                                int64_t N, const VocabShard& shard) {
  LOOM_OPS_DISPATCH(vocab_shard_sum_exp, (0, 1.0 * N * shard.rows + 2.0 * N), sum, logits, max, N,
                    shard);
}

template <typename Real>
inline void vocab_shard_cross_entropy_backward(const Exec& ex, Real* logits, const Real* max,
                                               const Real* sum, const int32_t* targets, Real k,
                                               int64_t N, const VocabShard& shard,
                                               float z_loss = 0) {
  LOOM_OPS_DISPATCH(vocab_shard_cross_entropy_backward, (0, 2.0 * N * shard.rows + 3.0 * N), logits,
                    max, sum, targets, k, N, shard, z_loss);
}

// The vocabulary-parallel head's cross-entropy on a GPU at bf16 / fp16 matmul precision, its
// logits kept as the head's GEMM wrote them, 16-bit (`dtype` = matmul_input_dtype(ex, kF32):
// matmul_forward_rounded_output): vocab_shard_logit_max, _sum_exp and _cross_entropy_backward on
// those values, widened; the backward writes the logits' gradient over them in `dtype`, the
// operand of the head's backward GEMMs (matmul_backward_from_rounded). Elsewhere the head keeps
// fp32 logits and takes the ops above.
void vocab_shard_logit_max_rounded(const Exec& ex, float* max, float* target_logit,
                                   const void* logits, DType dtype, const int32_t* targets,
                                   int64_t N, const VocabShard& shard);
void vocab_shard_sum_exp_rounded(const Exec& ex, float* sum, const void* logits, DType dtype,
                                 const float* max, int64_t N, const VocabShard& shard);
void vocab_shard_cross_entropy_backward_rounded(const Exec& ex, void* logits, DType dtype,
                                                const float* max, const float* sum,
                                                const int32_t* targets, float k, int64_t N,
                                                const VocabShard& shard, float z_loss = 0);

// A Linear layer's GEMMs (nn::Linear, the tensor-parallel Linears; never the LM head): the
// matmul ops above — with a `residual`, matmul_forward_adding; with a `gelu_input` h, the
// backward from dgelu (overwritten) through the GELU, matmul_backward_before_gelu — or, where the
// process runs at fp8 (fp8_block(ex) > 0, float), the same with the GEMM operands quantized to fp8
// (matmul_forward_fp8 / matmul_backward_fp8; the GELU and the residual stay fp32).
template <typename Real>
inline void linear_forward(const Exec& ex, Real* out, const Real* inp, const Real* weight,
                           const Real* bias, const Real* residual, int64_t N, int64_t C,
                           int64_t OC) {
  if constexpr (std::is_same_v<Real, float>) {
    if (fp8_block(ex) > 0) {
      matmul_forward_fp8(ex, out, inp, weight, bias, N, C, OC);
      if (residual != nullptr) add_inplace(ex, out, residual, N * OC);
      return;
    }
  }
  if (residual != nullptr)
    matmul_forward_adding(ex, out, inp, weight, bias, residual, N, C, OC);
  else
    matmul_forward(ex, out, inp, weight, bias, N, C, OC);
}

// dweight = nullptr (and dbias = nullptr) computes dinp alone, dinp = nullptr the weight's
// gradients alone: see linear_backward_input / linear_backward_weight.
template <typename Real>
inline void linear_backward(const Exec& ex, Real* dinp, Real* dweight, Real* dbias, Real* dout,
                            const Real* gelu_input, const Real* inp, const Real* weight, int64_t N,
                            int64_t C, int64_t OC) {
  if constexpr (std::is_same_v<Real, float>) {
    if (fp8_block(ex) > 0) {
      if (gelu_input != nullptr) gelu_backward(ex, dout, gelu_input, dout, N * OC);
      matmul_backward_fp8(ex, dinp, dweight, dbias, dout, inp, weight, N, C, OC);
      return;
    }
  }
  if (gelu_input != nullptr && dweight != nullptr) {
    matmul_backward_before_gelu(ex, dinp, dweight, dbias, dout, gelu_input, inp, weight, N, C, OC);
    return;
  }
  // (Without the weight's GEMM the GPU's fused GELU-and-GEMMs op has nothing to fuse with.)
  if (gelu_input != nullptr) gelu_backward(ex, dout, gelu_input, dout, N * OC);
  matmul_backward(ex, dinp, dweight, dbias, dout, inp, weight, N, C, OC);
}

// linear_backward in two halves, for a zero-bubble pipeline schedule (parallel/
// pipeline_schedule.h), which runs the weight gradients after the input gradient has gone on to
// the previous stage: linear_backward_input writes dinp (through the GELU when gelu_input is
// given, dout overwritten by the gradient at the GELU's input as in linear_backward); later,
// linear_backward_weight accumulates dweight and dbias from that dout and the layer's input. The
// same GEMMs as linear_backward, so on CPU ranks bit for bit its results.
template <typename Real>
inline void linear_backward_input(const Exec& ex, Real* dinp, Real* dout, const Real* gelu_input,
                                  const Real* weight, int64_t N, int64_t C, int64_t OC) {
  LOOM_CHECK(dinp != nullptr);
  linear_backward<Real>(ex, dinp, nullptr, nullptr, dout, gelu_input, nullptr, weight, N, C, OC);
}
template <typename Real>
inline void linear_backward_weight(const Exec& ex, Real* dweight, Real* dbias, Real* dout,
                                   const Real* inp, int64_t N, int64_t C, int64_t OC) {
  LOOM_CHECK(dweight != nullptr);
  linear_backward<Real>(ex, nullptr, dweight, dbias, dout, nullptr, inp, nullptr, N, C, OC);
}

// Attention of n new query rows over a key/value cache (kernels/cpu/attention_cache.h): the
// incremental decoding of sampling, which runs on CPU ranks only; a GPU is refused by name.
template <typename Real>
inline void attention_with_cache(const Exec& ex, Real* out, const Real* q, int64_t q_stride,
                                 const Real* k, const Real* v, int64_t first, int64_t n, int64_t C,
                                 int64_t NH, int64_t window = 0) {
  if (ex.device.is_cuda())
    fail("attention_with_cache on ", ex.device.str(), ": decoding with a key/value cache runs on ",
         "the CPU (loom sample)");
  const detail::OpScope op_scope_("attention_forward", ex, [&] {
    return detail::work_of<Real>(4.0 * n * (first + n) * C, 2.0 * (first + n) * C + 2.0 * n * C);
  });
  cpu::attention_with_cache(*ex.pool, out, q, q_stride, k, v, first, n, C, NH, window);
}

// The attention of some query rows over every position's keys and values, or with `keys` over a
// block of them (context parallelism's ring): kernels/cpu/attention.h,
// attention_gqa_forward_rows; cuda::attention_gqa_forward_rows.
template <typename Real>
inline void attention_gqa_forward_rows(const Exec& ex, Real* out, Real* lse, const Real* q,
                                       int64_t ldq, const Real* kv, int64_t ldkv, int64_t B,
                                       int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                       std::span<const cpu::RowRange> rows,
                                       std::span<const cpu::RowRange> keys = {},
                                       cpu::DocumentStarts docs = {}) {
  const int64_t Tq = cpu::rows_in(rows);
  const detail::OpScope op_scope_("attention_gqa_forward_rows", ex, [&] {
    return detail::work_of<Real>(2.0 * B * Tq * T * NH * hd,
                                 1.0 * B * (Tq * NH + 2 * T * KV) * hd + 1.0 * B * Tq * NH * hd);
  });
  if (detail::on_gpu<Real>(ex, "attention_gqa_forward_rows")) {
    if constexpr (detail::kRunsOnGpu<Real>)
      return cuda::attention_gqa_forward_rows(ex.device.index, out, lse, q, ldq, kv, ldkv, B, T, NH,
                                              KV, hd, rows, keys, docs);
  }
  cpu::attention_gqa_forward_rows(*ex.pool, out, lse, q, ldq, kv, ldkv, B, T, NH, KV, hd, rows,
                                  keys, docs);
}

template <typename Real>
inline void attention_gqa_backward_rows(const Exec& ex, Real* dq, int64_t lddq, Real* dkv,
                                        const Real* dout, const Real* q, int64_t ldq,
                                        const Real* kv, int64_t ldkv, const Real* out,
                                        const Real* lse, int64_t B, int64_t T, int64_t NH,
                                        int64_t KV, int64_t hd, std::span<const cpu::RowRange> rows,
                                        std::span<const cpu::RowRange> keys = {},
                                        cpu::DocumentStarts docs = {}) {
  const int64_t Tq = cpu::rows_in(rows);
  const detail::OpScope op_scope_("attention_gqa_backward_rows", ex, [&] {
    return detail::work_of<Real>(5.0 * B * Tq * T * NH * hd,
                                 2.0 * B * (Tq * NH + 2 * T * KV) * hd + 3.0 * B * Tq * NH * hd);
  });
  if (detail::on_gpu<Real>(ex, "attention_gqa_backward_rows")) {
    if constexpr (detail::kRunsOnGpu<Real>)
      return cuda::attention_gqa_backward_rows(ex.device.index, dq, lddq, dkv, dout, q, ldq, kv,
                                               ldkv, out, lse, B, T, NH, KV, hd, rows, keys, docs);
  }
  cpu::attention_gqa_backward_rows(*ex.pool, dq, lddq, dkv, dout, q, ldq, kv, ldkv, out, lse, B, T,
                                   NH, KV, hd, rows, keys, docs);
}

// The ring's merge of two partial attentions of the same rows (cpu::attention_merge_rows;
// cuda::attention_merge_rows).
template <typename Real>
inline void attention_merge_rows(const Exec& ex, Real* out, Real* lse, const Real* part_out,
                                 const Real* part_lse, int64_t B, int64_t Tq, int64_t NH,
                                 int64_t hd) {
  const detail::OpScope op_scope_("attention_merge_rows", ex, [&] {
    return detail::work_of<Real>(4.0 * B * Tq * NH * hd, 3.0 * B * Tq * NH * (hd + 1));
  });
  if (detail::on_gpu<Real>(ex, "attention_merge_rows")) {
    if constexpr (detail::kRunsOnGpu<Real>)
      return cuda::attention_merge_rows(ex.device.index, out, lse, part_out, part_lse, B, Tq, NH,
                                        hd);
  }
  cpu::attention_merge_rows(*ex.pool, out, lse, part_out, part_lse, B, Tq, NH, hd);
}

// Context parallelism on a GPU at bf16 where the flash kernels apply to the rank's query rows
// (bf16 matmuls, head size 64 or 128, at most 8 runs of rows and of keys; never on a CPU): q and
// the gathered keys and values (or the ring's blocks) kept and exchanged as bf16 values
// (DType::kBF16), rounded once from the fp32 qkv by copy_columns_to_bf16 as the flash kernels
// would round them when they load them — the fp32 path's results bit for bit, half the bytes
// (cuda::attention_gqa_*_rows_bf16). out, lse, dout, dq and dkv stay f32; the backward reads out
// (for D = rowsum(dO ∘ O) alone) as f32 or as the 16-bit values proj keeps (out_dtype).
bool attention_rows_take_bf16(const Exec& ex, int64_t NH, int64_t hd, int64_t B,
                              std::span<const cpu::RowRange> rows,
                              std::span<const cpu::RowRange> keys = {});
void copy_columns_to_bf16(const Exec& ex, void* dst, int64_t ld_dst, const float* src,
                          int64_t ld_src, int64_t rows, int64_t width);
// The same from a bf16 qkv (the projection wrote it rounded): copied as they are.
void copy_columns_16(const Exec& ex, void* dst, int64_t ld_dst, const void* src, int64_t ld_src,
                     int64_t rows, int64_t width);
// The forward writes out in f32, or (out_dtype bf16) as the projection's rounded input where no
// merge follows (the all-gather's rows).
void attention_gqa_forward_rows_bf16(const Exec& ex, void* out, DType out_dtype, float* lse,
                                     const void* q, int64_t ldq, const void* kv, int64_t ldkv,
                                     int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                     std::span<const cpu::RowRange> rows,
                                     std::span<const cpu::RowRange> keys = {},
                                     cpu::DocumentStarts docs = {});
void attention_gqa_backward_rows_bf16(const Exec& ex, float* dq, int64_t lddq, float* dkv,
                                      const float* dout, const void* q, int64_t ldq, const void* kv,
                                      int64_t ldkv, const void* out, DType out_dtype,
                                      const float* lse, int64_t B, int64_t T, int64_t NH,
                                      int64_t KV, int64_t hd, std::span<const cpu::RowRange> rows,
                                      std::span<const cpu::RowRange> keys = {},
                                      cpu::DocumentStarts docs = {});

template <typename Real>
inline void copy_columns(const Exec& ex, Real* dst, int64_t ld_dst, const Real* src, int64_t ld_src,
                         int64_t rows, int64_t width) {
  LOOM_OPS_DISPATCH(copy_columns, (0, 2.0 * rows * width), dst, ld_dst, src, ld_src, rows, width);
}

#undef LOOM_OPS_DISPATCH

}  // namespace loom::ops
