// NcclCommunicator's point-to-point messages (nccl_backend.h: "Send/recv and tags"): each
// preceded by a header the receiver checks, since NCCL matches messages by order, not by tag;
// a message to oneself is a copy on the stream.
#include <cstring>

#include "comm/nccl/nccl_backend.h"
#include "comm/nccl/nccl_shared.h"
#include "device/cuda/cuda_check.h"

namespace loom {

using namespace nccl;

namespace {
enum HeaderField { kTag, kCount, kDType, kNumber, kHeaderFields };

// A message, checked and numbered: "send(dst=1, tag=3) #4 on group ...", where #4 counts the
// earlier messages this rank sent to (received from) that peer; its flight record likewise.
struct P2p {
  std::string what;
  int64_t number = 0;
  FlightNote note;
};
P2p p2p_op(NcclShared& s, const char* op, const char* peer_name, int peer, int tag,
           std::vector<int64_t>& counter, const Tensor& t) {
  if (peer < 0 || peer >= s.size)
    comm_fail(op, " on group '", s.name, "': ", peer_name, " ", peer, " outside [0, ", s.size, ")");
  int64_t number = 0;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    number = counter[static_cast<size_t>(peer)]++;
  }
  std::string name = detail::concat(op, "(", peer_name, "=", peer, ", tag=", tag, ")");
  return {detail::concat(name, " #", number, " on ", s.group()), number,
          FlightNote{true, number, std::move(name), std::string(dtype_name(t.dtype())),
                     t.numel()}};
}

// A message's header on the tensor's GPU: its tag, size, dtype and number, which the receiver
// compares with what it expects (NCCL matches a recv with the peer's next send, whatever its tag).
// Uploaded queued on the compute stream, which the send's stream waits for, so the host does
// not wait for the GPU's work before each send.
Tensor header_of(const Tensor& tensor, int tag, int64_t number) {
  Tensor host = Tensor::empty({kHeaderFields}, DType::kI64);
  const int64_t fields[kHeaderFields] = {tag, tensor.numel(), static_cast<int64_t>(tensor.dtype()),
                                         number};
  std::memcpy(host.raw(), fields, sizeof fields);
  return host.to_queued(tensor.device());
}

// The receiver's check of a header that arrived into `header`, run once the recv completed (its
// event done, so the bytes are there for any stream): read on the readback stream.
std::function<void()> header_check(const std::shared_ptr<NcclShared>& shared, const Tensor& header,
                                   const std::string& what, int tag, const Tensor& into,
                                   int64_t number) {
  return [shared, header, what, tag, n = into.numel(), dtype = into.dtype(), number] {
    int64_t h[kHeaderFields] = {};
    {
      cuda::DeviceGuard guard(shared->device);
      LOOM_NCCL_CUDA(cudaMemcpyAsync(h, header.raw(), sizeof h, cudaMemcpyDeviceToHost,
                                     shared->readback));
      LOOM_NCCL_CUDA(cudaStreamSynchronize(shared->readback));
    }
    if (h[kTag] == tag && h[kCount] == n && h[kDType] == static_cast<int64_t>(dtype)) return;
    comm_fail(what, ": got a message with tag ", h[kTag], ", ", h[kCount], " × ",
              dtype_name(static_cast<DType>(h[kDType])), " (the peer's send #", h[kNumber],
              "), expected tag ", tag, ", ", n, " × ", dtype_name(dtype), " (recv #", number,
              "); NCCL matches messages by order, so post recvs in the order of the sends");
  };
}

// The NCCL calls of a send (header, then payload) and of a recv, inside a group.
ncclResult_t nccl_send(NcclShared& s, const Tensor& header, const Tensor& tensor, int dst) {
  ncclResult_t r = ncclSend(header.raw(), kHeaderFields, ncclInt64, dst, s.comm, s.stream);
  if (r == ncclSuccess && tensor.numel() > 0)
    r = ncclSend(tensor.raw(), count(tensor), nccl_type(tensor.dtype()), dst, s.comm, s.stream);
  return r;
}
ncclResult_t nccl_recv(NcclShared& s, const Tensor& header, Tensor& tensor, int src) {
  ncclResult_t r = ncclRecv(header.raw(), kHeaderFields, ncclInt64, src, s.comm, s.stream);
  if (r == ncclSuccess && tensor.numel() > 0)
    r = ncclRecv(tensor.raw(), count(tensor), nccl_type(tensor.dtype()), src, s.comm, s.stream);
  return r;
}

ncclResult_t copy_on_stream(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return ncclSuccess;
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream) == cudaSuccess
             ? ncclSuccess
             : ncclUnhandledCudaError;
}
}  // namespace

WorkHandle NcclCommunicator::send_async(const Tensor& tensor, int dst, int tag) {
  expect_on_gpu(tensor, shared_->device, "send", "the");
  NcclShared& s = *shared_;
  P2p send = p2p_op(s, "send", "dst", dst, tag, s.sent, tensor);
  if (dst == rank_) {
    // To oneself: an eager copy, queued for the recv (NCCL would need both in one group).
    Tensor copy = Tensor::empty(tensor.shape(), tensor.dtype(), tensor.device());
    WorkHandle work =
        launch(shared_, {send.what}, "cudaMemcpyAsync",
               [&] { return copy_on_stream(copy.raw(), tensor.raw(), tensor.nbytes(), s.stream); },
               {tensor, copy}, {send.note});
    std::lock_guard<std::mutex> lock(s.mutex);
    s.self_messages[tag].push_back(copy);
    return work;
  }
  const Tensor header = header_of(tensor, tag, send.number);
  return launch(shared_, {send.what}, "ncclSend",
                [&] { return grouped([&] { return nccl_send(s, header, tensor, dst); }); },
                {tensor, header}, {send.note});
}

WorkHandle NcclCommunicator::recv_async(Tensor& tensor, int src, int tag) {
  expect_on_gpu(tensor, shared_->device, "recv", "the");
  NcclShared& s = *shared_;
  P2p recv = p2p_op(s, "recv", "src", src, tag, s.received, tensor);
  const std::string& what = recv.what;
  if (src == rank_) {
    Tensor message;
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      auto& box = s.self_messages[tag];
      if (!box.empty()) {
        message = box.front();
        box.pop_front();
      }
    }
    // The stream runs in issue order, so a recv from oneself can never wait for a later send.
    if (!message.defined())
      comm_fail(what, ": no message from this rank to itself with tag ", tag,
                " (a recv from oneself must follow its send)");
    if (message.numel() != tensor.numel() || message.dtype() != tensor.dtype())
      comm_fail(what, ": rank ", src, " sent ", message.numel(), " × ", dtype_name(message.dtype()),
                ", expected ", tensor.numel(), " × ", dtype_name(tensor.dtype()));
    return launch(
        shared_, {what}, "cudaMemcpyAsync",
        [&] { return copy_on_stream(tensor.raw(), message.raw(), tensor.nbytes(), s.stream); },
        {tensor, message}, {recv.note});
  }
  Tensor header = Tensor::empty({kHeaderFields}, DType::kI64, tensor.device());
  return launch(shared_, {what}, "ncclRecv",
                [&] { return grouped([&] { return nccl_recv(s, header, tensor, src); }); },
                {tensor, header}, {recv.note},
                header_check(shared_, header, what, tag, tensor, recv.number));
}

WorkHandle NcclCommunicator::all_to_all_v_async(const Tensor& input,
                                                const std::vector<int64_t>& send_counts,
                                                Tensor& output,
                                                const std::vector<int64_t>& recv_counts) {
  expect_on_gpu(input, shared_->device, "all_to_all_v", "the input");
  expect_on_gpu(output, shared_->device, "all_to_all_v", "the output");
  const auto [send_at, recv_at] = all_to_all_v_offsets(input, send_counts, output, recv_counts);
  const auto block = all_to_all_v_block;
  NcclShared& s = *shared_;
  const int n = size_, me = rank_;
  struct Message {
    int peer;
    Tensor data, header;
  };
  std::vector<Message> sends, recvs;
  std::vector<Tensor> keep = {input, output};
  std::vector<FlightNote> notes;
  std::vector<std::function<void()>> checks;
  std::string what = detail::concat("all_to_all_v on ", s.group());
  for (int k = 1; k < n; ++k) {  // the ring's order, as the default's
    const int to = (me + k) % n, from = (me - k + n) % n;
    if (send_counts[static_cast<size_t>(to)] > 0) {
      const Tensor data = block(input, send_at, to);
      const P2p send = p2p_op(s, "send", "dst", to, kAllToAllVTag, s.sent, data);
      sends.push_back({to, data, header_of(data, kAllToAllVTag, send.number)});
      keep.push_back(sends.back().header);
      notes.push_back(send.note);
    }
    if (recv_counts[static_cast<size_t>(from)] > 0) {
      const Tensor data = block(output, recv_at, from);
      const P2p recv = p2p_op(s, "recv", "src", from, kAllToAllVTag, s.received, data);
      recvs.push_back({from, data, Tensor::empty({kHeaderFields}, DType::kI64, output.device())});
      keep.push_back(recvs.back().header);
      notes.push_back(recv.note);
      checks.push_back(
          header_check(shared_, recvs.back().header, recv.what, kAllToAllVTag, data, recv.number));
    }
  }
  const Tensor own = block(input, send_at, me);
  Tensor own_out = block(output, recv_at, me);
  return launch(
      shared_, {what}, "ncclSend/ncclRecv",
      [&] {
        ncclResult_t r = copy_on_stream(own_out.raw(), own.raw(), own.nbytes(), s.stream);
        if (r != ncclSuccess || (sends.empty() && recvs.empty())) return r;
        return grouped([&] {
          ncclResult_t result = ncclSuccess;
          for (Message& m : sends)
            if (result == ncclSuccess) result = nccl_send(s, m.header, m.data, m.peer);
          for (Message& m : recvs)
            if (result == ncclSuccess) result = nccl_recv(s, m.header, m.data, m.peer);
          return result;
        });
      },
      std::move(keep), notes,
      [checks = std::move(checks)] {
        for (const auto& check : checks) check();
      });
}

WorkHandle NcclCommunicator::send_recv_async(const Tensor& to_send, int dst, Tensor& into, int src,
                                             int tag) {
  // A message to or from oneself goes through the eager self-copy of send_async / recv_async.
  if (dst == rank_ || src == rank_)
    return Communicator::send_recv_async(to_send, dst, into, src, tag);
  expect_on_gpu(to_send, shared_->device, "send", "the");
  expect_on_gpu(into, shared_->device, "recv", "the");
  NcclShared& s = *shared_;
  const P2p send = p2p_op(s, "send", "dst", dst, tag, s.sent, to_send);
  const P2p recv = p2p_op(s, "recv", "src", src, tag, s.received, into);
  const Tensor out_header = header_of(to_send, tag, send.number);
  Tensor in_header = Tensor::empty({kHeaderFields}, DType::kI64, into.device());
  return launch(shared_, {send.what + " with " + recv.what}, "ncclSend/ncclRecv",
                [&] {
                  return grouped([&] {
                    const ncclResult_t r = nccl_send(s, out_header, to_send, dst);
                    return r == ncclSuccess ? nccl_recv(s, in_header, into, src) : r;
                  });
                },
                {to_send, into, out_header, in_header}, {send.note, recv.note},
                header_check(shared_, in_header, recv.what, tag, into, recv.number));
}

}  // namespace loom
