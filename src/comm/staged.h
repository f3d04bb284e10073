// StagedCommunicator — a host communicator (local thread ranks or MPI processes) carrying tensors
// that live on a GPU: each operation copies its GPU tensors into host buffers, runs on the host
// communicator, and copies results back. Any number of ranks may share a GPU this way, and the
// host backends' semantics come along: buffered sends, tags matched exactly, every collective.
//
// What it is for: GPU jobs without nccl or with more ranks than GPUs (runtime.backend = "local"
// or "mpi" on cuda), which is how one GPU checks every strategy against the CPU. It is slow by
// design: every byte crosses PCIe twice.
//
// Asynchrony is kept: the device-to-host copy happens when the operation is issued (after the
// GPU work queued before it, as a copy waits for its stream), the host operation runs
// asynchronously as usual, and wait() / test() == true copy the result back to the GPU before
// returning. Tensors on the staging device itself pass straight through; every other tensor is
// staged, host ones included (which is how the CPU tests run this code: ranks' tensors on cpu:r,
// staging on another cpu device).
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace loom {

class StagedCommunicator final : public Communicator {
 public:
  // Wraps `inner` (not owned; it must outlive this), whose tensors must be host tensors; staging
  // buffers come from `host`'s allocator (a cpu device).
  StagedCommunicator(Communicator& inner, Device host);
  // Owns `inner` (what split returns).
  StagedCommunicator(std::unique_ptr<Communicator> inner, Device host);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }
  std::string backend() const override { return inner_->backend(); }
  // The staging device: its tensors need no copies (scalars, all_reduce_value).
  Device tensor_device() const override { return host_; }

  WorkHandle all_reduce_async(Tensor& tensor, ReduceOp op) override;
  WorkHandle reduce_scatter_async(const Tensor& input, Tensor& output, ReduceOp op) override;
  WorkHandle all_gather_async(const Tensor& input, Tensor& output) override;
  WorkHandle broadcast_async(Tensor& tensor, int root) override;
  WorkHandle reduce_async(Tensor& tensor, int root, ReduceOp op) override;
  WorkHandle all_to_all_async(const Tensor& input, Tensor& output) override;
  WorkHandle barrier_async() override { return inner_->barrier_async(); }
  WorkHandle send_async(const Tensor& tensor, int dst, int tag) override;
  WorkHandle recv_async(Tensor& tensor, int src, int tag) override;
  std::unique_ptr<Communicator> split(int color, int key) override;

 private:
  bool staged(const Tensor& t) const;  // not on host_
  // An operation from `input` into `output` (reduce_scatter, all_gather, all_to_all): `issue`
  // starts it on the host copies.
  template <typename Issue>
  WorkHandle in_out(const Tensor& input, Tensor& output, Issue issue);
  // A copy of `t` on host_ (t itself when already there); with `contents`, the data copied too.
  Tensor to_host(const Tensor& t, bool contents) const;

  std::unique_ptr<Communicator> owned_;
  Communicator* inner_;
  Device host_;
};

}  // namespace loom
