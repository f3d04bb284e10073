// The mpi backend's process-wide state, dtype/op mapping and argument checks (see mpi_ops.h).
#include "comm/mpi/mpi_ops.h"

#include <algorithm>
#include <climits>
#include <cstdlib>

namespace loom::mpi_internal {

// ---- checked MPI calls
// ---------------------------------------------------------------------------

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return "MPI error code " + std::to_string(code);
  return std::string(text, static_cast<size_t>(length));
}

void mpi_check(int code, const char* call) {
  if (code != MPI_SUCCESS)
    throw CommError(detail::concat("mpi: ", call, " failed: ", mpi_error_string(code)));
}

namespace {

// ---- process-wide MPI state
// ------------------------------------------------------------------------

struct Runtime {
  bool we_initialised = false;
  bool thread_multiple = false;
  std::mutex mpi_mutex;  // serialises MPI calls when the library is not MPI_THREAD_MULTIPLE
  // User-defined reductions for 16-bit floats: [bf16, f16] × [sum, max, min].
  MPI_Op half_ops[2][3] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL},
                           {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};
};

// Leaked on purpose: used from the atexit handler, after static destructors may have run.
Runtime& runtime() {
  static Runtime* instance = new Runtime;
  return *instance;
}

}  // namespace

std::unique_lock<std::mutex> mpi_lock() {
  Runtime& rt = runtime();
  return rt.thread_multiple ? std::unique_lock<std::mutex>()
                            : std::unique_lock<std::mutex>(rt.mpi_mutex);
}

bool mpi_finalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

namespace {

// ---- bf16 / f16 reductions
// --------------------------------------------------------------------------

enum HalfFormat { kBf16 = 0, kF16 = 1 };
enum HalfReduce { kHalfSum = 0, kHalfMax = 1, kHalfMin = 2 };

template <int kFormat>
float widen(uint16_t h) {
  return kFormat == kBf16 ? bf16_to_float(h) : f16_to_float(h);
}
template <int kFormat>
uint16_t narrow(float f) {
  return kFormat == kBf16 ? float_to_bf16(f) : float_to_f16(f);
}

// MPI's contract: inout[i] = in[i] op inout[i].
template <int kFormat, int kReduce>
void half_reduce(void* in, void* inout, int* length, MPI_Datatype* /*type*/) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *length; ++i) {
    float x = widen<kFormat>(a[i]);
    float y = widen<kFormat>(b[i]);
    float r = kReduce == kHalfSum ? x + y : kReduce == kHalfMax ? std::max(x, y) : std::min(x, y);
    b[i] = narrow<kFormat>(r);
  }
}

void create_half_ops(Runtime& rt) {
  MPI_User_function* functions[2][3] = {
      {half_reduce<kBf16, kHalfSum>, half_reduce<kBf16, kHalfMax>, half_reduce<kBf16, kHalfMin>},
      {half_reduce<kF16, kHalfSum>, half_reduce<kF16, kHalfMax>, half_reduce<kF16, kHalfMin>}};
  for (int f = 0; f < 2; ++f) {
    for (int r = 0; r < 3; ++r)
      LOOM_MPI_CALL(MPI_Op_create, functions[f][r], /*commute=*/1, &rt.half_ops[f][r]);
  }
}

void finalize_at_exit() {
  Runtime& rt = runtime();
  if (mpi_finalized()) return;
  for (auto& row : rt.half_ops) {
    for (MPI_Op& op : row) {
      if (op != MPI_OP_NULL) MPI_Op_free(&op);
    }
  }
  MPI_Finalize();
}

}  // namespace

void ensure_initialised() {
  static std::once_flag once;
  std::call_once(once, [] {
    Runtime& rt = runtime();
    int initialised = 0;
    LOOM_MPI_CALL(MPI_Initialized, &initialised);
    int provided = MPI_THREAD_SINGLE;
    if (!initialised) {
      LOOM_MPI_CALL(MPI_Init_thread, nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      rt.we_initialised = true;
    } else {
      LOOM_MPI_CALL(MPI_Query_thread, &provided);
    }
    rt.thread_multiple = provided >= MPI_THREAD_MULTIPLE;
    LOOM_MPI_CALL(MPI_Comm_set_errhandler, MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    create_half_ops(rt);
    if (rt.we_initialised) std::atexit(finalize_at_exit);
  });
}

// ---- dtypes and ops
// ---------------------------------------------------------------------------------

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return MPI_FLOAT;
    case DType::kF64:
      return MPI_DOUBLE;
    case DType::kI32:
      return MPI_INT32_T;
    case DType::kI64:
      return MPI_INT64_T;
    case DType::kBF16:
    case DType::kF16:
      return MPI_UINT16_T;  // moved as bits; reduced by the half ops
  }
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op, DType dtype) {
  if (dtype == DType::kBF16 || dtype == DType::kF16) {
    int format = dtype == DType::kBF16 ? kBf16 : kF16;
    int reduce = op == ReduceOp::kMax ? kHalfMax : op == ReduceOp::kMin ? kHalfMin : kHalfSum;
    return runtime().half_ops[format][reduce];
  }
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return MPI_SUM;
    case ReduceOp::kMax:
      return MPI_MAX;
    case ReduceOp::kMin:
      return MPI_MIN;
  }
  return MPI_OP_NULL;
}

// avg = sum / n, applied once the sum is complete.
void divide_in_place(const Tensor& tensor, int n) {
  const int64_t count = tensor.numel();
  switch (tensor.dtype()) {
    case DType::kF32: {
      float* p = tensor.data<float>();
      for (int64_t i = 0; i < count; ++i) p[i] /= static_cast<float>(n);
      break;
    }
    case DType::kF64: {
      double* p = tensor.data<double>();
      for (int64_t i = 0; i < count; ++i) p[i] /= n;
      break;
    }
    case DType::kI32: {
      int32_t* p = tensor.data<int32_t>();
      for (int64_t i = 0; i < count; ++i) p[i] /= n;
      break;
    }
    case DType::kI64: {
      int64_t* p = tensor.data<int64_t>();
      for (int64_t i = 0; i < count; ++i) p[i] /= n;
      break;
    }
    case DType::kBF16: {
      uint16_t* p = tensor.data_u16();
      for (int64_t i = 0; i < count; ++i)
        p[i] = float_to_bf16(bf16_to_float(p[i]) / static_cast<float>(n));
      break;
    }
    case DType::kF16: {
      uint16_t* p = tensor.data_u16();
      for (int64_t i = 0; i < count; ++i)
        p[i] = float_to_f16(f16_to_float(p[i]) / static_cast<float>(n));
      break;
    }
  }
}

int to_count(int64_t count, const char* op) {
  if (count > INT_MAX)
    fail("mpi: ", op, " of ", count, " elements exceeds MPI's int count (", INT_MAX, ")");
  return static_cast<int>(count);
}

void expect_host(const Tensor& tensor, const char* op, const char* what) {
  if (!tensor.defined())
    throw CommError(detail::concat("mpi: ", op, ": ", what, " tensor is undefined"));
  if (!tensor.device().is_cpu()) {
    throw CommError(detail::concat("mpi: ", op, ": ", what, " tensor is on ", tensor.device().str(),
                                   "; the mpi backend needs host tensors"));
  }
}

void expect_same_dtype(const Tensor& input, const Tensor& output, const char* op) {
  if (input.dtype() != output.dtype()) {
    throw CommError(detail::concat("mpi: ", op, ": input is ", dtype_name(input.dtype()),
                                   " but output is ", dtype_name(output.dtype())));
  }
}

}  // namespace loom::mpi_internal
