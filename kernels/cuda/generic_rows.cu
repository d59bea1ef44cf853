// Schedule "generic rows": one block a row, scalar loads, any alignment and
// any options; the row is read three times (the later reads mostly from L2).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/dtype_dispatch.cuh"
#include "kernels/cuda/element_traits.cuh"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/row_math.cuh"
#include "kernels/cuda/schedules.h"

namespace lossd {
namespace cuda_ce {
namespace {

// Logits [N, V]; grid = N blocks. Reads the row three times (the later reads
// mostly from L2); used for unaligned rows and vocabularies past the cluster
// path's reach.
template <typename T>
__global__ void __launch_bounds__(kGenericThreads) GenericKernel(Params p) {
  using Tr = Traits<T>;
  __shared__ Stats scratch[kGenericThreads / 32 + 1];
  const WorkspaceHeader& hdr = *p.header;
  if (hdr.error) return;
  const long long row = blockIdx.x;
  const int vocab = p.vocab;
  const long long y = LoadTarget(p, row);
  const bool valid = y != p.ignore_index;
  const T* in = static_cast<const T*>(p.logits) + row * p.stride;
  T* out = p.grad ? static_cast<T*>(p.grad) + row * p.stride : nullptr;
  const float c = p.softcap;

  float zy = 0.0f, wy = 1.0f, unused;
  if (valid) {
    const float xy = Tr::Load(in + y);
    zy = c > 0 ? SoftcapZ(xy, c, &unused) : xy;
    if (p.weights) wy = p.weights[y];
  }
  Stats st;
  st.m = -INFINITY;
  st.t = 0.0f;
  st.sum_wz = 0.0f;
  st.arg = INT_MAX;
  bool nan = false;  // (never the max, but the row's sum is NaN)
  for (int i = threadIdx.x; i < vocab; i += kGenericThreads) {
    float z = Tr::Load(in + i);
    if (c > 0) z = SoftcapZ(z, c, &unused);
    nan = nan || isnan(z);
    if (z > st.m) {
      st.m = z;
      st.arg = i;
    }
    if (p.eps > 0) st.sum_wz += (p.weights ? p.weights[i] : 1.0f) * z;
  }
  for (int i = threadIdx.x; i < vocab; i += kGenericThreads) {
    float z = Tr::Load(in + i);
    if (c > 0) z = SoftcapZ(z, c, &unused);
    const float e = expf(z - st.m);
    st.t += i == st.arg ? 0.0f : e;
  }
  if (st.m == -INFINITY) st.t = nan ? NAN : -1.0f;
  // A +inf logit makes the row's sum NaN (inf - inf), as every schedule and
  // the CPU count it: the max alone was skipped above.
  if (st.m == INFINITY) st.t = NAN;
  st = BlockReduce<kGenericThreads>(st, scratch);  // also orders the zy read
  const RowMath rm = MakeRowMath(p, hdr, st, valid, zy, wy);
  if (threadIdx.x == 0) WriteRowOutputs(p, row, valid, y, rm, st.arg, true);
  if (!out) return;
  for (int i = threadIdx.x; i < vocab; i += kGenericThreads) {
    float dfac = 1.0f;
    float z = Tr::Load(in + i);
    if (c > 0) z = SoftcapZ(z, c, &dfac);
    float gz = p.weights ? OtherGrad<T, true>(rm, z, p.weights[i])
                         : OtherGrad<T, false>(rm, z, 1.0f);
    if (valid && i == y) gz = rm.gy;
    Tr::Store(out + i, valid ? gz * dfac : 0.0f);
  }
}

}  // namespace

cudaError_t LaunchGenericRows(const Params& p, DType dtype,
                              cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.rows));
  return WithElementType(dtype, [&](auto element) {
    GenericKernel<decltype(element)><<<grid, kGenericThreads, 0, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace cuda_ce
}  // namespace lossd
