// `#pragma unroll` for nvcc; host compilers (the CUDA emulator's) would warn about a pragma they
// do not know.
#pragma once

#ifdef __CUDACC__
#define LOOM_UNROLL _Pragma("unroll")
#else
#define LOOM_UNROLL
#endif
