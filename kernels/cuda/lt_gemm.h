// lossd's wrapper of a cuBLASLt matrix product for the linear
// cross-entropy's chunks: one algorithm chosen per shape when the product is
// built, deterministic reductions only, errors as absl::Status.
#ifndef LOSSD_KERNELS_CUDA_LT_GEMM_H_
#define LOSSD_KERNELS_CUDA_LT_GEMM_H_

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "kernels/cuda/unique_handle.h"

namespace lossd {

// The workspace each product may use (the caller's, per chunk).
constexpr std::size_t kLtWorkspaceBytes = std::size_t{32} << 20;

// A cuBLASLt status as absl::Status (ALLOC_FAILED: RESOURCE_EXHAUSTED).
absl::Status LtStatus(cublasStatus_t status, absl::string_view what);

// The CUDA data type of a floating dtype (fp32 for anything else).
cudaDataType_t LtDataType(DType dtype);

// One cuBLASLt handle per thread and device, made on first use and kept.
absl::StatusOr<cublasLtHandle_t> LtThreadHandle();

// D [m, n] (column-major, ld ldd) = alpha op(A) op(B) + beta C, C = D; the
// algorithm is chosen once, when the product is built, and kept.
class LtGemm {
 public:
  LtGemm() = default;
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // bias: D += bias[i] on D's row i (length m, D's type) in the epilogue,
  // the pointer given to each Run.
  absl::Status Init(cublasLtHandle_t handle, bool trans_a, bool trans_b,
                    int64_t m, int64_t n, int64_t k, cudaDataType_t ab_type,
                    int64_t lda, int64_t ldb, cudaDataType_t d_type,
                    int64_t ldd, const char* what, bool bias = false);

  absl::Status Run(float alpha, const void* a, const void* b, float beta,
                   void* d, void* workspace, cudaStream_t stream,
                   const void* bias = nullptr) const;

 private:
  const char* what_ = "";
  bool bias_ = false;
  cublasLtHandle_t handle_ = nullptr;
  UniqueHandle<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy> op_;
  UniqueHandle<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy> a_, b_, d_;
  cublasLtMatmulHeuristicResult_t heuristic_ = {};
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_LT_GEMM_H_
