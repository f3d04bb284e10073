// The machine's fp32 fused-multiply-add ceiling, measured: each thread runs a register-only loop
// of independent vector FMAs (AVX-512 when the CPU has it, else AVX2; a scalar fallback
// elsewhere) for a fixed time; the sum over threads is the peak that `loom bench train` prints its
// achieved GFLOP/s against (the roofline share of issue 8).
#pragma once

namespace loom::cpu {

struct FmaPeak {
  double gflops = 0;       // all threads together
  const char* isa = "";    // "avx512", "avx2" or "scalar"
};

// Runs `threads` threads at once for about `seconds`.
FmaPeak measure_fma_peak(int threads, double seconds = 0.3);

}  // namespace loom::cpu
