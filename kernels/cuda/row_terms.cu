// The last step of the post-training rows on the smem row pieces schedule:
// each row's entropy from its pieces' shares, summed in piece order so that
// every run gives the same bits.
#include <cuda_runtime.h>

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

}  // namespace

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
