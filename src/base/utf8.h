// UTF-8 checks shared by the readers of text a user hands Loom.
#pragma once

#include <cstddef>
#include <string_view>

namespace loom {

// The bytes of the UTF-8 sequence a byte begins: 1 to 4, or 0 for a byte that begins none (a
// continuation byte, 0xf8 and up).
inline size_t utf8_sequence_length(unsigned char lead) {
  return lead < 0x80           ? 1
         : (lead >> 5) == 0x6  ? 2
         : (lead >> 4) == 0xe  ? 3
         : (lead >> 3) == 0x1e ? 4
                               : 0;
}

// The index of the first byte of `s` that does not belong to well-formed UTF-8 (RFC 3629: no
// overlong forms, no surrogates, nothing past U+10FFFF), or npos.
size_t invalid_utf8_at(std::string_view s);

}  // namespace loom
