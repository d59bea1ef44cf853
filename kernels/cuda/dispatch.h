// The kernels' Params of a cross-entropy problem over its workspace
// (dispatch.cc), for launchers that compute a row's statistics their own way
// and then share the cross-entropy's prepare, row math and finalize: the
// linear cross-entropy's fused forward (fused_linear_forward.cu).
#ifndef LOSSD_KERNELS_CUDA_DISPATCH_H_
#define LOSSD_KERNELS_CUDA_DISPATCH_H_

#include "kernels/cross_entropy.h"
#include "kernels/cuda/launch_params.h"

namespace lossd {
namespace cuda_ce {

// `args`' pointers, shape and options, and the per-row arrays and header
// carved out of `workspace` (CrossEntropyCudaWorkspaceBytes(args.rows)
// bytes). args.logits may be null for a launcher that reads no logits.
Params MakeParams(const CrossEntropyArgs& args, void* workspace);

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_DISPATCH_H_
