// The kernels around every schedule: prepare (target check, the mean's
// denominator, class-weight sums, the gradient's scale) and finalize (the
// fixed-order fp64 sums of the per-row values into CrossEntropyCudaResult).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/element_traits.cuh"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/row_math.cuh"
#include "kernels/cuda/schedules.h"

namespace lossd {
namespace cuda_ce {
namespace {

// Fixed-order reduction over the kReduceThreads threads of a block with `op`
// (commutative): butterflies within each warp, then over the warps' results;
// every thread gets the same bits. `scratch` holds 32 values.
template <typename A, typename Op>
__device__ A BlockFold(A v, A* scratch, Op op) {
  static_assert(kReduceThreads == 32 * 32, "one warp's lanes for the warps");
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  v = scratch[threadIdx.x % 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  __syncthreads();  // scratch may be reused at once
  return v;
}

template <typename A>
__device__ A BlockSum(A v, A* scratch) {
  return BlockFold(v, scratch, [](A a, A b) { return a + b; });
}

// Rows a thread of the prepare and finalize kernels loads at once (their
// loads in flight together, not one DRAM round trip a row).
constexpr int kRowBatch = 8;

__global__ void __launch_bounds__(kReduceThreads) PrepareKernel(Params p) {
  __shared__ double dscratch[32];
  __shared__ long long lscratch[32];
  long long bad = LLONG_MAX;
  long long valid = 0;
  double wsum = 0.0;
  for (long long base = threadIdx.x; base < p.rows;
       base += kRowBatch * kReduceThreads) {
    long long ys[kRowBatch];
#pragma unroll
    for (int k = 0; k < kRowBatch; ++k) {
      const long long i = base + k * kReduceThreads;
      ys[k] = i < p.rows ? LoadTarget(p, i) : p.ignore_index;
    }
#pragma unroll
    for (int k = 0; k < kRowBatch; ++k) {
      const long long y = ys[k];
      if (y == p.ignore_index) continue;
      if (y < 0 || y >= p.vocab) {
        bad = min(bad, base + k * kReduceThreads);
        continue;
      }
      ++valid;
      wsum += p.weights ? static_cast<double>(p.weights[y]) : 1.0;
    }
  }
  double wtotal = 0.0;
  if (p.weights) {
    for (int c = threadIdx.x; c < p.vocab; c += kReduceThreads) {
      wtotal += p.weights[c];
    }
  } else if (threadIdx.x == 0) {
    wtotal = p.vocab;
  }
  bad = BlockFold(bad, lscratch,
                  [](long long a, long long b) { return min(a, b); });
  valid = BlockSum(valid, lscratch);
  wsum = BlockSum(wsum, dscratch);
  wtotal = BlockSum(wtotal, dscratch);
  if (threadIdx.x == 0) {
    WorkspaceHeader h = {};
    h.error = bad != LLONG_MAX ? kCrossEntropyBadTarget : 0;
    h.bad_row = bad != LLONG_MAX ? bad : -1;
    h.valid = valid;
    // As the reference: a mean over zero valid rows is 0; a zero D with valid
    // rows (weights summing to 0) gives NaN/Inf as torch does. An explicit
    // normalizer is D even without valid rows (as Evaluate reports it).
    const bool mean = p.reduction == static_cast<int>(Reduction::kMean);
    const double d = p.normalizer > 0 ? p.normalizer : wsum;
    h.denominator = mean && (valid > 0 || p.normalizer > 0) ? d : 0.0;
    double s = p.grad_scale;
    if (mean) s = valid > 0 ? s / d : 0.0;
    h.scale = static_cast<float>(s);
    h.weight_total = static_cast<float>(wtotal);
    *p.header = h;
  }
}

// ---- finalize: fixed-order reduction of the per-row values ----------------

__global__ void __launch_bounds__(kReduceThreads)
    FinalizeKernel(Params p, CrossEntropyCudaResult* out) {
  __shared__ double dscratch[32];
  __shared__ long long lscratch[32];
  const WorkspaceHeader h = *p.header;
  if (h.error) {
    if (threadIdx.x == 0) {
      CrossEntropyCudaResult r = {};
      r.error = h.error;
      r.bad_row = h.bad_row;
      r.bad_target = LoadTarget(p, h.bad_row);
      *out = r;
    }
    return;
  }
  double loss = 0.0, zloss = 0.0;
  long long correct = 0, nonfinite = 0;
  for (long long base = threadIdx.x; base < p.rows;
       base += kRowBatch * kReduceThreads) {
    float l[kRowBatch], z[kRowBatch];
    int f[kRowBatch];
#pragma unroll
    for (int k = 0; k < kRowBatch; ++k) {
      const long long i = base + k * kReduceThreads;
      const bool in = i < p.rows;
      l[k] = in ? p.row_loss[i] : 0.0f;
      z[k] = in ? p.row_zloss[i] : 0.0f;
      f[k] = in ? p.row_flags[i] : 0;
    }
#pragma unroll
    for (int k = 0; k < kRowBatch; ++k) {
      loss += l[k];
      zloss += z[k];
      correct += (f[k] & kFlagCorrect) ? 1 : 0;
      nonfinite += (f[k] & kFlagNonfinite) ? 1 : 0;
    }
  }
  loss = BlockSum(loss, dscratch);
  zloss = BlockSum(zloss, dscratch);
  correct = BlockSum(correct, lscratch);
  nonfinite = BlockSum(nonfinite, lscratch);
  if (threadIdx.x == 0) {
    CrossEntropyCudaResult r = {};
    if (p.reduction == static_cast<int>(Reduction::kMean)) {
      loss = h.valid > 0 ? loss / h.denominator : 0.0;
      zloss = h.valid > 0 ? zloss / h.denominator : 0.0;
    }
    r.loss = loss;
    r.z_loss = zloss;
    r.denominator = h.denominator;
    r.valid_tokens = h.valid;
    r.correct_tokens = correct;
    r.nonfinite_rows = nonfinite;
    r.bad_row = -1;
    *out = r;
  }
}

}  // namespace

cudaError_t LaunchPrepare(const Params& p, cudaStream_t stream) {
  PrepareKernel<<<1, kReduceThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t LaunchFinalize(const Params& p, CrossEntropyCudaResult* out,
                           cudaStream_t stream) {
  FinalizeKernel<<<1, kReduceThreads, 0, stream>>>(p, out);
  return cudaGetLastError();
}

}  // namespace cuda_ce
}  // namespace lossd
