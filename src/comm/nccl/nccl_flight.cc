// NcclFlight: a rank's flight recorder for one nccl world (nccl_shared.h), and the registry by
// which the thread ranks of a world find each other's records.
#include <algorithm>
#include <exception>

#include "comm/nccl/nccl_shared.h"

namespace loom::nccl {
namespace {
std::string join(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}
}  // namespace

std::shared_ptr<NcclFlight> NcclWorldPeers::find(int world_rank) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = by_rank.find(world_rank);
  return it == by_rank.end() ? nullptr : it->second.lock();
}

std::vector<std::shared_ptr<NcclFlight>> NcclWorldPeers::all() {
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<std::shared_ptr<NcclFlight>> out;
  for (auto& [rank, flight] : by_rank)
    if (auto f = flight.lock()) out.push_back(std::move(f));
  return out;
}

std::shared_ptr<NcclWorldPeers> world_peers(const ncclUniqueId& id) {
  static std::mutex mutex;
  static std::map<std::string, std::weak_ptr<NcclWorldPeers>> worlds;
  std::lock_guard<std::mutex> lock(mutex);
  std::erase_if(worlds, [](const auto& w) { return w.second.expired(); });
  std::weak_ptr<NcclWorldPeers>& slot = worlds[std::string(id.internal, sizeof id.internal)];
  std::shared_ptr<NcclWorldPeers> peers = slot.lock();
  if (!peers) {
    peers = std::make_shared<NcclWorldPeers>();
    slot = peers;
  }
  return peers;
}

void NcclFlight::started(const std::vector<uint64_t>& ids, const EventRef& done,
                         const void* owner) {
  std::lock_guard<std::mutex> lock(mutex);
  for (uint64_t id : ids) {
    recorder.started(id);
    pending.push_back({id, done, owner});
  }
}

void NcclFlight::reap_locked() {
  std::erase_if(pending, [&](const Pending& p) {
    const cudaError_t state = cudaEventQuery(p.done.get());
    if (state == cudaErrorNotReady) return false;
    if (state == cudaSuccess)
      recorder.completed(p.id);
    else
      recorder.failed(p.id);
    return true;
  });
}

void NcclFlight::reap() {
  std::lock_guard<std::mutex> lock(mutex);
  reap_locked();
}

std::string NcclFlight::dump(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex);
  if (dir.empty() || dumped) return "";
  dumped = true;
  reap_locked();
  try {
    recorder.dump(dir, world_rank, world_size, reason, "nccl");
    return "";
  } catch (const std::exception& e) {
    return std::string(" (flight recorder dump failed: ") + e.what() + ")";
  }
}

void NcclFlight::failed(const std::vector<uint64_t>& ids) {
  std::lock_guard<std::mutex> lock(mutex);
  for (uint64_t id : ids) recorder.failed(id);
  std::erase_if(pending, [&](const Pending& p) { return std::ranges::count(ids, p.id) > 0; });
}

void NcclFlight::abandon(const void* owner) {
  std::lock_guard<std::mutex> lock(mutex);
  std::erase_if(pending, [&](const Pending& p) { return p.owner == owner; });
}

std::string NcclFlight::dump_world(const std::string& reason) {
  const std::string note = dump(reason);
  for (const auto& peer : peers->all())
    if (peer.get() != this)
      (void)peer->dump(detail::concat("rank ", world_rank, " failed: ", reason));
  return note;
}

std::string NcclFlight::not_arrived(const std::string& group, int64_t seq,
                                    const std::vector<int>& members) const {
  std::vector<int> absent, elsewhere;
  for (int m : members) {
    if (m == world_rank) continue;
    const std::shared_ptr<NcclFlight> peer = peers->find(m);
    if (!peer)
      elsewhere.push_back(m);
    else if (peer->recorder.last_seq(group) < seq)
      absent.push_back(m);
  }
  std::string out;
  if (!absent.empty())
    out = detail::concat("; rank(s) ", join(absent), " did not arrive");
  else if (elsewhere.empty())
    out = "; every rank issued it";
  if (!elsewhere.empty())
    out += detail::concat("; whether rank(s) ", join(elsewhere),
                          " arrived is unknown here (other processes)");
  if (!dir.empty() && !elsewhere.empty())
    out += detail::concat(": `loom debug hang` reads the flight dumps in ", dir);
  return out;
}

}  // namespace loom::nccl
