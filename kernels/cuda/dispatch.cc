// CrossEntropyCudaLaunch: fills the kernels' Params, picks the schedule for
// the shape, dtype and options (ChooseSchedule, the one table of that
// decision), sizes it, and enqueues prepare, the schedule and finalize.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/cuda/cross_entropy_cuda.h"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/schedules.h"

namespace lossd {
namespace {

using cuda_ce::kHeaderBytes;
using cuda_ce::kMaxCluster;
using cuda_ce::kMaxPieces;
using cuda_ce::kThreads;
using cuda_ce::Params;
using Schedule = CrossEntropyCudaSchedule;

constexpr long long kKiB = 1024;

// What the choice depends on.
struct Shape {
  DType dtype;
  int esize;  // bytes an element
  int vec;    // elements a 16-byte vector
  long long rows;
  int vocab;
  long long row_bytes;
  bool forward_only;
  bool in_place;
  // Softcap, class weights or label smoothing: cluster register rows take
  // them in their general build (every other schedule in all its builds).
  bool general;
  // Logits (and gradient) 16-byte aligned and a row stride of whole 16-byte
  // vectors: every row starts on a vector.
  bool aligned_rows;
  // ... and the vocab a whole number of vectors too (the schedules that copy
  // or keep whole vectors of a row need it).
  bool whole_vectors;
  // The gradient (if any) as far from a 16-byte boundary as the logits: the
  // schedules that handle a row's unaligned edges themselves (smem row
  // pieces, split row forward) take any row then.
  bool edges_ok;
};

// A row of `vocab` elements cut into at most kMaxPieces pieces of about
// `piece_kib` KiB (`default_kib` when 0), each a whole number of vectors; the
// last piece may be shorter.
struct RowPieces {
  int chunk;   // elements a piece
  int pieces;  // pieces a row
};
RowPieces SplitRow(const Shape& s, int piece_kib, int default_kib) {
  const long long piece = (piece_kib > 0 ? piece_kib : default_kib) * kKiB;
  const long long per_row = std::min<long long>(
      kMaxPieces, std::max<long long>(1, (s.row_bytes + piece - 1) / piece));
  const long long chunk =
      ((s.vocab + per_row - 1) / per_row + s.vec - 1) / s.vec * s.vec;
  return {static_cast<int>(chunk),
          static_cast<int>((s.vocab + chunk - 1) / chunk)};
}

// A row cut into `cluster` slices of `chunk` elements, one a block.
struct ClusterSlices {
  int chunk;
  int cluster;
};
// Slices of about `slice_kib` KiB (default 32), whole vectors; cluster may
// come out past kMaxCluster (then the shape does not fit).
ClusterSlices SliceRows(const Shape& s, int slice_kib) {
  const long long slice = (slice_kib > 0 ? slice_kib : 32) * kKiB;
  const long long csize =
      std::max<long long>(1, (s.row_bytes + slice - 1) / slice);
  const long long chunk =
      ((s.vocab + csize - 1) / csize + s.vec - 1) / s.vec * s.vec;
  return {static_cast<int>(chunk),
          static_cast<int>((s.vocab + chunk - 1) / chunk)};
}
// Slices of about `slice_kib` KiB (default 128), a whole number of 256-vector
// batches each, at most kMaxCluster (slices grow past slice_kib instead).
ClusterSlices StreamRows(const Shape& s, int slice_kib) {
  const long long slice = (slice_kib > 0 ? slice_kib : 128) * kKiB;
  long long csize = std::min<long long>(
      kMaxCluster, std::max<long long>(1, (s.row_bytes + slice - 1) / slice));
  const long long unit = static_cast<long long>(kThreads) * s.vec;
  const long long chunk =
      ((s.vocab + csize - 1) / csize + unit - 1) / unit * unit;
  return {static_cast<int>(chunk),
          static_cast<int>((s.vocab + chunk - 1) / chunk)};
}
// Register rows: `vpt` vectors a thread (0: the largest slice, 16 vectors, 64
// KiB a block, measured fastest at every vocab since fewer blocks a row mean
// fewer cluster barriers; rows that fit one smaller block take that).
struct RegisterRows {
  int vpt;
  long long chunk;
  long long cluster;
};
RegisterRows RegisterSlices(const Shape& s, int vpt) {
  if (vpt == 0) {
    vpt = 16;
    for (int v = 1; v < 16; v *= 2) {
      if (s.vocab <= v * kThreads * s.vec) {
        vpt = v;
        break;
      }
    }
  }
  const long long chunk = static_cast<long long>(vpt) * kThreads * s.vec;
  return {vpt, chunk, (s.vocab + chunk - 1) / chunk};
}
bool RegisterRowsFit(const Shape& s, const RegisterRows& r) {
  return s.aligned_rows && r.cluster <= kMaxCluster &&
         s.rows * r.cluster <= INT_MAX;
}

// The decision, measured on the H200 (bench/NOTES.md, bench/RESULTS.md):
//
//   mode          rows                                 schedule
//   forward only  >= 32 KiB                            split row forward
//   fwd+gradient  2-byte >= 32 KiB or fp32 >= 120 KiB
//                 and its pieces fit                   smem row pieces
//                 else whole vectors, 2-byte in place  L2 row pieces
//   fwd+gradient  whole vectors, 32-512 KiB            cluster slice rows
//   fwd+gradient  aligned, > 160 KiB                   cluster stream rows
//   any           shorter rows, aligned, <= 16 x 64 KiB  cluster register rows
//   any           otherwise                            generic rows
//
// Every schedule takes every option (softcap, class weights, label
// smoothing, z-loss): those with per-element work run each schedule's option
// build (ElementOptionsOn), the rest its plain one.
//
// Split row forward and smem row pieces take rows of any alignment and vocab
// (their edges one element at a time: the gradient must then sit as far from
// a 16-byte boundary as the logits); the cluster schedules need rows that
// start on 16-byte vectors ("aligned") and some a vocab of whole vectors.
// Forward only falls back to cluster stream rows (aligned rows) only past
// INT_MAX blocks. The smem row pieces need a piece (about 48 KiB, more past 32
// pieces a row) to fit a block's shared memory: rows up to ~6 MiB on the H200.
// fp32 rows under 120 KiB measured faster on cluster slice rows (87-88% of copy
// against 85-86% at V = 32000 before session 9; see NOTES.md).
Schedule ChooseSchedule(const Shape& s, const Params& p, cudaError_t* error) {
  *error = cudaSuccess;
  {
    if (s.forward_only && s.row_bytes >= 32 * kKiB) {
      if ((s.whole_vectors || s.edges_ok) &&
          s.rows * SplitRow(s, 0, 256).pieces <= INT_MAX) {
        return Schedule::kSplitRowForward;
      }
      if (s.aligned_rows && s.rows * StreamRows(s, 0).cluster <= INT_MAX) {
        return Schedule::kClusterStreamRows;
      }
    }
    if (!s.forward_only && (s.whole_vectors || s.edges_ok) &&
        s.row_bytes >= (s.esize == 2 ? 32 : 120) * kKiB) {
      Params q = p;
      const RowPieces rp = SplitRow(s, 0, 48);
      q.chunk = rp.chunk;
      bool fits = false;
      *error = cuda_ce::SmemRowPiecesFit(
          q, s.dtype, /*bulk=*/!s.in_place || s.esize == 4 || !s.whole_vectors,
          /*edges=*/!s.whole_vectors, rp.pieces, &fits);
      if (*error != cudaSuccess) return Schedule::kAuto;
      if (fits) return Schedule::kSmemRowPieces;
      if (s.whole_vectors && s.esize == 2 && s.in_place) {
        return Schedule::kL2RowPieces;
      }
    }
    if (!s.forward_only && s.whole_vectors && s.row_bytes >= 32 * kKiB &&
        SliceRows(s, 0).cluster <= kMaxCluster) {
      return Schedule::kClusterSliceRows;
    }
    if (!s.forward_only && s.aligned_rows && s.row_bytes > 160 * kKiB &&
        s.rows * StreamRows(s, 0).cluster <= INT_MAX) {
      return Schedule::kClusterStreamRows;
    }
  }
  return RegisterRowsFit(s, RegisterSlices(s, 0))
             ? Schedule::kClusterRegisterRows
             : Schedule::kGenericRows;
}

// Sizes `schedule` for the shape (config may set its piece size) and
// launches it. cudaErrorInvalidValue where the schedule cannot take the shape
// (only a config can ask for that).
cudaError_t LaunchSchedule(Schedule schedule, const Shape& s, Params p,
                           const CrossEntropyCudaConfig& config,
                           cudaStream_t stream) {
  switch (schedule) {
    case Schedule::kGenericRows:
      return cuda_ce::LaunchGenericRows(p, s.dtype, stream);
    case Schedule::kClusterRegisterRows: {
      const RegisterRows r = RegisterSlices(s, config.vectors_per_thread);
      if (!RegisterRowsFit(s, r)) {
        // Unaligned rows, or a cluster past 16 blocks: as the automatic
        // choice does for such rows.
        return cuda_ce::LaunchGenericRows(p, s.dtype, stream);
      }
      p.chunk = static_cast<int>(r.chunk);
      const cudaError_t e = cuda_ce::LaunchClusterRegisterRows(
          p, s.dtype, s.general, r.vpt, static_cast<int>(r.cluster), stream);
      if (e == cudaSuccess || e == cudaErrorInvalidValue) return e;
      // Whether this device schedules a cluster of that many blocks of that
      // size is known only when it is launched (a MIG slice, another GPU):
      // the one fallback on a launch error; generic rows take any row.
      cudaGetLastError();
      return cuda_ce::LaunchGenericRows(p, s.dtype, stream);
    }
    case Schedule::kClusterStreamRows: {
      const ClusterSlices c = StreamRows(s, config.piece_kib);
      if (!s.aligned_rows || s.rows * c.cluster > INT_MAX) {
        return cudaErrorInvalidValue;
      }
      p.chunk = c.chunk;
      return cuda_ce::LaunchClusterStreamRows(p, s.dtype, c.cluster, stream);
    }
    case Schedule::kClusterSliceRows: {
      const ClusterSlices c = SliceRows(s, config.piece_kib);
      if (!s.whole_vectors || c.cluster > kMaxCluster) {
        return cudaErrorInvalidValue;
      }
      p.chunk = c.chunk;
      return cuda_ce::LaunchClusterSliceRows(p, s.dtype, c.cluster, stream);
    }
    case Schedule::kSplitRowForward: {
      const RowPieces rp = SplitRow(s, config.piece_kib, 256);
      if (!s.forward_only || s.rows * rp.pieces > INT_MAX) {
        return cudaErrorInvalidValue;
      }
      p.chunk = rp.chunk;
      return cuda_ce::LaunchSplitRowForward(
          p, s.dtype, /*edges=*/!s.whole_vectors, rp.pieces, stream);
    }
    case Schedule::kL2RowPieces: {
      const RowPieces rp = SplitRow(s, config.piece_kib, 64);
      if (s.forward_only || !s.whole_vectors || s.esize != 2) {
        return cudaErrorInvalidValue;
      }
      const long long group_bytes =
          static_cast<long long>(config.group_mib > 0 ? config.group_mib : 4)
          << 20;
      const long long group_rows = std::min<long long>(
          std::max<long long>(1, group_bytes / s.row_bytes), s.rows);
      p.chunk = rp.chunk;
      return cuda_ce::LaunchL2RowPieces(p, s.dtype, rp.pieces,
                                        static_cast<int>(group_rows), stream);
    }
    case Schedule::kSmemRowPieces: {
      const RowPieces rp = SplitRow(s, config.piece_kib, 48);
      if (s.forward_only || !(s.whole_vectors || s.edges_ok)) {
        return cudaErrorInvalidValue;
      }
      p.chunk = rp.chunk;
      // Pieces come in by bulk copies (bench/NOTES.md "v9, session 9": fp32
      // 87-91% -> 89.5-93% of copy, bf16 out of place 87.7% -> 88.8% on
      // average) except 2-byte logits in place, where the threads' own loads
      // measured the same or better (89.1 / 88.6 / 89.1% against 87.1 / 89.3
      // / 89.1% at 8192x128256 / 4096x262144 / 16384x131072, means of 5).
      // Rows with edges: bulk copies always (the threads' loads build spills
      // there).
      const bool bulk = s.esize == 4 || !s.in_place || !s.whole_vectors;
      return cuda_ce::LaunchSmemRowPieces(
          p, s.dtype, bulk, /*edges=*/!s.whole_vectors, rp.pieces, stream);
    }
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

std::size_t CrossEntropyCudaWorkspaceBytes(int64_t rows) {
  const std::size_t n = rows > 0 ? static_cast<std::size_t>(rows) : 0;
  return kHeaderBytes + 5 * cuda_ce::AlignUp(n * 4) +
         cuda_ce::AlignUp(n * kMaxPieces * cuda_ce::kStatsBytes) +
         cuda_ce::AlignUp(n * kMaxPieces * sizeof(float));
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
  Params p = {};
  p.logits = args.logits;
  p.grad = args.mode == GradientMode::kNone ? nullptr : args.gradient;
  p.targets = args.targets;
  p.weights = args.class_weights;
  p.token_loss = args.token_loss;
  p.token_lse = args.token_lse;
  p.token_argmax = args.token_argmax;
  char* ws = static_cast<char*>(workspace);
  const std::size_t col =
      cuda_ce::AlignUp(static_cast<std::size_t>(args.rows) * 4);
  p.header = reinterpret_cast<cuda_ce::WorkspaceHeader*>(ws);
  p.row_loss = reinterpret_cast<float*>(ws + kHeaderBytes);
  p.row_zloss = reinterpret_cast<float*>(ws + kHeaderBytes + col);
  p.row_flags = reinterpret_cast<int*>(ws + kHeaderBytes + 2 * col);
  p.row_done = reinterpret_cast<int*>(ws + kHeaderBytes + 3 * col);
  p.row_zy = reinterpret_cast<float*>(ws + kHeaderBytes + 4 * col);
  p.pieces = ws + kHeaderBytes + 5 * col;
  p.piece_wz = reinterpret_cast<float*>(
      ws + kHeaderBytes + 5 * col +
      cuda_ce::AlignUp(static_cast<std::size_t>(args.rows) * kMaxPieces *
                       cuda_ce::kStatsBytes));
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

  cudaError_t e = cuda_ce::LaunchPrepare(p, stream);
  if (e != cudaSuccess) return e;
  if (args.rows > 0) {
    const int esize = static_cast<int>(DTypeSize(args.logits_dtype));
    const auto aligned = [](const void* ptr) {
      return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0;
    };
    Shape s;
    s.dtype = args.logits_dtype;
    s.esize = esize;
    s.vec = 16 / esize;
    s.rows = args.rows;
    s.vocab = p.vocab;
    s.row_bytes = static_cast<long long>(p.vocab) * esize;
    s.forward_only = p.grad == nullptr;
    s.in_place = p.grad == p.logits;
    s.general = p.softcap > 0 || p.weights != nullptr || p.eps > 0;
    s.aligned_rows = aligned(p.logits) &&
                     (p.grad == nullptr || aligned(p.grad)) &&
                     (p.stride * esize) % 16 == 0;
    s.whole_vectors = s.aligned_rows && p.vocab % s.vec == 0;
    s.edges_ok =
        p.grad == nullptr || (reinterpret_cast<std::uintptr_t>(p.grad) -
                              reinterpret_cast<std::uintptr_t>(p.logits)) %
                                     16 ==
                                 0;
    const CrossEntropyCudaConfig cfg =
        config ? *config : CrossEntropyCudaConfig{};
    Schedule schedule = cfg.schedule;
    if (schedule == Schedule::kAuto) {
      schedule = ChooseSchedule(s, p, &e);
      if (e != cudaSuccess) return e;
    }
    e = LaunchSchedule(schedule, s, p, cfg, stream);
    if (e != cudaSuccess) return e;
  }
  return cuda_ce::LaunchFinalize(p, device_result, stream);
}

}  // namespace lossd
