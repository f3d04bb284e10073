// `loom bench attention`: causal attention forward and backward over a whole sequence against
// one context-parallel rank's query rows (its zigzag chunks over every position's keys), as the
// training step calls them: how close cp's attention comes to 1/cp of one device's. With
// --documents L also the whole sequence under document masking (documents of L tokens), --window W
// under a sliding window of W positions (both: both).
#pragma once

#include <cstdint>
#include <string>

namespace loom {

struct BenchAttentionArgs {
  std::string device = "cpu";  // cpu, or cuda / cuda:N
  std::string precision =
      "fp32";       // a GPU's matmul precision: fp32 or bf16 (bf16: the flash kernels)
  int threads = 1;  // CPU threads
  int64_t batch = 1;
  int64_t seq_len = 4096;
  int64_t heads = 12;
  int64_t kv_heads = 0;  // 0: as many as heads
  int64_t head_dim = 64;
  int cp = 2;
  int iters = 3;  // timed repetitions of each; the best counts
  // Document masking: the whole sequence's attention again with documents of this many tokens
  // (data.document_mask), against the causal one; 0: not measured.
  int64_t documents = 0;
  // A sliding window (model.sliding_window): each query's this many latest positions, with the
  // documents if any; 0: not measured.
  int64_t window = 0;
  bool json = false;
};

int cmd_bench_attention(const BenchAttentionArgs& args);

}  // namespace loom
