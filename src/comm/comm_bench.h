// Collective benchmarks in the manner of nccl-tests: algorithm bandwidth algbw = S / t and bus
// bandwidth busbw = algbw × factor(op, n), where the factor makes busbw comparable with the
// hardware's link speed whatever the rank count (nccl-tests' doc/PERFORMANCE.md):
//   all_reduce 2(n−1)/n; reduce_scatter, all_gather, all_to_all (n−1)/n; broadcast, reduce 1.
// S is the per-rank buffer size (for all_gather: the output, for reduce_scatter: the input).
//
// The ceiling: on one machine every collective moves bytes through memory, whose bandwidth B
// (bytes read + written per second) we measure with a copy probe in the same run
// (probe_memcpy_bandwidth). An operation that
// must read R and write W bytes in total over all ranks takes at least (R + W) / B, which bounds
// algbw and so busbw. For an in-place all-reduce, R = W = n·S: busbw ≤ B·(n−1)/n².
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace loom {

struct CommBenchOptions {
  std::vector<std::string> ops;      // all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all
  std::vector<int64_t> sizes_bytes;  // per-rank buffer sizes
  DType dtype = DType::kF32;
  int warmup = 2;
  int iters = 10;
  double memcpy_gbps = 0;  // B; measured by the caller once (measure_memcpy_gbps)
  // Optional: seconds per plain MPI_Allreduce of this tensor (the mpi backend's reference).
  std::function<double(Tensor&, int iters)> reference_all_reduce;
};

struct CommBenchRow {
  std::string backend, op;
  int ranks = 0;
  int64_t bytes = 0;
  double time_us = 0;
  double algbw_gbps = 0, busbw_gbps = 0, ceiling_gbps = 0;
  double reference_busbw_gbps = -1;  // plain MPI_Allreduce, when measured
};

// Collective over `comm`: every rank calls it with the same options; every rank gets the rows
// (timings are the maximum over ranks of each rank's mean time).
std::vector<CommBenchRow> run_comm_bench(Communicator& comm, const CommBenchOptions& options);

// The bus-bandwidth factor of an op for n ranks; throws naming an unknown op.
double busbw_factor(const std::string& op, int n);
// Upper bound of busbw for an op given memory bandwidth B (GB/s, read + write).
double busbw_ceiling(const std::string& op, int n, double memcpy_gbps);
// The machine's copy bandwidth B, as the best of two probes: glibc memcpy and an AVX2 copy loop
// with non-temporal (streaming) stores, which skip the read-for-ownership of the destination
// (when the CPU has AVX2). `threads` threads copy at once (run with as many as the benchmark has
// ranks: the collectives use every rank's thread too), each between buffers of its own of
// total_bytes / (2 × threads) bytes: source and destination together total_bytes, by default
// 512 MiB, well beyond any last-level cache, so the copy runs at memory speed rather than
// cache speed. Buffers are 2 MiB aligned, MADV_HUGEPAGE and touched before timing (first-touch
// page faults cost ~11 µs per 4 KiB page on a VM); each probe takes the best of `reps` runs.
// GB/s count bytes read + written (2 × the bytes copied).
struct MemcpyProbe {
  double gbps = 0;          // B: the faster probe
  std::string method;       // "glibc memcpy" or "avx2 streaming-store copy"
  double memcpy_gbps = 0;   // glibc memcpy
  double stream_gbps = -1;  // AVX2 streaming stores; -1 when the CPU lacks AVX2
  int threads = 0;
  int reps = 0;                  // runs per probe (the best counts)
  int64_t bytes_per_thread = 0;  // each thread's copy size
};
MemcpyProbe probe_memcpy_bandwidth(int threads, int64_t total_bytes = int64_t{512} << 20,
                                   int reps = 10);
// probe_memcpy_bandwidth(threads, total_bytes).gbps.
double measure_memcpy_gbps(int threads, int64_t total_bytes = int64_t{512} << 20);
// "1M,16M,64M" / "4096,1G" -> bytes; throws naming the bad item.
std::vector<int64_t> parse_sizes(const std::string& text);
const std::vector<std::string>& all_bench_ops();

}  // namespace loom
