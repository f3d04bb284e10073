// Tensor — a contiguous, row-major n-d array on one device, owning (a share of) its storage.
//
// Deliberately simple, in the spirit of llm.c: no strides, no autograd. Modules keep their
// activations as Tensors and call kernels on raw pointers; views (reshape, narrow along dim 0)
// share the storage. Storage comes from the device's counting allocator, so memory statistics
// cover every tensor.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "base/check.h"
#include "base/thread_pool.h"
#include "device/device.h"
#include "tensor/dtype.h"

namespace loom {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& shape);  // "[2, 3, 4]"
int64_t shape_numel(const Shape& shape);

class Storage {
 public:
  Storage(size_t bytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
};

class Tensor {
 public:
  Tensor() = default;  // undefined tensor

  // Uninitialised contents (reused allocator blocks hold old data).
  static Tensor empty(const Shape& shape, DType dtype = DType::kF32, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype = DType::kF32, Device device = Device::cpu());
  // A host tensor holding `values` (f32), shaped `shape`.
  static Tensor from_vector(const std::vector<float>& values, const Shape& shape);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const;  // negative i counts from the end
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return numel_; }
  DType dtype() const { return dtype_; }
  Device device() const;
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }

  void* raw() const;
  template <typename T>
  T* data() const {
    LOOM_CHECK_MSG(defined() && DTypeOf<T>::value == dtype_, "tensor dtype mismatch");
    return static_cast<T*>(raw());
  }
  uint16_t* data_u16() const;  // bf16/f16 raw storage

  // Views sharing storage.
  Tensor reshape(const Shape& shape) const;          // same numel; throws naming both shapes
  Tensor narrow(int64_t start, int64_t length) const;  // rows [start, start+length) of dim 0

  // New tensors.
  Tensor clone() const;
  Tensor to(DType dtype) const;    // host conversion between float dtypes (f32/f64/bf16/f16)
  Tensor to(Device device) const;  // copy to another device (same dtype)
  // A host tensor's copy on `device`, uploaded without waiting for it (copy_from_host_queued).
  Tensor to_queued(Device device) const;

  void zero_();
  // The same, a host tensor's bytes split over `pool`'s threads: one thread's memset of a large
  // buffer (a model's gradients) runs at ~7 GB/s, a part of what the memory takes. A GPU's
  // tensor is zeroed on the GPU as by zero_().
  void zero_(ThreadPool& pool);
  void copy_from(const Tensor& src);  // same shape and dtype, any devices
  // The same from a host tensor, without waiting for the device: on a GPU through page-locked
  // staging, queued on the compute stream after the work queued there (copy_bytes_from_host_queued).
  // For a training step's batches, which copy_from would make wait for the last micro-batch.
  void copy_from_host_queued(const Tensor& src);
  std::vector<float> to_vector() const;  // host copy as f32 (float dtypes only)

  // Throws loom::Error "<what>: expected shape [..], got [..]" on mismatch.
  void expect_shape(const Shape& shape, const std::string& what) const;

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::kF32;
};

}  // namespace loom
