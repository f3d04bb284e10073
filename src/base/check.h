// LOOM_CHECK: internal invariants. A failure is a bug in Loom, not in the user's input, so it
// prints file:line and aborts instead of throwing.
#pragma once

#include <cstdio>
#include <cstdlib>

#define LOOM_CHECK(cond)                                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: internal check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

#define LOOM_CHECK_MSG(cond, msg)                                                        \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: internal check failed: %s (%s)\n", __FILE__, __LINE__, \
                   #cond, msg);                                                          \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)
