// The linear cross-entropy contract: hidden states X [N, H] times a
// resident LM head W [V, H] (+ bias [V]) into the cross-entropy of
// kernels/cross_entropy.h, with dX, dW and dbias formed in one call. Plain C++.
#ifndef LOSSD_KERNELS_LINEAR_CROSS_ENTROPY_H_
#define LOSSD_KERNELS_LINEAR_CROSS_ENTROPY_H_

#include <cstdint>
#include <functional>

#include "kernels/cross_entropy.h"

namespace lossd {

// How the weight gradient (and the bias gradient) meets its accumulator.
enum class AccumulateMode : int {
  kNone = 0,       // no weight gradient is formed (dW and dbias must be null)
  kAdd = 1,        // dW += this call's gradient (micro-batches)
  kOverwrite = 2,  // dW = this call's gradient
};

// One problem. Logically, for every row n (valid or not):
//   z_n = W x_n + b                           (logits of row n, [V])
// then the cross-entropy of kernels/cross_entropy.h on z with `options`,
// `class_weights` and `targets`, and, as its gradient G = dL/dz [N, V] (which
// already carries grad_scale and, for kMean, 1/D):
//   dX = G W          [N, H]   (written as `dx_mode` says)
//   dW (+)= G^T X     [V, H]   fp32
//   dbias (+)= sum_n G[n, :]   [V]  fp32
//
// The gradient is produced here, in the "Forward", so that a later Backward
// recomputes nothing: grad_scale folds a known scalar grad_output (e.g.
// 1/micro-batches) into it, and a Backward on dX may still scale dX lazily as
// the service does for logits. dW cannot be scaled lazily per call once
// accumulated, hence:
//
// Reduction kNone: the gradient of sum_n g_n * loss_n needs the per-row g
// before dW is formed, so a gradient (dx_mode != kNone or accumulate !=
// kNone) with kNone REQUIRES `token_grad_output` [N] (fp32, g_n; grad_scale
// multiplies it too). Without a gradient, kNone is loss-only and
// token_grad_output must be null. With kMean/kSum token_grad_output must be
// null.
//
// Mean over chunks: backends compute the logits in chunks of rows, but D (the
// kMean denominator) is the whole call's: `options.normalizer` when > 0, else
// sum of w_{y_n} over the call's valid rows. A caller that splits one batch
// into micro-batches passes the batch's normalizer explicitly.
//
// Pointers are host pointers for the CPU backend and device pointers for the
// CUDA backend; every one is borrowed for the call.
struct LinearCrossEntropyArgs {
  int64_t rows = 0;    // N >= 0
  int64_t hidden = 0;  // H >= 1
  int64_t vocab = 0;   // V >= 1, < 2^31

  DType dtype = DType::kBFloat16;  // of X, W, bias and an out-of-place dX
  const void* x = nullptr;         // [rows, hidden], rows contiguous
  const void* weight = nullptr;    // [vocab, hidden], rows contiguous
  const void* bias = nullptr;      // [vocab] or nullptr for none

  DType targets_dtype = DType::kInt64;
  const void* targets = nullptr;  // [rows]

  const float* class_weights = nullptr;  // [vocab] fp32, or nullptr for none
  CrossEntropyOptions options;

  // kNone with a gradient only: [rows] fp32 per-row grad_output.
  const float* token_grad_output = nullptr;

  // kInPlace: dx == x (X is overwritten by dX). kOutOfPlace: a separate
  // [rows, hidden] buffer of `dtype` not overlapping x. kNone: dx == nullptr.
  GradientMode dx_mode = GradientMode::kInPlace;
  void* dx = nullptr;

  AccumulateMode accumulate = AccumulateMode::kAdd;
  float* grad_weight = nullptr;  // [vocab, hidden] fp32; null iff accumulate
                                 // is kNone
  float* grad_bias = nullptr;    // [vocab] fp32, or nullptr for none; needs
                                 // accumulate != kNone (null allowed with a
                                 // bias: its gradient is then not formed)

  // What the caller's tensors are, when it knows more than the fields above
  // (the service fills these from its records): validation rejects any that
  // disagrees with the problem. 0 / kInvalid = not given.
  int64_t weight_hidden = 0;  // W's second dimension (must be hidden)
  DType weight_dtype = DType::kInvalid;  // must be dtype
  DType bias_dtype = DType::kInvalid;    // must be dtype
  int64_t grad_weight_rows = 0;          // must be vocab
  int64_t grad_weight_cols = 0;          // must be hidden
  int64_t grad_bias_size = 0;            // must be vocab

  // Speed over dW's precision for 16-bit inputs: the three products in the
  // input dtype as the peers compute them. A hint a backend may ignore (the
  // CPU computes in fp32 either way); CUDA takes it as LinearPrecision::kFast.
  bool fast_products = false;

  // Optional per-row outputs, as in CrossEntropyArgs.
  float* token_loss = nullptr;      // [rows]
  float* token_lse = nullptr;       // [rows]
  int32_t* token_argmax = nullptr;  // [rows]

  // Asked before each chunk of rows (never inside one), from the calling
  // thread; once it returns true the call stops and returns CANCELLED. The
  // outputs are then partly written (dX of the chunks done, dW and dbias
  // holding those chunks' sum, per-row outputs): a caller that may stop a
  // call lets it write only into buffers it can discard. Empty: never asked.
  std::function<bool()> cancelled;
};

}  // namespace lossd

#endif  // LOSSD_KERNELS_LINEAR_CROSS_ENTROPY_H_
