// The steps around the post-training rows on the smem row pieces schedule: a
// top-k teacher's support gathered before it, each row's entropy from its
// pieces' shares after it (summed in piece order: the same bits every run).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/row_terms.h"

namespace lossd {
namespace cuda_ce {
namespace {

// Shapes: piece_entropy [N, pieces], rows_out [N].
__global__ void RowTermsEntropyKernel(const float* piece_entropy,
                                      PostTrainingCudaRow* rows_out,
                                      long long N, int pieces) {
  const long long row =
      blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (row >= N) return;
  float h = 0.0f;
  for (int i = 0; i < pieces; ++i) h += piece_entropy[row * pieces + i];
  rows_out[row].entropy = h;
}

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }

// Shapes: logits x [N, S] (row stride S), indices and support_z [N, k]. z is
// the softcapped logit (cap > 0), computed with the accurate tanhf.
template <typename T>
__global__ void GatherSupportKernel(const T* x, long long S,
                                    const void* indices, bool indices64,
                                    long long N, int k, float cap,
                                    float* support_z) {
  const long long at =
      blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (at >= N * k) return;
  const long long row = at / k;
  const long long c = indices64 ? static_cast<const long long*>(indices)[at]
                                : static_cast<const int*>(indices)[at];
  const float v = ToFloat(x[row * S + c]);
  support_z[at] = cap > 0.0f ? cap * tanhf(v / cap) : v;
}

template <typename T>
cudaError_t Gather(const Params& p, const RowTerms& terms,
                   cudaStream_t stream) {
  const long long total = p.rows * terms.top_k;
  if (total <= 0) return cudaSuccess;
  constexpr int kBlock = 256;
  GatherSupportKernel<T><<<static_cast<unsigned>((total + kBlock - 1) / kBlock),
                           kBlock, 0, stream>>>(
      static_cast<const T*>(p.logits), p.stride, terms.indices, terms.indices64,
      p.rows, terms.top_k, p.softcap, terms.support_z);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchGatherSupport(const Params& p, const RowTerms& terms,
                                DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return Gather<float>(p, terms, stream);
    case DType::kBFloat16:
      return Gather<__nv_bfloat16>(p, terms, stream);
    case DType::kFloat16:
      return Gather<__half>(p, terms, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchRowTermsEntropy(const RowTerms& terms, long long rows,
                                  int pieces, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  constexpr int kBlock = 256;
  RowTermsEntropyKernel<<<static_cast<unsigned>((rows + kBlock - 1) / kBlock),
                          kBlock, 0, stream>>>(terms.piece_entropy,
                                               terms.rows_out, rows, pieces);
  return cudaGetLastError();
}

}  // namespace cuda_ce
}  // namespace lossd
