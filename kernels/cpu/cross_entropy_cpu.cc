// Argument validation and the fast multithreaded CPU backend. Rows are
// independent, so threads take fixed blocks of rows; per-block fp64 totals are
// summed in block order afterwards, which keeps the result independent of the
// thread count.
#include "kernels/cpu/cross_entropy_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/float16.h"
#include "kernels/cpu/cross_entropy_internal.h"

namespace lossd {
namespace {

using cpu_internal::ArgmaxUpdate;
using cpu_internal::BFloat16Format;
using cpu_internal::Float16Format;
using cpu_internal::Float32Format;
using cpu_internal::StoreDouble;

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat("cross_entropy: ", message));
}

// Everything a row needs that is the same for all rows of one call.
struct Plan {
  const CrossEntropyArgs* args;
  void* gradient;  // where the gradient goes; nullptr for kNone
  double total_weight;
  double row_scale;  // s of the contract: grad_scale, divided by D for kMean
};

struct Totals {
  double loss = 0.0;
  double z_loss = 0.0;
  int64_t correct = 0;
  int64_t nonfinite = 0;
};

// exp(x) for the x <= 0 of a softmax after its max is subtracted, within 1 ulp
// (Cephes' polynomial). Branch-free so that the row loop vectorizes, which a
// call to the libm expf prevents. Below -87 (results under FLT_MIN, invisible
// next to the row maximum's 1) it returns 0; NaN stays NaN.
inline float ExpNonPositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  // Adding 1.5 * 2^23 rounds x * log2(e) to an integer n held in the low
  // mantissa bits, which then build 2^n directly.
  constexpr float kRoundMagic = 12582912.0f;
  const float shifted = clamped * 1.44269504f + kRoundMagic;
  const float n = shifted - kRoundMagic;
  const uint32_t scale_bits =
      (FloatBits(shifted) - FloatBits(kRoundMagic) + 127u) << 23;
  // r = x - n * ln(2) in two steps so that r keeps its low bits.
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const float result = y * FloatFromBits(scale_bits);
  return x < -87.0f ? 0.0f : result;
}

// Per-thread scratch rows of `vocab` floats.
struct Scratch {
  std::vector<float> z;          // z (softcap applied)
  std::vector<float> e;          // exp(z - max)
  std::vector<float> softcap_d;  // dz/dx, only with softcap and a gradient
};

// d tanh(u)/du = sech(u)^2 = 4q / (1 + q)^2 with q = exp(-2|u|): accurate
// relative to its (tiny) value where tanh saturates, unlike 1 - tanh(u)^2.
inline float SoftcapDerivative(float u) {
  const float q = std::exp(-2.0f * std::fabs(u));
  return 4.0f * q / ((1.0f + q) * (1.0f + q));
}

// Pass 1 of a row: its logits `in` as z (softcap applied; and dz/dx for a
// gradient) into `scratch`, with z's max and its first index.
template <typename Format>
void LoadRow(const Plan& plan, const typename Format::Storage* in,
             Scratch* scratch, float* max_z, int64_t* argmax) {
  const int64_t vocab = plan.args->vocab;
  const float softcap = plan.args->options.softcap;
  float* z = scratch->z.data();
  float* softcap_d = scratch->softcap_d.data();
  if (softcap > 0.0f) {
    // In fp64, rounded once: tanhf plus the float divide and multiply left
    // z (|z| up to the cap, 20-50) a few ulps off, i.e. ~1e-6 of every p
    // (oracle seed 2497868560, case 384: 1.2e-6 > the 1e-6 fp32 limit).
    const double cap = softcap;
    for (int64_t c = 0; c < vocab; ++c) {
      z[c] = static_cast<float>(
          cap * std::tanh(static_cast<double>(Format::Load(in[c])) / cap));
    }
    if (plan.gradient != nullptr) {
      for (int64_t c = 0; c < vocab; ++c) {
        softcap_d[c] = SoftcapDerivative(Format::Load(in[c]) / softcap);
      }
    }
  } else {
    for (int64_t c = 0; c < vocab; ++c) z[c] = Format::Load(in[c]);
  }
  // Locals, not the out-parameters: the loop then keeps them in registers.
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_index = 0;
  for (int64_t c = 0; c < vocab; ++c) ArgmaxUpdate(z[c], c, &best, &best_index);
  *max_z = best;
  *argmax = best_index;
}

// Pass 3 of a valid row (target `target`, log-sum-exp `lse`, sum of
// exp(z - max) `sum_exp`): the gradient into `out`, in fp32 math with one
// rounding, and the target column from fp64 math.
template <typename Format>
void WriteRowGradient(const Plan& plan, const typename Format::Storage* in,
                      int64_t target, double lse, double sum_exp,
                      const Scratch& scratch, typename Format::Storage* out) {
  const CrossEntropyArgs& args = *plan.args;
  const CrossEntropyOptions& options = args.options;
  const int64_t vocab = args.vocab;
  const float softcap = options.softcap;
  const float* weights = args.class_weights;
  const float eps = options.label_smoothing;
  const float* e = scratch.e.data();
  const float* softcap_d = scratch.softcap_d.data();
  const double target_weight = weights == nullptr ? 1.0 : weights[target];
  const double z_target = scratch.z[static_cast<size_t>(target)];
  // dL/dz_c = s * (p_c * a - eps * w_c / V - (1 - eps) * w_y * [c == y]).
  const double target_coeff = (1.0 - eps) * target_weight;
  const double a = target_coeff +
                   eps * plan.total_weight / static_cast<double>(vocab) +
                   2.0 * options.z_loss_scale * lse;
  const double s = plan.row_scale;
  // p_y * a - (1 - eps) * w_y = (1 - eps) * w_y * (p_y - 1) + p_y * (a - (1 -
  // eps) * w_y), with p_y - 1 = expm1(z_y - lse) exact even when p_y ~ 1.
  // Computed before the loop below overwrites the logits (in-place mode).
  const double p_target_minus_one = std::expm1(z_target - lse);
  double g_target = s * (target_coeff * p_target_minus_one +
                         (p_target_minus_one + 1.0) * (a - target_coeff) -
                         eps * target_weight / static_cast<double>(vocab));
  if (softcap > 0.0f) {
    const double cosh_u =
        std::cosh(static_cast<double>(Format::Load(in[target])) / softcap);
    g_target /= cosh_u * cosh_u;
  }

  const float s_a = static_cast<float>(s * a);
  const float s_eps_v =
      static_cast<float>(s * eps / static_cast<double>(vocab));
  const float inv_sum = static_cast<float>(1.0 / sum_exp);
  if (softcap > 0.0f) {
    for (int64_t c = 0; c < vocab; ++c) {
      const float w = weights == nullptr ? 1.0f : weights[c];
      out[c] =
          Format::Store((e[c] * inv_sum * s_a - s_eps_v * w) * softcap_d[c]);
    }
  } else if (weights == nullptr) {
    for (int64_t c = 0; c < vocab; ++c) {
      out[c] = Format::Store(e[c] * inv_sum * s_a - s_eps_v);
    }
  } else {
    for (int64_t c = 0; c < vocab; ++c) {
      out[c] = Format::Store(e[c] * inv_sum * s_a - s_eps_v * weights[c]);
    }
  }
  StoreDouble(out, args.logits_dtype, target, g_target);
}

// One row: pass 1 converts to z (softcap applied) and finds the max; pass 2
// stores exp(z - max) with fp64 sums; pass 3 writes the gradient in fp32 math
// with one rounding, and the target column from fp64 math with an expm1 so
// that p_y - 1 does not cancel.
template <typename Format>
void ProcessRow(const Plan& plan, int64_t row, Scratch* scratch,
                Totals* totals) {
  using Storage = typename Format::Storage;
  const CrossEntropyArgs& args = *plan.args;
  const CrossEntropyOptions& options = args.options;
  const int64_t vocab = args.vocab;
  const Storage* in =
      static_cast<const Storage*>(args.logits) + row * args.row_stride;
  const float* weights = args.class_weights;
  const float eps = options.label_smoothing;
  float* z = scratch->z.data();
  float* e = scratch->e.data();

  float max_z = 0.0f;
  int64_t argmax = 0;
  LoadRow<Format>(plan, in, scratch, &max_z, &argmax);

  for (int64_t c = 0; c < vocab; ++c) e[c] = ExpNonPositive(z[c] - max_z);
  // Four fp64 partial sums in a fixed order: accurate, deterministic, and not
  // one long dependency chain.
  double partial[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t c4 = 0;
  for (; c4 + 4 <= vocab; c4 += 4) {
    partial[0] += e[c4];
    partial[1] += e[c4 + 1];
    partial[2] += e[c4 + 2];
    partial[3] += e[c4 + 3];
  }
  for (; c4 < vocab; ++c4) partial[0] += e[c4];
  const double sum_exp = (partial[0] + partial[1]) + (partial[2] + partial[3]);
  double weighted_shifted_sum = 0.0;  // sum_c w_c * (z_c - max)
  if (eps > 0.0f) {
    const double max_d = max_z;
    if (weights == nullptr) {
      for (int64_t c = 0; c < vocab; ++c) weighted_shifted_sum += z[c] - max_d;
    } else {
      for (int64_t c = 0; c < vocab; ++c) {
        weighted_shifted_sum +=
            static_cast<double>(weights[c]) * (z[c] - max_d);
      }
    }
  }
  const double log_sum = std::log(sum_exp);
  const double lse = max_z + log_sum;
  if (args.token_lse != nullptr) args.token_lse[row] = static_cast<float>(lse);
  if (args.token_argmax != nullptr) {
    args.token_argmax[row] = static_cast<int32_t>(argmax);
  }

  const int64_t target = LoadTarget(args.targets, args.targets_dtype, row);
  Storage* out =
      plan.gradient == nullptr
          ? nullptr
          : static_cast<Storage*>(plan.gradient) + row * args.row_stride;
  if (target == options.ignore_index) {
    if (args.token_loss != nullptr) args.token_loss[row] = 0.0f;
    if (out != nullptr) {
      const Storage zero = Format::Store(0.0f);
      for (int64_t c = 0; c < vocab; ++c) out[c] = zero;
    }
    return;
  }

  const double target_weight = weights == nullptr ? 1.0 : weights[target];
  const double z_target = z[target];
  const double smooth = plan.total_weight * log_sum - weighted_shifted_sum;
  const double z_loss = static_cast<double>(options.z_loss_scale) * lse * lse;
  // As the reference: no smoothing term at eps = 0 (0 * inf for a -inf
  // logit would be NaN).
  const double loss =
      (1.0 - eps) * target_weight * (lse - z_target) +
      (eps > 0.0f ? eps / static_cast<double>(vocab) * smooth : 0.0) + z_loss;
  if (!std::isfinite(loss)) ++totals->nonfinite;
  if (argmax == target) ++totals->correct;
  totals->loss += loss;
  totals->z_loss += z_loss;
  if (args.token_loss != nullptr) {
    args.token_loss[row] = static_cast<float>(loss);
  }
  if (out == nullptr) return;

  WriteRowGradient<Format>(plan, in, target, lse, sum_exp, *scratch, out);
}

template <typename Format>
void RunRows(const Plan& plan, int num_threads, int64_t block_rows,
             std::vector<Totals>* block_totals) {
  const int64_t rows = plan.args->rows;
  const int64_t vocab = plan.args->vocab;
  const int64_t num_blocks = static_cast<int64_t>(block_totals->size());
  std::atomic<int64_t> next_block{0};
  auto worker = [&]() {
    Scratch scratch;
    scratch.z.resize(vocab);
    scratch.e.resize(vocab);
    if (plan.gradient != nullptr && plan.args->options.softcap > 0.0f) {
      scratch.softcap_d.resize(vocab);
    }
    for (int64_t block = next_block.fetch_add(1); block < num_blocks;
         block = next_block.fetch_add(1)) {
      Totals& totals = (*block_totals)[block];
      const int64_t end = std::min(rows, (block + 1) * block_rows);
      for (int64_t row = block * block_rows; row < end; ++row) {
        ProcessRow<Format>(plan, row, &scratch, &totals);
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(num_threads - 1);
  for (int i = 1; i < num_threads; ++i) threads.emplace_back(worker);
  worker();
  for (std::thread& thread : threads) thread.join();
}

}  // namespace

absl::Status CrossEntropyCpu(const CrossEntropyArgs& args,
                             CrossEntropyResult* result, int num_threads) {
  if (result == nullptr) return Invalid("result is nullptr");
  absl::Status status = ValidateCrossEntropyArgs(args);
  if (!status.ok()) return status;
  status = CheckTargets(args.targets, args.targets_dtype, args.rows, args.vocab,
                        args.options.ignore_index);
  if (!status.ok()) return status;

  const CrossEntropyOptions& options = args.options;
  int64_t valid_tokens = 0;
  double target_weight_sum = 0.0;
  for (int64_t row = 0; row < args.rows; ++row) {
    const int64_t target = LoadTarget(args.targets, args.targets_dtype, row);
    if (target == options.ignore_index) continue;
    ++valid_tokens;
    target_weight_sum +=
        args.class_weights == nullptr ? 1.0 : args.class_weights[target];
  }
  double total_weight = static_cast<double>(args.vocab);
  if (args.class_weights != nullptr) {
    total_weight = 0.0;
    for (int64_t c = 0; c < args.vocab; ++c)
      total_weight += args.class_weights[c];
  }
  const bool mean = options.reduction == Reduction::kMean;
  const double denominator =
      options.normalizer > 0.0 ? options.normalizer : target_weight_sum;

  Plan plan;
  plan.args = &args;
  plan.gradient = args.mode == GradientMode::kNone ? nullptr : args.gradient;
  plan.total_weight = total_weight;
  plan.row_scale = options.grad_scale;
  if (mean)
    plan.row_scale = valid_tokens > 0 ? options.grad_scale / denominator : 0.0;

  // Blocks depend only on the shape, never on the thread count, so the block
  // totals (and their ordered sum) are the same for any num_threads.
  constexpr int64_t kBlockElements = int64_t{1} << 16;
  constexpr int64_t kMinElementsPerThread = int64_t{1} << 16;
  const int64_t block_rows =
      std::clamp<int64_t>(kBlockElements / args.vocab, 1, 256);
  const int64_t num_blocks = (args.rows + block_rows - 1) / block_rows;
  if (num_threads <= 0) {
    num_threads = static_cast<int>(std::thread::hardware_concurrency());
  }
  const int64_t by_work =
      std::max<int64_t>(1, args.rows * args.vocab / kMinElementsPerThread);
  num_threads = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>({num_threads, num_blocks, by_work})));

  std::vector<Totals> block_totals(num_blocks);
  switch (args.logits_dtype) {
    case DType::kFloat32:
      RunRows<Float32Format>(plan, num_threads, block_rows, &block_totals);
      break;
    case DType::kBFloat16:
      RunRows<BFloat16Format>(plan, num_threads, block_rows, &block_totals);
      break;
    default:
      RunRows<Float16Format>(plan, num_threads, block_rows, &block_totals);
      break;
  }

  Totals totals;
  for (const Totals& block : block_totals) {
    totals.loss += block.loss;
    totals.z_loss += block.z_loss;
    totals.correct += block.correct;
    totals.nonfinite += block.nonfinite;
  }
  CrossEntropyResult out;
  out.valid_tokens = valid_tokens;
  out.correct_tokens = totals.correct;
  out.nonfinite_rows = totals.nonfinite;
  out.loss = totals.loss;
  out.z_loss = totals.z_loss;
  if (mean) {
    if (valid_tokens > 0) {
      out.loss = totals.loss / denominator;
      out.z_loss = totals.z_loss / denominator;
    } else {
      out.loss = 0.0;
      out.z_loss = 0.0;
    }
    // An explicit normalizer is D whether or not a row is valid (as Evaluate
    // reports it); the automatic one is 0 without valid rows.
    if (valid_tokens > 0 || options.normalizer > 0.0)
      out.denominator = denominator;
  }
  *result = out;
  return absl::OkStatus();
}

}  // namespace lossd
