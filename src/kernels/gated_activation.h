// The gate's activation of a gated MLP (Shazeer 2020, "GLU Variants Improve Transformer"):
// out = act(gate) ⊙ up. SiLU makes Llama's SwiGLU; the tanh-approximated GELU makes Gemma's
// GeGLU (transformers' "gelu_pytorch_tanh", GPT-2's GELU: kernels/cpu/gelu.h).
#pragma once

namespace loom {

enum class GatedActivation { kSilu, kGeluTanh };

}  // namespace loom
