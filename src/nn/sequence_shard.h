// SequenceShard — what a module needs to know when its rank holds only some positions of each
// sequence (context parallelism, parallel/context_parallel.h): which positions, and a way to see
// every position's keys and values. The modules stay free of communication: the exchange is a
// virtual call whose implementation lives in parallel/.
//
// Positions a module reads by index — the position embedding's rows, the rotary embedding's
// angles — are this shard's (positions()); the attention gathers the whole sequence's keys and
// values, computes its own query rows, and hands its share of dK and dV back to be summed
// (shard_attention_forward / backward below).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/exec.h"
#include "tensor/tensor.h"

namespace loom {

struct Context;

class SequenceShard {
 public:
  virtual ~SequenceShard() = default;
  // The whole sequence's length T, and the positions this rank holds, in its local order
  // (Σ sizes = local_length()).
  virtual int64_t full_length() const = 0;
  virtual const std::vector<cpu::RowRange>& positions() const = 0;
  int64_t local_length() const { return cpu::rows_in(positions()); }

  // (B, local_length, W) of every rank of the group → (B, T, W), positions in order.
  virtual Tensor gather(Context& ctx, const Tensor& local) = 0;
  // (B, T, W) of every rank → their sum at this rank's positions, (B, local_length, W).
  virtual Tensor reduce_scatter(Context& ctx, const Tensor& full) = 0;
  // `values` (host) replaced by their sum over the group, the same on every rank (the host
  // waits): statistics of whole sequences, as a mixture of experts' choices per expert and
  // sequence (nn/moe_mlp.h).
  virtual void sum_over_group(std::vector<double>& values) = 0;

  // The ring form of the exchange (parallel.cp_comm = "ring"): when ring() is true the attention
  // never holds the whole sequence's keys and values; each rank's block passes around the group
  // instead, the next one arriving while the current one computes.
  virtual bool ring() const { return false; }
  using BlockVisit =
      std::function<void(const Tensor& block, const std::vector<cpu::RowRange>& positions)>;
  // visit(block, its positions) for every rank's `local` (B, local_length, W) of the group, this
  // rank's first, then the previous rank's, and so on round the ring.
  virtual void ring_blocks(Context& ctx, const Tensor& local, const BlockVisit& visit);
  using GradVisit = std::function<void(const Tensor& block,
                                       const std::vector<cpu::RowRange>& positions, Tensor& grad)>;
  // The backward's pass: visit(block, positions, grad) overwrites grad (shaped as block, of
  // dtype grad_dtype: a GPU's bf16 blocks have fp32 gradients) with this rank's gradient of that
  // block. Each block's gradient travels with it, summed rank after rank from its owner on, and
  // comes home: the result is the group's sum for this rank's own block, (B, local_length, W).
  virtual Tensor ring_blocks_backward(Context& ctx, const Tensor& local, DType grad_dtype,
                                      const GradVisit& visit);
};

// Rows `positions` of a (T, W) table, stacked: (Σ sizes, W), on the table's device.
Tensor rows_of(const Tensor& table, const std::vector<cpu::RowRange>& positions);
// table's rows at `positions` += rows (Σ sizes, W): rows_of's adjoint.
void add_rows_into(const Exec& ex, Tensor& table, const Tensor& rows,
                   const std::vector<cpu::RowRange>& positions);

// Whether shard_attention_forward keeps q and kv in bf16 (a GPU at bf16 whose flash kernels
// take this shard's rows, and with the ring its blocks of keys): then qkv may come in bf16
// itself, as the projection writes it for the flash kernels (no fp32 copy of it at all).
bool shard_attention_takes_bf16(const Context& ctx, const SequenceShard& shard, int64_t B,
                                int64_t NH, int64_t hd);
// The attention of a shard's query rows over the whole sequence: `qkv` (B·Tl or B, Tl, W =
// (NH + 2·KV)·hd) is this rank's, q and k already turned. Only the keys and values cross the
// group. Kept for the backward: `q`, a compact copy of the queries (B, Tl, NH·hd), and `kv`, the
// whole sequence's keys and values (B, T, 2·KV·hd), gathered — the rank's own among them, so qkv
// itself need not be kept; with the ring (shard.ring()) only this rank's keys and values (B, Tl,
// 2·KV·hd), every other block passed round again in the backward. att (B·Tl, NH·hd) and lse
// (B, NH, Tl) are written. On a GPU at bf16 whose flash kernels take the rows
// (shard_attention_takes_bf16) q and kv are bf16: half the bytes kept and exchanged
// (all-gathered or passed round the ring), the same results; with `rounded_output` att is bf16
// too, the projection's rounded input (the flash kernels write it so where no merge follows, the
// ring's merged rows are rounded once). `docs`: document masking, the whole sequences' starts
// (B, T) on ctx's device; none: causal.
void shard_attention_forward(Context& ctx, SequenceShard& shard, const Tensor& qkv, int64_t B,
                             int64_t NH, int64_t KV, int64_t hd, Tensor& q, Tensor& kv, Tensor& att,
                             Tensor& lse, bool rounded_output = false,
                             cpu::DocumentStarts docs = {});
// Its backward: datt shaped as att → dqkv (B, Tl, W): this rank's dQ, and its positions' sum of
// every rank's dK and dV (reduce-scattered). With bf16 q and kv, att may be the bf16 values the
// projection keeps (the backward reads it for D = rowsum(dO ∘ O) alone). `docs`: document
// masking, the whole sequences' starts (B, T) as the forward's.
Tensor shard_attention_backward(Context& ctx, SequenceShard& shard, const Tensor& q,
                                const Tensor& kv, const Tensor& att, const Tensor& lse,
                                const Tensor& datt, int64_t NH, int64_t KV, int64_t hd,
                                cpu::DocumentStarts docs = {});

}  // namespace loom
