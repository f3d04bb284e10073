// All CUDA kernels: the same forward/backward pairs as kernels/cpu (same arguments, same layouts,
// same accumulate-or-overwrite rules), float only, on GPU `device` (a cuda:N index). Plain C++:
// the declarations compile without the CUDA toolkit; the definitions (*.cu) are built only with
// LOOM_CUDA=ON. Call them through kernels/ops.h, which picks the CPU or the GPU by the Device.
//
// Execution model (docs/architecture.md, "CUDA"):
//  - every kernel is enqueued on the legacy default stream of its GPU, the rank's compute stream,
//    and returns at once; the host waits only where it needs a value (sum, sum_squares and
//    sum_squares_each — one wait for many sums —, and the token / target checks, which copy 8
//    bytes back). The nccl communicator's stream waits on
//    this stream with an event before each collective, so communication overlaps the kernels
//    queued after it.
//  - scratch memory (attention scores, partial sums) comes from the GPU's caching allocator;
//    blocks freed while kernels still use them are safe because every kernel runs on the one
//    stream in issue order.
//  - LOOM_CUDA_SYNC=1 synchronises after every kernel, so an illegal address or a failed launch
//    is reported by the call that caused it.
//  - bitwise reproducible: no atomics on floats; every reduction runs in a fixed order that does
//    not depend on timing. Results agree with the CPU kernels to rounding (the GEMMs sum in
//    another order, tanh and exp differ in the last bits), not bit for bit, except AdamW, add,
//    scale and the embedding forward, which perform the same correctly rounded operations.
#pragma once

#include <cstdint>
#include <span>

#include "kernels/adamw_factors.h"    // AdamWRun
#include "kernels/cpu/attention.h"    // RowRange
#include "kernels/cpu/vocab_shard.h"  // VocabShard
#include "kernels/gated_activation.h"
#include "kernels/moe_routing.h"

namespace loom::cuda {

// ---- GEMM (cuBLASLt) ---------------------------------------------------------------------------

// Row-major, as cpu::gemm: C(M×N) = alpha·op(A)·op(B) + beta·C, plus bias (N, broadcast over
// rows) when non-null, in the GEMM's epilogue. batch > 1 runs `batch` independent products whose
// A, B, C start stride_a, stride_b, stride_c elements apart.
struct GemmBatch {
  int64_t count = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
};

// What the GEMMs' inputs are rounded to on the tensor cores; accumulation, weights and GEMM
// outputs stay fp32 (PyTorch's float32_matmul_precision "highest" / "high" / "medium"), except
// the 16-bit outputs asked for by name (gemm_rounded_output, the *_rounded kernels). kFp32 matches
// the CPU to ~1e-6; kTf32 keeps 10 mantissa bits, kBf16 7 (operands are cast to bf16 on the fly,
// ~1e-2), kFp16 10 bits in a narrow range (|x| <= 65504, normal down to 6e-5: operands beyond it
// become ±inf, which is what loss scaling, optim/loss_scaler.h, is for). Process-wide; kFp32 by
// default.
enum class MatmulPrecision { kFp32, kTf32, kBf16, kFp16 };
void set_matmul_precision(MatmulPrecision precision);
MatmulPrecision matmul_precision();
// bf16 and fp16: the precisions whose GEMM operands are stored in 16 bits.
inline bool rounds_to_16_bits(MatmulPrecision precision) {
  return precision == MatmulPrecision::kBf16 || precision == MatmulPrecision::kFp16;
}

// A GEMM operand: fp32 values (rounded to the matmul precision inside gemm, a cast kernel per
// operand per call at bf16 / fp16), or values a RoundedOperand already rounded to bf16 / fp16.
struct GemmOperand {
  GemmOperand(const float* values) : data(values) {}  // NOLINT(google-explicit-constructor)
  GemmOperand(const void* bits, MatmulPrecision precision) : data(bits), rounded_to(precision) {}
  // gemm's check: fails, naming operand `name`, when it was rounded for another precision than
  // the one the GEMM runs at.
  void expect_usable_at(MatmulPrecision precision, const char* name) const;

  const void* data;
  // kFp32: `data` holds floats; kBf16 / kFp16: 16-bit values of that type.
  MatmulPrecision rounded_to = MatmulPrecision::kFp32;
};

// x[0, n) rounded once for several GEMMs at the current matmul precision, which must not change
// while it lives: at bf16 / fp16 a 16-bit copy in scratch memory of GPU `device` (one cast
// kernel; queued like any kernel, freed when this object goes: see Scratch), at fp32 / TF32 x
// itself (cuBLASLt rounds TF32 inside the GEMM). matmul_backward rounds dout once for its two
// GEMMs: at GPT-2 124M, T = 1024, batch 16 that saves ~8 GB of memory traffic per step in the
// blocks' Linears (a read and a cast of 9·N·C values per layer).
class RoundedOperand {
 public:
  RoundedOperand(int device, const float* x, int64_t n);
  // n 16-bit values at the current precision (bf16 or fp16, else it fails), for a kernel that
  // writes its output rounded (bits()) straight into a GEMM operand.
  RoundedOperand(int device, int64_t n);
  ~RoundedOperand();
  RoundedOperand(const RoundedOperand&) = delete;
  RoundedOperand& operator=(const RoundedOperand&) = delete;
  GemmOperand operand() const { return operand_; }
  void* bits() const { return bits_; }

 private:
  void allocate(int64_t n);  // the 16-bit buffer of n values

  int device_;
  size_t bytes_ = 0;  // of the 16-bit copy; 0 when there is none
  void* bits_ = nullptr;
  GemmOperand operand_;
};

// x[0, n) rounded to the current matmul precision (bf16 or fp16, else it fails) into `out`, n
// 16-bit values the caller owns (one kernel, queued): a GEMM operand kept for later GEMMs, as a
// Linear keeps its input for the weight gradient.
GemmOperand round_for_gemm(int device, void* out, const float* x, int64_t n);

void gemm(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb, float beta, float* C, int64_t ldc,
          const float* bias = nullptr, GemmBatch batch = {});

// D (M×N, row stride ldd) = op(A)·op(B) + addend + bias: gemm with its C input distinct from its
// output (cuBLASLt's C and D), so a residual connection's add happens in the GEMM's epilogue
// instead of a pass of its own. addend has D's layout and may be D itself.
void gemm_adding(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                 GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb, const float* addend,
                 float* D, int64_t ldd, const float* bias = nullptr);

// C (M×N, row stride ldc) = op(A)·op(B) (+ bias) written in the current matmul precision's 16-bit
// type (bf16 or fp16, else it fails), fp32 accumulation rounded once: an output only 16-bit
// readers take (the LM head's logits, qkv for the flash kernels), at half the bytes. The bias
// (N values, fp32) is added in the epilogue as cuBLASLt takes it for a 16-bit output, rounded to
// that type itself (as PyTorch's autocast rounds a Linear's bias). Returns C as a GEMM operand.
GemmOperand gemm_rounded_output(int device, bool trans_a, bool trans_b, int64_t M, int64_t N,
                                int64_t K, GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb,
                                void* C, int64_t ldc, const float* bias = nullptr);

// A GELU in the GEMM's epilogue (cuBLASLt GELU_AUX_BIAS and DGELU), at bf16 / fp16 (else it
// fails); D and `pre` are M×N in that 16-bit type with row stride N. gemm_gelu: pre = op(A)·op(B)
// + bias (fp32 bias rounded to the 16-bit type, as gemm_rounded_output takes it) and D =
// GELU(pre), the GELU taken of the fp32 sum before its rounding. gemm_gelu_backward: D =
// GELU'(pre) ⊙ op(A)·op(B), the product in fp32. Both return false, writing nothing, where
// cuBLASLt offers no algorithm for the problem (matmul.cu then runs the GEMM and the GELU apart).
bool gemm_gelu(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
               GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb, void* D, void* pre,
               const float* bias);
bool gemm_gelu_backward(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                        GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb, void* D,
                        const void* pre);
// Whether the Linear-and-GELU ops below put the GELU in the GEMMs' epilogues: unless the
// environment sets LOOM_CUDA_GELU_EPILOGUE=0 (read at each call), which runs them apart, for
// comparing the two on a GPU.
bool gelu_epilogue_enabled();

// Op timing (kernels/op_profile.h): a CUDA event recorded now on GPU `device`'s legacy stream,
// where every kernel runs; and the milliseconds between two of them (waits for `stop`), which
// releases both.
void* record_timing_event(int device);
double elapsed_ms_and_release(void* start, void* stop);

// The GPU's memory bandwidth in GB/s: the best of `iters` device-to-device copies of `bytes`
// (after one warm-up), each byte counted read and written — the roofline the op profile's GB/s
// of the streaming kernels are read against. Checks that the copy arrived.
double measure_copy_gbps(int device, int64_t bytes, int iters);

// The GPU's dense matrix rate at `precision`, in TFLOP/s: the best of `iters` timed n×n×n GEMMs
// (after one warm-up), for MFU figures measured on the machine itself.
double measure_gemm_tflops(int device, MatmulPrecision precision, int64_t n, int iters);
// The same for gemm_fp8 (A in 1 × 128 blocks, B in 128 × 128: DeepSeek-V3's forward); n a
// multiple of 128.
double measure_fp8_gemm_tflops(int device, int64_t n, int iters);

// Linear (cpu/gemm.h). `inp` may come already rounded (round_for_gemm), as nn::Linear keeps it at
// bf16 / fp16 matmul precision, and `weight` too (its copy a training step keeps rounded:
// nn/rounded_weights.h); fp32 operands are cast by each GEMM.
void matmul_forward(int device, float* out, GemmOperand inp, GemmOperand weight, const float* bias,
                    int64_t N, int64_t C, int64_t OC);
// matmul_forward writing `out` in the current matmul precision's 16-bit type (gemm_rounded_output,
// the bias rounded too): the qkv projection's output for the flash kernels.
GemmOperand matmul_forward_rounded_output(int device, void* out, GemmOperand inp,
                                          GemmOperand weight, const float* bias, int64_t N,
                                          int64_t C, int64_t OC);
// matmul_forward plus a residual (N × OC) added in the GEMM's epilogue: out = inp·Wᵀ + bias +
// residual, rounded once (the separate add rounds the GEMM's output first: the two differ in the
// last bit). A block's skip connection (x + proj(...)) without an add over three activations.
void matmul_forward_adding(int device, float* out, GemmOperand inp, GemmOperand weight,
                           const float* bias, const float* residual, int64_t N, int64_t C,
                           int64_t OC);
// At bf16 / fp16 with a bias, the bias gradient's pass over dout also writes dout's rounding
// for the two GEMMs: dout read once, not twice.
void matmul_backward(int device, float* dinp, float* dweight, float* dbias, const float* dout,
                     GemmOperand inp, GemmOperand weight, int64_t N, int64_t C, int64_t OC);
// matmul_backward of a Linear whose output h went into a GELU (the MLP's fc), from `dgelu`, the
// gradient at the GELU's output: gelu_backward then matmul_backward, with dgelu overwritten
// (scratch). One pass over dgelu and h makes the GELU's input gradient, fp32 in place or at
// bf16 / fp16 straight as the GEMMs' rounded operand, and the bias gradient's column sums; bit for
// bit the two ops. At GPT-2 124M, T = 1024, batch 16 (N·OC = 16384 × 3072 per layer) ~7 GB less
// memory traffic per step at bf16 than gelu_backward, a cast and a bias pass, each over fp32.
void matmul_backward_before_gelu(int device, float* dinp, float* dweight, float* dbias,
                                 float* dgelu, const float* h, GemmOperand inp, GemmOperand weight,
                                 int64_t N, int64_t C, int64_t OC);
// The MLP's fc and its GELU at bf16 / fp16 (else it fails): pre (N × OC) = inp·weightᵀ + bias and
// gelu_out = GELU(pre), both written in that 16-bit type — pre kept for the backward, gelu_out as
// proj's input (returned as its operand). One GEMM with the GELU in its epilogue (gemm_gelu);
// where that is off or cuBLASLt has no algorithm for it, the GEMM in fp32 and one pass writing
// both, from the same fp32 sums (bias rounded likewise). At GPT-2 124M, T = 1024, batch 16
// (N·OC = 16384 × 3072 per layer) ~3.6 GB less memory traffic per step than an fp32 fc output
// and a GELU pass over it, and 1.2 GB less memory (pre in 16 bits, not fp32).
GemmOperand matmul_forward_gelu(int device, void* gelu_out, void* pre, GemmOperand inp,
                                GemmOperand weight, const float* bias, int64_t N, int64_t C,
                                int64_t OC);
// matmul_backward of the Linear after that GELU (the MLP's proj: its input `inp` is gelu_out),
// whose input gradient is taken on through the GELU: dpre (N × C, 16-bit) = GELU'(pre) ⊙
// (dout·weight), the gradient at the GELU's input, rounded once — fc's dout, its GEMMs' operand
// (returned). dweight and dbias as matmul_backward. The GELU's gradient in the dinp GEMM's
// epilogue (gemm_gelu_backward), or apart as above: ~4.8 GB less memory traffic per step at that
// shape than an fp32 dinp and a pass over it and an fp32 pre. dpre = nullptr: the weight's
// gradients alone (pre unread), as a zero-bubble schedule's W runs them; dweight and dbias =
// nullptr: dpre alone, its B.
GemmOperand matmul_backward_into_gelu(int device, void* dpre, float* dweight, float* dbias,
                                      const float* dout, GemmOperand inp, GemmOperand weight,
                                      const void* pre, int64_t N, int64_t C, int64_t OC);
// matmul_backward writing dinp in the current matmul precision's 16-bit type (bf16 or fp16, else
// it fails), rounded once from the GEMM's fp32 sums (gemm_rounded_output): a dinp only 16-bit
// readers take — the attention projection's, dO for the flash kernels. Returns it as an operand.
// As matmul_backward_into_gelu, dinp or dweight and dbias may be null (a zero-bubble W, B).
GemmOperand matmul_backward_rounded_dinp(int device, void* dinp, float* dweight, float* dbias,
                                         const float* dout, GemmOperand inp, GemmOperand weight,
                                         int64_t N, int64_t C, int64_t OC);
// matmul_backward on a dout its producer wrote rounded to 16 bits (attention_backward_rounded):
// the bias gradient sums those values, the GEMMs read them as they are.
void matmul_backward_from_rounded_dout(int device, float* dinp, float* dweight, float* dbias,
                                       GemmOperand dout, GemmOperand inp, GemmOperand weight,
                                       int64_t N, int64_t C, int64_t OC);
// matmul_backward's two GEMMs (dinp when non-null, dweight accumulated) on a dout given as an
// operand, possibly already rounded.
void matmul_backward_gemms(int device, float* dinp, float* dweight, GemmOperand dout,
                           GemmOperand inp, GemmOperand weight, int64_t N, int64_t C, int64_t OC);

// fp8 GEMM operands (fp8.cu; runtime.matmul_precision = "fp8"): kernels/cpu/fp8.h's recipe with
// the same bits. quantize_fp8_blocks: each block_rows × block_cols block of `in` (rows × cols,
// row stride ld_in) scaled by the power of two that fits its largest |value| under 448, rounded
// to E4M3 and scaled back into `out` (row stride ld_out; no aliasing); a block of zeros stays
// zeros, one holding an infinity or a NaN is copied. The Linear with its operands so quantized
// in blocks of `block` (inputs and output gradients 1 × block, weights block × block, the weight
// gradient's operands block × 1) on the bf16 GEMM: the matmul precision must be bf16 (else it
// fails); the bias and its gradient stay fp32, dweight and dbias accumulate.
void quantize_fp8_blocks(int device, float* out, int64_t ld_out, const float* in, int64_t ld_in,
                         int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols);
void matmul_forward_fp8(int device, float* out, const float* inp, const float* weight,
                        const float* bias, int64_t N, int64_t C, int64_t OC, int64_t block);
void matmul_backward_fp8(int device, float* dinp, float* dweight, float* dbias, const float* dout,
                         const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC,
                         int64_t block);

// E4M3 operands for the tensor cores' fp8 GEMM (cuBLASLt's block-scaled fp8 on sm_90; fp8.cu,
// gemm.cu): the values quantize_fp8_blocks gives, as E4M3 bytes, with one fp32 scale a block — the
// reciprocal of the power of two the block was multiplied by, so that a value is its byte's E4M3
// value times its block's scale, exactly. Blocks of 128 along the contraction (an operand's
// columns, K): kVec128 one a row and 128 columns (DeepSeek-V3's activations and gradients),
// kBlock128 one a 128 × 128 block (its weights). The scales lie as cuBLASLt's VEC128_32F and
// BLK128x128_32F modes read them — kVec128's rows fastest (scale of row r, column block j at
// r + j·rows), kBlock128's row blocks apart by the column-block count rounded up to 4 (at
// i·round_up(ceil(cols / 128), 4) + j) — as PyTorch's _scaled_mm lays them out for those modes.
// Not checked on a GPU yet: CudaKernelsTest.Fp8TensorCoreGemmIsTheQuantizedOperandsProduct
// compares the GEMM with the product of the dequantized values (bench/gpu/run.sh).
enum class Fp8Scaling { kVec128, kBlock128 };
inline constexpr int64_t kFp8GemmBlock = 128;
struct Fp8Operand {
  const uint8_t* data = nullptr;  // rows × cols E4M3 bytes, row-major, row stride cols
  const float* scales = nullptr;  // fp8_scale_count(rows, cols, scaling) of them
  Fp8Scaling scaling = Fp8Scaling::kVec128;
};
int64_t fp8_scale_count(int64_t rows, int64_t cols, Fp8Scaling scaling);
// The scales' layout: variant 0 is the one above; the others are the alternatives a GPU run tries
// when 0 does not match cuBLASLt's reading, so that one run says which does (v % 2 = 1: kVec128's
// column blocks fastest, at r·ceil(cols / 128) + j; v / 2 = 1: kBlock128's rows unpadded, at
// i·ceil(cols / 128) + j; v / 2 = 2: its row blocks fastest, at i + j·ceil(rows / 128)). For that
// test only; process-wide.
inline constexpr int kFp8ScaleLayouts = 6;
void set_fp8_scale_layout(int variant);
int fp8_scale_layout();
// Index of the scale of the block holding row r, column c.
int64_t fp8_scale_index(int64_t rows, int64_t cols, Fp8Scaling scaling, int64_t r, int64_t c);
// `in` (rows × cols, fp32, row-major) quantized in blocks of `scaling` into E4M3 bytes `out` and
// `scales` (unused padding scales 0): bit for bit quantize_fp8_blocks' values with 1 × 128 or
// 128 × 128 blocks. A block holding an infinity or a NaN is stored as NaNs with scale 1 (its
// product must not pass for finite: the loss scaler skips the step).
// With `transposed`, the operand is inᵀ: `in` stored cols × rows, the operand's (r, c) at
// in[c·rows + r] (the weight gradient's operands, blocked along the tokens).
void quantize_e4m3(int device, uint8_t* out, float* scales, const float* in, int64_t rows,
                   int64_t cols, Fp8Scaling scaling, bool transposed = false);
// C (M × N, fp32, row-major, row stride N) = A · Bᵀ on the fp8 tensor cores: A (M × K) scaled
// kVec128, B (N × K) either way; K a multiple of 16. The products of E4M3 values are exact and
// summed in fp32 (cuBLASLt's accumulation, not its fast one), so C is the dequantized operands'
// product up to the order of the sums. The CUDA emulator sums them in double.
void gemm_fp8(int device, int64_t M, int64_t N, int64_t K, const Fp8Operand& A, const Fp8Operand& B,
              float* C);
// Whether matmul_forward_fp8 / matmul_backward_fp8 run on the E4M3 tensor cores (gemm_fp8, at
// fp8_block = 128 with every dimension a multiple of 16) instead of the bf16 GEMM on the
// quantized values: the same products, summed in another order. Off unless set or
// LOOM_CUDA_FP8_TENSOR_CORES=1 is in the environment, until a GPU run has checked cuBLASLt's
// reading of the scales (CudaKernelsTest.Fp8TensorCoreGemmIsTheQuantizedOperandsProduct).
void set_fp8_tensor_cores(bool on);
bool fp8_tensor_cores();
// gemm_fp8's argument checks (fails naming what is wrong).
void expect_fp8_gemm_shapes(int64_t M, int64_t N, int64_t K, const Fp8Operand& A);

// ---- elementwise and reductions ----------------------------------------------------------------

void add_forward(int device, float* out, const float* a, const float* b, int64_t n);
void add_inplace(int device, float* acc, const float* x, int64_t n);
void scale_inplace(int device, float* x, float s, int64_t n);
// cpu/elementwise.h's bf16 conversions for gradients communicated in bf16 (`out` / `in`: bf16
// bits), __float2bfloat16_rn: to nearest even.
void round_to_bf16(int device, uint16_t* out, const float* in, int64_t n);
void widen_bf16(int device, float* out, const uint16_t* in, int64_t n);
void add_widened_bf16(int device, float* acc, const uint16_t* in, int64_t n);
// Σ x² and Σ x in double, in a fixed order (a fixed grid, then the blocks' sums in block order).
// Wait for the GPU: the value comes back to the host.
double sum_squares(int device, const float* x, int64_t n);
// sums[i] = sum_squares(device, xs[i], ns[i]) for every i, each to the same bits, with one wait
// for all of them instead of one each (a gradient norm over many parameters or ranges).
void sum_squares_each(int device, std::span<const float* const> xs, std::span<const int64_t> ns,
                      double* sums);
double sum(int device, const float* x, int64_t n);
// sum's value written to `result`, a double in device memory, queued: no wait (a micro-batch's
// loss, read with the step's others at its end).
void sum_into(int device, const float* x, int64_t n, double* result);

void gelu_forward(int device, float* out, const float* inp, int64_t n);
// GELU(pre) of n 16-bit values in the current matmul precision's type (bf16 or fp16, else it
// fails; matmul_forward_gelu's pre), rounded to that type: its gelu_out rebuilt for selective
// recomputation — to an ulp: the forward took the GELU of the sum before its rounding.
GemmOperand gelu_forward_of_rounded(int device, void* out, const void* pre, int64_t n);
void gelu_backward(int device, float* dinp, const float* inp, const float* dout, int64_t n);

// ---- layers ------------------------------------------------------------------------------------

void layernorm_forward(int device, float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int64_t N, int64_t C);
// layernorm_forward writing its output as the next GEMM's operand: N·C values rounded to the
// current matmul precision's 16-bit type (bf16 or fp16, else it fails), bit for bit
// round_for_gemm(layernorm_forward(...)), without the fp32 output in memory.
GemmOperand layernorm_forward_rounded(int device, void* out, float* mean, float* rstd,
                                      const float* inp, const float* weight, const float* bias,
                                      int64_t N, int64_t C);
void layernorm_backward(int device, float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int64_t N, int64_t C);
// layernorm_backward with dresidual (N × C) added to dinp in the same kernel: the gradient of the
// skip connection around a pre-norm block's branch. Bit for bit layernorm_backward then
// add_inplace(dinp, dresidual), without the add's pass over three activations.
void layernorm_backward_adding(int device, float* dinp, float* dweight, float* dbias,
                               const float* dout, const float* inp, const float* weight,
                               const float* mean, const float* rstd, const float* dresidual,
                               int64_t N, int64_t C);

// RMSNorm (cpu/rmsnorm.h): a warp per row, dweight as fixed-order column sums.
void rmsnorm_forward(int device, float* out, float* rstd, const float* inp, const float* weight,
                     int64_t N, int64_t C, double eps);
// rmsnorm_forward writing its output as the next GEMM's operand (as layernorm_forward_rounded):
// N·C values rounded to the current matmul precision's 16-bit type (bf16 or fp16, else it
// fails), bit for bit round_for_gemm(rmsnorm_forward(...)).
GemmOperand rmsnorm_forward_rounded(int device, void* out, float* rstd, const float* inp,
                                    const float* weight, int64_t N, int64_t C, double eps);
void rmsnorm_backward(int device, float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C);
// rmsnorm_backward with dresidual (N × C) added to dinp in the same kernel (the skip connection
// around a pre-norm branch): bit for bit rmsnorm_backward then add_inplace(dinp, dresidual).
void rmsnorm_backward_adding(int device, float* dinp, float* dweight, const float* dout,
                             const float* inp, const float* weight, const float* rstd,
                             const float* dresidual, int64_t N, int64_t C);
// An RMSNorm's rows split over a tensor-parallel group (cpu/rmsnorm.h): the rank's partial
// sums, a warp a row, and the forward and backward given the group's sums of them.
void rmsnorm_partial_sums(int device, float* sums, const float* a, const float* b,
                          const float* weight, int64_t N, int64_t C);
void rmsnorm_forward_of_sums(int device, float* out, float* rstd, const float* sums,
                             const float* inp, const float* weight, int64_t N, int64_t C,
                             int64_t C_full, double eps);
void rmsnorm_backward_of_dots(int device, float* dinp, float* dweight, const float* dout,
                              const float* inp, const float* weight, const float* rstd,
                              const float* dots, int64_t N, int64_t C, int64_t C_full);

// Rotary position embedding with grouped-query attention's head sharing (cpu/rope.h); cos_sin
// (T, hd) is cpu::rope_table's, copied to the GPU. The backward sums a shared key/value head's
// gradients in ascending query head, as the CPU does: one thread per output element, no atomics.
void rope_gqa_forward(int device, float* out, const float* qkv, const float* cos_sin, int64_t B,
                      int64_t T, int64_t NH, int64_t KV, int64_t hd);
void rope_gqa_backward(int device, float* dqkv, const float* dout, const float* cos_sin, int64_t B,
                       int64_t T, int64_t NH, int64_t KV, int64_t hd);
// The rotary embedding in place on qkv (B, T, (NH + 2·KV)·hd)'s NH query and KV key heads, the
// value heads untouched (cpu/rope.h's rotation, cos_sin as above): one thread per rotation pair.
// The backward turns dqkv's query and key heads back in place (dx[i] = dy[i]·c + dy[i+hd/2]·s,
// dx[i+hd/2] = dy[i+hd/2]·c − dy[i]·s).
void rope_forward(int device, float* qkv, const float* cos_sin, int64_t B, int64_t T, int64_t NH,
                  int64_t KV, int64_t hd);
void rope_backward(int device, float* dqkv, const float* cos_sin, int64_t B, int64_t T, int64_t NH,
                   int64_t KV, int64_t hd);

// rope_forward / rope_backward on a qkv (its gradient) of 16-bit values of the current matmul
// precision's type (bf16 or fp16, else it fails): the one the qkv projection wrote for the flash
// kernels, and the gradient attention_gqa_backward_rounded writes. Each pair widened, turned in
// fp32 and rounded once.
void rope_forward_rounded(int device, void* qkv, const float* cos_sin, int64_t B, int64_t T,
                          int64_t NH, int64_t KV, int64_t hd);
void rope_backward_rounded(int device, void* dqkv, const float* cos_sin, int64_t B, int64_t T,
                           int64_t NH, int64_t KV, int64_t hd);

// SwiGLU (cpu/swiglu.h): h (N, 2H) = [gate | up], out (N, H); dh (N, 2H) overwritten. `act`:
// the gate's activation (GeGLU's tanh GELU, or the SiLU).
void swiglu_forward(int device, float* out, const float* h, int64_t N, int64_t H,
                    GatedActivation act);
void swiglu_backward(int device, float* dh, const float* dout, const float* h, int64_t N, int64_t H,
                     GatedActivation act);
// The same on 16-bit values of the current matmul precision's type (bf16 or fp16, else it
// fails), computed in fp32 and rounded once: h the fc's rounded output
// (matmul_forward_rounded_output), out proj's input; dout proj's rounded dinp
// (matmul_backward_rounded_dinp), dh the fc's rounded dout. Each returned as a GEMM operand.
GemmOperand swiglu_forward_rounded(int device, void* out, const void* h, int64_t N, int64_t H,
                                   GatedActivation act);
GemmOperand swiglu_backward_rounded(int device, void* dh, const void* dout, const void* h,
                                    int64_t N, int64_t H, GatedActivation act);

// A mixture of experts (kernels/cpu/moe.h's, moe.cu).
void moe_route(int device, float* probs, int32_t* choice, float* weight, float* lse,
               const float* logits, int64_t N, int64_t E, int64_t K, const MoeRouting& routing);
void moe_prob_sums(int device, double* sums, const float* probs, int64_t B, int64_t T, int64_t E,
                   bool sigmoid);
void gather_rows(int device, void* out, const void* in, const int32_t* rows, int64_t n,
                 int64_t row_bytes);
void moe_scatter_add(int device, float* y, const float* src, const int32_t* rows,
                     const int32_t* slots, const float* weight, int64_t n, int64_t C, int64_t K);
void moe_expert_output_grad(int device, float* g, float* dweight, const float* out,
                            const int32_t* rows, const int32_t* slots, const float* weight,
                            int64_t n, int64_t C, int64_t K);
void moe_router_backward(int device, float* dlogits, const float* probs, const int32_t* choice,
                         const float* weight, const float* dweight, const double* balance,
                         const float* lse, double z, int64_t B, int64_t T, int64_t E, int64_t K,
                         bool sigmoid, double scale, bool normalize);

// Checks the tokens (a 4-byte copy back: a wait) and throws loom::Error naming the first bad one
// — unless `ids_checked`, where they were checked before they came (Exec::ids_checked). wpe null:
// no position embedding (and dwpe null: no position gradient), as on the CPU.
void embedding_forward(int device, float* out, const int32_t* tokens, const float* wte,
                       const float* wpe, int64_t B, int64_t T, int64_t C, int64_t V,
                       bool ids_checked = false);
void embedding_backward(int device, float* dwte, float* dwpe, const float* dout,
                        const int32_t* tokens, int64_t B, int64_t T, int64_t C);
// Positions reset at each document (cpu::document_positions; global null or on the GPU), and the
// rows of a position table added by those ids (cpu::add_rows_by_id: bit for bit the CPU's). The
// ids are computed, never read from outside: not checked.
void document_positions(int device, int32_t* ids, const int32_t* starts, const int32_t* global,
                        int64_t B, int64_t Tl, int64_t T);
void add_rows_by_id(int device, float* out, const float* table, const int32_t* ids, int64_t N,
                    int64_t C);
// A sliding window in a table of first visible positions (cpu::window_starts): the same values.
void window_starts(int device, int32_t* out, const int32_t* starts, int64_t B, int64_t T,
                   int64_t window);

// Causal self-attention: the fused flash kernels (flash_attention.cu) where they apply (bf16,
// head size 64 or 128), else cuBLAS batched GEMMs around a causal softmax with a (B·NH, T, T) score
// matrix as scratch. KV (here and in the *_rounded calls below): the key/value heads of a compact
// qkv (B, T, (NH + 2·KV)·hd) and dqkv, query head h reading key/value head h / (NH/KV), which
// only the flash kernels read in place (else it fails: attention_gqa_* expand the heads first);
// 0, the default, is NH: (B, T, 3C). `docs` (here and in every attention call below): document
// masking, the starts on the device (cpu::DocumentStarts; none: causal).
void attention_forward(int device, float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                       int64_t C, int64_t NH, cpu::DocumentStarts docs = {}, int64_t KV = 0);
void attention_backward(int device, float* dqkv, const float* dout, const float* qkv,
                        const float* out, const float* lse, int64_t B, int64_t T, int64_t C,
                        int64_t NH, cpu::DocumentStarts docs = {}, int64_t KV = 0);

// Grouped-query attention (attention_gqa.cu) reading the shared key/value heads in place: qkv
// (B, T, (NH + 2·KV)·hd) as the qkv projection writes it, NH query heads, then KV key heads, then
// KV value heads (query head h reads key/value head h / (NH/KV)). out (B, T, NH·hd), lse
// (B, NH, T): attention_forward's, as if each shared head were repeated for its query heads.
// dqkv (B, T, (NH + 2·KV)·hd) is overwritten; a shared key/value head's gradient is the sum of its
// query heads' gradients, in ascending query head (no atomics). With KV == NH, or where the flash
// kernels apply (they read the shared heads in place and sum a shared head's gradient in their
// accumulators), attention_forward / attention_backward on qkv itself; otherwise the heads are
// expanded into (B, T, 3·NH·hd) scratch for the length of the call (and the gradient reduced from
// it), so nothing repeated is kept between forward and backward.
void attention_gqa_forward(int device, float* out, float* lse, const float* qkv, int64_t B,
                           int64_t T, int64_t NH, int64_t KV, int64_t hd,
                           cpu::DocumentStarts docs = {});
void attention_gqa_backward(int device, float* dqkv, const float* dout, const float* qkv,
                            const float* out, const float* lse, int64_t B, int64_t T, int64_t NH,
                            int64_t KV, int64_t hd, cpu::DocumentStarts docs = {});
// Context parallelism (kernels/cpu/attention.h, attention_gqa_*_rows): the attention of the
// query rows `rows` (positions, in order) of q (B, Tq, ldq) over the keys and values kv (B, T,
// ldkv: KV key heads, then KV value heads) — every position's, or with `keys` a ring's block
// (the positions of those runs, ascending, T in all; a row that sees none of them gets output 0
// and lse -inf) — the CPU kernels' contract. Where the whole sequence's attention takes the
// flash kernels (bf16, head size 64 or 128) they run here too, the queries at their positions
// and grouped key/value heads read in place (up to 8 runs of rows, and of keys); else the
// batched-GEMM path per piece of the rows (scores (B·NH, rows, keys) in scratch, the pieces cut
// so that they stay within attention_score_bytes(), 256 MiB unless set). The backward writes
// dq's first NH·hd columns (row stride lddq) and overwrites dkv, a shared key/value head's
// gradient summed over its query heads in ascending order.
void set_attention_score_bytes(int64_t bytes);  // process-wide, like set_matmul_precision
int64_t attention_score_bytes();
void attention_gqa_forward_rows(int device, float* out, float* lse, const float* q, int64_t ldq,
                                const float* kv, int64_t ldkv, int64_t B, int64_t T, int64_t NH,
                                int64_t KV, int64_t hd, std::span<const cpu::RowRange> rows,
                                std::span<const cpu::RowRange> keys = {},
                                cpu::DocumentStarts docs = {});
void attention_gqa_backward_rows(int device, float* dq, int64_t lddq, float* dkv, const float* dout,
                                 const float* q, int64_t ldq, const float* kv, int64_t ldkv,
                                 const float* out, const float* lse, int64_t B, int64_t T,
                                 int64_t NH, int64_t KV, int64_t hd,
                                 std::span<const cpu::RowRange> rows,
                                 std::span<const cpu::RowRange> keys = {},
                                 cpu::DocumentStarts docs = {});
// The ring's merge of two partial attentions of the same rows (cpu::attention_merge_rows: the
// same formula, in the same order).
void attention_merge_rows(int device, float* out, float* lse, const float* part_out,
                          const float* part_lse, int64_t B, int64_t Tq, int64_t NH, int64_t hd);
// Context parallelism at bf16 on the flash kernels (attention_rows_take_bf16: where they apply to
// these rows and keys): q and kv kept and exchanged as bf16 values, rounded once as the flash
// kernels would round them when they load — the same results, half the bytes; lse, dout, dq and
// dkv fp32, out fp32 or (the backward reads it for D alone) the 16-bit values of the current
// matmul precision. copy_columns_to_bf16 rounds a qkv's columns into them.
bool attention_rows_take_bf16(int64_t NH, int64_t hd, int64_t B,
                              std::span<const cpu::RowRange> rows,
                              std::span<const cpu::RowRange> keys = {});
void copy_columns_to_bf16(int device, void* dst, int64_t ld_dst, const float* src, int64_t ld_src,
                          int64_t rows, int64_t width);
// The same of 16-bit values (a bf16 qkv's columns into them), copied as they are.
void copy_columns_16(int device, void* dst, int64_t ld_dst, const void* src, int64_t ld_src,
                     int64_t rows, int64_t width);
// The forward writes out in f32, or with out_bf16 in bf16 (the projection's rounded input).
void attention_gqa_forward_rows_bf16(int device, void* out, bool out_bf16, float* lse,
                                     const void* q, int64_t ldq, const void* kv, int64_t ldkv,
                                     int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                     std::span<const cpu::RowRange> rows,
                                     std::span<const cpu::RowRange> keys = {},
                                     cpu::DocumentStarts docs = {});
void attention_gqa_backward_rows_bf16(int device, float* dq, int64_t lddq, float* dkv,
                                      const float* dout, const void* q, int64_t ldq, const void* kv,
                                      int64_t ldkv, GemmOperand out, const float* lse, int64_t B,
                                      int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                      std::span<const cpu::RowRange> rows,
                                      std::span<const cpu::RowRange> keys = {},
                                      cpu::DocumentStarts docs = {});
// Columns [0, width) of `rows` rows between row strides ld_src and ld_dst (cpu/attention.h).
void copy_columns(int device, float* dst, int64_t ld_dst, const float* src, int64_t ld_src,
                  int64_t rows, int64_t width);

// attention_forward_rounded / attention_backward_rounded (below) on the compact qkv, dqkv
// (B, T, (NH + 2·KV)·hd) written in out's 16-bit type, the qkv projection's rounded dout: where
// the flash kernels apply (and with KV == NH) those calls on qkv itself; else the same expansion
// into scratch of qkv's type (fp32 there), the expanded gradient written in out's 16-bit type and
// summed back in fp32, rounded once.
GemmOperand attention_gqa_forward_rounded(int device, void* out, float* lse, GemmOperand qkv,
                                          int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                          cpu::DocumentStarts docs = {});
GemmOperand attention_gqa_backward_rounded(int device, void* dqkv, GemmOperand dout,
                                           GemmOperand qkv, GemmOperand out, const float* lse,
                                           int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                           cpu::DocumentStarts docs = {});

// The attention at bf16 / fp16 matmul precision, its output and input gradient written as GEMM
// operands in that 16-bit type: by the flash kernels themselves where they apply (bf16, head
// size 64 or 128), else rounded from the fp32 results. The forward's `out` is the attention
// projection's input; the backward takes it for D = rowsum(dout ∘ out), as FlashAttention-2
// keeps O in bf16, and writes dqkv (B·T·3C) as the qkv projection's dout. At GPT-2 124M,
// T = 1024, batch 16, ~4 GB less memory traffic per step and 0.6 GB less memory than fp32 out and
// dqkv the projections round for themselves.
//
// `qkv` is fp32, or where attention_takes_rounded_qkv says so (the flash kernels apply), the
// 16-bit values the qkv projection wrote (matmul_forward_rounded_output): the flash kernels
// round Q, K and V to bf16 as they load them, so both give the same bits. The backward's `dout`
// likewise, with a 16-bit qkv: fp32, or the 16-bit values the attention projection's backward
// wrote (matmul_backward_rounded_dinp), which the dK/dV kernel fetches by cp.async as it does Q.
GemmOperand attention_forward_rounded(int device, void* out, float* lse, GemmOperand qkv, int64_t B,
                                      int64_t T, int64_t C, int64_t NH,
                                      cpu::DocumentStarts docs = {}, int64_t KV = 0);
GemmOperand attention_backward_rounded(int device, void* dqkv, GemmOperand dout, GemmOperand qkv,
                                       GemmOperand out, const float* lse, int64_t B, int64_t T,
                                       int64_t C, int64_t NH, cpu::DocumentStarts docs = {},
                                       int64_t KV = 0);
// Whether attention_forward_rounded / attention_backward_rounded take a 16-bit qkv at the current
// matmul precision for these sizes.
bool attention_takes_rounded_qkv(int64_t C, int64_t NH, int64_t B);

// Checks the targets like embedding_forward.
void cross_entropy_forward(int device, float* losses, float* lse, const float* logits,
                           const int32_t* targets, int64_t N, int64_t V, bool ids_checked = false);
void cross_entropy_backward(int device, float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, float dloss, int64_t N, int64_t V,
                            float z_loss = 0);
// The LM head's backward (cpu/cross_entropy.h: lm_head_backward): cross_entropy_backward, then
// matmul_backward without a bias. At bf16 / fp16 matmul precision the logit gradient is written
// once, already rounded, as the GEMMs' operand (16 bits per logit, `logits` left as they were)
// instead of fp32 over the logits and a cast after: at GPT-2 124M, T = 1024, batch 16 (16384 ×
// 50304 logits) ~6.6 GB less memory traffic per step.
// cpu::lse_square_sum into *result (device memory), queued: one block, to rounding the CPU's sum.
void lse_square_sum(int device, double* result, const float* lse, const float* sum,
                    const int32_t* targets, int64_t N);
void lm_head_backward(int device, float* dinp, float* dweight, float* logits, const float* lse,
                      const int32_t* targets, float dloss, const float* inp, const float* weight,
                      int64_t N, int64_t C, int64_t V, float z_loss = 0);

// The LM head with its logits stored in the current matmul precision's 16-bit type (bf16 or fp16,
// else it fails), as PyTorch's autocast leaves them: the head's GEMM writes them in 16 bits
// (gemm_rounded_output) and the cross-entropy reads them so — at GPT-2 124M, T = 1024, batch 16
// the 16384 × 50304 logits take 1.65 GB instead of 3.3 GB, and ~5 GB less memory traffic per
// step. The forward: logits (N × V, 16-bit) = inp·weightᵀ, then cross_entropy_forward on them
// (targets checked). The backward: the logits' gradient in place over them, already the GEMMs'
// rounded operand, then matmul_backward without a bias (dinp, dweight accumulated).
void lm_head_forward_rounded_logits(int device, float* losses, float* lse, void* logits,
                                    GemmOperand inp, GemmOperand weight, const int32_t* targets,
                                    int64_t N, int64_t C, int64_t V, bool ids_checked = false);
void lm_head_backward_from_rounded_logits(int device, float* dinp, float* dweight, void* logits,
                                          const float* lse, const int32_t* targets, float dloss,
                                          GemmOperand inp, GemmOperand weight, int64_t N, int64_t C,
                                          int64_t V, float z_loss = 0);

// ---- a vocabulary-parallel embedding and LM head (kernels/cpu/vocab_shard.h) -----------------
// (wpe / dwpe null: no position table, as on the CPU.)

void vocab_shard_embedding_forward(int device, float* out, const int32_t* tokens, const float* wte,
                                   const float* wpe, int64_t N, int64_t T, int64_t C,
                                   const VocabShard& shard, bool add_positions,
                                   bool ids_checked = false);
void vocab_shard_embedding_backward(int device, float* dwte, float* dwpe, const float* dout,
                                    const int32_t* tokens, int64_t N, int64_t T, int64_t C,
                                    const VocabShard& shard);
void vocab_shard_logit_max(int device, float* max, float* target_logit, const float* logits,
                           const int32_t* targets, int64_t N, const VocabShard& shard);
void vocab_shard_sum_exp(int device, float* sum, const float* logits, const float* max, int64_t N,
                         const VocabShard& shard);
// The rows' losses summed into *result (device memory), queued: one block, each thread's rows in
// order, the threads' sums in a fixed order (to rounding the CPU's row-order sum).
void vocab_shard_loss_sum(int device, double* result, const float* sum, const float* max,
                          const float* target_logit, const int32_t* targets, int64_t N);
void vocab_shard_cross_entropy_backward(int device, float* logits, const float* max,
                                        const float* sum, const int32_t* targets, float k,
                                        int64_t N, const VocabShard& shard, float z_loss = 0);
// vocab_shard_logit_max, _sum_exp and _cross_entropy_backward on the 16-bit logits the head's GEMM
// wrote at bf16 / fp16 matmul precision (its rounded type), the gradient written over them in
// that type, for the GEMMs to read.
void vocab_shard_logit_max_rounded(int device, float* max, float* target_logit, const void* logits,
                                   const int32_t* targets, int64_t N, const VocabShard& shard);
void vocab_shard_sum_exp_rounded(int device, float* sum, const void* logits, const float* max,
                                 int64_t N, const VocabShard& shard);
void vocab_shard_cross_entropy_backward_rounded(int device, void* logits, const float* max,
                                                const float* sum, const int32_t* targets, float k,
                                                int64_t N, const VocabShard& shard,
                                                float z_loss = 0);

void adamw_update(int device, float* param, const float* grad, float* m, float* v, int64_t n,
                  double lr, double beta1, double beta2, double eps, double weight_decay,
                  int64_t step, float grad_scale);

// adamw_update over the runs of the same flat buffers in one launch, a block per chunk of
// kAdamWChunk elements (`runs`: `count` entries in GPU memory, numbered by number_adamw_chunks,
// `chunks` in all), with `weight_decay` where a run's decay is set: each element bitwise what
// adamw_update computes. A model's ~150 parameters, most small, in one launch instead of one each.
void adamw_update_runs(int device, float* values, const float* grads, float* m, float* v,
                       const AdamWRun* runs, int64_t count, int64_t chunks, double lr, double beta1,
                       double beta2, double eps, double weight_decay, int64_t step,
                       float grad_scale);

}  // namespace loom::cuda
