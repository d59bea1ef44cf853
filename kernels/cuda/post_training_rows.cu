// The row kernel of the post-training losses, a first landing: one block per
// row, fp32, passes for the statistics, the divergence's sums and the gradient
// written in place; the host wrapper reduces the rows' totals.
//
// Shapes: logits z [N, V] (row stride S), teacher [N, V], top-k [N, k],
// advantages / logprobs / targets / segment ids [N].
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "kernels/cuda/post_training_cuda.h"
#include "kernels/cuda/post_training_terms.cuh"

namespace lossd {
namespace {

constexpr int kThreads = 512;
constexpr int kMaxTopK = 512;

__device__ __forceinline__ float LoadF(const float* p, int64_t i) {
  return p[i];
}
__device__ __forceinline__ float LoadF(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ float LoadF(const __half* p, int64_t i) {
  return __half2float(p[i]);
}
__device__ __forceinline__ void StoreF(float* p, int64_t i, float v) {
  p[i] = v;
}
__device__ __forceinline__ void StoreF(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}
__device__ __forceinline__ void StoreF(__half* p, int64_t i, float v) {
  p[i] = __float2half_rn(v);
}

// A running max m, sum of exp(x - m) and sum of exp(x - m) * x.
struct Stats {
  float m;
  float s;
  float w;
};
__device__ __forceinline__ Stats EmptyStats() {
  return {-INFINITY, 0.0f, 0.0f};
}
__device__ __forceinline__ void Update(Stats* a, float x) {
  if (x == -INFINITY) return;  // a masked class adds nothing (and no NaN)
  if (x > a->m) {
    const float scale = expf(a->m - x);
    a->s *= scale;
    a->w *= scale;
    a->m = x;
  }
  const float e = expf(x - a->m);
  a->s += e;
  a->w += e * x;
}
struct MergeStats {
  __device__ __forceinline__ Stats operator()(const Stats& a,
                                              const Stats& b) const {
    const float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) return EmptyStats();
    const float sa = a.m == -INFINITY ? 0.0f : expf(a.m - m);
    const float sb = b.m == -INFINITY ? 0.0f : expf(b.m - m);
    return {m, a.s * sa + b.s * sb, a.w * sa + b.w * sb};
  }
};
__device__ __forceinline__ float Lse(const Stats& a) { return a.m + logf(a.s); }

// Argmax with the first index winning ties.
struct ArgMax {
  float value;
  int index;
};
struct MergeArgMax {
  __device__ __forceinline__ ArgMax operator()(const ArgMax& a,
                                               const ArgMax& b) const {
    if (b.value > a.value || (b.value == a.value && b.index < a.index)) {
      return b;
    }
    return a;
  }
};
struct Sum2 {
  float a;
  float b;
};
struct MergeSum2 {
  __device__ __forceinline__ Sum2 operator()(const Sum2& x,
                                             const Sum2& y) const {
    return {x.a + y.a, x.b + y.b};
  }
};

// The divergence's sums of a row: D, sum_b h_b and sum_b P_b, in fp64 (gbar
// is sum h / sum P: the P as computed, so that fp32's lse, which moves every
// P_b by the same factor, moves gbar with them instead of by gbar times it).
struct Sum3 {
  double d;
  double h;
  double p;
};
struct MergeSum3 {
  __device__ __forceinline__ Sum3 operator()(const Sum3& x,
                                             const Sum3& y) const {
    return {x.d + y.d, x.h + y.h, x.p + y.p};
  }
};

// A running max m, sum of exp(x - m) and sum of exp(x - m) (x - y) in fp64:
// with x the weights' side, the forward or reverse KL of a dense teacher in
// the statistics pass, sum_c q_c (v_c - u_c) or sum_c p_c (u_c - v_c) as w / s
// (u, v the student's and the teacher's logits over tau).
struct WeightedStats {
  float m;
  double s;
  double w;
};
__device__ __forceinline__ void Update(WeightedStats* a, float x, float y) {
  if (x == -INFINITY) return;
  if (x > a->m) {
    const double scale = exp(static_cast<double>(a->m) - x);
    a->s *= scale;
    a->w *= scale;
    a->m = x;
  }
  const double e = expf(x - a->m);
  a->s += e;
  a->w += e * (static_cast<double>(x) - y);
}
struct MergeWeightedStats {
  __device__ __forceinline__ WeightedStats
  operator()(const WeightedStats& a, const WeightedStats& b) const {
    const float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) return {-INFINITY, 0.0, 0.0};
    const double sa =
        a.m == -INFINITY ? 0.0 : exp(static_cast<double>(a.m) - m);
    const double sb =
        b.m == -INFINITY ? 0.0 : exp(static_cast<double>(b.m) - m);
    return {m, a.s * sa + b.s * sb, a.w * sa + b.w * sb};
  }
};

// Reverse KL's log P_c - log Q_c - k = u - v - k with k a row constant: u
// the student's logit over tau, v the teacher's (dense) or its logprob
// (top-k), k the gap of their normalisers, plus gbar for the gradient. In
// fp64: each log alone carries an fp32 rounding of its normaliser's size,
// and the gradient P_c (log P_c - log Q_c - gbar) of a row nearly sure of one
// class cancels them (two terms ~10, ~1e-3 apart).
__device__ __forceinline__ double LogRatio(float u, float v, double k) {
  return static_cast<double>(u) - static_cast<double>(v) - k;
}

struct Params {
  int64_t rows, vocab, stride;
  const void* logits;
  void* gradient;  // null: no gradient
  const void* targets;
  bool targets64;
  int64_t ignore_index;
  float softcap;
  float label_smoothing;  // the cross-entropy terms' (not with a policy)
  float z_loss_scale;
  const float* row_scale;
  // Distillation (kd), dense teacher or top-k.
  bool kd;
  float tau, alpha, beta;
  int divergence;
  const void* teacher;
  int64_t teacher_stride;
  int top_k;
  const void* indices;
  bool indices64;
  const float* logprobs;
  bool renormalize;
  // Policy.
  bool policy;
  PolicyArgs pg;  // device pointers
  PostTrainingCudaRow* out;
};

__device__ __forceinline__ int64_t LoadIndex(const void* p, bool is64,
                                             int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i]
              : static_cast<const int32_t*>(p)[i];
}

// Calls f(c, x[c], t[c]) for the thread's elements c = tid + i * kThreads of
// a row in increasing order (t[c] is 0 without a teacher), loading kUnroll of
// them before using any. Measured at 8192 x 128256 bf16 (H100): 1 gives dense
// KD 17.8 ms, 8 gives 33.8 ms (108 registers: one block an SM), so the row
// is not bound by loads in flight; bench/NOTES.md.
constexpr int kUnroll = 1;
template <typename T, typename TT, typename F>
__device__ __forceinline__ void ForRow(const T* x, const TT* t, int64_t V,
                                       int tid, F f) {
  for (int64_t base = tid; base < V; base += int64_t{kThreads} * kUnroll) {
    float xv[kUnroll], tv[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t c = base + int64_t{j} * kThreads;
      xv[j] = c < V ? LoadF(x, c) : 0.0f;
      tv[j] = t != nullptr && c < V ? LoadF(t, c) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int64_t c = base + int64_t{j} * kThreads;
      if (c < V) f(c, xv[j], tv[j]);
    }
  }
}

template <typename T, typename TT>
__global__ void __launch_bounds__(kThreads)
    PostTrainingRowKernel(const Params prm) {
  using StatsReduce = cub::BlockReduce<Stats, kThreads>;
  using ArgReduce = cub::BlockReduce<ArgMax, kThreads>;
  using SumReduce = cub::BlockReduce<Sum2, kThreads>;
  using MassReduce = cub::BlockReduce<double, kThreads>;
  using Sum3Reduce = cub::BlockReduce<Sum3, kThreads>;
  using WeightedReduce = cub::BlockReduce<WeightedStats, kThreads>;
  __shared__ union {
    typename StatsReduce::TempStorage stats;
    typename ArgReduce::TempStorage arg;
    typename SumReduce::TempStorage sum;
    typename MassReduce::TempStorage mass;
    typename Sum3Reduce::TempStorage sum3;
    typename WeightedReduce::TempStorage weighted;
  } temp;
  __shared__ Stats shared_stats[3];
  __shared__ ArgMax shared_arg;
  __shared__ Sum2 shared_sum[2];
  __shared__ Sum3 shared_sum3;
  __shared__ WeightedStats shared_weighted;
  __shared__ float shared_z_sum;
  __shared__ int top_index[kMaxTopK];
  __shared__ float top_log_p[kMaxTopK];
  __shared__ float top_h[kMaxTopK];
  extern __shared__ unsigned support[];  // V bits for a top-k teacher

  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const int64_t V = prm.vocab;
  const T* x = static_cast<const T*>(prm.logits) + row * prm.stride;
  T* g = prm.gradient == nullptr
             ? nullptr
             : static_cast<T*>(prm.gradient) + row * prm.stride;
  const TT* t = prm.teacher == nullptr ? nullptr
                                       : static_cast<const TT*>(prm.teacher) +
                                             row * prm.teacher_stride;
  const float cap = prm.softcap;
  auto z_of = [cap](float v) { return cap > 0.0f ? cap * tanhf(v / cap) : v; };
  const float inv_tau = prm.kd ? 1.0f / prm.tau : 1.0f;
  const bool sparse = prm.kd && prm.top_k > 0;
  const bool reverse_kl =
      prm.kd && prm.divergence == static_cast<int>(Divergence::kReverseKl);
  const int k = prm.top_k;
  // A dense teacher's forward or reverse KL: its sums in the statistics pass
  // (JSD's log M needs both lse first: a pass of its own).
  const bool forward_kl =
      prm.kd && prm.divergence == static_cast<int>(Divergence::kForwardKl);
  const bool one_pass = t != nullptr && (forward_kl || reverse_kl);
  // At temperature 1 the student's u statistics are z's.
  const bool u_is_z = inv_tau == 1.0f;

  // Pass 1: statistics.
  Stats z_stats = EmptyStats(), u_stats = EmptyStats(), t_stats = EmptyStats();
  WeightedStats weighted = {-INFINITY, 0.0, 0.0};
  ArgMax arg = {-INFINITY, 0};
  const bool kd = prm.kd;
  const float eps = prm.label_smoothing;
  float z_sum = 0.0f;  // for label smoothing's mean of z
  ForRow(x, t, V, tid, [&](int64_t c, float xc, float tc) {
    const float z = z_of(xc);
    Update(&z_stats, z);
    z_sum += z;
    if (z > arg.value) arg = {z, static_cast<int>(c)};
    if (kd) {
      const float u = z * inv_tau;
      if (!u_is_z) Update(&u_stats, u);
      if (t != nullptr) {
        const float v = tc * inv_tau;
        Update(&t_stats, v);
        if (one_pass) {
          Update(&weighted, forward_kl ? v : u, forward_kl ? u : v);
        }
      }
    }
  });
  if (sparse) {
    for (int64_t w = tid; w < (V + 31) / 32; w += kThreads) support[w] = 0u;
  }
  {
    Stats r = StatsReduce(temp.stats).Reduce(z_stats, MergeStats());
    if (tid == 0) shared_stats[0] = r;
    __syncthreads();
    if (u_is_z) {
      if (tid == 0) shared_stats[1] = shared_stats[0];
    } else {
      r = StatsReduce(temp.stats).Reduce(u_stats, MergeStats());
      if (tid == 0) shared_stats[1] = r;
      __syncthreads();
    }
    r = StatsReduce(temp.stats).Reduce(t_stats, MergeStats());
    if (tid == 0) shared_stats[2] = r;
    __syncthreads();
    if (one_pass) {
      const WeightedStats w =
          WeightedReduce(temp.weighted).Reduce(weighted, MergeWeightedStats());
      if (tid == 0) shared_weighted = w;
      __syncthreads();
    }
    const ArgMax a = ArgReduce(temp.arg).Reduce(arg, MergeArgMax());
    if (tid == 0) shared_arg = a;
    __syncthreads();
    if (eps > 0.0f) {
      const Sum2 zs =
          SumReduce(temp.sum).Reduce(Sum2{z_sum, 0.0f}, MergeSum2());
      if (tid == 0) shared_z_sum = zs.a;
      __syncthreads();
    }
  }
  const Stats zs = shared_stats[0];
  const float lse = Lse(zs);
  const float entropy = lse - zs.w / zs.s;
  const int argmax = shared_arg.index;

  const bool has_target = prm.targets != nullptr;
  const int64_t y =
      has_target ? LoadIndex(prm.targets, prm.targets64, row) : -1;
  const bool valid = !has_target || y != prm.ignore_index;
  if (!valid) {
    if (g != nullptr) {
      for (int64_t c = tid; c < V; c += kThreads) StoreF(g, c, 0.0f);
    }
    if (tid == 0) {
      prm.out[row] = {0.0, 0.0,  0.0,    0.0, 0.0, entropy,
                      lse, 0.0f, argmax, 0,   0.0};
    }
    return;
  }
  const float logp = has_target ? z_of(LoadF(x, y)) - lse : 0.0f;
  // The (label-smoothed) cross entropy against the target.
  const double ce = eps > 0.0f
                        ? (1.0 - eps) * static_cast<double>(-logp) +
                              eps * static_cast<double>(lse - shared_z_sum / V)
                        : static_cast<double>(-logp);
  double loss = 0.0, distill = 0.0, ratio_out = 0.0, approx_kl = 0.0,
         kl_out = 0.0;
  bool clipped = false;
  float dlogp = 0.0f;  // policy: dl/dlogp
  float gbar = 0.0f;   // distillation: sum_b h_b / sum_b P_b
  // Reverse KL: log P_c - log Q_c - gbar = LogRatio(u_c, log q_c, k_ratio).
  double k_ratio = 0.0;
  float tail_g = 0.0f;  // top-k bucket: h_tail / P_tail
  float lse_u = 0.0f, lse_t = 0.0f, lse_s = 0.0f;

  if (prm.policy) {
    const cuda_pt::PolicyInputs inputs = cuda_pt::PolicyInputsOf(prm.pg);
    const cuda_pt::PolicyRow pr = cuda_pt::MakePolicyRow(
        inputs, prm.pg.advantages[row], prm.pg.sampling_logprobs[row],
        inputs.has_reference ? prm.pg.reference_logprobs[row] : 0.0f, logp);
    loss = pr.loss;
    dlogp = pr.dlogp;
    clipped = pr.clipped;
    kl_out = pr.kl;
    ratio_out = pr.ratio;
    approx_kl = prm.pg.sampling_logprobs[row] - logp;
  } else if (prm.kd) {
    lse_u = Lse(shared_stats[1]);
    double d_sum = 0.0, h_sum = 0.0, p_sum = 0.0;
    if (one_pass) {
      lse_t = Lse(shared_stats[2]);
      const double lse_gap = static_cast<double>(lse_u) - lse_t;
      const WeightedStats w = shared_weighted;
      const double mean = w.s > 0.0 ? w.w / w.s : 0.0;
      if (reverse_kl) {
        // mean = sum_c p_c (u_c - v_c) = k_ratio; D its part past the gap.
        distill = mean - lse_gap;
        k_ratio = mean;
      } else {
        // mean = sum_c q_c (v_c - u_c); gbar = -sum q / sum p over the p and
        // q as the gradient computes them (the statistics' sums over exp(lse
        // - m)).
        distill = mean + lse_gap;
        const Stats su = shared_stats[1], st = shared_stats[2];
        const double sum_p = su.s * exp(static_cast<double>(su.m) - lse_u);
        const double sum_q = st.s * exp(static_cast<double>(st.m) - lse_t);
        gbar = static_cast<float>(sum_p > 0.0 ? -sum_q / sum_p : 0.0);
      }
    } else if (!sparse) {
      lse_t = Lse(shared_stats[2]);
      const double lse_gap = static_cast<double>(lse_u) - lse_t;
      ForRow(x, t, V, tid, [&](int64_t, float xc, float tc) {
        const float u = z_of(xc) * inv_tau;
        const float log_p = u - lse_u;
        const float p = expf(log_p);
        if (reverse_kl) {
          const double h =
              p > 0.0f ? p * LogRatio(u, tc * inv_tau, lse_gap) : 0.0;
          d_sum += h;
          h_sum += h;
        } else {
          float d, h;
          cuda_pt::DivergenceTerm(prm.divergence, prm.beta, log_p,
                                  tc * inv_tau - lse_t, &d, &h);
          d_sum += d;
          h_sum += h;
        }
        p_sum += p;
      });
      k_ratio = lse_gap;
    } else {
      // The support: its student values, marked in the bitmap.
      float zu = -INFINITY, lq = -INFINITY;
      if (tid < k) {
        const int64_t c = LoadIndex(prm.indices, prm.indices64, row * k + tid);
        top_index[tid] = static_cast<int>(c);
        zu = z_of(LoadF(x, c)) * inv_tau;
        lq = prm.logprobs[row * k + tid];
        atomicOr(&support[c / 32], 1u << (c % 32));
      }
      __syncthreads();
      float log_p = 0.0f, log_q = lq;
      double lse_gap = lse_u;  // log P_j - log Q_j = zu - lq - lse_gap
      if (prm.renormalize) {
        Stats s1 = EmptyStats(), s2 = EmptyStats();
        if (tid < k) {
          Update(&s1, zu);
          Update(&s2, lq);
        }
        Stats r = StatsReduce(temp.stats).Reduce(s1, MergeStats());
        if (tid == 0) shared_stats[1] = r;
        __syncthreads();
        r = StatsReduce(temp.stats).Reduce(s2, MergeStats());
        if (tid == 0) shared_stats[2] = r;
        __syncthreads();
        lse_s = Lse(shared_stats[1]);
        const float lse_q = Lse(shared_stats[2]);
        log_p = zu - lse_s;
        log_q = lq - lse_q;
        lse_gap = static_cast<double>(lse_s) - lse_q;
      } else {
        log_p = zu - lse_u;
      }
      if (tid < k) {
        float d, h;
        cuda_pt::DivergenceTerm(prm.divergence, prm.beta, log_p, log_q, &d, &h);
        const float p = expf(log_p);
        d_sum = d;
        h_sum = h;
        if (reverse_kl) {
          h_sum = p > 0.0f ? p * LogRatio(zu, lq, lse_gap) : 0.0;
          d_sum = h_sum;
        }
        p_sum = p;
        top_log_p[tid] = log_p;
        top_h[tid] = h;
      }
      k_ratio = lse_gap;
      if (!prm.renormalize && k < V) {
        // The tail bucket: the student's mass outside the support, and the
        // teacher's 1 - sum exp(logprobs), summed in fp64 (in fp32 the
        // difference keeps ~1e-7 absolute: 1e-4 relative in a tail of 1e-3).
        float tail_p = 0.0f;
        ForRow(x, static_cast<const TT*>(nullptr), V, tid,
               [&](int64_t c, float xc, float) {
                 if ((support[c / 32] >> (c % 32)) & 1u) return;
                 tail_p += expf(z_of(xc) * inv_tau - lse_u);
               });
        const double teacher_mass = MassReduce(temp.mass).Sum(
            tid < k ? exp(static_cast<double>(lq)) : 0.0);
        __syncthreads();  // temp is reused
        const Sum2 r =
            SumReduce(temp.sum).Reduce(Sum2{tail_p, 0.0f}, MergeSum2());
        if (tid == 0) {
          const float p_tail = r.a;
          const double q_tail = fmax(0.0, 1.0 - teacher_mass);
          float d, h;
          cuda_pt::DivergenceTerm(prm.divergence, prm.beta, logf(p_tail),
                                  static_cast<float>(log(q_tail)), &d, &h);
          d_sum += d;
          h_sum += h;
          p_sum += p_tail;
          shared_sum[1] = Sum2{h, p_tail};
        }
        __syncthreads();
        tail_g =
            shared_sum[1].b > 0.0f ? shared_sum[1].a / shared_sum[1].b : 0.0f;
      }
    }
    if (!one_pass) {
      const Sum3 r =
          Sum3Reduce(temp.sum3).Reduce(Sum3{d_sum, h_sum, p_sum}, MergeSum3());
      if (tid == 0) shared_sum3 = r;
      __syncthreads();
      distill = shared_sum3.d;
      const double gbar64 =
          shared_sum3.p > 0.0 ? shared_sum3.h / shared_sum3.p : 0.0;
      gbar = static_cast<float>(gbar64);
      k_ratio += gbar64;
    }
    // A side of no mass (lse -inf: the student's row or renormalised
    // support, a dense teacher's row) has no distribution.
    if (lse_u == -INFINITY || lse_t == -INFINITY || lse_s == -INFINITY) {
      distill = NAN;
    }
    loss += (1.0 - prm.alpha) * distill;
  } else {
    loss = ce;
  }
  if (prm.kd && prm.alpha > 0.0f) {
    // The cross-entropy part, written plainly.
    loss = prm.alpha * ce + (1.0 - prm.alpha) * distill;
  }
  const float zls = prm.z_loss_scale;
  const double z_loss = static_cast<double>(zls) * lse * lse;
  loss += z_loss;

  if (g != nullptr) {
    // Every thread has read what it needs of the row (the target's logit
    // included) before any element is overwritten.
    __syncthreads();
    // (a NaN factor: every element of the row NaN)
    const float s = prm.kd && DistillationGradientIsNan(reverse_kl, distill)
                        ? NAN
                        : prm.row_scale[row];
    const float kd_scale = (1.0f - prm.alpha) * inv_tau;
    auto gradient_of = [&](int64_t c, float xc, float extra) {
      const float z = z_of(xc);
      // p_c - [c == y]; at the target as expm1, which keeps the digits of
      // 1 - p_y when p_y is close to 1.
      const float p = expf(z - lse);
      const float residual = c == y ? expm1f(z - lse) : p;
      // The smoothed cross entropy's p_c - (1 - eps)[c == y] - eps / V.
      const float ce_grad =
          eps > 0.0f ? p - (c == y ? 1.0f - eps : 0.0f) - eps / V : residual;
      float grad = 0.0f;
      if (prm.policy) {
        grad = -dlogp * residual;
      } else if (prm.kd) {
        if (prm.alpha > 0.0f) grad = prm.alpha * ce_grad;
        grad += extra;
      } else {
        grad = ce_grad;
      }
      if (zls > 0.0f) grad += 2.0f * zls * lse * p;
      grad *= s;
      if (cap > 0.0f) {
        const float th = z / cap;
        grad *= 1.0f - th * th;
      }
      return grad;
    };
    ForRow(x, t, V, tid, [&](int64_t c, float xc, float tc) {
      if (sparse && ((support[c / 32] >> (c % 32)) & 1u)) return;
      float extra = 0.0f;
      if (prm.kd && !sparse) {
        const float u = z_of(xc) * inv_tau;
        const float log_p = u - lse_u;
        const float p = expf(log_p);
        if (reverse_kl) {
          // P_c (log P_c - log Q_c - gbar), its cancellation in fp64.
          extra =
              p > 0.0f
                  ? kd_scale * p *
                        static_cast<float>(LogRatio(u, tc * inv_tau, k_ratio))
                  : 0.0f;
        } else {
          float d, h;
          cuda_pt::DivergenceTerm(prm.divergence, prm.beta, log_p,
                                  tc * inv_tau - lse_t, &d, &h);
          extra = kd_scale * (h - p * gbar);
        }
      } else if (sparse && !prm.renormalize) {
        extra = kd_scale * expf(z_of(xc) * inv_tau - lse_u) * (tail_g - gbar);
      }
      StoreF(g, c, gradient_of(c, xc, extra));
    });
    if (sparse && tid < k) {
      // The support's own elements, skipped above (so still logits here).
      const int64_t c = top_index[tid];
      const float xc = LoadF(x, c);
      const float p = expf(top_log_p[tid]);
      float extra = kd_scale * (top_h[tid] - p * gbar);
      if (reverse_kl) {
        const float lq = prm.logprobs[row * k + tid];
        extra = p > 0.0f ? kd_scale * p *
                               static_cast<float>(
                                   LogRatio(z_of(xc) * inv_tau, lq, k_ratio))
                         : 0.0f;
      }
      StoreF(g, c, gradient_of(c, xc, extra));
    }
  }
  if (tid == 0) {
    int flags = kPostTrainingRowValid;
    if (has_target && argmax == y) flags |= kPostTrainingRowCorrect;
    if (clipped) flags |= kPostTrainingRowClipped;
    prm.out[row] = {loss,      distill, ratio_out,
                    approx_kl, kl_out,  static_cast<double>(entropy),
                    lse,       logp,    argmax,
                    flags,     z_loss};
  }
}

// The dynamic shared memory a launch takes without opting in (48 KiB less
// the static shared memory, ~7 KiB).
constexpr size_t kDefaultDynamicSmem = 48 * 1024 - 8 * 1024;

template <typename T, typename TT>
cudaError_t Launch(const Params& params, size_t smem, cudaStream_t stream) {
  if (smem > kDefaultDynamicSmem) {
    // A top-k teacher's support bitmap over a large vocabulary.
    const cudaError_t e = cudaFuncSetAttribute(
        PostTrainingRowKernel<T, TT>,
        cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  PostTrainingRowKernel<T, TT>
      <<<static_cast<unsigned>(params.rows), kThreads, smem, stream>>>(params);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchTeacher(const Params& params, DType teacher, size_t smem,
                          cudaStream_t stream) {
  switch (teacher) {
    case DType::kBFloat16:
      return Launch<T, __nv_bfloat16>(params, smem, stream);
    case DType::kFloat16:
      return Launch<T, __half>(params, smem, stream);
    default:
      return Launch<T, float>(params, smem, stream);
  }
}

}  // namespace

cudaError_t PostTrainingCudaLaunch(const PostTrainingArgs& args,
                                   const float* row_scale,
                                   PostTrainingCudaRow* rows_out,
                                   cudaStream_t stream) {
  const CrossEntropyArgs& base = args.base;
  if (base.rows <= 0) return cudaSuccess;
  if (base.rows > INT32_MAX || base.vocab > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  Params p = {};
  p.rows = base.rows;
  p.vocab = base.vocab;
  p.stride = base.row_stride;
  p.logits = base.logits;
  p.gradient = base.mode == GradientMode::kNone ? nullptr : base.gradient;
  p.targets = base.targets;
  p.targets64 = base.targets_dtype == DType::kInt64;
  p.ignore_index = base.options.ignore_index;
  p.softcap = base.options.softcap;
  p.label_smoothing = base.options.label_smoothing;
  p.z_loss_scale = base.options.z_loss_scale;
  p.row_scale = row_scale;
  p.out = rows_out;
  size_t smem = 0;
  DType teacher_dtype = DType::kFloat32;
  if (args.distillation != nullptr) {
    const DistillationArgs& kd = *args.distillation;
    p.kd = true;
    p.tau = kd.temperature;
    p.alpha = kd.alpha;
    p.divergence = KernelDivergence(kd);
    p.beta = kd.beta;
    p.teacher = kd.teacher_logits;
    p.teacher_stride = kd.teacher_row_stride;
    teacher_dtype = kd.teacher_dtype;
    if (kd.teacher_logits == nullptr) {
      if (base.vocab > kPostTrainingCudaMaxTopKVocab || kd.top_k > kMaxTopK) {
        return cudaErrorInvalidValue;
      }
      p.top_k = static_cast<int>(kd.top_k);
      p.indices = kd.top_k_indices;
      p.indices64 = kd.top_k_indices_dtype == DType::kInt64;
      p.logprobs = kd.top_k_logprobs;
      p.renormalize = kd.tail == TopKTail::kRenormalize;
      smem = static_cast<size_t>((base.vocab + 31) / 32) * sizeof(unsigned);
    }
  }
  if (args.policy != nullptr) {
    p.policy = true;
    p.pg = *args.policy;
  }
  switch (base.logits_dtype) {
    case DType::kBFloat16:
      return LaunchTeacher<__nv_bfloat16>(p, teacher_dtype, smem, stream);
    case DType::kFloat16:
      return LaunchTeacher<__half>(p, teacher_dtype, smem, stream);
    default:
      return LaunchTeacher<float>(p, teacher_dtype, smem, stream);
  }
}

}  // namespace lossd
