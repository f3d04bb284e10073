#include "nn/rounded_weights.h"

#include <cstdlib>
#include <string>

#include "base/error.h"

namespace loom {

bool RoundedWeights::enabled_by_environment() {
  const char* v = std::getenv("LOOM_CUDA_WEIGHT_COPIES");
  return v == nullptr || std::string(v) != "0";
}

RoundedWeights::RoundedWeights(const ParameterStore& store, const Exec& ex, bool own_copies) {
  dtype_ = ops::matmul_input_dtype(ex, DType::kF32);
  if (dtype_ == DType::kF32 || !enabled_by_environment()) return;
  if (!own_copies) {
    lending_ = true;
    return;
  }
  if (!store.allocated()) fail("RoundedWeights: the parameter store is not allocated yet");
  int64_t n = 0;
  for (const auto& p : store.parameters()) {
    if (!p->gemm_operand) continue;
    // 16-byte aligned copies (8 values), as the GEMMs' vectorised loads like them.
    copies_[p.get()] = Copy{n, nullptr};
    n += (p->numel() + 7) / 8 * 8;
  }
  if (n > 0) buffer_ = Tensor::empty({n}, dtype_, ex.device);
}

ops::GemmWeight RoundedWeights::of(const Exec& ex, const Parameter& p) {
  const float* values = p.value.data<float>();
  if (const auto lent = lent_.find(&p); lent != lent_.end())
    return ops::GemmWeight(values, lent->second, dtype_);
  const auto it = buffer_.defined() ? copies_.find(&p) : copies_.end();
  if (it == copies_.end()) return ops::GemmWeight(values);
  Copy& copy = it->second;
  void* bits = static_cast<char*>(buffer_.raw()) +
               static_cast<size_t>(copy.offset) * dtype_size(dtype_);
  if (copy.from != values) {
    ops::round_weight(ex, bits, dtype_, values, p.numel());
    copy.from = values;
    ++roundings_;
  }
  return ops::GemmWeight(values, bits, dtype_);
}

void RoundedWeights::invalidate() {
  for (auto& [param, copy] : copies_) copy.from = nullptr;
  lent_.clear();
}

void RoundedWeights::lend(const Parameter& p, const void* bits) {
  if (!lending_) fail("RoundedWeights: ", p.name, " lent to copies that take none");
  lent_[&p] = bits;
}

void RoundedWeights::take_back(const Parameter& p) {
  lent_.erase(&p);
}

ops::GemmWeight gemm_weight(Context& ctx, const Parameter& p) {
  if (ctx.rounded_weights != nullptr) return ctx.rounded_weights->of(ctx.exec(), p);
  return ops::GemmWeight(p.value.data<float>());
}

}  // namespace loom
