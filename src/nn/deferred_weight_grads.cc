#include "nn/deferred_weight_grads.h"

#include <utility>

namespace loom {

void DeferredWeightGrads::add(Work work, int64_t bytes) {
  entries_.push_back({Kind::kWork, 0, std::move(work)});
  ++work_count_;
  bytes_ += bytes;
}

void DeferredWeightGrads::before_backward(size_t unit) {
  entries_.push_back({Kind::kBeforeUnit, unit, nullptr});
}

void DeferredWeightGrads::after_backward(size_t unit) {
  entries_.push_back({Kind::kAfterUnit, unit, nullptr});
}

void DeferredWeightGrads::run(const Exec& ex, ParamHooks* hooks) {
  // Moved out first: the work releases its tensors as it goes, and a throwing GEMM leaves this
  // object empty rather than half run.
  std::vector<Entry> entries = std::move(entries_);
  entries_.clear();
  work_count_ = 0;
  bytes_ = 0;
  for (Entry& e : entries) {
    switch (e.kind) {
      case Kind::kBeforeUnit:
        if (hooks != nullptr) hooks->before_backward(e.unit);
        break;
      case Kind::kAfterUnit:
        if (hooks != nullptr) hooks->after_backward(e.unit);
        break;
      case Kind::kWork:
        e.work(ex);
        e.work = nullptr;  // its dy and x go back to the allocator now
        break;
    }
  }
}

}  // namespace loom
