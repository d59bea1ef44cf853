// What every cross-entropy kernel receives (Params) and the layout of the
// workspace it shares with the prepare and finalize kernels. Plain structs:
// the host-side dispatch (dispatch.cc) fills them, the .cu files read them.
#ifndef LOSSD_KERNELS_CUDA_LAUNCH_PARAMS_H_
#define LOSSD_KERNELS_CUDA_LAUNCH_PARAMS_H_

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace lossd {
namespace cuda_ce {

constexpr int kThreads = 256;         // most schedules: threads per block
constexpr int kGenericThreads = 512;  // generic rows: threads per block
constexpr int kReduceThreads = 1024;  // prepare/finalize: one block
constexpr int kMaxCluster = 16;       // blocks a cluster (non-portable past 8)
// Per-row statistics slots in the workspace (at most a warp: one warp merges
// them). 32: smem row pieces split fp32 1 MiB rows into 22
// pieces of 48 KiB, four blocks a SM (at 16, 64 KiB pieces fit three: 83%
// against 89-91% of copy).
constexpr int kMaxPieces = 32;

// Workspace: header, then per-row loss, z-loss and flags (kFlag*), the L2
// row pieces' done counts and target logits, then the pieces' records.
struct WorkspaceHeader {
  int error;
  int pad;
  long long bad_row;
  long long valid;
  double denominator;            // D for kMean (0 without valid rows)
  float scale;                   // s of the contract, rounded once to fp32
  float weight_total;            // W
  unsigned long long next_item;  // L2/smem row pieces: the next work item
};
constexpr std::size_t kHeaderBytes = 256;
// sizeof(Stats) (row_math.cuh), the per-piece record of the workspace.
constexpr std::size_t kStatsBytes = 16;
constexpr int kFlagCorrect = 1;
constexpr int kFlagNonfinite = 2;

struct Params {
  const void* logits;
  void* grad;  // nullptr for GradientMode::kNone
  const void* targets;
  const float* weights;
  float* token_loss;
  float* token_lse;
  int32_t* token_argmax;
  WorkspaceHeader* header;
  float* row_loss;
  float* row_zloss;
  int* row_flags;
  // Split row forward and L2 row pieces: kMaxPieces Stats a row; smem row
  // pieces: a PieceSlot a piece.
  void* pieces;
  int* row_done;  // L2 row pieces: pieces a row whose statistics are written
  float* row_zy;  // L2 row pieces: the target logit of a row
  long long rows;
  long long stride;
  long long ignore_index;
  double normalizer;
  int vocab;
  int chunk;  // elements a block's slice or a row piece
  int targets64;
  int reduction;
  float eps;
  float zls;
  float softcap;
  float grad_scale;
  // Smem row pieces with label smoothing: each piece's sum of w_c z_c, by
  // item (its slot has no room for it).
  float* piece_wz;
};

// The options' per-element work a row needs, as the schedules' option builds
// take it (a mask, a build each: a runtime test in the hot loops was compiled
// as both sides computed and one selected, so smoothing paid for the softcap,
// and a runtime weight test split the unrolled loop at every element):
// softcap, label smoothing, and class weights inside smoothing's terms (w_c
// of every element). Class weights without smoothing and z-loss are per-row
// terms (RowMath) and take the plain build, 0.
constexpr int kOptSoftcap = 1;
constexpr int kOptSmoothing = 2;
constexpr int kOptWeights = 4;  // only with kOptSmoothing
inline int ElementOptionsOn(const Params& p) {
  const bool smoothing = p.eps > 0.0f;
  return (p.softcap > 0.0f ? kOptSoftcap : 0) |
         (smoothing ? kOptSmoothing : 0) |
         (smoothing && p.weights != nullptr ? kOptWeights : 0);
}

// Calls f(std::integral_constant<int, mask>()) for the option build `mask`.
template <typename F>
auto WithOptionBuild(int mask, F&& f) {
  constexpr int kSmoothingWeights = kOptSmoothing | kOptWeights;
  switch (mask) {
    case kOptSoftcap:
      return f(std::integral_constant<int, kOptSoftcap>());
    case kOptSmoothing:
      return f(std::integral_constant<int, kOptSmoothing>());
    case kOptSoftcap | kOptSmoothing:
      return f(std::integral_constant<int, kOptSoftcap | kOptSmoothing>());
    case kSmoothingWeights:
      return f(std::integral_constant<int, kSmoothingWeights>());
    case kOptSoftcap | kSmoothingWeights:
      return f(std::integral_constant<int, kOptSoftcap | kSmoothingWeights>());
    default:
      return f(std::integral_constant<int, 0>());
  }
}

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_LAUNCH_PARAMS_H_
