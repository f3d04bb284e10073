#include "comm/communicator.h"

#include <algorithm>

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
}  // namespace

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

}  // namespace loom
