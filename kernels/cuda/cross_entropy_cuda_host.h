// The absl::Status face of the CUDA cross-entropy backend: the one host
// wrapper (validate, launch, wait, map errors) that the server's CudaDevice
// and the tests both call, and the single cudaError_t -> absl::Status mapping
// of the CUDA code.
#ifndef LOSSD_KERNELS_CUDA_CROSS_ENTROPY_CUDA_HOST_H_
#define LOSSD_KERNELS_CUDA_CROSS_ENTROPY_CUDA_HOST_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/cross_entropy.h"
#include "kernels/cuda/align_up.h"
#include "kernels/cuda/cross_entropy_cuda.h"

namespace lossd {

// OK for cudaSuccess; RESOURCE_EXHAUSTED for cudaErrorMemoryAllocation;
// INTERNAL naming `what` and cudaGetErrorString otherwise. Pure.
absl::Status CudaStatus(cudaError_t error, absl::string_view what);

// The message of a bad target a kernel found: row `row`'s target `target`
// is outside [0, vocab) and not ignore_index.
std::string BadTargetMessage(int64_t row, int64_t target, int64_t vocab,
                             int64_t ignore_index);

// A kernel's sums as the contract's result (kernel_seconds left 0).
CrossEntropyResult FromCudaResult(const CrossEntropyCudaResult& result);

// Bytes of device memory CrossEntropyCudaRun needs as `scratch` for `rows`
// rows: the launch's workspace and the device-side result. Pure.
std::size_t CrossEntropyCudaScratchBytes(int64_t rows);

// Runs the fused cross-entropy on `stream` for `device_args` (device
// pointers, per-token outputs included; same contract as CrossEntropyCpu),
// waits for the stream and fills *result. `scratch` is device memory of at
// least CrossEntropyCudaScratchBytes(rows) bytes; `host_result` is host memory
// the result comes back through (pinned memory makes that copy
// asynchronous). `config` (tests; may be nullptr) names a schedule.
//
// Returns OK; INVALID_ARGUMENT when ValidateCrossEntropyArgs fails, result,
// scratch or host_result is nullptr, scratch is too small, the shape is not
// supported by the kernels (vocab or rows past 2^31 - 1, or a `config`
// schedule that cannot take it), or a target is outside [0, vocab) and not
// ignore_index (the message names the first such row and value; then no
// output is written and in-place logits are unchanged); RESOURCE_EXHAUSTED
// when device memory runs out; INTERNAL for other CUDA errors (a sticky one
// included: the caller decides what that means for its context).
// Synchronizes `stream`. Ownership: borrows every buffer until it returns.
// Thread safety: reentrant for distinct buffers.
absl::Status CrossEntropyCudaRun(
    const CrossEntropyArgs& device_args, void* scratch,
    std::size_t scratch_bytes, CrossEntropyCudaResult* host_result,
    cudaStream_t stream, CrossEntropyResult* result,
    const CrossEntropyCudaConfig* config = nullptr);

// CrossEntropyCudaRun with its scratch allocated from the stream's memory
// pool and freed before it returns, and the result through pageable memory.
// Same contract.
absl::Status CrossEntropyCuda(const CrossEntropyArgs& device_args,
                              CrossEntropyResult* result, cudaStream_t stream,
                              const CrossEntropyCudaConfig* config = nullptr);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_CROSS_ENTROPY_CUDA_HOST_H_
