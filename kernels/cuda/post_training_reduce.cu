// The post-training records summed on the device in a fixed order (the CPU
// twin: ReducePostTrainingRows, which sums in row order), and the per-token
// outputs gathered from them, so that a call copies back only those.
#include <cuda_runtime.h>

#include <cmath>
#include <cub/block/block_reduce.cuh>

#include "kernels/cuda/post_training_reduce.h"

namespace lossd {
namespace {

constexpr int kThreads = 512;
// Records a thread loads before it adds them (their loads in flight
// together, not one DRAM round trip a record).
constexpr int kBatch = 4;

struct Sums {
  double loss, distillation, ratio, approx_kl, kl, entropy, z_loss;
  long long valid, nonfinite, correct, clipped;
};

struct AddSums {
  __device__ Sums operator()(const Sums& a, const Sums& b) const {
    return {a.loss + b.loss,
            a.distillation + b.distillation,
            a.ratio + b.ratio,
            a.approx_kl + b.approx_kl,
            a.kl + b.kl,
            a.entropy + b.entropy,
            a.z_loss + b.z_loss,
            a.valid + b.valid,
            a.nonfinite + b.nonfinite,
            a.correct + b.correct,
            a.clipped + b.clipped};
  }
};

__device__ __forceinline__ void Add(const PostTrainingCudaRow& r, bool policy,
                                    bool z_loss, Sums* s) {
  if ((r.flags & kPostTrainingRowValid) == 0) return;
  s->loss += r.loss;
  s->distillation += r.distillation;
  s->ratio += r.ratio;
  s->approx_kl += r.approx_kl;
  s->kl += r.kl;
  if (policy) s->entropy += r.entropy;
  if (z_loss) s->z_loss += r.z_loss;
  s->valid += 1;
  s->nonfinite += !isfinite(r.loss);
  s->correct += (r.flags & kPostTrainingRowCorrect) != 0;
  s->clipped += (r.flags & kPostTrainingRowClipped) != 0;
}

// Shapes: rows [N]; one block. Thread t sums rows t, t + T, ... in order,
// then cub's block reduction (a fixed tree for a fixed block size) sums the
// threads: the order depends on N alone.
__global__ void __launch_bounds__(kThreads)
    ReduceKernel(const PostTrainingCudaRow* rows, long long N, bool policy,
                 bool z_loss, PostTrainingSums* out) {
  using Reduce = cub::BlockReduce<Sums, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  Sums s = {};
  for (long long base = threadIdx.x; base < N; base += kBatch * kThreads) {
    PostTrainingCudaRow batch[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const long long row = base + static_cast<long long>(i) * kThreads;
      if (row < N) batch[i] = rows[row];
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (base + static_cast<long long>(i) * kThreads < N) {
        Add(batch[i], policy, z_loss, &s);
      }
    }
  }
  const Sums total = Reduce(storage).Reduce(s, AddSums());
  if (threadIdx.x == 0) {
    out->valid_tokens = total.valid;
    out->nonfinite_rows = total.nonfinite;
    out->correct_tokens = total.correct;
    out->clipped_tokens = total.clipped;
    out->loss = total.loss;
    out->distillation = total.distillation;
    out->ratio = total.ratio;
    out->approx_kl = total.approx_kl;
    out->kl = total.kl;
    out->entropy = total.entropy;
    out->z_loss = total.z_loss;
  }
}

// Shapes: rows [N]; each asked output [N].
__global__ void TokensKernel(const PostTrainingCudaRow* rows, long long N,
                             bool policy, PostTrainingCudaTokens t) {
  const long long row =
      blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x;
  if (row >= N) return;
  const PostTrainingCudaRow& r = rows[row];
  const bool policy_row = policy && (r.flags & kPostTrainingRowValid) != 0;
  if (t.loss != nullptr) t.loss[row] = static_cast<float>(r.loss);
  if (t.lse != nullptr) t.lse[row] = r.lse;
  if (t.argmax != nullptr) t.argmax[row] = r.argmax;
  if (t.logprob != nullptr) t.logprob[row] = r.logprob;
  if (t.entropy != nullptr) t.entropy[row] = static_cast<float>(r.entropy);
  if (t.ratio != nullptr) {
    t.ratio[row] = policy_row ? static_cast<float>(r.ratio) : 0.0f;
  }
  if (t.clipped != nullptr) {
    t.clipped[row] =
        policy_row && (r.flags & kPostTrainingRowClipped) != 0 ? 1 : 0;
  }
}

}  // namespace

cudaError_t LaunchPostTrainingReduce(const PostTrainingCudaRow* rows,
                                     long long count, bool policy, bool z_loss,
                                     PostTrainingSums* out,
                                     cudaStream_t stream) {
  if (count < 1) return cudaErrorInvalidValue;
  ReduceKernel<<<1, kThreads, 0, stream>>>(rows, count, policy, z_loss, out);
  return cudaGetLastError();
}

cudaError_t LaunchPostTrainingTokens(const PostTrainingCudaRow* rows,
                                     long long count, bool policy,
                                     const PostTrainingCudaTokens& tokens,
                                     cudaStream_t stream) {
  const bool asked = tokens.loss != nullptr || tokens.lse != nullptr ||
                     tokens.argmax != nullptr || tokens.logprob != nullptr ||
                     tokens.entropy != nullptr || tokens.ratio != nullptr ||
                     tokens.clipped != nullptr;
  if (!asked || count < 1) return cudaSuccess;
  constexpr int kBlock = 256;
  const long long blocks = (count + kBlock - 1) / kBlock;
  TokensKernel<<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(
      rows, count, policy, tokens);
  return cudaGetLastError();
}

}  // namespace lossd
