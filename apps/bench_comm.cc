#include "bench_comm.h"

#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "base/error.h"
#include "comm/comm_bench.h"
#include "comm/local/local_backend.h"
#include "comm/mpi/launch_env.h"
#include "base/timer.h"
#ifdef LOOM_WITH_MPI
#include "comm/mpi/mpi_backend.h"
#endif

namespace loom {
namespace {

void print_rows(const std::vector<CommBenchRow>& rows, const MemcpyProbe& probe, bool json,
                const std::string& dtype) {
  const double memcpy_gbps = probe.gbps;
  if (!json) {
    std::printf("memcpy bandwidth B = %.2f GB/s (read + write); ceiling = busbw bound implied by B\n",
                memcpy_gbps);
    char stream[32] = "n/a (no AVX2)";
    if (probe.stream_gbps >= 0) std::snprintf(stream, sizeof stream, "%.2f GB/s", probe.stream_gbps);
    std::printf("B probe: %s won (%d threads x %.0f MiB copies, best of %d; glibc memcpy %.2f GB/s, "
                "avx2 streaming stores %s)\n",
                probe.method.c_str(), probe.threads,
                static_cast<double>(probe.bytes_per_thread) / (1 << 20), probe.reps, probe.memcpy_gbps,
                stream);
    std::printf("%-8s %-15s %5s %12s %11s %11s %11s %11s %11s\n", "backend", "op", "ranks", "bytes",
                "time_us", "algbw GB/s", "busbw GB/s", "ceiling", "mpi busbw");
  }
  for (const CommBenchRow& r : rows) {
    if (json) {
      nlohmann::json j = {{"backend", r.backend},         {"op", r.op}, {"dtype", dtype},
                          {"ranks", r.ranks},             {"bytes", r.bytes},
                          {"time_us", r.time_us},         {"algbw_gbps", r.algbw_gbps},
                          {"busbw_gbps", r.busbw_gbps},   {"ceiling_gbps", r.ceiling_gbps},
                          {"memcpy_gbps", memcpy_gbps},   {"memcpy_probe", probe.method}};
      if (r.reference_busbw_gbps >= 0) j["mpi_busbw_gbps"] = r.reference_busbw_gbps;
      std::cout << j.dump() << std::endl;
    } else {
      char ref[32] = "-";
      if (r.reference_busbw_gbps >= 0) std::snprintf(ref, sizeof ref, "%.2f", r.reference_busbw_gbps);
      std::printf("%-8s %-15s %5d %12ld %11.1f %11.2f %11.2f %11.2f %11s\n", r.backend.c_str(),
                  r.op.c_str(), r.ranks, static_cast<long>(r.bytes), r.time_us, r.algbw_gbps,
                  r.busbw_gbps, r.ceiling_gbps, ref);
    }
  }
}

CommBenchOptions make_options(const BenchCommArgs& a, const MemcpyProbe& probe) {
  CommBenchOptions o;
  o.ops = a.op == "all" ? all_bench_ops() : std::vector<std::string>{a.op};
  for (const auto& op : o.ops) busbw_factor(op, 2);  // unknown op: error before starting ranks
  o.sizes_bytes = parse_sizes(a.sizes);
  o.iters = a.iters;
  o.warmup = a.warmup;
  if (a.dtype == "fp32") o.dtype = DType::kF32;
  else if (a.dtype == "bf16") o.dtype = DType::kBF16;
  else fail("--dtype ", a.dtype, ": expected fp32 or bf16");
  o.memcpy_gbps = probe.gbps;
  return o;
}

}  // namespace

int cmd_bench_comm(const BenchCommArgs& a, const std::vector<std::string>& argv) {
  if (a.iters < 1) fail("--iters must be >= 1, got ", a.iters);
  if (a.backend == "local") {
    if (a.ranks < 1) fail("--ranks must be >= 1, got ", a.ranks);
    make_options(a, {});  // a bad --op or --sizes: an error before the probe
    // As many copying threads as ranks: the collective uses every rank's thread too.
    const MemcpyProbe probe = probe_memcpy_bandwidth(a.ranks);
    CommBenchOptions options = make_options(a, probe);
    auto world = make_local_world(a.ranks);
    std::vector<CommBenchRow> rows;
    std::vector<std::thread> threads;
    std::string error;
    for (int r = 0; r < a.ranks; ++r)
      threads.emplace_back([&, r] {
        try {
          auto out = run_comm_bench(*world[r], options);
          if (r == 0) rows = std::move(out);
        } catch (const std::exception& e) {
          if (r == 0) error = e.what();
          static_cast<LocalCommunicator&>(*world[r]).abort(e.what());
        }
      });
    for (auto& t : threads) t.join();
    if (!error.empty()) fail(error);
    print_rows(rows, probe, a.json, a.dtype);
    return 0;
  }
  if (a.backend == "mpi") {
#ifdef LOOM_WITH_MPI
    const LaunchEnv env = detect_launch_env();
    if (!env.under_launcher) {
      // Re-launch this very command under mpirun with --ranks processes.
      std::vector<std::string> cmd = {"mpirun"};
      if (geteuid() == 0) cmd.push_back("--allow-run-as-root");
      for (const char* s : {"--oversubscribe", "--bind-to", "none", "-np"}) cmd.push_back(s);
      cmd.push_back(std::to_string(a.ranks));
      // Our own path, resolved now: for mpirun, /proc/self/exe would be mpirun itself.
      char self[4096];
      const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
      if (len <= 0) fail("cannot resolve /proc/self/exe to re-launch under mpirun");
      cmd.push_back(std::string(self, static_cast<size_t>(len)));
      cmd.insert(cmd.end(), argv.begin() + 1, argv.end());
      std::vector<char*> cargv;
      for (auto& s : cmd) cargv.push_back(s.data());
      cargv.push_back(nullptr);
      std::fflush(stdout);
      execvp("mpirun", cargv.data());
      fail("cannot start mpirun for --backend mpi (is openmpi-bin installed?)");
    }
    // Rank 0 alone probes B, with one thread per rank, before MPI starts: the other ranks wait
    // in MPI_Init, which sleeps between polls, instead of competing for the cores (a blocking
    // collective would spin). Only rank 0 prints, so only it needs B.
    make_options(a, {});
    MemcpyProbe probe;
    if (env.rank == 0) probe = probe_memcpy_bandwidth(env.size);
    auto world = make_mpi_world();
    CommBenchOptions options = make_options(a, probe);
    MPI_Comm comm = static_cast<MpiCommunicator&>(*world).comm();
    options.reference_all_reduce = [comm](Tensor& t, int iters) {
      MPI_Barrier(comm);
      const double t0 = now_seconds();
      for (int i = 0; i < iters; ++i)
        MPI_Allreduce(MPI_IN_PLACE, t.raw(), static_cast<int>(t.numel()), MPI_FLOAT, MPI_SUM, comm);
      return (now_seconds() - t0) / iters;
    };
    auto rows = run_comm_bench(*world, options);
    if (world->rank() == 0) print_rows(rows, probe, a.json, a.dtype);
    return 0;
#else
    fail("--backend mpi: this Loom was built without MPI (install libopenmpi-dev and rebuild)");
#endif
  }
  fail("--backend '", a.backend, "': expected local or mpi");
}

}  // namespace loom
