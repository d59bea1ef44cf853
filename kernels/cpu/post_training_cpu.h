// The fp64 CPU backend of kernels/post_training.h; being fp64, it is the
// other backends' oracle.
#ifndef LOSSD_KERNELS_CPU_POST_TRAINING_CPU_H_
#define LOSSD_KERNELS_CPU_POST_TRAINING_CPU_H_

#include "absl/status/status.h"
#include "kernels/post_training.h"
#include "kernels/post_training_plan.h"
#include "kernels/post_training_validate.h"

namespace lossd {

// Computes the loss, the gradient (as args.base.mode says), the per-token
// outputs and `*result` with fp64 row math and one rounding per gradient
// element. Rows are split over `num_threads` threads (0 = hardware
// concurrency); totals are summed in row order, so the result does not depend
// on the thread count.
//
// Returns OK, or INVALID_ARGUMENT (as ValidatePostTrainingArgs and
// CheckPostTrainingData, or result == nullptr) having written nothing.
// Non-finite logits give non-finite rows, counted in
// result->base.nonfinite_rows, not an error. Ownership: borrows every buffer
// for the call. Thread safety: reentrant.
absl::Status PostTrainingCpu(const PostTrainingArgs& args,
                             PostTrainingResult* result, int num_threads = 0);

// The rows of `args` alone, for a caller that plans and reduces a larger
// problem itself (LinearForward's chunks of rows): row r's gradient is scaled
// by row_scale[r] (the plan's factor times grad_scale) and its totals go to
// totals[r]; the per-token outputs are written. `args` must have passed the
// checks of kernels/post_training_validate.h (on the whole problem); its inputs
// are host pointers. Threads as PostTrainingCpu; writes nothing but the
// gradient, the per-token outputs and `totals`.
void PostTrainingCpuRows(const PostTrainingArgs& args, const double* row_scale,
                         PostTrainingRowTotals* totals, int num_threads = 0);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_POST_TRAINING_CPU_H_
