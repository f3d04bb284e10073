#include "comm/communicator.h"

#include <algorithm>

#include "device/allocator.h"

namespace loom {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

namespace {
// Two operations as one: done when both are; wait() waits for each (the first error thrown).
class BothWork final : public Work {
 public:
  BothWork(WorkHandle first, WorkHandle second)
      : first_(std::move(first)), second_(std::move(second)) {}
  void wait() override {
    first_->wait();
    second_->wait();
  }
  bool test() override {
    const bool a = first_->test();
    return second_->test() && a;
  }
  void wait_on_device() override {
    first_->wait_on_device();
    second_->wait_on_device();
  }

 private:
  WorkHandle first_, second_;
};

// Many operations as one: done when all are; wait() waits for each in order.
class AllWork final : public Work {
 public:
  explicit AllWork(std::vector<WorkHandle> works) : works_(std::move(works)) {}
  void wait() override {
    for (const WorkHandle& w : works_) w->wait();
  }
  bool test() override {
    bool done = true;
    for (const WorkHandle& w : works_) done = w->test() && done;
    return done;
  }
  void wait_on_device() override {
    for (const WorkHandle& w : works_) w->wait_on_device();
  }

 private:
  std::vector<WorkHandle> works_;
};
}  // namespace

std::pair<std::vector<int64_t>, std::vector<int64_t>> Communicator::all_to_all_v_offsets(
    const Tensor& input, const std::vector<int64_t>& send_counts, const Tensor& output,
    const std::vector<int64_t>& recv_counts) const {
  const int n = size(), me = rank();
  const auto offsets = [&](const std::vector<int64_t>& counts, const Tensor& t, const char* what) {
    if (static_cast<int>(counts.size()) != n)
      throw CommError(detail::concat(name(), ": all_to_all_v's ", what, " counts: ", counts.size(),
                                     " for a group of ", n));
    std::vector<int64_t> at(static_cast<size_t>(n) + 1, 0);
    for (int r = 0; r < n; ++r) {
      if (counts[static_cast<size_t>(r)] < 0)
        throw CommError(detail::concat(name(), ": all_to_all_v: a negative ", what, " count"));
      at[static_cast<size_t>(r) + 1] = at[static_cast<size_t>(r)] + counts[static_cast<size_t>(r)];
    }
    if (at.back() != t.numel())
      throw CommError(detail::concat(name(), ": all_to_all_v's ", what, " counts sum to ",
                                     at.back(), ", the tensor holds ", t.numel()));
    return at;
  };
  std::vector<int64_t> send_at = offsets(send_counts, input, "send");
  std::vector<int64_t> recv_at = offsets(recv_counts, output, "receive");
  if (input.dtype() != output.dtype())
    throw CommError(detail::concat(name(), ": all_to_all_v from ", dtype_name(input.dtype()),
                                   " into ", dtype_name(output.dtype())));
  if (send_counts[static_cast<size_t>(me)] != recv_counts[static_cast<size_t>(me)])
    throw CommError(detail::concat(name(), ": all_to_all_v sends itself ",
                                   send_counts[static_cast<size_t>(me)], " elements but expects ",
                                   recv_counts[static_cast<size_t>(me)]));
  return {std::move(send_at), std::move(recv_at)};
}

Tensor Communicator::all_to_all_v_block(const Tensor& t, const std::vector<int64_t>& at, int r) {
  const int64_t begin = at[static_cast<size_t>(r)];
  return t.reshape({t.numel()}).narrow(begin, at[static_cast<size_t>(r) + 1] - begin);
}

WorkHandle Communicator::all_to_all_v_async(const Tensor& input,
                                            const std::vector<int64_t>& send_counts, Tensor& output,
                                            const std::vector<int64_t>& recv_counts) {
  const int n = size(), me = rank();
  const auto [send_at, recv_at] = all_to_all_v_offsets(input, send_counts, output, recv_counts);
  const auto block = all_to_all_v_block;
  if (send_counts[static_cast<size_t>(me)] >
      0) {  // in the device's queue, as the messages' kernels are
    const Tensor from = block(input, send_at, me);
    Tensor into = block(output, recv_at, me);
    copy_bytes_queued(into.raw(), from.raw(), output.device(), static_cast<size_t>(from.nbytes()));
  }
  std::vector<WorkHandle> works;
  for (int k = 1; k < n; ++k) {
    const int to = (me + k) % n, from = (me - k + n) % n;
    const bool sends = send_counts[static_cast<size_t>(to)] > 0;
    const bool receives = recv_counts[static_cast<size_t>(from)] > 0;
    Tensor out = block(input, send_at, to), in = block(output, recv_at, from);
    if (sends && receives)
      works.push_back(send_recv_async(out, to, in, from, kAllToAllVTag));
    else if (sends)
      works.push_back(send_async(out, to, kAllToAllVTag));
    else if (receives)
      works.push_back(recv_async(in, from, kAllToAllVTag));
  }
  return std::make_shared<AllWork>(std::move(works));
}

WorkHandle Communicator::send_recv_async(const Tensor& to_send, int dst, Tensor& into, int src,
                                         int tag) {
  WorkHandle sent = send_async(to_send, dst, tag);
  return std::make_shared<BothWork>(std::move(sent), recv_async(into, src, tag));
}

// A GPU communicator's value goes up queued behind the GPU's work (copy_from_host_queued) and
// comes back by a copy behind the operation (wait_on_device), so the host waits once, for the
// result; check() then says whether the operation failed (the value would be garbage).
std::vector<double> all_reduce_values(Communicator& comm, const std::vector<double>& values,
                                      ReduceOp op) {
  Tensor host = Tensor::empty({static_cast<int64_t>(values.size())}, DType::kF64);
  std::copy(values.begin(), values.end(), host.data<double>());
  Tensor t = host.to_queued(comm.tensor_device());
  comm.all_reduce_async(t, op)->wait_on_device();
  const Tensor back = t.to(Device::cpu());
  comm.check();
  return std::vector<double>(back.data<double>(), back.data<double>() + back.numel());
}

double all_reduce_value(Communicator& comm, double value, ReduceOp op) {
  return all_reduce_values(comm, {value}, op)[0];
}

std::vector<double> all_gather_values(Communicator& comm, const std::vector<double>& mine) {
  const int64_t n = static_cast<int64_t>(mine.size());
  Tensor host = Tensor::empty({n}, DType::kF64);
  std::copy(mine.begin(), mine.end(), host.data<double>());
  Tensor all = Tensor::empty({n * comm.size()}, DType::kF64, comm.tensor_device());
  comm.all_gather_async(host.to_queued(comm.tensor_device()), all)->wait_on_device();
  Tensor back = all.to(Device::cpu());
  comm.check();
  return std::vector<double>(back.data<double>(), back.data<double>() + back.numel());
}

std::vector<int64_t> all_to_all_values(Communicator& comm, const std::vector<int64_t>& to_each) {
  const int64_t n = static_cast<int64_t>(to_each.size());
  if (n != comm.size())
    throw CommError(detail::concat(comm.name(), ": all_to_all_values of ", n,
                                   " values for a group of ", comm.size()));
  Tensor host = Tensor::empty({n}, DType::kI64);
  std::copy(to_each.begin(), to_each.end(), host.data<int64_t>());
  Tensor theirs = Tensor::empty({n}, DType::kI64, comm.tensor_device());
  comm.all_to_all_async(host.to_queued(comm.tensor_device()), theirs)->wait_on_device();
  const Tensor back = theirs.to(Device::cpu());
  comm.check();
  return std::vector<int64_t>(back.data<int64_t>(), back.data<int64_t>() + n);
}

}  // namespace loom
