// The CUDA backend of the cross-entropy contract (kernels/cross_entropy.h):
// device-side launch with no host synchronization, for the server's streams.
// CUDA runtime headers only; the absl wrapper is cross_entropy_cuda_host.h.
#ifndef LOSSD_KERNELS_CUDA_CROSS_ENTROPY_CUDA_H_
#define LOSSD_KERNELS_CUDA_CROSS_ENTROPY_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cross_entropy.h"

namespace lossd {

// Written to device memory by CrossEntropyCudaLaunch. Same meaning as
// CrossEntropyResult, plus the bad-target report: when `error` is
// kCrossEntropyBadTarget, nothing else was written anywhere (gradient,
// per-token outputs and logits are untouched) and the sums are 0.
struct CrossEntropyCudaResult {
  double loss;
  double z_loss;
  double denominator;
  long long valid_tokens;
  long long correct_tokens;
  long long nonfinite_rows;
  long long bad_row;     // first row whose target is out of range, or -1
  long long bad_target;  // that row's target value
  int error;             // 0 = ok, kCrossEntropyBadTarget
  int reserved;
};

constexpr int kCrossEntropyBadTarget = 1;

// The fused schedules, one a file in kernels/cuda/ (schedule_policy.h says
// which shape takes which; each takes every option). kAuto is the production
// choice.
enum class CrossEntropyCudaSchedule : int {
  kAuto = 0,
  kGenericRows = 1,          // generic_rows.cu: any alignment, any options
  kClusterRegisterRows = 2,  // cluster_register_rows.cu: rows <= 1 MiB
  kClusterStreamRows = 3,    // cluster_stream_rows.cu: aligned rows
  kClusterSliceRows = 4,     // cluster_slice_rows.cu: up to 16 slices
  kSplitRowForward = 5,      // split_row_forward.cu: forward only
  kL2RowPieces = 6,          // l2_row_pieces.cu: 2-byte logits
  kSmemRowPieces = 7,        // smem_row_pieces.cu: forward+gradient
};

// For tests: run a named schedule on a shape it would not get by default
// (small rows in many pieces, say). Production passes nullptr. 0 fields mean
// the schedule's own choice.
struct CrossEntropyCudaConfig {
  CrossEntropyCudaSchedule schedule = CrossEntropyCudaSchedule::kAuto;
  // KiB of a block's slice or of a row piece (cluster stream/slice rows, split
  // row forward, L2 and smem row pieces).
  int piece_kib = 0;
  // Cluster register rows: 16-byte vectors a thread holds (1, 2, 4, 8, 16).
  int vectors_per_thread = 0;
  // L2 row pieces: MiB of rows a group (default 4).
  int group_mib = 0;
};

// Bytes of device workspace CrossEntropyCudaLaunch needs for `rows` rows
// (aligned to 256 bytes). Thread-safe, pure.
std::size_t CrossEntropyCudaWorkspaceBytes(int64_t rows);

// Enqueues the fused cross-entropy on `stream`: a target check, the fused
// loss+gradient kernel and a fixed-order reduction into *device_result.
// `args` must already be valid (ValidateCrossEntropyArgs) and hold device
// pointers; `device_result` and `workspace` (>= CrossEntropyCudaWorkspaceBytes)
// are device memory owned by the caller and must outlive the stream work. The
// result is deterministic: the same inputs give the same bits on every run.
// Returns cudaSuccess when the work was enqueued; cudaErrorInvalidValue for a
// too-small workspace, an unsupported shape (vocab or rows >= 2^31), or a
// `config` schedule that cannot take this shape; or a launch error. A bad
// target is not a launch error: it is reported in device_result->error once
// the stream reaches it. Thread-safe for distinct buffers; `config` (tests;
// may be nullptr) names the schedule instead of the automatic choice.
cudaError_t CrossEntropyCudaLaunch(
    const CrossEntropyArgs& args, CrossEntropyCudaResult* device_result,
    void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
    const CrossEntropyCudaConfig* config = nullptr);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_CROSS_ENTROPY_CUDA_H_
