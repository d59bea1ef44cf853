// Host wrapper of the CUDA cross-entropy: validates, allocates the workspace
// stream-ordered, launches, synchronizes and maps errors to absl::Status.
#include "kernels/cuda/cross_entropy_cuda_host.h"

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cross_entropy_cpu.h"

namespace lossd {

absl::Status CudaStatus(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorName(error),
                                           ": ", cudaGetErrorString(error));
  if (error == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(message);
  }
  return absl::InternalError(message);
}

absl::Status CrossEntropyCuda(const CrossEntropyArgs& device_args,
                              CrossEntropyResult* result, cudaStream_t stream,
                              const CrossEntropyCudaConfig* config) {
  if (result == nullptr) {
    return absl::InvalidArgumentError("cross_entropy: result is nullptr");
  }
  absl::Status status = ValidateCrossEntropyArgs(device_args);
  if (!status.ok()) return status;

  const std::size_t workspace_bytes =
      CrossEntropyCudaWorkspaceBytes(device_args.rows);
  void* block = nullptr;
  status = CudaStatus(
      cudaMallocAsync(&block, workspace_bytes + sizeof(CrossEntropyCudaResult),
                      stream),
      "cross_entropy: workspace allocation");
  if (!status.ok()) return status;
  auto* device_result = reinterpret_cast<CrossEntropyCudaResult*>(
      static_cast<char*>(block) + workspace_bytes);
  CrossEntropyCudaResult host = {};
  status = CudaStatus(CrossEntropyCudaLaunch(device_args, device_result, block,
                                             workspace_bytes, stream, config),
                      "cross_entropy: launch");
  if (status.ok()) {
    status = CudaStatus(cudaMemcpyAsync(&host, device_result, sizeof(host),
                                        cudaMemcpyDeviceToHost, stream),
                        "cross_entropy: result copy");
  }
  const absl::Status freed =
      CudaStatus(cudaFreeAsync(block, stream), "cross_entropy: workspace free");
  const absl::Status synced = CudaStatus(cudaStreamSynchronize(stream),
                                         "cross_entropy: stream synchronize");
  if (!status.ok()) return status;
  if (!freed.ok()) return freed;
  if (!synced.ok()) return synced;

  if (host.error == kCrossEntropyBadTarget) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cross_entropy: target of row ", host.bad_row, " is ", host.bad_target,
        ", outside [0, ", device_args.vocab, ") and not ignore_index (",
        device_args.options.ignore_index, ")"));
  }
  result->loss = host.loss;
  result->z_loss = host.z_loss;
  result->valid_tokens = host.valid_tokens;
  result->correct_tokens = host.correct_tokens;
  result->nonfinite_rows = host.nonfinite_rows;
  result->denominator = host.denominator;
  return absl::OkStatus();
}

}  // namespace lossd
