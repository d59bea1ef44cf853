// CrossEntropyCudaLaunch: fills the kernels' Params, asks the schedule policy
// (schedule_policy.h, the one table of that decision) for a schedule and its
// sizes, and enqueues prepare, the schedule and finalize.
#include "kernels/cuda/dispatch.h"

#include <climits>
#include <cstdint>
#include <optional>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/align_up.h"
#include "kernels/cuda/cross_entropy_cuda.h"
#include "kernels/cuda/device_limits.h"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/schedule_policy.h"
#include "kernels/cuda/schedules.h"

namespace lossd {
namespace {

using cuda_ce::DeviceLimits;
using cuda_ce::kHeaderBytes;
using cuda_ce::kMaxPieces;
using cuda_ce::Params;
using cuda_ce::Schedule;
using cuda_ce::ScheduleChoice;
using cuda_ce::ScheduleShape;

// The policy's schedules are the named ones less kAuto.
constexpr bool SameSchedule(Schedule a, CrossEntropyCudaSchedule b) {
  return static_cast<int>(a) == static_cast<int>(b);
}
static_assert(SameSchedule(Schedule::kGenericRows,
                           CrossEntropyCudaSchedule::kGenericRows));
static_assert(SameSchedule(Schedule::kClusterRegisterRows,
                           CrossEntropyCudaSchedule::kClusterRegisterRows));
static_assert(SameSchedule(Schedule::kClusterStreamRows,
                           CrossEntropyCudaSchedule::kClusterStreamRows));
static_assert(SameSchedule(Schedule::kClusterSliceRows,
                           CrossEntropyCudaSchedule::kClusterSliceRows));
static_assert(SameSchedule(Schedule::kSplitRowForward,
                           CrossEntropyCudaSchedule::kSplitRowForward));
static_assert(SameSchedule(Schedule::kL2RowPieces,
                           CrossEntropyCudaSchedule::kL2RowPieces));
static_assert(SameSchedule(Schedule::kSmemRowPieces,
                           CrossEntropyCudaSchedule::kSmemRowPieces));

// A device's limits, queried once: every launch asks (the server's streams,
// from several threads).
class DeviceLimitsCache {
 public:
  DeviceLimitsCache() = default;
  DeviceLimitsCache(const DeviceLimitsCache&) = delete;
  DeviceLimitsCache& operator=(const DeviceLimitsCache&) = delete;

  // `device`'s limits: cudaSuccess, or cudaDeviceGetAttribute's error.
  cudaError_t Get(int device, DeviceLimits* limits) {
    {
      absl::MutexLock lock(&mu_);
      const auto it = limits_.find(device);
      if (it != limits_.end()) {
        *limits = it->second;
        return cudaSuccess;
      }
    }
    // Outside the lock (two threads may both ask once; same answer). Errors
    // are not kept: the next launch asks again.
    DeviceLimits d;  // (the pieces kernel's fields: its sm_90 builds)
    cudaError_t e =
        cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess) {
      e = cudaDeviceGetAttribute(&d.smem_per_block_optin,
                                 cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                 device);
    }
    if (e == cudaSuccess) {
      e = cudaDeviceGetAttribute(
          &d.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    }
    if (e == cudaSuccess) {
      e = cudaDeviceGetAttribute(&d.smem_reserved_per_block,
                                 cudaDevAttrReservedSharedMemoryPerBlock,
                                 device);
    }
    if (e != cudaSuccess) return e;
    absl::MutexLock lock(&mu_);
    limits_[device] = d;
    *limits = d;
    return cudaSuccess;
  }

 private:
  absl::Mutex mu_;
  std::unordered_map<int, DeviceLimits> limits_ ABSL_GUARDED_BY(mu_);
};

// Launches the schedule `c` names, sized as it says.
cudaError_t LaunchSchedule(const ScheduleChoice& c, DType dtype, Params p,
                           cudaStream_t stream) {
  p.chunk = c.chunk;
  switch (c.schedule) {
    case Schedule::kGenericRows:
      return cuda_ce::LaunchGenericRows(p, dtype, stream);
    case Schedule::kClusterRegisterRows: {
      const cudaError_t e = cuda_ce::LaunchClusterRegisterRows(
          p, dtype, c.general, c.vectors_per_thread, c.cluster, stream);
      if (e == cudaSuccess || e == cudaErrorInvalidValue) return e;
      // Whether this device schedules a cluster of that many blocks of that
      // size is known only when it is launched (a MIG slice, another GPU):
      // the one fallback on a launch error; generic rows take any row.
      cudaGetLastError();
      return cuda_ce::LaunchGenericRows(p, dtype, stream);
    }
    case Schedule::kClusterStreamRows:
      return cuda_ce::LaunchClusterStreamRows(p, dtype, c.cluster, stream);
    case Schedule::kClusterSliceRows:
      return cuda_ce::LaunchClusterSliceRows(p, dtype, c.cluster, stream);
    case Schedule::kSplitRowForward:
      return cuda_ce::LaunchSplitRowForward(p, dtype, c.edges, c.pieces,
                                            stream);
    case Schedule::kL2RowPieces:
      return cuda_ce::LaunchL2RowPieces(p, dtype, c.pieces, c.group_rows,
                                        stream);
    case Schedule::kSmemRowPieces:
      // (its launcher asks the occupancy API again and refuses a shape
      // that does not fit: cudaErrorInvalidConfiguration)
      return cuda_ce::LaunchSmemRowPieces(p, dtype, c.bulk, c.edges, c.pieces,
                                          stream);
  }
  return cudaErrorInvalidValue;
}

// The schedule for `s`: the policy's choice on this device, or the one
// `config` names (nullopt where it cannot take the shape).
cudaError_t Choose(const ScheduleShape& s, const CrossEntropyCudaConfig& config,
                   std::optional<ScheduleChoice>* choice) {
  const cuda_ce::ScheduleKnobs knobs{
      config.piece_kib, config.vectors_per_thread, config.group_mib};
  if (config.schedule != CrossEntropyCudaSchedule::kAuto) {
    const int named = static_cast<int>(config.schedule);
    *choice =
        named >= static_cast<int>(Schedule::kGenericRows) &&
                named <= static_cast<int>(Schedule::kSmemRowPieces)
            ? cuda_ce::SizeSchedule(static_cast<Schedule>(named), s, knobs)
            : std::nullopt;
    return cudaSuccess;
  }
  DeviceLimits limits;
  const cudaError_t e = cuda_ce::CurrentDeviceLimits(&limits);
  if (e != cudaSuccess) return e;
  *choice = cuda_ce::ChooseSchedule(s, limits);
  if (knobs.piece_kib > 0 || knobs.vectors_per_thread > 0 ||
      knobs.group_mib > 0) {
    // The knobs size whichever schedule the policy chose.
    *choice = cuda_ce::SizeSchedule((*choice)->schedule, s, knobs);
  }
  return cudaSuccess;
}

}  // namespace

namespace cuda_ce {
Params FillParams(const CrossEntropyArgs& args, void* workspace) {
  Params p = {};
  p.logits = args.logits;
  p.grad = args.mode == GradientMode::kNone ? nullptr : args.gradient;
  p.targets = args.targets;
  p.weights = args.class_weights;
  p.token_loss = args.token_loss;
  p.token_lse = args.token_lse;
  p.token_argmax = args.token_argmax;
  if (workspace != nullptr) {
    char* ws = static_cast<char*>(workspace);
    const std::size_t col = AlignUp(static_cast<std::size_t>(args.rows) * 4);
    p.header = reinterpret_cast<cuda_ce::WorkspaceHeader*>(ws);
    p.row_loss = reinterpret_cast<float*>(ws + kHeaderBytes);
    p.row_zloss = reinterpret_cast<float*>(ws + kHeaderBytes + col);
    p.row_flags = reinterpret_cast<int*>(ws + kHeaderBytes + 2 * col);
    p.row_done = reinterpret_cast<int*>(ws + kHeaderBytes + 3 * col);
    p.row_zy = reinterpret_cast<float*>(ws + kHeaderBytes + 4 * col);
    p.pieces = ws + kHeaderBytes + 5 * col;
    p.piece_wz =
        reinterpret_cast<float*>(ws + kHeaderBytes + 5 * col +
                                 AlignUp(static_cast<std::size_t>(args.rows) *
                                         kMaxPieces * cuda_ce::kStatsBytes));
  }
  p.rows = args.rows;
  p.stride = args.row_stride;
  p.ignore_index = args.options.ignore_index;
  p.normalizer = args.options.normalizer;
  p.vocab = static_cast<int>(args.vocab);
  p.targets64 = args.targets_dtype == DType::kInt64 ? 1 : 0;
  p.reduction = static_cast<int>(args.options.reduction);
  p.eps = args.options.label_smoothing;
  p.zls = args.options.z_loss_scale;
  p.softcap = args.options.softcap;
  p.grad_scale = args.options.grad_scale;
  return p;
}

ScheduleShape ShapeOf(const Params& p, DType dtype) {
  const int esize = static_cast<int>(DTypeSize(dtype));
  const auto aligned = [](const void* ptr) {
    return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0;
  };
  ScheduleShape s;
  s.element_bytes = esize;
  s.rows = p.rows;
  s.vocab = p.vocab;
  s.forward_only = p.grad == nullptr;
  s.in_place = p.grad == p.logits;
  s.options_on = p.softcap > 0 || p.weights != nullptr || p.eps > 0;
  s.aligned_rows = aligned(p.logits) &&
                   (p.grad == nullptr || aligned(p.grad)) &&
                   (p.stride * esize) % 16 == 0;
  s.whole_vectors = s.aligned_rows && p.vocab % s.VectorElements() == 0;
  s.edges_ok =
      p.grad == nullptr || (reinterpret_cast<std::uintptr_t>(p.grad) -
                            reinterpret_cast<std::uintptr_t>(p.logits)) %
                                   16 ==
                               0;
  return s;
}

cudaError_t CurrentDeviceLimits(DeviceLimits* limits) {
  static DeviceLimitsCache* const cache = new DeviceLimitsCache;
  int device = 0;
  const cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  return cache->Get(device, limits);
}

}  // namespace cuda_ce

std::size_t CrossEntropyCudaWorkspaceBytes(int64_t rows) {
  const std::size_t n = rows > 0 ? static_cast<std::size_t>(rows) : 0;
  return kHeaderBytes + 5 * AlignUp(n * 4) +
         AlignUp(n * kMaxPieces * cuda_ce::kStatsBytes) +
         AlignUp(n * kMaxPieces * sizeof(float));
}

cudaError_t CrossEntropyCudaLaunch(const CrossEntropyArgs& args,
                                   CrossEntropyCudaResult* device_result,
                                   void* workspace, std::size_t workspace_bytes,
                                   cudaStream_t stream,
                                   const CrossEntropyCudaConfig* config) {
  if (workspace_bytes < CrossEntropyCudaWorkspaceBytes(args.rows) ||
      args.vocab <= 0 || args.vocab > INT_MAX || args.rows < 0 ||
      args.rows > INT_MAX || device_result == nullptr ||
      !IsLogitsDType(args.logits_dtype)) {
    return cudaErrorInvalidValue;
  }
  Params p = cuda_ce::FillParams(args, workspace);
  cudaError_t e = cuda_ce::LaunchPrepare(p, stream);
  if (e != cudaSuccess) return e;
  if (args.rows > 0) {
    const ScheduleShape s = cuda_ce::ShapeOf(p, args.logits_dtype);
    std::optional<ScheduleChoice> choice;
    e = Choose(s, config ? *config : CrossEntropyCudaConfig{}, &choice);
    if (e != cudaSuccess) return e;
    if (!choice) return cudaErrorInvalidValue;
    e = LaunchSchedule(*choice, args.logits_dtype, p, stream);
    if (e != cudaSuccess) return e;
  }
  return cuda_ce::LaunchFinalize(p, device_result, stream);
}

}  // namespace lossd
