// cblas_sgemm resolved from OpenBLAS on first use (dlopen, RTLD_LOCAL)
// instead of linked: a linked OpenBLAS puts its thread-local storage (60 KiB)
// into every thread's static TLS, which leaves the metrics server's civetweb
// threads (100 KiB stacks) too little stack to format a scrape. Loaded later,
// the storage is dynamic and costs only the threads that call it. Without the
// library a plain loop computes the same product, slowly.
#include <cblas.h>
#include <dlfcn.h>

#include <cstdint>

namespace {

using Sgemm = decltype(&::cblas_sgemm);

Sgemm OpenBlasSgemm() {
  static const Sgemm sgemm = [] {
    void* library = dlopen(LOSSD_OPENBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
    return library == nullptr
               ? nullptr
               : reinterpret_cast<Sgemm>(dlsym(library, "cblas_sgemm"));
  }();
  return sgemm;
}

// C = alpha op(A) op(B) + beta C, row-major, fp64 accumulation.
void LoopSgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
               float alpha, const float* a, int64_t lda, const float* b,
               int64_t ldb, float beta, float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0.0;
      for (int64_t p = 0; p < k; ++p) {
        const float x = trans_a ? a[p * lda + i] : a[i * lda + p];
        const float y = trans_b ? b[j * ldb + p] : b[p * ldb + j];
        sum += static_cast<double>(x) * y;
      }
      float& out = c[i * ldc + j];
      out = static_cast<float>(alpha * sum + (beta == 0.0f ? 0.0 : beta * out));
    }
  }
}

}  // namespace

extern "C" void cblas_sgemm(OPENBLAS_CONST enum CBLAS_ORDER order,
                            OPENBLAS_CONST enum CBLAS_TRANSPOSE trans_a,
                            OPENBLAS_CONST enum CBLAS_TRANSPOSE trans_b,
                            OPENBLAS_CONST blasint m, OPENBLAS_CONST blasint n,
                            OPENBLAS_CONST blasint k,
                            OPENBLAS_CONST float alpha, OPENBLAS_CONST float* a,
                            OPENBLAS_CONST blasint lda, OPENBLAS_CONST float* b,
                            OPENBLAS_CONST blasint ldb,
                            OPENBLAS_CONST float beta, float* c,
                            OPENBLAS_CONST blasint ldc) {
  if (const Sgemm sgemm = OpenBlasSgemm(); sgemm != nullptr) {
    sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c,
          ldc);
    return;
  }
  const bool ta = trans_a != CblasNoTrans;
  const bool tb = trans_b != CblasNoTrans;
  if (order == CblasRowMajor) {
    LoopSgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    // Column-major C is row-major C^T = op(B)^T op(A)^T.
    LoopSgemm(tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
  }
}
