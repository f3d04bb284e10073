#include "kernels/op_profile.h"

#include <algorithm>
#include <map>
#include <mutex>

#include "base/timer.h"
#include "kernels/cuda/kernels.h"

namespace loom::ops {

namespace detail {
std::atomic<bool> g_profiling{false};
}  // namespace detail

namespace {

struct Table {
  std::mutex mutex;
  std::map<std::string, OpTime> ops;
  struct Pending {  // a GPU op's events, read at stop_profile
    const char* name;
    OpWork work;
    void* start;
    void* stop;
  };
  std::vector<Pending> pending;
};

Table& table() {
  static Table t;
  return t;
}

void add(Table& t, const char* name, const OpWork& work, double ms) {  // t.mutex held
  OpTime& op = t.ops[name];
  op.name = name;
  ++op.calls;
  op.ms += ms;
  op.work.flops += work.flops;
  op.work.bytes += work.bytes;
}

}  // namespace

void start_profile() {
  Table& t = table();
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    t.ops.clear();
    t.pending.clear();
  }
  detail::g_profiling.store(true);
}

std::vector<OpTime> stop_profile() {
  detail::g_profiling.store(false);
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
#ifdef LOOM_WITH_CUDA
  for (const auto& p : t.pending)
    add(t, p.name, p.work, cuda::elapsed_ms_and_release(p.start, p.stop));
#endif
  t.pending.clear();
  std::vector<OpTime> out;
  for (const auto& [name, op] : t.ops) out.push_back(op);
  std::sort(out.begin(), out.end(), [](const OpTime& a, const OpTime& b) { return a.ms > b.ms; });
  return out;
}

namespace detail {

void OpScope::begin(const char* name, const Exec& ex, OpWork work) {
  name_ = name;
  work_ = work;
  device_ = ex.device;
#ifdef LOOM_WITH_CUDA
  if (device_.is_cuda()) {
    events_[0] = cuda::record_timing_event(device_.index);
    return;
  }
#endif
  start_s_ = now_seconds();
}

void OpScope::end() {
  Table& t = table();
#ifdef LOOM_WITH_CUDA
  if (device_.is_cuda()) {
    void* stop = cuda::record_timing_event(device_.index);
    std::lock_guard<std::mutex> lock(t.mutex);
    t.pending.push_back({name_, work_, events_[0], stop});
    return;
  }
#endif
  const double ms = (now_seconds() - start_s_) * 1e3;
  std::lock_guard<std::mutex> lock(t.mutex);
  add(t, name_, work_, ms);
}

}  // namespace detail
}  // namespace loom::ops
