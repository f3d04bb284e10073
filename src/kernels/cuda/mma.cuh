// The tensor cores' warp-wide step with a layout we know: mma.sync m16n8k16, bf16 operands and
// fp32 accumulators (sm_80 and later). wmma's fragments are opaque, so a kernel working on its
// accumulators must store them to shared memory first; PTX documents which lane holds which
// element of mma's (device/cuda/emulator/scheduler.h spells it out), so a kernel can work on the
// accumulators in registers — FlashAttention-2's softmax — and hand them on as the next product's
// A operand without any lane exchanging anything.
//
// In a warp, lane = 4·g + t: g owns rows g and g + 8 of a 16-row operand, t the columns 2t and
// 2t + 1 of every 8 columns. ldmatrix loads B operands from shared memory in that layout, two
// mmas' at a time. Under the CUDA emulator both are the emulator's own.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

#ifdef LOOM_CUDA_EMULATE
#include "device/cuda/emulator/scheduler.h"
#endif

#include "kernels/cuda/unroll.h"  // LOOM_UNROLL

namespace loom::cuda {

#if defined(__CUDACC__) || defined(LOOM_CUDA_EMULATE)

// d += a·b over the warp: A 16×16 (four registers of bf16 pairs), B 16×8 (two), D 16×8 (four
// floats per lane). Every lane of the warp calls it.
__device__ inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(LOOM_CUDA_EMULATE)
  cuda_emu::warp_mma_m16n8k16_bf16(d, a, b);
#elif defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  (void)d, (void)a, (void)b;  // nvcc's host pass: never called there
#endif
}

// Two floats rounded to bf16 as one operand register, `lo` in the low half.
__device__ inline uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &pair, sizeof bits);
  return bits;
}

// ldmatrix .x4: four 8×8 matrices of bf16 from shared memory, lane l giving the address of row
// l % 8 of matrix l / 8 (16 bytes, 16-byte aligned); r[i] = this lane's fragment of matrix i, as
// device/cuda/emulator/scheduler.h spells out. `transposed`: each matrix read column-major.
template <bool Transposed>
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* row) {
#if defined(LOOM_CUDA_EMULATE)
  cuda_emu::warp_ldmatrix_x4(r, row, Transposed);
#elif defined(__CUDA_ARCH__)
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  if constexpr (Transposed)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
#else
  (void)r, (void)row;         // nvcc's host pass: never called there
#endif
}

// The B operands of two mmas side by side, columns n0 .. n0 + 7 (b0) and n0 + 8 .. n0 + 15 (b1),
// k from k0 to k0 + 15, out of a shared tile (`ld` values a row, rows 16-byte aligned) holding
// B(k, n) at tile[n·ld + k] — B's columns along the tile's rows (a K or a Q tile for a product
// with its transpose) — or, `KAlongRows`, at tile[k·ld + n] (a V, K, Q or dO tile as the right
// factor). One ldmatrix for both: its four matrices are (n block, k half) = (0, 0), (0, 1),
// (1, 0), (1, 1), read transposed when k runs down the tile's rows.
template <bool KAlongRows>
__device__ inline void load_b_pair(uint32_t (&b0)[2], uint32_t (&b1)[2], const __nv_bfloat16* tile,
                                   int ld, int n0, int k0) {
  const int lane = threadIdx.x % 32, matrix = lane / 8, row = lane % 8;
  const int n_block = matrix / 2, k_half = matrix % 2;
  const __nv_bfloat16* p = KAlongRows ? tile + (k0 + 8 * k_half + row) * ld + n0 + 8 * n_block
                                      : tile + (n0 + 8 * n_block + row) * ld + k0 + 8 * k_half;
  uint32_t r[4];
  ldmatrix_x4<KAlongRows>(r, p);
  b0[0] = r[0];
  b0[1] = r[1];
  b1[0] = r[2];
  b1[1] = r[3];
}

// The accumulators of two 16×8 products side by side (columns 0–7 in `left`, 8–15 in `right`) as
// the A operand of a product whose k runs over those 16 columns, rounded to bf16: the two layouts
// agree lane by lane.
__device__ inline void accumulators_as_a(uint32_t (&a)[4], const float (&left)[4],
                                         const float (&right)[4]) {
  a[0] = pack_bf16(left[0], left[1]);
  a[1] = pack_bf16(left[2], left[3]);
  a[2] = pack_bf16(right[0], right[1]);
  a[3] = pack_bf16(right[2], right[3]);
}

#endif

}  // namespace loom::cuda
