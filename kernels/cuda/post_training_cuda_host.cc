// The host wrapper of the CUDA post-training losses: the plan from the targets
// and segment ids on the host, the row kernel, and the CPU backend's reduction
// of the rows' totals, so both devices sum in the same order.
#include "kernels/cuda/post_training_cuda_host.h"

#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu/post_training_cpu.h"
#include "kernels/cuda/cross_entropy_cuda_host.h"
#include "kernels/cuda/post_training_cuda.h"

namespace lossd {
namespace {

// Device memory of one call, freed on the stream.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(cudaStream_t stream) : stream_(stream) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (pointer_ != nullptr) cudaFreeAsync(pointer_, stream_);
  }
  absl::Status Allocate(size_t bytes) {
    return CudaStatus(cudaMallocAsync(&pointer_, bytes, stream_),
                      "post_training allocate");
  }
  void* get() const { return pointer_; }

 private:
  cudaStream_t stream_;
  void* pointer_ = nullptr;
};

absl::Status CopyToHost(void* host, const void* device, size_t bytes,
                        cudaStream_t stream) {
  if (bytes == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream),
      "post_training copy to host"));
  return CudaStatus(cudaStreamSynchronize(stream), "post_training synchronize");
}

}  // namespace

absl::Status CheckPostTrainingCudaVocab(const PostTrainingArgs& args) {
  if (args.distillation != nullptr &&
      args.distillation->teacher_logits == nullptr &&
      args.base.vocab > kPostTrainingCudaMaxTopKVocab) {
    return absl::UnimplementedError(
        absl::StrCat("a top-k teacher over V = ", args.base.vocab,
                     " classes is not offered on the GPU yet (at most ",
                     kPostTrainingCudaMaxTopKVocab, ")"));
  }
  return absl::OkStatus();
}

absl::Status CopyPostTrainingPlanInputs(const PostTrainingArgs& device_args,
                                        cudaStream_t stream,
                                        PostTrainingHostView* host) {
  const CrossEntropyArgs& base = device_args.base;
  const int64_t rows = base.rows;
  host->args = device_args;
  if (base.targets != nullptr) {
    host->targets.resize(static_cast<size_t>(rows) *
                         DTypeSize(base.targets_dtype));
    RETURN_IF_ERROR(CopyToHost(host->targets.data(), base.targets,
                               host->targets.size(), stream));
    host->args.base.targets = host->targets.data();
  }
  if (device_args.segments != nullptr) {
    host->segments = *device_args.segments;
    host->ids.resize(static_cast<size_t>(rows));
    RETURN_IF_ERROR(CopyToHost(host->ids.data(), host->segments.ids,
                               host->ids.size() * sizeof(int32_t), stream));
    host->segments.ids = host->ids.data();
    host->args.segments = &host->segments;
  }
  return absl::OkStatus();
}

void CollectPostTrainingCudaRows(const PostTrainingArgs& args,
                                 const PostTrainingCudaRow* out,
                                 PostTrainingRowTotals* totals) {
  const CrossEntropyArgs& base = args.base;
  const int64_t rows = base.rows;
  for (int64_t row = 0; row < rows; ++row) {
    const PostTrainingCudaRow& r = out[row];
    PostTrainingRowTotals& t = totals[row];
    t.valid = (r.flags & kPostTrainingRowValid) != 0;
    t.correct = (r.flags & kPostTrainingRowCorrect) != 0;
    t.clipped = (r.flags & kPostTrainingRowClipped) != 0;
    t.loss = r.loss;
    t.distillation = r.distillation;
    t.ratio = r.ratio;
    t.approx_kl = r.approx_kl;
    t.kl = r.kl;
    t.z_loss = r.z_loss;
    t.entropy = args.policy != nullptr && t.valid ? r.entropy : 0.0;
    if (base.token_loss != nullptr) {
      base.token_loss[row] = static_cast<float>(r.loss);
    }
    if (base.token_lse != nullptr) base.token_lse[row] = r.lse;
    if (base.token_argmax != nullptr) base.token_argmax[row] = r.argmax;
    if (args.token_logprob != nullptr) {
      args.token_logprob[row] = r.logprob;
    }
    if (args.token_entropy != nullptr) {
      args.token_entropy[row] = static_cast<float>(r.entropy);
    }
    const bool policy_row = args.policy != nullptr && t.valid;
    if (args.token_ratio != nullptr) {
      args.token_ratio[row] = policy_row ? static_cast<float>(r.ratio) : 0.0f;
    }
    if (args.token_clipped != nullptr) {
      args.token_clipped[row] = policy_row && t.clipped;
    }
  }
}

absl::Status PostTrainingCuda(const PostTrainingArgs& device_args,
                              PostTrainingResult* result, cudaStream_t stream) {
  if (result == nullptr) {
    return absl::InvalidArgumentError("post_training: result is nullptr");
  }
  RETURN_IF_ERROR(ValidatePostTrainingArgs(device_args));
  const CrossEntropyArgs& base = device_args.base;
  const int64_t rows = base.rows;
  RETURN_IF_ERROR(CheckPostTrainingCudaVocab(device_args));

  // The plan needs the targets and segment ids on the host.
  PostTrainingHostView host;
  RETURN_IF_ERROR(CopyPostTrainingPlanInputs(device_args, stream, &host));
  const PostTrainingArgs& host_view = host.args;
  const PostTrainingPlan plan = PlanPostTraining(host_view);
  std::vector<float> row_scale(static_cast<size_t>(rows));
  for (int64_t row = 0; row < rows; ++row) {
    row_scale[row] =
        static_cast<float>(plan.row_scale[row] * base.options.grad_scale);
  }

  std::vector<PostTrainingCudaRow> out(static_cast<size_t>(rows));
  if (rows > 0) {
    DeviceBuffer device_scale(stream), device_rows(stream);
    RETURN_IF_ERROR(device_scale.Allocate(row_scale.size() * sizeof(float)));
    RETURN_IF_ERROR(
        device_rows.Allocate(out.size() * sizeof(PostTrainingCudaRow)));
    RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(device_scale.get(), row_scale.data(),
                                   row_scale.size() * sizeof(float),
                                   cudaMemcpyHostToDevice, stream),
                   "post_training copy row scales"));
    const cudaError_t launched = PostTrainingCudaLaunch(
        device_args, static_cast<const float*>(device_scale.get()),
        static_cast<PostTrainingCudaRow*>(device_rows.get()), stream);
    if (launched == cudaErrorInvalidValue) {
      cudaStreamSynchronize(stream);
      return absl::InvalidArgumentError(
          "post_training: the shape is not supported by the GPU kernel");
    }
    RETURN_IF_ERROR(CudaStatus(launched, "post_training launch"));
    RETURN_IF_ERROR(CopyToHost(out.data(), device_rows.get(),
                               out.size() * sizeof(PostTrainingCudaRow),
                               stream));
  }

  std::vector<PostTrainingRowTotals> totals(static_cast<size_t>(rows));
  CollectPostTrainingCudaRows(device_args, out.data(), totals.data());
  *result = ReducePostTrainingRows(host_view, plan, totals);
  return absl::OkStatus();
}

}  // namespace lossd
