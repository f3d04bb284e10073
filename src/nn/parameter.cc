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
  p->full_shape = shape;
  if (units_.empty()) units_.push_back(ParamUnit{"all", 0, 0, {}});
  units_.back().params.push_back(p.get());
  params_.push_back(std::move(p));
  return params_.back().get();
}

Parameter* ParameterStore::add_shard(const std::string& name, const Shape& shape,
                                     const Shape& full_shape, std::vector<ShardPiece> pieces,
                                     InitKind init, float init_std) {
  for (const ShardPiece& piece : pieces) {
    if (piece.local_row < 0 || piece.rows < 0 || shape.empty() || piece.local_row + piece.rows > shape[0] ||
        piece.region.global_shape != full_shape || piece.region.offset.size() != shape.size())
      fail("parameter '", name, "': shard piece of ", piece.rows, " rows at local row ",
           piece.local_row, " does not fit local shape ", shape_str(shape), " in full shape ",
           shape_str(full_shape));
  }
  Parameter* p = add(name, shape, init, init_std);
  p->full_shape = full_shape;
  p->pieces = std::move(pieces);
  p->weight_decay = full_shape.size() >= 2;
  return p;
}

namespace {
// Initialises one parameter's local tensor: the whole parameter, or its shard's pieces.
void init_parameter(const Parameter& p, Tensor& local, uint64_t seed) {
  if (!local.device().is_cpu()) {
    // The initialisers run on the host (tensor/rng.h); a GPU's parameters are copied over.
    Tensor host = Tensor::empty(local.shape(), local.dtype());
    init_parameter(p, host, seed);
    local.copy_from(host);
    return;
  }
  if (p.pieces.empty()) {
    switch (p.init) {
      case InitKind::kNormal: init_normal(local, seed, p.name, 0.0f, p.init_std); break;
      case InitKind::kZeros: init_constant(local, 0.0); break;
      case InitKind::kOnes: init_constant(local, 1.0); break;
    }
    return;
  }
  init_constant(local, 0.0);  // rows outside every piece (padding) stay zero
  for (const ShardPiece& piece : p.pieces) {
    Tensor rows = local.narrow(piece.local_row, piece.rows);
    switch (p.init) {
      case InitKind::kNormal: init_normal(rows, seed, p.name, 0.0f, p.init_std, piece.region); break;
      case InitKind::kZeros: break;
      case InitKind::kOnes: init_constant(rows, 1.0); break;
    }
  }
}
}  // namespace

void ParameterStore::begin_unit(const std::string& name, bool experts) {
  if (allocated()) fail("unit '", name, "' begun after the store was allocated");
  if (!units_.empty() && units_.back().params.empty()) fail("unit '", units_.back().name, "' is empty");
  units_.push_back(ParamUnit{name, 0, 0, {}, experts});
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
  for (auto& p : params_) init_parameter(*p, p->value, seed);
}

void ParameterStore::initialize_slice(uint64_t seed, int64_t begin, int64_t length,
                                      Tensor& out) const {
  LOOM_CHECK(allocated() && out.numel() == length && out.ndim() == 1);
  if (!out.device().is_cpu()) {
    Tensor host = Tensor::empty(out.shape(), out.dtype());
    initialize_slice(seed, begin, length, host);
    out.copy_from(host);
    return;
  }
  init_constant(out, 0.0);
  for (const auto& p : params_) {
    const int64_t lo = std::max(begin, p->offset), hi = std::min(begin + length, p->offset + p->numel());
    if (lo >= hi) continue;
    Tensor piece = out.narrow(lo - begin, hi - lo);
    if (!p->pieces.empty()) {
      // A tensor-parallel shard: initialise the whole local tensor, keep the range.
      Tensor whole = Tensor::empty(p->shape, out.dtype(), out.device());
      init_parameter(*p, whole, seed);
      piece.copy_from(whole.reshape({p->numel()}).narrow(lo - p->offset, hi - lo));
      continue;
    }
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

void ParameterStore::zero_grads(ThreadPool& pool) {
  if (grads_.defined()) grads_.zero_(pool);
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
