// Built when LOOM_CUDA=OFF: the CUDA entry points exist, report zero GPUs and refuse politely.
#include "base/error.h"
#include "device/cuda/cuda_backend.h"

namespace loom::cuda {

namespace {
constexpr const char* kNoCuda =
    "this Loom was built without CUDA: reconfigure with -DLOOM_CUDA=ON (preset 'cuda')";
[[noreturn]] void no_cuda() { fail(kNoCuda); }
}  // namespace

int device_count() { return 0; }
std::string unavailable_reason() { return kNoCuda; }
std::unique_ptr<Allocator> make_cuda_allocator(int) { no_cuda(); }
void copy_bytes(void*, Device, const void*, Device, size_t) { no_cuda(); }
void copy_bytes_queued(void*, const void*, int, size_t) { no_cuda(); }
void copy_bytes_from_host_queued(void*, int, const void*, size_t) { no_cuda(); }
void synchronize(int) { no_cuda(); }
void synchronize_compute(int) { no_cuda(); }
struct StreamMark {};
void anchor_clock(int) { no_cuda(); }
std::shared_ptr<StreamMark> record_mark(int) { no_cuda(); }
std::optional<double> mark_seconds(const StreamMark&) { return std::nullopt; }
void zero_bytes(void*, int, size_t) { no_cuda(); }
void axpy_f32(int, int64_t, float, const float*, const float*, float*) { no_cuda(); }

}  // namespace loom::cuda
