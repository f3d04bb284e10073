// Which sanitizer this translation unit is built with, for the emulator's announcements to it
// (fiber switches in scheduler.cc, poisoned memory in poison.h): LOOM_EMU_ASAN under
// AddressSanitizer, LOOM_EMU_TSAN under ThreadSanitizer. GCC says so with __SANITIZE_*__,
// clang with __has_feature.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define LOOM_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LOOM_EMU_ASAN 1
#endif
#endif

#if defined(__SANITIZE_THREAD__)
#define LOOM_EMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define LOOM_EMU_TSAN 1
#endif
#endif
