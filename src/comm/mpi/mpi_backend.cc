// MpiCommunicator: the communicator, its worker thread and its collectives (see mpi_backend.h).
// Files: mpi_ops.{h,cc} (MPI state, dtypes, bf16/f16 ops), mpi_work.{h,cc} (Work handles),
// mpi_flight.{h,cc} (flight recorder dumps, arrival board), this file.
#include "comm/mpi/mpi_backend.h"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include "comm/mpi/mpi_flight.h"
#include "comm/mpi/mpi_ops.h"
#include "comm/mpi/mpi_work.h"

namespace loom {

using mpi_internal::MpiFlight;
using mpi_internal::MpiGroupInfo;
using mpi_internal::MpiTask;
using mpi_internal::divide_in_place;
using mpi_internal::expect_host;
using mpi_internal::expect_same_dtype;
using mpi_internal::mpi_finalized;
using mpi_internal::mpi_lock;
using mpi_internal::mpi_op;
using mpi_internal::mpi_type;
using mpi_internal::reap_orphans;
using mpi_internal::to_count;

namespace {

// Collective codes for the debug check.
enum OpCode { kAllReduce, kReduceScatter, kAllGather, kBroadcast, kReduce, kAllToAll, kBarrier };
constexpr const char* kOpNames[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                    "reduce",     "all_to_all",     "barrier"};

bool debug_from_env() {
  const char* value = std::getenv("LOOM_COMM_DEBUG");
  return value != nullptr && std::string_view(value) == "1";
}

// The world ranks of `comm`'s members, by rank in `comm`.
std::vector<int> world_ranks_of(MPI_Comm comm, int size) {
  std::vector<int> ranks(size), world(size);
  for (int r = 0; r < size; ++r) ranks[r] = r;
  auto lock = mpi_lock();
  MPI_Group group, world_group;
  LOOM_MPI_CALL(MPI_Comm_group, comm, &group);
  LOOM_MPI_CALL(MPI_Comm_group, MPI_COMM_WORLD, &world_group);
  LOOM_MPI_CALL(MPI_Group_translate_ranks, group, size, ranks.data(), world_group, world.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  return world;
}

}  // namespace

// ---- MpiCommunicator
// --------------------------------------------------------------------------------

MpiCommunicator::MpiCommunicator(MPI_Comm comm, bool owned, std::string name,
                                 const CommOptions& options, std::shared_ptr<MpiFlight> flight,
                                 int board_id)
    : comm_(comm), owned_(owned), name_(std::move(name)), options_(options) {
  if (debug_from_env()) options_.debug_checks = true;
  {
    auto lock = mpi_lock();
    LOOM_MPI_CALL(MPI_Comm_rank, comm_, &rank_);
    LOOM_MPI_CALL(MPI_Comm_size, comm_, &size_);
  }
  auto group = std::make_shared<MpiGroupInfo>();
  group->name = name_;
  group->rank = rank_;
  group->size = size_;
  group->world_ranks = world_ranks_of(comm_, size_);
  group->board_id = board_id;
  if (!flight) {
    int world_rank = 0, world_size = 1;
    auto lock = mpi_lock();
    LOOM_MPI_CALL(MPI_Comm_rank, MPI_COMM_WORLD, &world_rank);
    LOOM_MPI_CALL(MPI_Comm_size, MPI_COMM_WORLD, &world_size);
    lock = {};
    flight = mpi_internal::make_flight(options_, world_rank, world_size, board_id);
  }
  flight->recorder().add_group(name_, group->world_ranks);
  group->flight = std::move(flight);
  group_ = std::move(group);
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

const FlightRecorder& MpiCommunicator::flight_recorder() const {
  return group_->flight->recorder();
}

MpiCommunicator::Issued MpiCommunicator::begin_collective(int op_code, const char* op_name,
                                                          const Tensor* tensor, int64_t count,
                                                          int root, const std::string& args) {
  reap_orphans();
  MpiFlight& flight = *group_->flight;
  flight.dump_if_peer_timed_out();  // before this op appears in the records
  Issued issued;
  const int64_t seq = issued.seq = next_seq_++;
  group_->mark_issued(seq);
  issued.flight_id = flight.recorder().issued(
      name_, seq, op_name, tensor ? std::string(dtype_name(tensor->dtype())) : std::string(),
      tensor ? count : 0);
  std::string inner = args;
  if (tensor != nullptr)
    inner += detail::concat(args.empty() ? "" : ", ", count, " × ", dtype_name(tensor->dtype()));
  issued.what = detail::concat(op_name, " #", seq, inner.empty() ? "" : " (" + inner + ")",
                               " on group '", name_, "' (size ", size_, ", rank ", rank_, ")");
  if (!options_.debug_checks) return issued;
  try {
    debug_check(issued, op_code, tensor, count, root);
  } catch (...) {
    flight.recorder().failed(issued.flight_id);
    throw;
  }
  return issued;
}

// Every rank contributes (seq, op, count, dtype, root); the first row that differs from ours
// names the mismatch. Rows 0..size-1 receive, row `size` is ours; a tensor, so a timed-out
// request keeps its buffer alive.
void MpiCommunicator::debug_check(const Issued& issued, int op_code, const Tensor* tensor,
                                  int64_t count, int root) {
  const int64_t seq = issued.seq;
  Tensor rows = Tensor::empty({5 * (size_ + 1)}, DType::kI64);
  int64_t* all = rows.data<int64_t>();
  int64_t* mine = all + 5 * size_;
  const int64_t fields[5] = {seq, op_code, count,
                             tensor ? static_cast<int64_t>(tensor->dtype()) : -1, root};
  std::copy(fields, fields + 5, mine);
  // Runs on the worker like the collectives, so it stays in issue order with them; not
  // recorded itself (the collective it checks is).
  Issued check{seq, "the debug check before " + issued.what, mpi_internal::kNotRecorded};
  enqueue([comm = comm_, mine,
           all] { LOOM_MPI_CALL(MPI_Allgather, mine, 5, MPI_INT64_T, all, 5, MPI_INT64_T, comm); },
          std::move(check), {rows})
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
}

uint64_t MpiCommunicator::record_p2p(bool send, int peer, int tag, const Tensor& tensor) {
  group_->flight->dump_if_peer_timed_out();
  const int64_t n = (send ? send_count_ : recv_count_)[{peer, tag}]++;
  return group_->flight->recorder().issued(
      name_ + ":p2p", n,
      detail::concat(send ? "send(dst=" : "recv(src=", peer, ", tag=", tag, ")"),
      std::string(dtype_name(tensor.dtype())), tensor.numel());
}

WorkHandle MpiCommunicator::enqueue(std::function<void()> run, Issued issued,
                                    std::vector<Tensor> keep, std::function<void()> on_done) {
  auto task = std::make_shared<MpiTask>();
  task->run = std::move(run);
  task->on_done = std::move(on_done);
  task->keep = std::move(keep);
  task->group = group_;
  task->seq = issued.seq;
  task->flight_id = issued.flight_id;
  {
    std::lock_guard<std::mutex> guard(queue_mutex_);
    queue_.push_back(task);
  }
  queue_cv_.notify_one();
  return mpi_internal::make_task_work(std::move(task), std::move(issued.what), options_.timeout);
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
    mpi_internal::run_task(*task);
  }
}

WorkHandle MpiCommunicator::all_reduce_async(Tensor& tensor, ReduceOp op) {
  expect_host(tensor, "all_reduce", "the");
  const int count = to_count(tensor.numel(), "all_reduce");
  Issued issued = begin_collective(kAllReduce, "all_reduce", &tensor, count, -1,
                                      std::string(reduce_op_name(op)));
  std::function<void()> on_done;
  if (op == ReduceOp::kAvg) on_done = [tensor, n = size_] { divide_in_place(tensor, n); };
  return enqueue(
      [comm = comm_, data = tensor.raw(), count, type = mpi_type(tensor.dtype()),
       mop = mpi_op(op, tensor.dtype())] {
        LOOM_MPI_CALL(MPI_Allreduce, MPI_IN_PLACE, data, count, type, mop, comm);
      },
      std::move(issued), {tensor}, std::move(on_done));
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
  Issued issued = begin_collective(kReduceScatter, "reduce_scatter", &output, count, -1,
                                      std::string(reduce_op_name(op)));
  std::function<void()> on_done;
  if (op == ReduceOp::kAvg) on_done = [output, n = size_] { divide_in_place(output, n); };
  return enqueue(
      [comm = comm_, in = input.raw(), out = output.raw(), count, type = mpi_type(input.dtype()),
       mop = mpi_op(op, input.dtype())] {
        LOOM_MPI_CALL(MPI_Reduce_scatter_block, in, out, count, type, mop, comm);
      },
      std::move(issued), {input, output}, std::move(on_done));
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
  Issued issued = begin_collective(kAllGather, "all_gather", &input, count, -1, "");
  return enqueue(
      [comm = comm_, in = input.raw(), out = output.raw(), count, type = mpi_type(input.dtype())] {
        LOOM_MPI_CALL(MPI_Allgather, in, count, type, out, count, type, comm);
      },
      std::move(issued), {input, output});
}

WorkHandle MpiCommunicator::broadcast_async(Tensor& tensor, int root) {
  expect_host(tensor, "broadcast", "the");
  if (root < 0 || root >= size_)
    fail("mpi: broadcast on group '", name_, "': root ", root, " outside [0, ", size_, ")");
  const int count = to_count(tensor.numel(), "broadcast");
  Issued issued = begin_collective(kBroadcast, "broadcast", &tensor, count, root,
                                      detail::concat("root ", root));
  return enqueue([comm = comm_, data = tensor.raw(), count, type = mpi_type(tensor.dtype()),
                  root] { LOOM_MPI_CALL(MPI_Bcast, data, count, type, root, comm); },
                 std::move(issued), {tensor});
}

WorkHandle MpiCommunicator::reduce_async(Tensor& tensor, int root, ReduceOp op) {
  expect_host(tensor, "reduce", "the");
  if (root < 0 || root >= size_)
    fail("mpi: reduce on group '", name_, "': root ", root, " outside [0, ", size_, ")");
  const int count = to_count(tensor.numel(), "reduce");
  Issued issued = begin_collective(kReduce, "reduce", &tensor, count, root,
                                      detail::concat(reduce_op_name(op), ", root ", root));
  std::function<void()> on_done;
  if (op == ReduceOp::kAvg && rank_ == root)
    on_done = [tensor, n = size_] { divide_in_place(tensor, n); };
  // The root reduces in place; the others only send (their recvbuf is not used).
  const void* send = rank_ == root ? MPI_IN_PLACE : tensor.raw();
  return enqueue([comm = comm_, send, data = tensor.raw(), count, type = mpi_type(tensor.dtype()),
                  mop = mpi_op(op, tensor.dtype()),
                  root] { LOOM_MPI_CALL(MPI_Reduce, send, data, count, type, mop, root, comm); },
                 std::move(issued), {tensor}, std::move(on_done));
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
  Issued issued = begin_collective(kAllToAll, "all_to_all", &input, input.numel(), -1, "");
  return enqueue(
      [comm = comm_, in = input.raw(), out = output.raw(), chunk, type = mpi_type(input.dtype())] {
        LOOM_MPI_CALL(MPI_Alltoall, in, chunk, type, out, chunk, type, comm);
      },
      std::move(issued), {input, output});
}

WorkHandle MpiCommunicator::barrier_async() {
  Issued issued = begin_collective(kBarrier, "barrier", nullptr, 0, -1, "");
  return enqueue([comm = comm_] { LOOM_MPI_CALL(MPI_Barrier, comm); }, std::move(issued), {});
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
  const uint64_t id = record_p2p(/*send=*/true, dst, tag, tensor);
  return start_p2p(id, std::move(what), tensor, [&](MPI_Request* request) {
    LOOM_MPI_CALL(MPI_Isend, tensor.raw(), count, mpi_type(tensor.dtype()), dst, tag, comm_,
                  request);
  });
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
  const uint64_t id = record_p2p(/*send=*/false, src, tag, tensor);
  return start_p2p(id, std::move(what), tensor, [&](MPI_Request* request) {
    LOOM_MPI_CALL(MPI_Irecv, tensor.raw(), count, mpi_type(tensor.dtype()), src, tag, comm_,
                  request);
  });
}

// Issues the request (under the MPI lock) and wraps it; the record is started at once, as MPI
// now owns the operation.
WorkHandle MpiCommunicator::start_p2p(uint64_t flight_id, std::string what, const Tensor& tensor,
                                      const std::function<void(MPI_Request*)>& issue) {
  FlightRecorder& recorder = group_->flight->recorder();
  MPI_Request request;
  try {
    auto lock = mpi_lock();
    issue(&request);
  } catch (...) {
    recorder.failed(flight_id);
    throw;
  }
  recorder.started(flight_id);
  return mpi_internal::make_request_work(request, std::move(what), options_.timeout, {tensor},
                                         group_, flight_id);
}

// Recorded as the parent group's collective (it takes a sequence number, as in the local
// backend); the new group shares this world's flight recorder and gets an arrival-board id its
// members agree on.
std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) {
  group_->flight->dump_if_peer_timed_out();
  const int64_t seq = next_seq_++;
  group_->mark_issued(seq);
  FlightRecorder& recorder = group_->flight->recorder();
  const uint64_t id = recorder.issued(name_, seq, "split", "", 0);
  recorder.started(id);
  MPI_Comm child = MPI_COMM_NULL;
  int board_id = -1;
  try {
    {
      auto lock = mpi_lock();
      LOOM_MPI_CALL(MPI_Comm_split, comm_, color < 0 ? MPI_UNDEFINED : color, key, &child);
    }
    if (child != MPI_COMM_NULL) board_id = mpi_internal::agree_split_board_id(child);
  } catch (...) {
    recorder.failed(id);
    throw;
  }
  recorder.completed(id);
  if (child == MPI_COMM_NULL) return nullptr;
  return std::make_unique<MpiCommunicator>(child, /*owned=*/true,
                                           detail::concat(name_, "/split(color=", color, ")"),
                                           options_, group_->flight, board_id);
}

// The first call creates the arrival board (collective over MPI_COMM_WORLD).
std::unique_ptr<Communicator> make_mpi_world(const CommOptions& options) {
  mpi_internal::ensure_initialised();
  mpi_internal::ensure_arrival_board();
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, /*owned=*/false, "world", options,
                                           nullptr, mpi_internal::next_world_board_id());
}

}  // namespace loom
