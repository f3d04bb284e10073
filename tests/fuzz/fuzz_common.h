// Shared by the fuzz targets (tests/fuzz/README.md): a scratch directory of the process's own and
// the one rule every target checks — input a user can give Loom (a config, a data file, a
// checkpoint) either works or throws loom::Error, whose message is the one line the `loom` command
// prints. Anything else — another exception type escaping, a crash, an out-of-bounds access or
// undefined behaviour seen by the sanitizers, an allocation of a size read from the file — ends
// the process, and libFuzzer (or the corpus replay) reports the input.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>

#include "base/error.h"

namespace loom::fuzz {

// A directory of this process's own, in memory where the machine has /dev/shm (each input is
// written to a file: the parsers under test read files, as Loom does).
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    const std::filesystem::path base = std::filesystem::is_directory("/dev/shm")
                                           ? "/dev/shm"
                                           : std::filesystem::temp_directory_path();
    std::filesystem::path d = base / ("loom_fuzz_" + std::to_string(getpid()));
    std::filesystem::remove_all(d);
    std::filesystem::create_directories(d);
    std::atexit([] { std::filesystem::remove_all(scratch_dir()); });
    return d;
  }();
  return dir;
}

inline void write_file(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
}

// A whole file's bytes ("" where it cannot be read).
inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// Runs `f`; a loom::Error is the accepted way to refuse the input. Its message must name
// something (the file, key or value): an empty one is a failure too. With LOOM_FUZZ_VERBOSE set
// in the environment, each refusal's message is printed.
template <typename F>
bool accepts(F&& f) {
  try {
    f();
    return true;
  } catch (const Error& e) {
    if (std::getenv("LOOM_FUZZ_VERBOSE") != nullptr)
      std::fprintf(stderr, "refused: %s\n", e.what());
    if (std::string_view(e.what()).empty()) {
      std::fprintf(stderr, "fuzz: loom::Error with an empty message\n");
      std::abort();
    }
    return false;
  }
}

// A property the accepted input must have (a round trip, a bound): aborts with `what` if not.
inline void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz: property failed: %s\n", what);
    std::abort();
  }
}

// Where LOOM_FUZZ_WRITE_SEEDS names a directory, a target whose inputs are files it makes itself
// (a checkpoint's, an export's) writes each seed input there: seed(file name, input).
inline void seed(const std::string& name, std::string_view input) {
  const char* dir = std::getenv("LOOM_FUZZ_WRITE_SEEDS");
  if (dir == nullptr) return;
  std::filesystem::create_directories(dir);
  write_file(std::filesystem::path(dir) / name, input);
}

// Keeps a value computed only to touch memory (so the reads are not optimised away).
inline volatile uint64_t kept;
inline void keep(uint64_t value) {
  kept = value;
}

}  // namespace loom::fuzz
