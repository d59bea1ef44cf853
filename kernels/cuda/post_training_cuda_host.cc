// The host wrapper of the CUDA post-training losses: the host's plan where
// the kernels need it, the fast schedule or the row kernel, and the rows
// reduced on the device (one small copy back), or with segments on the host
// as the CPU backend does.
#include "kernels/cuda/post_training_cuda_host.h"

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cross_entropy_cuda.h"
#include "kernels/cuda/cross_entropy_cuda_host.h"
#include "kernels/cuda/dense_kd_pieces.h"
#include "kernels/cuda/device_limits.h"
#include "kernels/cuda/dispatch.h"
#include "kernels/cuda/post_training_cuda.h"
#include "kernels/cuda/post_training_policy.h"
#include "kernels/cuda/post_training_reduce.h"
#include "kernels/cuda/row_terms.h"
#include "kernels/cuda/schedules.h"
#include "kernels/cuda/stream_block.h"
#include "kernels/post_training_plan.h"
#include "kernels/post_training_validate.h"

namespace lossd {
namespace {

// `bytes` of device memory for `block`, ordered on its stream.
absl::Status Allocate(StreamBlock* block, size_t bytes) {
  return CudaStatus(block->Allocate(bytes), "post_training allocate");
}

absl::Status CopyToHost(void* host, const void* device, size_t bytes,
                        cudaStream_t stream) {
  if (bytes == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream),
      "post_training copy to host"));
  return CudaStatus(cudaStreamSynchronize(stream), "post_training synchronize");
}

// The fast schedule's choice for `args` (device pointers), or nullopt for the
// row kernel.
absl::Status ChooseFast(const PostTrainingArgs& args,
                        std::optional<cuda_ce::ScheduleChoice>* choice) {
  *choice = std::nullopt;
  const CrossEntropyArgs& base = args.base;
  if (base.rows <= 0 || base.rows > INT32_MAX || base.vocab > INT32_MAX) {
    return absl::OkStatus();
  }
  cuda_ce::PostTrainingShape shape;
  shape.logits =
      cuda_ce::ShapeOf(cuda_ce::FillParams(base, nullptr), base.logits_dtype);
  if (args.distillation != nullptr) {
    shape.distillation = true;
    const DistillationArgs& kd = *args.distillation;
    shape.dense_teacher = kd.teacher_logits != nullptr;
    shape.temperature = kd.temperature;
    if (shape.dense_teacher) {
      const int64_t bytes = static_cast<int64_t>(DTypeSize(kd.teacher_dtype));
      shape.teacher_element_bytes = static_cast<int>(bytes);
      shape.teacher_whole_vectors =
          reinterpret_cast<std::uintptr_t>(kd.teacher_logits) % 16 == 0 &&
          kd.teacher_row_stride * bytes % 16 == 0 &&
          base.vocab * bytes % 16 == 0;
    }
  }
  shape.policy = args.policy != nullptr;
  shape.targets = base.targets != nullptr;
  shape.row_options =
      base.options.label_smoothing > 0.0f || base.options.z_loss_scale != 0.0f;
  cuda_ce::DeviceLimits limits;
  RETURN_IF_ERROR(CudaStatus(cuda_ce::CurrentDeviceLimits(&limits),
                             "post_training device limits"));
  *choice = cuda_ce::ChoosePostTrainingSchedule(shape, limits);
  return absl::OkStatus();
}

bool DenseTeacher(const PostTrainingArgs& args) {
  return args.distillation != nullptr &&
         args.distillation->teacher_logits != nullptr;
}

// Enqueues a dense teacher's call on its row pieces (dense_kd_pieces.h) as
// `choice` sizes them, each row's gradient scaled by `row_scale` (device);
// cudaErrorInvalidConfiguration (nothing written) where they do not fit.
cudaError_t LaunchDense(const PostTrainingArgs& args,
                        const cuda_ce::ScheduleChoice& choice,
                        const float* row_scale, void* workspace,
                        PostTrainingCudaRow* rows_out, cudaStream_t stream) {
  cuda_ce::DenseKdPieces call;
  call.base = args.base;
  call.kd = *args.distillation;
  call.divergence = KernelDivergence(call.kd);
  call.chunk = choice.chunk;
  call.pieces = choice.pieces;
  call.row_scale = row_scale;
  call.rows_out = rows_out;
  call.workspace = workspace;
  call.gradient = args.base.mode != GradientMode::kNone;
  call.entropy = args.policy != nullptr || args.token_entropy != nullptr;
  return cuda_ce::LaunchDenseKdPieces(call, stream);
}

// The fast schedule's floats beside the workspace: a top-k teacher's
// gathered support [rows, k], then the pieces' tau sums [rows * pieces] where
// the kTau builds need them (RowTerms).
bool TauSums(const PostTrainingArgs& args) {
  cuda_ce::RowTerms terms = {};
  terms.kd = args.distillation != nullptr;
  terms.renormalize =
      terms.kd && args.distillation->tail == TopKTail::kRenormalize;
  terms.inv_tau = terms.kd ? 1.0f / args.distillation->temperature : 1.0f;
  return cuda_ce::NeedsTauSums(terms);
}
size_t TermsFloats(const PostTrainingArgs& args,
                   const cuda_ce::ScheduleChoice& choice) {
  if (args.distillation == nullptr) return 0;
  const size_t rows = static_cast<size_t>(args.base.rows);
  return rows * static_cast<size_t>(args.distillation->top_k) +
         (TauSums(args) ? rows * static_cast<size_t>(choice.pieces) : 0);
}

// Enqueues `args` on the smem row pieces schedule as `choice` sizes it: the
// rows' records into `rows_out` as the row kernel writes them; `floats` holds
// TermsFloats. cudaErrorInvalidConfiguration (nothing written) where the
// pieces do not fit this device after all: the caller takes the row kernel.
cudaError_t LaunchFast(const PostTrainingArgs& args,
                       const cuda_ce::ScheduleChoice& choice,
                       const float* row_scale, void* workspace, float* floats,
                       PostTrainingCudaRow* rows_out, cudaStream_t stream) {
  CrossEntropyArgs base = args.base;
  // (host pointers here: the records carry these values)
  base.token_loss = nullptr;
  base.token_lse = nullptr;
  base.token_argmax = nullptr;
  cuda_ce::Params p = cuda_ce::FillParams(base, workspace);
  p.chunk = choice.chunk;
  cuda_ce::RowTerms terms = {};
  terms.row_scale = row_scale;
  terms.policy = args.policy != nullptr;
  terms.forward_only = base.mode == GradientMode::kNone;
  // (the entropy: a policy's statistics, or asked for per token)
  terms.entropy = terms.policy || args.token_entropy != nullptr;
  terms.inv_tau = 1.0f;
  if (terms.policy) terms.pg = *args.policy;
  if (args.distillation != nullptr) {
    const DistillationArgs& kd = *args.distillation;
    terms.kd = true;
    terms.inv_tau = 1.0f / kd.temperature;
    terms.top_k = static_cast<int>(kd.top_k);
    terms.indices64 = kd.top_k_indices_dtype == DType::kInt64;
    terms.renormalize = kd.tail == TopKTail::kRenormalize;
    terms.divergence = KernelDivergence(kd);
    terms.beta = kd.beta;
    terms.alpha = kd.alpha;
    terms.indices = kd.top_k_indices;
    terms.logprobs = kd.top_k_logprobs;
    terms.support_z = floats;
    if (TauSums(args)) {
      terms.piece_tau = floats + static_cast<size_t>(base.rows) * kd.top_k;
    }
  }
  terms.rows_out = rows_out;
  // (label smoothing's per-piece floats: free, the options are off)
  terms.piece_entropy = p.piece_wz;
  cudaError_t e = cuda_ce::LaunchPrepare(p, stream);
  if (e == cudaSuccess && terms.kd) {
    e = cuda_ce::LaunchGatherSupport(p, terms, base.logits_dtype, stream);
  }
  if (e == cudaSuccess) {
    e = cuda_ce::LaunchSmemRowPiecesTerms(p, terms, base.logits_dtype,
                                          choice.bulk, choice.pieces, stream);
  }
  if (e == cudaSuccess && terms.entropy) {
    e = cuda_ce::LaunchRowTermsEntropy(terms, p.rows, choice.pieces, stream);
  }
  return e;
}

// Pinned host memory of at least `bytes` that a thread reuses: the rows'
// records (80 bytes a row: a pageable copy of them ran at a fraction of the
// bus's speed), or the device reduction's sums and the per-token outputs
// asked for; nullptr where it cannot be had (then pageable memory).
void* PinnedStaging(size_t bytes) {
  struct Staging {
    void* pointer = nullptr;
    size_t bytes = 0;
    ~Staging() {
      if (pointer != nullptr) cudaFreeHost(pointer);
    }
  };
  thread_local Staging staging;
  if (staging.bytes < bytes) {
    if (staging.pointer != nullptr) cudaFreeHost(staging.pointer);
    staging.bytes = 0;
    if (cudaMallocHost(&staging.pointer, bytes) != cudaSuccess) {
      cudaGetLastError();
      staging.pointer = nullptr;
      return nullptr;
    }
    staging.bytes = bytes;
  }
  return staging.pointer;
}

// Enqueues the rows' records of `args` into `device_rows` (allocated here,
// [rows] > 0), on the path `path` asks for, each row's gradient scaled by
// `row_scale`.
absl::Status RunRows(const PostTrainingArgs& args, PostTrainingCudaPath path,
                     const std::vector<float>& row_scale,
                     StreamBlock* device_rows, cudaStream_t stream) {
  const size_t rows = row_scale.size();
  StreamBlock device_scale(stream);
  RETURN_IF_ERROR(Allocate(&device_scale, row_scale.size() * sizeof(float)));
  RETURN_IF_ERROR(Allocate(device_rows, rows * sizeof(PostTrainingCudaRow)));
  auto* records = static_cast<PostTrainingCudaRow*>(device_rows->get());
  RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(device_scale.get(), row_scale.data(),
                                 row_scale.size() * sizeof(float),
                                 cudaMemcpyHostToDevice, stream),
                 "post_training copy row scales"));
  std::optional<cuda_ce::ScheduleChoice> fast;
  if (path == PostTrainingCudaPath::kAuto) {
    RETURN_IF_ERROR(ChooseFast(args, &fast));
  }
  cudaError_t launched = cudaErrorInvalidConfiguration;
  StreamBlock workspace(stream), floats(stream);
  if (fast && DenseTeacher(args)) {
    RETURN_IF_ERROR(Allocate(&workspace, cuda_ce::DenseKdWorkspaceBytes(
                                             args.base.rows, fast->pieces)));
    launched =
        LaunchDense(args, *fast, static_cast<const float*>(device_scale.get()),
                    workspace.get(), records, stream);
  } else if (fast) {
    RETURN_IF_ERROR(
        Allocate(&workspace, CrossEntropyCudaWorkspaceBytes(args.base.rows)));
    if (args.distillation != nullptr) {
      RETURN_IF_ERROR(
          Allocate(&floats, TermsFloats(args, *fast) * sizeof(float)));
    }
    launched = LaunchFast(
        args, *fast, static_cast<const float*>(device_scale.get()),
        workspace.get(), static_cast<float*>(floats.get()), records, stream);
  }
  if (launched == cudaErrorInvalidConfiguration) {
    cudaGetLastError();  // (the fast schedule's refusal, if any)
    launched = PostTrainingCudaLaunch(
        args, static_cast<const float*>(device_scale.get()), records, stream);
  }
  if (launched == cudaErrorInvalidValue) {
    cudaStreamSynchronize(stream);
    return absl::InvalidArgumentError(
        "post_training: the shape is not supported by the GPU kernel");
  }
  return CudaStatus(launched, "post_training launch");
}

// The host's view of a call: the targets and segment ids copied back
// (CopyPostTrainingPlanInputs), and the plan made from them.
struct HostView {
  PostTrainingHostView host;
  PostTrainingPlan plan;
  const PostTrainingArgs& args() const { return host.args; }
};

// Copies the targets and segment ids of `device_args` back and plans.
absl::Status PlanOnHost(const PostTrainingArgs& device_args, HostView* view,
                        cudaStream_t stream) {
  RETURN_IF_ERROR(CopyPostTrainingPlanInputs(device_args, stream, &view->host));
  view->plan = PlanPostTraining(view->host.args);
  return absl::OkStatus();
}

// Where the device reduction's copy back puts each part: the sums, then
// each per-token output asked for, 16-byte aligned (offset 0: not asked).
struct TokenLayout {
  size_t loss = 0, lse = 0, argmax = 0, logprob = 0, entropy = 0, ratio = 0,
         clipped = 0;
  size_t bytes = 0;
};
TokenLayout LayOutTokens(const PostTrainingArgs& args) {
  const size_t rows = static_cast<size_t>(args.base.rows);
  TokenLayout layout;
  layout.bytes = sizeof(PostTrainingSums);
  const auto place = [&](const void* asked, size_t element, size_t* offset) {
    if (asked == nullptr) return;
    layout.bytes = (layout.bytes + 15) / 16 * 16;
    *offset = layout.bytes;
    layout.bytes += rows * element;
  };
  place(args.base.token_loss, sizeof(float), &layout.loss);
  place(args.base.token_lse, sizeof(float), &layout.lse);
  place(args.base.token_argmax, sizeof(int32_t), &layout.argmax);
  place(args.token_logprob, sizeof(float), &layout.logprob);
  place(args.token_entropy, sizeof(float), &layout.entropy);
  place(args.token_ratio, sizeof(float), &layout.ratio);
  place(args.token_clipped, sizeof(uint8_t), &layout.clipped);
  return layout;
}

// The part of `buffer` at `offset`, or nullptr where it is 0 (not asked).
template <typename T>
T* At(void* buffer, size_t offset) {
  return offset == 0
             ? nullptr
             : reinterpret_cast<T*>(static_cast<char*>(buffer) + offset);
}

// The per-token outputs `args` asks for (HOST pointers) from `staging`, laid
// out as `layout` says.
void CopyTokensOut(const PostTrainingArgs& args, const TokenLayout& layout,
                   void* staging) {
  const size_t rows = static_cast<size_t>(args.base.rows);
  const auto copy = [&](void* out, size_t offset, size_t element) {
    if (out != nullptr)
      std::memcpy(out, At<char>(staging, offset), rows * element);
  };
  copy(args.base.token_loss, layout.loss, sizeof(float));
  copy(args.base.token_lse, layout.lse, sizeof(float));
  copy(args.base.token_argmax, layout.argmax, sizeof(int32_t));
  copy(args.token_logprob, layout.logprob, sizeof(float));
  copy(args.token_entropy, layout.entropy, sizeof(float));
  copy(args.token_ratio, layout.ratio, sizeof(float));
  copy(args.token_clipped, layout.clipped, sizeof(uint8_t));
}

// The end of a call without segments on the device, after the kernels that
// wrote `records` [rows > 0] (device): their sums (post_training_reduce.h,
// the z-loss where `z_loss`) and the per-token outputs asked for, one copy
// back, and `result` from them. Synchronizes `stream`.
absl::Status EndOnDevice(const PostTrainingArgs& args,
                         const PostTrainingCudaRow* records, bool z_loss,
                         PostTrainingResult* result, cudaStream_t stream) {
  const TokenLayout layout = LayOutTokens(args);
  std::vector<char> pageable;
  void* staging = PinnedStaging(layout.bytes);
  if (staging == nullptr) {
    pageable.resize(layout.bytes);
    staging = pageable.data();
  }
  StreamBlock device_out(stream);
  RETURN_IF_ERROR(Allocate(&device_out, layout.bytes));
  const bool policy = args.policy != nullptr;
  cudaError_t launched = LaunchPostTrainingReduce(
      records, args.base.rows, policy, z_loss,
      static_cast<PostTrainingSums*>(device_out.get()), stream);
  if (launched == cudaSuccess) {
    PostTrainingCudaTokens tokens;
    void* out = device_out.get();
    tokens.loss = At<float>(out, layout.loss);
    tokens.lse = At<float>(out, layout.lse);
    tokens.argmax = At<int32_t>(out, layout.argmax);
    tokens.logprob = At<float>(out, layout.logprob);
    tokens.entropy = At<float>(out, layout.entropy);
    tokens.ratio = At<float>(out, layout.ratio);
    tokens.clipped = At<uint8_t>(out, layout.clipped);
    launched = LaunchPostTrainingTokens(records, args.base.rows, policy, tokens,
                                        stream);
  }
  RETURN_IF_ERROR(CudaStatus(launched, "post_training reduce"));
  RETURN_IF_ERROR(CopyToHost(staging, device_out.get(), layout.bytes, stream));
  PostTrainingSums sums;
  std::memcpy(&sums, staging, sizeof(sums));
  CopyTokensOut(args, layout, staging);
  *result = FinishUnsegmentedPostTraining(args.base.options, sums);
  return absl::OkStatus();
}

// The fast schedule without segments, whose gradient factor is then the
// prepare kernel's scale (RowTerms::row_scale nullptr): no plan on the host,
// and the call ends on the device. *ran is false where the pieces do not fit
// this device (the caller takes the other path).
absl::Status RunFastUnsegmented(const PostTrainingArgs& args,
                                const cuda_ce::ScheduleChoice& choice,
                                PostTrainingResult* result, bool* ran,
                                cudaStream_t stream) {
  *ran = false;
  const size_t rows = static_cast<size_t>(args.base.rows);
  StreamBlock device_rows(stream), workspace(stream), floats(stream);
  RETURN_IF_ERROR(Allocate(&device_rows, rows * sizeof(PostTrainingCudaRow)));
  RETURN_IF_ERROR(
      Allocate(&workspace, CrossEntropyCudaWorkspaceBytes(args.base.rows)));
  if (args.distillation != nullptr) {
    RETURN_IF_ERROR(
        Allocate(&floats, TermsFloats(args, choice) * sizeof(float)));
  }
  auto* records = static_cast<PostTrainingCudaRow*>(device_rows.get());
  const cudaError_t launched =
      LaunchFast(args, choice, nullptr, workspace.get(),
                 static_cast<float*>(floats.get()), records, stream);
  if (launched == cudaErrorInvalidConfiguration) {
    cudaGetLastError();
    return CudaStatus(cudaStreamSynchronize(stream), "post_training sync");
  }
  RETURN_IF_ERROR(CudaStatus(launched, "post_training launch"));
  // (the fast schedule takes no z-loss: its records leave that field unset)
  RETURN_IF_ERROR(EndOnDevice(args, records, /*z_loss=*/false, result, stream));
  *ran = true;
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckPostTrainingCudaSupport(const PostTrainingArgs& args) {
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
    // (the smem row pieces leave it unwritten: they take no z-loss)
    t.z_loss = base.options.z_loss_scale != 0.0f ? r.z_loss : 0.0;
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
                              PostTrainingResult* result, cudaStream_t stream,
                              PostTrainingCudaPath path) {
  if (result == nullptr) {
    return absl::InvalidArgumentError("post_training: result is nullptr");
  }
  RETURN_IF_ERROR(ValidatePostTrainingArgs(device_args));
  const CrossEntropyArgs& base = device_args.base;
  const int64_t rows = base.rows;
  RETURN_IF_ERROR(CheckPostTrainingCudaSupport(device_args));

  if (rows > 0 && path == PostTrainingCudaPath::kAuto) {
    std::optional<cuda_ce::ScheduleChoice> fast;
    RETURN_IF_ERROR(ChooseFast(device_args, &fast));
    // (a dense teacher's pieces take each row's factor from the plan)
    if (fast && device_args.segments == nullptr && !DenseTeacher(device_args)) {
      bool ran = false;
      RETURN_IF_ERROR(
          RunFastUnsegmented(device_args, *fast, result, &ran, stream));
      if (ran) return absl::OkStatus();
    }
  }

  // The plan first: the kernels need each row's factor.
  HostView view;
  RETURN_IF_ERROR(PlanOnHost(device_args, &view, stream));
  std::vector<PostTrainingCudaRow> pageable;
  PostTrainingCudaRow* out = nullptr;
  if (rows > 0) {
    std::vector<float> row_scale(static_cast<size_t>(rows));
    for (int64_t row = 0; row < rows; ++row) {
      row_scale[row] = static_cast<float>(view.plan.row_scale[row] *
                                          base.options.grad_scale);
    }
    StreamBlock device_rows(stream);
    RETURN_IF_ERROR(
        RunRows(device_args, path, row_scale, &device_rows, stream));
    const auto* records =
        static_cast<const PostTrainingCudaRow*>(device_rows.get());
    if (device_args.segments == nullptr) {
      // (only the row kernel takes a z-loss, and writes it)
      return EndOnDevice(device_args, records,
                         base.options.z_loss_scale != 0.0f, result, stream);
    }
    const size_t bytes =
        static_cast<size_t>(rows) * sizeof(PostTrainingCudaRow);
    out = static_cast<PostTrainingCudaRow*>(PinnedStaging(bytes));
    if (out == nullptr) {
      pageable.resize(static_cast<size_t>(rows));
      out = pageable.data();
    }
    RETURN_IF_ERROR(CopyToHost(out, records, bytes, stream));
  }

  // Reused by the thread up to 64Ki rows: a fresh 80 bytes a row, zeroed,
  // cost more than the reduction itself (its pages; Collect sets every
  // field).
  thread_local std::vector<PostTrainingRowTotals> reused;
  std::vector<PostTrainingRowTotals> fresh;
  std::vector<PostTrainingRowTotals>& totals =
      rows <= (int64_t{1} << 16) ? reused : fresh;
  totals.resize(static_cast<size_t>(rows));
  CollectPostTrainingCudaRows(device_args, out, totals.data());
  *result = ReducePostTrainingRows(view.args(), view.plan, totals);
  return absl::OkStatus();
}

}  // namespace lossd
