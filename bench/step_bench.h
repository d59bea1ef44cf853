// What bench/user_step_bench and bench/linear_step_bench share: timing,
// failing, the random bf16 values they send, and the logits step (upload
// logits and targets, Forward in place, Backward 1.0, the bf16 gradient back)
// both time through lossd::Client.
#ifndef LOSSD_BENCH_STEP_BENCH_H_
#define LOSSD_BENCH_STEP_BENCH_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/client.h"

namespace step_bench {

using Clock = std::chrono::steady_clock;

// Seconds since `since`.
double Seconds(Clock::time_point since);

// Prints "<program>: `what`" and exits 1: a benchmark that cannot measure
// stops.
[[noreturn]] void Die(const std::string& what);

// Dies with `what` and the status unless it is OK.
void Must(const absl::Status& status, const char* what);

// `count` random bf16 values: random sign and mantissa, an exponent drawn
// from the `exponents` values from `exponent` on (0x7e: magnitudes from 0.5).
// A 32 M block repeated: drawing billions of values would take longer than
// the steps.
std::vector<uint16_t> RandomBf16(size_t count, uint32_t seed, int exponent,
                                 int exponents);

// The times of one logits step, in seconds, and its Forward's result.
struct LogitsStep {
  double seconds = 0.0;  // the whole step
  double upload = 0.0;   // logits and targets
  double forward = 0.0;
  double backward = 0.0;
  double download = 0.0;
  lossd::ForwardResult forward_result;
};

// One logits step of bf16 `logits` [rows, vocab] and int64 `targets`
// [rows]: upload both, Forward in place, Backward 1.0, download the bf16
// gradient into `*gradient` (resized to the logits' size: a training loop
// keeps this buffer, so only the first step allocates it), release both.
// Dies on any error.
LogitsStep TimeLogitsStep(lossd::Client& client,
                          const std::vector<uint16_t>& logits,
                          const std::vector<int64_t>& targets, int64_t rows,
                          int64_t vocab, std::vector<uint16_t>* gradient);

}  // namespace step_bench

#endif  // LOSSD_BENCH_STEP_BENCH_H_
