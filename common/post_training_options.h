// The choices of the post-training losses (kernels/post_training.h says what
// each computes), shared by the client, the server and the kernels. Plain C++,
// so that .cu files can include it too.
#ifndef LOSSD_COMMON_POST_TRAINING_OPTIONS_H_
#define LOSSD_COMMON_POST_TRAINING_OPTIONS_H_

namespace lossd {

// Values match lossd.v1.Divergence.
enum class Divergence : int { kForwardKl = 1, kReverseKl = 2, kJsd = 3 };
// Values match lossd.v1.TopKTail.
enum class TopKTail : int { kRenormalize = 1, kBucket = 2 };
// Values match lossd.v1.PolicyLoss.
enum class PolicyLossKind : int {
  kImportanceSampling = 1,
  kPpoClip = 2,
  kCispo = 3,
};
// Values match lossd.v1.KlEstimator.
enum class KlEstimator : int { kK1 = 1, kK2 = 2, kK3 = 3 };
// Values match lossd.v1.SegmentReduction (0: the options' reduction).
enum class SegmentReduction : int {
  kNone = 0,
  kSeqMeanTokenMean = 1,
  kSeqMeanTokenSum = 2,
};

}  // namespace lossd

#endif  // LOSSD_COMMON_POST_TRAINING_OPTIONS_H_
