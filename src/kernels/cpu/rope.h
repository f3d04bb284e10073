// Rotary position embedding (Su et al. 2021, "RoFormer"; RoPE) with grouped-query attention's
// head sharing (Ainslie et al. 2023, "GQA"), as Llama uses them: between the qkv projection and
// the attention kernels (attention.h), which then see NH query, key and value heads as GPT-2's.
// HF transformers' Llama convention ("rotate_half"): dimension i of a head is paired with
// dimension i + hd/2, not with its neighbour.
//
// Legend: B = batch, T = sequence length, NH = query heads, KV = key/value heads (KV divides NH;
// query head h shares key/value head h / (NH/KV)), hd = head size (even).
//
// qkv (B, T, (NH + 2·KV)·hd) as the qkv projection writes it: NH query heads, then KV key heads,
// then KV value heads, each hd wide. out (B, T, 3·NH·hd) as attention_forward reads it: q | k | v,
// NH heads each, head h at columns h·hd of its third.
//
// cos_sin (T, hd), rope_table's: row t = [cos(t·θ_0) … cos(t·θ_{hd/2−1}), sin(t·θ_0) …
// sin(t·θ_{hd/2−1})]. A head x at position t is rotated, for i < hd/2, c = cos_sin[t][i],
// s = cos_sin[t][hd/2 + i], into
//   y[i] = x[i]·c − x[i+hd/2]·s,   y[i+hd/2] = x[i+hd/2]·c + x[i]·s.
#pragma once

#include <cstdint>

#include "base/error.h"
#include "base/thread_pool.h"

namespace loom::cpu {

// The rotary frequencies θ_i = theta^(−2i/hd) (Llama: theta = 10000 or 500000) and, with
// scaling_factor > 0, Llama 3.1's long-context scaling of them ("llama3" in transformers'
// rope_scaling): a frequency whose wavelength 2π/θ is shorter than original_max_seq_len /
// high_freq_factor stays, one longer than original_max_seq_len / low_freq_factor is divided by
// scaling_factor, and those between are blended, (1 − s)·θ/factor + s·θ with
// s = (original_max_seq_len / wavelength − low_freq_factor) / (high_freq_factor − low_freq_factor).
// With `linear` instead, every frequency is divided by scaling_factor (transformers' "linear"
// rope_scaling, Chen et al. 2023's position interpolation: positions / factor; Gemma 3 4B+'s
// whole-sequence blocks).
struct RopeFrequencies {
  double theta = 10000;
  double scaling_factor = 0;  // 0: no scaling
  double low_freq_factor = 1;
  double high_freq_factor = 4;
  double original_max_seq_len = 8192;
  bool linear = false;  // the factor divides every frequency (no blending)
  // θ_i, i < hd/2, in double.
  double frequency(int64_t i, int64_t hd) const;
  bool operator==(const RopeFrequencies&) const = default;
};

// The (T, hd) table above, computed in double and rounded to Real once. A host helper: the
// table is built once and copied to the device that runs the rope kernels.
template <typename Real>
void rope_table(Real* cos_sin, int64_t T, int64_t hd, const RopeFrequencies& frequencies);
template <typename Real>
void rope_table(Real* cos_sin, int64_t T, int64_t hd, double theta) {
  rope_table(cos_sin, T, hd, RopeFrequencies{theta});
}

// out (B, T, 3·NH·hd): query head h rotated; key head h = key head h / (NH/KV) of qkv rotated;
// value head h = value head h / (NH/KV), copied. Each (b, t) row is one thread's, so the result
// does not depend on pool.size().
template <typename Real>
void rope_gqa_forward(ThreadPool& pool, Real* out, const Real* qkv, const Real* cos_sin, int64_t B,
                      int64_t T, int64_t NH, int64_t KV, int64_t hd);

// dqkv (B, T, (NH + 2·KV)·hd) is overwritten from dout (B, T, 3·NH·hd): the inverse rotation
// (dx[i] = dy[i]·c + dy[i+hd/2]·s, dx[i+hd/2] = dy[i+hd/2]·c − dy[i]·s) and, for a key or value
// head shared by NH/KV query heads, the sum of their gradients in ascending query head, then
// rotated back (the CUDA kernel adds in the same order). Independent of pool.size().
template <typename Real>
void rope_gqa_backward(ThreadPool& pool, Real* dqkv, const Real* dout, const Real* cos_sin,
                       int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd);

// The rotation alone, in place on the compact layout (the query and key heads of qkv (B, T,
// (NH + 2·KV)·hd); the value heads untouched), for attention that reads the shared heads in place
// (attention_gqa_forward); the backward turns dqkv's query and key heads back in place. Each
// (b, t) row is one thread's.
template <typename Real>
void rope_forward(ThreadPool& pool, Real* qkv, const Real* cos_sin, int64_t B, int64_t T,
                  int64_t NH, int64_t KV, int64_t hd);
template <typename Real>
void rope_backward(ThreadPool& pool, Real* dqkv, const Real* cos_sin, int64_t B, int64_t T,
                   int64_t NH, int64_t KV, int64_t hd);

// Throws loom::Error naming `op` unless the heads can be shared and rotated: NH, KV, hd > 0, KV
// divides NH and hd is even. The CPU and CUDA kernels check before anything is written.
inline void check_rope_gqa_shape(const char* op, int64_t NH, int64_t KV, int64_t hd) {
  if (NH <= 0 || KV <= 0 || NH % KV != 0)
    fail(op, ": ", KV, " key/value heads do not divide ", NH, " query heads");
  if (hd <= 0 || hd % 2 != 0)
    fail(op, ": head size ", hd, " is not even (rotate_half pairs i, i + hd/2)");
}

}  // namespace loom::cpu
