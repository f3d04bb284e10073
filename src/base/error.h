// loom::Error — the one error type for user, config, data and environment mistakes.
//
// Two tiers (docs/architecture.md): what a user can cause (a bad file, key, shape) throws
// loom::Error with a message naming the culprit; broken internal invariants use LOOM_CHECK,
// which aborts with file:line. Only apps/ turns an Error into an exit code.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace loom {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

// Throws loom::Error with the arguments streamed together: fail("file ", path, ": bad magic").
template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
  throw Error(detail::concat(std::forward<Args>(args)...));
}

}  // namespace loom
