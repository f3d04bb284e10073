// The fused attention kernels (flash_attention.cu) that attention.cu dispatches to when they apply.
#pragma once

#include <cstdint>
#include <span>

#include "kernels/cpu/attention.h"  // RowRange

namespace loom::cuda {

// Head size 64 or 128, the matmul precision bf16 (the kernels' operands are bf16), and not switched off
// with LOOM_CUDA_FLASH_ATTENTION=0 (for comparisons with the GEMM path).
bool flash_attention_applies(int64_t C, int64_t NH, int64_t B);

// attention_forward's contract (kernels.h), qkv (and dqkv below) in the compact layout of KV
// key/value heads (B, T, (NH + 2·KV)·64), query head h reading key/value head h / (NH/KV); KV = NH:
// (B, T, 3C).
void flash_attention_forward(int device, float* out, float* lse, const float* qkv, int64_t B,
                             int64_t T, int64_t C, int64_t NH, int64_t KV,
                             cpu::DocumentStarts docs = {});

// The same with `out` written in bf16 (B·T·C values): attention_forward_rounded. `qkv` holds
// floats, or bf16 values when qkv_bf16 (as the qkv projection wrote them).
void flash_attention_forward_bf16_out(int device, void* out, float* lse, const void* qkv,
                                      bool qkv_bf16, int64_t B, int64_t T, int64_t C, int64_t NH,
                                      int64_t KV, cpu::DocumentStarts docs = {});

// attention_backward's contract, given D = rowsum(dout ∘ out) per (b, h, t). dqkv must not alias
// qkv or dout: the dK/dV pass writes it before the dQ pass reads them (callers pass a fresh one).
void flash_attention_backward(int device, float* dqkv, const float* dout, const float* qkv,
                              const float* lse, const float* D, int64_t B, int64_t T, int64_t C,
                              int64_t NH, int64_t KV, cpu::DocumentStarts docs = {});

// The same with dqkv written in bf16 (B·T·(NH + 2·KV)·64 values): attention_backward_rounded; `qkv` as in
// flash_attention_forward_bf16_out, `dout` likewise floats or, with a bf16 qkv, bf16 values (as
// the attention projection's backward wrote them).
void flash_attention_backward_bf16_dqkv(int device, void* dqkv, const void* dout, bool dout_bf16,
                                        const void* qkv, bool qkv_bf16, const float* lse,
                                        const float* D, int64_t B, int64_t T, int64_t C, int64_t NH,
                                        int64_t KV, cpu::DocumentStarts docs = {});

// Context parallelism's attention of some query rows (attention_gqa_forward_rows' and
// attention_gqa_backward_rows' contracts, kernels.h) by the same kernels, the queries at their
// positions, and with `keys` the keys and values of a ring's block (at those runs of positions):
// where flash_attention_applies and the rows and the keys are at most 8 runs of positions each.
bool flash_attention_applies_to_rows(int64_t NH, int64_t hd, int64_t B,
                                     std::span<const cpu::RowRange> rows,
                                     std::span<const cpu::RowRange> keys = {});
// q and kv floats, or bf16 values when `bf16_in` (context parallelism keeps and exchanges them so).
// A row that sees none of the keys gets output 0 and lse -inf.
void flash_attention_forward_rows(int device, float* out, float* lse, const void* q, int64_t ldq,
                                  const void* kv, int64_t ldkv, bool bf16_in, int64_t B, int64_t T,
                                  int64_t NH, int64_t KV, int64_t hd,
                                  std::span<const cpu::RowRange> rows,
                                  std::span<const cpu::RowRange> keys = {},
                                  cpu::DocumentStarts docs = {});
// The same with bf16 q and kv and `out` written in bf16, as flash_attention_forward_bf16_out
// writes the whole sequence's (the projection's rounded input).
void flash_attention_forward_rows_bf16_out(int device, void* out, float* lse, const void* q,
                                           int64_t ldq, const void* kv, int64_t ldkv, int64_t B,
                                           int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                           std::span<const cpu::RowRange> rows,
                                           std::span<const cpu::RowRange> keys = {},
                                           cpu::DocumentStarts docs = {});
// D = rowsum(dout ∘ out) per (b, h, local row), as lse. dkv's every row is written.
void flash_attention_backward_rows(int device, float* dq, int64_t lddq, float* dkv,
                                   const float* dout, const void* q, int64_t ldq, const void* kv,
                                   int64_t ldkv, bool bf16_in, const float* lse, const float* D,
                                   int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                   std::span<const cpu::RowRange> rows,
                                   std::span<const cpu::RowRange> keys = {},
                                   cpu::DocumentStarts docs = {});

}  // namespace loom::cuda
