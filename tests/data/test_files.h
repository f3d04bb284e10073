// Helpers for the data tests: a fresh temporary directory per test, and file writing.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "base/error.h"
#include "data/shard.h"

namespace loom::testing {

// temp_directory_path()/loom_data_test_<pid>_<test name>, created empty, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(info->test_suite_name()) + "_" + info->name();
    for (char& c : name)
      if (c == '/') c = '_';
    path_ = std::filesystem::temp_directory_path() /
            ("loom_data_test_" + std::to_string(::getpid()) + "_" + name);
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string str() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Shards train_00000s.bin in `dir`, shard s holding tokens 1000*s + j, j = 0..sizes[s]-1, so
// every token tells where it came from. Their paths, in order.
inline std::vector<std::string> make_numbered_shards(const TempDir& dir,
                                                     const std::vector<int>& sizes) {
  std::vector<std::string> paths;
  for (size_t s = 0; s < sizes.size(); ++s) {
    std::vector<uint16_t> tokens(static_cast<size_t>(sizes[s]));
    for (size_t j = 0; j < tokens.size(); ++j) tokens[j] = static_cast<uint16_t>(1000 * s + j);
    paths.push_back(dir.file("train_00000" + std::to_string(s) + ".bin"));
    write_shard(paths.back(), tokens);
  }
  return paths;
}

// Expects `fn` to throw loom::Error whose message contains every one of `parts`.
inline void expect_error(const std::function<void()>& fn,
                         std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected loom::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& part : parts)
      EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' not in: " << msg;
  }
}

}  // namespace loom::testing
