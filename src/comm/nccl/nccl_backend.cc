// NcclCommunicator (nccl_backend.h): its state, and the collectives — each names its operation
// ("all_reduce #7 (sum, 1001 × f32) on group ...") and enqueues one NCCL call through launch()
// (nccl_work.cc). Send / recv are in nccl_p2p.cc, init and split in nccl_setup.cc.
#include "comm/nccl/nccl_backend.h"

#include <algorithm>
#include <cstring>

#include "comm/nccl/nccl_shared.h"

namespace loom {

using namespace nccl;

NcclCommunicator::NcclCommunicator(std::shared_ptr<NcclShared> shared, std::string name)
    : shared_(std::move(shared)),
      name_(std::move(name)),
      rank_(shared_->rank),
      size_(shared_->size) {}

NcclCommunicator::~NcclCommunicator() {
  shared_->close();
}

int NcclCommunicator::cuda_device() const {
  return shared_->device;
}

void NcclCommunicator::check() {
  NcclShared& s = *shared_;
  std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.failed) s.sweep_locked();  // the completed operations' checks, now
  if (s.failed) comm_fail(s.aborted, "; communicator aborted");
}

void NcclCommunicator::on_device_wait(std::function<void(double, double)> observer) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  shared_->on_stall = std::move(observer);
}

double NcclCommunicator::take_device_wait_seconds() {
  NcclShared& s = *shared_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.reap_locked();
  return std::exchange(s.stalled_seconds, 0.0);
}

namespace {
void expect_pair(const Tensor& input, const Tensor& output, int device, const char* op) {
  expect_on_gpu(input, device, op, "input");
  expect_on_gpu(output, device, op, "output");
  if (input.dtype() != output.dtype())
    comm_fail(op, ": input is ", dtype_name(input.dtype()), " but output is ",
              dtype_name(output.dtype()));
}

void expect_root(int root, int size, const std::string& name, const char* op) {
  if (root < 0 || root >= size)
    comm_fail(op, " on group '", name, "': root ", root, " outside [0, ", size, ")");
}

// CommOptions::debug_checks: every rank's sequence number and collective as text ("all_reduce(sum,
// 5 × f32)") gathered before the collective is enqueued; the first rank whose differ is named and
// the collective is not enqueued (mismatched NCCL collectives hang, or read or write past a
// buffer). One all-gather and one host wait a collective: for debugging. The group stays usable.
void debug_check(const std::shared_ptr<NcclShared>& s, int64_t seq, const std::string& text) {
  constexpr size_t kWords = 12;  // the sequence number, then up to 87 bytes of text and a 0
  std::vector<int64_t> words(kWords, 0);
  words[0] = seq;
  std::memcpy(words.data() + 1, text.data(), std::min(text.size(), 8 * (kWords - 1) - 1));
  const std::vector<int64_t> rows = all_gather_words(
      s, words, detail::concat("the debug check before ", text, " #", seq, " on ", s->group()));
  for (int r = 0; r < s->size; ++r) {
    const int64_t* row = rows.data() + static_cast<size_t>(r) * kWords;
    if (std::equal(row, row + kWords, words.begin())) continue;
    throw CommError(detail::concat(
        "nccl debug check: at sequence number ", seq, " on group '", s->name, "' rank ", s->rank,
        " calls ", text, " but rank ", r, " calls ", reinterpret_cast<const char*>(row + 1),
        " (its sequence number ", row[0], ")"));
  }
}

// Names the group's next collective ("all_reduce #7 (sum, 1001 × f32) on group ...") and
// enqueues `call`; an empty `t` enqueues nothing NCCL-side (NCCL gains nothing from it).
WorkHandle collective(const std::shared_ptr<NcclShared>& s, const char* op, const Tensor* t,
                      const std::string& args, const char* call_name,
                      std::function<ncclResult_t()> call, std::vector<Tensor> keep) {
  std::string inner = args;
  if (t != nullptr) {
    inner += detail::concat(args.empty() ? "" : ", ", t->numel(), " × ", dtype_name(t->dtype()));
    if (t->numel() == 0) call = nullptr;
  }
  int64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(s->mutex);
    seq = s->next_seq++;
  }
  if (s->options.debug_checks)
    debug_check(s, seq, detail::concat(op, inner.empty() ? "" : "(" + inner + ")"));
  OpInfo info(
      detail::concat(op, " #", seq, inner.empty() ? "" : " (" + inner + ")", " on ", s->group()),
      seq);
  FlightNote note{false, seq, op, t ? std::string(dtype_name(t->dtype())) : "",
                  t ? t->numel() : 0};
  return launch(s, std::move(info), call_name, call, std::move(keep), {note});
}
}  // namespace

WorkHandle NcclCommunicator::all_reduce_async(Tensor& tensor, ReduceOp op) {
  expect_on_gpu(tensor, shared_->device, "all_reduce", "the");
  NcclShared& s = *shared_;
  return collective(
      shared_, "all_reduce", &tensor, std::string(reduce_op_name(op)), "ncclAllReduce",
      [&] {
        return ncclAllReduce(tensor.raw(), tensor.raw(), count(tensor), nccl_type(tensor.dtype()),
                             nccl_op(op), s.comm, s.stream);
      },
      {tensor});
}

WorkHandle NcclCommunicator::reduce_scatter_async(const Tensor& input, Tensor& output,
                                                  ReduceOp op) {
  expect_pair(input, output, shared_->device, "reduce_scatter");
  if (input.numel() != output.numel() * size_)
    comm_fail("reduce_scatter on group '", name_, "': input has ", input.numel(),
              " elements, expected size ", size_, " × output ", output.numel());
  NcclShared& s = *shared_;
  return collective(
      shared_, "reduce_scatter", &output, std::string(reduce_op_name(op)), "ncclReduceScatter",
      [&] {
        return ncclReduceScatter(input.raw(), output.raw(), count(output), nccl_type(input.dtype()),
                                 nccl_op(op), s.comm, s.stream);
      },
      {input, output});
}

WorkHandle NcclCommunicator::all_gather_async(const Tensor& input, Tensor& output) {
  expect_pair(input, output, shared_->device, "all_gather");
  if (output.numel() != input.numel() * size_)
    comm_fail("all_gather on group '", name_, "': output has ", output.numel(),
              " elements, expected size ", size_, " × input ", input.numel());
  NcclShared& s = *shared_;
  return collective(shared_, "all_gather", &input, "", "ncclAllGather",
                    [&] {
                      return ncclAllGather(input.raw(), output.raw(), count(input),
                                           nccl_type(input.dtype()), s.comm, s.stream);
                    },
                    {input, output});
}

WorkHandle NcclCommunicator::broadcast_async(Tensor& tensor, int root) {
  expect_on_gpu(tensor, shared_->device, "broadcast", "the");
  expect_root(root, size_, name_, "broadcast");
  NcclShared& s = *shared_;
  return collective(shared_, "broadcast", &tensor, detail::concat("root ", root), "ncclBroadcast",
                    [&] {
                      return ncclBroadcast(tensor.raw(), tensor.raw(), count(tensor),
                                           nccl_type(tensor.dtype()), root, s.comm, s.stream);
                    },
                    {tensor});
}

WorkHandle NcclCommunicator::reduce_async(Tensor& tensor, int root, ReduceOp op) {
  expect_on_gpu(tensor, shared_->device, "reduce", "the");
  expect_root(root, size_, name_, "reduce");
  NcclShared& s = *shared_;
  // In place: recvbuff is only written at root, so the other ranks keep their tensors.
  return collective(
      shared_, "reduce", &tensor, detail::concat(reduce_op_name(op), ", root ", root), "ncclReduce",
      [&] {
        return ncclReduce(tensor.raw(), tensor.raw(), count(tensor), nccl_type(tensor.dtype()),
                          nccl_op(op), root, s.comm, s.stream);
      },
      {tensor});
}

WorkHandle NcclCommunicator::all_to_all_async(const Tensor& input, Tensor& output) {
  expect_pair(input, output, shared_->device, "all_to_all");
  if (input.numel() != output.numel() || input.numel() % size_ != 0)
    comm_fail("all_to_all on group '", name_, "': input has ", input.numel(), " and output ",
              output.numel(), " elements; both must be the same multiple of size ", size_);
  NcclShared& s = *shared_;
  return collective(shared_, "all_to_all", &input, "", "ncclSend/ncclRecv group",
                    [&] {
                      return grouped([&] {
                        const size_t n = count(input) / static_cast<size_t>(s.size);
                        const size_t bytes = n * dtype_size(input.dtype());
                        const auto* in = static_cast<const char*>(input.raw());
                        auto* out = static_cast<char*>(output.raw());
                        const ncclDataType_t type = nccl_type(input.dtype());
                        for (int peer = 0; peer < s.size; ++peer) {
                          const size_t at = static_cast<size_t>(peer) * bytes;
                          ncclResult_t r = ncclSend(in + at, n, type, peer, s.comm, s.stream);
                          if (r == ncclSuccess)
                            r = ncclRecv(out + at, n, type, peer, s.comm, s.stream);
                          if (r != ncclSuccess) return r;
                        }
                        return ncclSuccess;
                      });
                    },
                    {input, output});
}

WorkHandle NcclCommunicator::barrier_async() {
  NcclShared& s = *shared_;
  return collective(shared_, "barrier", nullptr, "", "ncclAllReduce",
                    [&] {
                      return ncclAllReduce(s.scratch.raw(), s.scratch.raw(), 1, ncclFloat32,
                                           ncclSum, s.comm, s.stream);
                    },
                    {s.scratch});
}

}  // namespace loom
