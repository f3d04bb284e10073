// Fused causal attention (FlashAttention-2's schedule) for head sizes 64 (every GPT-2 size) and
// 128 (Llama 3's and most larger models') with bf16 operands on the tensor cores (mma.sync
// m16n8k16, fp32 accumulation; mma.cuh): what attention.cu uses when the matmul precision is bf16.
// No (T, T) score matrix ever reaches memory. A block of 4 warps owns 64 rows, 16 per warp, and
// walks the other side's tiles through shared memory; each warp keeps its own rows' operands in
// registers for the whole walk, and the scores, probabilities and their gradients never leave
// registers: the accumulators of one product are the A operand of the next (mma.cuh), and a row's
// max and sum combine the 4 lanes that hold it with two shuffles.
//
//  - forward, per query tile: S = Q·Kᵀ per 64-key tile (32 at head size 128), online softmax
//  (running max m and sum l
//    per row, the output rescaled by 2^(m_old - m_new); scores in log2 units for exp2f), O += P·V;
//    then O / l and lse = (m + log2 l)·ln 2.
//  - backward, deterministic (no float atomics), in two passes that each recompute P from lse:
//    per key tile, over the 32-query tiles at or after it: Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, Pᵀ, dSᵀ = Pᵀ ∘
//    (dPᵀ - D) / sqrt(hd), dV += Pᵀ·dO, dK += dSᵀ·Q; and per query tile, over its 32-key tiles:
//    S = Q·Kᵀ, dP = dO·Vᵀ, dS likewise, dQ += dS·K. D = rowsum(dO ∘ O) comes from attention.cu.
//
// The other side's tiles are stored once, row-major, and ldmatrix reads the B operands of two
// mmas at a time out of them, along their rows or (transposing) down their columns: the padded
// leading dimension (+8 values) puts each 8-row phase of its reads, and a warp's stores, in
// distinct banks.
// Warps whose rows the causal mask hides from a whole tile skip its products. With document
// masking (Rows::docs) a query tile's walk over the keys starts at the tile of its first row's
// document, and a key tile's walk over the queries ends at the last query whose document
// reaches it; each score is masked by its row's document start as well as its position.
//
// qkv is read in place as the qkv projection writes it, (B, T, (NH + 2·KV)·hd): NH query heads,
// then KV key heads, then KV value heads, query head h reading key/value head h / (NH/KV) —
// grouped-query attention (GQA); KV = NH is GPT-2's (B, T, 3C). dqkv has the same layout: the
// dK/dV pass runs per key/value head and walks the query tiles of each of its query heads in
// ascending head, so a shared head's gradient is summed in its accumulators, not atomically.
//
// Context parallelism's attention of a rank's query rows (attention_gqa_*_rows) runs the same
// kernels: the queries and the gathered keys/values are separate tensors (Strides), and the query
// rows are runs of positions (Rows: a zigzag rank's two chunks), each row masked by its position,
// not its local index. The whole sequence is the one run of positions 0..T-1, so both are one
// code path; a row walks the same key tiles either way, and a rank's rows are bit for bit the
// whole sequence's (tested). The ring's blocks of keys are runs of key positions likewise
// (Rows::keys): a query masks a key row by how many rows it sees (visible(p): the block's keys
// ascend), which for the whole sequence's keys is p + 1, the same comparison as before.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/flash_attention.h"
#include "kernels/cuda/key_runs.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"

namespace loom::cuda {
namespace {

using bf16 = __nv_bfloat16;

// Every function below is templated on kHd, the head size: 64 or 128 (flash_attention_applies).
constexpr int kFlashWarps = 4;  // 16 rows each: one mma's M
constexpr int kFlashThreads = 32 * kFlashWarps;
constexpr int kBlockRows = 16 * kFlashWarps;
constexpr int kSideTile = 32;  // backward: the other side's rows per shared tile
constexpr float kLog2e = 1.4426950408889634f;
// The leading dimension of a tile with hd columns (padded: module comment).
template <int kHd>
constexpr int kLd = kHd + 8;
// The forward's keys per shared tile: 64, or 32 at head size 128, so that its K and V tiles (two
// stages each) stay within the 48 KB of static shared memory a block may have.
template <int kHd>
constexpr int kKeyTile = kHd == 64 ? 64 : 32;
// Blocks per multiprocessor the kernels are compiled for: at head size 128 a thread's
// accumulators double, and half the blocks leave it the registers for them.
template <int kHd>
constexpr int kMinBlocks = kHd == 64 ? 4 : 2;

// Where the rows of an operand are: row t of batch b at base + b·batch + t·row, a head's columns
// further on at its offset (h·hd). One qkv tensor gives the queries, keys and values of the whole
// sequence; context parallelism passes its local queries and the gathered keys/values apart.
struct Strides {
  int64_t row, batch;
};

// The query rows a launch computes: `count` runs of consecutive positions, run i the positions
// [begin[i], begin[i] + size[i]) at local rows [at[i], at[i] + size[i]) of the queries, dQ, the
// output, dO, lse and D (Tq local rows per (b, h)), runs in ascending position. The whole sequence
// is the one run {0, 0, T}; a context-parallel rank's zigzag chunks are two.
//
// The keys (T per (b, key/value head)): `keys` (key_runs.cuh) says where they are — the
// positions [0, T), or a ring's block of runs of positions — and how many of them a query sees.
constexpr int kMaxRuns = 8;
struct Rows {
  int64_t NH, KV, T, Tq;
  int count;
  int64_t begin[kMaxRuns], at[kMaxRuns], size[kMaxRuns];
  KeyRuns keys;
  cpu::DocumentStarts docs;  // document masking (device memory); none: causal
  __device__ int64_t kv_of(int64_t h) const { return h / (NH / KV); }
  // How many key rows a query at position p sees, and the position of key row j.
  __device__ int64_t visible(int64_t p) const { return keys.visible(p); }
  // The first key row the query at position p of sequence b sees: those before it belong to
  // earlier documents (0 without document masking). Starts never decrease along a sequence, so
  // a tile's first row has the smallest.
  __device__ int64_t first_key(int64_t b, int64_t p) const {
    return KeyMask{keys, docs}.begin(b, p);
  }
  __device__ int64_t key_position(int64_t j) const { return keys.position(j); }
  // The 8-key blocks from key row k0 on holding a key that a warp whose last row is at position
  // `last` sees (what rows_times_tile_t computes; the rest are all masked).
  __device__ int64_t blocks_seen(int64_t last, int64_t k0) const {
    if (keys.count == 0) return (last - k0) / 8 + 1;
    const int64_t end = visible(last);
    return end > k0 ? (end - k0 + 7) / 8 : 0;
  }
};

// The 64-row query tile that block x of the forward and dQ launches owns: run `run`, local rows
// [row0, row0 + 64) of it. The tiles seeing the most keys (the last run's last tile) start first.
struct QueryTile {
  int run;
  int64_t row0;
};
__device__ inline QueryTile query_tile_of(const Rows& rows, int64_t x) {
  for (int i = rows.count - 1; i > 0; --i) {
    const int64_t tiles = (rows.size[i] + kBlockRows - 1) / kBlockRows;
    if (x < tiles) return {i, (tiles - 1 - x) * kBlockRows};
    x -= tiles;
  }
  return {0, ((rows.size[0] + kBlockRows - 1) / kBlockRows - 1 - x) * kBlockRows};
}

// Four consecutive floats, p 16-byte aligned: one 128-bit load on the GPU.
__device__ inline float4 load4(const float* p) {
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const float4*>(p);
#else
  return make_float4(p[0], p[1], p[2], p[3]);
#endif
}

// Four floats rounded to bf16 at dst (8-byte aligned): one 64-bit store on the GPU.
__device__ inline void store4(bf16* dst, float4 v) {
  const uint32_t lo = pack_bf16(v.x, v.y), hi = pack_bf16(v.z, v.w);
#ifdef __CUDA_ARCH__
  *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
#else
  std::memcpy(static_cast<void*>(dst), &lo, sizeof lo);
  std::memcpy(static_cast<void*>(dst + 2), &hi, sizeof hi);
#endif
}

// Rows [row0, row0 + Rows) of a head's hd columns (row r at src + r·width; src and width
// multiples of 4 floats), rounded to bf16, into `tile` (row-major, ld kLd<kHd>);
// zeros past T. A thread moves 4 columns of a row at a time: a warp's 8-byte stores cover whole
// rows, in distinct banks.
template <int kHd, int Rows>
__device__ void load_tile(bf16* tile, const float* src, int64_t row0, int64_t T, int64_t width) {
  for (int e = threadIdx.x; e < Rows * kHd / 4; e += blockDim.x) {
    const int r = e / (kHd / 4), c = e % (kHd / 4) * 4;
    const int64_t row = row0 + r;
    const float4 v = row < T ? load4(src + row * width + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    store4(tile + r * kLd<kHd> + c, v);
  }
}

// load_tile's rows, asynchronously (cp.async, 16 bytes a copy, zeros past T) when they are bf16
// already, so a kernel can fetch the next tile while it computes on this one: the caller commits
// and waits (async_copy.cuh). Else loaded and rounded now.
template <int kHd, int Rows, typename In>
__device__ void fetch_tile(bf16* tile, const In* src, int64_t row0, int64_t T, int64_t width) {
  if constexpr (std::is_same_v<In, bf16>) {
    for (int e = threadIdx.x; e < Rows * kHd / 8; e += blockDim.x) {
      const int r = e / (kHd / 8), c = e % (kHd / 8) * 8;
      const int64_t row = row0 + r;
      cp_async_16(tile + r * kLd<kHd> + c, row < T ? src + row * width + c : src, row < T);
    }
  } else {
    load_tile<kHd, Rows>(tile, src, row0, T, width);
  }
}

// Stages of the K and V tiles in shared memory: two with a bf16 qkv (the next pair in flight).
template <typename In>
inline constexpr int kStages = std::is_same_v<In, bf16> ? 2 : 1;

// Walks the K and V tiles of rows [begin, end) of a key/value head (row t of K at k_head +
// t·width, of V at v_head + t·width) in steps of Rows from the tile holding row `begin`, calling
// body(k, v, key0) with each pair in shared memory (`k`, `v`: kStages buffers each). With a bf16
// qkv the next pair's copies fly while the body computes on this one; else each pair is loaded and
// rounded at its turn. The body may return early; every thread of the block must call this.
template <int kHd, int Rows, typename In, typename Body>
__device__ void for_each_key_tile(bf16 (*k)[Rows * kLd<kHd>], bf16 (*v)[Rows * kLd<kHd>],
                                  const In* k_head, const In* v_head, int64_t width, int64_t T,
                                  int64_t begin, int64_t end, Body&& body) {
  constexpr bool kAsync = kStages<In> == 2;
  begin -= begin % Rows;     // the tile holding key row `begin` (earlier ones: other documents)
  if (end <= begin) return;  // a ring's block none of whose keys the rows see: nothing to fetch
  if constexpr (kAsync) {
    fetch_tile<kHd, Rows>(k[0], k_head, begin, T, width);
    fetch_tile<kHd, Rows>(v[0], v_head, begin, T, width);
    cp_async_commit();
  }
  int stage = 0;
  for (int64_t k0 = begin; k0 < end; k0 += Rows) {
    __syncthreads();  // every warp is done with the buffers the fetch below refills
    if constexpr (kAsync) {
      if (k0 + Rows < end) {
        fetch_tile<kHd, Rows>(k[stage ^ 1], k_head, k0 + Rows, T, width);
        fetch_tile<kHd, Rows>(v[stage ^ 1], v_head, k0 + Rows, T, width);
      }
      cp_async_commit();
      cp_async_wait<1>();  // this thread's copies of this pair (not the next one's)
    } else {
      fetch_tile<kHd, Rows>(k[0], k_head, k0, T, width);
      fetch_tile<kHd, Rows>(v[0], v_head, k0, T, width);
    }
    __syncthreads();  // ... and every other thread's
    body(k[stage], v[stage], k0);
    if constexpr (kAsync) stage ^= 1;
  }
}

// A warp's 16 rows [row0, row0 + 16) of a head's hd columns (row r at src + r·width) as the A
// operands of the four 16-column k steps over hd, rounded to bf16; zeros past T. Read once per
// block, straight from global memory: each group of 4 lanes reads 32 contiguous bytes.
template <int kHd, typename In>
__device__ void load_row_operands(uint32_t (&a)[kHd / 16][4], const In* src, int64_t row0,
                                  int64_t T, int64_t width) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int half = 0; half < 2; ++half) {  // rows g and g + 8
    const int64_t row = row0 + g + 8 * half;
    const In* p = row < T ? src + row * width : nullptr;
    LOOM_UNROLL
    for (int kk = 0; kk < kHd / 16; ++kk) {
      LOOM_UNROLL
      for (int right = 0; right < 2; ++right) {  // columns 2t, 2t + 1 and 8 further
        const int c = 16 * kk + 2 * t + 8 * right;
        a[kk][half + 2 * right] = p != nullptr ? pack_bf16(widen(p[c]), widen(p[c + 1])) : 0u;
      }
    }
  }
}

// Writes a warp's 16 rows × hd accumulators (rows row0 + g, row0 + g + 8 in this lane) times
// `row_scale` at dst + row·width; rows past T are dropped. `Out`: fp32, or bf16 for a GEMM
// operand (rounded from the same fp32 values).
template <int kHd, typename Out>
__device__ void store_rows(Out* dst, int64_t width, const float (&acc)[kHd / 8][4], int64_t row0,
                           int64_t T, const float (&row_scale)[2]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + g + 8 * half;
    if (row >= T) continue;
    Out* out = dst + row * width;
    LOOM_UNROLL
    for (int j = 0; j < kHd / 8; ++j) {
      round_to(out[8 * j + 2 * t], acc[j][2 * half] * row_scale[half]);
      round_to(out[8 * j + 2 * t + 1], acc[j][2 * half + 1] * row_scale[half]);
    }
  }
}

// The two rows' values combined over the 4 lanes that hold them (lanes 4g .. 4g + 3).
__device__ inline float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ inline float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// s (this warp's 16 rows × 8·Blocks columns) = A·Bᵀ: A the warp's rows over hd (row operands),
// B the rows of `tile` (ld kLd<kHd>). Only the 8-column blocks from which the first `used` start are
// computed, the rest left zero (the causal mask hides them).
template <int kHd, int Blocks>
__device__ void rows_times_tile_t(float (&s)[Blocks][4], const uint32_t (&a)[kHd / 16][4],
                                  const bf16* tile, int64_t used = Blocks) {
  LOOM_UNROLL
  for (int j = 0; j < Blocks; j += 2) {
    LOOM_UNROLL
    for (int e = 0; e < 4; ++e) s[j][e] = s[j + 1][e] = 0.0f;
    if (j >= used) continue;
    LOOM_UNROLL
    for (int kk = 0; kk < kHd / 16; ++kk) {
      uint32_t b0[2], b1[2];
      load_b_pair<false>(b0, b1, tile, kLd<kHd>, 8 * j, 16 * kk);
      mma_bf16(s[j], a[kk], b0);
      mma_bf16(s[j + 1], a[kk], b1);
    }
  }
}

// acc (16 rows × hd) += P·X: P the accumulators `p` (16 rows × 8·Blocks columns) rounded to
// bf16, of which only the first `used` 8-column blocks may be nonzero; X the tile of 8·Blocks
// rows `x` (ld kLd<kHd>), read down its columns by ldmatrix's transposing load.
template <int kHd, int Blocks>
__device__ void accumulate_times_tile(float (&acc)[kHd / 8][4], const float (&p)[Blocks][4],
                                      const bf16* x, int64_t used = Blocks) {
  LOOM_UNROLL
  for (int kk = 0; kk < Blocks / 2; ++kk) {
    if (2 * kk >= used) continue;
    uint32_t a[4];
    accumulators_as_a(a, p[2 * kk], p[2 * kk + 1]);
    LOOM_UNROLL
    for (int j = 0; j < kHd / 8; j += 2) {
      uint32_t b0[2], b1[2];
      load_b_pair<true>(b0, b1, x, kLd<kHd>, 8 * j, 16 * kk);
      mma_bf16(acc[j], a, b0);
      mma_bf16(acc[j + 1], a, b1);
    }
  }
}

// `In`: q, k, v in fp32, or in bf16 as the qkv projection wrote them. `Out`: fp32, or bf16 for an
// output only the next GEMM (and D = rowsum(dO ∘ O)) reads. out is (B, Tq, NH·hd).
template <int kHd, typename In, typename Out>
__global__ void __launch_bounds__(kFlashThreads, kMinBlocks<kHd>)
    flash_forward_kernel(Out* out, float* lse, const In* q, Strides qs, const In* k, const In* v,
                         Strides kvs, Rows rows, float scale) {
  // K: B(k = hd, n = key) of S = Q·Kᵀ; V: B(k = key, n = hd) of O += P·V.
  __shared__ __align__(16) bf16 k_tiles[kStages<In>][kKeyTile<kHd> * kLd<kHd>];
  __shared__ __align__(16) bf16 v_tiles[kStages<In>][kKeyTile<kHd> * kLd<kHd>];
  const int64_t NH = rows.NH, C = NH * kHd, T = rows.T, Tq = rows.Tq;
  const int64_t bh = blockIdx.y, b = bh / NH, h = bh % NH, g = rows.kv_of(h);
  const QueryTile tile = query_tile_of(rows, blockIdx.x);
  // This run: positions p0.., local rows at.., n of them.
  const int64_t p0 = rows.begin[tile.run], at = rows.at[tile.run], n = rows.size[tile.run];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  const int64_t w0 = tile.row0 + 16 * warp;                    // this warp's first row in the run
  const int64_t r0 = p0 + w0;                                  // ... and its position
  // This lane's two rows: the key rows each sees, [first, limit) (the keys at or before its
  // position, and with document masking from its document's start).
  const int64_t limit[2] = {rows.visible(r0 + lane / 4), rows.visible(r0 + lane / 4 + 8)};
  const int64_t first[2] = {w0 + lane / 4 < n ? rows.first_key(b, r0 + lane / 4) : 0,
                            w0 + lane / 4 + 8 < n ? rows.first_key(b, r0 + lane / 4 + 8) : 0};
  // The warp's earliest key (its first row's) and the tile's (where the walk starts).
  const int64_t warp_first = w0 < n ? rows.first_key(b, r0) : 0;
  const int64_t kv_begin = rows.first_key(b, p0 + tile.row0);
  const float scale2 = scale * kLog2e;  // scores in log2 units

  uint32_t qa[kHd / 16][4];
  load_row_operands<kHd>(qa, q + b * qs.batch + at * qs.row + h * kHd, w0, n, qs.row);
  float o[kHd / 8][4] = {};
  // Per row: the running max (log2 units) and this lane's part of the running sum.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  // Causal: the keys up to the tile's last row's position.
  const int64_t kv_end =
      rows.visible(p0 + (tile.row0 + kBlockRows < n ? tile.row0 + kBlockRows : n) - 1);
  for_each_key_tile<kHd, kKeyTile<kHd>>(
      k_tiles, v_tiles, k + b * kvs.batch + g * kHd, v + b * kvs.batch + g * kHd, kvs.row, T,
      kv_begin, kv_end, [&](const bf16* k_tile, const bf16* v_tile, int64_t k0) {
        if (k0 + kKeyTile<kHd> <= warp_first) return;  // every key before the warp's documents
        const int64_t visible = rows.blocks_seen(r0 + 15, k0);
        float s[kKeyTile<kHd> / 8][4];
        rows_times_tile_t<kHd>(s, qa, k_tile, visible);  // S = Q·Kᵀ
        float mx[2] = {-INFINITY, -INFINITY};
        LOOM_UNROLL
        for (int j = 0; j < kKeyTile<kHd> / 8; ++j) {
          LOOM_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int64_t key = k0 + 8 * j + 2 * t + e % 2;
            s[j][e] = key >= first[e / 2] && key < limit[e / 2] ? s[j][e] * scale2 : -INFINITY;
            mx[e / 2] = fmaxf(mx[e / 2], s[j][e]);
          }
        }
        float base[2], alpha[2];
        for (int r = 0; r < 2; ++r) {
          const float m_new = fmaxf(m[r], quad_max(mx[r]));
          base[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet keeps p = 0
          alpha[r] = exp2f(m[r] - base[r]);             // 0 while m was -inf
          m[r] = m_new;
          l[r] *= alpha[r];
        }
        LOOM_UNROLL
        for (int j = 0; j < kKeyTile<kHd> / 8; ++j) {
          LOOM_UNROLL
          for (int e = 0; e < 4; ++e) {
            s[j][e] = exp2f(s[j][e] - base[e / 2]);
            l[e / 2] += s[j][e];
          }
        }
        LOOM_UNROLL
        for (int j = 0; j < kHd / 8; ++j) {
          LOOM_UNROLL
          for (int e = 0; e < 4; ++e) o[j][e] *= alpha[e / 2];
        }
        accumulate_times_tile<kHd>(o, s, v_tile, visible);  // O += P·V
      });
  float inverse[2];
  for (int r = 0; r < 2; ++r) {
    l[r] = quad_sum(l[r]);
    // A row that sees no key (a ring's block of later positions): output 0, lse -inf.
    inverse[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    const int64_t row = w0 + lane / 4 + 8 * r;
    if (row < n && t == 0) lse[bh * Tq + at + row] = m[r] / kLog2e + logf(l[r]);
  }
  store_rows<kHd>(out + (b * Tq + at) * C + h * kHd, C, o, w0, n, inverse);
}

// The backward kernels: `In` as the forward's; `DO`, dO's type: fp32, or bf16 as the attention
// projection's backward wrote it (with a bf16 qkv only). dO is (B, Tq, NH·hd) as the output.
//
// dK and dV of one 64-key tile of a key/value head, over the 32-query tiles of each of its query
// heads in ascending head, and of each run in ascending position, that hold a position at or
// after the tile's first key (one walk: a tile's successor is the next tile of the run, or the
// first of the next run or head, so the pipeline of copies runs across them). dK, dV rows past
// every query are written zero.
template <int kHd, typename In, typename DO, typename Out>
__global__ void flash_backward_kv_kernel(Out* dk, Out* dv, Strides dkvs, const DO* dout,
                                         const In* q, Strides qs, const In* k, const In* v,
                                         Strides kvs, const float* lse, const float* D, Rows rows,
                                         float scale) {
  // Q: B(k = hd, n = query) of Sᵀ = K·Qᵀ and B(k = query, n = hd) of dK += dSᵀ·Q; dO likewise
  // of dPᵀ = V·dOᵀ and dV += Pᵀ·dO. Each in bf16 arrives by cp.async, the next tile while this
  // one is in use; in fp32 it is loaded, and rounded, at its turn.
  __shared__ __align__(16) bf16 q_tiles[kStages<In>][kSideTile * kLd<kHd>];
  __shared__ __align__(16) bf16 dy_tiles[kStages<DO>][kSideTile * kLd<kHd>];
  __shared__ float lse2_q[kSideTile], d_q[kSideTile];  // per query: lse in log2 units, D
  __shared__ int64_t first_q[kSideTile];  // per query: the first key row it sees (documents)
  const int64_t NH = rows.NH, KV = rows.KV, C = NH * kHd, T = rows.T, Tq = rows.Tq;
  const int64_t group = NH / KV;
  const int64_t bkv = blockIdx.y, b = bkv / KV, kv = bkv % KV;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kBlockRows;  // the first tiles see most
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  const int64_t w0 = k0 + 16 * warp;                           // this warp's first key
  const int64_t keys[2] = {w0 + lane / 4, w0 + lane / 4 + 8};  // this lane's two key rows
  const int64_t key_pos[2] = {rows.key_position(keys[0]), rows.key_position(keys[1])};
  const int64_t first_pos = rows.key_position(k0), warp_pos = rows.key_position(w0);
  const float scale2 = scale * kLog2e;
  // Per run, its first 32-row tile holding a position at or after the first key's and how many
  // tiles from there: causal, earlier queries see none of these keys.
  // With document masking the walk also ends at the last tile holding a query whose document
  // starts at or before this block's last key: document starts never decrease along a run, so
  // the queries that see any of these keys are a prefix of it (found by bisection) — short
  // documents leave O(T·L) of the walk, not O(T²).
  const int64_t last_key = (k0 + kBlockRows < T ? k0 + kBlockRows : T) - 1;
  int64_t first[kMaxRuns], count[kMaxRuns], tiles = 0;
  for (int i = 0; i < rows.count; ++i) {
    const int64_t skip =
        first_pos > rows.begin[i] ? (first_pos - rows.begin[i]) / kSideTile : 0;
    int64_t all = (rows.size[i] + kSideTile - 1) / kSideTile;
    if (rows.docs.start != nullptr) {
      int64_t lo = 0, hi = rows.size[i];  // the first local row whose document starts later
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (rows.first_key(b, rows.begin[i] + mid) <= last_key)
          lo = mid + 1;
        else
          hi = mid;
      }
      all = (lo + kSideTile - 1) / kSideTile;
    }
    first[i] = skip;
    count[i] = all > skip ? all - skip : 0;
    tiles += count[i];
  }
  const int64_t steps = group * tiles;
  // Walk step s: query head kv·group + s / tiles, run and local row of its tile (s % tiles).
  struct Step {
    int64_t h, run, row0;
  };
  const auto step_of = [&](int64_t s) {
    int64_t r = s % tiles;
    int i = 0;
    while (r >= count[i]) r -= count[i++];
    return Step{kv * group + s / tiles, i, (first[i] + r) * kSideTile};
  };

  uint32_t ka[kHd / 16][4], va[kHd / 16][4];
  load_row_operands<kHd>(ka, k + b * kvs.batch + kv * kHd, w0, T, kvs.row);
  load_row_operands<kHd>(va, v + b * kvs.batch + kv * kHd, w0, T, kvs.row);
  float dk_acc[kHd / 8][4] = {}, dv_acc[kHd / 8][4] = {};
  constexpr bool kAsyncQ = kStages<In> == 2, kAsyncDy = kStages<DO> == 2;
  constexpr bool kAsync = kAsyncQ || kAsyncDy;
  const auto fetch_q = [&](bf16* tile, const Step& st) {
    fetch_tile<kHd, kSideTile>(tile, q + b * qs.batch + rows.at[st.run] * qs.row + st.h * kHd,
                               st.row0, rows.size[st.run], qs.row);
  };
  const auto fetch_dy = [&](bf16* tile, const Step& st) {
    fetch_tile<kHd, kSideTile>(tile, dout + (b * Tq + rows.at[st.run]) * C + st.h * kHd, st.row0,
                               rows.size[st.run], C);
  };
  if (steps > 0) {
    if constexpr (kAsyncQ) fetch_q(q_tiles[0], step_of(0));
    if constexpr (kAsyncDy) fetch_dy(dy_tiles[0], step_of(0));
  }
  if constexpr (kAsync) cp_async_commit();
  int stage = 0;
  for (int64_t s = 0; s < steps; ++s) {
    const Step st = step_of(s);
    const int64_t p0 = rows.begin[st.run], n = rows.size[st.run], at = rows.at[st.run];
    const int64_t bh = b * NH + st.h, q0 = p0 + st.row0;  // the tile's first position
    __syncthreads();  // every warp is done with lse2_q, d_q and the buffers refilled below
    if constexpr (kAsyncQ) {
      if (s + 1 < steps) fetch_q(q_tiles[stage ^ 1], step_of(s + 1));
    } else {
      fetch_q(q_tiles[0], st);
    }
    if constexpr (kAsyncDy) {
      if (s + 1 < steps) fetch_dy(dy_tiles[stage ^ 1], step_of(s + 1));
    } else {
      fetch_dy(dy_tiles[0], st);
    }
    if constexpr (kAsync) cp_async_commit();
    for (int e = threadIdx.x; e < kSideTile; e += blockDim.x) {
      const int64_t row = st.row0 + e;
      lse2_q[e] = row < n ? lse[bh * Tq + at + row] * kLog2e : 0.0f;
      d_q[e] = row < n ? D[bh * Tq + at + row] : 0.0f;
      first_q[e] = row < n ? rows.first_key(b, p0 + row) : 0;
    }
    if constexpr (kAsync) cp_async_wait<1>();  // this thread's copies of this tile pair
    __syncthreads();                           // ... and every other thread's
    const bf16* q_tile = q_tiles[kAsyncQ ? stage : 0];
    const bf16* dy = dy_tiles[kAsyncDy ? stage : 0];
    if constexpr (kAsync) stage ^= 1;
    if (q0 + kSideTile - 1 < warp_pos) continue;  // every query before all of this warp's keys
    if (first_q[0] > w0 + 15) continue;  // every query's document after all of this warp's keys
    float sT[kSideTile / 8][4], dpt[kSideTile / 8][4];
    rows_times_tile_t<kHd>(sT, ka, q_tile);  // Sᵀ = K·Qᵀ
    rows_times_tile_t<kHd>(dpt, va, dy);     // dPᵀ = V·dOᵀ
    LOOM_UNROLL
    for (int j = 0; j < kSideTile / 8; ++j) {
      LOOM_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int c = 8 * j + 2 * t + e % 2;
        const int64_t i = q0 + c;
        const float prob =
            i >= key_pos[e / 2] && st.row0 + c < n && keys[e / 2] < T && keys[e / 2] >= first_q[c]
                ? exp2f(sT[j][e] * scale2 - lse2_q[c])
                : 0.0f;
        sT[j][e] = prob;                                  // Pᵀ
        dpt[j][e] = prob * (dpt[j][e] - d_q[c]) * scale;  // dSᵀ
      }
    }
    accumulate_times_tile<kHd>(dv_acc, sT, dy);      // dV += Pᵀ·dO
    accumulate_times_tile<kHd>(dk_acc, dpt, q_tile);  // dK += dSᵀ·Q
  }
  const float one[2] = {1.0f, 1.0f};
  store_rows<kHd>(dk + b * dkvs.batch + kv * kHd, dkvs.row, dk_acc, w0, T, one);
  store_rows<kHd>(dv + b * dkvs.batch + kv * kHd, dkvs.row, dv_acc, w0, T, one);
}

// dQ of one 64-query tile.
template <int kHd, typename In, typename DO, typename Out>
__global__ void __launch_bounds__(kFlashThreads, kMinBlocks<kHd>)
    flash_backward_q_kernel(Out* dq, Strides dqs, const DO* dout, const In* q, Strides qs,
                            const In* k, const In* v, Strides kvs, const float* lse,
                            const float* D, Rows rows, float scale) {
  // K: B(k = hd, n = key) of S = Q·Kᵀ and B(k = key, n = hd) of dQ += dS·K; V: B of dP = dO·Vᵀ.
  __shared__ __align__(16) bf16 k_tiles[kStages<In>][kSideTile * kLd<kHd>];
  __shared__ __align__(16) bf16 v_tiles[kStages<In>][kSideTile * kLd<kHd>];
  const int64_t NH = rows.NH, C = NH * kHd, T = rows.T, Tq = rows.Tq;
  const int64_t bh = blockIdx.y, b = bh / NH, h = bh % NH, g = rows.kv_of(h);
  const QueryTile tile = query_tile_of(rows, blockIdx.x);
  const int64_t p0 = rows.begin[tile.run], at = rows.at[tile.run], n = rows.size[tile.run];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
  const int64_t w0 = tile.row0 + 16 * warp, r0 = p0 + w0;
  const int64_t local[2] = {w0 + lane / 4, w0 + lane / 4 + 8};
  const float scale2 = scale * kLog2e;
  float lse2[2], d[2];
  for (int r = 0; r < 2; ++r) {
    lse2[r] = local[r] < n ? lse[bh * Tq + at + local[r]] * kLog2e : 0.0f;
    d[r] = local[r] < n ? D[bh * Tq + at + local[r]] : 0.0f;
  }

  uint32_t qa[kHd / 16][4], dya[kHd / 16][4];
  load_row_operands<kHd>(qa, q + b * qs.batch + at * qs.row + h * kHd, w0, n, qs.row);
  load_row_operands<kHd>(dya, dout + (b * Tq + at) * C + h * kHd, w0, n, C);
  float dq_acc[kHd / 8][4] = {};
  // The key rows this lane's two rows see, [first, limit), and the warp's last row.
  const int64_t limit[2] = {rows.visible(p0 + local[0]), rows.visible(p0 + local[1])};
  const int64_t first[2] = {local[0] < n ? rows.first_key(b, p0 + local[0]) : 0,
                            local[1] < n ? rows.first_key(b, p0 + local[1]) : 0};
  const int64_t warp_first = w0 < n ? rows.first_key(b, r0) : 0;
  const int64_t kv_begin = rows.first_key(b, p0 + tile.row0);
  const int64_t warp_end = rows.keys.count == 0 ? r0 + 16 : rows.visible(r0 + 15);
  const int64_t kv_end =
      rows.visible(p0 + (tile.row0 + kBlockRows < n ? tile.row0 + kBlockRows : n) - 1);
  for_each_key_tile<kHd, kSideTile>(
      k_tiles, v_tiles, k + b * kvs.batch + g * kHd, v + b * kvs.batch + g * kHd, kvs.row, T,
      kv_begin, kv_end, [&](const bf16* k_tile, const bf16* v_tile, int64_t k0) {
        if (k0 >= warp_end) return;  // every key after all of this warp's rows
        if (k0 + kSideTile <= warp_first) return;  // every key before the warp's documents
        float s[kSideTile / 8][4], dp[kSideTile / 8][4];
        rows_times_tile_t<kHd>(s, qa, k_tile);   // S = Q·Kᵀ
        rows_times_tile_t<kHd>(dp, dya, v_tile);  // dP = dO·Vᵀ
        LOOM_UNROLL
        for (int j = 0; j < kSideTile / 8; ++j) {
          LOOM_UNROLL
          for (int e = 0; e < 4; ++e) {
            const int64_t key = k0 + 8 * j + 2 * t + e % 2;
            const float prob = key >= first[e / 2] && key < limit[e / 2] && local[e / 2] < n
                                   ? exp2f(s[j][e] * scale2 - lse2[e / 2])
                                   : 0.0f;
            s[j][e] = prob * (dp[j][e] - d[e / 2]) * scale;  // dS
          }
        }
        accumulate_times_tile<kHd>(dq_acc, s, k_tile);  // dQ += dS·K
      });
  const float one[2] = {1.0f, 1.0f};
  store_rows<kHd>(dq + b * dqs.batch + at * dqs.row + h * kHd, dqs.row, dq_acc, w0, n, one);
}

bool flash_disabled_by_environment() {
  static const bool disabled = [] {
    const char* v = std::getenv("LOOM_CUDA_FLASH_ATTENTION");
    return v != nullptr && std::string(v) == "0";
  }();
  return disabled;
}

// The tiles are read 4 values (8 with bf16's cp.async) at a time: every row of a head starts 16
// bytes aligned when the tensor does and its row stride keeps it so (head sizes are multiples of
// 64). A view starting elsewhere is refused, not misread.
void check_aligned(const void* p, size_t bytes, const char* what) {
  if (!aligned_to(p, bytes))
    fail("flash attention: ", what, " does not start on a ", bytes, "-byte boundary");
}
template <typename In>
void check_rows_aligned(const In* p, Strides s, const char* what) {
  check_aligned(p, 16, what);
  if (s.row * static_cast<int64_t>(sizeof(In)) % 16 != 0)
    fail("flash attention: ", what, "'s rows are ", s.row, " values apart, not a multiple of 16 bytes");
}

void check_heads(int64_t NH, int64_t KV, int64_t hd) {
  if (NH <= 0 || KV <= 0 || NH % KV != 0)
    fail("flash attention: ", KV, " key/value heads do not divide ", NH, " query heads");
  if (hd != 64 && hd != 128) fail("flash attention: head size ", hd, " is not 64 or 128");
}

// The operands of one attention: where its queries and keys/values are, and which query rows.
template <typename In>
struct Operands {
  const In* q;
  Strides qs;
  const In* k;
  const In* v;
  Strides kvs;
  Rows rows;
  int64_t hd;
};

// The whole sequence's, read in place from qkv (B, T, (NH + 2·KV)·hd): NH query heads, then KV
// key heads, then KV value heads.
template <typename In>
Operands<In> whole_sequence(const In* qkv, int64_t T, int64_t C, int64_t NH, int64_t KV,
                            cpu::DocumentStarts docs) {
  if (NH <= 0) fail("flash attention: ", NH, " query heads");
  const int64_t hd = C / NH, W = (NH + 2 * KV) * hd;
  check_heads(NH, KV, C % NH == 0 ? hd : 0);
  Rows rows{NH, KV, T, T, 1, {0}, {0}, {T}, KeyRuns{T}, docs};
  const Strides s{W, T * W};
  check_rows_aligned(qkv, s, "qkv");
  return {qkv, s, qkv + NH * hd, qkv + (NH + KV) * hd, s, rows, hd};
}

// Context parallelism's: queries q (B, Tq, ldq) at positions `ranges`, keys then values in kv
// (B, T, ldkv): every position's, or with `keys` those of its runs of positions (a ring's block).
template <typename In>
Operands<In> query_rows(const In* q, int64_t ldq, const In* kv, int64_t ldkv, int64_t T, int64_t NH,
                        int64_t KV, int64_t hd, std::span<const cpu::RowRange> ranges,
                        std::span<const cpu::RowRange> keys, cpu::DocumentStarts docs) {
  check_heads(NH, KV, hd);
  Rows rows{
      NH,  KV, T, cpu::rows_in(ranges), 0, {}, {}, {}, key_runs_of("flash attention", T, keys),
      docs};
  int64_t at = 0, last = 0;
  for (const cpu::RowRange& r : ranges) {
    if (r.size() == 0) continue;
    if (rows.count == kMaxRuns)
      fail("flash attention: more than ", kMaxRuns, " runs of query rows");
    if (r.begin < last)
      fail("flash attention: query rows [", r.begin, ", ", r.end, ") out of order");
    rows.begin[rows.count] = r.begin;
    rows.at[rows.count] = at;
    rows.size[rows.count] = r.size();
    ++rows.count;
    at += r.size();
    last = r.end;
  }
  if (keys.empty() && last > T) fail("flash attention: query rows past the ", T, " keys");
  const Strides qs{ldq, rows.Tq * ldq}, kvs{ldkv, T * ldkv};
  check_rows_aligned(q, qs, "q");
  check_rows_aligned(kv, kvs, "kv");
  return {q, qs, kv, kv + KV * hd, kvs, rows, hd};
}

// The forward's and dQ's blocks: one per 64 query rows of each run, for each of B·NH heads.
dim3 query_grid(int64_t B, const Rows& rows) {
  int64_t tiles = 0;
  for (int i = 0; i < rows.count; ++i) tiles += blocks_of(rows.size[i], kBlockRows);
  return dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(B * rows.NH));
}
// dK/dV's: one per 64 keys, for each of B·KV key/value heads.
dim3 key_grid(int64_t B, const Rows& rows) {
  return dim3(blocks_of(rows.T, kBlockRows), static_cast<unsigned>(B * rows.KV));
}

// f(std::integral_constant<int, hd>{}) for head size 64 or 128 (check_heads).
template <typename F>
void with_head_size(int64_t hd, F&& f) {
  if (hd == 64)
    f(std::integral_constant<int, 64>{});
  else
    f(std::integral_constant<int, 128>{});
}

float flash_scale(int64_t hd) {
  return 1.0f / std::sqrt(static_cast<float>(hd));
}

template <typename In, typename Out>
void flash_forward(int device, Out* out, float* lse, const Operands<In>& x, int64_t B,
                   const char* name) {
  DeviceGuard guard(device);
  if (B * x.rows.Tq == 0) return;
  with_head_size(x.hd, [&](auto hd) {
    launch(name, flash_forward_kernel<decltype(hd)::value, In, Out>, query_grid(B, x.rows),
           kFlashThreads, out, lse, x.q, x.qs, x.k, x.v, x.kvs, x.rows, flash_scale(x.hd));
  });
}

// dQ at dq (strides dqs), dK and dV at dk, dv (strides dkvs: every key's row written, zero where
// no query sees it).
template <typename In, typename DO, typename Out>
void flash_backward(int device, Out* dq, Strides dqs, Out* dk, Out* dv, Strides dkvs,
                    const DO* dout, const float* lse, const float* D, const Operands<In>& x,
                    int64_t B) {
  DeviceGuard guard(device);
  check_aligned(dout, 16, "dout");  // 4 floats, or 8 bf16 values (cp.async), at a time
  if (B * x.rows.T == 0) return;
  with_head_size(x.hd, [&](auto hd) {
    constexpr int kHd = decltype(hd)::value;
    launch("attention_backward (flash dK, dV)", flash_backward_kv_kernel<kHd, In, DO, Out>,
           key_grid(B, x.rows), kFlashThreads, dk, dv, dkvs, dout, x.q, x.qs, x.k, x.v, x.kvs,
           lse, D, x.rows, flash_scale(x.hd));
    if (x.rows.Tq > 0)
      launch("attention_backward (flash dQ)", flash_backward_q_kernel<kHd, In, DO, Out>,
             query_grid(B, x.rows), kFlashThreads, dq, dqs, dout, x.q, x.qs, x.k, x.v, x.kvs,
             lse, D, x.rows, flash_scale(x.hd));
  });
}

// flash_backward of the whole sequence: dqkv in qkv's layout.
template <typename In, typename DO, typename Out>
void flash_backward_whole(int device, Out* dqkv, const DO* dout, const In* qkv, const float* lse,
                          const float* D, int64_t B, int64_t T, int64_t C, int64_t NH, int64_t KV,
                          cpu::DocumentStarts docs) {
  const Operands<In> x = whole_sequence(qkv, T, C, NH, KV, docs);
  flash_backward(device, dqkv, x.qs, dqkv + NH * x.hd, dqkv + (NH + KV) * x.hd, x.kvs, dout, lse,
                 D, x, B);
}

}  // namespace

bool flash_attention_applies(int64_t C, int64_t NH, int64_t B) {
  return NH > 0 && (C == NH * 64 || C == NH * 128) && B * NH <= 65535 &&
         matmul_precision() == MatmulPrecision::kBf16 && !flash_disabled_by_environment();
}

bool flash_attention_applies_to_rows(int64_t NH, int64_t hd, int64_t B,
                                     std::span<const cpu::RowRange> rows,
                                     std::span<const cpu::RowRange> keys) {
  const auto runs = [](std::span<const cpu::RowRange> r) {
    return std::count_if(r.begin(), r.end(), [](const cpu::RowRange& x) { return x.size() > 0; });
  };
  return runs(rows) <= kMaxRuns && runs(keys) <= KeyRuns::kMaxRuns &&
         flash_attention_applies(NH * hd, NH, B);
}

void flash_attention_forward(int device, float* out, float* lse, const float* qkv, int64_t B,
                             int64_t T, int64_t C, int64_t NH, int64_t KV,
                             cpu::DocumentStarts docs) {
  flash_forward(device, out, lse, whole_sequence(qkv, T, C, NH, KV, docs), B,
                "attention_forward (flash)");
}

void flash_attention_forward_bf16_out(int device, void* out, float* lse, const void* qkv,
                                      bool qkv_bf16, int64_t B, int64_t T, int64_t C, int64_t NH,
                                      int64_t KV, cpu::DocumentStarts docs) {
  if (qkv_bf16)
    flash_forward(device, static_cast<bf16*>(out), lse,
                  whole_sequence(static_cast<const bf16*>(qkv), T, C, NH, KV, docs), B,
                  "attention_forward (flash, bf16 qkv and out)");
  else
    flash_forward(device, static_cast<bf16*>(out), lse,
                  whole_sequence(static_cast<const float*>(qkv), T, C, NH, KV, docs), B,
                  "attention_forward (flash, bf16 out)");
}

void flash_attention_backward(int device, float* dqkv, const float* dout, const float* qkv,
                              const float* lse, const float* D, int64_t B, int64_t T, int64_t C,
                              int64_t NH, int64_t KV, cpu::DocumentStarts docs) {
  flash_backward_whole(device, dqkv, dout, qkv, lse, D, B, T, C, NH, KV, docs);
}

void flash_attention_backward_bf16_dqkv(int device, void* dqkv, const void* dout, bool dout_bf16,
                                        const void* qkv, bool qkv_bf16, const float* lse,
                                        const float* D, int64_t B, int64_t T, int64_t C, int64_t NH,
                                        int64_t KV, cpu::DocumentStarts docs) {
  bf16* dqkv16 = static_cast<bf16*>(dqkv);
  if (dout_bf16 && !qkv_bf16)
    fail(
        "flash attention: a bf16 dout needs a bf16 qkv (the attention projection's backward "
        "writes it so only where the qkv projection wrote qkv in bf16)");
  if (dout_bf16)
    flash_backward_whole(device, dqkv16, static_cast<const bf16*>(dout),
                         static_cast<const bf16*>(qkv), lse, D, B, T, C, NH, KV, docs);
  else if (qkv_bf16)
    flash_backward_whole(device, dqkv16, static_cast<const float*>(dout),
                         static_cast<const bf16*>(qkv), lse, D, B, T, C, NH, KV, docs);
  else
    flash_backward_whole(device, dqkv16, static_cast<const float*>(dout),
                         static_cast<const float*>(qkv), lse, D, B, T, C, NH, KV, docs);
}

void flash_attention_forward_rows(int device, float* out, float* lse, const void* q, int64_t ldq,
                                  const void* kv, int64_t ldkv, bool bf16_in, int64_t B, int64_t T,
                                  int64_t NH, int64_t KV, int64_t hd,
                                  std::span<const cpu::RowRange> rows,
                                  std::span<const cpu::RowRange> keys, cpu::DocumentStarts docs) {
  if (bf16_in)
    flash_forward(device, out, lse,
                  query_rows(static_cast<const bf16*>(q), ldq, static_cast<const bf16*>(kv), ldkv,
                             T, NH, KV, hd, rows, keys, docs),
                  B, "attention_gqa_forward_rows (flash, bf16 q and kv)");
  else
    flash_forward(device, out, lse,
                  query_rows(static_cast<const float*>(q), ldq, static_cast<const float*>(kv), ldkv,
                             T, NH, KV, hd, rows, keys, docs),
                  B, "attention_gqa_forward_rows (flash)");
}

void flash_attention_forward_rows_bf16_out(int device, void* out, float* lse, const void* q,
                                           int64_t ldq, const void* kv, int64_t ldkv, int64_t B,
                                           int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                           std::span<const cpu::RowRange> rows,
                                           std::span<const cpu::RowRange> keys,
                                           cpu::DocumentStarts docs) {
  flash_forward(device, static_cast<bf16*>(out), lse,
                query_rows(static_cast<const bf16*>(q), ldq, static_cast<const bf16*>(kv), ldkv, T,
                           NH, KV, hd, rows, keys, docs),
                B, "attention_gqa_forward_rows (flash, bf16 q, kv and out)");
}

void flash_attention_backward_rows(int device, float* dq, int64_t lddq, float* dkv,
                                   const float* dout, const void* q, int64_t ldq, const void* kv,
                                   int64_t ldkv, bool bf16_in, const float* lse, const float* D,
                                   int64_t B, int64_t T, int64_t NH, int64_t KV, int64_t hd,
                                   std::span<const cpu::RowRange> rows,
                                   std::span<const cpu::RowRange> keys, cpu::DocumentStarts docs) {
  const auto run = [&](const auto* typed_q, const auto* typed_kv) {
    const auto x = query_rows(typed_q, ldq, typed_kv, ldkv, T, NH, KV, hd, rows, keys, docs);
    flash_backward(device, dq, Strides{lddq, x.rows.Tq * lddq}, dkv, dkv + KV * hd, x.kvs, dout,
                   lse, D, x, B);
  };
  if (bf16_in)
    run(static_cast<const bf16*>(q), static_cast<const bf16*>(kv));
  else
    run(static_cast<const float*>(q), static_cast<const float*>(kv));
}

}  // namespace loom::cuda
