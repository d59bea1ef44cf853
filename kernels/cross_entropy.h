// The cross-entropy contract that every compute backend (CPU and CUDA)
// implements. Plain C++ with standard headers only (and common/'s dtypes and
// loss options, which are too), so that .cu files can include it; nothing here
// knows about handles, gRPC or absl.
#ifndef LOSSD_KERNELS_CROSS_ENTROPY_H_
#define LOSSD_KERNELS_CROSS_ENTROPY_H_

#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "common/loss_options.h"

namespace lossd {

// One problem: logits [rows, vocab] with row_stride elements between row
// starts. Pointers are host pointers for the CPU backend and device pointers
// for the CUDA backend.
struct CrossEntropyArgs {
  int64_t rows = 0;
  int64_t vocab = 0;
  // Elements; >= vocab. Also the stride of an out-of-place gradient.
  int64_t row_stride = 0;

  DType logits_dtype = DType::kFloat32;
  const void* logits = nullptr;

  DType targets_dtype = DType::kInt64;
  const void* targets = nullptr;  // [rows]

  const float* class_weights = nullptr;  // [vocab] fp32, or nullptr for none

  CrossEntropyOptions options;

  GradientMode mode = GradientMode::kInPlace;
  // kInPlace: must equal logits. kOutOfPlace: a separate buffer of
  // logits_dtype, same stride. kNone: must be nullptr.
  // Precision (docs/api.md, "Precision of the gradient"), g the exact
  // gradient, terms = |s| (|A| p_c + (1 - eps) w_y [c == y] + eps w_c / V):
  // bf16 and fp16 within (0.5 + 1/32) ulp(g) + 2 * 2^-24 * terms; fp32 within
  // 1e-6 absolute (relative past 1), and for p_c >= 2^-64 within 0.5 ulp(g) +
  // 24 * 2^-24 * terms; with softcap c 1 ulp(g) + max(128, 16 c) * 2^-24 *
  // terms.
  void* gradient = nullptr;

  // Optional per-row outputs (nullptr = not requested); every row is written,
  // ignored rows too.
  // [rows] loss_i (with the z-loss term); 0 for ignored rows.
  float* token_loss = nullptr;
  // [rows] lse of z; computed for ignored rows as well.
  float* token_lse = nullptr;
  // [rows] first index of the row maximum of z.
  int32_t* token_argmax = nullptr;
};

// Results. `loss` includes the z-loss term; `z_loss` is that term alone; both
// are reduced as the options say (for kNone they are sums over rows, the
// per-row values being in token_loss).
struct CrossEntropyResult {
  double loss = 0.0;
  double z_loss = 0.0;
  int64_t valid_tokens = 0;    // rows whose target is not ignore_index
  int64_t correct_tokens = 0;  // valid rows with argmax(z) == target
  // Valid rows whose loss is not finite (NaN/Inf in the logits).
  int64_t nonfinite_rows = 0;
  // D used for kMean (0 when there were no valid rows).
  double denominator = 0.0;
  // Device time of the computation where the backend measures it (the CUDA
  // backend: events around its kernels), else 0 (the caller's clock is then
  // the computation's time: the CPU backend).
  double kernel_seconds = 0.0;
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_CROSS_ENTROPY_H_
