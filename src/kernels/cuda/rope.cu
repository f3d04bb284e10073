// Rotary position embedding with grouped-query attention's head sharing (kernels/cpu/rope.h):
// one thread per (row, head, rotation pair i / i + hd/2) of the output, in a grid-stride loop.
// The backward gives each input element one owner that adds the gradients of the query heads
// sharing its key or value head in ascending head, then rotates back — the CPU's order, so no
// atomics and the same sums. rope_forward / rope_backward rotate qkv's own query and key heads in
// place (the value heads untouched): one thread per (row, head, pair), each reading and writing
// only its pair.
#include "base/error.h"
#include "kernels/cpu/rope.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

// out (BT, 3·NH·hd) from qkv (BT, (NH + 2·KV)·hd): thread e handles pair i of output head j
// (q heads, then k heads, then v heads, NH each) of row r.
__global__ void rope_gqa_forward_kernel(float* out, const float* qkv, const float* cos_sin,
                                        int64_t BT, int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  const int64_t half = hd / 2, group = NH / KV, in_row = (NH + 2 * KV) * hd;
  const int64_t n = BT * 3 * NH * half;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t i = e % half, j = (e / half) % (3 * NH), r = e / half / (3 * NH);
    const float* row = qkv + r * in_row;
    float* y = out + r * 3 * NH * hd + j * hd;
    if (j >= 2 * NH) {  // a value head, shared: copied
      const float* v = row + (NH + KV) * hd + ((j - 2 * NH) / group) * hd;
      y[i] = v[i];
      y[i + half] = v[i + half];
      continue;
    }
    const float* x = j < NH ? row + j * hd : row + NH * hd + ((j - NH) / group) * hd;
    const float* cs = cos_sin + (r % T) * hd;
    const float c = cs[i], s = cs[half + i], x0 = x[i], x1 = x[i + half];
    y[i] = x0 * c - x1 * s;
    y[i + half] = x1 * c + x0 * s;
  }
}

// dqkv (BT, (NH + 2·KV)·hd) from dout (BT, 3·NH·hd): thread e handles pair i of input head j (q
// heads, then k heads, then v heads) of row r.
__global__ void rope_gqa_backward_kernel(float* dqkv, const float* dout, const float* cos_sin,
                                         int64_t BT, int64_t T, int64_t NH, int64_t KV,
                                         int64_t hd) {
  const int64_t half = hd / 2, group = NH / KV, heads = NH + 2 * KV;
  const int64_t n = BT * heads * half;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t i = e % half, j = (e / half) % heads, r = e / half / heads;
    const float* row = dout + r * 3 * NH * hd;
    float* dx = dqkv + r * heads * hd + j * hd;
    float d0, d1;
    if (j < NH) {
      d0 = row[j * hd + i];
      d1 = row[j * hd + i + half];
    } else {
      // The key (or value) gradients of query heads kv·group .. kv·group + group − 1, in order.
      const bool key = j < NH + KV;
      const float* dy = row + (key ? NH : 2 * NH) * hd + (j - (key ? NH : NH + KV)) * group * hd;
      d0 = dy[i];
      d1 = dy[i + half];
      for (int64_t h = 1; h < group; ++h) {
        d0 += dy[h * hd + i];
        d1 += dy[h * hd + i + half];
      }
      if (!key) {
        dx[i] = d0;
        dx[i + half] = d1;
        continue;
      }
    }
    const float* cs = cos_sin + (r % T) * hd;
    const float c = cs[i], s = cs[half + i];
    dx[i] = d0 * c + d1 * s;
    dx[i + half] = d1 * c - d0 * s;
  }
}

// In place on qkv (BT, (NH + 2·KV)·hd): thread e turns pair i of head j (the NH query heads, then
// the KV key heads) of row r forward (y = x·c ∓ x'·s) or, with kBack, back (dx = dy·c ± dy'·s).
// E: float, or the 16-bit type of a qkv (its gradient) kept as GEMM operands, the pair widened,
// turned in fp32 and rounded back once.
template <bool kBack, typename E>
__global__ void rope_inplace_kernel(E* qkv, const float* cos_sin, int64_t BT, int64_t T,
                                    int64_t NH, int64_t KV, int64_t hd) {
  const int64_t half = hd / 2, heads = NH + KV, row = (NH + 2 * KV) * hd;
  const int64_t n = BT * heads * half;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t i = e % half, j = (e / half) % heads, r = e / half / heads;
    E* x = qkv + r * row + j * hd;
    const float* cs = cos_sin + (r % T) * hd;
    const float c = cs[i], s = kBack ? -cs[half + i] : cs[half + i];
    const float x0 = widen(x[i]), x1 = widen(x[i + half]);
    round_to(x[i], x0 * c - x1 * s);
    round_to(x[i + half], x1 * c + x0 * s);
  }
}

}  // namespace

void rope_gqa_forward(int device, float* out, const float* qkv, const float* cos_sin, int64_t B,
                      int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  cpu::check_rope_gqa_shape("rope_gqa_forward", NH, KV, hd);
  if (B * T == 0) return;
  DeviceGuard guard(device);
  launch("rope_gqa_forward", rope_gqa_forward_kernel,
         blocks_for(B * T * 3 * NH * (hd / 2), kThreads), kThreads, out, qkv, cos_sin, B * T, T, NH,
         KV, hd);
}

void rope_gqa_backward(int device, float* dqkv, const float* dout, const float* cos_sin, int64_t B,
                       int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  cpu::check_rope_gqa_shape("rope_gqa_backward", NH, KV, hd);
  if (B * T == 0) return;
  DeviceGuard guard(device);
  launch("rope_gqa_backward", rope_gqa_backward_kernel,
         blocks_for(B * T * (NH + 2 * KV) * (hd / 2), kThreads), kThreads, dqkv, dout, cos_sin,
         B * T, T, NH, KV, hd);
}

namespace {

template <typename E>
void rope_inplace(const char* op, bool back, int device, E* qkv, const float* cos_sin, int64_t B,
                  int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  cpu::check_rope_gqa_shape(op, NH, KV, hd);
  if (B * T == 0) return;
  DeviceGuard guard(device);
  const int blocks = blocks_for(B * T * (NH + KV) * (hd / 2), kThreads);
  if (back)
    launch(op, rope_inplace_kernel<true, E>, blocks, kThreads, qkv, cos_sin, B * T, T, NH, KV, hd);
  else
    launch(op, rope_inplace_kernel<false, E>, blocks, kThreads, qkv, cos_sin, B * T, T, NH, KV, hd);
}

// The in-place rotation on 16-bit values of the current matmul precision's type.
void rope_inplace_rounded(const char* op, bool back, int device, void* qkv, const float* cos_sin,
                          int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd) {
  with_rounded_type(op, [&](auto zero) {
    using Half = decltype(zero);
    rope_inplace(op, back, device, static_cast<Half*>(qkv), cos_sin, B, T, NH, KV, hd);
  });
}

}  // namespace

void rope_forward(int device, float* qkv, const float* cos_sin, int64_t B, int64_t T, int64_t NH,
                  int64_t KV, int64_t hd) {
  rope_inplace("rope_forward", false, device, qkv, cos_sin, B, T, NH, KV, hd);
}

void rope_backward(int device, float* dqkv, const float* cos_sin, int64_t B, int64_t T, int64_t NH,
                   int64_t KV, int64_t hd) {
  rope_inplace("rope_backward", true, device, dqkv, cos_sin, B, T, NH, KV, hd);
}

void rope_forward_rounded(int device, void* qkv, const float* cos_sin, int64_t B, int64_t T,
                          int64_t NH, int64_t KV, int64_t hd) {
  rope_inplace_rounded("rope_forward_rounded", false, device, qkv, cos_sin, B, T, NH, KV, hd);
}

void rope_backward_rounded(int device, void* dqkv, const float* cos_sin, int64_t B, int64_t T,
                           int64_t NH, int64_t KV, int64_t hd) {
  rope_inplace_rounded("rope_backward_rounded", true, device, dqkv, cos_sin, B, T, NH, KV, hd);
}

}  // namespace loom::cuda
