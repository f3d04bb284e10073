#include "device/device.h"

#include <charconv>

#include "base/error.h"

namespace loom {

Device Device::parse(std::string_view text) {
  std::string_view kind = text;
  int index = 0;
  if (auto colon = text.find(':'); colon != std::string_view::npos) {
    kind = text.substr(0, colon);
    std::string_view num = text.substr(colon + 1);
    auto [p, ec] = std::from_chars(num.data(), num.data() + num.size(), index);
    if (ec != std::errc() || p != num.data() + num.size() || index < 0)
      fail("device '", text, "': the index after ':' must be a non-negative integer");
  }
  if (kind == "cpu") return cpu(index);
  if (kind == "cuda") return cuda(index);
  fail("device '", text, "': expected 'cpu', 'cpu:N', 'cuda' or 'cuda:N'");
}

std::string Device::str() const {
  return std::string(is_cpu() ? "cpu" : "cuda") + ":" + std::to_string(index);
}

}  // namespace loom
