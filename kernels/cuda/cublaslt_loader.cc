// The cuBLASLt functions the linear cross-entropy calls, resolved from the
// library on first use (dlopen, RTLD_LOCAL) instead of linked: a library
// linked into the process puts its thread-local storage (cuBLASLt's: ~94 KiB)
// into every thread's static TLS, and then a thread created with a small
// stack fails (the metrics server's civetweb threads get 100 KiB:
// pthread_create returns EINVAL, and lossd could not serve /metrics). Loaded
// later, the storage is dynamic and costs only the threads that call it.
#include <cublasLt.h>
#include <dlfcn.h>

namespace {

void* CublasLt() {
  static void* const library =
      dlopen(LOSSD_CUBLASLT_SONAME, RTLD_NOW | RTLD_LOCAL);
  return library;
}

template <typename Function>
Function Resolve(const char* name) {
  void* library = CublasLt();
  return library == nullptr ? nullptr
                            : reinterpret_cast<Function>(dlsym(library, name));
}

}  // namespace

// Each forwards to the library's own function; CUBLAS_STATUS_NOT_INITIALIZED
// when the library or the symbol cannot be found.
#define LOSSD_CUBLASLT_FORWARD(name, parameters, arguments)                  \
  extern "C" cublasStatus_t CUBLASWINAPI name parameters {                   \
    static const auto real = Resolve<decltype(&::name)>(#name);              \
    return real == nullptr ? CUBLAS_STATUS_NOT_INITIALIZED : real arguments; \
  }

LOSSD_CUBLASLT_FORWARD(cublasLtCreate, (cublasLtHandle_t * handle), (handle))
LOSSD_CUBLASLT_FORWARD(
    cublasLtMatmul,
    (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
     const void* a, cublasLtMatrixLayout_t a_desc, const void* b,
     cublasLtMatrixLayout_t b_desc, const void* beta, const void* c,
     cublasLtMatrixLayout_t c_desc, void* d, cublasLtMatrixLayout_t d_desc,
     const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspace_bytes,
     cudaStream_t stream),
    (handle, desc, alpha, a, a_desc, b, b_desc, beta, c, c_desc, d, d_desc,
     algo, workspace, workspace_bytes, stream))
LOSSD_CUBLASLT_FORWARD(
    cublasLtMatmulAlgoGetHeuristic,
    (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
     cublasLtMatrixLayout_t a_desc, cublasLtMatrixLayout_t b_desc,
     cublasLtMatrixLayout_t c_desc, cublasLtMatrixLayout_t d_desc,
     cublasLtMatmulPreference_t preference, int requested,
     cublasLtMatmulHeuristicResult_t results[], int* returned),
    (handle, desc, a_desc, b_desc, c_desc, d_desc, preference, requested,
     results, returned))
LOSSD_CUBLASLT_FORWARD(cublasLtMatmulDescCreate,
                       (cublasLtMatmulDesc_t * desc,
                        cublasComputeType_t compute, cudaDataType_t scale),
                       (desc, compute, scale))
LOSSD_CUBLASLT_FORWARD(cublasLtMatmulDescDestroy, (cublasLtMatmulDesc_t desc),
                       (desc))
LOSSD_CUBLASLT_FORWARD(cublasLtMatmulDescSetAttribute,
                       (cublasLtMatmulDesc_t desc,
                        cublasLtMatmulDescAttributes_t attribute,
                        const void* buffer, size_t bytes),
                       (desc, attribute, buffer, bytes))
LOSSD_CUBLASLT_FORWARD(cublasLtMatmulPreferenceCreate,
                       (cublasLtMatmulPreference_t * preference), (preference))
LOSSD_CUBLASLT_FORWARD(cublasLtMatmulPreferenceDestroy,
                       (cublasLtMatmulPreference_t preference), (preference))
LOSSD_CUBLASLT_FORWARD(cublasLtMatmulPreferenceSetAttribute,
                       (cublasLtMatmulPreference_t preference,
                        cublasLtMatmulPreferenceAttributes_t attribute,
                        const void* buffer, size_t bytes),
                       (preference, attribute, buffer, bytes))
LOSSD_CUBLASLT_FORWARD(cublasLtMatrixLayoutCreate,
                       (cublasLtMatrixLayout_t * layout, cudaDataType type,
                        uint64_t rows, uint64_t cols, int64_t ld),
                       (layout, type, rows, cols, ld))
LOSSD_CUBLASLT_FORWARD(cublasLtMatrixLayoutDestroy,
                       (cublasLtMatrixLayout_t layout), (layout))

#undef LOSSD_CUBLASLT_FORWARD
