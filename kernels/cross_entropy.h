// The cross-entropy contract that every compute backend (CPU and CUDA)
// implements. Plain C++ with standard headers only, so that .cu files can
// include it too; nothing here knows about handles, gRPC or absl.
#ifndef LOSSD_KERNELS_CROSS_ENTROPY_H_
#define LOSSD_KERNELS_CROSS_ENTROPY_H_

#include <cstddef>
#include <cstdint>

namespace lossd {

// Element types of the tensors lossd stores. Values match lossd.v1.DType in the
// proto.
enum class DType : int {
  kInvalid = 0,
  kFloat32 = 1,
  kBFloat16 = 2,
  kFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
};

// What a stored tensor's buffer holds (the server's store and the client's
// TensorInfo, so that both headers can be included together). Values match
// lossd.v1.TensorState; the server never reports kUnspecified.
enum class TensorState : int { kUnspecified = 0, kLogits = 1, kGradient = 2 };

// Bytes per element; 0 for kInvalid.
constexpr std::size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kInt64:
      return 8;
    default:
      return 0;
  }
}

// The canonical lower-case name ("float32", "bfloat16", "float16", "int32",
// "int64"); "invalid" for kInvalid or any value outside the enum. The one name
// table of the tree: the server's messages and the client's names start here.
// Returns a static string (never nullptr). Pure; thread-safe.
constexpr const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    default:
      return "invalid";
  }
}

constexpr bool IsLogitsDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat16;
}
constexpr bool IsTargetsDType(DType dtype) {
  return dtype == DType::kInt32 || dtype == DType::kInt64;
}

// Values match lossd.v1.Reduction.
enum class Reduction : int { kMean = 1, kSum = 2, kNone = 3 };

// Values match lossd.v1.GradientMode.
enum class GradientMode : int {
  kInPlace = 1,  // the gradient overwrites the logits (same buffer, same dtype)
  // The gradient goes to a separate buffer of the logits' dtype.
  kOutOfPlace = 2,
  kNone = 3,  // forward only: the logits are only read
};

// Options with the semantics of torch.nn.functional.cross_entropy (see
// docs/design.md §3).
//
// clang-format off
// Let z = softcap * tanh(x / softcap) when softcap > 0, else z = x;
// lse = log sum_c exp(z_c); w the class weights (all 1 when absent),
// W = sum_c w_c, eps = label_smoothing, y the target. For a row whose target
// is not ignore_index:
//
//   loss_i  = (1 - eps) * w_y * (lse - z_y) + eps / V * sum_c w_c * (lse - z_c)
//             + zloss_i
//   zloss_i = z_loss_scale * lse^2   (added to loss_i, also reported alone)
//
// Reduction: kSum sums the rows; kMean divides the sum by D, where
// D = normalizer when normalizer > 0, else sum_i w_{y_i} over valid rows (the
// valid-row count without weights); kNone keeps per-row values. A mean over
// zero valid rows is 0 (torch gives NaN). Gradient of the reduced loss times
// grad_scale, for valid rows:
//
//   dL/dz_c = s * ( p_c * ((1 - eps) * w_y + eps * W / V + 2 * z_loss_scale * lse)
//                   - (1 - eps) * w_y * [c == y] - eps * w_c / V )
//   dL/dx_c = dL/dz_c * (1 - (z_c / softcap)^2)   when softcap > 0
//
// with s = grad_scale / D for kMean and s = grad_scale otherwise. Ignored rows
// get 0.
// clang-format on
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
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_CROSS_ENTROPY_H_
