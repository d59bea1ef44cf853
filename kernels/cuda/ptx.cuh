// Inline PTX the schedules share: cluster barriers, mbarriers, bulk copies
// (the TMA unit without a tensor map), st.async into a peer's shared memory,
// L2 eviction policies and prefetch, acquire loads. sm_90.

#ifndef LOSSD_KERNELS_CUDA_PTX_CUH_
#define LOSSD_KERNELS_CUDA_PTX_CUH_

#include <cuda_runtime.h>

#include "kernels/cuda/row_math.cuh"

namespace lossd {
namespace cuda_ce {

// Split cluster barrier. DSMEM may be written only once the peer block has
// started, so blocks arrive on entry and wait just before the first push.
__device__ __forceinline__ void ClusterArriveRelaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}

__device__ __forceinline__ unsigned SmemAddr(const void* ptr) {
  return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void MbarInit(unsigned long long* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddr(bar)),
               "r"(count)
               : "memory");
}
__device__ __forceinline__ void MbarExpectTx(unsigned long long* bar,
                                             unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                   SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void MbarArrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddr(bar))
               : "memory");
}
// How long a waiting thread may sleep in try_wait before it looks again: a
// waiting warp then takes no issue slots from the SM's other block.
constexpr unsigned kSuspendNs = 1000000;
__device__ __forceinline__ void MbarWait(unsigned long long* bar,
                                         unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(SmemAddr(bar)), "r"(parity), "n"(kSuspendNs)
        : "memory");
  } while (!done);
}
// Global -> shared bulk copy (the TMA unit, no tensor map): `bytes` a
// multiple of 16, both addresses 16-byte aligned; completes on `bar`.
__device__ __forceinline__ void BulkLoad(void* dst, const void* src,
                                         unsigned bytes,
                                         unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
      "[%0], [%1], %2, [%3];" ::"r"(SmemAddr(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
}
// try_wait with cluster-scope acquire: the data other blocks' st.async wrote
// before completing the phase is visible after it.
__device__ __forceinline__ void MbarWaitCluster(unsigned long long* bar,
                                                unsigned parity) {
  unsigned done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], "
        "%2, %3;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(SmemAddr(bar)), "r"(parity), "n"(kSuspendNs)
        : "memory");
  } while (!done);
}
// Stores `v` into `slot` (an address in this block's shared memory) of the
// block of cluster rank `peer`, completing 16 bytes of the transaction on
// that block's copy of `bar`. No fence: ordering comes from the mbarrier.
__device__ __forceinline__ void StAsyncStats(Stats* slot, int peer,
                                             const Stats& v,
                                             unsigned long long* bar) {
  unsigned rslot, rbar;
  asm("mapa.shared::cluster.u32 %0, %1, %2;"
      : "=r"(rslot)
      : "r"(SmemAddr(slot)), "r"(peer));
  asm("mapa.shared::cluster.u32 %0, %1, %2;"
      : "=r"(rbar)
      : "r"(SmemAddr(bar)), "r"(peer));
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], "
      "{%1, %2, %3, %4}, [%5];" ::"r"(rslot),
      "r"(__float_as_uint(v.m)), "r"(__float_as_uint(v.t)),
      "r"(__float_as_uint(v.sum_wz)), "r"(v.arg), "r"(rbar)
      : "memory");
}

// L2 eviction priorities (L2 row pieces): a policy for every line
// an access touches, and vector loads and streaming stores that carry one.
__device__ __forceinline__ unsigned long long L2EvictLast() {
  unsigned long long pol;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ unsigned long long L2EvictFirst() {
  unsigned long long pol;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint4 LoadWithPolicy(const uint4* a,
                                                unsigned long long pol) {
  uint4 v;
  asm("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(a), "l"(pol));
  return v;
}
__device__ __forceinline__ void StoreStreamWithPolicy(uint4* a, uint4 v,
                                                      unsigned long long pol) {
  asm volatile(
      "st.global.cs.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(a),
      "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol)
      : "memory");
}

__device__ __forceinline__ int LoadAcquire(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];"
               : "=r"(v)
               : "l"(ptr)
               : "memory");
  return v;
}

// Asks the TMA unit to bring `bytes` (a multiple of 16) at `src` (16-byte
// aligned) into L2; nothing waits for it.
__device__ __forceinline__ void BulkPrefetchL2(const void* src,
                                               unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src),
               "r"(bytes)
               : "memory");
}

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_PTX_CUH_
