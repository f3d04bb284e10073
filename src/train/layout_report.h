// What start-up prints about the layout: which rank holds which (dp, pp, tp) coordinate, how many
// parameters each rank holds and the memory it is expected to need.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "layout/mesh_shape.h"

namespace loom {

// Activation bytes a rank is expected to hold at its peak, by the per-block inventory of what
// backward keeps (f32; N = micro_batch_size × seq_len tokens, C = d_model, P = tp):
//   none      x, ln_1, x1, ln_2 (N·C each; N/P rows under sequence parallelism) + qkv (3N·C/P),
//             attention output (N·C/P), fc output and GELU output (4N·C/P each)
//   selective without the LayerNorm and GELU outputs;  full  the block input only
// times the blocks of this pipeline rank, plus the head's logits (N·V/P) and final LayerNorm on
// the last stage, times the micro-batches in flight (1 without pipelining; pp − stage for 1F1B,
// a bound of pp·v for interleaved; pp for zb-h1 and zb-v (whose last stage is on rank 0); every
// micro-batch for GPipe), plus one block's everything for the block in backward (recomputed
// activations, gradients). An estimate: the step metrics report the measured peak
// (mem_activations_peak_mb).
int64_t expected_activation_bytes(const Config& config, int pp_rank, int64_t blocks_on_rank);

// Whether the config's ranks are GPUs ("cuda", "cuda:N") whose GEMMs read 16-bit operands (bf16 /
// fp16 matmul precision): where activations are kept in 16 bits and the engines keep the
// weights' 16-bit copies (nn/rounded_weights.h).
bool gpu_sixteen_bit_operands(const Config& config);

struct RankFootprint {
  int64_t parameters = 0;         // elements this rank holds (its shards, padding included)
  int64_t state_bytes = 0;        // parameters + gradients + optimizer moments, as allocated
  int64_t activation_bytes = 0;   // expected_activation_bytes
};

// The start-up table: the layout, then one line per rank with its coordinates and footprint.
std::string layout_report(const Config& config, const MeshShape& mesh,
                          const std::vector<RankFootprint>& ranks);

}  // namespace loom
