// lossctl's flags for the post-training losses (docs/api.md, "Post-training
// losses"), apart from the rest of the CLI: forward reads them into
// ForwardOptions; eval into EvaluateOptions and the per-row columns it copies
// into each block (the teacher's rows, the segment ids).
#ifndef LOSSD_CLIENT_LOSSCTL_POST_TRAINING_H_
#define LOSSD_CLIENT_LOSSCTL_POST_TRAINING_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/client.h"
#include "client/tensor_file.h"

namespace lossd {

// The distillation, policy and segment options of forward and linear
// (ForwardOptions or LinearForwardOptions), from their flags; tensor files
// named by them are opened into `files`, which must outlive the call that
// sends them inline.
template <typename Options>
absl::Status PostTrainingFlagsInto(
    Options* options, std::vector<std::unique_ptr<InputTensor>>* files);

// forward's and linear's lines for the post-training results, after the
// loss line.
template <typename Options>
void PrintPostTrainingResult(const Options& options,
                             const ForwardResult& result);

// A per-row input of eval (a file of `rows` entries) and the RowBlock field
// each block carries it in.
struct EvalColumn {
  std::unique_ptr<InputTensor> file;
  std::string RowBlock::*field;
};

// eval's distillation, policy loss and segments, from the flags: their
// options into `options` and their files (one entry a row, `rows` rows) into
// `columns`. INVALID_ARGUMENT for a file of another row count, or policy
// inputs without --policy_loss.
absl::Status EvalPostTrainingFromFlags(int64_t rows, EvaluateOptions* options,
                                       std::vector<EvalColumn>* columns);

// Copies rows [first_row, first_row + count) of each column into `block`.
void CopyEvalColumns(const std::vector<EvalColumn>& columns, int64_t rows,
                     int64_t first_row, int64_t count, RowBlock* block);

// eval's lines for the post-training results, after the loss line.
void PrintEvalPostTrainingResult(const EvaluateOptions& options,
                                 const EvaluateResult& result);

}  // namespace lossd

#endif  // LOSSD_CLIENT_LOSSCTL_POST_TRAINING_H_
