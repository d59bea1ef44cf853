// The launch contract of lossd's Hopper GEMM (gemm_sm90.cuh): Z = X W^T in
// bf16 with fp32 accumulation, Z stored in bf16 or fp32. The first stage of
// the cross entropy in the GEMM's epilogue (issue 30); cuBLASLt remains the
// fallback wherever GemmSm90Eligibility says no.
#ifndef LOSSD_KERNELS_CUDA_GEMM_SM90_H_
#define LOSSD_KERNELS_CUDA_GEMM_SM90_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/gemm_sm90_policy.h"

namespace lossd {
namespace cuda_gemm {

enum class ZType { kBFloat16, kFloat32 };

struct GemmSm90Args {
  const void* x = nullptr;  // bf16 [rows, depth], row-major, 16-byte aligned
  const void* w = nullptr;  // bf16 [cols, depth], row-major, 16-byte aligned
  void* z = nullptr;        // [rows, z_stride] of z_type, row-major
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t depth = 0;
  int64_t z_stride = 0;
  ZType z_type = ZType::kBFloat16;
  // Blocks that share each W tile by TMA multicast: 1 or 2, or 0 for the
  // policy's choice (GemmSm90Cluster).
  int cluster = 0;
  // kPingPong needs two blocks a cluster; kPolicy: GemmSm90ScheduleFor.
  GemmSm90Schedule schedule = GemmSm90Schedule::kPolicy;
};

// The policy's shape for `args` (pointer alignment read from the pointers).
GemmSm90Shape ShapeOf(const GemmSm90Args& args);

// Enqueues Z = X W^T on `stream` on the current device. cudaSuccess, or
// cudaErrorNotSupported where GemmSm90Eligibility says no on this device
// (nothing is enqueued: use cuBLASLt), cudaErrorInvalidValue for a cluster
// other than 0, 1 or 2 or the ping-pong schedule with one block a cluster, or
// the error of the driver's tensor map encoder or of the launch. Thread-safe.
cudaError_t GemmSm90(const GemmSm90Args& args, cudaStream_t stream);

}  // namespace cuda_gemm
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_GEMM_SM90_H_
