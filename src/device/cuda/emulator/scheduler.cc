// Fibers for the CUDA emulator (scheduler.h). On x86-64 a fiber switch is a dozen instructions
// (the callee-saved registers and the stack pointer), so a block of 256 threads costs
// microseconds; elsewhere ucontext, which makes a system call per switch. Under AddressSanitizer
// and ThreadSanitizer every switch is announced to them.
#include "device/cuda/emulator/scheduler.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "base/error.h"
#include "device/cuda/emulator/sanitizers.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#ifdef LOOM_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif
#ifdef LOOM_EMU_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace loom::cuda_emu {
namespace {

constexpr int kWarpSize = 32;
constexpr int kMaxThreadsPerBlock = 1024;
// Kernels are shallow: their frames, libm's, and the emulator's own calls.
constexpr size_t kStackBytes = size_t{64} << 10;

#if defined(__x86_64__)
extern "C" void loom_emu_switch(void** save_sp, void* next_sp);
extern "C" void loom_emu_trampoline();

// loom_emu_switch saves the callee-saved registers on the current stack, stores the stack pointer
// in *save_sp, and restores the same from next_sp. A new fiber's stack is laid out as if it had
// been switched away from, returning into loom_emu_trampoline, which calls the function left in
// r13. The x87 and SSE control words are not switched (the SysV ABI would have them callee-saved):
// every fiber runs on the host thread that made it, and no kernel changes rounding modes; the
// reloads (ldmxcsr, fldcw) stall the pipeline and cost more than the rest of the switch.
__asm__(R"(
  .text
  .p2align 4
  .globl loom_emu_switch
  .hidden loom_emu_switch
  .type loom_emu_switch, @function
loom_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size loom_emu_switch, .-loom_emu_switch

  .p2align 4
  .globl loom_emu_trampoline
  .hidden loom_emu_trampoline
  .type loom_emu_trampoline, @function
loom_emu_trampoline:
  callq *%r13
  ud2
  .size loom_emu_trampoline, .-loom_emu_trampoline
)");

struct Context {
  void* sp = nullptr;
};

// A fresh context on [stack, stack + bytes) that starts in entry().
void make_context(Context& context, char* stack, size_t bytes, void (*entry)()) {
  const auto top = (reinterpret_cast<uintptr_t>(stack + bytes) - 64) & ~uintptr_t{15};
  // Six registers and the return address: after they are popped the trampoline runs with the
  // stack 16-byte aligned, as a call instruction expects.
  auto* frame = reinterpret_cast<uint64_t*>(top - 56);
  std::memset(frame, 0, 56);
  frame[2] = reinterpret_cast<uint64_t>(entry);                 // r13 (popped after r15, r14)
  frame[6] = reinterpret_cast<uint64_t>(&loom_emu_trampoline);  // return address
  context.sp = frame;
}

void switch_context(Context& from, Context& to) {
  loom_emu_switch(&from.sp, to.sp);
}
#else
struct Context {
  ucontext_t uc;
};

void make_context(Context& context, char* stack, size_t bytes, void (*entry)()) {
  if (getcontext(&context.uc) != 0) fail("CUDA emulator: getcontext failed");
  context.uc.uc_stack.ss_sp = stack;
  context.uc.uc_stack.ss_size = bytes;
  context.uc.uc_link = nullptr;
  makecontext(&context.uc, entry, 0);
}

void switch_context(Context& from, Context& to) {
  if (swapcontext(&from.uc, &to.uc) != 0) fail("CUDA emulator: swapcontext failed");
}
#endif

// AddressSanitizer follows a stack switch only when told (its fake stacks, its stack bounds):
// before_switch names the stack being switched to (save = nullptr when the current fiber never
// resumes), after_switch runs first thing in the context switched to.
void before_switch(void** save, const void* bottom, size_t size) {
#ifdef LOOM_EMU_ASAN
  __sanitizer_start_switch_fiber(save, bottom, size);
#else
  (void)save, (void)bottom, (void)size;
#endif
}

void after_switch(void* saved, const void** old_bottom, size_t* old_size) {
#ifdef LOOM_EMU_ASAN
  __sanitizer_finish_switch_fiber(saved, old_bottom, old_size);
#else
  (void)saved, (void)old_bottom, (void)old_size;
#endif
}

// ThreadSanitizer keeps a call stack and a clock per thread: each fiber is a TSan fiber of its
// own, and every switch synchronises (TSan's default), so the emulated threads of a block are
// ordered as the round robin runs them (races between a block's CUDA threads are not its to
// find here; races between host threads, such as ranks using emulated NCCL, are).
void* tsan_create_fiber() {
#ifdef LOOM_EMU_TSAN
  return __tsan_create_fiber(0);
#else
  return nullptr;
#endif
}

void* tsan_current_fiber() {
#ifdef LOOM_EMU_TSAN
  return __tsan_get_current_fiber();
#else
  return nullptr;
#endif
}

void tsan_destroy_fiber(void* fiber) {
#ifdef LOOM_EMU_TSAN
  if (fiber != nullptr) __tsan_destroy_fiber(fiber);
#else
  (void)fiber;
#endif
}

void tsan_switch_to(void* fiber) {
#ifdef LOOM_EMU_TSAN
  __tsan_switch_to_fiber(fiber, 0);
#else
  (void)fiber;
#endif
}

enum class State { kReady, kAtBarrier, kAtShuffle, kDone };

struct Fiber {
  Context context;
  char* stack = nullptr;
  size_t stack_bytes = 0;
  void* fake_stack = nullptr;  // AddressSanitizer's, while switched away
  void* tsan_fiber = nullptr;  // ThreadSanitizer's (made once per slot, reused by every launch)
  State state = State::kReady;
  ThreadIndices indices;
  int linear = 0;  // x fastest, then y, then z
  uint64_t offer = 0, received = 0;
  int source = 0;
};

// One per host thread that launches kernels: the fibers' stacks (mapped once, reused by every
// launch) and the state of the block running now.
class Scheduler {
 public:
  Scheduler() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    mapping_bytes_ = kStackBytes * kMaxThreadsPerBlock;
    void* map = mmap(nullptr, mapping_bytes_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (map == MAP_FAILED) fail("CUDA emulator: cannot map ", mapping_bytes_, " bytes of stacks");
    stacks_ = static_cast<char*>(map);
    // A guard page below each stack: an overflow faults instead of writing into the next one.
    for (int i = 0; i < kMaxThreadsPerBlock; ++i)
      (void)mprotect(stacks_ + kStackBytes * static_cast<size_t>(i), page, PROT_NONE);
    guard_bytes_ = page;
    fibers_.resize(kMaxThreadsPerBlock);
  }
  ~Scheduler() {
    for (Fiber& f : fibers_) tsan_destroy_fiber(f.tsan_fiber);
    munmap(stacks_, mapping_bytes_);
  }
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  void run(const char* kernel, Dim3 grid, Dim3 block, void (*body)(void*), void* context);

  Fiber& running() {
    if (running_ == nullptr)
      fail("CUDA emulator: threadIdx, __syncthreads or a shuffle used outside a kernel");
    return *running_;
  }

  void sync_threads();
  void warp_exchange(const void* value, void* out, size_t bytes, int source_lane);

 private:
  static void fiber_main();
  void run_block(Dim3 block_idx);
  void on_exit(Fiber& fiber);
  void yield(Fiber& fiber) {
    tsan_switch_to(main_tsan_fiber_);
    before_switch(&fiber.fake_stack, main_stack_, main_stack_bytes_);
    switch_context(fiber.context, main_);
    after_switch(fiber.fake_stack, nullptr, nullptr);
  }
  // The last switch out of a fiber: it is never resumed.
  [[noreturn]] void leave(Fiber& fiber) {
    tsan_switch_to(main_tsan_fiber_);
    before_switch(nullptr, main_stack_, main_stack_bytes_);
    switch_context(fiber.context, main_);
    __builtin_trap();
  }
  // From inside a fiber, after error_ was set (in a statement of its own, so that its temporaries
  // are gone): leave for good; run_block throws error_.
  [[noreturn]] void fail_in_fiber(Fiber& fiber);
  std::string where(const Fiber& fiber) const;
  int warp_lanes(int warp) const { return std::min(kWarpSize, threads_ - warp * kWarpSize); }

  char* stacks_ = nullptr;
  size_t mapping_bytes_ = 0, guard_bytes_ = 0;
  std::vector<Fiber> fibers_;
  Context main_;
  void* main_fake_stack_ = nullptr;
  void* main_tsan_fiber_ = nullptr;
  const void* main_stack_ = nullptr;  // the host thread's stack, as AddressSanitizer knows it
  size_t main_stack_bytes_ = 0;
  Fiber* running_ = nullptr;

  // The launch and block running now.
  const char* kernel_ = "";
  Dim3 grid_, block_;
  void (*body_)(void*) = nullptr;
  void* body_context_ = nullptr;
  int threads_ = 0, live_ = 0, at_barrier_ = 0;
  std::vector<int> warp_arrived_, warp_exited_;  // per warp: lanes in a shuffle, lanes done
  std::string error_;
};

thread_local Scheduler* t_scheduler = nullptr;

// Each thread's queued cp.async copies (cp_async_16) of the block running on this host thread.
struct AsyncCopy {
  void* dst;
  const void* src;
  int src_bytes;
  int64_t group;
};
struct AsyncCopies {
  std::vector<AsyncCopy> queued;
  int64_t open_group = 0;  // committed groups are numbered below it
};
thread_local AsyncCopies t_async[kMaxThreadsPerBlock];

Scheduler& scheduler() {
  thread_local Scheduler instance;
  t_scheduler = &instance;
  return instance;
}

std::string dims(Dim3 d) {
  return detail::concat("(", d.x, ", ", d.y, ", ", d.z, ")");
}

void Scheduler::fiber_main() {
  Scheduler& s = *t_scheduler;
  after_switch(nullptr, &s.main_stack_, &s.main_stack_bytes_);
  Fiber& fiber = *s.running_;
  s.body_(s.body_context_);
  fiber.state = State::kDone;
  s.on_exit(fiber);
  s.leave(fiber);
}

std::string Scheduler::where(const Fiber& fiber) const {
  return detail::concat("kernel ", kernel_, ", block ", dims(fiber.indices.block_idx), ", thread ",
                        dims(fiber.indices.thread_idx));
}

void Scheduler::fail_in_fiber(Fiber& fiber) {
  fiber.state = State::kDone;
  leave(fiber);
}

void Scheduler::on_exit(Fiber& fiber) {
  if (!t_async[fiber.linear].queued.empty()) {
    error_ = detail::concat("CUDA emulator: ", where(fiber),
                            " exited with cp.async copies it never waited for");
    fail_in_fiber(fiber);
  }
  --live_;
  const int warp = fiber.linear / kWarpSize;
  ++warp_exited_[static_cast<size_t>(warp)];
  for (int l = 0; warp_arrived_[static_cast<size_t>(warp)] > 0 && l < warp_lanes(warp); ++l) {
    const Fiber& other = fibers_[static_cast<size_t>(warp * kWarpSize + l)];
    if (other.state == State::kAtShuffle) {
      error_ = detail::concat("CUDA emulator: ", where(fiber), " exited while lane ", l,
                              " of its warp waits in a warp shuffle (all 32 lanes must take part)");
      fail_in_fiber(fiber);
    }
  }
  if (live_ > 0 && at_barrier_ == live_) {  // the last thread the others waited for has exited
    for (int i = 0; i < threads_; ++i)
      if (fibers_[static_cast<size_t>(i)].state == State::kAtBarrier)
        fibers_[static_cast<size_t>(i)].state = State::kReady;
    at_barrier_ = 0;
  }
}

void Scheduler::sync_threads() {
  Fiber& fiber = running();
  fiber.state = State::kAtBarrier;
  if (++at_barrier_ == live_) {
    for (int i = 0; i < threads_; ++i)
      if (fibers_[static_cast<size_t>(i)].state == State::kAtBarrier)
        fibers_[static_cast<size_t>(i)].state = State::kReady;
    at_barrier_ = 0;
    return;
  }
  yield(fiber);
}

void Scheduler::warp_exchange(const void* value, void* out, size_t bytes, int source_lane) {
  Fiber& fiber = running();
  if (bytes > sizeof fiber.offer) {
    error_ = "CUDA emulator: shuffles move 8 bytes at most";
    fail_in_fiber(fiber);
  }
  const int warp = fiber.linear / kWarpSize, lanes = warp_lanes(warp);
  Fiber* lane0 = &fibers_[static_cast<size_t>(warp * kWarpSize)];
  for (int l = 0; warp_exited_[static_cast<size_t>(warp)] > 0 && l < lanes; ++l)
    if (lane0[l].state == State::kDone) {
      error_ = detail::concat("CUDA emulator: ", where(fiber), " shuffles while lane ", l,
                              " of its warp has exited (all 32 lanes must take part)");
      fail_in_fiber(fiber);
    }
  fiber.offer = 0;
  std::memcpy(&fiber.offer, value, bytes);
  fiber.source = source_lane;
  fiber.state = State::kAtShuffle;
  if (++warp_arrived_[static_cast<size_t>(warp)] == lanes) {
    // The last lane to arrive hands every lane its value.
    for (int l = 0; l < lanes; ++l) {
      Fiber& f = lane0[l];
      f.received = f.source >= 0 && f.source < lanes ? lane0[f.source].offer : f.offer;
      f.state = State::kReady;
    }
    warp_arrived_[static_cast<size_t>(warp)] = 0;
  } else {
    yield(fiber);
  }
  std::memcpy(out, &fiber.received, bytes);
}

void Scheduler::run_block(Dim3 block_idx) {
  for (int i = 0; i < threads_; ++i) t_async[i] = AsyncCopies{};
  live_ = threads_;
  at_barrier_ = 0;
  std::fill(warp_arrived_.begin(), warp_arrived_.end(), 0);
  std::fill(warp_exited_.begin(), warp_exited_.end(), 0);
  for (int i = 0; i < threads_; ++i) {
    Fiber& f = fibers_[static_cast<size_t>(i)];
    f.state = State::kReady;
    f.linear = i;
    const unsigned u = static_cast<unsigned>(i);
    f.indices = {{u % block_.x, u / block_.x % block_.y, u / (block_.x * block_.y)},
                 block_idx,
                 block_,
                 grid_};
    f.stack = stacks_ + kStackBytes * static_cast<size_t>(i) + guard_bytes_;
    f.stack_bytes = kStackBytes - guard_bytes_;
    f.fake_stack = nullptr;
    if (f.tsan_fiber == nullptr) f.tsan_fiber = tsan_create_fiber();
    make_context(f.context, f.stack, f.stack_bytes, &Scheduler::fiber_main);
  }
  // Warp by warp: a warp's lanes run until the warp waits at __syncthreads or is done (each of its
  // shuffles completes within the warp), so the 32 stacks in use stay in cache.
  const int warps = static_cast<int>(warp_arrived_.size());
  while (live_ > 0) {
    bool ran = false;
    for (int w = 0; w < warps; ++w) {
      for (bool warp_ran = true; warp_ran;) {
        warp_ran = false;
        for (int i = w * kWarpSize; i < w * kWarpSize + warp_lanes(w); ++i) {
          Fiber& f = fibers_[static_cast<size_t>(i)];
          if (f.state != State::kReady) continue;
          running_ = &f;
          tsan_switch_to(f.tsan_fiber);
          before_switch(&main_fake_stack_, f.stack, f.stack_bytes);
          switch_context(main_, f.context);
          after_switch(main_fake_stack_, nullptr, nullptr);
          running_ = nullptr;
          warp_ran = ran = true;
          if (!error_.empty()) fail(std::exchange(error_, std::string()));
        }
      }
    }
    if (!ran) {
      int at_shuffle = 0;
      const Fiber* example = nullptr;
      for (int i = 0; i < threads_; ++i) {
        const Fiber& f = fibers_[static_cast<size_t>(i)];
        if (f.state == State::kAtShuffle) ++at_shuffle;
        if (example == nullptr && f.state != State::kDone) example = &f;
      }
      fail("CUDA emulator: kernel ", kernel_, " deadlocked in block ", dims(block_idx), ": ",
           at_barrier_, " thread(s) wait at __syncthreads and ", at_shuffle,
           " in warp shuffles, of ", live_, " live (e.g. thread ",
           example != nullptr ? dims(example->indices.thread_idx) : std::string("?"),
           "): a barrier some threads never reach");
    }
  }
}

void Scheduler::run(const char* kernel, Dim3 grid, Dim3 block, void (*body)(void*), void* context) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || block.z > 64)
    fail("CUDA emulator: kernel ", kernel, " launched with block ", dims(block),
         ": a block holds 1 to 1024 threads, z at most 64 (cudaErrorInvalidConfiguration)");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 ||
      grid.z > 65535)
    fail("CUDA emulator: kernel ", kernel, " launched with grid ", dims(grid),
         ": x in [1, 2^31 - 1], y and z in [1, 65535] (cudaErrorInvalidConfiguration)");
  main_tsan_fiber_ = tsan_current_fiber();
  kernel_ = kernel;
  grid_ = grid;
  block_ = block;
  body_ = body;
  body_context_ = context;
  threads_ = static_cast<int>(threads);
  warp_arrived_.assign(static_cast<size_t>((threads_ + kWarpSize - 1) / kWarpSize), 0);
  warp_exited_ = warp_arrived_;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) run_block({x, y, z});
}

// Inside a kernel t_scheduler is set (run_kernel went through scheduler()); outside, running()
// refuses.
Scheduler& in_kernel() {
  return t_scheduler != nullptr ? *t_scheduler : scheduler();
}

}  // namespace

namespace {
std::atomic<int64_t> g_kernels{0};
std::atomic<int64_t> g_host_waits{0};
thread_local bool t_queued = false;  // work queued by this thread since it last waited
}  // namespace

HostActivity host_activity() {
  return {g_kernels.load(), g_host_waits.load()};
}

void note_kernel() {
  g_kernels.fetch_add(1, std::memory_order_relaxed);
  t_queued = true;
}

void note_queued() {
  t_queued = true;
}

void note_host_wait() {
  if (!t_queued) return;
  t_queued = false;
  g_host_waits.fetch_add(1, std::memory_order_relaxed);
}

void run_kernel(const char* kernel, Dim3 grid, Dim3 block, void (*body)(void*), void* context) {
  note_kernel();
  scheduler().run(kernel, grid, block, body, context);
}

const ThreadIndices& current() {
  return in_kernel().running().indices;
}

void sync_threads() {
  in_kernel().sync_threads();
}

void warp_exchange(const void* value, void* out, size_t bytes, int source_lane) {
  in_kernel().warp_exchange(value, out, bytes, source_lane);
}

int lane_id() {
  return in_kernel().running().linear % kWarpSize;
}

namespace {
float bf16_half(uint32_t pair, int high) {
  const uint32_t bits = (high != 0 ? pair >> 16 : pair & 0xffffu) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
}  // namespace

void warp_mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  struct Fragments {
    uint32_t a[4], b[2];
  };
  // Every lane leaves its fragments here, the warp meets, each lane computes its four outputs
  // from all of them, and the warp meets again before anyone may overwrite them. One block runs
  // at a time on a host thread, so one slot per (warp, lane) of a block is enough.
  static thread_local Fragments offered[kMaxThreadsPerBlock / kWarpSize][kWarpSize];
  Scheduler& s = in_kernel();
  const int linear = s.running().linear, warp = linear / kWarpSize, lane = linear % kWarpSize;
  Fragments& mine = offered[warp][lane];
  std::copy(a, a + 4, mine.a);
  std::copy(b, b + 2, mine.b);
  const int meet = 0;
  int ignored = 0;
  s.warp_exchange(&meet, &ignored, sizeof meet, lane);
  const Fragments* warp_fragments = offered[warp];
  const auto a_at = [&](int row, int k) {  // A(row, k): lane (row % 8)·4 + (k % 8) / 2
    const Fragments& f = warp_fragments[row % 8 * 4 + k % 8 / 2];
    return bf16_half(f.a[(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k % 2);
  };
  const auto b_at = [&](int k, int col) {  // B(k, col): lane col·4 + (k % 8) / 2
    const Fragments& f = warp_fragments[col * 4 + k % 8 / 2];
    return bf16_half(f.b[k >= 8 ? 1 : 0], k % 2);
  };
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + i % 2;
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += a_at(row, k) * b_at(k, col);
    d[i] = acc;
  }
  s.warp_exchange(&meet, &ignored, sizeof meet, lane);
}

void warp_ldmatrix_x4(uint32_t (&r)[4], const void* row, bool transposed) {
  // As warp_mma_m16n8k16_bf16: every lane leaves its row address, the warp meets, each lane reads
  // its elements through the addresses of the others, and the warp meets again.
  static thread_local const void* offered[kMaxThreadsPerBlock / kWarpSize][kWarpSize];
  Scheduler& s = in_kernel();
  const int linear = s.running().linear, warp = linear / kWarpSize, lane = linear % kWarpSize;
  offered[warp][lane] = row;
  const int meet = 0;
  int ignored = 0;
  s.warp_exchange(&meet, &ignored, sizeof meet, lane);
  const auto element = [&](int matrix, int row_index, int col) {  // 16 bits of matrix(row, col)
    uint16_t v;
    std::memcpy(&v, static_cast<const char*>(offered[warp][matrix * 8 + row_index]) + 2 * col,
                sizeof v);
    return static_cast<uint32_t>(v);
  };
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i)
    r[i] = transposed ? element(i, 2 * t, g) | element(i, 2 * t + 1, g) << 16
                      : element(i, g, 2 * t) | element(i, g, 2 * t + 1) << 16;
  s.warp_exchange(&meet, &ignored, sizeof meet, lane);
}

void cp_async_16(void* dst, const void* src, int src_bytes) {
  // The destination is garbage from the issue to the wait (0xff bytes: NaN in any float type):
  // a read before the wait, or a refill of a buffer other threads still read, shows.
  std::memset(dst, 0xff, 16);
  AsyncCopies& mine = t_async[in_kernel().running().linear];
  mine.queued.push_back({dst, src, src_bytes, mine.open_group});
}

void cp_async_commit() {
  ++t_async[in_kernel().running().linear].open_group;
}

void cp_async_wait(int pending) {
  AsyncCopies& mine = t_async[in_kernel().running().linear];
  const int64_t done_below = mine.open_group - pending;
  std::vector<AsyncCopy> still;
  for (const AsyncCopy& c : mine.queued) {
    if (c.group >= done_below) {
      still.push_back(c);
      continue;
    }
    if (c.src_bytes > 0) std::memcpy(c.dst, c.src, static_cast<size_t>(c.src_bytes));
    std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, static_cast<size_t>(16 - c.src_bytes));
  }
  mine.queued = std::move(still);
}

}  // namespace loom::cuda_emu
