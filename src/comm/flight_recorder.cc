#include "comm/flight_recorder.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "base/error.h"
#include "base/json_number.h"

namespace loom {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
std::string join(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s;
}
}  // namespace

std::string_view flight_state_name(FlightState state) {
  switch (state) {
    case FlightState::kIssued: return "issued";
    case FlightState::kStarted: return "started";
    case FlightState::kCompleted: return "completed";
    case FlightState::kFailed: return "failed";
  }
  return "?";
}

FlightRecorder::FlightRecorder(size_t capacity) : capacity_(std::max<size_t>(1, capacity)) {
  ring_.reserve(capacity_);
}

void FlightRecorder::add_group(const std::string& group, std::vector<int> world_ranks) {
  std::lock_guard<std::mutex> lock(mutex_);
  groups_[group] = std::move(world_ranks);
}

uint64_t FlightRecorder::issued(const std::string& group, int64_t seq, std::string op,
                                std::string dtype, int64_t count) {
  FlightRecord r{group, seq, std::move(op), std::move(dtype), count, FlightState::kIssued,
                 now_s(), 0, 0};
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t id = next_id_++;
  if (ring_.size() < capacity_) {
    ring_.push_back(std::move(r));
  } else {
    ring_[id % capacity_] = std::move(r);
  }
  return id;
}

void FlightRecorder::set_state(uint64_t id, FlightState state) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (id + capacity_ < next_id_ || id >= next_id_) return;  // overwritten already
  FlightRecord& r = ring_[id % capacity_];
  r.state = state;
  if (state == FlightState::kStarted) r.t_started = now_s();
  if (state == FlightState::kCompleted || state == FlightState::kFailed) r.t_completed = now_s();
}

void FlightRecorder::started(uint64_t id) { set_state(id, FlightState::kStarted); }
void FlightRecorder::completed(uint64_t id) { set_state(id, FlightState::kCompleted); }
void FlightRecorder::failed(uint64_t id) { set_state(id, FlightState::kFailed); }

std::vector<FlightRecord> FlightRecorder::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<FlightRecord> out;
  const uint64_t first = next_id_ > capacity_ ? next_id_ - capacity_ : 0;
  for (uint64_t id = first; id < next_id_; ++id) out.push_back(ring_[id % capacity_]);
  return out;
}

int64_t FlightRecorder::last_seq(const std::string& group) const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t last = -1;
  for (const FlightRecord& r : ring_)
    if (r.group == group) last = std::max(last, r.seq);
  return last;
}

std::string FlightRecorder::dump(const std::string& dir, int world_rank, int world_size,
                                 const std::string& reason, const std::string& backend) const {
  json j;
  j["format"] = "loom-flight-recorder";
  j["version"] = 1;
  j["rank"] = world_rank;
  j["world_size"] = world_size;
  j["reason"] = reason;
  if (!backend.empty()) j["backend"] = backend;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    j["groups"] = groups_;
  }
  json records = json::array();
  for (const FlightRecord& r : snapshot())
    records.push_back({{"group", r.group}, {"seq", r.seq}, {"op", r.op}, {"dtype", r.dtype},
                       {"count", r.count}, {"state", flight_state_name(r.state)},
                       {"t_issued", r.t_issued}, {"t_started", r.t_started},
                       {"t_completed", r.t_completed}});
  j["records"] = records;
  std::error_code ec;
  fs::create_directories(dir, ec);
  char number[16];
  std::snprintf(number, sizeof number, "%05d", world_rank);
  const std::string name =
      std::string("rank_") + number + (backend.empty() ? "" : "." + backend) + ".json";
  const fs::path path = fs::path(dir) / name;
  const fs::path tmp = fs::path(dir) / (name + ".tmp");
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << j.dump(1) << '\n';
    if (!out) fail("cannot write flight recorder dump ", tmp.string());
  }
  fs::rename(tmp, path, ec);
  if (ec) fail("cannot rename ", tmp.string(), ": ", ec.message());
  return path.string();
}

std::string HangReport::text() const {
  std::ostringstream os;
  for (const auto& f : findings) os << f << '\n';
  return os.str();
}

namespace {

// One rank's dump as written by FlightRecorder::dump, read and checked.
struct Dump {
  int rank = 0;
  int world_size = 0;
  std::map<std::string, std::vector<int>> groups;
  std::vector<FlightRecord> records;
};

// Largest world a dump may claim: the analysis lists every rank without a dump.
constexpr int kMaxDumpWorld = 1 << 20;

// Reads `path`; throws loom::Error naming it and what is wrong (a dump damaged on its way to
// the disk, or a file that is not one).
Dump read_dump(const fs::path& path) {
  const auto damaged = [&](const auto&... why) -> void {
    fail("flight recorder dump ", path.string(), ": ", why...);
  };
  std::ifstream in(path);
  Dump d;
  try {
    const json j = json::parse(in);
    if (!j.is_object() || j.value("format", "") != "loom-flight-recorder")
      damaged("not a Loom flight recorder dump");
    d.rank = json_integer<int>(j.at("rank"));
    d.world_size = json_integer<int>(j.at("world_size"));
    if (d.world_size < 1 || d.world_size > kMaxDumpWorld || d.rank < 0 || d.rank >= d.world_size)
      damaged("rank ", d.rank, " of world_size ", d.world_size);
    for (const auto& [group, members] : j.at("groups").items())
      d.groups[group] = json_integers<int>(members);
    for (const auto& [group, members] : d.groups)
      for (const int m : members)
        if (m < 0 || m >= d.world_size) damaged("group '", group, "' has rank ", m);
    for (const json& rec : j.at("records")) {
      FlightRecord r;
      r.group = rec.at("group").get<std::string>();
      r.seq = json_integer<int64_t>(rec.at("seq"));
      r.op = rec.at("op").get<std::string>();
      const std::string state = rec.at("state").get<std::string>();
      const FlightState states[] = {FlightState::kIssued, FlightState::kStarted,
                                    FlightState::kCompleted, FlightState::kFailed};
      const auto known = std::find_if(std::begin(states), std::end(states),
                                      [&](FlightState s) { return flight_state_name(s) == state; });
      if (known == std::end(states)) damaged("a record's state '", state, "'");
      r.state = *known;
      d.records.push_back(std::move(r));
    }
  } catch (const json::exception& e) {
    damaged("not valid: ", e.what());
  }
  return d;
}

}  // namespace

HangReport analyze_flight_dumps(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail("flight recorder directory ", dir, " does not exist");
  struct Rank {
    std::map<std::string, std::vector<int>> groups;
    std::vector<FlightRecord> records;
  };
  std::map<int, Rank> ranks;
  HangReport report;
  // A damaged dump (cut short by a full disk, say) is named and skipped: the others still tell
  // where the job hangs, and its rank counts as one without a dump.
  std::vector<std::string> damaged;
  std::vector<fs::path> paths;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("rank_", 0) == 0 && entry.path().extension() == ".json")
      paths.push_back(entry.path());
  }
  std::sort(paths.begin(), paths.end());
  for (const fs::path& path : paths) {
    Dump d;
    try {
      d = read_dump(path);
    } catch (const Error& e) {
      damaged.push_back(e.what());
      continue;
    }
    Rank& r = ranks[d.rank];  // a rank's second dump adds to its first
    for (auto& [group, members] : d.groups) r.groups[group] = std::move(members);
    for (FlightRecord& rec : d.records) r.records.push_back(std::move(rec));
    report.world_size = std::max(report.world_size, d.world_size);
  }
  if (ranks.empty()) {
    if (!damaged.empty())
      fail(damaged.front(), damaged.size() > 1 ? " (and every other dump)" : "");
    fail("no flight recorder dumps (rank_*.json) in ", dir);
  }
  for (int r = 0; r < report.world_size; ++r)
    if (!ranks.count(r)) report.missing_dumps.push_back(r);
  if (!report.missing_dumps.empty())
    report.findings.push_back("no dump from rank(s) " + join(report.missing_dumps) +
                              ": they crashed, were killed or never started");

  // Per group: the members, and for every member the highest sequence number it issued and the
  // lowest one it has not completed.
  std::map<std::string, std::vector<int>> members;
  for (const auto& [rank, r] : ranks)
    for (const auto& [group, world_ranks] : r.groups) members[group] = world_ranks;
  for (const auto& [group, world_ranks] : members) {
    std::map<int, int64_t> last_issued;      // rank -> highest seq issued (-1: none)
    std::map<int, FlightRecord> stuck;       // rank -> first record not completed
    std::map<int, FlightRecord> last_record;
    for (int rank : world_ranks) {
      auto it = ranks.find(rank);
      // A rank whose dumps lack the group (e.g. its nccl dump is missing) says nothing of it.
      if (it == ranks.end() || !it->second.groups.count(group)) continue;
      last_issued[rank] = -1;
      for (const FlightRecord& rec : it->second.records) {
        if (rec.group != group) continue;
        if (rec.seq > last_issued[rank]) {
          last_issued[rank] = rec.seq;
          last_record[rank] = rec;
        }
        if (rec.state != FlightState::kCompleted &&
            (!stuck.count(rank) || rec.seq < stuck[rank].seq))
          stuck[rank] = rec;
      }
    }
    if (stuck.empty()) continue;
    // The earliest sequence number anyone waits at is where the group is stuck.
    int64_t wait_seq = INT64_MAX;
    std::string wait_op;
    for (const auto& [rank, rec] : stuck) {
      if (rec.seq < wait_seq) {
        wait_seq = rec.seq;
        wait_op = rec.op;
      }
    }
    std::vector<int> waiting, behind, missing, unrecorded;
    for (int rank : world_ranks) {
      if (!ranks.count(rank)) {
        missing.push_back(rank);
      } else if (!last_issued.count(rank)) {
        unrecorded.push_back(rank);
      } else if (last_issued[rank] < wait_seq) {
        behind.push_back(rank);
      } else if (stuck.count(rank)) {
        waiting.push_back(rank);
      }
    }
    std::string line = "group '" + group + "' (ranks " + join(world_ranks) + "): ";
    if (!waiting.empty())
      line += "rank(s) " + join(waiting) + " wait in " + wait_op + " #" + std::to_string(wait_seq);
    if (!behind.empty()) {
      line += "; rank(s) " + join(behind) + " never reached #" + std::to_string(wait_seq);
      for (int rank : behind) {
        line += rank == behind.front() ? " (last:" : ";";
        const auto rec = last_record.find(rank);
        line += rec == last_record.end()
                    ? " rank " + std::to_string(rank) + " issued nothing in this group"
                    : " rank " + std::to_string(rank) + " " + rec->second.op + " #" +
                          std::to_string(rec->second.seq) + " " +
                          std::string(flight_state_name(rec->second.state));
      }
      line += ")";
    }
    if (!missing.empty()) line += "; no dump from rank(s) " + join(missing);
    if (!unrecorded.empty()) line += "; no records of this group from rank(s) " + join(unrecorded);
    // Most useful first: groups where somebody is behind.
    if (!behind.empty()) {
      report.findings.insert(report.findings.begin() + (report.missing_dumps.empty() ? 0 : 1), line);
    } else {
      report.findings.push_back(line);
    }
  }
  if (report.findings.empty()) report.findings.push_back("every recorded operation completed: no hang in the dumps");
  for (const std::string& why : damaged) report.findings.push_back(why + "; skipped");
  return report;
}

}  // namespace loom
