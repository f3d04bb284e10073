#include "nn/moe_mlp.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "base/error.h"
#include "kernels/ops.h"
#include "nn/sequence_shard.h"
#include "tensor/dispatch.h"

namespace loom {
namespace {

// Orders items 0 .. n−1 by their local expert, expert_of(i) (−1: none here), each expert's in
// item order: returns the items, and sets `offsets` (local + 1, on the host) to each expert's
// first place among them.
template <typename ExpertOf>
std::vector<int32_t> order_by_expert(int64_t n, int64_t local, ExpertOf expert_of,
                                     Tensor& offsets) {
  offsets = Tensor::zeros({local + 1}, DType::kI32);
  int32_t* off = offsets.data<int32_t>();
  for (int64_t i = 0; i < n; ++i)
    if (const int64_t e = expert_of(i); e >= 0) ++off[e + 1];
  for (int64_t e = 0; e < local; ++e) off[e + 1] += off[e];
  std::vector<int32_t> items(static_cast<size_t>(off[local]));
  std::vector<int32_t> next(off, off + local);
  for (int64_t i = 0; i < n; ++i)
    if (const int64_t e = expert_of(i); e >= 0)
      items[static_cast<size_t>(next[static_cast<size_t>(e)]++)] = static_cast<int32_t>(i);
  return items;
}

}  // namespace

RouterScore parse_router_score(const std::string& name, const std::string& key) {
  if (name == "softmax") return RouterScore::kSoftmax;
  if (name == "sigmoid") return RouterScore::kSigmoid;
  fail(key, " = \"", name, "\": expected \"softmax\" or \"sigmoid\"");
}

const char* router_score_name(RouterScore score) {
  return score == RouterScore::kSoftmax ? "softmax" : "sigmoid";
}

MoeMlp::MoeMlp(ParameterStore& store, const std::string& name, const MoeShape& shape,
               const MoeLosses& losses, float init_std, float proj_std, ExpertExchange* exchange,
               TensorSplit* split)
    : shape_(shape),
      exchange_(exchange),
      split_(split),
      losses_(losses),
      router_(store, name + ".router", shape.channels, shape.experts, false, init_std) {
  if (shape.experts < 1 || shape.top_k < 1 || shape.top_k > shape.experts)
    fail(name, ": top ", shape.top_k, " of ", shape.experts, " experts");
  const int64_t G = shape.router_groups, GK = shape.router_group_topk;
  if (!shape.groups_route())
    fail(name, ": group-limited routing of ", shape.experts, " experts in ", G, " groups, top ",
         shape.top_k, " from the best ", GK, " groups: the groups must divide the experts, ", GK,
         " must divide the top k, and each group hold top k / ", GK, " experts");
  if (!(shape.router_scale > 0))
    fail(name, ": the routing weights' factor must be positive, got ", shape.router_scale);
  if (shape.score == RouterScore::kSigmoid && losses.router_z > 0)
    fail(name, ": the router z-loss (model.moe_router_z_loss_coef) is a softmax's; sigmoid ",
         "scores (model.moe_router_score_function) take none");
  local_ = shape.experts;
  const HiddenSlice slice =
      split_ != nullptr ? HiddenSlice{split_->rank(), split_->ranks()} : HiddenSlice{};
  const auto add_shared = [&] {
    if (shape.shared > 0)
      shared_ = std::make_unique<SwiGluMlp>(store, name + ".shared", shape.channels,
                                            shape.shared * shape.hidden, init_std, proj_std, slice);
  };
  if (exchange_ != nullptr) {
    const int ranks = exchange_->ranks();
    if (shape.experts % ranks != 0)
      fail(name, ": ", shape.experts, " experts do not split evenly over ", ranks,
           " expert-parallel ranks (parallel.ep)");
    local_ = shape.experts / ranks;
    first_ = local_ * exchange_->rank();
    // The shared experts are the block's, like the router; the routed ones a unit of their own
    // (the block's parameters end with this layer's).
    add_shared();
    store.begin_unit(name + ".experts", /*experts=*/true);
    expert_unit_ = static_cast<int>(store.units().size()) - 1;
  }
  for (int64_t e = first_; e < first_ + local_; ++e)
    experts_.push_back(std::make_unique<SwiGluMlp>(store, name + ".experts." + std::to_string(e),
                                                   shape.channels, shape.hidden, init_std, proj_std,
                                                   slice));
  if (exchange_ == nullptr) add_shared();
  out_.resize(static_cast<size_t>(local_));
}

void update_expert_biases(std::vector<float>& biases, const std::vector<double>& tokens,
                          int64_t experts, double rate) {
  LOOM_CHECK(biases.size() == tokens.size() && experts > 0 && biases.size() % experts == 0);
  const size_t E = static_cast<size_t>(experts);
  const float step = static_cast<float>(rate);
  for (size_t first = 0; first < biases.size(); first += E) {
    double sum = 0;
    for (size_t e = 0; e < E; ++e) sum += tokens[first + e];
    const double mean = sum / static_cast<double>(E);
    for (size_t e = 0; e < E; ++e) {
      const double gap = mean - tokens[first + e];
      if (gap > 0) biases[first + e] += step;
      if (gap < 0) biases[first + e] -= step;
    }
  }
}

void MoeMlp::set_expert_bias(const float* bias) {
  const int64_t E = shape_.experts;
  device_expert_bias_ = Tensor();
  if (std::all_of(bias, bias + E, [](float b) { return b == 0.0f; })) {
    expert_bias_ = Tensor();
    return;
  }
  expert_bias_ = Tensor::empty({E}, DType::kF32);
  std::copy(bias, bias + E, expert_bias_.data<float>());
}

Tensor MoeMlp::forward(Context& ctx, const Tensor& x) {
  return run(ctx, x, nullptr);
}

Tensor MoeMlp::forward_adding(Context& ctx, const Tensor& x, const Tensor& residual) {
  return run(ctx, x, &residual);
}

Tensor MoeMlp::gather(const Exec& ex, const Tensor& tokens, int64_t e) const {
  const int64_t C = shape_.channels, n = rows_of(e);
  Tensor out = Tensor::empty({n, C}, tokens.dtype(), tokens.device());
  ops::gather_rows(ex, out.raw(), tokens.raw(), rows_.data<int32_t>() + offset(e), n,
                   C * static_cast<int64_t>(dtype_size(tokens.dtype())));
  return out;
}

Tensor MoeMlp::expert_tokens_of(const Tensor& x) const {
  const Tensor rows = x.reshape({x.numel() / shape_.channels, shape_.channels});
  return exchange_ != nullptr ? exchange_->gather(rows) : rows;
}

Tensor MoeMlp::send_tokens(const Exec& ex, const Tensor& x) const {
  const int64_t C = shape_.channels, rows = send_index_.numel();
  Tensor send = Tensor::empty({rows, C}, x.dtype(), x.device());
  ops::gather_rows(ex, send.raw(), x.raw(), send_index_.data<int32_t>(), rows,
                   C * static_cast<int64_t>(dtype_size(x.dtype())));
  return exchange_rows(send, false);
}

Tensor MoeMlp::exchange_rows(const Tensor& rows, bool back) const {
  const int R = exchange_->ranks();
  const int64_t* n = exchange_rows_.data<int64_t>();
  const std::vector<int64_t> sent(n, n + R), received(n + R, n + 2 * R);
  return back ? exchange_->all_to_all(rows, received, sent)
              : exchange_->all_to_all(rows, sent, received);
}

Tensor MoeMlp::run_all_to_all(Context& ctx, const Tensor& x, const Tensor* residual,
                              const int32_t* chosen, const std::vector<uint8_t>& keep) {
  const int64_t C = shape_.channels, K = shape_.top_k, N = x.numel() / C;
  const int R = exchange_->ranks();
  const auto kept = [&](int64_t i) { return keep.empty() || keep[static_cast<size_t>(i)] != 0; };
  const Exec ex = ctx.exec();
  const auto on_device = [&](const Tensor& host) {
    return ctx.device.is_cpu() ? host : host.to(ctx.device);
  };
  // Each destination's block exactly as long as its pairs (all_to_all_v), the counts exchanged
  // first: what each rank receives from each (one small all-to-all; the host waits for it).
  std::vector<int64_t> count(static_cast<size_t>(R), 0);
  for (int64_t i = 0; i < N * K; ++i)
    if (kept(i)) ++count[static_cast<size_t>(chosen[i] / local_)];
  const std::vector<int64_t> incoming = exchange_->exchange_counts(count);
  exchange_rows_ = Tensor::empty({2 * R}, DType::kI64);
  std::copy(count.begin(), count.end(), exchange_rows_.data<int64_t>());
  std::copy(incoming.begin(), incoming.end(), exchange_rows_.data<int64_t>() + R);
  const int64_t arriving = std::accumulate(incoming.begin(), incoming.end(), int64_t{0});
  // The pairs sent, slot by slot (a slot's tokens are distinct): slot j's are
  // [slot_pairs[j], slot_pairs[j + 1]); without drops j·N + t.
  const int64_t P = std::accumulate(count.begin(), count.end(), int64_t{0});
  std::vector<int64_t> start(static_cast<size_t>(R), 0);  // each destination's block
  for (int d = 1; d < R; ++d)
    start[static_cast<size_t>(d)] =
        start[static_cast<size_t>(d) - 1] + count[static_cast<size_t>(d) - 1];
  Tensor send_index = Tensor::empty({P}, DType::kI32), send_pair = Tensor::empty({P}, DType::kI32);
  Tensor ids = Tensor::empty({P}, DType::kI32);  // the local expert at the destination
  Tensor pair_rows = Tensor::empty({P}, DType::kI32), pair_tok = Tensor::empty({P}, DType::kI32),
         pair_slot = Tensor::empty({P}, DType::kI32);
  slot_pairs_ = Tensor::empty({K + 1}, DType::kI64);
  int64_t* slot_pairs = slot_pairs_.data<int64_t>();
  std::vector<int64_t> next(static_cast<size_t>(R), 0);
  int64_t p = 0;
  for (int64_t j = 0; j < K; ++j) {
    slot_pairs[j] = p;
    for (int64_t t = 0; t < N; ++t) {
      if (!kept(t * K + j)) continue;
      const int64_t e = chosen[t * K + j], d = e / local_;
      const int64_t q = start[static_cast<size_t>(d)] + next[static_cast<size_t>(d)]++;
      send_index.data<int32_t>()[q] = static_cast<int32_t>(t);
      send_pair.data<int32_t>()[q] = static_cast<int32_t>(p);
      ids.data<int32_t>()[q] = static_cast<int32_t>(e - d * local_);
      pair_rows.data<int32_t>()[p] = static_cast<int32_t>(q);
      pair_tok.data<int32_t>()[p] = static_cast<int32_t>(t);
      pair_slot.data<int32_t>()[p] = static_cast<int32_t>(j);
      ++p;
    }
  }
  slot_pairs[K] = p;
  send_index_ = on_device(send_index);
  send_pair_ = on_device(send_pair);
  pair_rows_ = on_device(pair_rows);
  pair_tok_ = on_device(pair_tok);
  pair_slot_ = on_device(pair_slot);
  // What arrives: every source's block of rows for this rank's experts, laid out expert by
  // expert (the experts' indices on the host: from a GPU a second wait).
  Tensor arrived = exchange_rows(on_device(ids), false);
  if (!ctx.device.is_cpu()) arrived = arrived.to(Device::cpu());
  const int32_t* expert_of = arrived.data<int32_t>();
  const std::vector<int32_t> places = order_by_expert(
      arriving, local_, [&](int64_t q) { return expert_of[q]; }, offsets_);
  Tensor rows = Tensor::empty({static_cast<int64_t>(places.size())}, DType::kI32);
  std::copy(places.begin(), places.end(), rows.data<int32_t>());
  rows_ = slots_ = on_device(rows);
  // The local experts on what arrived; their outputs, unweighed, back where the rows came from.
  const Tensor received = send_tokens(ex, x);
  Tensor outputs = Tensor::zeros({arriving, C}, ctx.dtype, ctx.device);
  if (expert_unit_ >= 0) hook_before_forward(ctx, static_cast<size_t>(expert_unit_));
  for (int64_t e = 0; e < local_; ++e) {
    const size_t ei = static_cast<size_t>(e);
    const int64_t n = rows_of(e);
    out_[ei] = Tensor();
    if (n == 0) continue;
    const Tensor out = experts_[ei]->forward(ctx, gather(ex, received, e));
    dispatch_float(ctx.dtype, [&](auto zero) {
      using Real = decltype(zero);
      ops::moe_scatter_add<Real>(ex, outputs.data<Real>(), out.data<Real>(),
                                 rows_.data<int32_t>() + offset(e),
                                 rows_.data<int32_t>() + offset(e), nullptr, n, C, K);
    });
  }
  if (expert_unit_ >= 0) hook_after_forward(ctx, static_cast<size_t>(expert_unit_));
  const Tensor returned = exchange_rows(outputs, true);
  // Each pair's output at home, weighed into its token: a slot's pairs at a time.
  pair_out_ = Tensor::empty({P, C}, ctx.dtype, ctx.device);
  ops::gather_rows(ex, pair_out_.raw(), returned.raw(), pair_rows_.data<int32_t>(), P,
                   C * static_cast<int64_t>(dtype_size(ctx.dtype)));
  Tensor y = residual ? residual->clone() : Tensor::zeros(x.shape(), ctx.dtype, ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using Real = decltype(zero);
    for (int64_t j = 0; j < K; ++j) {
      const int64_t first = slot_pairs[j], n = slot_pairs[j + 1] - first;
      ops::moe_scatter_add<Real>(ex, y.data<Real>(), pair_out_.data<Real>() + first * C,
                                 pair_tok_.data<int32_t>() + first,
                                 pair_slot_.data<int32_t>() + first, weight_.data<Real>(), n, C, K);
    }
  });
  return y;
}

std::vector<uint8_t> MoeMlp::capacity_keep(Context& ctx, const int32_t* chosen, int64_t n,
                                           int64_t T, const Tensor& weights, int64_t own_first,
                                           int64_t own_pairs) {
  const int64_t E = shape_.experts, K = shape_.top_k;
  const bool by_score = shape_.capacity.policy == TokenDropPolicy::kProbs;
  std::vector<float> score;
  if (by_score) {  // the routing weights on the host (from a GPU: a second small wait)
    const Tensor w = weights.device().is_cpu() ? weights : weights.to(Device::cpu());
    score.resize(static_cast<size_t>(n * K));
    dispatch_float(w.dtype(), [&](auto zero) {
      using Real = decltype(zero);
      for (size_t i = 0; i < score.size(); ++i) score[i] = static_cast<float>(w.data<Real>()[i]);
    });
  }
  std::vector<uint8_t> keep(static_cast<size_t>(n * K));
  if (ctx.sequence == nullptr) {
    keep_within_capacity({chosen, keep.size()}, score, T, K, E, shape_.capacity, keep);
  } else {
    // Under context parallelism a rank holds T of each sequence's L positions: the sequences'
    // choices (and weights) laid out at their positions and summed over the group, so every rank
    // decides on the whole sequences, as one device, and keeps its own positions' answers.
    const int64_t L = ctx.sequence->full_length(), S = n / T, whole_pairs = S * L * K;
    std::vector<int64_t> position;  // of each local row
    for (const cpu::RowRange& range : ctx.sequence->positions())
      for (int64_t g = range.begin; g < range.end; ++g) position.push_back(g);
    LOOM_CHECK(static_cast<int64_t>(position.size()) == T);
    const auto at = [&](int64_t i) {  // local pair i's place among the whole sequences'
      const int64_t t = i / K;
      return static_cast<size_t>(((t / T) * L + position[static_cast<size_t>(t % T)]) * K + i % K);
    };
    std::vector<double> whole(static_cast<size_t>(whole_pairs * (by_score ? 2 : 1)), 0.0);
    for (int64_t i = 0; i < n * K; ++i) {
      whole[at(i)] = chosen[i] + 1;  // 0: another rank's position
      if (by_score) whole[static_cast<size_t>(whole_pairs) + at(i)] = score[static_cast<size_t>(i)];
    }
    ctx.sequence->sum_over_group(whole);
    std::vector<int32_t> whole_choice(static_cast<size_t>(whole_pairs));
    std::vector<float> whole_score(by_score ? static_cast<size_t>(whole_pairs) : 0);
    for (size_t i = 0; i < whole_choice.size(); ++i) {
      whole_choice[i] = static_cast<int32_t>(std::lround(whole[i])) - 1;
      if (by_score) whole_score[i] = static_cast<float>(whole[whole_choice.size() + i]);
    }
    std::vector<uint8_t> whole_keep(whole_choice.size());
    keep_within_capacity(whole_choice, whole_score, L, K, E, shape_.capacity, whole_keep);
    for (int64_t i = 0; i < n * K; ++i) keep[static_cast<size_t>(i)] = whole_keep[at(i)];
  }
  dropped_ = std::count(keep.begin() + own_first, keep.begin() + own_first + own_pairs, 0);
  return keep;
}

Tensor MoeMlp::run(Context& ctx, const Tensor& x, const Tensor* residual) {
  const int64_t C = shape_.channels, E = shape_.experts, K = shape_.top_k;
  if (x.dim(-1) != C || x.shape().size() != 3)
    fail(router_.weight()->name, ": input must be (B, T, ", C, ")");
  if (split_ != nullptr && residual != nullptr)
    fail(router_.weight()->name, ": a tensor-parallel slice of the experts makes a partial sum, ",
         "to which the caller adds the residual after summing it");
  const int64_t B = x.dim(0), N = x.numel() / C, T = N / B;
  const Exec ex = exec_ = ctx.exec();
  dropped_ = 0;
  const Tensor logits = router_.forward(ctx, x);  // (B, T, E), ctx.dtype
  probs_ = Tensor::empty({N, E}, ctx.dtype, ctx.device);
  choice_ = Tensor::empty({N, K}, DType::kI32, ctx.device);
  weight_ = Tensor::empty({N, K}, ctx.dtype, ctx.device);
  lse_ = Tensor::empty({N}, ctx.dtype, ctx.device);
  Tensor sums = Tensor::empty({B, E}, DType::kF64, ctx.device);  // each sequence's Σ p_e
  const bool sigmoid = shape_.score == RouterScore::kSigmoid;
  const float* bias = nullptr;  // the balancing biases, on the forward's device
  if (expert_bias_.defined()) {
    if (ctx.device.is_cpu()) {
      bias = expert_bias_.data<float>();
    } else {
      if (!device_expert_bias_.defined() || device_expert_bias_.device() != ctx.device)
        device_expert_bias_ = expert_bias_.to(ctx.device);
      bias = device_expert_bias_.data<float>();
    }
  }
  dispatch_float(ctx.dtype, [&](auto zero) {
    using Real = decltype(zero);
    ops::moe_route<Real>(ex, probs_.data<Real>(), choice_.data<int32_t>(), weight_.data<Real>(),
                         lse_.data<Real>(), logits.data<Real>(), N, E, K,
                         MoeRouting{bias, sigmoid, shape_.router_groups, shape_.router_group_topk,
                                    shape_.router_scale, shape_.router_normalize});
    ops::moe_prob_sums<Real>(ex, sums.data<double>(), probs_.data<Real>(), B, T, E, sigmoid);
  });
  // Under expert parallelism with the all-gather dispatcher the local experts serve the group's
  // tokens: their choices and weights gathered (the tokens themselves below). The all-to-all
  // dispatcher sends each token's rows to its experts' ranks instead (run_all_to_all).
  const bool all_to_all = exchange_ != nullptr && exchange_->all_to_all_dispatch();
  const bool gathered = exchange_ != nullptr && !all_to_all;
  const Tensor group_choice = gathered ? exchange_->gather(choice_) : choice_;
  group_weight_ = gathered ? exchange_->gather(weight_) : Tensor();
  const int64_t group_n = group_choice.dim(0);
  // The choices on the host (from a GPU: the block's one wait), laid out expert by expert.
  const Tensor choice = ctx.device.is_cpu() ? group_choice : group_choice.to(Device::cpu());
  if (!ctx.device.is_cpu()) sums = sums.to(Device::cpu());
  const int32_t* chosen = choice.data<int32_t>();
  // This rank's tokens' choices (its block of the group's) count for the balance loss.
  const int32_t* own = chosen + (gathered ? exchange_->rank() * N * K : 0);
  counts_ = Tensor::zeros({B, E}, DType::kI32);
  int32_t* counts = counts_.data<int32_t>();
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < K; ++j) ++counts[(t / T) * E + own[t * K + j]];
  expert_tokens_.assign(static_cast<size_t>(E), 0);
  for (int64_t i = 0; i < B * E; ++i) expert_tokens_[static_cast<size_t>(i % E)] += counts[i];
  // Under context parallelism this rank holds T of each sequence's full_length() positions: the
  // sequences' counts and probability sums are summed over the group (one host wait), and every
  // rank's balance loss is the whole sequences'.
  sequence_length_ = T;
  if (ctx.sequence != nullptr) {
    sequence_length_ = ctx.sequence->full_length();
    std::vector<double> whole(static_cast<size_t>(2 * B * E));
    for (int64_t i = 0; i < B * E; ++i) {
      whole[static_cast<size_t>(i)] = counts[i];
      whole[static_cast<size_t>(B * E + i)] = sums.data<double>()[i];
    }
    ctx.sequence->sum_over_group(whole);
    for (int64_t i = 0; i < B * E; ++i) {
      counts[i] = static_cast<int32_t>(std::lround(whole[static_cast<size_t>(i)]));
      sums.data<double>()[i] = whole[static_cast<size_t>(B * E + i)];
    }
  }
  // The balance loss: the mean over sequences of Σ_e f_e · P_e.
  const double L = static_cast<double>(sequence_length_);
  balance_loss_ = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t e = 0; e < E; ++e)
      balance_loss_ += static_cast<double>(E) / (static_cast<double>(K) * L) * counts[b * E + e] *
                       sums.data<double>()[b * E + e] / L / static_cast<double>(B);
  // The router z-loss: the mean over tokens of lse², where it counts.
  router_z_loss_ = 0;
  if (losses_.router_z > 0) {
    const Tensor lse = ctx.device.is_cpu() ? lse_ : lse_.to(Device::cpu());
    dispatch_float(ctx.dtype, [&](auto zero) {
      using Real = decltype(zero);
      for (int64_t t = 0; t < N; ++t) {
        const double l = static_cast<double>(lse.data<Real>()[t]);
        router_z_loss_ += l * l / static_cast<double>(N);
      }
    });
  }
  // Expert capacity (nn/moe_capacity.h): the pairs beyond it, per whole sequence, dropped.
  const std::vector<uint8_t> keep =
      shape_.capacity.dropless()
          ? std::vector<uint8_t>()
          : capacity_keep(ctx, chosen, group_n, T, gathered ? group_weight_ : weight_,
                          gathered ? exchange_->rank() * N * K : 0, N * K);
  if (all_to_all) {
    Tensor y = run_all_to_all(ctx, x, residual, chosen, keep);
    if (shared_) return shared_->forward_adding(ctx, x, y);
    return y;
  }
  // The (token, slot) choices of the local experts (under expert parallelism, of the group's
  // tokens), expert by expert.
  const std::vector<int32_t> choices = order_by_expert(
      group_n * K, local_,
      [&](int64_t i) -> int64_t {  // −1: another rank's, or dropped
        const int64_t e = chosen[i] - first_;
        return e >= 0 && e < local_ && (keep.empty() || keep[static_cast<size_t>(i)] != 0) ? e : -1;
      },
      offsets_);
  Tensor rows = Tensor::empty({static_cast<int64_t>(choices.size())}, DType::kI32),
         slots = Tensor::empty({static_cast<int64_t>(choices.size())}, DType::kI32);
  for (size_t k = 0; k < choices.size(); ++k) {
    rows.data<int32_t>()[k] = static_cast<int32_t>(choices[k] / K);
    slots.data<int32_t>()[k] = static_cast<int32_t>(choices[k] % K);
  }
  rows_ = ctx.device.is_cpu() ? rows : rows.to(ctx.device);
  slots_ = ctx.device.is_cpu() ? slots : slots.to(ctx.device);
  // Each local expert on its tokens; their outputs weighed into y, expert by expert (a fixed
  // order). Under expert parallelism into the group's rows, summed over the group after.
  const Tensor tokens = expert_tokens_of(x);
  const Tensor& weights = exchange_ != nullptr ? group_weight_ : weight_;
  Tensor y = exchange_ != nullptr ? Tensor::zeros({group_n, C}, ctx.dtype, ctx.device)
             : residual           ? residual->clone()
                                  : Tensor::zeros(x.shape(), ctx.dtype, ctx.device);
  if (expert_unit_ >= 0) hook_before_forward(ctx, static_cast<size_t>(expert_unit_));
  for (int64_t e = 0; e < local_; ++e) {
    const size_t ei = static_cast<size_t>(e);
    const int64_t n = rows_of(e);
    out_[ei] = Tensor();
    if (n == 0) continue;  // an idle expert runs nothing; its gradient stays as it is
    out_[ei] = experts_[ei]->forward(ctx, gather(ex, tokens, e));
    dispatch_float(ctx.dtype, [&](auto zero) {
      using Real = decltype(zero);
      ops::moe_scatter_add<Real>(ex, y.data<Real>(), out_[ei].data<Real>(),
                                 rows_.data<int32_t>() + offset(e),
                                 slots_.data<int32_t>() + offset(e), weights.data<Real>(), n, C, K);
    });
  }
  if (expert_unit_ >= 0) hook_after_forward(ctx, static_cast<size_t>(expert_unit_));
  if (exchange_ != nullptr) {
    y = exchange_->reduce_scatter(y).reshape(x.shape());
    if (residual)
      dispatch_float(ctx.dtype, [&](auto zero) {
        using Real = decltype(zero);
        ops::add_inplace<Real>(ex, y.data<Real>(), residual->data<Real>(), N * C);
      });
  }
  // The shared experts on every token, added last (in the GEMM's epilogue on a GPU).
  if (shared_) return shared_->forward_adding(ctx, x, y);
  return y;
}

Tensor MoeMlp::backward(Context& ctx, const Tensor& dy) {
  LOOM_CHECK(probs_.defined());
  const int64_t C = shape_.channels, E = shape_.experts, K = shape_.top_k;
  const int64_t B = dy.dim(0), N = dy.numel() / C, T = N / B;
  const Exec ex = ctx.exec();
  // The gradients of the tokens' rows and their weights: this rank's N tokens, or under expert
  // parallelism the group's (every slot not a local expert's left zero), summed over the group.
  const bool dispatched = pair_out_.defined();  // by the all-to-all dispatcher
  const bool group = exchange_ != nullptr && !dispatched;
  const Tensor dtokens = group ? exchange_->gather(dy.reshape({N, C})) : dy;
  const Tensor& weights = group ? group_weight_ : weight_;
  const int64_t rows_n = dtokens.numel() / C;
  Tensor dx = Tensor::zeros({rows_n, C}, ctx.dtype, ctx.device);
  // Every slot an expert's, unless some were another rank's or dropped (their weights' gradients
  // zero: those outputs were never added).
  Tensor dweight = group || !shape_.capacity.dropless()
                       ? Tensor::zeros({rows_n, K}, ctx.dtype, ctx.device)
                       : Tensor::empty({N, K}, ctx.dtype, ctx.device);
  Tensor dlogits = Tensor::empty({B, T, E}, ctx.dtype, ctx.device);
  // The balance loss's gradient at each sequence's probabilities: the coefficient × the loss's
  // scale / (B·T) × f_e. Under context parallelism f_e is the whole sequence's, and T this rank's
  // positions, not full_length(): the group's gradients are averaged with dp's (divided by cp),
  // so each rank's tokens take cp times their share of the mean.
  Tensor balance = Tensor::empty({B, E}, DType::kF64);
  const double aux = static_cast<double>(losses_.balance) * ctx.backward_scale /
                     static_cast<double>(B * T) * static_cast<double>(E) /
                     static_cast<double>(K * sequence_length_);
  for (int64_t i = 0; i < B * E; ++i) balance.data<double>()[i] = aux * counts_.data<int32_t>()[i];
  if (!ctx.device.is_cpu()) balance = balance.to(ctx.device);
  dispatch_float(ctx.dtype, [&](auto zero) {
    using Real = decltype(zero);
    if (dispatched) {
      // The pairs' output gradients at home (and the routing weights'), sent to the experts'
      // ranks as the rows went; the inputs' gradients come back and are added per slot.
      const int64_t P = pair_tok_.numel(), rows = send_pair_.numel();
      const int R = exchange_->ranks();
      const int64_t* exchanged = exchange_rows_.data<int64_t>();
      const int64_t arrived = std::accumulate(exchanged + R, exchanged + 2 * R, int64_t{0});
      const int64_t row_bytes = C * static_cast<int64_t>(sizeof(Real));
      Tensor g = Tensor::empty({P, C}, ctx.dtype, ctx.device);
      ops::gather_rows(ex, g.raw(), dy.raw(), pair_tok_.data<int32_t>(), P, row_bytes);
      ops::moe_expert_output_grad<Real>(ex, g.data<Real>(), dweight.data<Real>(),
                                        pair_out_.data<Real>(), pair_tok_.data<int32_t>(),
                                        pair_slot_.data<int32_t>(), weight_.data<Real>(), P, C, K);
      pair_out_ = Tensor();
      Tensor send = Tensor::empty({rows, C}, ctx.dtype, ctx.device);
      ops::gather_rows(ex, send.raw(), g.raw(), send_pair_.data<int32_t>(), rows, row_bytes);
      const Tensor grads = exchange_rows(send, false);
      Tensor dreceived = Tensor::zeros({arrived, C}, ctx.dtype, ctx.device);
      if (expert_unit_ >= 0) hook_before_backward(ctx, static_cast<size_t>(expert_unit_));
      for (int64_t e = 0; e < local_; ++e) {
        const int64_t n = rows_of(e);
        if (n == 0) continue;
        const int32_t* at = rows_.data<int32_t>() + offset(e);
        const Tensor dxe = experts_[static_cast<size_t>(e)]->backward(ctx, gather(ex, grads, e));
        ops::moe_scatter_add<Real>(ex, dreceived.data<Real>(), dxe.data<Real>(), at, at, nullptr, n,
                                   C, K);
      }
      if (expert_unit_ >= 0) hook_after_backward(ctx, static_cast<size_t>(expert_unit_));
      const Tensor back = exchange_rows(dreceived, true);
      Tensor dpairs = Tensor::empty({P, C}, ctx.dtype, ctx.device);
      ops::gather_rows(ex, dpairs.raw(), back.raw(), pair_rows_.data<int32_t>(), P, row_bytes);
      const int64_t* slot_pairs = slot_pairs_.data<int64_t>();
      for (int64_t j = 0; j < K; ++j) {
        const int64_t first = slot_pairs[j], n = slot_pairs[j + 1] - first;
        ops::moe_scatter_add<Real>(ex, dx.data<Real>(), dpairs.data<Real>() + first * C,
                                   pair_tok_.data<int32_t>() + first,
                                   pair_slot_.data<int32_t>() + first, nullptr, n, C, K);
      }
    } else {
      if (expert_unit_ >= 0) hook_before_backward(ctx, static_cast<size_t>(expert_unit_));
      for (int64_t e = 0; e < local_; ++e) {
        const size_t ei = static_cast<size_t>(e);
        const int64_t n = rows_of(e);
        if (n == 0) continue;
        const int32_t* rows = rows_.data<int32_t>() + offset(e);
        const int32_t* slots = slots_.data<int32_t>() + offset(e);
        Tensor g = gather(ex, dtokens, e);
        ops::moe_expert_output_grad<Real>(ex, g.data<Real>(), dweight.data<Real>(),
                                          out_[ei].data<Real>(), rows, slots, weights.data<Real>(),
                                          n, C, K);
        out_[ei] = Tensor();
        const Tensor dxe = experts_[ei]->backward(ctx, g);
        ops::moe_scatter_add<Real>(ex, dx.data<Real>(), dxe.data<Real>(), rows, slots, nullptr, n,
                                   C, K);
      }
      if (expert_unit_ >= 0) hook_after_backward(ctx, static_cast<size_t>(expert_unit_));
      if (group) {
        dx = exchange_->reduce_scatter(dx);
        dweight = exchange_->reduce_scatter(dweight);
      }
    }
    // Under tensor parallelism each rank's experts made a part of every output, so of every
    // routing weight's gradient: summed over the group, the whole one the router's backward
    // needs, the same on every rank.
    if (split_ != nullptr) split_->all_reduce(dweight);
    ops::moe_router_backward<Real>(
        ex, dlogits.data<Real>(), probs_.data<Real>(), choice_.data<int32_t>(),
        weight_.data<Real>(), dweight.data<Real>(), balance.data<double>(), lse_.data<Real>(),
        static_cast<double>(losses_.router_z) * ctx.backward_scale / static_cast<double>(N), B, T,
        E, K, shape_.score == RouterScore::kSigmoid, shape_.router_scale, shape_.router_normalize);
    // The router's input gradient (whole on every rank of a tensor-parallel group; the caller
    // sums dx over it) added once.
    const Tensor drouter = router_.backward(ctx, dlogits);
    if (split_ == nullptr || split_->rank() == 0)
      ops::add_inplace<Real>(ex, dx.data<Real>(), drouter.data<Real>(), N * C);
    if (shared_) {
      const Tensor dshared = shared_->backward(ctx, dy);
      ops::add_inplace<Real>(ex, dx.data<Real>(), dshared.data<Real>(), N * C);
    }
  });
  clear_routing();
  return dx.reshape(dy.shape());
}

void MoeMlp::clear_routing() {
  probs_ = choice_ = weight_ = lse_ = group_weight_ = rows_ = slots_ = offsets_ = counts_ =
      Tensor();
  send_index_ = send_pair_ = pair_rows_ = pair_tok_ = pair_slot_ = slot_pairs_ = pair_out_ =
      exchange_rows_ = Tensor();
  for (Tensor& out : out_) out = Tensor();
}

void MoeMlp::drop_recomputable() {
  router_.drop_input();
  for (auto& expert : experts_) expert->drop_recomputable();
  if (shared_) shared_->drop_recomputable();
}

void MoeMlp::restore_input(const Tensor& x) {
  LOOM_CHECK(offsets_.defined());
  router_.restore_input(x);
  // Under expert parallelism the rows again: gathered, or sent by the all-to-all dispatcher.
  const Tensor tokens = send_index_.defined() ? send_tokens(exec_, x) : expert_tokens_of(x);
  for (int64_t e = 0; e < local_; ++e)
    if (rows_of(e) > 0) experts_[static_cast<size_t>(e)]->restore_input(gather(exec_, tokens, e));
  if (shared_) shared_->restore_input(x);
}

void MoeMlp::clear_cache() {
  router_.clear_cache();
  for (auto& expert : experts_) expert->clear_cache();
  if (shared_) shared_->clear_cache();
  clear_routing();
}

void MoeMlp::collect_cache(std::vector<Tensor*>& out) {
  router_.collect_cache(out);
  for (auto& expert : experts_) expert->collect_cache(out);
  if (shared_) shared_->collect_cache(out);
  for (Tensor* t : {&probs_, &choice_, &weight_, &lse_, &group_weight_, &rows_, &slots_, &offsets_,
                    &counts_, &send_index_, &send_pair_, &pair_rows_, &pair_tok_, &pair_slot_,
                    &slot_pairs_, &pair_out_, &exchange_rows_})
    out.push_back(t);
  for (Tensor& t : out_) out.push_back(&t);
}

}  // namespace loom
