// The fp64 CPU backend of the post-training losses: per row its statistics,
// its loss, then one gradient pass over the vocabulary.
#include "kernels/cpu/post_training_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cross_entropy_cpu.h"
#include "kernels/cpu/cross_entropy_internal.h"
#include "kernels/cross_entropy_validate.h"

namespace lossd {
namespace {

using cpu_internal::ArgmaxUpdate;
using cpu_internal::LoadLogit;
using cpu_internal::StoreDouble;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

absl::Status Invalid(const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat("post_training: ", message));
}

int64_t LoadIndex(const void* indices, DType dtype, int64_t i) {
  return LoadTarget(indices, dtype, i);
}

// log(exp(a) + exp(b)) without overflow; -inf when both are.
double LogAddExp(double a, double b) {
  const double m = std::max(a, b);
  if (m == -kInf) return -kInf;
  return m + std::log(std::exp(a - m) + std::exp(b - m));
}

// x * log-ratio with 0 * anything = 0 (a bucket of mass 0 adds nothing).
double MassTimes(double mass, double log_ratio) {
  return mass > 0.0 ? mass * log_ratio : 0.0;
}

// The divergence computed for `kd`. Liger and TRL: JSD with beta 0 / 1 is
// the forward / reverse KL.
Divergence ComputedDivergence(const DistillationArgs& kd) {
  if (kd.divergence == Divergence::kJsd && kd.beta == 0.0f) {
    return Divergence::kForwardKl;
  }
  if (kd.divergence == Divergence::kJsd && kd.beta == 1.0f) {
    return Divergence::kReverseKl;
  }
  return kd.divergence;
}

// One divergence over B buckets given log P_b (student) and log Q_b
// (teacher): returns D and fills h_b = P_b dD/dP_b, whose sum is gbar of
// kernels/post_training.h.
double BucketDivergence(const DistillationArgs& kd,
                        const std::vector<double>& log_p,
                        const std::vector<double>& log_q,
                        std::vector<double>* h) {
  const size_t buckets = log_p.size();
  h->assign(buckets, 0.0);
  const double beta = kd.beta;
  const Divergence kind = ComputedDivergence(kd);
  double d = 0.0;
  for (size_t b = 0; b < buckets; ++b) {
    const double p = std::exp(log_p[b]);
    const double q = std::exp(log_q[b]);
    switch (kind) {
      case Divergence::kForwardKl:
        d += MassTimes(q, log_q[b] - log_p[b]);
        (*h)[b] = -q;
        break;
      case Divergence::kReverseKl:
        d += MassTimes(p, log_p[b] - log_q[b]);
        (*h)[b] = MassTimes(p, log_p[b] - log_q[b] + 1.0);
        break;
      case Divergence::kJsd: {
        const double log_m =
            LogAddExp(std::log(beta) + log_q[b], std::log1p(-beta) + log_p[b]);
        d += beta * MassTimes(q, log_q[b] - log_m) +
             (1.0 - beta) * MassTimes(p, log_p[b] - log_m);
        (*h)[b] = (1.0 - beta) * MassTimes(p, log_p[b] - log_m);
        break;
      }
    }
  }
  return d;
}

// gbar = sum_b P_b g_b of a divergence's buckets (log P_b and h_b = P_b g_b),
// taken against the heaviest bucket d: gbar = g_d - spread with spread =
// sum_{b != d} (P_b g_d - h_b) = sum_{b != d} P_b (g_d - g_b). Bucket d's
// gradient factor g_d - gbar is then `spread` itself: where d holds nearly
// all the mass it is tiny, and sum_b h_b - P_d g_d would give it as the
// difference of two numbers of the size of g_d, losing its digits (a top-k
// tail of mass 1 - 1e-10: 1e-5 of the row's largest gradient element).
struct CenteredMean {
  double gbar = 0.0;
  size_t heaviest = 0;
  double spread = 0.0;  // g_heaviest - gbar
};

CenteredMean CenterOnHeaviest(const std::vector<double>& log_p,
                              const std::vector<double>& h) {
  CenteredMean mean;
  for (size_t b = 1; b < log_p.size(); ++b) {
    if (log_p[b] > log_p[mean.heaviest]) mean.heaviest = b;
  }
  const double p_d = std::exp(log_p[mean.heaviest]);
  const double g_d = p_d > 0.0 ? h[mean.heaviest] / p_d : 0.0;
  for (size_t b = 0; b < log_p.size(); ++b) {
    if (b != mean.heaviest) mean.spread += std::exp(log_p[b]) * g_d - h[b];
  }
  mean.gbar = g_d - mean.spread;
  return mean;
}

// w (g_b - gbar), the gradient factor of a class of weight w in bucket b with
// h_b = w g_b (a class that is its bucket) or g_b given (`h_is_g`).
double BucketFactor(const CenteredMean& mean, size_t bucket, double w,
                    double h_or_g, bool h_is_g) {
  if (bucket == mean.heaviest) return w * mean.spread;
  return h_is_g ? w * (h_or_g - mean.gbar) : h_or_g - w * mean.gbar;
}

// Everything the rows share.
struct Plan {
  const PostTrainingArgs* args;
  void* gradient;           // nullptr for kNone
  const double* row_scale;  // ds/dl_i for each row (0 for ignored rows)
};

// Per-row workspace, one per thread.
struct Scratch {
  std::vector<double> x, z, grad, log_p, log_q, h;
  std::vector<int64_t> stamp;  // stamp[c] == row + 1: c is in the row's top k
};

// What the steps of one row share: its index, target, statistics at
// temperature 1 and the workspace (z the softcapped logits, grad dl_i/dz).
struct Row {
  int64_t index = 0;
  int64_t y = -1;  // -1: no targets
  double lse = 0.0;
  double logp = 0.0;
  Scratch* scratch = nullptr;
};

// Loads the row, takes its max, argmax, lse and entropy, and writes the
// per-token outputs every row has.
Row LoadRow(const PostTrainingArgs& args, int64_t index, Scratch* scratch,
            PostTrainingRowTotals* totals) {
  const CrossEntropyArgs& base = args.base;
  const int64_t vocab = base.vocab;
  const double softcap = base.options.softcap;
  const int64_t offset = index * base.row_stride;
  std::vector<double>& x = scratch->x;
  std::vector<double>& z = scratch->z;
  for (int64_t c = 0; c < vocab; ++c) {
    x[c] = LoadLogit(base.logits, base.logits_dtype, offset + c);
    z[c] = softcap > 0.0 ? softcap * std::tanh(x[c] / softcap) : x[c];
  }
  double max_z = -kInf;
  int64_t argmax = 0;
  for (int64_t c = 0; c < vocab; ++c) ArgmaxUpdate(z[c], c, &max_z, &argmax);
  double sum_exp = 0.0;
  for (int64_t c = 0; c < vocab; ++c) sum_exp += std::exp(z[c] - max_z);
  Row row;
  row.index = index;
  row.scratch = scratch;
  row.lse = max_z + std::log(sum_exp);
  // Entropy lse - sum p z, with 0 * (-inf) = 0 for masked classes.
  double expected_z = 0.0;
  for (int64_t c = 0; c < vocab; ++c) {
    const double p = std::exp(z[c] - row.lse);
    if (p > 0.0) expected_z += p * z[c];
  }
  totals->entropy = row.lse - expected_z;
  if (base.token_lse != nullptr) {
    base.token_lse[index] = static_cast<float>(row.lse);
  }
  if (base.token_argmax != nullptr) {
    base.token_argmax[index] = static_cast<int32_t>(argmax);
  }
  if (args.token_entropy != nullptr) {
    args.token_entropy[index] = static_cast<float>(totals->entropy);
  }
  if (base.targets != nullptr) {
    row.y = LoadTarget(base.targets, base.targets_dtype, index);
    totals->correct = argmax == row.y;
  }
  return row;
}

// The (label-smoothed) cross entropy of a valid row against its target,
// times `weight`; weight * dCE/dz added into scratch->grad. With smoothing
// eps: (1 - eps)(lse - z_y) + eps (lse - mean_c z_c), gradient
// p_c - (1 - eps)[c == y] - eps / V.
double CrossEntropyRow(const Row& row, double smoothing, double weight) {
  std::vector<double>& grad = row.scratch->grad;
  const std::vector<double>& z = row.scratch->z;
  const double vocab = static_cast<double>(z.size());
  double z_sum = 0.0;
  for (size_t c = 0; c < z.size(); ++c) {
    grad[c] += weight * (std::exp(z[c] - row.lse) - smoothing / vocab);
    if (smoothing > 0.0) z_sum += z[c];
  }
  grad[row.y] -= weight * (1.0 - smoothing);
  double loss = (1.0 - smoothing) * -row.logp;
  if (smoothing > 0.0) loss += smoothing * (row.lse - z_sum / vocab);
  return weight * loss;
}

// The policy loss of a valid row; its gradient into scratch->grad.
double PolicyRow(const PolicyArgs& pg, const Row& row,
                 PostTrainingRowTotals* totals) {
  const int64_t i = row.index;
  const double advantage = pg.advantages[i];
  const double ratio = std::exp(row.logp - pg.sampling_logprobs[i]);
  const double clipped_ratio =
      std::min(std::max(ratio, 1.0 - static_cast<double>(pg.epsilon_low)),
               1.0 + static_cast<double>(pg.epsilon_high));
  double loss = 0.0;
  double dlogp = 0.0;  // dl/dlogp
  switch (pg.loss) {
    case PolicyLossKind::kImportanceSampling:
      loss = -ratio * advantage;
      dlogp = -ratio * advantage;
      break;
    case PolicyLossKind::kPpoClip: {
      const double unclipped = -ratio * advantage;
      const double clipped = -clipped_ratio * advantage;
      totals->clipped = clipped > unclipped;
      loss = std::max(unclipped, clipped);
      dlogp = totals->clipped ? 0.0 : -ratio * advantage;
      break;
    }
    case PolicyLossKind::kCispo:
      totals->clipped = clipped_ratio != ratio;
      loss = -clipped_ratio * advantage * row.logp;
      dlogp = -clipped_ratio * advantage;
      break;
  }
  if (pg.reference_logprobs != nullptr) {
    const double d = pg.reference_logprobs[i] - row.logp;
    double kl = 0.0, dkl = 0.0;
    switch (pg.kl_estimator) {
      case KlEstimator::kK1:
        kl = -d;
        dkl = 1.0;
        break;
      case KlEstimator::kK2:
        kl = 0.5 * d * d;
        dkl = -d;
        break;
      case KlEstimator::kK3:
        kl = std::exp(d) - d - 1.0;
        dkl = 1.0 - std::exp(d);
        break;
    }
    totals->kl = kl;
    if (pg.kl_coef > 0.0f) {
      loss += pg.kl_coef * kl;
      dlogp += pg.kl_coef * dkl;
    }
  }
  totals->ratio = ratio;
  totals->approx_kl = pg.sampling_logprobs[i] - row.logp;
  // dlogp/dz_c = [c == y] - p_c.
  std::vector<double>& grad = row.scratch->grad;
  const std::vector<double>& z = row.scratch->z;
  for (size_t c = 0; c < z.size(); ++c) {
    grad[c] = -dlogp * std::exp(z[c] - row.lse);
  }
  grad[row.y] += dlogp;
  return loss;
}

// A dense teacher's divergence; its gradient (times kd_scale) added into
// grad. log_p holds the student's log p at the temperature.
double DenseDivergence(const DistillationArgs& kd, const Row& row,
                       double kd_scale) {
  Scratch& scratch = *row.scratch;
  const int64_t vocab = static_cast<int64_t>(scratch.log_p.size());
  const int64_t offset = row.index * kd.teacher_row_stride;
  std::vector<double>& log_q = scratch.log_q;
  log_q.resize(vocab);
  double max_t = -kInf;
  for (int64_t c = 0; c < vocab; ++c) {
    log_q[c] = LoadLogit(kd.teacher_logits, kd.teacher_dtype, offset + c) /
               kd.temperature;
    max_t = std::max(max_t, log_q[c]);
  }
  // A teacher row of no mass (every logit -inf) has no distribution.
  if (max_t == -kInf) return kNaN;
  double sum_t = 0.0;
  for (int64_t c = 0; c < vocab; ++c) sum_t += std::exp(log_q[c] - max_t);
  const double lse_t = max_t + std::log(sum_t);
  for (int64_t c = 0; c < vocab; ++c) log_q[c] -= lse_t;
  const double divergence =
      BucketDivergence(kd, scratch.log_p, log_q, &scratch.h);
  const CenteredMean mean = CenterOnHeaviest(scratch.log_p, scratch.h);
  for (int64_t c = 0; c < vocab; ++c) {
    scratch.grad[c] +=
        kd_scale * BucketFactor(mean, static_cast<size_t>(c),
                                std::exp(scratch.log_p[c]), scratch.h[c],
                                /*h_is_g=*/false);
  }
  return divergence;
}

// A top-k teacher's divergence (renormalized, or with the tail bucket); its
// gradient (times kd_scale) added into grad. full_log_p holds the student's
// log p at the temperature over the vocabulary.
double TopKDivergence(const DistillationArgs& kd, const Row& row,
                      const std::vector<double>& full_log_p, double kd_scale) {
  Scratch& scratch = *row.scratch;
  const int64_t vocab = static_cast<int64_t>(full_log_p.size());
  const int64_t k = kd.top_k;
  const float* logprobs = kd.top_k_logprobs + row.index * k;
  std::vector<int64_t> index(k);
  for (int64_t j = 0; j < k; ++j) {
    index[j] =
        LoadIndex(kd.top_k_indices, kd.top_k_indices_dtype, row.index * k + j);
    scratch.stamp[index[j]] = row.index + 1;
  }
  std::vector<double> log_p(k), log_q(k);
  const bool tail = kd.tail == TopKTail::kBucket && k < vocab;
  double tail_p = 0.0;
  if (kd.tail == TopKTail::kRenormalize) {
    double max_s = -kInf, max_l = -kInf;
    for (int64_t j = 0; j < k; ++j) {
      max_s = std::max(max_s, full_log_p[index[j]]);
      max_l = std::max(max_l, static_cast<double>(logprobs[j]));
    }
    // A student of no mass on the support has no renormalised distribution
    // (CheckPostTrainingData refuses the teacher's).
    if (max_s == -kInf) return kNaN;
    double sum_s = 0.0, sum_l = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      sum_s += std::exp(full_log_p[index[j]] - max_s);
      sum_l += std::exp(logprobs[j] - max_l);
    }
    for (int64_t j = 0; j < k; ++j) {
      log_p[j] = full_log_p[index[j]] - max_s - std::log(sum_s);
      log_q[j] = logprobs[j] - max_l - std::log(sum_l);
    }
  } else {
    double teacher_mass = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      log_p[j] = full_log_p[index[j]];
      log_q[j] = logprobs[j];
      teacher_mass += std::exp(static_cast<double>(logprobs[j]));
    }
    if (tail) {
      // The student's tail summed over its members, not 1 - support: the
      // difference would lose the tail's digits when it is small.
      for (int64_t c = 0; c < vocab; ++c) {
        if (scratch.stamp[c] != row.index + 1) {
          tail_p += std::exp(full_log_p[c]);
        }
      }
      log_p.push_back(std::log(tail_p));
      log_q.push_back(std::log(std::max(0.0, 1.0 - teacher_mass)));
    }
  }
  const double divergence = BucketDivergence(kd, log_p, log_q, &scratch.h);
  const CenteredMean mean = CenterOnHeaviest(log_p, scratch.h);
  if (tail) {
    // Every class off the support as p_c (g_tail - gbar).
    const double tail_g = tail_p > 0.0 ? scratch.h[k] / tail_p : 0.0;
    for (int64_t c = 0; c < vocab; ++c) {
      if (scratch.stamp[c] == row.index + 1) continue;
      scratch.grad[c] +=
          kd_scale * BucketFactor(mean, static_cast<size_t>(k),
                                  std::exp(full_log_p[c]), tail_g,
                                  /*h_is_g=*/true);
    }
  }
  for (int64_t j = 0; j < k; ++j) {
    scratch.grad[index[j]] +=
        kd_scale * BucketFactor(mean, static_cast<size_t>(j),
                                std::exp(log_p[j]), scratch.h[j],
                                /*h_is_g=*/false);
  }
  return divergence;
}

// The distillation loss of a valid row; its gradient into scratch->grad.
double DistillationRow(const DistillationArgs& kd, const Row& row,
                       double smoothing, PostTrainingRowTotals* totals) {
  Scratch& scratch = *row.scratch;
  const std::vector<double>& z = scratch.z;
  const int64_t vocab = static_cast<int64_t>(z.size());
  const double tau = kd.temperature;
  const double alpha = kd.alpha;
  double loss = 0.0;
  if (alpha > 0.0) loss += CrossEntropyRow(row, smoothing, alpha);
  // The student at the temperature: log softmax(z / tau).
  double max_u = -kInf;
  for (int64_t c = 0; c < vocab; ++c) max_u = std::max(max_u, z[c] / tau);
  if (max_u == -kInf) {
    // A student row of no mass (every logit -inf) has no distribution.
    totals->distillation = kNaN;
    return loss + (1.0 - alpha) * kNaN;
  }
  double sum_u = 0.0;
  for (int64_t c = 0; c < vocab; ++c) sum_u += std::exp(z[c] / tau - max_u);
  const double lse_u = max_u + std::log(sum_u);
  std::vector<double> full_log_p(vocab);
  for (int64_t c = 0; c < vocab; ++c) full_log_p[c] = z[c] / tau - lse_u;
  // dD/du_c, added into grad scaled by (1 - alpha) / tau.
  const double kd_scale = (1.0 - alpha) / tau;
  double divergence = 0.0;
  if (kd.teacher_logits != nullptr) {
    scratch.log_p = full_log_p;
    divergence = DenseDivergence(kd, row, kd_scale);
  } else {
    divergence = TopKDivergence(kd, row, full_log_p, kd_scale);
  }
  totals->distillation = divergence;
  return loss + (1.0 - alpha) * divergence;
}

// Writes the row's gradient: grad times the row's factor, through softcap.
void WriteRowGradient(const Plan& plan, const Row& row) {
  const CrossEntropyArgs& base = plan.args->base;
  const double softcap = base.options.softcap;
  const int64_t offset = row.index * base.row_stride;
  const double s = plan.row_scale[row.index];
  const Scratch& scratch = *row.scratch;
  for (int64_t c = 0; c < base.vocab; ++c) {
    double g = scratch.grad[c] * s;
    if (softcap > 0.0) {
      const double cosh_u = std::cosh(scratch.x[c] / softcap);
      g /= cosh_u * cosh_u;
    }
    StoreDouble(plan.gradient, base.logits_dtype, offset + c, g);
  }
}

PostTrainingRowTotals ComputeRow(const Plan& plan, int64_t index,
                                 Scratch* scratch) {
  const PostTrainingArgs& args = *plan.args;
  const CrossEntropyArgs& base = args.base;
  PostTrainingRowTotals totals;
  Row row = LoadRow(args, index, scratch, &totals);
  if (!PostTrainingRowIsValid(args, index)) {
    totals = PostTrainingRowTotals();
    if (base.token_loss != nullptr) base.token_loss[index] = 0.0f;
    if (args.token_logprob != nullptr) args.token_logprob[index] = 0.0f;
    if (args.token_ratio != nullptr) args.token_ratio[index] = 0.0f;
    if (args.token_clipped != nullptr) args.token_clipped[index] = 0;
    if (plan.gradient != nullptr) {
      const int64_t offset = index * base.row_stride;
      for (int64_t c = 0; c < base.vocab; ++c) {
        StoreDouble(plan.gradient, base.logits_dtype, offset + c, 0.0);
      }
    }
    return totals;
  }
  totals.valid = true;
  row.logp = row.y >= 0 ? scratch->z[row.y] - row.lse : 0.0;
  if (args.token_logprob != nullptr) {
    args.token_logprob[index] = static_cast<float>(row.logp);
  }
  std::fill(scratch->grad.begin(), scratch->grad.end(), 0.0);
  double loss = 0.0;
  if (args.policy != nullptr) {
    loss = PolicyRow(*args.policy, row, &totals);
  } else {
    // Only the policy sums the entropy over the tokens.
    totals.entropy = 0.0;
    const double smoothing = base.options.label_smoothing;
    if (args.distillation != nullptr) {
      loss = DistillationRow(*args.distillation, row, smoothing, &totals);
    } else {
      loss = CrossEntropyRow(row, smoothing, 1.0);
    }
  }
  const double z_loss_scale = base.options.z_loss_scale;
  if (z_loss_scale > 0.0) {
    // PaLM's z-loss on every valid row: z_loss_scale lse^2, gradient
    // 2 z_loss_scale lse p_c.
    totals.z_loss = z_loss_scale * row.lse * row.lse;
    loss += totals.z_loss;
    for (size_t c = 0; c < scratch->z.size(); ++c) {
      scratch->grad[c] +=
          2.0 * z_loss_scale * row.lse * std::exp(scratch->z[c] - row.lse);
    }
  }
  totals.loss = loss;
  if (args.distillation != nullptr &&
      DistillationGradientIsNan(
          ComputedDivergence(*args.distillation) == Divergence::kReverseKl,
          totals.distillation)) {
    std::fill(scratch->grad.begin(), scratch->grad.end(), kNaN);
  }
  if (args.token_ratio != nullptr) {
    args.token_ratio[index] = static_cast<float>(totals.ratio);
  }
  if (args.token_clipped != nullptr) args.token_clipped[index] = totals.clipped;
  if (base.token_loss != nullptr) {
    base.token_loss[index] = static_cast<float>(loss);
  }
  if (plan.gradient != nullptr) WriteRowGradient(plan, row);
  return totals;
}

}  // namespace

void PostTrainingCpuRows(const PostTrainingArgs& args, const double* row_scale,
                         PostTrainingRowTotals* totals, int num_threads) {
  const CrossEntropyArgs& base = args.base;
  const int64_t rows = base.rows;
  Plan plan;
  plan.args = &args;
  plan.gradient = base.mode == GradientMode::kNone ? nullptr : base.gradient;
  plan.row_scale = row_scale;
  unsigned threads = num_threads > 0 ? static_cast<unsigned>(num_threads)
                                     : std::thread::hardware_concurrency();
  threads = std::max(
      1u, std::min<unsigned>(
              threads, static_cast<unsigned>(std::max<int64_t>(1, rows / 8))));
  auto work = [&](unsigned thread) {
    Scratch scratch;
    scratch.x.resize(base.vocab);
    scratch.z.resize(base.vocab);
    scratch.grad.resize(base.vocab);
    scratch.stamp.assign(base.vocab, 0);
    const int64_t begin = rows * thread / threads;
    const int64_t end = rows * (thread + 1) / threads;
    for (int64_t row = begin; row < end; ++row) {
      totals[row] = ComputeRow(plan, row, &scratch);
    }
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (std::thread& thread : pool) thread.join();
}

absl::Status PostTrainingCpu(const PostTrainingArgs& args,
                             PostTrainingResult* result, int num_threads) {
  if (result == nullptr) return Invalid("result is nullptr");
  absl::Status status = ValidatePostTrainingArgs(args);
  if (!status.ok()) return status;
  status = CheckPostTrainingData(args);
  if (!status.ok()) return status;

  // The reduction's factors depend on the targets and segment ids only, so
  // they are known before any row is computed. The gradient scale is folded
  // into the gradient's factors only.
  const PostTrainingPlan plan = PlanPostTraining(args);
  std::vector<double> row_scale = plan.row_scale;
  for (double& scale : row_scale) scale *= args.base.options.grad_scale;
  std::vector<PostTrainingRowTotals> totals(args.base.rows);
  PostTrainingCpuRows(args, row_scale.data(), totals.data(), num_threads);
  *result = ReducePostTrainingRows(args, plan, totals);
  return absl::OkStatus();
}

}  // namespace lossd
