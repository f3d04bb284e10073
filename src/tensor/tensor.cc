#include "tensor/tensor.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "base/error.h"
#include "device/allocator.h"

namespace loom {

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) fail("negative dimension in shape ", shape_str(shape));
    n *= d;
  }
  return n;
}

Storage::Storage(size_t bytes, Device device) : bytes_(bytes), device_(device) {
  data_ = allocator_for(device).allocate(bytes == 0 ? 1 : bytes);
}

Storage::~Storage() { allocator_for(device_).deallocate(data_, bytes_ == 0 ? 1 : bytes_); }

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  Tensor t;
  t.shape_ = shape;
  t.numel_ = shape_numel(shape);
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(t.nbytes(), device);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::from_vector(const std::vector<float>& values, const Shape& shape) {
  if (shape_numel(shape) != static_cast<int64_t>(values.size()))
    fail("from_vector: ", values.size(), " values do not fill shape ", shape_str(shape));
  Tensor t = empty(shape, DType::kF32);
  std::memcpy(t.raw(), values.data(), t.nbytes());
  return t;
}

int64_t Tensor::dim(int i) const {
  if (i < 0) i += ndim();
  LOOM_CHECK(i >= 0 && i < ndim());
  return shape_[i];
}

Device Tensor::device() const { return storage_ ? storage_->device() : Device::cpu(); }

void* Tensor::raw() const {
  LOOM_CHECK(defined());
  return static_cast<char*>(storage_->data()) + offset_;
}

uint16_t* Tensor::data_u16() const {
  LOOM_CHECK(dtype_ == DType::kBF16 || dtype_ == DType::kF16);
  return static_cast<uint16_t*>(raw());
}

Tensor Tensor::reshape(const Shape& shape) const {
  if (shape_numel(shape) != numel_)
    fail("cannot reshape ", shape_str(shape_), " to ", shape_str(shape));
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::narrow(int64_t start, int64_t length) const {
  LOOM_CHECK(ndim() >= 1);
  if (start < 0 || length < 0 || start + length > shape_[0])
    fail("narrow [", start, ", ", start + length, ") out of range for shape ", shape_str(shape_));
  Tensor t = *this;
  t.shape_[0] = length;
  t.numel_ = shape_numel(t.shape_);
  t.offset_ = offset_ + static_cast<size_t>(start) * (numel_ / std::max<int64_t>(1, shape_[0])) *
                            dtype_size(dtype_);
  return t;
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  t.copy_from(*this);
  return t;
}

namespace {
// Reads element i of a host float tensor as double / writes it from double.
double load(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kF64: return static_cast<const double*>(p)[i];
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16: return f16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kI32: return static_cast<const int32_t*>(p)[i];
    case DType::kI64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
  }
  return 0;
}
void store(void* p, DType dt, int64_t i, double v) {
  switch (dt) {
    case DType::kF32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::kF64: static_cast<double*>(p)[i] = v; break;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(static_cast<float>(v)); break;
    case DType::kF16: static_cast<uint16_t*>(p)[i] = float_to_f16(static_cast<float>(v)); break;
    case DType::kI32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::kI64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
  }
}
}  // namespace

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return clone();
  if (!device().is_cpu()) fail("dtype conversion is host-only for now; copy to cpu first");
  if (!is_floating(dtype) || !is_floating(dtype_))
    fail("conversion ", dtype_name(dtype_), " -> ", dtype_name(dtype), " is not supported");
  Tensor t = empty(shape_, dtype, device());
  const void* src = raw();
  void* dst = t.raw();
  // bf16/f16 go through f32 (double would double-round f64 -> f16 through f32 only when the
  // source is f64, and f64 tensors exist only in gradient checks).
  for (int64_t i = 0; i < numel_; ++i) store(dst, dtype, i, load(src, dtype_, i));
  return t;
}

Tensor Tensor::to(Device device) const {
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to_queued(Device device) const {
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from_host_queued(*this);
  return t;
}

void Tensor::zero_() {
  if (numel_ == 0) return;
  zero_bytes(raw(), device(), nbytes());
}

void Tensor::zero_(ThreadPool& pool) {
  constexpr int64_t kPiece = int64_t{1} << 20;  // bytes per task: large runs of one memset
  const int64_t bytes = nbytes();
  if (numel_ == 0 || !device().is_cpu() || pool.size() == 1 || bytes < 4 * kPiece) {
    zero_();
    return;
  }
  char* base = static_cast<char*>(raw());
  pool.parallel_for((bytes + kPiece - 1) / kPiece, 4, [&](int64_t p0, int64_t p1) {
    const int64_t begin = p0 * kPiece, end = std::min(bytes, p1 * kPiece);
    std::memset(base + begin, 0, static_cast<size_t>(end - begin));
  });
}

void Tensor::copy_from(const Tensor& src) {
  if (src.shape_ != shape_ || src.dtype_ != dtype_)
    fail("copy_from: source ", shape_str(src.shape_), " ", dtype_name(src.dtype_),
         " does not match destination ", shape_str(shape_), " ", dtype_name(dtype_));
  copy_bytes(raw(), device(), src.raw(), src.device(), nbytes());
}

void Tensor::copy_from_host_queued(const Tensor& src) {
  if (src.shape_ != shape_ || src.dtype_ != dtype_)
    fail("copy_from_host_queued: source ", shape_str(src.shape_), " ", dtype_name(src.dtype_),
         " does not match destination ", shape_str(shape_), " ", dtype_name(dtype_));
  if (!src.device().is_cpu())
    fail("copy_from_host_queued: the source is on ", src.device().str(), ", not the host");
  copy_bytes_from_host_queued(raw(), device(), src.raw(), nbytes());
}

std::vector<float> Tensor::to_vector() const {
  Tensor host = device().is_cpu() ? *this : to(Device::cpu());
  std::vector<float> out(static_cast<size_t>(numel_));
  for (int64_t i = 0; i < numel_; ++i) out[i] = static_cast<float>(load(host.raw(), dtype_, i));
  return out;
}

void Tensor::expect_shape(const Shape& shape, const std::string& what) const {
  if (shape != shape_)
    fail(what, ": expected shape ", shape_str(shape), ", got ", shape_str(shape_));
}

}  // namespace loom
