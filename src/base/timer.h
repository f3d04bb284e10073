// Wall-clock helpers.
#pragma once

#include <chrono>

namespace loom {

inline double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

}  // namespace loom
