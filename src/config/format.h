// TOML spellings of values, shared by to_toml() and the messages of parse and validate.
// Internal to the config layer.
#pragma once

#include <charconv>
#include <cstdio>
#include <string>
#include <string_view>

namespace loom {

// Shortest text that reads back to the same double, always a TOML float: "0.02", "1e-08",
// "3.0" (never "3", which TOML reads as an integer), "inf", "nan".
inline std::string format_double(double v) {
  char buf[64];
  const auto result = std::to_chars(buf, buf + sizeof buf, v);
  std::string out(buf, result.ptr);
  if (out.find_first_not_of("-0123456789") == std::string::npos) out += ".0";
  return out;
}

// A TOML basic string: "..." with \\, \" and control characters escaped.
inline std::string toml_quote(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
          char esc[8];
          std::snprintf(esc, sizeof esc, "\\u%04x", static_cast<unsigned char>(c));
          out += esc;
        } else {
          out += c;
        }
    }
  }
  return out + '"';
}

}  // namespace loom
