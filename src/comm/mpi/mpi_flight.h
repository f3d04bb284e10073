// The mpi backend's reliability state: the flight recorder and its dumps, and the arrival board
// that names the ranks which did not arrive at a timed-out collective.
// Internal to src/comm/mpi (namespace loom::mpi_internal); see mpi_backend.h for the design.
//
// Arrival board: one MPI_Win_allocate_shared window per process (created collectively by the
// first make_mpi_world, over MPI_COMM_TYPE_SHARED), used only when every rank is on one node.
// Row r (world rank r) holds, per group id, the number of collectives rank r issued on that
// group; issuing a collective is one atomic store into the rank's own row (no message). A rank
// whose wait times out reads the rows of its group's members: those with fewer issued than its
// own sequence number + 1 did not arrive. An extra row holds one timeout counter per world: a
// rank that times out increments its world's counter, and the other ranks of that world see it
// (watchdog thread, next operation, destruction) and dump their flight recorders.
// Group ids: worlds take 0, 1, ... in creation order (every rank creates its worlds in the same
// order, as it must: they all wrap MPI_COMM_WORLD); a split's members agree on the largest of
// their next free ids (one MPI_Allreduce on the new communicator). Ids are never reused within a
// process, so a rank's slot for an id always means the same group.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/flight_recorder.h"

namespace loom::mpi_internal {

// Creates the arrival board once per process; collective over MPI_COMM_WORLD (call it from
// make_mpi_world, after ensure_initialised). Without one node, or on any MPI error, there is
// no board and the messages say that the ranks cannot be named.
void ensure_arrival_board();
// The board id of a new world (-1 when it has none): this process's count of worlds so far.
int next_world_board_id();
// The board id of a new split communicator (-1 when none); collective over `comm`.
int agree_split_board_id(MPI_Comm comm);

// One process's flight recorder for one world (one make_mpi_world call), shared by the world
// communicator, every communicator split from it and their pending operations.
class MpiFlight {
 public:
  MpiFlight(const CommOptions& options, int world_rank, int world_size, int world_board_id);
  // Backstop: dumps if a rank of this world timed out and this rank has not dumped yet.
  ~MpiFlight();
  MpiFlight(const MpiFlight&) = delete;
  MpiFlight& operator=(const MpiFlight&) = delete;

  FlightRecorder& recorder() { return recorder_; }
  int world_rank() const { return world_rank_; }
  bool dumps() const { return !dir_.empty(); }

  // This rank's wait timed out: raises the world's timeout counter (so the other ranks dump)
  // and dumps, when flight_dir is set. Returns a note for the error message if the dump failed.
  std::string on_timeout(const std::string& message);
  // Dumps once if another rank of this world timed out; one shared-memory load when not.
  void dump_if_peer_timed_out();
  // Dumps once, whatever happened (the job is being torn down by a signal).
  void dump_now(const std::string& reason);

 private:
  bool peer_timed_out() const;
  std::string dump_once(const std::string& reason);  // "" or a failure note

  FlightRecorder recorder_;
  const std::string dir_;
  const int world_rank_;
  const int world_size_;
  const int world_board_id_;
  std::mutex dump_mutex_;  // a dump and an operation issued meanwhile do not interleave
  bool dumped_ = false;
};

// A world's flight state; with flight_dir set, also watched by the process's flight watchdog
// thread (dumps when a peer timed out, or on SIGTERM/SIGABRT: see mpi_backend.h).
std::shared_ptr<MpiFlight> make_flight(const CommOptions& options, int world_rank, int world_size,
                                       int world_board_id);

// What an operation needs to know about its group, also after the communicator is gone.
struct MpiGroupInfo {
  std::string name;
  int rank = 0;
  int size = 1;
  std::vector<int> world_ranks;  // members' world ranks, by group rank
  int board_id = -1;             // -1: not on the arrival board
  std::shared_ptr<MpiFlight> flight;

  // Records that this rank issued collective `seq` of the group (one atomic store).
  void mark_issued(int64_t seq) const;
  // The tail of a timeout message for collective `seq`: "; rank(s) 2 did not arrive (...)", or
  // why they cannot be named.
  std::string not_arrived(int64_t seq) const;
};

}  // namespace loom::mpi_internal
