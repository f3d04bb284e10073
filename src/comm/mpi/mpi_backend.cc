#include "comm/mpi/mpi_backend.h"

#include <algorithm>
#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

namespace loom {
namespace {

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

#define LOOM_MPI_CALL(fn, ...) mpi_check(fn(__VA_ARGS__), #fn)

// ---- process-wide MPI state
// ------------------------------------------------------------------------

// A pending request whose Work handle was dropped: its buffers must outlive it, so it is kept
// here and reaped when complete (sends and receives; a dropped collective stays queued or
// running on the worker, which holds its buffers until it completes).
struct Orphan {
  MPI_Request request;
  std::vector<Tensor> keep;
};

struct Runtime {
  bool we_initialised = false;
  bool thread_multiple = false;
  std::mutex mpi_mutex;  // serialises MPI calls when the library is not MPI_THREAD_MULTIPLE
  std::mutex orphan_mutex;
  std::vector<Orphan> orphans;
  // User-defined reductions for 16-bit floats: [bf16, f16] × [sum, max, min].
  MPI_Op half_ops[2][3] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL},
                           {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};
};

// Leaked on purpose: used from the atexit handler, after static destructors may have run.
Runtime& runtime() {
  static Runtime* instance = new Runtime;
  return *instance;
}

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

// ---- the Work handle
// --------------------------------------------------------------------------------

void reap_orphans() {
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> guard(rt.orphan_mutex);
  if (rt.orphans.empty() || mpi_finalized()) return;
  auto lock = mpi_lock();
  std::erase_if(rt.orphans, [](Orphan& orphan) {
    int flag = 0;
    return MPI_Test(&orphan.request, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag != 0;
  });
}

class MpiWork final : public Work {
 public:
  MpiWork(MPI_Request request, std::string what, std::chrono::milliseconds timeout,
          std::vector<Tensor> keep, std::function<void()> on_done)
      : request_(request),
        what_(std::move(what)),
        timeout_(timeout),
        keep_(std::move(keep)),
        on_done_(std::move(on_done)) {}

  ~MpiWork() override {
    if (done_ || mpi_finalized()) return;
    Runtime& rt = runtime();
    std::lock_guard<std::mutex> guard(rt.orphan_mutex);
    rt.orphans.push_back(Orphan{request_, std::move(keep_)});
  }

  bool test() override {
    if (done_) return true;
    int flag = 0;
    {
      auto lock = mpi_lock();
      LOOM_MPI_CALL(MPI_Test, &request_, &flag, MPI_STATUS_IGNORE);
    }
    if (flag == 0) return false;
    done_ = true;
    if (on_done_) on_done_();
    keep_.clear();
    return true;
  }

  // Polls MPI_Test (which also drives MPI's progress): yields for the first polls, so a short
  // operation completes with little latency, then sleeps briefly so waiting ranks do not take
  // the cores of oversubscribed ranks.
  void wait() override {
    const auto start = std::chrono::steady_clock::now();
    for (int polls = 0; !test(); ++polls) {
      if (std::chrono::steady_clock::now() - start > timeout_) {
        throw CommError(
            detail::concat("mpi: timed out after ", timeout_.count(), " ms waiting for ", what_,
                           "; ranks that did not arrive: unknown with the mpi backend"));
      }
      if (polls < 2000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

 private:
  MPI_Request request_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::vector<Tensor> keep_;  // buffers MPI reads or writes until completion
  std::function<void()> on_done_;
  bool done_ = false;
};

// Collective codes for the debug check.
enum OpCode { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kReduce, kAllToAll, kBarrier };
constexpr const char* kOpNames[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                    "reduce",     "all_to_all",     "barrier"};

bool debug_from_env() {
  const char* value = std::getenv("LOOM_COMM_DEBUG");
  return value != nullptr && std::string_view(value) == "1";
}

}  // namespace

// A collective queued for the communicator's worker thread. `mutex` guards done/error.
struct MpiTask {
  std::function<void()> run;      // the blocking MPI call
  std::function<void()> on_done;  // after a successful run (the avg division)
  std::vector<Tensor> keep;       // buffers MPI reads or writes until completion
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
};

namespace {

// The Work handle of a queued collective: completion is signalled by the worker thread.
class MpiTaskWork final : public Work {
 public:
  MpiTaskWork(std::shared_ptr<MpiTask> task, std::string what, std::chrono::milliseconds timeout)
      : task_(std::move(task)), what_(std::move(what)), timeout_(timeout) {}

  bool test() override {
    std::lock_guard<std::mutex> guard(task_->mutex);
    if (!task_->done) return false;
    if (task_->error) std::rethrow_exception(task_->error);
    return true;
  }

  // On timeout the worker stays blocked in MPI; a later wait() may still see it complete.
  void wait() override {
    std::unique_lock<std::mutex> lock(task_->mutex);
    if (!task_->cv.wait_for(lock, timeout_, [&] { return task_->done; })) {
      throw CommError(detail::concat("mpi: timed out after ", timeout_.count(), " ms waiting for ",
                                     what_,
                                     "; ranks that did not arrive: unknown with the mpi backend"));
    }
    if (task_->error) std::rethrow_exception(task_->error);
  }

 private:
  std::shared_ptr<MpiTask> task_;
  std::string what_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

// ---- MpiCommunicator
// --------------------------------------------------------------------------------

MpiCommunicator::MpiCommunicator(MPI_Comm comm, bool owned, std::string name,
                                 const CommOptions& options)
    : comm_(comm), owned_(owned), name_(std::move(name)), options_(options) {
  if (debug_from_env()) options_.debug_checks = true;
  {
    auto lock = mpi_lock();
    LOOM_MPI_CALL(MPI_Comm_rank, comm_, &rank_);
    LOOM_MPI_CALL(MPI_Comm_size, comm_, &size_);
  }
  worker_ = std::thread([this] { worker_loop(); });
}

// Drains the queue, then joins the worker (no lock held: the worker needs queue_mutex_ and the
// MPI lock). If a collective timed out and its peers never arrive, this waits forever: abort
// the job instead of destroying the communicator.
MpiCommunicator::~MpiCommunicator() {
  {
    std::lock_guard<std::mutex> guard(queue_mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  if (owned_ && !mpi_finalized()) {
    auto lock = mpi_lock();
    MPI_Comm_free(&comm_);
  }
}

std::string MpiCommunicator::begin_collective(int op_code, const char* op_name,
                                              const Tensor* tensor, int64_t count, int root,
                                              const std::string& args) {
  reap_orphans();
  const int64_t seq = next_seq_++;
  std::string inner = args;
  if (tensor != nullptr)
    inner += detail::concat(args.empty() ? "" : ", ", count, " × ", dtype_name(tensor->dtype()));
  std::string what = detail::concat(op_name, " #", seq, inner.empty() ? "" : " (" + inner + ")",
                                    " on group '", name_, "' (size ", size_, ", rank ", rank_, ")");
  if (!options_.debug_checks) return what;

  // Every rank contributes (seq, op, count, dtype, root); the first row that differs from ours
  // names the mismatch. Rows 0..size-1 receive, row `size` is ours; a tensor, so a timed-out
  // request keeps its buffer alive.
  Tensor rows = Tensor::empty({5 * (size_ + 1)}, DType::kI64);
  int64_t* all = rows.data<int64_t>();
  int64_t* mine = all + 5 * size_;
  const int64_t fields[5] = {seq, op_code, count,
                             tensor ? static_cast<int64_t>(tensor->dtype()) : -1, root};
  std::copy(fields, fields + 5, mine);
  // Runs on the worker like the collectives, so it stays in issue order with them.
  enqueue([comm = comm_, mine,
           all] { LOOM_MPI_CALL(MPI_Allgather, mine, 5, MPI_INT64_T, all, 5, MPI_INT64_T, comm); },
          "the debug check before " + what, {rows})
      ->wait();
  auto describe = [](const int64_t* row) {
    std::string text = kOpNames[row[1]];
    if (row[3] >= 0)
      text += detail::concat("(", row[2], " × ", dtype_name(static_cast<DType>(row[3])), ")");
    if (row[1] == kBroadcast || row[1] == kReduce) text += detail::concat(" root ", row[4]);
    return text;
  };
  for (int r = 0; r < size_; ++r) {
    const int64_t* row = all + 5 * r;
    if (std::equal(row, row + 5, mine)) continue;
    throw CommError(detail::concat("mpi debug check: at sequence number ", seq, " on group '",
                                   name_, "' rank ", rank_, " calls ", describe(mine), " but rank ",
                                   r, " calls ", describe(row), " (its sequence number ", row[0],
                                   ")"));
  }
  return what;
}

WorkHandle MpiCommunicator::make_work(MPI_Request request, std::string what,
                                      std::vector<Tensor> keep) {
  return std::make_shared<MpiWork>(request, std::move(what), options_.timeout, std::move(keep),
                                   std::function<void()>{});
}

WorkHandle MpiCommunicator::enqueue(std::function<void()> run, std::string what,
                                    std::vector<Tensor> keep, std::function<void()> on_done) {
  auto task = std::make_shared<MpiTask>();
  task->run = std::move(run);
  task->on_done = std::move(on_done);
  task->keep = std::move(keep);
  {
    std::lock_guard<std::mutex> guard(queue_mutex_);
    queue_.push_back(task);
  }
  queue_cv_.notify_one();
  return std::make_shared<MpiTaskWork>(std::move(task), std::move(what), options_.timeout);
}

// Runs the queued collectives one at a time, in issue order, until stopped with an empty queue.
void MpiCommunicator::worker_loop() {
  for (;;) {
    std::shared_ptr<MpiTask> task;
    {
      std::unique_lock<std::mutex> lock(queue_mutex_);
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error;
    try {
      if (mpi_finalized()) throw CommError("mpi: MPI was finalised before the collective ran");
      {
        auto lock = mpi_lock();
        task->run();
      }
      if (task->on_done) task->on_done();
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> guard(task->mutex);
      task->done = true;
      task->error = error;
      task->keep.clear();
      task->run = nullptr;
      task->on_done = nullptr;
      task->cv.notify_all();
    }
  }
}

WorkHandle MpiCommunicator::all_reduce_async(Tensor& tensor, ReduceOp op) {
  expect_host(tensor, "all_reduce", "the");
  const int count = to_count(tensor.numel(), "all_reduce");
  std::string what = begin_collective(kAllReduce, "all_reduce", &tensor, count, -1,
                                      std::string(reduce_op_name(op)));
  std::function<void()> on_done;
  if (op == ReduceOp::kAvg) on_done = [tensor, n = size_] { divide_in_place(tensor, n); };
  return enqueue(
      [comm = comm_, data = tensor.raw(), count, type = mpi_type(tensor.dtype()),
       mop = mpi_op(op, tensor.dtype())] {
        LOOM_MPI_CALL(MPI_Allreduce, MPI_IN_PLACE, data, count, type, mop, comm);
      },
      std::move(what), {tensor}, std::move(on_done));
}

WorkHandle MpiCommunicator::reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) {
  expect_host(input, "reduce_scatter", "input");
  expect_host(output, "reduce_scatter", "output");
  expect_same_dtype(input, output, "reduce_scatter");
  if (input.numel() != output.numel() * size_) {
    fail("mpi: reduce_scatter on group '", name_, "': input has ", input.numel(),
         " elements, expected size ", size_, " × output ", output.numel(), " = ",
         output.numel() * size_);
  }
  const int count = to_count(output.numel(), "reduce_scatter");
  std::string what = begin_collective(kReduceScatter, "reduce_scatter", &output, count, -1,
                                      std::string(reduce_op_name(op)));
  std::function<void()> on_done;
  if (op == ReduceOp::kAvg) on_done = [output, n = size_] { divide_in_place(output, n); };
  return enqueue(
      [comm = comm_, in = input.raw(), out = output.raw(), count, type = mpi_type(input.dtype()),
       mop = mpi_op(op, input.dtype())] {
        LOOM_MPI_CALL(MPI_Reduce_scatter_block, in, out, count, type, mop, comm);
      },
      std::move(what), {input, output}, std::move(on_done));
}

WorkHandle MpiCommunicator::all_gather_async(const Tensor& input, Tensor& output) {
  expect_host(input, "all_gather", "input");
  expect_host(output, "all_gather", "output");
  expect_same_dtype(input, output, "all_gather");
  if (output.numel() != input.numel() * size_) {
    fail("mpi: all_gather on group '", name_, "': output has ", output.numel(),
         " elements, expected size ", size_, " × input ", input.numel(), " = ",
         input.numel() * size_);
  }
  const int count = to_count(input.numel(), "all_gather");
  to_count(output.numel(), "all_gather");
  std::string what = begin_collective(kAllGather, "all_gather", &input, count, -1, "");
  return enqueue(
      [comm = comm_, in = input.raw(), out = output.raw(), count, type = mpi_type(input.dtype())] {
        LOOM_MPI_CALL(MPI_Allgather, in, count, type, out, count, type, comm);
      },
      std::move(what), {input, output});
}

WorkHandle MpiCommunicator::broadcast_async(Tensor& tensor, int root) {
  expect_host(tensor, "broadcast", "the");
  if (root < 0 || root >= size_)
    fail("mpi: broadcast on group '", name_, "': root ", root, " outside [0, ", size_, ")");
  const int count = to_count(tensor.numel(), "broadcast");
  std::string what = begin_collective(kBroadcast, "broadcast", &tensor, count, root,
                                      detail::concat("root ", root));
  return enqueue([comm = comm_, data = tensor.raw(), count, type = mpi_type(tensor.dtype()),
                  root] { LOOM_MPI_CALL(MPI_Bcast, data, count, type, root, comm); },
                 std::move(what), {tensor});
}

WorkHandle MpiCommunicator::reduce_async(Tensor& tensor, int root, ReduceOp op) {
  expect_host(tensor, "reduce", "the");
  if (root < 0 || root >= size_)
    fail("mpi: reduce on group '", name_, "': root ", root, " outside [0, ", size_, ")");
  const int count = to_count(tensor.numel(), "reduce");
  std::string what = begin_collective(kReduce, "reduce", &tensor, count, root,
                                      detail::concat(reduce_op_name(op), ", root ", root));
  std::function<void()> on_done;
  if (op == ReduceOp::kAvg && rank_ == root)
    on_done = [tensor, n = size_] { divide_in_place(tensor, n); };
  // The root reduces in place; the others only send (their recvbuf is not used).
  const void* send = rank_ == root ? MPI_IN_PLACE : tensor.raw();
  return enqueue([comm = comm_, send, data = tensor.raw(), count, type = mpi_type(tensor.dtype()),
                  mop = mpi_op(op, tensor.dtype()),
                  root] { LOOM_MPI_CALL(MPI_Reduce, send, data, count, type, mop, root, comm); },
                 std::move(what), {tensor}, std::move(on_done));
}

WorkHandle MpiCommunicator::all_to_all_async(const Tensor& input, Tensor& output) {
  expect_host(input, "all_to_all", "input");
  expect_host(output, "all_to_all", "output");
  expect_same_dtype(input, output, "all_to_all");
  if (input.numel() != output.numel() || input.numel() % size_ != 0) {
    fail("mpi: all_to_all on group '", name_, "': input (", input.numel(), ") and output (",
         output.numel(), ") must have the same number of elements, a multiple of the group size ",
         size_);
  }
  to_count(input.numel(), "all_to_all");
  const int chunk = static_cast<int>(input.numel() / size_);
  std::string what = begin_collective(kAllToAll, "all_to_all", &input, input.numel(), -1, "");
  return enqueue(
      [comm = comm_, in = input.raw(), out = output.raw(), chunk, type = mpi_type(input.dtype())] {
        LOOM_MPI_CALL(MPI_Alltoall, in, chunk, type, out, chunk, type, comm);
      },
      std::move(what), {input, output});
}

WorkHandle MpiCommunicator::barrier_async() {
  std::string what = begin_collective(kBarrier, "barrier", nullptr, 0, -1, "");
  return enqueue([comm = comm_] { LOOM_MPI_CALL(MPI_Barrier, comm); }, std::move(what), {});
}

WorkHandle MpiCommunicator::send_async(const Tensor& tensor, int dst, int tag) {
  expect_host(tensor, "send", "the");
  if (dst < 0 || dst >= size_)
    fail("mpi: send on group '", name_, "': destination ", dst, " outside [0, ", size_, ")");
  if (tag < 0) fail("mpi: send on group '", name_, "': tag ", tag, " is negative");
  reap_orphans();
  const int count = to_count(tensor.numel(), "send");
  std::string what = detail::concat(
      "send #", next_p2p_seq_++, " (", count, " × ", dtype_name(tensor.dtype()), " to rank ", dst,
      ", tag ", tag, ") on group '", name_, "' (size ", size_, ", rank ", rank_, ")");
  MPI_Request request;
  {
    auto lock = mpi_lock();
    LOOM_MPI_CALL(MPI_Isend, tensor.raw(), count, mpi_type(tensor.dtype()), dst, tag, comm_,
                  &request);
  }
  return make_work(request, std::move(what), {tensor});
}

WorkHandle MpiCommunicator::recv_async(Tensor& tensor, int src, int tag) {
  expect_host(tensor, "recv", "the");
  if (src < 0 || src >= size_)
    fail("mpi: recv on group '", name_, "': source ", src, " outside [0, ", size_, ")");
  if (tag < 0) fail("mpi: recv on group '", name_, "': tag ", tag, " is negative");
  reap_orphans();
  const int count = to_count(tensor.numel(), "recv");
  std::string what = detail::concat(
      "recv #", next_p2p_seq_++, " (", count, " × ", dtype_name(tensor.dtype()), " from rank ", src,
      ", tag ", tag, ") on group '", name_, "' (size ", size_, ", rank ", rank_, ")");
  MPI_Request request;
  {
    auto lock = mpi_lock();
    LOOM_MPI_CALL(MPI_Irecv, tensor.raw(), count, mpi_type(tensor.dtype()), src, tag, comm_,
                  &request);
  }
  return make_work(request, std::move(what), {tensor});
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  MPI_Comm child = MPI_COMM_NULL;
  {
    auto lock = mpi_lock();
    LOOM_MPI_CALL(MPI_Comm_split, comm_, color < 0 ? MPI_UNDEFINED : color, key, &child);
  }
  if (child == MPI_COMM_NULL) return nullptr;
  return std::make_unique<MpiCommunicator>(
      child, /*owned=*/true, detail::concat(name_, "/split(color=", color, ")"), options_);
}

std::unique_ptr<Communicator> make_mpi_world(const CommOptions& options) {
  ensure_initialised();
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, /*owned=*/false, "world", options);
}

}  // namespace loom
