// The benches' checks of CUDA and cuBLAS(Lt) calls: a bench that hits an
// error prints where and stops, rather than timing a failed launch.
#ifndef LOSSD_BENCH_CUDA_CHECK_H_
#define LOSSD_BENCH_CUDA_CHECK_H_

#include <cuda_runtime.h>
#include <library_types.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(expr)                                                 \
  do {                                                                   \
    const cudaError_t e_ = (expr);                                       \
    if (e_ != cudaSuccess) {                                             \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, \
                   cudaGetErrorString(e_));                              \
      std::abort();                                                      \
    }                                                                    \
  } while (0)

// For cuBLAS and cuBLASLt calls (cublasStatus_t; include their header first).
#define CHECK_CUBLAS(expr)                                            \
  do {                                                                \
    const auto s_ = (expr);                                           \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                \
      std::fprintf(stderr, "%s:%d: %s: cuBLAS status %d\n", __FILE__, \
                   __LINE__, #expr, static_cast<int>(s_));            \
      std::abort();                                                   \
    }                                                                 \
  } while (0)

#endif  // LOSSD_BENCH_CUDA_CHECK_H_
