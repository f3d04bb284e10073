// The machine's fp32 fused-multiply-add ceiling, measured: each thread runs a register-only loop
// of independent vector FMAs (AVX-512 when the CPU has it, else AVX2; a scalar fallback
// elsewhere) for a fixed time; the sum over threads is the peak that `loom bench train` prints its
// achieved GFLOP/s against (the roofline share of issue 8).
#pragma once

namespace loom::cpu {

struct FmaPeak {
  double gflops = 0;       // all threads together
  const char* isa = "";    // "avx512", "avx2", "scalar", or "avx512-bf16" (vdpbf16ps)
};

// What the loop runs: fp32 FMAs, or (kBf16Gemm, bf16 matmul precision's ceiling) what the bf16
// GEMM runs (sgemm_bf16_avx512.h: bf16_kernel()): AVX512_BF16's vdpbf16ps, two multiply-adds of
// bf16 pairs per lane and instruction, or fp32 FMAs on rounded operands.
enum class PeakKind { kFp32Fma, kBf16Gemm };

// Runs `threads` threads at once for about `seconds`.
FmaPeak measure_fma_peak(int threads, double seconds = 0.3, PeakKind kind = PeakKind::kFp32Fma);

}  // namespace loom::cpu
