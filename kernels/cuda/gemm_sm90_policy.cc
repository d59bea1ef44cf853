// The GEMM's eligibility policy (gemm_sm90_policy.h): plain C++ so that its
// decision table is tested on the CPU.
#include "kernels/cuda/gemm_sm90_policy.h"

namespace lossd {
namespace cuda_gemm {

const char* GemmSm90FitName(GemmSm90Fit fit) {
  switch (fit) {
    case GemmSm90Fit::kYes:
      return "yes";
    case GemmSm90Fit::kNotSm90:
      return "not sm_90";
    case GemmSm90Fit::kEmpty:
      return "empty";
    case GemmSm90Fit::kTooLarge:
      return "too large";
    case GemmSm90Fit::kZStride:
      return "z stride";
    case GemmSm90Fit::kDepthAlignment:
      return "depth alignment";
    case GemmSm90Fit::kPointerAlignment:
      return "pointer alignment";
  }
  return "unknown";
}

GemmSm90Fit GemmSm90Eligibility(const GemmSm90Shape& shape, int major,
                                int minor) {
  // sm_90a code runs on 9.0 only: a later architecture has no wgmma.
  if (major != 9 || minor != 0) return GemmSm90Fit::kNotSm90;
  if (shape.rows <= 0 || shape.cols <= 0 || shape.depth <= 0) {
    return GemmSm90Fit::kEmpty;
  }
  // Tile indices and TMA coordinates are 32-bit.
  constexpr int64_t kMax = 0x7fffffff;
  if (shape.rows > kMax || shape.cols > kMax || shape.depth > kMax) {
    return GemmSm90Fit::kTooLarge;
  }
  if (shape.z_stride < shape.cols) return GemmSm90Fit::kZStride;
  // A TMA tensor map's strides are multiples of 16 bytes.
  if (shape.depth % 8 != 0) return GemmSm90Fit::kDepthAlignment;
  if (!shape.operands_aligned || !shape.z_aligned ||
      (shape.z_element_bytes != 2 && shape.z_element_bytes != 4)) {
    return GemmSm90Fit::kPointerAlignment;
  }
  return GemmSm90Fit::kYes;
}

bool ZByTensorStore(const GemmSm90Shape& shape) {
  return shape.z_aligned16 &&
         (shape.z_stride * shape.z_element_bytes) % 16 == 0 &&
         (shape.cols * shape.z_element_bytes) % 16 == 0;
}

int GemmSm90Cluster(const GemmSm90Shape&) { return 2; }

GemmSm90Schedule GemmSm90ScheduleFor(const GemmSm90Shape&, int) {
  return GemmSm90Schedule::kCooperative;
}

bool FusedLinearForwardTakes(const GemmSm90Shape& shape, bool bf16,
                             bool gradient, int major, int minor) {
  return bf16 && !gradient &&
         GemmSm90Eligibility(shape, major, minor) == GemmSm90Fit::kYes;
}

const char* FusedLinearGradientRefusal(const GemmSm90Shape& shape,
                                       const FusedGradientCall& call, int major,
                                       int minor) {
  if (call.post_training) return "a post-training loss";
  if (!call.bf16) return "operands other than bf16";
  if (!call.sparse_residual)
    return "a precision other than the sparse residual";
  if (call.softcap) return "a softcap";
  if (call.grad_bias) return "dbias";
  const GemmSm90Fit fit = GemmSm90Eligibility(shape, major, minor);
  if (fit != GemmSm90Fit::kYes) return GemmSm90FitName(fit);
  if (shape.z_element_bytes != 4 || !ZByTensorStore(shape)) {
    return "Z's rows not whole 16-byte pieces";
  }
  return nullptr;
}

}  // namespace cuda_gemm
}  // namespace lossd
