// The options of a cross-entropy loss, as the client sends them, the server
// checks them and the kernels compute them. Plain C++ with standard headers
// only, so that .cu files can include it too.
#ifndef LOSSD_COMMON_LOSS_OPTIONS_H_
#define LOSSD_COMMON_LOSS_OPTIONS_H_

#include <cstdint>

namespace lossd {

// Values match lossd.v1.Reduction.
enum class Reduction : int { kMean = 1, kSum = 2, kNone = 3 };

// Values match lossd.v1.GradientMode.
enum class GradientMode : int {
  // The gradient overwrites the logits (same buffer, same dtype).
  kInPlace = 1,
  // The gradient goes to a separate buffer of the logits' dtype.
  kOutOfPlace = 2,
  // Forward only: the logits are only read.
  kNone = 3,
};

// Options with the semantics of torch.nn.functional.cross_entropy (see
// docs/design.md §3).
//
// Let z = softcap * tanh(x / softcap) when softcap > 0, else z = x; lse = log
// sum_c exp(z_c); w the class weights (all 1 when absent), W = sum_c w_c, eps =
// label_smoothing, y the target. For a row whose target is not ignore_index:
//
// clang-format off
//   loss_i  = (1 - eps) * w_y * (lse - z_y) + eps / V * sum_c w_c * (lse - z_c)
//   zloss_i = z_loss_scale * lse^2         (added to loss_i, also reported alone)
// clang-format on
//
// Reduction: kSum sums the rows; kMean divides the sum by D, where D =
// normalizer when normalizer > 0, else sum_i w_{y_i} over valid rows (the
// valid-row count without weights); kNone keeps per-row values. A mean over
// zero valid rows is 0 (torch gives NaN). Gradient of the reduced loss times
// grad_scale, for valid rows:
//
// clang-format off
//   dL/dz_c = s * (p_c * ((1 - eps) * w_y + eps * W / V + 2 * z_loss_scale * lse)
//                  - (1 - eps) * w_y * [c == y] - eps * w_c / V)
//   dL/dx_c = dL/dz_c * (1 - (z_c / softcap)^2)   when softcap > 0
// clang-format on
//
// with s = grad_scale / D for kMean and s = grad_scale otherwise. Ignored rows
// get 0.
struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  float label_smoothing = 0.0f;  // in [0, 1]
  Reduction reduction = Reduction::kMean;
  float z_loss_scale = 0.0f;  // >= 0
  float softcap = 0.0f;       // 0 = off; otherwise > 0
  double normalizer = 0.0;    // 0 = automatic (see above); otherwise > 0
  // Folded into the gradient before its single rounding.
  float grad_scale = 1.0f;
};

}  // namespace lossd

#endif  // LOSSD_COMMON_LOSS_OPTIONS_H_
