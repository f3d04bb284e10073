// All CPU kernels: llm.c-style forward/backward pairs on raw, row-major pointers.
//
// Conventions shared by every kernel:
//  - templates over the scalar Real, instantiated for float (training) and double (gradient
//    checks against finite differences);
//  - the first argument is the rank's ThreadPool, the only source of parallelism (no OpenMP,
//    and OpenBLAS is single-threaded under it);
//  - bitwise reproducible: fixed partitions, and reductions across rows in a fixed order;
//  - gradients of parameters are accumulated (+=), so micro-batches add up for free; gradients
//    of activations (dinp, dqkv, dlogits) are overwritten.
#pragma once

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_cache.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/elementwise.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/fp8.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"
#include "kernels/cpu/vocab_shard.h"
