// What the dispatch (dispatch.cc) derives from a call before it chooses a
// schedule: the kernels' Params over a workspace and the policy's view of the
// call. The post-training losses launch the same schedules from them, and the
// linear cross-entropy's fused forward (fused_linear_forward.cu), which
// computes a row's statistics its own way, shares the cross-entropy's
// prepare, row math and finalize through them.
#ifndef LOSSD_KERNELS_CUDA_DISPATCH_H_
#define LOSSD_KERNELS_CUDA_DISPATCH_H_

#include "common/dtype.h"
#include "kernels/cross_entropy.h"
#include "kernels/cuda/launch_params.h"
#include "kernels/cuda/schedule_policy.h"

namespace lossd {
namespace cuda_ce {

// The Params of `args` (device pointers, valid: ValidateCrossEntropyArgs)
// with their workspace arrays laid out over `workspace` (at least
// CrossEntropyCudaWorkspaceBytes(args.rows) bytes; nullptr leaves them null,
// for ShapeOf alone); p.chunk is left 0. args.logits may be null for a
// launcher that reads no logits. Pure.
Params FillParams(const CrossEntropyArgs& args, void* workspace);

// The shape the schedule policy decides on, from Params filled as above and
// the logits' dtype. Pure.
ScheduleShape ShapeOf(const Params& p, DType dtype);

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_DISPATCH_H_
