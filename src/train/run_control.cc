#include "train/run_control.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "base/error.h"

namespace loom {
namespace {

volatile sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int sig) {
  if (g_stop_signal == 0) g_stop_signal = sig;
}

}  // namespace

void install_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sa.sa_flags = SA_RESETHAND;  // the second Ctrl-C is the default action: the process ends
  sigaction(SIGINT, &sa, nullptr);
}

int stop_signal_received() {
  return g_stop_signal;
}

TestFault TestFault::from_env() {
  const char* env = std::getenv("LOOM_TEST_FAULT");
  if (env == nullptr || *env == 0) return {};
  const std::string s = env;
  const size_t at = s.find('@');
  TestFault f;
  const std::string kind = s.substr(0, at);
  if (kind == "kill") f.kind = kKill;
  if (kind == "hang") f.kind = kHang;
  if (kind == "term") f.kind = kTerm;
  if (kind == "savefail") f.kind = kSaveFail;
  if (kind == "slow") f.kind = kSlow;
  char* end = nullptr;
  if (at != std::string::npos) f.step = std::strtoll(s.c_str() + at + 1, &end, 10);
  if (f.kind == kNone || at == std::string::npos || end == nullptr || *end != 0 || f.step < 1)
    fail("LOOM_TEST_FAULT = '", s,
         "': expected kill@STEP, hang@STEP, term@STEP, slow@STEP or savefail@STEP (STEP >= 1)");
  return f;
}

void TestFault::strike_at(int64_t step_done) const {
  if (kind == kSlow && step_done >= step)
    std::this_thread::sleep_for(std::chrono::milliseconds(kSlowStepMs));
  if (kind == kNone || step_done != step) return;
  if (kind == kKill) raise(SIGKILL);
  if (kind == kTerm) raise(SIGTERM);  // handled before raise returns
  if (kind == kHang)
    for (;;) pause();
}

}  // namespace loom
