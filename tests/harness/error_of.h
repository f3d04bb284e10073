// error_of(fn): the message of the loom::Error that fn() throws — "" and a test failure when it
// throws none. For tests that check what an error says (the file, key or rank it names).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "base/error.h"

namespace loom::testutil {

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a loom::Error";
  return "";
}

}  // namespace loom::testutil
