#include "data/documents.h"

namespace loom {

void document_starts(int32_t* starts, const int32_t* tokens, int64_t B, int64_t T, int32_t eot) {
  for (int64_t b = 0; b < B; ++b) {
    int32_t start = 0;
    for (int64_t t = 0; t < T; ++t) {
      starts[b * T + t] = start;
      if (tokens[b * T + t] == eot) start = static_cast<int32_t>(t + 1);
    }
  }
}

}  // namespace loom
