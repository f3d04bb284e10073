// Making nccl communicators: make_nccl_world (the ncclUniqueId through a host communicator,
// ncclCommInitRankConfig) and NcclCommunicator::split (ncclCommSplit); both non-blocking and
// bounded by the timeout, and both join the rank's flight recorder (nccl_shared.h).
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "comm/nccl/nccl_backend.h"
#include "comm/nccl/nccl_shared.h"
#include "device/cuda/cuda_check.h"

namespace loom {

using namespace nccl;

namespace {
// Waits for a new communicator (init or split, non-blocking) to be ready; on failure or timeout
// aborts it and throws "nccl: <where>: <call> <why>".
void settle_new(ncclComm_t comm, ncclResult_t result, std::chrono::milliseconds timeout,
                const char* call, const std::string& where, const char* hint) {
  if (comm != nullptr) result = poll_state(comm, result, Clock::now() + timeout);
  if (result == ncclSuccess) return;
  const std::string why =
      result == ncclInProgress
          ? "timed out after " + seconds_str(timeout) + hint
          : detail::concat("failed: ", ncclGetErrorString(result), ": ", ncclGetLastError(comm));
  if (comm != nullptr) (void)ncclCommAbort(comm);
  comm_fail(where, ": ", call, " ", why);
}

// The world ranks of a new communicator's members, by its ranks: one all-gather of a word each
// over it (ncclCommSplit orders them by key, then by parent rank; only the members know theirs).
std::vector<int> gather_world_ranks(const std::shared_ptr<NcclShared>& s, int world_rank) {
  const std::vector<int64_t> ranks =
      all_gather_words(s, {world_rank}, "the exchange of world ranks on " + s->group());
  return std::vector<int>(ranks.begin(), ranks.end());
}

// Gives a set-up communicator its flight state: this rank's recorder, its group's name there
// ("nccl:<name>") and its members' world ranks.
void join_flight(const std::shared_ptr<NcclShared>& s, std::shared_ptr<NcclFlight> flight,
                 std::vector<int> world_ranks) {
  std::lock_guard<std::mutex> lock(s->mutex);
  s->flight_group = "nccl:" + s->name;
  flight->recorder.add_group(s->flight_group, world_ranks);
  s->world_ranks = std::move(world_ranks);
  s->flight = std::move(flight);
}
}  // namespace

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key) {
  NcclShared& s = *shared_;
  ncclComm_t child = nullptr;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    const int64_t seq = s.next_seq++;
    OpInfo op(detail::concat("split #", seq, " (color ", color, ", key ", key, ") on ", s.group()),
              seq);
    const std::string& what = op.what;
    s.check_usable_locked(what);
    // In the flight records as the local backend has it: completed once the child is ready.
    if (s.flight) op.flight_ids = {s.flight->recorder.issued(s.flight_group, seq, "split", "", 0)};
    const auto record = [&](void (FlightRecorder::*state)(uint64_t)) {
      for (uint64_t id : op.flight_ids) (s.flight->recorder.*state)(id);
    };
    cuda::DeviceGuard guard(s.device);
    ncclConfig_t config = nonblocking_config();
    const ncclResult_t r =
        ncclCommSplit(s.comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config);
    // Without a child (color < 0, or an error) the parent's state says how the split went.
    if (child == nullptr || r != ncclInProgress) s.settle_locked(r, "ncclCommSplit", op);
    if (child != nullptr) {
      try {
        settle_new(child, r, s.options.timeout, "ncclCommSplit", what, "");
      } catch (...) {
        record(&FlightRecorder::failed);
        throw;
      }
    }
    record(&FlightRecorder::completed);
    if (child == nullptr) return nullptr;
  }
  const std::string child_name = detail::concat(name_, "/split(color=", color, ")");
  std::shared_ptr<NcclShared> made = wrap(child, s.device, child_name, s.options);
  // A new communicator aborts and frees itself when a later step fails (~NcclCommunicator).
  auto result = std::make_unique<NcclCommunicator>(made, child_name);
  if (s.flight) join_flight(made, s.flight, gather_world_ranks(made, s.flight->world_rank));
  return result;
}

std::unique_ptr<Communicator> make_nccl_world(Communicator& bootstrap, int cuda_device,
                                              const CommOptions& options) {
  const std::string where =
      detail::concat("creating group '", bootstrap.name(), "' (size ", bootstrap.size(), ", rank ",
                     bootstrap.rank(), ") on cuda:", cuda_device);
  int gpus = 0;
  const cudaError_t err = cudaGetDeviceCount(&gpus);
  if (err != cudaSuccess)
    comm_fail(where, ": no GPU: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  if (cuda_device < 0 || cuda_device >= gpus)
    comm_fail(where, ": this machine has ", gpus, " GPU(s)");

  // Rank 0's id, as 32 i32 through the bootstrap (a host tensor, any host backend).
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  Tensor bytes = Tensor::zeros({32}, DType::kI32);
  if (bootstrap.rank() == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) comm_fail(where, ": ncclGetUniqueId failed: ", ncclGetErrorString(r));
    std::memcpy(bytes.raw(), &id, sizeof id);
  }
  bootstrap.broadcast(bytes, 0);
  std::memcpy(&id, bytes.raw(), sizeof id);

  cuda::DeviceGuard guard(cuda_device);
  ncclConfig_t config = nonblocking_config();
  ncclComm_t comm = nullptr;
  const ncclResult_t r =
      ncclCommInitRankConfig(&comm, bootstrap.size(), id, bootstrap.rank(), &config);
  settle_new(comm, r, options.timeout, "ncclCommInitRankConfig", where,
             " (did every rank call make_nccl_world?)");
  CommOptions opts = options;
  if (const char* env = std::getenv("LOOM_COMM_DEBUG"); env && std::string_view(env) == "1")
    opts.debug_checks = true;
  std::shared_ptr<NcclShared> made = wrap(comm, cuda_device, bootstrap.name(), opts);
  // The ranks of this world in this process find each other by its id (thread ranks).
  std::shared_ptr<NcclWorldPeers> peers = world_peers(id);
  auto flight = std::make_shared<NcclFlight>(opts, bootstrap.rank(), bootstrap.size(), peers);
  {
    std::lock_guard<std::mutex> lock(peers->mutex);
    peers->by_rank[bootstrap.rank()] = flight;
  }
  std::vector<int> world_ranks(static_cast<size_t>(bootstrap.size()));
  for (int i = 0; i < bootstrap.size(); ++i) world_ranks[static_cast<size_t>(i)] = i;
  join_flight(made, std::move(flight), std::move(world_ranks));
  return std::make_unique<NcclCommunicator>(made, bootstrap.name());
}

}  // namespace loom
