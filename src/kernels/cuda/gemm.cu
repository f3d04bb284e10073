// GEMMs through cuBLASLt (matmul.cu holds the Linear layer on them; gemm_emulated.cu replaces this
// file under the CUDA emulator).
//
// cuBLASLt is column-major; Loom is row-major. A row-major M×N matrix with row stride ld is the
// column-major N×M matrix with leading dimension ld, its transpose. So C = op(A)·op(B), row-major,
// is computed as the column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: B and A swap places, and keep their
// transposition flags. The bias epilogue adds a vector along the rows of the column-major D,
// which are the columns of the row-major C: exactly Linear's bias.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "base/error.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace loom::cuda {
namespace {

#define LOOM_CUBLAS_CHECK(expr)                                                                    \
  do {                                                                                             \
    const cublasStatus_t loom_status_ = (expr);                                                    \
    if (loom_status_ != CUBLAS_STATUS_SUCCESS)                                                     \
      fail(__FILE__, ":", __LINE__, ": ", #expr, " failed: ", cublasLtGetStatusName(loom_status_), \
           ": ", cublasLtGetStatusString(loom_status_));                                           \
  } while (0)

// One cuBLASLt handle and workspace per GPU, made on first use and kept for the process. Shared
// by the threads that use the GPU: their GEMMs all run on its legacy stream, one after another,
// so they never use the workspace at the same time.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // what cuBLAS asks for on Hopper

// The cuBLASLt heuristic's choice for one problem: its shapes, types, transpositions, epilogue
// and operand alignments. The heuristic costs tens of microseconds of host time per call, and a
// training step runs the same few dozen problems every time.
using AlgoKey = std::array<int64_t, 21>;

template <typename... Field>
AlgoKey algo_key(Field... field) {
  return {static_cast<int64_t>(field)...};
}

// What the heuristic said for a problem; `found` false: cuBLASLt has no algorithm for it (asked
// once; a GELU epilogue then runs apart).
struct AlgoChoice {
  bool found = false;
  cublasLtMatmulAlgo_t algo{};
};

struct GpuBlas {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::mutex algos_mutex;  // ranks sharing a GPU (local backend) share its choices
  std::map<AlgoKey, AlgoChoice> algos;
};

GpuBlas& blas_for(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, GpuBlas> per_gpu;  // never destroyed: see CachingCudaAllocator
  std::lock_guard<std::mutex> lock(mutex);
  GpuBlas& b = per_gpu[device];
  if (b.handle == nullptr) {
    LOOM_CUBLAS_CHECK(cublasLtCreate(&b.handle));
    LOOM_CUDA_CHECK(cudaMalloc(&b.workspace, kWorkspaceBytes));
  }
  return b;
}

// RAII owners of the cuBLASLt descriptors of one call.
struct Layout {
  cublasLtMatrixLayout_t layout = nullptr;
  Layout(cudaDataType type, uint64_t rows, uint64_t cols, int64_t ld, int64_t batch,
         int64_t stride) {
    LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld));
    if (batch > 1) {
      const int32_t count = static_cast<int32_t>(batch);
      LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                         &count, sizeof count));
      LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
          layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
    }
  }
  ~Layout() { (void)cublasLtMatrixLayoutDestroy(layout); }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
};

struct MatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  explicit MatmulDesc(cublasComputeType_t compute) {
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, compute, CUDA_R_32F));
  }
  ~MatmulDesc() { (void)cublasLtMatmulDescDestroy(desc); }
  MatmulDesc(const MatmulDesc&) = delete;
  MatmulDesc& operator=(const MatmulDesc&) = delete;
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attribute, const T& value) {
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof value));
  }
};

// The largest power of two up to 256 dividing a pointer and its batch stride in bytes: what a
// kernel may assume. cuBLASLt's heuristic assumes 256 unless told, and views into flat buffers
// (parameters, micro-batches) are often less aligned.
uint32_t alignment(const void* ptr, int64_t stride_bytes) {
  const auto addr = reinterpret_cast<uintptr_t>(ptr);
  uint32_t a = 256;
  while (a > 1 && (addr % a != 0 || stride_bytes % a != 0)) a /= 2;
  return a;
}

struct Preference {
  cublasLtMatmulPreference_t pref = nullptr;
  Preference(uint32_t align_a, uint32_t align_b, uint32_t align_c) {
    LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t bytes = kWorkspaceBytes;
    LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof bytes));
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c);
  }
  void set(cublasLtMatmulPreferenceAttributes_t attribute, uint32_t value) {
    LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &value, sizeof value));
  }
  ~Preference() { (void)cublasLtMatmulPreferenceDestroy(pref); }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
};

// The elements a row-major operand spans in memory: `rows` rows `ld` apart, `count` of them
// `stride` apart.
int64_t span(int64_t rows, int64_t cols, int64_t ld, int64_t count, int64_t stride) {
  return (count - 1) * stride + (rows - 1) * ld + cols;
}

// Element i's pseudo-random bits under `seed`, for the rate measurements' operands (zeros would
// flatter the tensor cores' power draw).
__device__ inline uint32_t fill_hash(int64_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return h;
}

// Deterministic pseudo-random values in [-1, 1) (bf16 or fp32).
template <typename T>
__global__ void fill_kernel(T* out, int64_t n, uint32_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)
    out[i] = T(static_cast<float>(fill_hash(i, seed) >> 8) / 8388608.0f - 1.0f);
}

// A GELU in lt_matmul's epilogue: forward (GELU_AUX, GELU_AUX_BIAS with a bias), D = GELU(the
// sum) and `aux` the sum; or backward (DGELU), D = GELU'(aux) ⊙ the product. aux has D's type and
// layout.
struct GeluEpilogue {
  bool backward = false;
  const void* aux = nullptr;
};

// The heuristic's algorithm for `key` (D's layout is C's), asked once per problem and kept.
AlgoChoice choose_algo(GpuBlas& blas, const AlgoKey& key, const MatmulDesc& desc,
                       const Layout& a_layout, const Layout& b_layout, const Layout& c_layout,
                       uint32_t align_a, uint32_t align_b, uint32_t align_c) {
  {
    std::lock_guard<std::mutex> lock(blas.algos_mutex);
    if (const auto it = blas.algos.find(key); it != blas.algos.end()) return it->second;
  }
  AlgoChoice choice;
  const Preference preference(align_a, align_b, align_c);
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      blas.handle, desc.desc, a_layout.layout, b_layout.layout, c_layout.layout, c_layout.layout,
      preference.pref, 1, &heuristic, &found);
  // An epilogue or a scale mode this cuBLASLt does not offer is NOT_SUPPORTED, not an error.
  if (status != CUBLAS_STATUS_NOT_SUPPORTED) LOOM_CUBLAS_CHECK(status);
  if (status == CUBLAS_STATUS_SUCCESS && found > 0) choice = {true, heuristic.algo};
  std::lock_guard<std::mutex> lock(blas.algos_mutex);
  blas.algos.emplace(key, choice);
  return choice;
}

// Row-major D = alpha·op(A)·op(B) + beta·C (+ bias) through cuBLASLt, A and B of `ab_type`
// (fp32, bf16 or fp16), C and D of `cd_type` (fp32, or A and B's 16-bit type) with the same
// layout; C may be D itself (in place). Accumulation in fp32. The bias is fp32, or of `cd_type`
// for a 16-bit D (cuBLASLt's bias takes D's type there). With a `gelu` epilogue, returns false
// (and computes nothing) where cuBLASLt has no algorithm for it; without, that fails.
bool lt_matmul(int device, cublasComputeType_t compute, cudaDataType ab_type, bool trans_a,
               bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
               int64_t lda, const void* B, int64_t ldb, float beta, const void* C, void* D,
               int64_t ldc, const void* bias, GemmBatch batch, cudaDataType cd_type = CUDA_R_32F,
               const GeluEpilogue* gelu = nullptr) {
  GpuBlas& blas = blas_for(device);
  // Column-major problem: D (m×n) = op(A')·op(B'), A' = B, B' = A.
  const int64_t m = N, n = M, k = K;
  const cublasOperation_t op_a = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  // A stored column-major matrix is what op() is applied to: (m×k) when not transposed, else (k×m).
  const Layout a_layout(ab_type, op_a == CUBLAS_OP_N ? m : k, op_a == CUBLAS_OP_N ? k : m, ldb,
                        batch.count, batch.stride_b);
  const Layout b_layout(ab_type, op_b == CUBLAS_OP_N ? k : n, op_b == CUBLAS_OP_N ? n : k, lda,
                        batch.count, batch.stride_a);
  const Layout c_layout(cd_type, m, n, ldc, batch.count, batch.stride_c);

  MatmulDesc desc(compute);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, op_a);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, op_b);
  if ((bias != nullptr || gelu != nullptr) && batch.count > 1)
    fail("cuda::gemm: an epilogue (bias, GELU) is supported on unbatched GEMMs only");
  cublasLtEpilogue_t epilogue =
      bias != nullptr ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  if (gelu != nullptr) {
    if (gelu->backward && bias != nullptr) fail("cuda::gemm: DGELU takes no bias");
    epilogue = gelu->backward    ? CUBLASLT_EPILOGUE_DGELU
               : bias != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS
                                 : CUBLASLT_EPILOGUE_GELU_AUX;
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, gelu->aux);
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ldc);
  }
  if (epilogue != CUBLASLT_EPILOGUE_DEFAULT) desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  if (bias != nullptr) {
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, cd_type);
  }

  // In cuBLASLt's terms A is our B and B our A (see above).
  const size_t element = ab_type == CUDA_R_32F ? 4 : 2;
  const int64_t strided = batch.count > 1 ? 1 : 0;
  const uint32_t align_a = alignment(B, strided * batch.stride_b * static_cast<int64_t>(element));
  const uint32_t align_b = alignment(A, strided * batch.stride_a * static_cast<int64_t>(element));
  const int64_t cd_element = cd_type == CUDA_R_32F ? 4 : 2;
  uint32_t align_c = std::min(alignment(C, strided * batch.stride_c * cd_element),
                              alignment(D, strided * batch.stride_c * cd_element));
  // cuBLASLt's preference has no alignment for the GELU's aux matrix: it is counted with C and D.
  if (gelu != nullptr) align_c = std::min(align_c, alignment(gelu->aux, 0));
  const AlgoKey key =
      algo_key(compute, ab_type, op_a, op_b, m, n, k, lda, ldb, ldc, batch.count, batch.stride_a,
               batch.stride_b, batch.stride_c, bias != nullptr ? 1 + cd_type : 0, align_a, align_b,
               align_c, beta != 0.0f, cd_type, epilogue);
  const AlgoChoice choice =
      choose_algo(blas, key, desc, a_layout, b_layout, c_layout, align_a, align_b, align_c);
  if (!choice.found) {
    if (gelu != nullptr) return false;
    fail("cuda::gemm: cuBLASLt has no algorithm for M=", M, " N=", N, " K=", K,
         " trans_a=", trans_a, " trans_b=", trans_b, " batch=", batch.count);
  }
  // Column-major operands: A' is the row-major B, B' the row-major A.
  const cublasStatus_t status = cublasLtMatmul(
      blas.handle, desc.desc, &alpha, B, a_layout.layout, A, b_layout.layout, &beta, C,
      c_layout.layout, D, c_layout.layout, &choice.algo, blas.workspace, kWorkspaceBytes, nullptr);
  if (status != CUBLAS_STATUS_SUCCESS && gelu != nullptr) {
    // cuBLASLt checks its arguments before it launches anything: a GELU epilogue it refuses
    // here (an aux constraint its heuristic did not apply) runs apart from now on.
    std::fprintf(stderr,
                 "loom: cuBLASLt refused the GELU epilogue (%s) for M=%ld N=%ld K=%ld: the GELU "
                 "runs in its own pass\n",
                 cublasLtGetStatusName(status), static_cast<long>(M), static_cast<long>(N),
                 static_cast<long>(K));
    std::lock_guard<std::mutex> lock(blas.algos_mutex);
    blas.algos[key].found = false;
    return false;
  }
  LOOM_CUBLAS_CHECK(status);
  check_launch("cublasLtMatmul");
  return true;
}

// C = op(A)·op(B) with both operands in the 16-bit type of `precision` (bf16 or fp16): those not
// rounded yet are rounded here, each over its whole span (gaps between rows included); fp32
// accumulation, output in fp32 or, `rounded_output`, in that 16-bit type too, with the bias
// (N values) then rounded to it. A `gelu` epilogue needs rounded_output; false where cuBLASLt has
// no algorithm for it.
bool half_gemm(int device, MatmulPrecision precision, bool trans_a, bool trans_b, int64_t M,
               int64_t N, int64_t K, float alpha, GemmOperand A, int64_t lda, GemmOperand B,
               int64_t ldb, float beta, const void* C, void* D, int64_t ldc, const float* bias,
               GemmBatch batch, bool rounded_output = false, const GeluEpilogue* gelu = nullptr) {
  const cudaDataType type = precision == MatmulPrecision::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
  const int64_t a_span = span(trans_a ? K : M, trans_a ? M : K, lda, batch.count, batch.stride_a);
  const int64_t b_span = span(trans_b ? N : K, trans_b ? K : N, ldb, batch.count, batch.stride_b);
  std::optional<RoundedOperand> a16, b16;
  if (A.rounded_to != precision) a16.emplace(device, static_cast<const float*>(A.data), a_span);
  if (B.rounded_to != precision) b16.emplace(device, static_cast<const float*>(B.data), b_span);
  std::optional<RoundedOperand> bias16;
  if (rounded_output && bias != nullptr) bias16.emplace(device, bias, N);
  return lt_matmul(device, CUBLAS_COMPUTE_32F, type, trans_a, trans_b, M, N, K, alpha,
                   a16 ? a16->operand().data : A.data, lda, b16 ? b16->operand().data : B.data, ldb,
                   beta, C, D, ldc, bias16 ? bias16->operand().data : bias, batch,
                   rounded_output ? type : CUDA_R_32F, gelu);
}

// gemm and gemm_adding: D = alpha·op(A)·op(B) + beta·C (+ bias) at the process's precision.
void gemm_at_precision(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                       float alpha, GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb,
                       float beta, const float* C, float* D, int64_t ldc, const float* bias,
                       GemmBatch batch) {
  if (M < 0 || N < 0 || K < 0 || batch.count < 1)
    fail("cuda::gemm: bad sizes M=", M, " N=", N, " K=", K, " batch=", batch.count);
  if (M == 0 || N == 0) return;
  if (K == 0) fail("cuda::gemm: K = 0 is not supported (M=", M, " N=", N, ")");
  const MatmulPrecision precision = matmul_precision();
  A.expect_usable_at(precision, "A");
  B.expect_usable_at(precision, "B");
  DeviceGuard guard(device);
  switch (precision) {
    case MatmulPrecision::kBf16:
    case MatmulPrecision::kFp16:
      half_gemm(device, precision, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, D,
                ldc, bias, batch);
      return;
    case MatmulPrecision::kTf32:
      lt_matmul(device, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F, trans_a, trans_b, M, N, K, alpha,
                A.data, lda, B.data, ldb, beta, C, D, ldc, bias, batch);
      return;
    case MatmulPrecision::kFp32:
      lt_matmul(device, CUBLAS_COMPUTE_32F, CUDA_R_32F, trans_a, trans_b, M, N, K, alpha, A.data,
                lda, B.data, ldb, beta, C, D, ldc, bias, batch);
      return;
  }
}

}  // namespace

void gemm(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
          GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb, float beta, float* C, int64_t ldc,
          const float* bias, GemmBatch batch) {
  gemm_at_precision(device, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, C, ldc, bias,
                    batch);
}

void gemm_adding(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                 GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb, const float* addend,
                 float* D, int64_t ldd, const float* bias) {
  gemm_at_precision(device, trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, 1.0f, addend, D, ldd,
                    bias, GemmBatch{});
}

GemmOperand gemm_rounded_output(int device, bool trans_a, bool trans_b, int64_t M, int64_t N,
                                int64_t K, GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb,
                                void* C, int64_t ldc, const float* bias) {
  const MatmulPrecision precision = check_rounded_output_gemm(M, N, K, A, B);
  DeviceGuard guard(device);
  if (M > 0 && N > 0)
    half_gemm(device, precision, trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, C, C, ldc,
              bias, GemmBatch{}, /*rounded_output=*/true);
  return GemmOperand(C, precision);
}

namespace {
// gemm_gelu and gemm_gelu_backward: D (16-bit, row stride N) with `gelu` in the epilogue.
bool gemm_with_gelu(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                    GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb, void* D,
                    const float* bias, GeluEpilogue gelu) {
  const MatmulPrecision precision = check_rounded_output_gemm(M, N, K, A, B);
  DeviceGuard guard(device);
  if (M == 0 || N == 0) return true;
  return half_gemm(device, precision, trans_a, trans_b, M, N, K, 1.0f, A, lda, B, ldb, 0.0f, D, D,
                   N, bias, GemmBatch{}, /*rounded_output=*/true, &gelu);
}
}  // namespace

bool gemm_gelu(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
               GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb, void* D, void* pre,
               const float* bias) {
  return gemm_with_gelu(device, trans_a, trans_b, M, N, K, A, lda, B, ldb, D, bias,
                        GeluEpilogue{false, pre});
}

bool gemm_gelu_backward(int device, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                        GemmOperand A, int64_t lda, GemmOperand B, int64_t ldb, void* D,
                        const void* pre) {
  return gemm_with_gelu(device, trans_a, trans_b, M, N, K, A, lda, B, ldb, D, nullptr,
                        GeluEpilogue{true, pre});
}

void gemm_fp8(int device, int64_t M, int64_t N, int64_t K, const Fp8Operand& A, const Fp8Operand& B,
              float* C) {
  expect_fp8_gemm_shapes(M, N, K, A);
  if (M == 0 || N == 0) return;
  DeviceGuard guard(device);
  GpuBlas& blas = blas_for(device);
  // Column-major, as lt_matmul: D (N × M) = op(A')·op(B') with A' our B (stored K × N, op T) and
  // B' our A (stored K × M): the "TN" form Hopper's fp8 tensor cores take, K contiguous in both.
  const int64_t m = N, n = M, k = K;
  const Layout a_layout(CUDA_R_8F_E4M3, k, m, K, 1, 0);
  const Layout b_layout(CUDA_R_8F_E4M3, k, n, K, 1, 0);
  const Layout c_layout(CUDA_R_32F, m, n, N, 1, 0);
  MatmulDesc desc(CUBLAS_COMPUTE_32F);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  const int32_t a_mode = B.scaling == Fp8Scaling::kBlock128
                             ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                             : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, a_mode);
  desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, b_mode);
  desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(B.scales));
  desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(A.scales));
  const int8_t fast_accumulation = 0;  // sums kept in fp32, not the tensor cores' shorter ones
  desc.set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast_accumulation);
  const uint32_t align_a = alignment(B.data, 0), align_b = alignment(A.data, 0),
                 align_c = alignment(C, 0);
  const AlgoKey key = algo_key(CUBLAS_COMPUTE_32F, CUDA_R_8F_E4M3, CUBLAS_OP_T, CUBLAS_OP_N, m, n,
                               k, a_mode, b_mode, align_a, align_b, align_c, -8);
  const AlgoChoice choice =
      choose_algo(blas, key, desc, a_layout, b_layout, c_layout, align_a, align_b, align_c);
  if (!choice.found)
    fail("cuda::gemm_fp8: cuBLASLt has no block-scaled E4M3 algorithm for M=", M, " N=", N,
         " K=", K, " (it needs CUDA 12.9+ and an sm_90 GPU)");
  const float alpha = 1.0f, beta = 0.0f;
  LOOM_CUBLAS_CHECK(cublasLtMatmul(blas.handle, desc.desc, &alpha, B.data, a_layout.layout, A.data,
                                   b_layout.layout, &beta, C, c_layout.layout, C, c_layout.layout,
                                   &choice.algo, blas.workspace, kWorkspaceBytes, nullptr));
  check_launch("cublasLtMatmul (fp8)");
}

namespace {

// TFLOP/s of the best of `iters` timed runs of `gemm`, an n×n×n product, after one warm-up.
template <typename Gemm>
double best_square_tflops(int64_t n, int iters, Gemm gemm) {
  cudaEvent_t start = nullptr, stop = nullptr;
  LOOM_CUDA_CHECK(cudaEventCreate(&start));
  LOOM_CUDA_CHECK(cudaEventCreate(&stop));
  float best_ms = 0;
  for (int i = 0; i <= iters; ++i) {  // i == 0: warm-up
    LOOM_CUDA_CHECK(cudaEventRecord(start, nullptr));
    gemm();
    LOOM_CUDA_CHECK(cudaEventRecord(stop, nullptr));
    LOOM_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (i > 0 && (best_ms == 0 || ms < best_ms)) best_ms = ms;
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  return 2.0 * static_cast<double>(n) * n * n / (best_ms * 1e-3) / 1e12;
}

// The best of `iters` timed n×n×n GEMMs on operands of type T (`type`), after one warm-up.
template <typename T>
double time_square_gemm(int device, cublasComputeType_t compute, cudaDataType type, int64_t n,
                        int iters) {
  Scratch<float> c(device, n * n);
  Scratch<T> a(device, n * n), b(device, n * n);
  launch("measure_gemm_tflops (fill)", fill_kernel<T>, blocks_for(n * n, 256), 256, a.get(), n * n,
         1u);
  launch("measure_gemm_tflops (fill)", fill_kernel<T>, blocks_for(n * n, 256), 256, b.get(), n * n,
         2u);
  return best_square_tflops(n, iters, [&] {
    lt_matmul(device, compute, type, false, false, n, n, n, 1.0f, a.get(), n, b.get(), n, 0.0f,
              c.get(), c.get(), n, nullptr, GemmBatch{});
  });
}

// Deterministic E4M3 bytes, none a NaN (the exponent field's low bit cleared: at most 14).
__global__ void fill_e4m3_kernel(uint8_t* out, int64_t n, uint32_t seed) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)
    out[i] = static_cast<uint8_t>((fill_hash(i, seed) >> 8) & 0xF7u);
}

}  // namespace

double measure_fp8_gemm_tflops(int device, int64_t n, int iters) {
  if (n < 1 || iters < 1 || n % 128 != 0)
    fail("measure_fp8_gemm_tflops: n a positive multiple of 128 and iters positive");
  DeviceGuard guard(device);
  Scratch<uint8_t> a(device, n * n), b(device, n * n);
  const int64_t a_scales = fp8_scale_count(n, n, Fp8Scaling::kVec128),
                b_scales = fp8_scale_count(n, n, Fp8Scaling::kBlock128);
  Scratch<float> sa(device, a_scales), sb(device, b_scales), c(device, n * n);
  launch("measure_fp8_gemm_tflops (fill)", fill_e4m3_kernel, blocks_for(n * n, 256), 256, a.get(),
         n * n, 1u);
  launch("measure_fp8_gemm_tflops (fill)", fill_e4m3_kernel, blocks_for(n * n, 256), 256, b.get(),
         n * n, 2u);
  launch("measure_fp8_gemm_tflops (fill)", fill_kernel<float>, blocks_for(a_scales, 256), 256,
         sa.get(), a_scales, 3u);
  launch("measure_fp8_gemm_tflops (fill)", fill_kernel<float>, blocks_for(b_scales, 256), 256,
         sb.get(), b_scales, 4u);
  // DeepSeek-V3's forward: activations in 1 × 128 blocks, weights in 128 × 128.
  const Fp8Operand A{a.get(), sa.get(), Fp8Scaling::kVec128},
      B{b.get(), sb.get(), Fp8Scaling::kBlock128};
  return best_square_tflops(n, iters, [&] { gemm_fp8(device, n, n, n, A, B, c.get()); });
}

double measure_gemm_tflops(int device, MatmulPrecision precision, int64_t n, int iters) {
  if (n < 1 || iters < 1) fail("measure_gemm_tflops: n and iters must be positive");
  DeviceGuard guard(device);
  switch (precision) {
    case MatmulPrecision::kBf16:
      return time_square_gemm<__nv_bfloat16>(device, CUBLAS_COMPUTE_32F, CUDA_R_16BF, n, iters);
    case MatmulPrecision::kFp16:
      return time_square_gemm<__half>(device, CUBLAS_COMPUTE_32F, CUDA_R_16F, n, iters);
    case MatmulPrecision::kTf32:
      return time_square_gemm<float>(device, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F, n, iters);
    case MatmulPrecision::kFp32:
      break;
  }
  return time_square_gemm<float>(device, CUBLAS_COMPUTE_32F, CUDA_R_32F, n, iters);
}

}  // namespace loom::cuda
