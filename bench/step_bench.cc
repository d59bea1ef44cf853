// The helpers of bench/step_bench.h.
#include "bench/step_bench.h"

#include <errno.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/strings/str_format.h"

namespace step_bench {

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

void Die(const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", program_invocation_short_name, what.c_str());
  std::exit(1);
}

void Must(const absl::Status& status, const char* what) {
  if (!status.ok()) Die(absl::StrFormat("%s: %s", what, status.ToString()));
}

std::vector<uint16_t> RandomBf16(size_t count, uint32_t seed, int exponent,
                                 int exponents) {
  std::vector<uint16_t> values(count);
  std::mt19937 rng(seed);
  const size_t block = std::min<size_t>(count, size_t{32} << 20);
  for (size_t i = 0; i < block; ++i) {
    const uint32_t r = rng();
    values[i] = static_cast<uint16_t>(((r & 1) << 15) |
                                      ((exponent + (r >> 1) % exponents) << 7) |
                                      ((r >> 8) & 0x7f));
  }
  for (size_t at = block; at < count; at += block) {
    std::memcpy(values.data() + at, values.data(),
                std::min(block, count - at) * sizeof(uint16_t));
  }
  return values;
}

LogitsStep TimeLogitsStep(lossd::Client& client,
                          const std::vector<uint16_t>& logits,
                          const std::vector<int64_t>& targets, int64_t rows,
                          int64_t vocab, std::vector<uint16_t>* gradient) {
  LogitsStep step;
  const auto start = Clock::now();
  absl::StatusOr<lossd::TensorInfo> uploaded =
      client.Upload(lossd::DType::kBFloat16, {rows, vocab}, logits.data(),
                    logits.size() * sizeof(uint16_t));
  Must(uploaded.status(), "upload logits");
  absl::StatusOr<lossd::TensorInfo> uploaded_targets =
      client.Upload(lossd::DType::kInt64, {rows}, targets.data(),
                    targets.size() * sizeof(int64_t));
  Must(uploaded_targets.status(), "upload targets");
  step.upload = Seconds(start);
  auto at = Clock::now();
  absl::StatusOr<lossd::ForwardResult> forward = client.Forward(
      uploaded->handle, lossd::Targets::Handle(uploaded_targets->handle));
  Must(forward.status(), "forward");
  step.forward = Seconds(at);
  at = Clock::now();
  Must(client.Backward(forward->gradient, 1.0).status(), "backward");
  step.backward = Seconds(at);
  at = Clock::now();
  gradient->resize(logits.size());
  Must(client
           .DownloadInto(forward->gradient, lossd::DType::kBFloat16,
                         gradient->data(), gradient->size() * sizeof(uint16_t))
           .status(),
       "download gradient");
  step.download = Seconds(at);
  step.seconds = Seconds(start);
  client.Release(forward->gradient).IgnoreError();
  client.Release(uploaded_targets->handle).IgnoreError();
  step.forward_result = *std::move(forward);
  return step;
}

}  // namespace step_bench
