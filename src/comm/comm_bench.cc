#include "comm/comm_bench.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "base/error.h"

namespace loom {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Total bytes an op must read + write over all n ranks, per byte of S.
double traffic_per_byte(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * n;       // read and write every buffer once (in place)
  if (op == "reduce_scatter") return n + 1.0;   // read n inputs of S, write n outputs of S/n
  if (op == "all_gather") return n + 1.0;       // read n inputs of S/n, write n outputs of S
  if (op == "broadcast") return n;              // read the root's S, write n−1 copies
  if (op == "reduce") return n + 1.0;           // read n inputs, write the root's S
  if (op == "all_to_all") return 2.0 * n;       // read and write n buffers of S
  fail("unknown collective '", op, "' (known: all_reduce, reduce_scatter, all_gather, broadcast, reduce, all_to_all)");
}

}  // namespace

const std::vector<std::string>& all_bench_ops() {
  static const std::vector<std::string> ops = {"all_reduce", "reduce_scatter", "all_gather",
                                               "broadcast",  "reduce",         "all_to_all"};
  return ops;
}

double busbw_factor(const std::string& op, int n) {
  traffic_per_byte(op, n);  // validates the name
  if (n <= 1) return op == "broadcast" || op == "reduce" ? 1.0 : 0.0;
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast" || op == "reduce") return 1.0;
  return static_cast<double>(n - 1) / n;
}

double busbw_ceiling(const std::string& op, int n, double memcpy_gbps) {
  const double algbw_max = memcpy_gbps / traffic_per_byte(op, n);
  return algbw_max * busbw_factor(op, n);
}

namespace {

// A buffer for the probe: 2 MiB aligned, huge pages asked for, every page touched.
struct ProbeBuffer {
  std::byte* p = nullptr;
  size_t bytes = 0;
  ProbeBuffer() = default;
  ProbeBuffer(const ProbeBuffer&) = delete;
  ProbeBuffer& operator=(const ProbeBuffer&) = delete;
  ~ProbeBuffer() { std::free(p); }
  void allocate(size_t n, int fill) {
    constexpr size_t kHuge = size_t{2} << 20;
    bytes = (n + kHuge - 1) / kHuge * kHuge;
    p = static_cast<std::byte*>(std::aligned_alloc(kHuge, bytes));
    if (!p) fail("memcpy probe: cannot allocate ", bytes, " bytes");
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);  // a hint: fewer faults and TLB misses where THP is on
#endif
    std::memset(p, fill, bytes);  // first touch, outside the timing
  }
};

bool have_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

#if defined(__x86_64__) || defined(__i386__)
// dst = src with 32-byte loads and non-temporal 32-byte stores (both 32-byte aligned, bytes a
// multiple of 128): the stores bypass the cache and need no read-for-ownership of dst.
__attribute__((target("avx2"))) void stream_copy(std::byte* dst, const std::byte* src, size_t bytes) {
  auto* d = reinterpret_cast<__m256i*>(dst);
  const auto* s = reinterpret_cast<const __m256i*>(src);
  for (size_t i = 0; i < bytes / 32; i += 4) {
    const __m256i a = _mm256_load_si256(s + i);
    const __m256i b = _mm256_load_si256(s + i + 1);
    const __m256i c = _mm256_load_si256(s + i + 2);
    const __m256i e = _mm256_load_si256(s + i + 3);
    _mm256_stream_si256(d + i, a);
    _mm256_stream_si256(d + i + 1, b);
    _mm256_stream_si256(d + i + 2, c);
    _mm256_stream_si256(d + i + 3, e);
  }
  _mm_sfence();
}
#else
void stream_copy(std::byte* dst, const std::byte* src, size_t bytes) { std::memcpy(dst, src, bytes); }
#endif

}  // namespace

MemcpyProbe probe_memcpy_bandwidth(int threads, int64_t total_bytes, int reps) {
  threads = std::max(1, threads);
  reps = std::max(1, reps);
  const size_t per = std::max<size_t>(4096, static_cast<size_t>(total_bytes / (2 * threads)) / 128 * 128);
  std::vector<ProbeBuffer> src(static_cast<size_t>(threads)), dst(static_cast<size_t>(threads));
  {
    std::vector<std::thread> ts;  // each thread touches its own buffers (first-touch placement)
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        src[t].allocate(per, t + 1);
        dst[t].allocate(per, 0);
      });
    for (auto& th : ts) th.join();
  }
  // Best of `reps` runs of `copy` on every thread at once; GB/s of bytes read + written.
  auto run = [&](void (*copy)(std::byte*, const std::byte*, size_t)) {
    double best = 0;
    for (int rep = 0; rep < reps; ++rep) {
      std::atomic<int> ready{0};
      std::atomic<bool> go{false};
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t)
        ts.emplace_back([&, t] {
          ready.fetch_add(1);
          while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
          copy(dst[t].p, src[t].p, per);
        });
      while (ready.load() < threads) std::this_thread::yield();
      const double t0 = now_s();
      go.store(true, std::memory_order_release);
      for (auto& th : ts) th.join();
      const double dt = now_s() - t0;
      best = std::max(best, 2.0 * static_cast<double>(per) * threads / dt / 1e9);
    }
    return best;
  };
  MemcpyProbe probe;
  probe.threads = threads;
  probe.reps = reps;
  probe.bytes_per_thread = static_cast<int64_t>(per);
  probe.memcpy_gbps = run([](std::byte* d, const std::byte* s, size_t n) { std::memcpy(d, s, n); });
  if (have_avx2()) probe.stream_gbps = run(&stream_copy);
  if (probe.stream_gbps > probe.memcpy_gbps) {
    probe.gbps = probe.stream_gbps;
    probe.method = "avx2 streaming-store copy";
  } else {
    probe.gbps = probe.memcpy_gbps;
    probe.method = "glibc memcpy";
  }
  return probe;
}

double measure_memcpy_gbps(int threads, int64_t total_bytes) {
  return probe_memcpy_bandwidth(threads, total_bytes).gbps;
}

std::vector<int64_t> parse_sizes(const std::string& text) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = text.find(',', pos);
    std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    if (item.empty()) fail("--sizes '", text, "': empty item");
    int64_t mult = 1;
    const char unit = static_cast<char>(std::toupper(static_cast<unsigned char>(item.back())));
    if (unit == 'K' || unit == 'M' || unit == 'G') {
      mult = unit == 'K' ? 1024 : unit == 'M' ? 1024 * 1024 : int64_t{1024} * 1024 * 1024;
      item.pop_back();
    }
    size_t used = 0;
    int64_t v = -1;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || v < 0) fail("--sizes '", text, "': '", item, "' is not a size like 64M");
    out.push_back(v * mult);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

std::vector<CommBenchRow> run_comm_bench(Communicator& comm, const CommBenchOptions& options) {
  const int n = comm.size();
  const int64_t esize = static_cast<int64_t>(dtype_size(options.dtype));
  std::vector<CommBenchRow> rows;
  for (const std::string& op : options.ops) {
    busbw_factor(op, n);  // validates the op on every rank before any collective
    for (int64_t bytes : options.sizes_bytes) {
      // Round to whole elements divisible by n (chunked collectives need equal chunks).
      const int64_t count = std::max<int64_t>(n, bytes / esize / n * n);
      Tensor a = Tensor::zeros({count}, options.dtype);
      Tensor b = Tensor::zeros({count}, options.dtype);
      Tensor small = Tensor::zeros({count / n}, options.dtype);
      auto run_once = [&] {
        if (op == "all_reduce") comm.all_reduce(a, ReduceOp::kSum);
        else if (op == "reduce_scatter") comm.reduce_scatter(a, small, ReduceOp::kSum);
        else if (op == "all_gather") comm.all_gather(small, a);
        else if (op == "broadcast") comm.broadcast(a, 0);
        else if (op == "reduce") comm.reduce(a, 0, ReduceOp::kSum);
        else comm.all_to_all(a, b);
      };
      for (int i = 0; i < options.warmup; ++i) run_once();
      comm.barrier();
      const double t0 = now_s();
      for (int i = 0; i < options.iters; ++i) run_once();
      Tensor t = Tensor::from_vector({static_cast<float>((now_s() - t0) / options.iters)}, {1});
      comm.all_reduce(t, ReduceOp::kMax);  // the slowest rank defines the time
      CommBenchRow row;
      row.backend = comm.backend();
      row.op = op;
      row.ranks = n;
      row.bytes = count * esize;
      row.time_us = t.data<float>()[0] * 1e6;
      row.algbw_gbps = static_cast<double>(row.bytes) / (row.time_us * 1e-6) / 1e9;
      row.busbw_gbps = row.algbw_gbps * busbw_factor(op, n);
      row.ceiling_gbps = busbw_ceiling(op, n, options.memcpy_gbps);
      if (op == "all_reduce" && options.reference_all_reduce) {
        Tensor r = Tensor::from_vector({static_cast<float>(options.reference_all_reduce(a, options.iters))}, {1});
        comm.all_reduce(r, ReduceOp::kMax);
        row.reference_busbw_gbps =
            static_cast<double>(row.bytes) / r.data<float>()[0] / 1e9 * busbw_factor(op, n);
      }
      rows.push_back(row);
    }
  }
  return rows;
}

}  // namespace loom
