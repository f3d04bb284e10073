// `loom bench comm`: collective bandwidth on the local (thread) or mpi backend.
#pragma once

#include <string>
#include <vector>

namespace loom {

struct BenchCommArgs {
  std::string backend = "local";
  int ranks = 2;
  std::string op = "all_reduce";
  std::string sizes = "1M,16M,64M";
  int iters = 10;
  int warmup = 2;
  std::string dtype = "fp32";  // fp32 or bf16 (parallel.grad_reduce_dtype's wire format)
  bool json = false;
};

// argv: the process's own arguments, to re-launch under mpirun for --backend mpi.
int cmd_bench_comm(const BenchCommArgs& args, const std::vector<std::string>& argv);

}  // namespace loom
