#include "nn/parameter.h"

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
  // Round offsets up to 16 elements (64 B for f32) so every parameter starts cache-aligned.
  p->offset = (numel_ + 15) / 16 * 16;
  numel_ = p->offset + p->numel();
  params_.push_back(std::move(p));
  return params_.back().get();
}

void ParameterStore::allocate(DType dtype, Device device) {
  LOOM_CHECK(!allocated());
  values_ = Tensor::zeros({numel_}, dtype, device);
  grads_ = Tensor::zeros({numel_}, dtype, device);
  for (auto& p : params_) {
    p->value = values_.narrow(p->offset, p->numel()).reshape(p->shape);
    p->grad = grads_.narrow(p->offset, p->numel()).reshape(p->shape);
  }
}

void ParameterStore::initialize(uint64_t seed) {
  LOOM_CHECK(allocated());
  for (auto& p : params_) {
    switch (p->init) {
      case InitKind::kNormal: init_normal(p->value, seed, p->name, 0.0f, p->init_std); break;
      case InitKind::kZeros: init_constant(p->value, 0.0); break;
      case InitKind::kOnes: init_constant(p->value, 1.0); break;
    }
  }
}

void ParameterStore::zero_grads() {
  if (allocated()) grads_.zero_();
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
