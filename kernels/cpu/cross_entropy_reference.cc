// The fp64 reference of the cross-entropy contract: the formulas of
// kernels/cross_entropy.h written out term by term, single-threaded, so that a
// reader can check it against torch by eye. It is the oracle of the tests of
// the fast CPU path and of the CUDA kernels; speed does not matter here.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/cpu/cross_entropy_cpu.h"
#include "kernels/cpu/cross_entropy_internal.h"

namespace lossd {

using cpu_internal::ArgmaxUpdate;
using cpu_internal::LoadLogit;
using cpu_internal::StoreDouble;

absl::Status CrossEntropyReference(const CrossEntropyArgs& args,
                                   CrossEntropyResult* result) {
  if (result == nullptr) {
    return absl::InvalidArgumentError("cross_entropy: result is nullptr");
  }
  absl::Status status = ValidateCrossEntropyArgs(args);
  if (!status.ok()) return status;
  status = CheckTargets(args.targets, args.targets_dtype, args.rows, args.vocab,
                        args.options.ignore_index);
  if (!status.ok()) return status;

  const CrossEntropyOptions& options = args.options;
  const int64_t rows = args.rows;
  const int64_t vocab = args.vocab;
  const double vocab_d = static_cast<double>(vocab);
  const double eps = options.label_smoothing;
  const double softcap = options.softcap;
  const double z_loss_scale = options.z_loss_scale;
  auto weight = [&](int64_t c) -> double {
    return args.class_weights == nullptr ? 1.0 : args.class_weights[c];
  };

  double total_weight = 0.0;  // W
  for (int64_t c = 0; c < vocab; ++c) total_weight += weight(c);
  int64_t valid_tokens = 0;
  double target_weight_sum = 0.0;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t target = LoadTarget(args.targets, args.targets_dtype, row);
    if (target == options.ignore_index) continue;
    ++valid_tokens;
    target_weight_sum += weight(target);
  }
  const bool mean = options.reduction == Reduction::kMean;
  const double denominator =
      options.normalizer > 0.0 ? options.normalizer : target_weight_sum;
  double s = options.grad_scale;
  if (mean) s = valid_tokens > 0 ? options.grad_scale / denominator : 0.0;

  void* gradient = args.mode == GradientMode::kNone ? nullptr : args.gradient;
  CrossEntropyResult out;
  out.valid_tokens = valid_tokens;
  std::vector<double> x(vocab);
  std::vector<double> z(vocab);
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t offset = row * args.row_stride;
    for (int64_t c = 0; c < vocab; ++c) {
      x[c] = LoadLogit(args.logits, args.logits_dtype, offset + c);
      z[c] = softcap > 0.0 ? softcap * std::tanh(x[c] / softcap) : x[c];
    }
    double max_z = -std::numeric_limits<double>::infinity();
    int64_t argmax = 0;
    for (int64_t c = 0; c < vocab; ++c) ArgmaxUpdate(z[c], c, &max_z, &argmax);
    double sum_exp = 0.0;
    for (int64_t c = 0; c < vocab; ++c) sum_exp += std::exp(z[c] - max_z);
    const double lse = max_z + std::log(sum_exp);
    if (args.token_lse != nullptr)
      args.token_lse[row] = static_cast<float>(lse);
    if (args.token_argmax != nullptr) {
      args.token_argmax[row] = static_cast<int32_t>(argmax);
    }

    const int64_t y = LoadTarget(args.targets, args.targets_dtype, row);
    if (y == options.ignore_index) {
      if (args.token_loss != nullptr) args.token_loss[row] = 0.0f;
      if (gradient != nullptr) {
        for (int64_t c = 0; c < vocab; ++c) {
          StoreDouble(gradient, args.logits_dtype, offset + c, 0.0);
        }
      }
      continue;
    }

    double smooth = 0.0;
    for (int64_t c = 0; c < vocab; ++c) smooth += weight(c) * (lse - z[c]);
    const double z_loss = z_loss_scale * lse * lse;
    // The smoothing term only when eps > 0: a -inf logit (a masked class)
    // makes `smooth` infinite, and 0 * inf would turn the loss into NaN where
    // torch gives a finite loss.
    const double loss = (1.0 - eps) * weight(y) * (lse - z[y]) +
                        (eps > 0.0 ? eps / vocab_d * smooth : 0.0) + z_loss;
    out.loss += loss;
    out.z_loss += z_loss;
    if (!std::isfinite(loss)) ++out.nonfinite_rows;
    if (argmax == y) ++out.correct_tokens;
    if (args.token_loss != nullptr)
      args.token_loss[row] = static_cast<float>(loss);

    if (gradient == nullptr) continue;
    for (int64_t c = 0; c < vocab; ++c) {
      const double p = std::exp(z[c] - lse);
      double g = p * ((1.0 - eps) * weight(y) + eps * total_weight / vocab_d +
                      2.0 * z_loss_scale * lse) -
                 eps * weight(c) / vocab_d;
      if (c == y) g -= (1.0 - eps) * weight(y);
      g *= s;
      if (softcap > 0.0) {
        // dz/dx = 1 - tanh(u)^2 = 1 / cosh(u)^2, the latter accurate where
        // tanh saturates.
        const double cosh_u = std::cosh(x[c] / softcap);
        g /= cosh_u * cosh_u;
      }
      StoreDouble(gradient, args.logits_dtype, offset + c, g);
    }
  }
  if (mean) {
    if (valid_tokens > 0) {
      out.loss /= denominator;
      out.z_loss /= denominator;
    } else {
      out.loss = 0.0;
      out.z_loss = 0.0;
    }
    if (valid_tokens > 0 || options.normalizer > 0.0)
      out.denominator = denominator;
  }
  *result = out;
  return absl::OkStatus();
}

}  // namespace lossd
