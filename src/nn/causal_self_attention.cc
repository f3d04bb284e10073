#include "nn/causal_self_attention.h"

#include <algorithm>

#include "base/error.h"
#include "kernels/ops.h"
#include "nn/sequence_shard.h"
#include "nn/sliding_window.h"
#include "tensor/dispatch.h"

namespace loom {

namespace {
int64_t head_dim_of(const std::string& name, int64_t channels, int64_t heads,
                    const std::optional<Rotary>& rotary) {
  if (rotary && rotary->head_dim > 0) return rotary->head_dim;
  if (heads <= 0 || channels % heads != 0)
    fail(name, ": n_heads = ", heads, " does not divide d_model = ", channels);
  return channels / heads;
}
int64_t qkv_width(int64_t heads, int64_t head_dim, const std::optional<Rotary>& rotary) {
  if (!rotary) return 3 * heads * head_dim;
  if (heads <= 0 || rotary->kv_heads <= 0 || heads % rotary->kv_heads != 0)
    fail("attention: n_kv_heads = ", rotary ? rotary->kv_heads : 0, " does not divide n_heads = ",
         heads);
  return (heads + 2 * rotary->kv_heads) * head_dim;
}
}  // namespace

CausalSelfAttention::CausalSelfAttention(ParameterStore& store, const std::string& name,
                                         int64_t channels, int64_t heads, float init_std,
                                         float proj_std, std::optional<Rotary> rotary)
    : channels_(channels),
      heads_(heads),
      head_dim_(head_dim_of(name, channels, heads, rotary)),
      width_(heads * head_dim_),
      rotary_(rotary),
      tables_(!rotary          ? nullptr
              : rotary->tables ? rotary->tables
                               : std::make_shared<RotaryTables>()),
      qkv_(store, name + ".qkv", channels, qkv_width(heads, head_dim_, rotary),
           !rotary || rotary->qkv_bias, init_std),
      proj_(store, name + ".proj", width_, channels, !rotary, proj_std) {
  if (rotary && head_dim_ % 2 != 0)
    fail(name, ": head size ", head_dim_, " must be even for the rotary embedding");
  if (rotary && rotary->qk_norm)
    qk_norm_.emplace(store, name, head_dim_, rotary->norm_eps, rotary->qk_norm_full, heads,
                     rotary->kv_heads, nullptr, rotary->query_scale);
}

Tensor CausalSelfAttention::project_turned(Context& ctx, const Tensor& x) {
  const int64_t B = x.dim(0), T = x.dim(1), KV = rotary_->kv_heads;
  Tensor qkv = qkv_.forward(ctx, x);
  if (qk_norm_) qk_norm_->forward(ctx, qkv, heads_, KV);
  const Tensor& rope = tables_->get(ctx, T, head_dim_, rotary_->frequencies);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::rope_forward<T_>(ctx.exec(), qkv.data<T_>(), rope.data<T_>(), B, T, heads_, KV, head_dim_);
  });
  return qkv;
}

int64_t RotaryTables::bytes() const {
  int64_t total = 0;
  for (const Slot& s : slots_)
    if (s.table.defined()) total += static_cast<int64_t>(s.table.nbytes());
  return total;
}

const Tensor& RotaryTables::get(Context& ctx, int64_t T, int64_t head_dim,
                                const cpu::RopeFrequencies& frequencies) {
  auto slot = std::find_if(slots_.begin(), slots_.end(), [&](const Slot& s) {
    return s.head_dim == head_dim && s.frequencies == frequencies;
  });
  if (slot == slots_.end()) slot = slots_.insert(slots_.end(), Slot{head_dim, frequencies, {}});
  Tensor& cached = slot->table;
  if (cached.defined() && cached.dim(0) == T && cached.device() == ctx.device &&
      cached.dtype() == ctx.dtype)
    return cached;
  // A context-parallel shard (a module sees one kind of context for its lifetime): the rows of
  // its positions in the whole sequence's table.
  const int64_t rows = ctx.sequence != nullptr ? ctx.sequence->full_length() : T;
  Tensor host = Tensor::empty({rows, head_dim}, ctx.dtype, Device::cpu());
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    cpu::rope_table<T_>(host.data<T_>(), rows, head_dim, frequencies);
  });
  if (ctx.sequence != nullptr) {
    LOOM_CHECK(T == ctx.sequence->local_length());
    host = rows_of(host, ctx.sequence->positions());
  }
  cached = host.to(ctx.device);
  return cached;
}

Tensor CausalSelfAttention::attend_shard(Context& ctx, const Tensor& x) {
  const int64_t B = x.dim(0), T = x.dim(1), hd = head_dim_;
  const int64_t KV = rotary_ ? rotary_->kv_heads : heads_;
  // (B, Tl, W): this rank's positions — in bf16 where the attention keeps q and kv so, as the
  // whole sequence's projection writes qkv for the flash kernels (turned in place in 16 bits);
  // with qk_norm in fp32, normalised and turned there.
  const bool rounded = !qk_norm_ && shard_attention_takes_bf16(ctx, *ctx.sequence, B, heads_, hd);
  Tensor local = qk_norm_  ? project_turned(ctx, x)
                 : rounded ? qkv_.forward_rounded_output(ctx, x)
                           : qkv_.forward(ctx, x);
  if (rotary_ && !qk_norm_) {
    const Tensor& rope = tables_->get(ctx, T, hd, rotary_->frequencies);
    if (rounded)
      ops::rope_forward_rounded(ctx.exec(), local.raw(), local.dtype(), rope.data<float>(), B, T,
                                heads_, KV, hd);
    else
      dispatch_float(ctx.dtype, [&](auto zero) {
        using T_ = decltype(zero);
        ops::rope_forward<T_>(ctx.exec(), local.data<T_>(), rope.data<T_>(), B, T, heads_, KV, hd);
      });
  }
  // Kept: the queries alone (qkv_out_) and the gathered keys and values.
  // Where the flash kernels take the rows the output too is kept as proj's rounded input, as the
  // whole sequence's attention keeps it (attend): one 16-bit copy for proj and for the
  // backward's D = rowsum(dO ∘ O), not an fp32 one beside proj's.
  shard_attention_forward(ctx, *ctx.sequence, local, B, heads_, KV, hd, qkv_out_, kv_full_, att_,
                          lse_, /*rounded_output=*/rounded, document_starts_of(documents_));
  att_ = att_.reshape({B, T, width_});
  return att_;
}

Tensor CausalSelfAttention::backward_shard(Context& ctx, const Tensor& dy) {
  const int64_t B = att_.dim(0), T = att_.dim(1), hd = head_dim_;
  const int64_t KV = rotary_ ? rotary_->kv_heads : heads_;
  Tensor datt = proj_.backward(ctx, dy);
  Tensor dqkv = shard_attention_backward(ctx, *ctx.sequence, qkv_out_, kv_full_, att_, lse_, datt,
                                         heads_, KV, hd,
                                         document_starts_of(documents_));  // (B, T, W)
  if (rotary_) {
    const Tensor& rope = tables_->get(ctx, T, hd, rotary_->frequencies);  // the forward's
    dispatch_float(ctx.dtype, [&](auto zero) {
      using T_ = decltype(zero);
      ops::rope_backward<T_>(ctx.exec(), dqkv.data<T_>(), rope.data<T_>(), B, T, heads_, KV, hd);
    });
  }
  if (qk_norm_) qk_norm_->backward(ctx, dqkv, heads_, KV);
  qkv_out_ = kv_full_ = att_ = lse_ = documents_ = Tensor();
  return qkv_.backward(ctx, dqkv);
}

Tensor CausalSelfAttention::attend_rotary(Context& ctx, const Tensor& x) {
  const int64_t B = x.dim(0), T = x.dim(1), hd = head_dim_;
  const Tensor& rope = tables_->get(ctx, T, hd, rotary_->frequencies);
  const int64_t KV = rotary_->kv_heads;
  lse_ = Tensor::empty({B, heads_, T}, ctx.dtype, ctx.device);
  // On a GPU at bf16 / fp16 matmul precision as GPT-2's attention (attend): qkv in 16 bits where
  // the flash kernels read it so (turned in place in 16 bits), the output as proj's rounded input.
  // With qk_norm qkv stays fp32, normalised and turned there, and the kernels round it as they
  // load it; the backward widens their bf16 dqkv for the norms' (at fp16: the fp32 path below).
  const DType out_dtype = ops::matmul_input_dtype(ctx.exec(), ctx.dtype);
  if (out_dtype != ctx.dtype && (!qk_norm_ || out_dtype == DType::kBF16)) {
    if (qk_norm_) {
      qkv_out_ = project_turned(ctx, x);
    } else {
      const bool rounded_qkv = ops::attention_takes_rounded_qkv(ctx.exec(), width_, heads_, B);
      qkv_out_ = rounded_qkv ? qkv_.forward_rounded_output(ctx, x) : qkv_.forward(ctx, x);
      if (rounded_qkv)
        ops::rope_forward_rounded(ctx.exec(), qkv_out_.raw(), qkv_out_.dtype(), rope.data<float>(),
                                  B, T, heads_, KV, hd);
      else
        ops::rope_forward<float>(ctx.exec(), qkv_out_.data<float>(), rope.data<float>(), B, T,
                                 heads_, KV, hd);
    }
    att_ = Tensor::empty({B, T, width_}, out_dtype, ctx.device);
    ops::attention_gqa_forward_rounded(ctx.exec(), att_.raw(), out_dtype, lse_.data<float>(),
                                       qkv_out_.raw(), qkv_out_.dtype(), B, T, heads_, KV, hd,
                                       document_starts_of(documents_));
    return att_;
  }
  // (B, T, (NH + 2·KV)·hd): q and k turned in place, the shared heads read where they are.
  qkv_out_ = project_turned(ctx, x);
  att_ = Tensor::empty({B, T, width_}, ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::attention_gqa_forward<T_>(ctx.exec(), att_.data<T_>(), lse_.data<T_>(),
                                   qkv_out_.data<T_>(), B, T, heads_, rotary_->kv_heads, hd,
                                   document_starts_of(documents_));
  });
  return att_;
}

Tensor CausalSelfAttention::backward_rotary(Context& ctx, const Tensor& dy) {
  const int64_t B = qkv_out_.dim(0), T = qkv_out_.dim(1), hd = head_dim_;
  const Tensor& rope = tables_->get(ctx, T, hd, rotary_->frequencies);  // the forward's
  if (att_.dtype() != ctx.dtype) {  // the 16-bit forward: dqkv written as qkv's rounded dout
    Tensor datt = qkv_out_.dtype() != ctx.dtype ? proj_.backward_rounded_dinp(ctx, dy)
                                                : proj_.backward(ctx, dy);
    Tensor dqkv = Tensor::empty(qkv_out_.shape(), att_.dtype(), ctx.device);
    ops::attention_gqa_backward_rounded(ctx.exec(), dqkv.raw(), datt.raw(), datt.dtype(),
                                        qkv_out_.raw(), qkv_out_.dtype(), att_.raw(), att_.dtype(),
                                        lse_.data<float>(), B, T, heads_, rotary_->kv_heads, hd,
                                        document_starts_of(documents_));
    ops::rope_backward_rounded(ctx.exec(), dqkv.raw(), dqkv.dtype(), rope.data<float>(), B, T,
                               heads_, rotary_->kv_heads, hd);
    // bf16 with qk_norm (attend_rotary): the norms' backward in fp32, qkv's dout so too
    if (qk_norm_) dqkv = qk_norm_->backward_widening(ctx, dqkv, heads_, rotary_->kv_heads);
    qkv_out_ = att_ = lse_ = documents_ = Tensor();
    return qkv_.backward(ctx, dqkv);
  }
  Tensor datt = proj_.backward(ctx, dy);
  Tensor dqkv = Tensor::empty(qkv_out_.shape(), ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::attention_gqa_backward<T_>(ctx.exec(), dqkv.data<T_>(), datt.data<T_>(),
                                    qkv_out_.data<T_>(), att_.data<T_>(), lse_.data<T_>(), B, T,
                                    heads_, rotary_->kv_heads, hd, document_starts_of(documents_));
    ops::rope_backward<T_>(ctx.exec(), dqkv.data<T_>(), rope.data<T_>(), B, T, heads_,
                           rotary_->kv_heads, hd);
  });
  if (qk_norm_) qk_norm_->backward(ctx, dqkv, heads_, rotary_->kv_heads);
  qkv_out_ = att_ = lse_ = documents_ = Tensor();
  return qkv_.backward(ctx, dqkv);
}

Tensor CausalSelfAttention::forward(Context& ctx, const Tensor& x) {
  return proj_.forward(ctx, attend(ctx, x));
}

Tensor CausalSelfAttention::forward_adding(Context& ctx, const Tensor& x, const Tensor& residual) {
  return proj_.forward_adding(ctx, attend(ctx, x), residual);
}

Tensor CausalSelfAttention::attend(Context& ctx, const Tensor& x) {
  if (x.ndim() != 3 || x.dim(2) != channels_)
    fail("attention expects (B, T, ", channels_, "), got ", shape_str(x.shape()));
  documents_ =
      attention_starts(ctx, window_, x.dim(0), x.dim(1), rotary_ ? rotary_->sliding_window : 0);
  if (ctx.sequence != nullptr) return attend_shard(ctx, x);
  if (rotary_) return attend_rotary(ctx, x);
  const int64_t B = x.dim(0), T = x.dim(1);
  // Where the fused flash kernels run (a GPU at bf16, head size 64 or 128) they round Q, K and V to bf16
  // as they load them: the projection writes qkv in bf16 itself, half the bytes to write, keep
  // and read (its bias rounded too, as under PyTorch's autocast).
  qkv_out_ = ops::attention_takes_rounded_qkv(ctx.exec(), width_, heads_, B)
                 ? qkv_.forward_rounded_output(ctx, x)
                 : qkv_.forward(ctx, x);
  lse_ = Tensor::empty({B, heads_, T}, ctx.dtype, ctx.device);
  // On a GPU at bf16 / fp16 matmul precision the output is written as proj's rounded input (and
  // kept once, by proj and for the backward's D = rowsum(dO ∘ O)).
  const DType out_dtype = ops::matmul_input_dtype(ctx.exec(), ctx.dtype);
  att_ = Tensor::empty({B, T, width_}, out_dtype, ctx.device);
  if (out_dtype != ctx.dtype) {
    ops::attention_forward_rounded(ctx.exec(), att_.raw(), out_dtype, lse_.data<float>(),
                                   qkv_out_.raw(), qkv_out_.dtype(), B, T, width_, heads_,
                                   document_starts_of(documents_));
    return att_;
  }
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    ops::attention_forward<T_>(ctx.exec(), att_.data<T_>(), lse_.data<T_>(), qkv_out_.data<T_>(), B,
                               T, width_, heads_, document_starts_of(documents_));
  });
  return att_;
}

Tensor CausalSelfAttention::backward(Context& ctx, const Tensor& dy) {
  if (ctx.sequence != nullptr) return backward_shard(ctx, dy);
  if (rotary_) return backward_rotary(ctx, dy);
  // Where the flash kernels read qkv in 16 bits they read dO (proj's dinp) so too, written by
  // proj's GEMM and fetched by cp.async like Q.
  Tensor datt = qkv_out_.dtype() != ctx.dtype ? proj_.backward_rounded_dinp(ctx, dy)
                                              : proj_.backward(ctx, dy);
  const int64_t B = qkv_out_.dim(0), T = qkv_out_.dim(1);
  // At 16-bit matmul precision dqkv is written as the qkv projection's rounded dout.
  Tensor dqkv = Tensor::empty(qkv_out_.shape(), att_.dtype(), ctx.device);
  if (att_.dtype() != ctx.dtype) {
    ops::attention_backward_rounded(ctx.exec(), dqkv.raw(), datt.raw(), datt.dtype(),
                                    qkv_out_.raw(), qkv_out_.dtype(), att_.raw(), att_.dtype(),
                                    lse_.data<float>(), B, T, width_, heads_,
                                    document_starts_of(documents_));
  } else {
    dispatch_float(ctx.dtype, [&](auto zero) {
      using T_ = decltype(zero);
      ops::attention_backward<T_>(ctx.exec(), dqkv.data<T_>(), datt.data<T_>(), qkv_out_.data<T_>(),
                                  att_.data<T_>(), lse_.data<T_>(), B, T, width_, heads_,
                                  document_starts_of(documents_));
    });
  }
  qkv_out_ = att_ = lse_ = documents_ = Tensor();
  return qkv_.backward(ctx, dqkv);
}

Tensor CausalSelfAttention::decode_adding(Context& ctx, const Tensor& x, const Tensor* residual,
                                          Tensor& keys, Tensor& values, int64_t first) {
  LOOM_CHECK_MSG(ctx.device.is_cpu(), "decoding with a key/value cache runs on the CPU");
  if (x.ndim() != 3 || x.dim(0) != 1) fail("decoding expects (1, n, C), got ", shape_str(x.shape()));
  // C: the attention's width (d_model unless Rotary::head_dim says otherwise).
  const int64_t n = x.dim(1), C = width_, hd = head_dim_;
  if (first + n > keys.dim(0))
    fail("decoding: positions up to ", first + n, " exceed the cache's ", keys.dim(0), " rows");
  Tensor qkv = qkv_.forward(ctx, x);  // (1, n, qkv width)
  if (qk_norm_) qk_norm_->forward(ctx, qkv, heads_, rotary_->kv_heads);
  if (rotary_) {
    // The table of every position the cache can hold, made once and kept while decoding.
    const Tensor& rope = tables_->get(ctx, keys.dim(0), hd, rotary_->frequencies);
    Tensor turned = Tensor::empty({1, n, 3 * C}, ctx.dtype, ctx.device);
    dispatch_float(ctx.dtype, [&](auto zero) {
      using T_ = decltype(zero);
      ops::rope_gqa_forward<T_>(ctx.exec(), turned.data<T_>(), qkv.data<T_>(),
                                rope.data<T_>() + first * hd, 1, n, heads_, rotary_->kv_heads, hd);
    });
    qkv = turned;
  }
  Tensor att = Tensor::empty({1, n, C}, ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using T_ = decltype(zero);
    const T_* rows = qkv.data<T_>();
    for (int64_t r = 0; r < n; ++r) {  // the new keys and values into the cache
      std::copy(rows + r * 3 * C + C, rows + r * 3 * C + 2 * C, keys.data<T_>() + (first + r) * C);
      std::copy(rows + r * 3 * C + 2 * C, rows + r * 3 * C + 3 * C,
                values.data<T_>() + (first + r) * C);
    }
    ops::attention_with_cache<T_>(ctx.exec(), att.data<T_>(), rows, 3 * C, keys.data<T_>(),
                                  values.data<T_>(), first, n, C, heads_,
                                  rotary_ ? rotary_->sliding_window : 0);
  });
  Tensor y = residual ? proj_.forward_adding(ctx, att, *residual) : proj_.forward(ctx, att);
  clear_cache();
  return y;
}

void CausalSelfAttention::clear_cache() {
  qkv_.clear_cache();
  proj_.clear_cache();
  if (qk_norm_) qk_norm_->clear_cache();
  qkv_out_ = att_ = lse_ = documents_ = Tensor();
}

}  // namespace loom
