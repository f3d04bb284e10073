// Elementwise kernels (residual add, scaling, GELU) and the double-precision sums behind the
// gradient norm; plus the launch helpers of launch.cuh.
#include <cstdlib>
#include <cstring>

#include "base/error.h"
#include "kernels/cuda/gelu.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {

void check_launch(const char* kernel) {
  const cudaError_t launch = cudaGetLastError();
  if (launch != cudaSuccess)
    fail("CUDA kernel ", kernel, " failed to launch: ", cudaGetErrorName(launch), ": ",
         cudaGetErrorString(launch));
  static const bool sync = [] {
    const char* v = std::getenv("LOOM_CUDA_SYNC");
    return v != nullptr && std::strcmp(v, "0") != 0 && *v != '\0';
  }();
  if (!sync) return;
  const cudaError_t run = cudaDeviceSynchronize();
  if (run != cudaSuccess)
    fail("CUDA kernel ", kernel, " failed: ", cudaGetErrorName(run), ": ", cudaGetErrorString(run));
}

int blocks_for(int64_t n, int threads) {
  int device = 0, sms = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&device));
  LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t wanted = (n + threads - 1) / threads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{sms} * 32)));
}

namespace {

// Grid-stride loop over [0, n).
#define LOOM_FOR_EACH(i, n)                                                              \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)

__global__ void add_kernel(float* out, const float* a, const float* b, int64_t n) {
  LOOM_FOR_EACH(i, n) out[i] = a[i] + b[i];
}

__global__ void add_inplace_kernel(float* acc, const float* x, int64_t n) {
  LOOM_FOR_EACH(i, n) acc[i] += x[i];
}

__global__ void scale_kernel(float* x, float s, int64_t n) {
  LOOM_FOR_EACH(i, n) x[i] *= s;
}

// fp32 in and out; or both of a GEMM operand's 16-bit type (the MLP's pre-activation rebuilt into
// its GELU output for recomputation), the GELU taken of the widened value and rounded.
template <typename T>
__global__ void gelu_forward_kernel(T* out, const T* inp, int64_t n) {
  LOOM_FOR_EACH(i, n) round_to(out[i], gelu(widen(inp[i])));
}

__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, int64_t n) {
  LOOM_FOR_EACH(i, n) dinp[i] = gelu_grad(inp[i], dout[i]);
}

// Fixed grid for the sums, so the order of additions never changes with the GPU model.
constexpr int kSumBlocks = 512;

template <bool kSquares>
__global__ void partial_sums_kernel(double* partials, const float* x, int64_t n) {
  __shared__ double shared[32];
  double acc = 0;
  LOOM_FOR_EACH(i, n) {
    const double v = x[i];
    acc += kSquares ? v * v : v;
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

__global__ void final_sum_kernel(double* result, const double* partials, int count) {
  __shared__ double shared[32];
  double acc = 0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) *result = acc;
}

// Queues the reduction of x into *result (device memory); n > 0.
template <bool kSquares>
void reduce_into(int device, const float* x, int64_t n, const char* name, double* result) {
  Scratch<double> partials(device, kSumBlocks);
  launch(name, partial_sums_kernel<kSquares>, kSumBlocks, kThreads, partials.get(), x, n);
  launch(name, final_sum_kernel, 1, kThreads, result, partials.get(), kSumBlocks);
}

template <bool kSquares>
double reduce(int device, const float* x, int64_t n, const char* name) {
  if (n == 0) return 0;
  DeviceGuard guard(device);
  Scratch<double> result(device, 1);
  reduce_into<kSquares>(device, x, n, name, result.get());
  double value = 0;
  LOOM_CUDA_CHECK(cudaMemcpy(&value, result.get(), sizeof value, cudaMemcpyDeviceToHost));
  return value;
}

}  // namespace

void add_forward(int device, float* out, const float* a, const float* b, int64_t n) {
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("add_forward", add_kernel, blocks_for(n, kThreads), kThreads, out, a, b, n);
}

void add_inplace(int device, float* acc, const float* x, int64_t n) {
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("add_inplace", add_inplace_kernel, blocks_for(n, kThreads), kThreads, acc, x, n);
}

namespace {
__global__ void round_to_bf16_kernel(__nv_bfloat16* out, const float* in, int64_t n) {
  LOOM_FOR_EACH(i, n) out[i] = __float2bfloat16_rn(in[i]);
}
__global__ void widen_bf16_kernel(float* out, const __nv_bfloat16* in, int64_t n) {
  LOOM_FOR_EACH(i, n) out[i] = __bfloat162float(in[i]);
}
__global__ void add_widened_bf16_kernel(float* acc, const __nv_bfloat16* in, int64_t n) {
  LOOM_FOR_EACH(i, n) acc[i] += __bfloat162float(in[i]);
}
}  // namespace

void round_to_bf16(int device, uint16_t* out, const float* in, int64_t n) {
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("round_to_bf16", round_to_bf16_kernel, blocks_for(n, kThreads), kThreads,
         reinterpret_cast<__nv_bfloat16*>(out), in, n);
}

void widen_bf16(int device, float* out, const uint16_t* in, int64_t n) {
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("widen_bf16", widen_bf16_kernel, blocks_for(n, kThreads), kThreads, out,
         reinterpret_cast<const __nv_bfloat16*>(in), n);
}

void add_widened_bf16(int device, float* acc, const uint16_t* in, int64_t n) {
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("add_widened_bf16", add_widened_bf16_kernel, blocks_for(n, kThreads), kThreads, acc,
         reinterpret_cast<const __nv_bfloat16*>(in), n);
}

void scale_inplace(int device, float* x, float s, int64_t n) {
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("scale_inplace", scale_kernel, blocks_for(n, kThreads), kThreads, x, s, n);
}

double sum_squares(int device, const float* x, int64_t n) {
  return reduce<true>(device, x, n, "sum_squares");
}

void sum_squares_each(int device, std::span<const float* const> xs, std::span<const int64_t> ns,
                      double* sums) {
  if (xs.size() != ns.size())
    fail("sum_squares_each: ", xs.size(), " arrays but ", ns.size(), " sizes");
  if (xs.empty()) return;
  DeviceGuard guard(device);
  const size_t k = xs.size();
  // One partials buffer for every array (the kernels run in issue order on the one stream),
  // reduce's kernels with their grid, each result into its own slot.
  Scratch<double> partials(device, kSumBlocks);
  Scratch<double> results(device, static_cast<int64_t>(k));
  LOOM_CUDA_CHECK(cudaMemsetAsync(results.get(), 0, k * sizeof(double), nullptr));  // n = 0: 0
  for (size_t i = 0; i < k; ++i) {
    if (ns[i] == 0) continue;
    launch("sum_squares", partial_sums_kernel<true>, kSumBlocks, kThreads, partials.get(), xs[i],
           ns[i]);
    launch("sum_squares", final_sum_kernel, 1, kThreads, results.get() + i, partials.get(),
           kSumBlocks);
  }
  LOOM_CUDA_CHECK(cudaMemcpy(sums, results.get(), k * sizeof(double), cudaMemcpyDeviceToHost));
}

double sum(int device, const float* x, int64_t n) {
  return reduce<false>(device, x, n, "sum");
}

void sum_into(int device, const float* x, int64_t n, double* result) {
  DeviceGuard guard(device);
  if (n == 0) {
    LOOM_CUDA_CHECK(cudaMemsetAsync(result, 0, sizeof *result, nullptr));  // +0.0: all zero bits
    return;
  }
  reduce_into<false>(device, x, n, "sum", result);
}

void gelu_forward(int device, float* out, const float* inp, int64_t n) {
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("gelu_forward", gelu_forward_kernel<float>, blocks_for(n, kThreads), kThreads, out, inp,
         n);
}

GemmOperand gelu_forward_of_rounded(int device, void* out, const void* pre, int64_t n) {
  DeviceGuard guard(device);
  const MatmulPrecision precision = with_rounded_type("gelu_forward_of_rounded", [&](auto zero) {
    using Half = decltype(zero);
    if (n > 0)
      launch("gelu_forward (16-bit)", gelu_forward_kernel<Half>, blocks_for(n, kThreads), kThreads,
             static_cast<Half*>(out), static_cast<const Half*>(pre), n);
  });
  return GemmOperand(out, precision);
}

void gelu_backward(int device, float* dinp, const float* inp, const float* dout, int64_t n) {
  if (n == 0) return;
  DeviceGuard guard(device);
  launch("gelu_backward", gelu_backward_kernel, blocks_for(n, kThreads), kThreads, dinp, inp, dout,
         n);
}

}  // namespace loom::cuda
