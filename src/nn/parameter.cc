#include "nn/parameter.h"

#include <algorithm>

#include "base/error.h"
#include "tensor/rng.h"

namespace loom {

Parameter* ParameterStore::add(const std::string& name, const Shape& shape, InitKind init,
                               float init_std) {
  if (allocated()) fail("parameter '", name, "' registered after the store was allocated");
  if (find(name) != nullptr) fail("parameter '", name, "' registered twice");
  auto p = std::make_unique<Parameter>();
  p->name = name;
  p->shape = shape;
  p->init = init;
  p->init_std = init_std;
  p->weight_decay = shape.size() >= 2;
  if (units_.empty()) units_.push_back(ParamUnit{"all", 0, 0, {}});
  units_.back().params.push_back(p.get());
  params_.push_back(std::move(p));
  return params_.back().get();
}

void ParameterStore::begin_unit(const std::string& name) {
  if (allocated()) fail("unit '", name, "' begun after the store was allocated");
  if (!units_.empty() && units_.back().params.empty()) fail("unit '", units_.back().name, "' is empty");
  units_.push_back(ParamUnit{name, 0, 0, {}});
}

void ParameterStore::allocate(DType dtype, Device device, const AllocateOptions& options) {
  LOOM_CHECK(!allocated());
  LOOM_CHECK(options.unit_multiple >= 1);
  // Offsets rounded up to 16 elements (64 B for f32) so every parameter starts cache-aligned;
  // each unit padded to a multiple of unit_multiple.
  int64_t offset = 0;
  for (ParamUnit& unit : units_) {
    unit.begin = offset;
    for (Parameter* p : unit.params) {
      p->offset = (offset + 15) / 16 * 16;
      offset = p->offset + p->numel();
    }
    const int64_t m = options.unit_multiple;
    offset = (offset + m - 1) / m * m;
    unit.numel = offset - unit.begin;
  }
  numel_ = offset;
  dtype_ = dtype;
  device_ = device;
  allocated_ = true;
  if (options.values) values_ = Tensor::zeros({numel_}, dtype, device);
  if (options.grads) grads_ = Tensor::zeros({numel_}, dtype, device);
  for (size_t u = 0; u < units_.size(); ++u) {
    const ParamUnit& unit = units_[u];
    bind_unit_values(u, values_.defined() ? values_.narrow(unit.begin, unit.numel) : Tensor());
    bind_unit_grads(u, grads_.defined() ? grads_.narrow(unit.begin, unit.numel) : Tensor());
  }
}

void ParameterStore::bind_unit_values(size_t u, const Tensor& buffer) {
  LOOM_CHECK(u < units_.size());
  const ParamUnit& unit = units_[u];
  LOOM_CHECK(!buffer.defined() || buffer.numel() == unit.numel);
  for (Parameter* p : unit.params)
    p->value = buffer.defined() ? buffer.narrow(p->offset - unit.begin, p->numel()).reshape(p->shape)
                                : Tensor();
}

void ParameterStore::bind_unit_grads(size_t u, const Tensor& buffer) {
  LOOM_CHECK(u < units_.size());
  const ParamUnit& unit = units_[u];
  LOOM_CHECK(!buffer.defined() || buffer.numel() == unit.numel);
  for (Parameter* p : unit.params)
    p->grad = buffer.defined() ? buffer.narrow(p->offset - unit.begin, p->numel()).reshape(p->shape)
                               : Tensor();
}

int64_t ParameterStore::parameter_numel() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p->numel();
  return n;
}

void ParameterStore::initialize(uint64_t seed) {
  LOOM_CHECK(allocated() && values_.defined());
  for (auto& p : params_) {
    switch (p->init) {
      case InitKind::kNormal: init_normal(p->value, seed, p->name, 0.0f, p->init_std); break;
      case InitKind::kZeros: init_constant(p->value, 0.0); break;
      case InitKind::kOnes: init_constant(p->value, 1.0); break;
    }
  }
}

void ParameterStore::initialize_slice(uint64_t seed, int64_t begin, int64_t length,
                                      Tensor& out) const {
  LOOM_CHECK(allocated() && out.numel() == length && out.ndim() == 1);
  init_constant(out, 0.0);
  for (const auto& p : params_) {
    const int64_t lo = std::max(begin, p->offset), hi = std::min(begin + length, p->offset + p->numel());
    if (lo >= hi) continue;
    Tensor piece = out.narrow(lo - begin, hi - lo);
    switch (p->init) {
      case InitKind::kNormal:
        init_normal(piece, seed, p->name, 0.0f, p->init_std, Region{{p->numel()}, {lo - p->offset}});
        break;
      case InitKind::kZeros: break;
      case InitKind::kOnes: init_constant(piece, 1.0); break;
    }
  }
}

void ParameterStore::zero_grads() {
  if (grads_.defined()) grads_.zero_();
}

Parameter* ParameterStore::find(const std::string& name) const {
  for (auto& p : params_)
    if (p->name == name) return p.get();
  return nullptr;
}

Parameter& ParameterStore::get(const std::string& name) const {
  Parameter* p = find(name);
  if (p == nullptr) fail("no parameter named '", name, "'");
  return *p;
}

}  // namespace loom
