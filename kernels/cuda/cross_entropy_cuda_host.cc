// The one host wrapper of the CUDA cross-entropy: validates, launches into
// the caller's scratch, waits, and maps errors to absl::Status.
#include "kernels/cuda/cross_entropy_cuda_host.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cross_entropy_validate.h"
#include "kernels/cuda/unique_handle.h"

namespace lossd {

std::string BadTargetMessage(int64_t row, int64_t target, int64_t vocab,
                             int64_t ignore_index) {
  return absl::StrCat("target of row ", row, " is ", target, ", outside [0, ",
                      vocab, ") and not ignore_index (", ignore_index, ")");
}

CrossEntropyResult FromCudaResult(const CrossEntropyCudaResult& result) {
  CrossEntropyResult out;
  out.loss = result.loss;
  out.z_loss = result.z_loss;
  out.valid_tokens = result.valid_tokens;
  out.correct_tokens = result.correct_tokens;
  out.nonfinite_rows = result.nonfinite_rows;
  out.denominator = result.denominator;
  return out;
}

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorName(error),
                                           ": ", cudaGetErrorString(error));
  if (error == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(message);
  }
  return absl::InternalError(message);
}

std::size_t CrossEntropyCudaScratchBytes(int64_t rows) {
  return AlignUp(CrossEntropyCudaWorkspaceBytes(rows)) +
         AlignUp(sizeof(CrossEntropyCudaResult));
}

absl::Status CrossEntropyCudaRun(const CrossEntropyArgs& device_args,
                                 void* scratch, std::size_t scratch_bytes,
                                 CrossEntropyCudaResult* host_result,
                                 cudaStream_t stream,
                                 CrossEntropyResult* result,
                                 const CrossEntropyCudaConfig* config) {
  if (result == nullptr || scratch == nullptr || host_result == nullptr) {
    return absl::InvalidArgumentError(
        "cross_entropy: result, scratch or host_result is nullptr");
  }
  absl::Status status = ValidateCrossEntropyArgs(device_args);
  if (!status.ok()) return status;
  if (scratch_bytes < CrossEntropyCudaScratchBytes(device_args.rows)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cross_entropy: scratch of ", scratch_bytes, " bytes, ",
        CrossEntropyCudaScratchBytes(device_args.rows), " needed"));
  }
  const std::size_t workspace_bytes =
      AlignUp(CrossEntropyCudaWorkspaceBytes(device_args.rows));
  auto* device_result = reinterpret_cast<CrossEntropyCudaResult*>(
      static_cast<char*>(scratch) + workspace_bytes);
  // The kernels' own time, as the kernel bench measures it: events around
  // the launch, not the host's wait (allocation, result copy, wake-up).
  UniqueHandle<cudaEvent_t, cudaEventDestroy> timing[2];
  const bool timed = cudaEventCreate(timing[0].put()) == cudaSuccess &&
                     cudaEventCreate(timing[1].put()) == cudaSuccess &&
                     cudaEventRecord(timing[0].get(), stream) == cudaSuccess;
  if (!timed) cudaGetLastError();
  const cudaError_t launched = CrossEntropyCudaLaunch(
      device_args, device_result, scratch, workspace_bytes, stream, config);
  if (timed && cudaEventRecord(timing[1].get(), stream) != cudaSuccess) {
    cudaGetLastError();
  }
  if (launched == cudaErrorInvalidValue) {
    cudaGetLastError();  // not sticky: nothing was enqueued past the check
    return absl::InvalidArgumentError(absl::StrCat(
        "cross_entropy: shape [", device_args.rows, ", ", device_args.vocab,
        "] is not supported by the CUDA kernel"));
  }
  status = CudaStatus(launched, "cross_entropy launch");
  if (status.ok()) {
    status = CudaStatus(
        cudaMemcpyAsync(host_result, device_result, sizeof(*host_result),
                        cudaMemcpyDeviceToHost, stream),
        "cross_entropy result copy");
  }
  if (status.ok()) {
    status = CudaStatus(cudaStreamSynchronize(stream), "cross_entropy");
  }
  float kernel_ms = 0.0f;
  if (status.ok() && timed &&
      cudaEventElapsedTime(&kernel_ms, timing[0].get(), timing[1].get()) !=
          cudaSuccess) {
    cudaGetLastError();
    kernel_ms = 0.0f;
  }
  if (!status.ok()) return status;
  const CrossEntropyCudaResult& host = *host_result;
  if (host.error == kCrossEntropyBadTarget) {
    return absl::InvalidArgumentError(
        BadTargetMessage(host.bad_row, host.bad_target, device_args.vocab,
                         device_args.options.ignore_index));
  }
  *result = FromCudaResult(host);
  result->kernel_seconds = kernel_ms * 1e-3;
  return absl::OkStatus();
}

absl::Status CrossEntropyCuda(const CrossEntropyArgs& device_args,
                              CrossEntropyResult* result, cudaStream_t stream,
                              const CrossEntropyCudaConfig* config) {
  if (result == nullptr) {
    return absl::InvalidArgumentError("cross_entropy: result is nullptr");
  }
  absl::Status status = ValidateCrossEntropyArgs(device_args);
  if (!status.ok()) return status;
  const std::size_t scratch_bytes =
      CrossEntropyCudaScratchBytes(device_args.rows);
  void* scratch = nullptr;
  status = CudaStatus(cudaMallocAsync(&scratch, scratch_bytes, stream),
                      "cross_entropy: scratch allocation");
  if (!status.ok()) return status;
  CrossEntropyCudaResult host = {};
  status = CrossEntropyCudaRun(device_args, scratch, scratch_bytes, &host,
                               stream, result, config);
  const absl::Status freed =
      CudaStatus(cudaFreeAsync(scratch, stream), "cross_entropy: scratch free");
  const absl::Status synced = CudaStatus(cudaStreamSynchronize(stream),
                                         "cross_entropy: stream synchronize");
  if (!status.ok()) return status;
  if (!freed.ok()) return freed;
  return synced;
}

}  // namespace lossd
