// Integers read from JSON files Loom did not write itself (or that a disk damaged).
//
// nlohmann's get<int64_t>() converts any JSON number with a static_cast: 1e30 read as an integer
// is undefined behaviour, 2^40 read as an int wraps and 3.7 becomes 3. json_integer<Int> takes
// only an integer written as one, within Int's range; anything else throws the library's own
// type_error (302, like a string where a number belongs) or out_of_range (406), so a caller that
// already names its file on nlohmann::json::exception names it for these too.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace loom {

template <class Int>
Int json_integer(const nlohmann::json& j) {
  static_assert(std::is_integral_v<Int> && !std::is_same_v<Int, bool>);
  using Limits = std::numeric_limits<Int>;
  if (!j.is_number_integer())
    throw nlohmann::json::type_error::create(302,
                                             std::string("type must be an integer, but is ") +
                                                 (j.is_number() ? j.dump() : j.type_name()),
                                             &j);
  const bool fits = j.is_number_unsigned() ? std::in_range<Int>(j.get<uint64_t>())
                                           : std::in_range<Int>(j.get<int64_t>());
  if (!fits)
    throw nlohmann::json::out_of_range::create(406,
                                               "integer " + j.dump() + " is outside [" +
                                                   std::to_string(Limits::min()) + ", " +
                                                   std::to_string(Limits::max()) + "]",
                                               &j);
  return j.is_number_unsigned() ? static_cast<Int>(j.get<uint64_t>())
                                : static_cast<Int>(j.get<int64_t>());
}

// An array of integers, each as json_integer<Int>.
template <class Int>
std::vector<Int> json_integers(const nlohmann::json& j) {
  if (!j.is_array())
    throw nlohmann::json::type_error::create(
        302, std::string("type must be an array of integers, but is ") + j.type_name(), &j);
  std::vector<Int> out;
  out.reserve(j.size());
  for (const nlohmann::json& v : j) out.push_back(json_integer<Int>(v));
  return out;
}

}  // namespace loom
