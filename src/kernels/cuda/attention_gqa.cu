// Grouped-query attention (Ainslie et al. 2023, "GQA") on the qkv projection's own layout,
// (B, T, (NH + 2·KV)·hd): NH query heads, then KV key heads, then KV value heads, query head h
// reading key/value head h / (NH/KV). With KV == NH that is attention_forward's (B, T, 3C) and the
// attention kernels run on it directly; where the flash kernels apply (bf16, head size 64) they
// read the shared heads in place too (flash_attention.cu: the dK/dV pass sums a shared head's
// query heads in its accumulators). Otherwise, for the length of one call, the shared heads
// are expanded into a (B, T, 3·NH·hd) scratch qkv from the caching allocator (a copy kernel),
// the batched-GEMM attention runs on it as it is, and the backward's (B, T, 3·NH·hd) gradient is
// reduced back, each shared key/value head summing its query heads' gradients in ascending query
// head, one thread per output element (no atomics: bitwise reproducible, and the CPU's sums,
// cpu::rope_gqa_backward's order). Nothing of the expansion outlives the call: the caller keeps
// only qkv between forward and backward.
#include "base/error.h"
#include "kernels/cuda/flash_attention.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

// Thread e copies kVec consecutive values of row r of `full` (BT, 3·NH·hd): head h of part p (q,
// k, v) from qkv head h (p = 0), key head NH + h/group (p = 1), value head NH + KV + h/group.
template <int kVec>
__global__ void gqa_expand_kernel(float* full, const float* qkv, int64_t BT, int64_t NH,
                                  int64_t KV, int64_t hd) {
  const int64_t group = NH / KV, C = NH * hd, in_row = (NH + 2 * KV) * hd;
  const int64_t per_row = 3 * C / kVec, n = BT * per_row;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t r = e / per_row, c = (e % per_row) * kVec;
    const int64_t p = c / C, h = (c % C) / hd, d = c % hd;
    const int64_t from = p == 0 ? h : NH + (p - 1) * KV + h / group;
    float v[kVec];
    load_pack<kVec>(qkv + r * in_row + from * hd + d, v);
    store_pack<kVec>(full + r * 3 * C + c, v);
  }
}

// Thread e writes kVec consecutive values of row r of dqkv (BT, (NH + 2·KV)·hd): a query head's
// gradient copied from dfull (BT, 3·NH·hd); a key or value head's the sum of its group's query
// heads' gradients, kv·group first, in ascending head. E: float, or a 16-bit type (the sums in
// fp32, rounded once).
template <int kVec, typename E>
__global__ void gqa_reduce_kernel(E* dqkv, const E* dfull, int64_t BT, int64_t NH, int64_t KV,
                                  int64_t hd) {
  const int64_t group = NH / KV, C = NH * hd, out_row = (NH + 2 * KV) * hd;
  const int64_t per_row = out_row / kVec, n = BT * per_row;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t r = e / per_row, c = (e % per_row) * kVec;
    const int64_t j = c / hd, d = c % hd;
    const E* row = dfull + r * 3 * C;
    float acc[kVec];
    if (j < NH) {
      load_pack<kVec>(row + j * hd + d, acc);
    } else {
      const bool key = j < NH + KV;
      const int64_t kv = j - (key ? NH : NH + KV);
      const E* dy = row + (key ? C : 2 * C) + kv * group * hd + d;
      load_pack<kVec>(dy, acc);
      for (int64_t h = 1; h < group; ++h) {
        float x[kVec];
        load_pack<kVec>(dy + h * hd, x);
        for (int k = 0; k < kVec; ++k) acc[k] += x[k];
      }
    }
    store_pack<kVec>(dqkv + r * out_row + c, acc);
  }
}

void check_gqa_shape(const char* op, int64_t NH, int64_t KV, int64_t hd) {
  if (NH <= 0 || KV <= 0 || NH % KV != 0)
    fail(op, ": ", KV, " key/value heads do not divide ", NH, " query heads");
  if (hd <= 0) fail(op, ": head size ", hd, " is not positive");
}

// 4 values (16 bytes of floats, 8 of a 16-bit type) a thread where the head size and both
// pointers allow it, else one.
template <typename E>
bool gqa_takes_vec4(const E* a, const E* b, int64_t hd) {
  return hd % 4 == 0 && aligned_to(a, 4 * sizeof(E)) && aligned_to(b, 4 * sizeof(E));
}

// full (B·T, 3·NH·hd) from qkv (B·T, (NH + 2·KV)·hd).
void expand_gqa_heads(float* full, const float* qkv, int64_t BT, int64_t NH, int64_t KV,
                      int64_t hd) {
  const int64_t n = BT * 3 * NH * hd;
  if (gqa_takes_vec4(full, qkv, hd))
    launch("attention_gqa (expand heads)", gqa_expand_kernel<4>, blocks_for(n / 4, kThreads),
           kThreads, full, qkv, BT, NH, KV, hd);
  else
    launch("attention_gqa (expand heads)", gqa_expand_kernel<1>, blocks_for(n, kThreads),
           kThreads, full, qkv, BT, NH, KV, hd);
}

// dqkv (B·T, (NH + 2·KV)·hd) from dfull (B·T, 3·NH·hd).
template <typename E>
void reduce_gqa_heads(E* dqkv, const E* dfull, int64_t BT, int64_t NH, int64_t KV, int64_t hd) {
  const int64_t n = BT * (NH + 2 * KV) * hd;
  if (gqa_takes_vec4(dqkv, dfull, hd))
    launch("attention_gqa_backward (reduce heads)", gqa_reduce_kernel<4, E>,
           blocks_for(n / 4, kThreads), kThreads, dqkv, dfull, BT, NH, KV, hd);
  else
    launch("attention_gqa_backward (reduce heads)", gqa_reduce_kernel<1, E>,
           blocks_for(n, kThreads), kThreads, dqkv, dfull, BT, NH, KV, hd);
}

// Where the flash kernels do not apply the attention reads qkv (and dO) in fp32 only: a 16-bit
// one is refused by name, as attention_forward_rounded refuses it.
void expect_fp32_for_expansion(GemmOperand x, const char* what, const char* name) {
  if (x.rounded_to != MatmulPrecision::kFp32)
    fail(what, ": a 16-bit ", name,
         " needs the flash kernels (bf16, head size 64 or 128), which do not apply");
}

}  // namespace

void attention_gqa_forward(int device, float* out, float* lse, const float* qkv, int64_t B,
                           int64_t T, int64_t NH, int64_t KV, int64_t hd,
                           cpu::DocumentStarts docs) {
  check_gqa_shape("attention_gqa_forward", NH, KV, hd);
  const int64_t C = NH * hd;
  // qkv is attention_forward's layout already, or the flash kernels read its shared heads in place.
  if (KV == NH || flash_attention_applies(C, NH, B)) {
    attention_forward(device, out, lse, qkv, B, T, C, NH, docs, KV);
    return;
  }
  if (B * T == 0) return;
  DeviceGuard guard(device);
  Scratch<float> full(device, B * T * 3 * C);
  expand_gqa_heads(full.get(), qkv, B * T, NH, KV, hd);
  attention_forward(device, out, lse, full.get(), B, T, C, NH, docs);
}

void attention_gqa_backward(int device, float* dqkv, const float* dout, const float* qkv,
                            const float* out, const float* lse, int64_t B, int64_t T, int64_t NH,
                            int64_t KV, int64_t hd, cpu::DocumentStarts docs) {
  check_gqa_shape("attention_gqa_backward", NH, KV, hd);
  const int64_t C = NH * hd;
  if (KV == NH || flash_attention_applies(C, NH, B)) {
    attention_backward(device, dqkv, dout, qkv, out, lse, B, T, C, NH, docs, KV);
    return;
  }
  if (B * T == 0) return;
  DeviceGuard guard(device);
  const int64_t BT = B * T;
  Scratch<float> full(device, BT * 3 * C), dfull(device, BT * 3 * C);
  expand_gqa_heads(full.get(), qkv, BT, NH, KV, hd);
  attention_backward(device, dfull.get(), dout, full.get(), out, lse, B, T, C, NH, docs);
  reduce_gqa_heads(dqkv, static_cast<const float*>(dfull.get()), BT, NH, KV, hd);
}

GemmOperand attention_gqa_forward_rounded(int device, void* out, float* lse, GemmOperand qkv,
                                          int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                          cpu::DocumentStarts docs) {
  check_gqa_shape("attention_gqa_forward_rounded", NH, KV, hd);
  const int64_t C = NH * hd;
  if (KV == NH || flash_attention_applies(C, NH, B))
    return attention_forward_rounded(device, out, lse, qkv, B, T, C, NH, docs, KV);
  expect_fp32_for_expansion(qkv, "attention_gqa_forward_rounded", "qkv");
  DeviceGuard guard(device);
  Scratch<float> full(device, B * T * 3 * C);
  if (B * T > 0)
    expand_gqa_heads(full.get(), static_cast<const float*>(qkv.data), B * T, NH, KV, hd);
  return attention_forward_rounded(device, out, lse, full.get(), B, T, C, NH, docs);
}

GemmOperand attention_gqa_backward_rounded(int device, void* dqkv, GemmOperand dout,
                                           GemmOperand qkv, GemmOperand out, const float* lse,
                                           int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                           cpu::DocumentStarts docs) {
  check_gqa_shape("attention_gqa_backward_rounded", NH, KV, hd);
  const int64_t C = NH * hd, BT = B * T;
  if (KV == NH || flash_attention_applies(C, NH, B))
    return attention_backward_rounded(device, dqkv, dout, qkv, out, lse, B, T, C, NH, docs, KV);
  expect_fp32_for_expansion(qkv, "attention_gqa_backward_rounded", "qkv");
  expect_fp32_for_expansion(dout, "attention_gqa_backward_rounded", "dout");
  out.expect_usable_at(matmul_precision(), "out");
  DeviceGuard guard(device);
  Scratch<float> full(device, BT * 3 * C);
  if (BT > 0) expand_gqa_heads(full.get(), static_cast<const float*>(qkv.data), BT, NH, KV, hd);
  // The expanded gradient in out's 16-bit type (the current precision's), summed back in fp32.
  with_rounded_type("attention_gqa_backward_rounded", [&](auto zero) {
    using Half = decltype(zero);
    Scratch<Half> dfull(device, BT * 3 * C);
    attention_backward_rounded(device, dfull.get(), dout, full.get(), out, lse, B, T, C, NH, docs);
    if (BT > 0)
      reduce_gqa_heads(static_cast<Half*>(dqkv), static_cast<const Half*>(dfull.get()), BT, NH, KV,
                       hd);
  });
  return GemmOperand(dqkv, out.rounded_to);
}

}  // namespace loom::cuda
