// The cuBLASLt product of the linear cross-entropy's chunks (lt_gemm.h).
#include "kernels/cuda/lt_gemm.h"

#include <map>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cross_entropy_cuda_host.h"

namespace lossd {

absl::Status LtStatus(cublasStatus_t status, absl::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  if (status == CUBLAS_STATUS_ALLOC_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("linear_cross_entropy: ", what, ": cuBLASLt alloc"));
  }
  return absl::InternalError(absl::StrCat("linear_cross_entropy: ", what,
                                          ": cuBLASLt status ",
                                          static_cast<int>(status)));
}

cudaDataType_t LtDataType(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return CUDA_R_16BF;
    case DType::kFloat16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

absl::StatusOr<cublasLtHandle_t> LtThreadHandle() {
  thread_local std::map<int, cublasLtHandle_t> handles;
  int device = 0;
  RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "linear: device"));
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  cublasLtHandle_t handle = nullptr;
  RETURN_IF_ERROR(LtStatus(cublasLtCreate(&handle), "create handle"));
  handles[device] = handle;
  return handle;
}

absl::Status LtGemm::Init(cublasLtHandle_t handle, bool trans_a, bool trans_b,
                          int64_t m, int64_t n, int64_t k,
                          cudaDataType_t ab_type, int64_t lda, int64_t ldb,
                          cudaDataType_t d_type, int64_t ldd, const char* what,
                          bool bias) {
  what_ = what;
  handle_ = handle;
  bias_ = bias;
  RETURN_IF_ERROR(LtStatus(
      cublasLtMatmulDescCreate(op_.put(), CUBLAS_COMPUTE_32F, CUDA_R_32F),
      what));
  if (bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    RETURN_IF_ERROR(LtStatus(
        cublasLtMatmulDescSetAttribute(op_.get(), CUBLASLT_MATMUL_DESC_EPILOGUE,
                                       &epilogue, sizeof(epilogue)),
        what));
    // The heuristic reads only the pointer's alignment: Run passes
    // workspace addresses, 256-byte aligned.
    const void* aligned = reinterpret_cast<const void*>(uintptr_t{256});
    RETURN_IF_ERROR(LtStatus(cublasLtMatmulDescSetAttribute(
                                 op_.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                 &aligned, sizeof(aligned)),
                             what));
  }
  const cublasOperation_t ta = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  RETURN_IF_ERROR(
      LtStatus(cublasLtMatmulDescSetAttribute(
                   op_.get(), CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
               what));
  RETURN_IF_ERROR(
      LtStatus(cublasLtMatmulDescSetAttribute(
                   op_.get(), CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
               what));
  RETURN_IF_ERROR(
      LtStatus(cublasLtMatrixLayoutCreate(a_.put(), ab_type, trans_a ? k : m,
                                          trans_a ? m : k, lda),
               what));
  RETURN_IF_ERROR(
      LtStatus(cublasLtMatrixLayoutCreate(b_.put(), ab_type, trans_b ? n : k,
                                          trans_b ? k : n, ldb),
               what));
  RETURN_IF_ERROR(
      LtStatus(cublasLtMatrixLayoutCreate(d_.put(), d_type, m, n, ldd), what));
  UniqueHandle<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>
      preference;
  RETURN_IF_ERROR(
      LtStatus(cublasLtMatmulPreferenceCreate(preference.put()), what));
  const std::size_t workspace = kLtWorkspaceBytes;
  // Split-K only where its partial sums are reduced by a separate pass in a
  // fixed order; in-place (atomic) reductions would change bits run to run.
  const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE |
                           CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
                           CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
  cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
      preference.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
      sizeof(workspace));
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulPreferenceSetAttribute(
        preference.get(), CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes,
        sizeof(schemes));
  }
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(
        handle, op_.get(), a_.get(), b_.get(), d_.get(), d_.get(),
        preference.get(), 1, &heuristic_, &found);
  }
  RETURN_IF_ERROR(LtStatus(status, what));
  if (found == 0) {
    return absl::InternalError(
        absl::StrCat("linear_cross_entropy: no cuBLASLt algorithm for ", what));
  }
  return absl::OkStatus();
}

absl::Status LtGemm::Run(float alpha, const void* a, const void* b, float beta,
                         void* d, void* workspace, cudaStream_t stream,
                         const void* bias) const {
  if (bias_) {
    // The descriptor is read when the product is enqueued, and a thread's
    // products are its own (CachedGemms), so setting it here is safe.
    RETURN_IF_ERROR(LtStatus(
        cublasLtMatmulDescSetAttribute(
            op_.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)),
        what_));
  }
  return LtStatus(
      cublasLtMatmul(handle_, op_.get(), &alpha, a, a_.get(), b, b_.get(),
                     &beta, d, d_.get(), d, d_.get(), &heuristic_.algo,
                     workspace, kLtWorkspaceBytes, stream),
      what_);
}

}  // namespace lossd
