// The local backend: thread ranks, shared-memory collectives. See local_backend.h for the design.
//
// One collective, step by step (all_reduce on n ranks, sequence number s):
//   step 0: rank r posts (op, count, dtype, root, buffer pointers) in slot s of the group and
//           waits until all n ranks posted (rendezvous 0, with the timeout);
//   check:  every rank compares all posts with rank 0's; a mismatch throws on every rank;
//   step 1: rank r reduces chunk r of all buffers in rank order 0..n-1, block by block, and
//           writes the block into chunk r of every buffer (chunk r is rank r's alone);
//   step 2: rendezvous 1: nobody returns (and reuses its buffer) while others still touch it;
//           the last rank to leave erases the slot.
#include "comm/local/local_backend.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "comm/local/local_group.h"
#include "comm/local/local_reduce.h"

namespace loom {
namespace {

using local::AbortState;
using local::chunk_range;
using local::Clock;
using local::copy_bytes;
using local::LocalGroup;
using local::OpContext;
using local::OpKind;
using local::Post;
using local::reduce_buffers;
using local::Slot;

// A failure crosses threads as its message and is thrown afresh by wait(): an exception object
// shared through std::exception_ptr is freed by whichever thread drops it last, which
// ThreadSanitizer (with an uninstrumented libstdc++) reports as a race.
class LocalWork final : public Work {
 public:
  void wait() override {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
    if (failed_) throw CommError(error_);
  }
  bool test() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  void finish(bool failed, std::string error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      failed_ = failed;
      error_ = std::move(error);
      done_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  bool failed_ = false;
  std::string error_;
};

// One rank's flight recorder and its dump-once flag, shared by the rank's communicators.
struct RankFlight {
  RankFlight(const CommOptions& options, int rank, int ranks)
      : recorder(options.flight_capacity),
        dir(options.flight_dir),
        world_rank(rank),
        world_size(ranks) {}
  FlightRecorder recorder;
  const std::string dir;
  const int world_rank;
  const int world_size;
  std::atomic<bool> dumped{false};

  // Dumps once, when dir is set; returns a note for the error message if the dump failed.
  std::string dump(const std::string& reason) {
    if (dir.empty() || dumped.exchange(true)) return "";
    try {
      recorder.dump(dir, world_rank, world_size, reason);
      return "";
    } catch (const std::exception& e) {
      return std::string(" (flight recorder dump failed: ") + e.what() + ")";
    }
  }
};

void check_cpu(const Tensor& t, std::string_view what) {
  if (!t.defined()) fail("local backend: ", what, ": undefined tensor");
  if (!t.device().is_cpu()) {
    fail("local backend: ", what, ": tensor on ", t.device().str(),
         ", only cpu tensors are supported");
  }
}

// This rank's part of a collective: `count` elements of `dtype` read from `in`, written to `out`.
Post post_of(OpKind kind, int64_t count, DType dtype, int root, ReduceOp op, const Tensor& in,
             const Tensor& out) {
  const auto* from = static_cast<const std::byte*>(in.raw());
  auto* to = static_cast<std::byte*>(out.raw());
  return Post{kind, count, dtype, root, op, from, to};
}

class LocalCommunicatorImpl final : public LocalCommunicator {
 public:
  LocalCommunicatorImpl(std::shared_ptr<LocalGroup> group, int rank,
                        std::shared_ptr<RankFlight> flight, bool is_world)
      : group_(std::move(group)), rank_(rank), flight_(std::move(flight)), is_world_(is_world) {
    flight_->recorder.add_group(group_->name(), group_->world_ranks());
    if (group_->size() > 1) progress_ = std::thread([this] { progress_loop(); });
  }
  ~LocalCommunicatorImpl() override {
    if (progress_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
      }
      cv_.notify_all();
      progress_.join();  // drains the queue first; every op ends within its timeout
    }
    // A rank that was in no operation when the world was aborted (e.g. it skipped the
    // collective the others wait in) dumps here; see local_backend.h.
    if (is_world_ && group_->abort_state().aborted())
      flight_->dump("world aborted: " + group_->abort_state().reason());
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  std::string name() const override { return group_->name(); }
  std::string backend() const override { return "local"; }
  void abort(const std::string& reason) override { group_->abort_state().abort(reason); }
  const FlightRecorder& flight_recorder() const override { return flight_->recorder; }

  WorkHandle all_reduce_async(Tensor& tensor, ReduceOp op) override {
    check_cpu(tensor, "all_reduce");
    const Post p =
        post_of(OpKind::kAllReduce, tensor.numel(), tensor.dtype(), -1, op, tensor, tensor);
    return collective(p, {tensor}, [this](const std::vector<Post>& posts) {
      const Post& me = posts[rank_];
      const size_t elem = dtype_size(me.dtype);
      auto [b, e] = chunk_range(me.count, elem, size(), rank_);
      std::vector<const std::byte*> ins;
      std::vector<std::byte*> outs;
      for (const Post& q : posts) {
        ins.push_back(q.in + b * elem);
        outs.push_back(q.out + b * elem);
      }
      reduce_buffers(me.dtype, me.op, ins, outs, e - b);
    });
  }

  WorkHandle reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) override {
    check_cpu(input, "reduce_scatter input");
    check_cpu(output, "reduce_scatter output");
    if (input.dtype() != output.dtype() || input.numel() != output.numel() * size()) {
      fail("reduce_scatter on group '", name(),
           "': input must hold size() × output elements of the output's dtype, got ", input.numel(),
           " ", dtype_name(input.dtype()), " for ", output.numel(), " ", dtype_name(output.dtype()),
           " on ", size(), " ranks");
    }
    const Post p =
        post_of(OpKind::kReduceScatter, output.numel(), output.dtype(), -1, op, input, output);
    return collective(p, {input, output}, [this](const std::vector<Post>& posts) {
      const Post& me = posts[rank_];
      const size_t bytes = static_cast<size_t>(me.count) * dtype_size(me.dtype);
      std::vector<const std::byte*> ins;
      for (const Post& q : posts) ins.push_back(q.in + rank_ * bytes);
      reduce_buffers(me.dtype, me.op, ins, {me.out}, me.count);
    });
  }

  WorkHandle all_gather_async(const Tensor& input, Tensor& output) override {
    check_cpu(input, "all_gather input");
    check_cpu(output, "all_gather output");
    if (input.dtype() != output.dtype() || output.numel() != input.numel() * size()) {
      fail("all_gather on group '", name(),
           "': output must hold size() × input elements of the input's dtype, got ", output.numel(),
           " ", dtype_name(output.dtype()), " for ", input.numel(), " ", dtype_name(input.dtype()),
           " on ", size(), " ranks");
    }
    const Post p = post_of(OpKind::kAllGather, input.numel(), input.dtype(), -1, ReduceOp::kSum,
                           input, output);
    return collective(p, {input, output}, [this](const std::vector<Post>& posts) {
      const Post& me = posts[rank_];
      const size_t bytes = static_cast<size_t>(me.count) * dtype_size(me.dtype);
      for (int r = 0; r < size(); ++r) copy_bytes(me.out + r * bytes, posts[r].in, bytes);
    });
  }

  WorkHandle broadcast_async(Tensor& tensor, int root) override {
    check_cpu(tensor, "broadcast");
    check_root(root, "broadcast");
    const Post p = post_of(OpKind::kBroadcast, tensor.numel(), tensor.dtype(), root, ReduceOp::kSum,
                           tensor, tensor);
    return collective(p, {tensor}, [this](const std::vector<Post>& posts) {
      const Post& me = posts[rank_];
      copy_bytes(me.out, posts[me.root].in, static_cast<size_t>(me.count) * dtype_size(me.dtype));
    });
  }

  WorkHandle reduce_async(Tensor& tensor, int root, ReduceOp op) override {
    check_cpu(tensor, "reduce");
    check_root(root, "reduce");
    const Post p =
        post_of(OpKind::kReduce, tensor.numel(), tensor.dtype(), root, op, tensor, tensor);
    return collective(p, {tensor}, [this](const std::vector<Post>& posts) {
      const Post& me = posts[rank_];
      const size_t elem = dtype_size(me.dtype);
      auto [b, e] = chunk_range(me.count, elem, size(), rank_);
      std::vector<const std::byte*> ins;
      for (const Post& q : posts) ins.push_back(q.in + b * elem);
      reduce_buffers(me.dtype, me.op, ins, {posts[me.root].out + b * elem}, e - b);
    });
  }

  WorkHandle all_to_all_async(const Tensor& input, Tensor& output) override {
    check_cpu(input, "all_to_all input");
    check_cpu(output, "all_to_all output");
    if (input.dtype() != output.dtype() || input.numel() != output.numel() ||
        input.numel() % size() != 0) {
      fail("all_to_all on group '", name(),
           "': input and output must both hold size() × n elements of one dtype, got ",
           input.numel(), " ", dtype_name(input.dtype()), " and ", output.numel(), " ",
           dtype_name(output.dtype()), " on ", size(), " ranks");
    }
    const auto* in = static_cast<const std::byte*>(input.raw());
    auto* out = static_cast<std::byte*>(output.raw());
    if (input.nbytes() > 0 && in < out + output.nbytes() && out < in + input.nbytes()) {
      fail("all_to_all on group '", name(),
           "': input and output overlap; it is not an in-place operation");
    }
    const Post p = post_of(OpKind::kAllToAll, input.numel() / size(), input.dtype(), -1,
                           ReduceOp::kSum, input, output);
    return collective(p, {input, output}, [this](const std::vector<Post>& posts) {
      const Post& me = posts[rank_];
      const size_t bytes = static_cast<size_t>(me.count) * dtype_size(me.dtype);
      for (int r = 0; r < size(); ++r)
        copy_bytes(me.out + r * bytes, posts[r].in + rank_ * bytes, bytes);
    });
  }

  // Every rank copies its blocks straight from the senders' inputs, as all_to_all does (the
  // default's messages would copy each block twice). The posts carry every rank's offsets, so
  // each rank checks the whole exchange — rank r's block for s as long as s expects — and all
  // refuse a mismatch alike, none left waiting.
  WorkHandle all_to_all_v_async(const Tensor& input, const std::vector<int64_t>& send_counts,
                                Tensor& output, const std::vector<int64_t>& recv_counts) override {
    check_cpu(input, "all_to_all_v input");
    check_cpu(output, "all_to_all_v output");
    const auto [send_at, recv_at] = all_to_all_v_offsets(input, send_counts, output, recv_counts);
    const auto* in = static_cast<const std::byte*>(input.raw());
    auto* out = static_cast<std::byte*>(output.raw());
    if (input.nbytes() > 0 && output.nbytes() > 0 && in < out + output.nbytes() &&
        out < in + input.nbytes())
      fail("all_to_all_v on group '", name(), "': input and output overlap");
    const int n = size();
    Tensor blocks = Tensor::empty({2 * (n + 1)}, DType::kI64);
    std::copy(send_at.begin(), send_at.end(), blocks.data<int64_t>());
    std::copy(recv_at.begin(), recv_at.end(), blocks.data<int64_t>() + n + 1);
    Post p = post_of(OpKind::kAllToAllV, 0, input.dtype(), -1, ReduceOp::kSum, input, output);
    p.blocks = blocks.data<int64_t>();
    return collective(p, {input, output, blocks}, [this, n](const std::vector<Post>& posts) {
      const auto sent = [&](int from, int to) {
        return posts[from].blocks[to + 1] - posts[from].blocks[to];
      };
      const auto expected = [&](int at, int from) {
        return posts[at].blocks[n + 1 + from + 1] - posts[at].blocks[n + 1 + from];
      };
      for (int r = 0; r < n; ++r)
        for (int s = 0; s < n; ++s)
          if (sent(r, s) != expected(s, r))
            throw CommError(detail::concat("all_to_all_v on group '", name(), "': rank ", r,
                                           " sends rank ", s, " ", sent(r, s),
                                           " elements, which expects ", expected(s, r)));
      const Post& me = posts[rank_];
      const size_t element = dtype_size(me.dtype);
      for (int r = 0; r < n; ++r)
        copy_bytes(me.out + me.blocks[n + 1 + r] * element,
                   posts[r].in + posts[r].blocks[rank_] * element,
                   static_cast<size_t>(sent(r, rank_)) * element);
    });
  }

  WorkHandle barrier_async() override {
    Post p{OpKind::kBarrier};
    return collective(p, {}, nullptr);
  }

  WorkHandle send_async(const Tensor& tensor, int dst, int tag) override {
    check_cpu(tensor, "send");
    check_peer(dst, "send to");
    const int n = send_count_[{dst, tag}]++;
    const uint64_t id = flight_->recorder.issued(
        name() + ":p2p", n, detail::concat("send(dst=", dst, ", tag=", tag, ")"),
        std::string(dtype_name(tensor.dtype())), tensor.numel());
    return enqueue(id,
                   [this, tensor, dst, tag] { group_->deliver(rank_, dst, tag, tensor.clone()); });
  }

  WorkHandle recv_async(Tensor& tensor, int src, int tag) override {
    check_cpu(tensor, "recv");
    check_peer(src, "recv from");
    const int n = recv_count_[{src, tag}]++;
    const uint64_t id = flight_->recorder.issued(
        name() + ":p2p", n, detail::concat("recv(src=", src, ", tag=", tag, ")"),
        std::string(dtype_name(tensor.dtype())), tensor.numel());
    return enqueue(id, [this, tensor, src, tag, n] {
      OpContext ctx{detail::concat("recv #", n, " from rank ", src, " (tag ", tag, ")"), rank_,
                    deadline()};
      Tensor message = group_->take(ctx, src, rank_, tag);
      if (message.numel() != tensor.numel() || message.dtype() != tensor.dtype()) {
        throw CommError(detail::concat(group_->prefix(ctx), ": rank ", src, " sent ",
                                       message.numel(), " ", dtype_name(message.dtype()),
                                       " elements, the receive buffer holds ", tensor.numel(), " ",
                                       dtype_name(tensor.dtype())));
      }
      copy_bytes(static_cast<std::byte*>(tensor.raw()),
                 static_cast<const std::byte*>(message.raw()), tensor.nbytes());
    });
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    std::unique_ptr<Communicator> result;
    Post p{OpKind::kSplit};
    p.color = color;
    p.key = key;
    const uint64_t seq = next_seq_++;
    const uint64_t id = flight_->recorder.issued(name(), static_cast<int64_t>(seq),
                                                 std::string(op_kind_name(OpKind::kSplit)), "", 0);
    enqueue(id, [this, p, seq, color, &result] {
      OpContext ctx = context(OpKind::kSplit, seq);
      Slot& slot = group_->arrive(ctx, seq, 0, &p);
      SlotGuard guard{group_.get(), seq};
      check_posts(ctx, slot.posts);
      // Members of my color ordered by (key, old rank); the lowest old rank creates the group.
      std::vector<std::pair<int, int>> members;  // (key, old rank)
      for (int r = 0; r < size(); ++r) {
        if (slot.posts[r].color == color) members.emplace_back(slot.posts[r].key, r);
      }
      std::sort(members.begin(), members.end());
      int leader = size();
      for (auto& m : members) leader = std::min(leader, m.second);
      if (color >= 0 && leader == rank_) {
        std::vector<int> world_ranks;
        for (auto& m : members) world_ranks.push_back(group_->world_ranks()[m.second]);
        auto group = std::make_shared<LocalGroup>(
            detail::concat(name(), "/split(color=", color, ")"), std::move(world_ranks),
            group_->options(), group_->abort_ptr());
        group_->abort_state().add(group);
        group_->set_created(slot, rank_, std::move(group));
      }
      group_->arrive(ctx, seq, 1, nullptr);
      if (color < 0) return;
      int new_rank = 0;
      while (members[new_rank].second != rank_) ++new_rank;
      result =
          std::make_unique<LocalCommunicatorImpl>(slot.created[leader], new_rank, flight_, false);
    })->wait();
    return result;
  }

 private:
  struct SlotGuard {
    LocalGroup* group;
    uint64_t seq;
    ~SlotGuard() { group->leave(seq); }
  };

  Clock::time_point deadline() const { return Clock::now() + group_->options().timeout; }

  OpContext context(OpKind kind, uint64_t seq) const {
    return {detail::concat(op_kind_name(kind), " #", seq), rank_, deadline()};
  }

  void check_root(int root, std::string_view what) const {
    if (root < 0 || root >= size())
      fail(what, " on group '", name(), "': root ", root, " is not a rank of ", size());
  }
  void check_peer(int peer, std::string_view what) const {
    if (peer < 0 || peer >= size())
      fail(what, " rank ", peer, " on group '", name(), "': not a rank of ", size());
  }

  // Every rank compares all posts with rank 0's, so every rank reports the same mismatch.
  void check_posts(const OpContext& ctx, const std::vector<Post>& posts) const {
    for (int r = 1; r < size(); ++r) {
      if (!same_call(posts[0], posts[r])) {
        throw CommError(
            detail::concat(group_->prefix(ctx), ": mismatched collective: rank 0 called ",
                           describe(posts[0]), " but rank ", r, " called ", describe(posts[r])));
      }
    }
  }

  // The common path of every collective: rendezvous 0, check, move data, rendezvous 1.
  // `keep` holds the tensors alive until the operation completed.
  WorkHandle collective(const Post& post, std::vector<Tensor> keep,
                        std::function<void(const std::vector<Post>&)> move_data) {
    const uint64_t seq = next_seq_++;
    const bool has_data = post.kind != OpKind::kBarrier && post.kind != OpKind::kSplit;
    const uint64_t id = flight_->recorder.issued(
        name(), static_cast<int64_t>(seq), std::string(op_kind_name(post.kind)),
        has_data ? std::string(dtype_name(post.dtype)) : std::string(), has_data ? post.count : 0);
    return enqueue(id, [this, post, seq, keep = std::move(keep), move_data = std::move(move_data)] {
      OpContext ctx = context(post.kind, seq);
      Slot& slot = group_->arrive(ctx, seq, 0, &post);
      SlotGuard guard{group_.get(), seq};
      check_posts(ctx, slot.posts);
      if (!move_data) return;
      move_data(slot.posts);
      group_->arrive(ctx, seq, 1, nullptr);
    });
  }

  // Runs `run` in issue order: inline for a group of size 1, on the progress thread otherwise.
  // `id`: the operation's flight record (issued already).
  WorkHandle enqueue(uint64_t id, std::function<void()> run) {
    auto work = std::make_shared<LocalWork>();
    if (!progress_.joinable()) {
      std::string error;
      const bool ok = run_op(run, id, error);
      work->finish(!ok, std::move(error));
      return work;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back({std::move(run), work, id});
    }
    cv_.notify_all();
    return work;
  }

  // Runs one operation and records it. When a wait failed (timeout, a peer gave up, abort) or
  // the world is aborted, dumps the flight recorder; on this rank's own timeout also aborts the
  // world so that the other ranks dump theirs (only with flight_dir; see local_backend.h). All
  // before the caller's wait() sees the error.
  bool run_op(const std::function<void()>& run, uint64_t id, std::string& error) {
    flight_->recorder.started(id);
    bool wait_failed = false;
    bool own_timeout = false;
    try {
      run();
      flight_->recorder.completed(id);
      return true;
    } catch (const local::WaitError& e) {
      error = e.what();
      wait_failed = true;
      own_timeout = e.own_timeout();
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "unknown exception";
    }
    flight_->recorder.failed(id);
    if (!flight_->dir.empty() && (wait_failed || group_->abort_state().aborted())) {
      error += flight_->dump(error);
      if (own_timeout) {
        group_->abort_state().abort(
            detail::concat("rank ", flight_->world_rank, " failed: ", error));
      }
    }
    return false;
  }

  void progress_loop() {
    std::string broken;  // after a failed operation the group state is unknown: fail the rest
    for (;;) {
      Pending op;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      std::string error;
      bool ok = false;
      if (!broken.empty()) {
        error = "skipped: an earlier operation on this rank failed: " + broken;
        flight_->recorder.failed(op.id);
      } else if (!(ok = run_op(op.run, op.id, error))) {
        broken = error;
      }
      op.run = nullptr;  // release the tensors before signalling completion
      op.work->finish(!ok, std::move(error));
    }
  }

  struct Pending {
    std::function<void()> run;
    std::shared_ptr<LocalWork> work;
    uint64_t id = 0;  // flight record
  };

  std::shared_ptr<LocalGroup> group_;
  const int rank_;
  uint64_t next_seq_ = 0;                          // issuing thread only
  std::map<std::pair<int, int>, int> recv_count_;  // (source, tag) → receives issued so far
  std::map<std::pair<int, int>, int> send_count_;  // (destination, tag) → sends issued so far
  const std::shared_ptr<RankFlight> flight_;       // this rank's recorder, shared with splits
  const bool is_world_;                            // made by make_local_world (dumps on abort)
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;
  bool stop_ = false;
  std::thread progress_;  // last: started after every other member exists
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_local_world(int size, const CommOptions& options) {
  if (size < 1) fail("make_local_world: size must be >= 1, got ", size);
  CommOptions opts = options;
  if (const char* env = std::getenv("LOOM_COMM_DEBUG"); env && std::string_view(env) == "1")
    opts.debug_checks = true;
  auto abort = std::make_shared<AbortState>();
  std::vector<int> world_ranks(size);
  for (int r = 0; r < size; ++r) world_ranks[r] = r;
  auto group = std::make_shared<LocalGroup>("world", std::move(world_ranks), opts, abort);
  abort->add(group);
  std::vector<std::unique_ptr<Communicator>> world;
  for (int r = 0; r < size; ++r) {
    world.push_back(std::make_unique<LocalCommunicatorImpl>(
        group, r, std::make_shared<RankFlight>(opts, r, size), true));
  }
  return world;
}

}  // namespace loom
