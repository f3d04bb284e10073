// FlightRecorder — each rank's ring buffer of its last collectives, for post-mortems of hangs.
//
// A bare watchdog says "rank 0 timed out in all_reduce". The question users need answered is
// *which rank never got there*. Each rank records every operation it issues (group, sequence
// number, op, dtype, element count) and its state: issued → started → completed (or failed).
// On a timeout every rank dumps its buffer to RUN_DIR/flight/rank_NNNNN.json, and
// `loom debug hang RUN_DIR` (analyze_flight_dumps) reads the dumps and names, per group, the
// ranks that wait at a sequence number and the ranks that never reached it.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace loom {

enum class FlightState { kIssued, kStarted, kCompleted, kFailed };
std::string_view flight_state_name(FlightState state);

struct FlightRecord {
  std::string group;   // communicator name, e.g. "world", "dp[pp=0,tp=1]"
  int64_t seq = 0;     // the group's sequence number of this operation
  std::string op;      // "all_reduce", "send", ...
  std::string dtype;   // "f32", ...
  int64_t count = 0;   // elements
  FlightState state = FlightState::kIssued;
  double t_issued = 0, t_started = 0, t_completed = 0;  // seconds, steady clock
};

class FlightRecorder {
 public:
  explicit FlightRecorder(size_t capacity = 4096);

  // Registers a group this rank belongs to, with its members' world ranks (for the analysis).
  void add_group(const std::string& group, std::vector<int> world_ranks);
  // Returns an id for the later state changes. Thread-safe.
  uint64_t issued(const std::string& group, int64_t seq, std::string op, std::string dtype,
                  int64_t count);
  void started(uint64_t id);
  void completed(uint64_t id);
  void failed(uint64_t id);

  std::vector<FlightRecord> snapshot() const;  // oldest first
  // The highest sequence number recorded for `group` (-1: none held), e.g. to tell whether a
  // peer in the same process issued a collective yet.
  int64_t last_seq(const std::string& group) const;
  // Writes DIR/rank_NNNNN.json (atomically: .tmp + rename); returns the path. A rank with a
  // second recorder (the nccl backend's, beside its host bootstrap's) names it by `backend`:
  // DIR/rank_NNNNN.<backend>.json; the analysis merges a rank's dumps.
  std::string dump(const std::string& dir, int world_rank, int world_size,
                   const std::string& reason, const std::string& backend = "") const;

 private:
  void set_state(uint64_t id, FlightState state);
  mutable std::mutex mutex_;
  size_t capacity_;
  std::vector<FlightRecord> ring_;
  uint64_t next_id_ = 0;  // id of the next record; ring_[id % capacity_]
  std::map<std::string, std::vector<int>> groups_;
};

// The result of reading every rank's dump.
struct HangReport {
  int world_size = 0;
  std::vector<int> missing_dumps;  // ranks that wrote no dump (crashed, killed, never started)
  std::vector<std::string> findings;  // one line each, most useful first
  std::string text() const;
};

// Reads DIR/rank_*.json (DIR = RUN_DIR/flight) and explains where each group is stuck; a rank's
// several dumps (rank_NNNNN.json, rank_NNNNN.nccl.json) count as one: their groups and records
// together.
// Throws loom::Error naming the directory or file when there is nothing to read.
HangReport analyze_flight_dumps(const std::string& dir);

}  // namespace loom
