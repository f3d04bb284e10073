// LocalGroup — the shared state of one group of the local backend: per-sequence-number slots
// where ranks post their buffers and meet (two rendezvous per collective), eager point-to-point
// mailboxes, and the world-wide abort flag. Internal to src/comm/local/.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "comm/communicator.h"

namespace loom::local {

using Clock = std::chrono::steady_clock;

enum class OpKind {
  kAllReduce,
  kReduceScatter,
  kAllGather,
  kBroadcast,
  kReduce,
  kAllToAll,
  kAllToAllV,
  kBarrier,
  kSplit
};

std::string_view op_kind_name(OpKind kind);

std::string seconds_str(std::chrono::milliseconds d);  // "2.0 s"

std::string rank_list(const std::vector<int>& ranks);  // "0, 2, 3" or "none"

// What a rank posts for one collective. count is the per-rank element count n (see
// communicator.h: reduce_scatter/all_gather/all_to_all move size() × n elements).
struct Post {
  OpKind kind = OpKind::kBarrier;
  int64_t count = 0;
  DType dtype = DType::kF32;
  int root = -1;
  ReduceOp op = ReduceOp::kSum;
  const std::byte* in = nullptr;
  std::byte* out = nullptr;
  int color = 0;
  int key = 0;
  // all_to_all_v: the rank's blocks' element offsets, send's then receive's (2 · (size + 1)).
  const int64_t* blocks = nullptr;
};

bool same_call(const Post& a, const Post& b);  // same op, count, dtype, root, reduce op

std::string describe(const Post& p);  // "all_reduce(count=8, dtype=f32, op=sum)"

class LocalGroup;

// Thrown by LocalGroup when a wait ends without its peers: this rank's own timeout
// (own_timeout), a peer that gave up on the same collective, or a world abort. The communicator
// dumps its flight recorder for these (see local_backend.h), not for mismatched calls.
class WaitError : public CommError {
 public:
  WaitError(const std::string& message, bool own_timeout)
      : CommError(message), own_timeout_(own_timeout) {}
  bool own_timeout() const { return own_timeout_; }

 private:
  bool own_timeout_;
};

// Shared by every group of one world: a failed rank fails them all.
class AbortState {
 public:
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  std::string reason() {
    std::lock_guard<std::mutex> lock(mutex_);
    return reason_;
  }
  void add(const std::shared_ptr<LocalGroup>& group) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::erase_if(groups_, [](const std::weak_ptr<LocalGroup>& g) { return g.expired(); });
    groups_.push_back(group);
  }
  void abort(const std::string& reason);

 private:
  std::mutex mutex_;
  std::atomic<bool> aborted_{false};
  std::string reason_;
  std::vector<std::weak_ptr<LocalGroup>> groups_;
};

// Per sequence number: what each rank posted and how far it got.
struct Slot {
  explicit Slot(int n) : posts(n), mask{std::vector<char>(n), std::vector<char>(n)}, created(n) {}
  std::vector<Post> posts;
  int arrived[2] = {0, 0};
  std::vector<char> mask[2];  // which ranks arrived at phase 0 / 1 (for messages)
  int left = 0;
  std::string failure;                               // set by a rank that gave up waiting
  std::vector<std::shared_ptr<LocalGroup>> created;  // split: the new group, by leader rank
};

// Who is asking, for messages and deadlines.
struct OpContext {
  std::string what;  // "all_reduce #17"
  int rank = 0;
  Clock::time_point deadline;
};

class LocalGroup {
 public:
  // world_ranks[r]: the world rank of the group's rank r (size entries).
  LocalGroup(std::string name, std::vector<int> world_ranks, CommOptions options,
             std::shared_ptr<AbortState> abort)
      : name_(std::move(name)),
        size_(static_cast<int>(world_ranks.size())),
        world_ranks_(std::move(world_ranks)),
        options_(std::move(options)),
        abort_(std::move(abort)) {}

  const std::string& name() const { return name_; }
  int size() const { return size_; }
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  const CommOptions& options() const { return options_; }
  AbortState& abort_state() { return *abort_; }
  const std::shared_ptr<AbortState>& abort_ptr() const { return abort_; }

  // "all_reduce #17 on group 'world' (local, 4 ranks)"
  std::string prefix(const OpContext& ctx) const {
    return detail::concat(ctx.what, " on group '", name_, "' (local, ", size_,
                          size_ == 1 ? " rank)" : " ranks)");
  }

  void wake() {
    { std::lock_guard<std::mutex> lock(mutex_); }
    cv_.notify_all();
  }

  // Rendezvous `phase` (0 or 1) of collective `seq`. Phase 0 posts `post` and can time out or
  // be aborted; phase 1 is reached by ranks that only do bounded copies after phase 0, so it
  // ignores aborts (a rank must not return while others still touch its buffers).
  Slot& arrive(const OpContext& ctx, uint64_t seq, int phase, const Post* post);

  void leave(uint64_t seq) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = slots_.find(seq);
    if (it != slots_.end() && ++it->second.left == size_) slots_.erase(it);
  }

  void set_created(Slot& slot, int rank, std::shared_ptr<LocalGroup> group) {
    std::lock_guard<std::mutex> lock(mutex_);
    slot.created[rank] = std::move(group);
  }

  // Point to point: eager FIFO mailboxes keyed by (src, dst, tag).
  void deliver(int src, int dst, int tag, Tensor message) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      mailboxes_[{src, dst, tag}].push_back(std::move(message));
    }
    cv_.notify_all();
  }
  // Pops the oldest message of (src, dst, tag); waits with the timeout, wakes on abort.
  Tensor take(const OpContext& ctx, int src, int dst, int tag);

 private:
  const std::string name_;
  const int size_;
  const std::vector<int> world_ranks_;
  const CommOptions options_;
  const std::shared_ptr<AbortState> abort_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<uint64_t, Slot> slots_;
  std::map<std::tuple<int, int, int>, std::deque<Tensor>> mailboxes_;
};

}  // namespace loom::local
