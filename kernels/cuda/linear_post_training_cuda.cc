// LinearPostTrainingCuda: the linear head's chunks with the post-training row
// kernel in place of the cross entropy, planned and reduced on the host as
// every backend does (kernels/post_training_plan.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "common/status_macros.h"
#include "kernels/cuda/align_up.h"
#include "kernels/cuda/cross_entropy_cuda_host.h"
#include "kernels/cuda/linear_cross_entropy_call.h"
#include "kernels/cuda/linear_cross_entropy_cuda.h"
#include "kernels/cuda/lt_gemm.h"
#include "kernels/cuda/post_training_cuda.h"
#include "kernels/cuda/post_training_cuda_host.h"
#include "kernels/linear_cross_entropy_validate.h"
#include "kernels/linear_post_training.h"
#include "kernels/post_training_plan.h"
#include "kernels/post_training_validate.h"

namespace lossd {

using linear_cuda::LinearCudaCall;

namespace {

// The rows' factors of a post-training call (the plan's times grad_scale),
// and the scaling of G for its 16-bit copies from the largest of them.
std::vector<float> ScalePostTrainingRows(const PostTrainingPlan& plan,
                                         double grad_scale,
                                         LinearCudaCall* call) {
  double largest = 0.0;
  for (double scale : plan.row_scale) {
    largest = std::max(largest, std::fabs(scale * grad_scale));
  }
  call->s = static_cast<float>(largest);
  const bool g16 = call->l.split || !call->l.logits_fp32;
  call->exponent = g16 ? linear_cuda::GradientExponent(call->s) : 0;
  call->alpha = std::ldexp(1.0f, -call->exponent);
  std::vector<float> row_scale(plan.row_scale.size());
  for (size_t row = 0; row < row_scale.size(); ++row) {
    row_scale[row] = static_cast<float>(
        std::ldexp(plan.row_scale[row] * grad_scale, call->exponent));
  }
  return row_scale;
}

}  // namespace

absl::Status LinearPostTrainingCuda(
    const LinearPostTrainingArgs& device_args, PostTrainingResult* result,
    cudaStream_t stream, const LinearCrossEntropyCudaConfig* config) {
  if (result == nullptr) {
    return absl::InvalidArgumentError(
        "linear_post_training: result is nullptr");
  }
  const LinearCrossEntropyArgs& args = device_args.linear;
  LinearCrossEntropyArgs checked = args;
  if (checked.targets == nullptr) {  // alpha-0 distillation: see below
    checked.targets = args.x;
    checked.targets_dtype = DType::kInt32;
  }
  RETURN_IF_ERROR(ValidateLinearCrossEntropyArgs(checked));
  const PostTrainingArgs whole = WholePostTrainingView(device_args);
  RETURN_IF_ERROR(ValidatePostTrainingArgs(whole));
  RETURN_IF_ERROR(CheckPostTrainingCudaSupport(whole));
  PostTrainingHostView host;
  RETURN_IF_ERROR(CopyPostTrainingPlanInputs(whole, stream, &host));
  const PostTrainingPlan plan = PlanPostTraining(host.args);

  const LinearCrossEntropyLabConfig lab = linear_cuda::LabConfig(config);
  const linear_cuda::Layout l = linear_cuda::MakeLayout(args, lab);
  const int64_t chunk_rows =
      PlanLinearCrossEntropyCudaLab(args, lab).chunk_rows;
  const int64_t chunks = (args.rows + chunk_rows - 1) / chunk_rows;
  const linear_cuda::Parts parts =
      linear_cuda::MakeParts(args, l, chunk_rows, chunks);
  ASSIGN_OR_RETURN(cublasLtHandle_t handle, LtThreadHandle());
  const size_t rows = static_cast<size_t>(std::max<int64_t>(args.rows, 0));
  const size_t rows_offset = AlignUp(rows * sizeof(float));
  char* block = nullptr;
  char* per_row = nullptr;
  RETURN_IF_ERROR(CudaStatus(
      cudaMallocAsync(reinterpret_cast<void**>(&block), parts.total, stream),
      "linear_post_training: workspace allocation"));
  absl::Status status = CudaStatus(
      cudaMallocAsync(reinterpret_cast<void**>(&per_row),
                      rows_offset + rows * sizeof(PostTrainingCudaRow) + 1,
                      stream),
      "linear_post_training: row allocation");
  LinearCudaCall call{args, l, parts, block, stream, chunk_rows, chunks};
  call.post_training = &whole;
  call.row_scale = reinterpret_cast<const float*>(per_row);
  call.rows_out = reinterpret_cast<PostTrainingCudaRow*>(per_row + rows_offset);
  const std::vector<float> row_scale =
      ScalePostTrainingRows(plan, args.options.grad_scale, &call);
  if (status.ok() && rows > 0) {
    status = CudaStatus(
        cudaMemcpyAsync(per_row, row_scale.data(), rows * sizeof(float),
                        cudaMemcpyHostToDevice, stream),
        "linear_post_training: row factors");
  }
  if (status.ok()) status = linear_cuda::PlanChunkGemms(handle, &call);
  if (status.ok()) status = linear_cuda::PrepareChunks(&call);
  if (status.ok()) status = linear_cuda::RunChunks(call);
  std::vector<PostTrainingCudaRow> out(rows);
  if (status.ok() && rows > 0) {
    status = CudaStatus(cudaMemcpyAsync(out.data(), call.rows_out,
                                        rows * sizeof(PostTrainingCudaRow),
                                        cudaMemcpyDeviceToHost, stream),
                        "linear_post_training: row copy");
  }
  RETURN_IF_ERROR(linear_cuda::FinishLinearCall(
      std::move(status), &call, per_row, "linear_post_training"));
  std::vector<PostTrainingRowTotals> totals(rows);
  CollectPostTrainingCudaRows(whole, out.data(), totals.data());
  *result = ReducePostTrainingRows(host.args, plan, totals);
  return absl::OkStatus();
}

}  // namespace lossd
