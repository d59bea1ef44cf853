// The linear cross-entropy in the Hopper GEMM's epilogue
// (fused_linear_forward.h): the statistics epilogue, the merge of a row's
// tiles, the launch between the cross-entropy's prepare and finalize, and the
// gradient path's store of Z and split of G.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/align_up.h"
#include "kernels/cuda/dispatch.h"
#include "kernels/cuda/element_traits.cuh"
#include "kernels/cuda/fused_linear_forward.h"
#include "kernels/cuda/gemm_sm90.cuh"
#include "kernels/cuda/gemm_sm90.h"
#include "kernels/cuda/gemm_sm90_store.cuh"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/row_math.cuh"
#include "kernels/cuda/schedules.h"
#include "kernels/cuda/slice_stats.cuh"
#include "kernels/cuda/sparse_residual.h"
#include "kernels/cuda/sparse_residual_record.cuh"

namespace lossd {
namespace {

using cuda_ce::Stats;

int ColumnTiles(int64_t vocab) {
  return static_cast<int>((vocab + cuda_gemm::kTileCols - 1) /
                          cuda_gemm::kTileCols);
}

// Shape: a consumer thread holds 64 values of each of two rows (8 apart) of
// a 128 x 256 tile of Z (FragmentCoords); the quad of lanes 4q .. 4q + 3
// holds a row's 256 columns. Each row's statistics over the tile (Stats: max
// at its first column, the sum of exp(z - max) over the other columns, sum
// of w_c z_c) are the thread's, then two quad shuffles, written by the quad's
// first lane to partials[row, tile]; the tile holding a row's target writes
// its z to p.row_zy. z = accumulator + bias, softcapped in build kOpts, and
// -inf past the vocabulary (never the max, exp() = 0). The exponentials are
// of (z - max) * log2e: z - max is exact near the max, where the terms count.
//
// The tensor cores wait while both warpgroups run this, so each value costs
// as few instructions as the statistics allow: the first pass only raises
// the max, the second finds the first column equal
// to it and sums the other columns' exponentials, counting the max's other
// ties as the 1 each adds; the tile test (kFull) and the bias (kBias) are
// builds, and the target compare runs only in the quads whose row's target
// falls in the tile.
template <int kOpts>
struct LossStatsEpilogue {
  static constexpr int kStagingBytes = 0;  // no Z: the ring gets 4 stages
  static constexpr int kRowValues = cuda_gemm::kFragmentValues / 2;
  cuda_ce::Params p;
  const float* bias;  // fp32 [vocab], 8-byte aligned, or null
  int col_tiles;
  Stats* partials;  // [rows, col_tiles]

  // Value j (0 .. 63, column order) of the row of `half` in the fragment.
  __device__ __forceinline__ static int Index(int half, int j) {
    return (j >> 1) * 4 + 2 * half + (j & 1);
  }

  template <bool kFull, bool kBias>
  __device__ __forceinline__ Stats
  RowStats(float (&acc)[cuda_gemm::kFragmentValues],
           const cuda_gemm::FragmentCoords& at, int half, int tile_col, int y,
           const cuda_ce::ElementOptions& opts) const {
    const int cols = p.vocab;
    // Four chains each for the max, the sum of w_c z_c and the sum of
    // exponentials (value j in chain j % 4), combined in a fixed order: the
    // epilogue is latency-bound with two warps a scheduler.
    float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    float wz[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < kRowValues; j += 2) {
      const int i = Index(half, j);
      const int c = at.ColOf(i);
      float2 b = make_float2(0.0f, 0.0f);
      if (kBias && (kFull || c < cols)) {
        // c is even: the pair (c, c + 1) is one 8-byte load, c + 1 < cols
        // wherever the vocabulary is even or c + 1 is not its last column.
        if (kFull || c + 1 < cols) {
          b = __ldg(reinterpret_cast<const float2*>(bias + c));
        } else {
          b.x = __ldg(bias + c);
        }
      }
      float z0 = cuda_ce::OptionZ<float, kOpts>(opts, acc[i] + b.x);
      float z1 = cuda_ce::OptionZ<float, kOpts>(opts, acc[i + 1] + b.y);
      const int k = j % 4;  // (0 or 2: the pair's chains are k, k + 1)
      if (kOpts & cuda_ce::kOptSmoothing) {
        if (kFull || c < cols) {
          wz[k] = fmaf(cuda_ce::OptionWeight<kOpts>(opts, c), z0, wz[k]);
        }
        if (kFull || c + 1 < cols) {
          wz[k + 1] =
              fmaf(cuda_ce::OptionWeight<kOpts>(opts, c + 1), z1, wz[k + 1]);
        }
      }
      if (!kFull) {
        z0 = c < cols ? z0 : -INFINITY;
        z1 = c + 1 < cols ? z1 : -INFINITY;
      }
      acc[i] = z0;
      acc[i + 1] = z1;
      m[k] = fmaxf(m[k], z0);
      m[k + 1] = fmaxf(m[k + 1], z1);
    }
    const float row_max = fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
    if (y >= tile_col && y < tile_col + cuda_gemm::kTileCols) {
#pragma unroll
      for (int j = 0; j < kRowValues; ++j) {
        const int i = Index(half, j);
        if (at.ColOf(i) == y) p.row_zy[at.RowOf(i)] = acc[i];
      }
    }
    // With no finite z (every column past the vocabulary) the slice is
    // empty; a NaN seen anywhere makes the sum NaN.
    const float shift = row_max == -INFINITY ? 0.0f : row_max;
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int first = kRowValues;  // the first j holding the max
    int ties = 0;
#pragma unroll
    for (int j = 0; j < kRowValues; ++j) {
      const float z = acc[Index(half, j)];
      const float e = cuda_ce::Exp2((z - shift) * cuda_ce::kLog2e);
      if (z == row_max) {
        first = min(first, j);
        ++ties;
      } else {
        t[j % 4] += e;
      }
    }
    Stats s;
    s.m = row_max;
    s.sum_wz = (wz[0] + wz[1]) + (wz[2] + wz[3]);
    const float sum = (t[0] + t[1]) + (t[2] + t[3]);
    if (row_max == -INFINITY) {
      s.t = isnan(sum) ? sum : -1.0f;
      s.arg = INT_MAX;
    } else {
      s.t = sum + static_cast<float>(ties - 1);
      s.arg = at.ColOf(Index(half, first));
    }
    return s;
  }

  __device__ __forceinline__ void operator()(
      float (&acc)[cuda_gemm::kFragmentValues],
      const cuda_gemm::FragmentCoords& at,
      const cuda_gemm::WarpgroupTile& wg) const {
    const int tile = wg.col / cuda_gemm::kTileCols;
    const int lane = wg.thread % 32;
    const cuda_ce::ElementOptions opts = cuda_ce::MakeElementOptions(p);
    const bool full = wg.col + cuda_gemm::kTileCols <= p.vocab;
    // Both rows' targets first, so that one load latency covers both; as
    // columns (-1 for none here: ignored, or past the vocabulary), as a
    // 64-bit compare cost registers the accumulator needs.
    int target[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = at.row + 8 * half;
      const long long y = r < p.rows ? cuda_ce::LoadTarget(p, r) : -1;
      target[half] = y >= 0 && y < p.vocab ? static_cast<int>(y) : -1;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int y = target[half];
      Stats s;
      if (bias != nullptr) {
        s = full ? RowStats<true, true>(acc, at, half, wg.col, y, opts)
                 : RowStats<false, true>(acc, at, half, wg.col, y, opts);
      } else {
        s = full ? RowStats<true, false>(acc, at, half, wg.col, y, opts)
                 : RowStats<false, false>(acc, at, half, wg.col, y, opts);
      }
      cuda_ce::ShuffleCombine(s, 1);
      cuda_ce::ShuffleCombine(s, 2);
      const int r = at.row + 8 * half;
      if (lane % 4 == 0 && r < p.rows) {
        partials[static_cast<int64_t>(r) * col_tiles + tile] = s;
      }
    }
  }
  __device__ __forceinline__ void Finish(
      const cuda_gemm::WarpgroupTile&) const {}
};

constexpr int kMergeThreads = 256;

// One warp a row: each lane folds the tiles lane, lane + 32, ... in column
// order, the warp's butterfly merges the lanes (the same bits every run),
// then the cross-entropy's row math and outputs, as its schedules write
// them; the row math kept in row_math[row] for the gradient (or not: null).
__global__ void __launch_bounds__(kMergeThreads)
    MergeTilesKernel(cuda_ce::Params p, const Stats* partials, int col_tiles,
                     cuda_ce::RowMath* row_math) {
  const long long row =
      static_cast<long long>(blockIdx.x) * (kMergeThreads / 32) +
      threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.rows) return;
  const cuda_ce::WorkspaceHeader h = *p.header;
  if (h.error) return;  // a bad target: nothing is written
  Stats st = cuda_ce::EmptyStats();
  for (int k = lane; k < col_tiles; k += 32) {
    cuda_ce::Combine(st, partials[row * col_tiles + k]);
  }
  st = cuda_ce::WarpMergeStats(st);
  const long long y = cuda_ce::LoadTarget(p, row);
  const bool valid = y != p.ignore_index;
  const float zy = valid ? p.row_zy[row] : 0.0f;
  const cuda_ce::RowMath rm = cuda_ce::MakeRowMath(
      p, h, st, valid, zy, cuda_ce::TargetWeight(p, valid, y));
  if (lane == 0) cuda_ce::WriteRowOutputs(p, row, valid, y, rm, st.arg, true);
  if (lane == 0 && row_math != nullptr) row_math[row] = rm;
}

template <int kOpts>
cudaError_t LaunchStatsGemm(const CUtensorMap& x_map, const CUtensorMap& w_map,
                            const cuda_gemm::GemmSm90Args& gemm,
                            const cuda_ce::Params& p, const float* bias,
                            Stats* partials, cudaStream_t stream) {
  LossStatsEpilogue<kOpts> epilogue;
  epilogue.p = p;
  epilogue.bias = bias;
  epilogue.col_tiles = ColumnTiles(p.vocab);
  epilogue.partials = partials;
  return cuda_gemm::LaunchGemmSm90(x_map, w_map, gemm, epilogue, stream);
}

// The gradient path's epilogue: the statistics as LossStatsEpilogue, which
// leaves z (accumulator + bias, -inf past the vocabulary) in acc, then z
// stored in fp32 by TMA (clipped at Z's edges) for the split.
template <int kOpts>
struct LossStatsStoreEpilogue {
  using Store = cuda_gemm::TmaStoreZ<float>;
  static constexpr int kStagingBytes = Store::kStagingBytes;
  LossStatsEpilogue<kOpts> stats;
  Store store;

  __device__ __forceinline__ void operator()(
      float (&acc)[cuda_gemm::kFragmentValues],
      const cuda_gemm::FragmentCoords& at,
      const cuda_gemm::WarpgroupTile& wg) const {
    stats(acc, at, wg);
    store(acc, at, wg);
  }
  __device__ __forceinline__ void Finish(
      const cuda_gemm::WarpgroupTile& wg) const {
    store.Finish(wg);
  }
};

// The option builds the gradient path takes: label smoothing with or without
// class weights (z-loss and class weights alone are per-row terms); a softcap
// would need its factor from the raw logit, which Z no longer holds.
template <typename F>
cudaError_t WithGradientBuild(int mask, F&& f) {
  constexpr int kSmoothing = cuda_ce::kOptSmoothing;
  constexpr int kWeights = cuda_ce::kOptSmoothing | cuda_ce::kOptWeights;
  switch (mask) {
    case 0:
      return f(std::integral_constant<int, 0>());
    case kSmoothing:
      return f(std::integral_constant<int, kSmoothing>());
    case kWeights:
      return f(std::integral_constant<int, kWeights>());
    default:
      return cudaErrorNotSupported;
  }
}

constexpr int kSplitThreads = 256;
constexpr int kMaxGridRows = 65535;

// Shape: blockIdx.y strides over the chunk's rows, each thread takes 4
// adjacent columns of a row (vocab % 4 == 0: 16-byte loads of z, 8-byte
// stores of hi). G is the cross-entropy kernels' own (ElementGrad from the
// row's RowMath, the target's from gy), times the row's scale, rounded once
// to bf16; the large entries' exact residuals go to the records as
// SplitGradientLaunch keeps them.
template <int kOpts>
__global__ void __launch_bounds__(kSplitThreads)
    SplitZKernel(cuda_ce::Params p, const cuda_ce::RowMath* row_math,
                 const float* z, const float* row_scale, __nv_bfloat16* hi,
                 SparseResidualSlots sparse) {
  const cuda_ce::ElementOptions opts = cuda_ce::MakeElementOptions(p);
  const int64_t vocab = p.vocab;
  const int64_t step = 4 * int64_t{gridDim.x} * kSplitThreads;
  for (int64_t row = blockIdx.y; row < p.rows; row += gridDim.y) {
    const cuda_ce::RowMath rm = row_math[row];
    const long long y = cuda_ce::LoadTarget(p, row);
    const bool valid = y != p.ignore_index;
    const float scale = row_scale != nullptr ? row_scale[row] : 1.0f;
    const int64_t base = row * vocab;
    for (int64_t c = 4 * (int64_t{blockIdx.x} * kSplitThreads + threadIdx.x);
         c < vocab; c += step) {
      const float4 v = *reinterpret_cast<const float4*>(z + base + c);
      const float x[4] = {v.x, v.y, v.z, v.w};
      alignas(8) __nv_bfloat16 h[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float g = cuda_ce::ElementGrad<float, kOpts>(rm, opts, x[k],
                                                     static_cast<int>(c + k));
        if (c + k == y) g = rm.gy;
        const float t = valid ? g * scale : 0.0f;
        h[k] = __float2bfloat16_rn(t);
        RecordResidual(sparse, base + c + k, vocab, t,
                       t - __bfloat162float(h[k]), scale);
      }
      *reinterpret_cast<uint2*>(hi + base + c) =
          *reinterpret_cast<const uint2*>(h);
    }
  }
}

template <int kOpts>
cudaError_t LaunchStatsStoreGemm(const CUtensorMap& x_map,
                                 const CUtensorMap& w_map,
                                 const cuda_gemm::GemmSm90Args& gemm,
                                 const cuda_ce::Params& p, const float* bias,
                                 Stats* partials, cudaStream_t stream) {
  LossStatsStoreEpilogue<kOpts> epilogue;
  epilogue.stats.p = p;
  epilogue.stats.bias = bias;
  epilogue.stats.col_tiles = ColumnTiles(p.vocab);
  epilogue.stats.partials = partials;
  epilogue.store.rows = static_cast<int>(gemm.rows);
  const cudaError_t e =
      cuda_gemm::ZMap(&epilogue.store.map, gemm,
                      CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 128 / sizeof(float));
  if (e != cudaSuccess) return e;
  return cuda_gemm::LaunchGemmSm90(x_map, w_map, gemm, epilogue, stream);
}

// What both entry points set up before enqueueing anything: the GEMM's
// arguments and tensor maps (z: where Z goes, or null), the cross-entropy's
// Params over the workspace and the partials after its part.
struct FusedSetup {
  cuda_gemm::GemmSm90Args gemm;
  CUtensorMap x_map, w_map;
  cuda_ce::Params p;
  Stats* partials;
};

cudaError_t Setup(const FusedLinearForwardArgs& args, float* z, void* workspace,
                  FusedSetup* s) {
  const CrossEntropyArgs& loss = args.loss;
  s->gemm.x = args.x;
  s->gemm.w = args.weight;
  s->gemm.z = z;
  s->gemm.rows = loss.rows;
  s->gemm.cols = loss.vocab;
  s->gemm.depth = args.hidden;
  s->gemm.z_stride = loss.vocab;  // (forward: no Z, its fields pass the policy)
  s->gemm.z_type = cuda_gemm::ZType::kFloat32;
  s->gemm.schedule = args.gemm_schedule;
  const cudaError_t e =
      cuda_gemm::PrepareGemmSm90(&s->gemm, &s->x_map, &s->w_map);
  if (e != cudaSuccess) return e;
  if (z != nullptr && !cuda_gemm::ZByTensorStore(cuda_gemm::ShapeOf(s->gemm))) {
    return cudaErrorNotSupported;
  }
  s->p = cuda_ce::FillParams(loss, workspace);
  s->partials =
      reinterpret_cast<Stats*>(static_cast<char*>(workspace) +
                               CrossEntropyCudaWorkspaceBytes(loss.rows));
  return cudaSuccess;
}

cudaError_t LaunchMerge(const FusedSetup& s, cuda_ce::RowMath* row_math,
                        cudaStream_t stream) {
  constexpr int kRowsPerBlock = kMergeThreads / 32;
  MergeTilesKernel<<<static_cast<unsigned>((s.p.rows + kRowsPerBlock - 1) /
                                           kRowsPerBlock),
                     kMergeThreads, 0, stream>>>(
      s.p, s.partials, ColumnTiles(s.p.vocab), row_math);
  return cudaGetLastError();
}

}  // namespace

std::size_t FusedLinearForwardWorkspaceBytes(int64_t rows, int64_t vocab) {
  const std::size_t n = rows > 0 ? static_cast<std::size_t>(rows) : 0;
  return CrossEntropyCudaWorkspaceBytes(rows) +
         AlignUp(n * ColumnTiles(vocab) * sizeof(Stats));
}

std::size_t FusedLinearGradientWorkspaceBytes(int64_t rows, int64_t vocab) {
  const std::size_t n = rows > 0 ? static_cast<std::size_t>(rows) : 0;
  return FusedLinearForwardWorkspaceBytes(rows, vocab) +
         AlignUp(n * sizeof(cuda_ce::RowMath));
}

cudaError_t FusedLinearForwardLaunch(const FusedLinearForwardArgs& args,
                                     CrossEntropyCudaResult* device_result,
                                     void* workspace,
                                     std::size_t workspace_bytes,
                                     cudaStream_t stream) {
  const CrossEntropyArgs& loss = args.loss;
  if (device_result == nullptr || loss.vocab <= 0 || loss.vocab > INT_MAX ||
      workspace_bytes <
          FusedLinearForwardWorkspaceBytes(loss.rows, loss.vocab)) {
    return cudaErrorInvalidValue;
  }
  FusedSetup s;
  cudaError_t e = Setup(args, nullptr, workspace, &s);
  if (e != cudaSuccess) return e;
  e = cuda_ce::LaunchPrepare(s.p, stream);
  if (e != cudaSuccess) return e;
  e = cuda_ce::WithOptionBuild(cuda_ce::ElementOptionsOn(s.p), [&](auto b) {
    return LaunchStatsGemm<decltype(b)::value>(s.x_map, s.w_map, s.gemm, s.p,
                                               args.bias, s.partials, stream);
  });
  if (e != cudaSuccess) return e;
  e = LaunchMerge(s, nullptr, stream);
  if (e != cudaSuccess) return e;
  return cuda_ce::LaunchFinalize(s.p, device_result, stream);
}

cudaError_t FusedLinearGradientLaunch(const FusedLinearGradientArgs& args,
                                      CrossEntropyCudaResult* device_result,
                                      void* workspace,
                                      std::size_t workspace_bytes,
                                      cudaStream_t stream) {
  const CrossEntropyArgs& loss = args.forward.loss;
  if (device_result == nullptr || args.z == nullptr || args.hi == nullptr ||
      loss.vocab <= 0 || loss.vocab > INT_MAX || loss.vocab % 4 != 0 ||
      workspace_bytes <
          FusedLinearGradientWorkspaceBytes(loss.rows, loss.vocab)) {
    return cudaErrorInvalidValue;
  }
  FusedSetup s;
  cudaError_t e = Setup(args.forward, args.z, workspace, &s);
  if (e != cudaSuccess) return e;
  const int build = cuda_ce::ElementOptionsOn(s.p);
  if (WithGradientBuild(build, [](auto) { return cudaSuccess; }) !=
      cudaSuccess) {
    return cudaErrorNotSupported;
  }
  auto* row_math = reinterpret_cast<cuda_ce::RowMath*>(
      static_cast<char*>(workspace) +
      FusedLinearForwardWorkspaceBytes(loss.rows, loss.vocab));
  const SparseResidualSlots sparse =
      args.sparse != nullptr ? *args.sparse : SparseResidualSlots();
  e = cuda_ce::LaunchPrepare(s.p, stream);
  if (e != cudaSuccess) return e;
  e = WithGradientBuild(build, [&](auto b) {
    return LaunchStatsStoreGemm<decltype(b)::value>(
        s.x_map, s.w_map, s.gemm, s.p, args.forward.bias, s.partials, stream);
  });
  if (e != cudaSuccess) return e;
  e = LaunchMerge(s, row_math, stream);
  if (e != cudaSuccess) return e;
  e = cuda_ce::LaunchFinalize(s.p, device_result, stream);
  if (e != cudaSuccess || loss.rows == 0) return e;
  const dim3 grid(
      static_cast<unsigned>((loss.vocab / 4 + kSplitThreads - 1) /
                            kSplitThreads),
      static_cast<unsigned>(std::min<int64_t>(loss.rows, kMaxGridRows)));
  return WithGradientBuild(build, [&](auto b) {
    SplitZKernel<decltype(b)::value><<<grid, kSplitThreads, 0, stream>>>(
        s.p, row_math, args.z, args.row_scale,
        static_cast<__nv_bfloat16*>(args.hi), sparse);
    return cudaGetLastError();
  });
}

}  // namespace lossd
