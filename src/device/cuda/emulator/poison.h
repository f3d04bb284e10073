// Emulated GPU memory under AddressSanitizer (an emulated build with LOOM_SANITIZE=address):
// what a kernel must not touch is poisoned, so an access there is reported with the kernel's
// stack, as compute-sanitizer's memcheck would on a GPU. Without AddressSanitizer these do
// nothing.
#pragma once

#include <cstddef>

#include "device/cuda/emulator/sanitizers.h"

#ifdef LOOM_EMU_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace loom::cuda_emu {

inline void poison(const void* p, size_t bytes) {
#ifdef LOOM_EMU_ASAN
  ASAN_POISON_MEMORY_REGION(p, bytes);
#else
  (void)p, (void)bytes;
#endif
}

inline void unpoison(const void* p, size_t bytes) {
#ifdef LOOM_EMU_ASAN
  ASAN_UNPOISON_MEMORY_REGION(p, bytes);
#else
  (void)p, (void)bytes;
#endif
}

}  // namespace loom::cuda_emu
