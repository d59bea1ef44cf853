// The sparse residual's sort and apply (sparse_residual.h). The records of a
// chunk are a few per row, so both steps are small next to the chunk's
// products; the sort is CUB's radix sort, which is stable and deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/align_up.h"
#include "kernels/cuda/sparse_residual.h"

namespace lossd {
namespace {

constexpr int kThreads = 256;

// The sort's parts after the slots.
struct SortParts {
  std::size_t keys_in, keys_out, values_in, values_out, temp, temp_bytes, total;
};

// Keys are v * rows + r; the invalid key, rows * vocab, sorts last.
int KeyBits(int64_t rows, int64_t vocab) {
  const uint64_t invalid =
      static_cast<uint64_t>(rows) * static_cast<uint64_t>(vocab);
  int bits = 1;
  while (bits < 64 && (invalid >> bits) != 0) ++bits;
  return bits;
}

std::size_t SlotsBytes(int64_t rows, int slots) {
  const std::size_t n = static_cast<std::size_t>(rows) * slots;
  return AlignUp(rows * sizeof(int)) + AlignUp(n * sizeof(int)) +
         AlignUp(n * sizeof(float));
}

SortParts MakeSortParts(int64_t rows, int slots, int64_t vocab) {
  const std::size_t n = static_cast<std::size_t>(rows) * slots;
  SortParts p;
  std::size_t at = SlotsBytes(rows, slots);
  p.keys_in = at;
  at += AlignUp(n * sizeof(uint64_t));
  p.keys_out = at;
  at += AlignUp(n * sizeof(uint64_t));
  p.values_in = at;
  at += AlignUp(n * sizeof(int));
  p.values_out = at;
  at += AlignUp(n * sizeof(int));
  p.temp = at;
  p.temp_bytes = 0;
  // A size query: no launch, no memory touched.
  cub::DeviceRadixSort::SortPairs(
      nullptr, p.temp_bytes, static_cast<const uint64_t*>(nullptr),
      static_cast<uint64_t*>(nullptr), static_cast<const int*>(nullptr),
      static_cast<int*>(nullptr), static_cast<int64_t>(n), 0,
      KeyBits(rows, vocab));
  at += AlignUp(p.temp_bytes);
  p.total = at;
  return p;
}

__global__ void ResetKernel(int* row_count, int64_t rows) {
  for (int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; r < rows;
       r += int64_t{gridDim.x} * blockDim.x)
    row_count[r] = 0;
}

// One key per slot: a kept record's (v, r), else the invalid key. A row
// that claimed more slots than it has keeps none.
__global__ void KeysKernel(SparseResidualSlots s, int64_t rows,
                           uint64_t invalid, uint64_t* keys, int* values) {
  const int64_t n = rows * s.slots;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / s.slots;
    const int k = static_cast<int>(i % s.slots);
    const int count = s.row_count[r];
    const bool kept = count <= s.slots && k < count;
    keys[i] = kept ? static_cast<uint64_t>(s.column[i]) * rows + r : invalid;
    values[i] = static_cast<int>(i);
  }
}

template <typename T>
__device__ __forceinline__ float Load(const T* p, int64_t i) {
  if constexpr (std::is_same<T, float>::value) {
    return p[i];
  } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return __bfloat162float(p[i]);
  } else {
    return __half2float(p[i]);
  }
}

// A block per column's run of records (found at its first key), its threads
// across H: each dW element gets its records' sum in (v, r) order, once.
template <typename T>
__global__ void ApplyKernel(const uint64_t* keys, const int* values,
                            const float* residual, int64_t n, int64_t rows,
                            uint64_t invalid, const T* x, int64_t hidden,
                            float alpha, float* grad_weight) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const uint64_t key = keys[i];
    if (key >= invalid) return;  // sorted: the rest are invalid too
    const uint64_t v = key / rows;
    if (i > 0 && keys[i - 1] / rows == v) continue;
    float* out = grad_weight + v * hidden;
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
      float sum = 0.0f;
      for (int64_t j = i; j < n && keys[j] < invalid && keys[j] / rows == v;
           ++j) {
        const int64_t r = static_cast<int64_t>(keys[j] % rows);
        sum = fmaf(residual[values[j]], Load(x, r * hidden + h), sum);
      }
      out[h] = fmaf(alpha, sum, out[h]);
    }
  }
}

int GridFor(int64_t total) {
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 132 * 8 ? (blocks > 0 ? blocks : 1)
                                           : 132 * 8);
}

}  // namespace

std::size_t SparseResidualWorkspaceBytes(int64_t rows, int slots,
                                         int64_t vocab) {
  return MakeSortParts(rows, slots, vocab).total;
}

SparseResidualSlots SparseResidualCarve(void* workspace, int64_t rows,
                                        int slots, float threshold) {
  const std::size_t n = static_cast<std::size_t>(rows) * slots;
  char* at = static_cast<char*>(workspace);
  SparseResidualSlots s;
  s.threshold = threshold;
  s.slots = slots;
  s.row_count = reinterpret_cast<int*>(at);
  at += AlignUp(rows * sizeof(int));
  s.column = reinterpret_cast<int*>(at);
  at += AlignUp(n * sizeof(int));
  s.residual = reinterpret_cast<float*>(at);
  return s;
}

cudaError_t SparseResidualResetLaunch(const SparseResidualSlots& s,
                                      int64_t rows, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  ResetKernel<<<GridFor(rows), kThreads, 0, stream>>>(s.row_count, rows);
  return cudaGetLastError();
}

cudaError_t SparseResidualApplyLaunch(const SparseResidualSlots& s,
                                      void* workspace, int64_t rows,
                                      int64_t vocab, const void* x,
                                      DType x_dtype, int64_t hidden,
                                      float alpha, float* grad_weight,
                                      cudaStream_t stream) {
  const int64_t n = rows * s.slots;
  if (n == 0) return cudaSuccess;
  const SortParts p = MakeSortParts(rows, s.slots, vocab);
  char* base = static_cast<char*>(workspace);
  auto* keys_in = reinterpret_cast<uint64_t*>(base + p.keys_in);
  auto* keys_out = reinterpret_cast<uint64_t*>(base + p.keys_out);
  auto* values_in = reinterpret_cast<int*>(base + p.values_in);
  auto* values_out = reinterpret_cast<int*>(base + p.values_out);
  const uint64_t invalid =
      static_cast<uint64_t>(rows) * static_cast<uint64_t>(vocab);
  KeysKernel<<<GridFor(n), kThreads, 0, stream>>>(s, rows, invalid, keys_in,
                                                  values_in);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  std::size_t temp_bytes = p.temp_bytes;
  error = cub::DeviceRadixSort::SortPairs(base + p.temp, temp_bytes, keys_in,
                                          keys_out, values_in, values_out, n, 0,
                                          KeyBits(rows, vocab), stream);
  if (error != cudaSuccess) return error;
  const int grid = static_cast<int>(n < 132 * 16 ? n : 132 * 16);
  switch (x_dtype) {
    case DType::kBFloat16:
      ApplyKernel<<<grid, kThreads, 0, stream>>>(
          keys_out, values_out, s.residual, n, rows, invalid,
          static_cast<const __nv_bfloat16*>(x), hidden, alpha, grad_weight);
      break;
    case DType::kFloat16:
      ApplyKernel<<<grid, kThreads, 0, stream>>>(
          keys_out, values_out, s.residual, n, rows, invalid,
          static_cast<const __half*>(x), hidden, alpha, grad_weight);
      break;
    default:
      ApplyKernel<<<grid, kThreads, 0, stream>>>(
          keys_out, values_out, s.residual, n, rows, invalid,
          static_cast<const float*>(x), hidden, alpha, grad_weight);
      break;
  }
  return cudaGetLastError();
}

}  // namespace lossd
