// SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"; Llama's MLP): a gated linear unit
// with the SiLU (swish) as its gate, between the fused gate/up projection and the down projection.
//   silu(a) = a·sigmoid(a),   out = silu(gate) ⊙ up
// With act = GatedActivation::kGeluTanh the gate's activation is the tanh GELU instead (GeGLU,
// Gemma's): out = gelu(gate) ⊙ up, through kernels/cpu/gelu.h's vectorised rows.
//
// Legend: N = rows (B*T), H = hidden width. h (N, 2H) as the fused projection writes it: gate in
// columns [0, H), up in [H, 2H).
#pragma once

#include <cstdint>

#include "base/thread_pool.h"
#include "kernels/gated_activation.h"

namespace loom::cpu {

// out (N, H) = silu(gate) ⊙ up.
template <typename Real>
void swiglu_forward(ThreadPool& pool, Real* out, const Real* h, int64_t N, int64_t H,
                    GatedActivation act = GatedActivation::kSilu);

// dh (N, 2H) is overwritten: dgate = dout ⊙ up ⊙ silu'(gate), with silu'(a) = s·(1 + a·(1 − s)),
// s = sigmoid(a); dup = dout ⊙ silu(gate) (GeGLU: gelu and gelu').
template <typename Real>
void swiglu_backward(ThreadPool& pool, Real* dh, const Real* dout, const Real* h, int64_t N,
                     int64_t H, GatedActivation act = GatedActivation::kSilu);

namespace detail {
// n elements of one float row on the calling thread (gate, up and dgate, dup n apart from
// wherever the caller points them): 16 lanes at a time where sixteen_lanes and the CPU has
// AVX-512, else 8 (AVX2 builds; scalar otherwise). The two widths give the same bits; exposed so
// that the tests can check that.
void swiglu_forward_chunk(float* out, const float* gate, const float* up, int64_t n,
                          bool sixteen_lanes);
void swiglu_backward_chunk(float* dgate, float* dup, const float* dout, const float* gate,
                           const float* up, int64_t n, bool sixteen_lanes);
}  // namespace detail

}  // namespace loom::cpu
