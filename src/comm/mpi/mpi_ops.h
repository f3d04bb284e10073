// The mpi backend's process-wide MPI state and its small building blocks: checked MPI calls, the
// MPI lock, initialisation/finalisation, dtype → MPI_Datatype, ReduceOp → MPI_Op (with the
// user-defined bf16/f16 reductions), the avg division and argument checks.
// Internal to src/comm/mpi (namespace loom::mpi_internal); see mpi_backend.h for the design.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <mutex>
#include <string>

#include "comm/communicator.h"

namespace loom::mpi_internal {

std::string mpi_error_string(int code);
// Throws CommError "mpi: CALL failed: <MPI_Error_string>" unless code == MPI_SUCCESS.
void mpi_check(int code, const char* call);

#define LOOM_MPI_CALL(fn, ...) ::loom::mpi_internal::mpi_check(fn(__VA_ARGS__), #fn)

// Initialises MPI once per process (MPI_THREAD_MULTIPLE asked, MPI_THREAD_SERIALIZED accepted),
// sets MPI_ERRORS_RETURN on MPI_COMM_WORLD, creates the half-precision ops, and finalises MPI
// at exit when Loom initialised it.
void ensure_initialised();
bool mpi_finalized();
// Held around every MPI call when the library is not MPI_THREAD_MULTIPLE (an empty lock
// otherwise).
std::unique_lock<std::mutex> mpi_lock();

MPI_Datatype mpi_type(DType dtype);
MPI_Op mpi_op(ReduceOp op, DType dtype);
// avg = sum / n, applied once the sum is complete (integer division for i32/i64).
void divide_in_place(const Tensor& tensor, int n);

// `count` as MPI's int count; fails above INT_MAX.
int to_count(int64_t count, const char* op);
void expect_host(const Tensor& tensor, const char* op, const char* what);
void expect_same_dtype(const Tensor& input, const Tensor& output, const char* op);

}  // namespace loom::mpi_internal
