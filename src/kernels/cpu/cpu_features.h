// What this CPU can run, asked of it once (cpuid). The kernels with AVX-512 paths — the SGEMM,
// GELU, the softmaxes' exp — choose by it at run time, so one x86-64-v3 binary uses AVX-512
// where it exists and runs everywhere else.
#pragma once

namespace loom::cpu {

inline bool has_avx512f() {
#if defined(__x86_64__)
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return yes;
#else
  return false;
#endif
}

}  // namespace loom::cpu
