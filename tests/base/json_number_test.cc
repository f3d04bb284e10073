#include "base/json_number.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

namespace loom {
namespace {

using nlohmann::json;

// The message of what json_integer<Int>(json::parse(text)) throws, or "" if it returns.
template <class Int>
std::string refusal(const std::string& text) {
  try {
    json_integer<Int>(json::parse(text));
  } catch (const json::exception& e) {
    return e.what();
  }
  return "";
}

TEST(JsonInteger, ReadsIntegersInTheirTypesRange) {
  EXPECT_EQ(json_integer<int>(json::parse("-2147483648")), INT32_MIN);
  EXPECT_EQ(json_integer<int>(json::parse("2147483647")), INT32_MAX);
  EXPECT_EQ(json_integer<int64_t>(json::parse("-9223372036854775808")), INT64_MIN);
  EXPECT_EQ(json_integer<int64_t>(json::parse("9223372036854775807")), INT64_MAX);
  EXPECT_EQ(json_integer<uint64_t>(json::parse("18446744073709551615")), UINT64_MAX);
  EXPECT_EQ(json_integer<uint64_t>(json::parse("0")), 0u);
  EXPECT_EQ(json_integer<int32_t>(json::parse("-7")), -7);
  EXPECT_EQ(json_integers<int64_t>(json::parse("[3, -1, 0]")), (std::vector<int64_t>{3, -1, 0}));
}

TEST(JsonInteger, RefusesWhatACastWouldBreakOrWrap) {
  // A float (a plain cast of 1e30 is undefined behaviour, of 3.7 silently 3), a string, null.
  for (const char* text : {"1e30", "6.66667e+27", "-1e300", "3.7", "2.0", "\"5\"", "null", "[1]"}) {
    SCOPED_TRACE(text);
    EXPECT_NE(refusal<int64_t>(text).find("type must be an integer"), std::string::npos)
        << refusal<int64_t>(text);
  }
  EXPECT_NE(refusal<int>("1e30").find("1e+30"), std::string::npos) << refusal<int>("1e30");
  // Integers past the type: 2^32 + 2 as an int would wrap to 2.
  for (const char* text : {"4294967298", "-2147483649", "2147483648"}) {
    SCOPED_TRACE(text);
    EXPECT_NE(refusal<int>(text).find("integer " + std::string(text) + " is outside"),
              std::string::npos)
        << refusal<int>(text);
  }
  EXPECT_NE(refusal<int64_t>("9223372036854775808").find("is outside"), std::string::npos);
  EXPECT_NE(refusal<uint64_t>("-1").find("is outside"), std::string::npos);
  EXPECT_NE(refusal<uint32_t>("4294967296").find("is outside"), std::string::npos);
  EXPECT_THROW(json_integers<int>(json::parse("[1, 2.5]")), json::type_error);
  EXPECT_THROW(json_integers<int>(json::parse("{\"a\": 1}")), json::type_error);
}

}  // namespace
}  // namespace loom
