// LocalGroup: rendezvous, mailboxes and abort for the local backend (see local_group.h).
#include "comm/local/local_group.h"

#include <iomanip>
#include <sstream>
#include <utility>

namespace loom::local {

std::string_view op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kReduce:
      return "reduce";
    case OpKind::kAllToAll:
      return "all_to_all";
    case OpKind::kAllToAllV:
      return "all_to_all_v";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kSplit:
      return "split";
  }
  return "?";
}

std::string seconds_str(std::chrono::milliseconds d) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(d.count() < 100 ? 3 : 1) << d.count() / 1000.0 << " s";
  return os.str();
}

std::string rank_list(const std::vector<int>& ranks) {
  if (ranks.empty()) return "none";
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

bool same_call(const Post& a, const Post& b) {
  if (a.kind != b.kind) return false;
  if (a.kind == OpKind::kBarrier || a.kind == OpKind::kSplit) return true;
  return a.count == b.count && a.dtype == b.dtype && a.root == b.root && a.op == b.op;
}

std::string describe(const Post& p) {
  std::ostringstream os;
  os << op_kind_name(p.kind) << "(";
  if (p.kind != OpKind::kBarrier && p.kind != OpKind::kSplit) {
    os << "count=" << p.count << ", dtype=" << dtype_name(p.dtype);
    if (p.kind == OpKind::kBroadcast || p.kind == OpKind::kReduce) os << ", root=" << p.root;
    if (p.kind == OpKind::kAllReduce || p.kind == OpKind::kReduceScatter ||
        p.kind == OpKind::kReduce) {
      os << ", op=" << reduce_op_name(p.op);
    }
  }
  os << ")";
  return os.str();
}

Slot& LocalGroup::arrive(const OpContext& ctx, uint64_t seq, int phase, const Post* post) {
  std::unique_lock<std::mutex> lock(mutex_);
  Slot& slot = slots_.try_emplace(seq, size_).first->second;
  if (phase == 0) slot.posts[ctx.rank] = *post;
  slot.mask[phase][ctx.rank] = 1;
  ++slot.arrived[phase];
  cv_.notify_all();
  // Phase 0 ends in one of two ways for everyone: all ranks arrived (then nobody gives up on
  // this slot any more), or some rank gave up first (timeout, abort) and recorded why; ranks
  // arriving later see that and never touch the posted buffers.
  auto ready = [&] {
    if (phase == 1) return slot.arrived[1] == size_;
    return !slot.failure.empty() || slot.arrived[0] == size_ || abort_->aborted();
  };
  const bool woken = cv_.wait_until(lock, ctx.deadline, ready);
  if (phase == 0 ? slot.failure.empty() && slot.arrived[0] == size_ : woken) return slot;
  std::string why = slot.failure;
  if (why.empty() && woken) why = "aborted: " + abort_->reason();
  const bool own_timeout = why.empty();
  if (own_timeout) {
    std::vector<int> arrived, missing;
    for (int r = 0; r < size_; ++r) (slot.mask[phase][r] ? arrived : missing).push_back(r);
    why = detail::concat("timed out after ", seconds_str(options_.timeout),
                         phase == 0 ? " waiting for ranks " : " waiting for ranks to finish: ",
                         rank_list(missing), " (arrived: ", rank_list(arrived), ")");
  }
  if (phase == 0 && slot.failure.empty()) slot.failure = why;
  cv_.notify_all();
  throw WaitError(prefix(ctx) + ": " + why, own_timeout);
}

Tensor LocalGroup::take(const OpContext& ctx, int src, int dst, int tag) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto& box = mailboxes_[{src, dst, tag}];
  if (!cv_.wait_until(lock, ctx.deadline, [&] { return !box.empty() || abort_->aborted(); })) {
    throw WaitError(detail::concat(prefix(ctx), ": timed out after ", seconds_str(options_.timeout),
                                   " waiting for ranks ", src, " (no message with tag ", tag, ")"),
                    true);
  }
  if (box.empty()) {
    lock.unlock();
    throw WaitError(prefix(ctx) + ": aborted: " + abort_->reason(), false);
  }
  Tensor message = std::move(box.front());
  box.pop_front();
  return message;
}

void AbortState::abort(const std::string& reason) {
  std::vector<std::shared_ptr<LocalGroup>> groups;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_.load()) return;
    reason_ = reason;
    aborted_.store(true, std::memory_order_release);
    for (auto& weak : groups_) {
      if (auto group = weak.lock()) groups.push_back(std::move(group));
    }
  }
  for (auto& group : groups) group->wake();
}

}  // namespace loom::local
