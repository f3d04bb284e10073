// The arrival board, flight-recorder dumps and the flight watchdog of the mpi backend
// (see mpi_flight.h and mpi_backend.h).
#include "comm/mpi/mpi_flight.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>

#include "comm/mpi/mpi_ops.h"

namespace loom::mpi_internal {
namespace {

// ---- the arrival board
// ----------------------------------------------------------------------------

constexpr int kSlots = 4096;      // group ids per rank (8 bytes each: 32 KiB a rank)
constexpr int kWorldIds = 256;    // ids [0, 256) for worlds, the rest for splits
constexpr int kNoBoard = -1;

struct Board {
  std::mutex mutex;  // creation and teardown (at exit) against the watchdog's reads
  std::atomic<int64_t*> base{nullptr};  // (world size + 1) rows of kSlots; null: no board
  int world_size = 0;
  MPI_Win win = MPI_WIN_NULL;
  std::string unavailable = "the arrival board was not created";  // why base is null
  std::atomic<int> next_world_id{0};
  std::atomic<int> next_split_id{kWorldIds};
};

// Leaked on purpose: read by the watchdog thread and the atexit hook.
Board& board() {
  static Board* instance = new Board;
  return *instance;
}

int64_t* slot(int64_t* base, int row, int id) {
  return base + static_cast<size_t>(row) * kSlots + static_cast<size_t>(id);
}
// The row after the ranks' rows: one timeout counter per world id.
int64_t* timeout_slot(int64_t* base, int world_id) { return slot(base, board().world_size, world_id); }

// ---- the flight watchdog (one thread per process, started with the first dumping world)
// ------

std::mutex registry_mutex;
std::vector<std::weak_ptr<MpiFlight>>* registry = nullptr;  // leaked (read at exit)
int signal_pipe[2] = {-1, -1};
std::atomic<int> signal_dumped{0};
struct sigaction previous_action[2];
constexpr int kSignals[2] = {SIGTERM, SIGABRT};

std::vector<std::shared_ptr<MpiFlight>> live_flights() {
  std::lock_guard<std::mutex> guard(registry_mutex);
  std::vector<std::shared_ptr<MpiFlight>> live;
  if (registry == nullptr) return live;
  std::erase_if(*registry, [](const std::weak_ptr<MpiFlight>& w) { return w.expired(); });
  for (auto& w : *registry)
    if (auto f = w.lock()) live.push_back(std::move(f));
  return live;
}

// mpirun tears the job down with SIGTERM (and a rank that dies of an uncaught exception raises
// SIGABRT). Dumping needs allocation and locks, which a signal handler must not do, so the
// handler hands the signal to the watchdog through a pipe, waits up to 2 s for its dump, and
// then re-raises the signal with the previous disposition. Best effort: mpirun may SIGKILL
// sooner, and a signal that arrives while the watchdog itself holds a recorder lock it needs
// is only waited for, never deadlocked on.
void on_fatal_signal(int sig) {
  const int saved_errno = errno;
  if (signal_pipe[1] >= 0 && signal_dumped.load() == 0) {
    [[maybe_unused]] ssize_t n = write(signal_pipe[1], &sig, sizeof sig);
    const timespec step{0, 10'000'000};
    for (int i = 0; i < 200 && signal_dumped.load() == 0; ++i) nanosleep(&step, nullptr);
  }
  for (int i = 0; i < 2; ++i)
    if (kSignals[i] == sig) sigaction(sig, &previous_action[i], nullptr);
  errno = saved_errno;
  raise(sig);  // delivered with the previous disposition once this handler returns
}

[[noreturn]] void watchdog_loop() {
  // Process-directed SIGTERM must go to another thread, whose handler waits for this one.
  sigset_t block;
  sigemptyset(&block);
  for (int s : kSignals) sigaddset(&block, s);
  pthread_sigmask(SIG_BLOCK, &block, nullptr);
  for (;;) {
    pollfd fd{signal_pipe[0], POLLIN, 0};
    if (poll(&fd, 1, 100) > 0 && (fd.revents & POLLIN)) {
      int sig = 0;
      if (read(signal_pipe[0], &sig, sizeof sig) == static_cast<ssize_t>(sizeof sig)) {
        for (auto& f : live_flights())
          f->dump_now(std::string("received ") + (sig == SIGTERM ? "SIGTERM" : "SIGABRT") +
                      ": the job is being torn down");
        signal_dumped.store(1);
      }
    }
    // Under the board's mutex: board_at_exit must not free the window under these reads.
    std::lock_guard<std::mutex> guard(board().mutex);
    for (auto& f : live_flights()) f->dump_if_peer_timed_out();
  }
}

void register_flight(const std::shared_ptr<MpiFlight>& flight) {
  static std::once_flag once;
  std::call_once(once, [] {
    registry = new std::vector<std::weak_ptr<MpiFlight>>;
    if (pipe(signal_pipe) == 0) {
      struct sigaction action {};
      action.sa_handler = on_fatal_signal;
      action.sa_flags = SA_RESTART;  // the interrupted thread's system call resumes meanwhile
      sigemptyset(&action.sa_mask);
      for (int i = 0; i < 2; ++i) sigaction(kSignals[i], &action, &previous_action[i]);
    }
    std::thread(watchdog_loop).detach();
  });
  std::lock_guard<std::mutex> guard(registry_mutex);
  registry->push_back(flight);
}

// At exit (before MPI_Finalize: atexit runs hooks in reverse order): last chance for a rank
// that never waited to dump, then the board is freed (collective, like MPI_Finalize itself).
void board_at_exit() {
  for (auto& f : live_flights()) f->dump_if_peer_timed_out();
  Board& b = board();
  std::lock_guard<std::mutex> guard(b.mutex);
  b.base.store(nullptr);
  if (b.win != MPI_WIN_NULL && !mpi_finalized()) {
    auto lock = mpi_lock();
    MPI_Win_free(&b.win);
  }
}

}  // namespace

void ensure_arrival_board() {
  static std::once_flag once;
  std::call_once(once, [] {
    Board& b = board();
    std::lock_guard<std::mutex> guard(b.mutex);
    auto lock = mpi_lock();
    int world_rank = 0, world_size = 1, node_size = 0;
    MPI_Comm node = MPI_COMM_NULL;
    if (MPI_Comm_rank(MPI_COMM_WORLD, &world_rank) != MPI_SUCCESS ||
        MPI_Comm_size(MPI_COMM_WORLD, &world_size) != MPI_SUCCESS ||
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, world_rank, MPI_INFO_NULL,
                            &node) != MPI_SUCCESS) {
      b.unavailable = "the arrival board could not be created";
      return;
    }
    MPI_Comm_size(node, &node_size);
    // Every rank computes the same answer (node sizes differ only when ranks span nodes), so
    // either all ranks go on to the collective allocation or none does.
    int all_local = node_size == world_size ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &all_local, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!all_local) {
      b.unavailable = "the ranks span several nodes (the arrival board needs one)";
      MPI_Comm_free(&node);
      return;
    }
    // Rank 0 allocates every row (contiguous, so row r is at r · kSlots from its base).
    const MPI_Aint bytes =
        world_rank == 0 ? static_cast<MPI_Aint>(world_size + 1) * kSlots * sizeof(int64_t) : 0;
    void* mine = nullptr;
    int ok = MPI_Win_allocate_shared(bytes, sizeof(int64_t), MPI_INFO_NULL, node, &mine, &b.win) ==
             MPI_SUCCESS;
    int64_t* base = nullptr;
    if (ok) {
      MPI_Aint size = 0;
      int unit = 0;
      ok = MPI_Win_shared_query(b.win, 0, &size, &unit, &base) == MPI_SUCCESS;
    }
    if (ok && world_rank == 0)
      std::memset(base, 0, static_cast<size_t>(world_size + 1) * kSlots * sizeof(int64_t));
    MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, node);  // also orders the memset
    MPI_Comm_free(&node);
    if (!ok) {
      b.unavailable = "the arrival board could not be allocated";
      return;
    }
    b.world_size = world_size;
    b.base.store(base);
    std::atexit(board_at_exit);
  });
}

int next_world_board_id() {
  const int id = board().next_world_id.fetch_add(1);
  return id < kWorldIds ? id : kNoBoard;
}

int agree_split_board_id(MPI_Comm comm) {
  Board& b = board();
  int id = b.next_split_id.load();
  {
    auto lock = mpi_lock();
    LOOM_MPI_CALL(MPI_Allreduce, MPI_IN_PLACE, &id, 1, MPI_INT, MPI_MAX, comm);
  }
  int next = b.next_split_id.load();
  while (next < id + 1 && !b.next_split_id.compare_exchange_weak(next, id + 1)) {
  }
  return id < kSlots ? id : kNoBoard;
}

// ---- MpiFlight
// ------------------------------------------------------------------------------------

MpiFlight::MpiFlight(const CommOptions& options, int world_rank, int world_size,
                     int world_board_id)
    : recorder_(options.flight_capacity),
      dir_(options.flight_dir),
      world_rank_(world_rank),
      world_size_(world_size),
      world_board_id_(world_board_id) {}

MpiFlight::~MpiFlight() { dump_if_peer_timed_out(); }

bool MpiFlight::peer_timed_out() const {
  int64_t* base = board().base.load(std::memory_order_acquire);
  if (base == nullptr || world_board_id_ < 0) return false;
  return std::atomic_ref<int64_t>(*timeout_slot(base, world_board_id_))
             .load(std::memory_order_acquire) > 0;
}

std::string MpiFlight::dump_once(const std::string& reason) {
  std::lock_guard<std::mutex> guard(dump_mutex_);
  if (dumped_) return "";
  dumped_ = true;
  try {
    recorder_.dump(dir_, world_rank_, world_size_, reason);
    return "";
  } catch (const std::exception& e) {
    return std::string(" (flight recorder dump failed: ") + e.what() + ")";
  }
}

std::string MpiFlight::on_timeout(const std::string& message) {
  if (int64_t* base = board().base.load(std::memory_order_acquire); base && world_board_id_ >= 0)
    std::atomic_ref<int64_t>(*timeout_slot(base, world_board_id_)).fetch_add(1);
  return dir_.empty() ? "" : dump_once(message);
}

void MpiFlight::dump_if_peer_timed_out() {
  if (dir_.empty() || !peer_timed_out()) return;
  dump_once(detail::concat("another rank of the world timed out (seen by rank ", world_rank_, ")"));
}

void MpiFlight::dump_now(const std::string& reason) {
  if (!dir_.empty()) dump_once(reason);
}

std::shared_ptr<MpiFlight> make_flight(const CommOptions& options, int world_rank, int world_size,
                                       int world_board_id) {
  auto flight = std::make_shared<MpiFlight>(options, world_rank, world_size, world_board_id);
  if (flight->dumps()) register_flight(flight);
  return flight;
}

// ---- MpiGroupInfo
// ---------------------------------------------------------------------------------

void MpiGroupInfo::mark_issued(int64_t seq) const {
  if (board_id < 0) return;
  int64_t* base = board().base.load(std::memory_order_acquire);
  if (base == nullptr) return;
  std::atomic_ref<int64_t>(*slot(base, world_ranks[rank], board_id))
      .store(seq + 1, std::memory_order_release);
}

std::string MpiGroupInfo::not_arrived(int64_t seq) const {
  int64_t* base = board().base.load(std::memory_order_acquire);
  if (base == nullptr || board_id < 0) {
    return "; ranks that did not arrive: unknown (" +
           (base == nullptr ? board().unavailable : std::string("too many groups for the arrival board")) +
           ")";
  }
  std::string ranks, last;
  for (int r = 0; r < size; ++r) {
    const int64_t issued = std::atomic_ref<int64_t>(*slot(base, world_ranks[r], board_id))
                               .load(std::memory_order_acquire);
    if (issued > seq) continue;
    ranks += detail::concat(ranks.empty() ? "" : ", ", r);
    last += detail::concat(last.empty() ? "" : "; ", "rank ", r,
                           issued == 0 ? " none" : detail::concat(" #", issued - 1));
  }
  if (ranks.empty()) {
    return "; every rank of the group issued it, so none is missing: a rank is still inside an "
           "earlier operation, or MPI is stuck";
  }
  return detail::concat("; rank(s) ", ranks, " did not arrive (last issued on this group: ", last,
                        ")");
}

}  // namespace loom::mpi_internal
