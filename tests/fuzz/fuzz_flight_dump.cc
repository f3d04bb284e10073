// Fuzzes `loom debug hang RUN_DIR`: the ranks' flight-recorder dumps it reads were written by
// Loom, but by ranks that were timing out, killed or out of disk — a dump may be cut short or
// damaged, and the command is what a user runs right then. Input: the dumps' contents separated
// by NUL bytes, written as rank_00000.json, rank_00001.json, ... (at most 8). Seeds: two ranks'
// real dumps of a hang (rank 1 never reached the third all-reduce), written by this target.
// Properties: a refusal is a loom::Error; an accepted directory gives a report that renders.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>

#include "comm/flight_recorder.h"
#include "fuzz_common.h"

namespace {
namespace fs = std::filesystem;

// A hang of two ranks in "world": both completed all-reduces 0 and 1; rank 0 waits in 2, which
// rank 1 never issued.
void write_seed() {
  if (std::getenv("LOOM_FUZZ_WRITE_SEEDS") == nullptr) return;
  const fs::path dir = loom::fuzz::scratch_dir() / "seed";
  std::string joined;
  for (int rank = 0; rank < 2; ++rank) {
    loom::FlightRecorder recorder;
    recorder.add_group("world", {0, 1});
    for (int64_t seq = 0; seq < (rank == 0 ? 3 : 2); ++seq) {
      const uint64_t id = recorder.issued("world", seq, "all_reduce", "f32", 1024);
      recorder.started(id);
      if (seq < 2) recorder.completed(id);
    }
    joined += loom::fuzz::read_file(recorder.dump(dir.string(), rank, 2, "timeout after 1 s"));
    if (rank == 0) joined += '\0';
  }
  loom::fuzz::seed("two_ranks_hang", joined);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool seeded = (write_seed(), true);
  (void)seeded;
  const fs::path dir = loom::fuzz::scratch_dir() / "flight";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  size_t at = 0;
  for (int rank = 0; rank < 8 && at <= input.size(); ++rank) {
    const size_t end = std::min(input.find('\0', at), input.size());
    char name[32];
    std::snprintf(name, sizeof name, "rank_%05d.json", rank);
    loom::fuzz::write_file(dir / name, input.substr(at, end - at));
    at = end + 1;
  }
  loom::HangReport report;
  if (!loom::fuzz::accepts([&] { report = loom::analyze_flight_dumps(dir.string()); })) return 0;
  loom::fuzz::keep(report.text().size());
  return 0;
}
