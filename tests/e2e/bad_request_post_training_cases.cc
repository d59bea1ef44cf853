// The bad-request table's rows for distillation, policy losses and segments:
// each gets INVALID_ARGUMENT (or its lookup's code) and changes nothing.
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "tests/e2e/bad_requests.h"

namespace lossd {
namespace bad_requests {
namespace {

pb::InlineTensor Inline(pb::DType dtype, std::string data) {
  pb::InlineTensor tensor;
  tensor.set_dtype(dtype);
  tensor.set_data(std::move(data));
  return tensor;
}

// A top-k teacher of k = 2 over the fixture's kRows x kVocab logits (of a
// ForwardRequest or a LinearForwardRequest).
template <typename Request>
void TopK(Request* request, std::vector<int32_t> indices,
          std::vector<float> logprobs, int32_t k = 2) {
  pb::TopKTeacher* top_k =
      request->mutable_distillation()->mutable_teacher_top_k();
  top_k->set_k(k);
  *top_k->mutable_indices_inline() = Inline(pb::DTYPE_INT32, Bytes(indices));
  *top_k->mutable_logprobs_inline() =
      Inline(pb::DTYPE_FLOAT32, Bytes(logprobs));
}

std::vector<int32_t> GoodIndices() { return {0, 1, 2, 3, 4, 0, 1, 2}; }
std::vector<float> GoodLogprobs() {
  return std::vector<float>(kRows * 2, -1.0f);
}

// A PPO policy over the fixture's rows with `advantages`.
template <typename Request>
void Policy(Request* request, std::vector<float> advantages,
            std::vector<float> sampling = std::vector<float>(kRows, -1.0f)) {
  pb::PolicyGradient* policy = request->mutable_policy();
  policy->set_loss(pb::POLICY_LOSS_PPO_CLIP);
  *policy->mutable_advantages_inline() =
      Inline(pb::DTYPE_FLOAT32, Bytes(advantages));
  *policy->mutable_sampling_logprobs_inline() =
      Inline(pb::DTYPE_FLOAT32, Bytes(sampling));
}

template <typename Request>
void Segments(Request* request, std::vector<int32_t> ids, int32_t count) {
  request->mutable_segments()->set_count(count);
  *request->mutable_segments()->mutable_ids_inline() =
      Inline(pb::DTYPE_INT32, Bytes(ids));
}

}  // namespace

void BadRequestsTest::AddPostTrainingCases(std::vector<Case>* cases) {
  auto add = [cases](std::string name, Code code, std::string message,
                     std::function<grpc::Status()> run) {
    cases->push_back(
        {std::move(name), code, std::move(message), std::move(run)});
  };
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> good_advantages(kRows, 1.0f);

  // ------------------------------------------------------- Distillation
  add("distillation: no teacher", Code::INVALID_ARGUMENT, "needs a teacher",
      ForwardWith([](auto* r) { r->mutable_distillation()->set_alpha(0.5f); }));
  add("distillation: dense teacher of another shape", Code::INVALID_ARGUMENT,
      "must be a float tensor of the logits' shape [4, 5], got float32 [256, "
      "640]",
      ForwardWith([this](auto* r) {
        r->mutable_distillation()->set_teacher_logits(big_);
      }));
  add("distillation: the teacher is the logits", Code::INVALID_ARGUMENT,
      "names the student's logits", ForwardWith([this](auto* r) {
        r->mutable_distillation()->set_teacher_logits(logits_);
      }));
  add("distillation: unknown teacher", Code::NOT_FOUND, "unknown handle",
      ForwardWith([this](auto* r) {
        r->mutable_distillation()->set_teacher_logits(unknown_);
      }));
  add("distillation: malformed teacher", Code::INVALID_ARGUMENT,
      "distillation.teacher_logits: malformed handle",
      ForwardWith([this](auto* r) {
        r->mutable_distillation()->set_teacher_logits(malformed_);
      }));
  add("distillation: teacher holds a gradient", Code::FAILED_PRECONDITION,
      "holds a gradient", ForwardWith([this](auto* r) {
        r->mutable_distillation()->set_teacher_logits(gradient_mean_);
      }));
  add("distillation: k > V", Code::INVALID_ARGUMENT,
      "k = 6 must be in [1, min(V, 512)] = [1, 5]", ForwardWith([](auto* r) {
        TopK(r, std::vector<int32_t>(kRows * 6, 0),
             std::vector<float>(kRows * 6, -1.0f), 6);
      }));
  add("distillation: k = 0 with inline tensors", Code::INVALID_ARGUMENT,
      "k is required with inline tensors",
      ForwardWith([](auto* r) { TopK(r, GoodIndices(), GoodLogprobs(), 0); }));
  add("distillation: top-k index out of range", Code::INVALID_ARGUMENT,
      "top-k index [1, 1] = 5 is outside [0, 5)", ForwardWith([](auto* r) {
        std::vector<int32_t> indices = GoodIndices();
        indices[3] = kVocab;
        TopK(r, indices, GoodLogprobs());
      }));
  add("distillation: negative top-k index", Code::INVALID_ARGUMENT,
      "top-k index [0, 0] = -1", ForwardWith([](auto* r) {
        std::vector<int32_t> indices = GoodIndices();
        indices[0] = -1;
        TopK(r, indices, GoodLogprobs());
      }));
  add("distillation: top-k index twice in a row", Code::INVALID_ARGUMENT,
      "top-k index 2 appears twice in row 1", ForwardWith([](auto* r) {
        std::vector<int32_t> indices = GoodIndices();
        indices[3] = 2;
        TopK(r, indices, GoodLogprobs());
      }));
  add("distillation: positive logprob", Code::INVALID_ARGUMENT,
      "top-k logprob [2, 1] = 0.5 must be <= 0", ForwardWith([](auto* r) {
        std::vector<float> logprobs = GoodLogprobs();
        logprobs[5] = 0.5f;
        TopK(r, GoodIndices(), logprobs);
      }));
  add("distillation: a renormalised support of no mass", Code::INVALID_ARGUMENT,
      "top-k logprobs of row 1 are all -inf: the renormalised support has no "
      "mass",
      ForwardWith([](auto* r) {
        std::vector<float> logprobs = GoodLogprobs();
        logprobs[2] = logprobs[3] = -std::numeric_limits<float>::infinity();
        TopK(r, GoodIndices(), logprobs);
      }));
  add("distillation: NaN logprob", Code::INVALID_ARGUMENT, "must be <= 0",
      ForwardWith([kNaN](auto* r) {
        std::vector<float> logprobs = GoodLogprobs();
        logprobs[0] = kNaN;
        TopK(r, GoodIndices(), logprobs);
      }));
  add("distillation: top-k logprobs of the wrong size", Code::INVALID_ARGUMENT,
      "distillation.teacher_top_k.logprobs_inline has 28 bytes; [4, 2] of "
      "float32 needs 32",
      ForwardWith([](auto* r) {
        std::vector<float> logprobs = GoodLogprobs();
        logprobs.pop_back();
        TopK(r, GoodIndices(), logprobs);
      }));
  add("distillation: top-k indices of float32", Code::INVALID_ARGUMENT,
      "indices_inline.dtype", ForwardWith([](auto* r) {
        TopK(r, GoodIndices(), GoodLogprobs());
        r->mutable_distillation()
            ->mutable_teacher_top_k()
            ->mutable_indices_inline()
            ->set_dtype(pb::DTYPE_FLOAT32);
      }));
  add("distillation: temperature 0", Code::INVALID_ARGUMENT,
      "temperature must be > 0", ForwardWith([](auto* r) {
        TopK(r, GoodIndices(), GoodLogprobs());
        r->mutable_distillation()->set_temperature(0.0f);
      }));
  add("distillation: alpha 1.5", Code::INVALID_ARGUMENT,
      "alpha must be in [0, 1]", ForwardWith([](auto* r) {
        TopK(r, GoodIndices(), GoodLogprobs());
        r->mutable_distillation()->set_alpha(1.5f);
      }));
  add("distillation: JSD beta -0.5", Code::INVALID_ARGUMENT,
      "beta must be in [0, 1]", ForwardWith([](auto* r) {
        TopK(r, GoodIndices(), GoodLogprobs());
        r->mutable_distillation()->set_divergence(pb::DIVERGENCE_JSD);
        r->mutable_distillation()->set_beta(-0.5f);
      }));
  add("distillation: unknown divergence", Code::INVALID_ARGUMENT,
      "unknown distillation.divergence 9", ForwardWith([](auto* r) {
        TopK(r, GoodIndices(), GoodLogprobs());
        r->mutable_distillation()->set_divergence(
            static_cast<pb::Divergence>(9));
      }));
  add("distillation: alpha > 0 without targets", Code::INVALID_ARGUMENT,
      "targets are required", ForwardWith([](auto* r) {
        r->clear_targets_handle();
        TopK(r, GoodIndices(), GoodLogprobs());
        r->mutable_distillation()->set_alpha(0.5f);
      }));
  add("distillation: label smoothing out of range", Code::INVALID_ARGUMENT,
      "label_smoothing", ForwardWith([](auto* r) {
        TopK(r, GoodIndices(), GoodLogprobs());
        r->mutable_options()->set_label_smoothing(1.5f);
      }));
  add("distillation: with class weights", Code::INVALID_ARGUMENT,
      "does not compose", ForwardWith([this](auto* r) {
        TopK(r, GoodIndices(), GoodLogprobs());
        r->mutable_options()->set_class_weights(weights_);
      }));
  add("distillation and policy together", Code::INVALID_ARGUMENT,
      "cannot be combined", ForwardWith([good_advantages](auto* r) {
        TopK(r, GoodIndices(), GoodLogprobs());
        Policy(r, good_advantages);
      }));

  // ------------------------------------------------------------- Policy
  add("policy: NaN advantage", Code::INVALID_ARGUMENT,
      "policy advantages[2] = nan is not finite", ForwardWith([kNaN](auto* r) {
        Policy(r, {1.0f, 1.0f, kNaN, 1.0f});
      }));
  add("policy: infinite sampling logprob", Code::INVALID_ARGUMENT,
      "sampling_logprobs[0] = -inf is not finite",
      ForwardWith([good_advantages](auto* r) {
        Policy(r, good_advantages,
               {-std::numeric_limits<float>::infinity(), -1.0f, -1.0f, -1.0f});
      }));
  add("policy: advantages of the wrong length", Code::INVALID_ARGUMENT,
      "policy.advantages_inline has 12 bytes; [4] of float32 needs 16",
      ForwardWith([](auto* r) {
        Policy(r, {1.0f, 1.0f, 1.0f});
      }));
  add("policy: advantages handle of another shape", Code::INVALID_ARGUMENT,
      "policy.advantages_handle must be float32 [4], got float32 [5]",
      ForwardWith([this, good_advantages](auto* r) {
        Policy(r, good_advantages);
        r->mutable_policy()->set_advantages_handle(weights_);
      }));
  add("policy: no loss kind", Code::INVALID_ARGUMENT,
      "policy.loss must be IMPORTANCE_SAMPLING, PPO_CLIP or CISPO",
      ForwardWith([good_advantages](auto* r) {
        Policy(r, good_advantages);
        r->mutable_policy()->set_loss(pb::POLICY_LOSS_UNSPECIFIED);
      }));
  add("policy: no sampling logprobs", Code::INVALID_ARGUMENT,
      "policy needs advantages and sampling_logprobs",
      ForwardWith([good_advantages](auto* r) {
        Policy(r, good_advantages);
        r->mutable_policy()->clear_sampling_logprobs_inline();
      }));
  add("policy: epsilon_low 1", Code::INVALID_ARGUMENT,
      "epsilon_low must be in [0, 1)", ForwardWith([good_advantages](auto* r) {
        Policy(r, good_advantages);
        r->mutable_policy()->set_epsilon_low(1.0f);
      }));
  add("policy: negative epsilon_high", Code::INVALID_ARGUMENT,
      "epsilon_high must be >= 0", ForwardWith([good_advantages](auto* r) {
        Policy(r, good_advantages);
        r->mutable_policy()->set_epsilon_high(-0.1f);
      }));
  add("policy: kl_coef without reference", Code::INVALID_ARGUMENT,
      "kl_coef > 0 needs reference logprobs",
      ForwardWith([good_advantages](auto* r) {
        Policy(r, good_advantages);
        r->mutable_policy()->set_kl_coef(0.1f);
      }));
  add("policy: without targets", Code::INVALID_ARGUMENT, "targets are required",
      ForwardWith([good_advantages](auto* r) {
        r->clear_targets_handle();
        Policy(r, good_advantages);
      }));
  add("policy: label smoothing", Code::INVALID_ARGUMENT,
      "label_smoothing does not compose with policy losses",
      ForwardWith([good_advantages](auto* r) {
        Policy(r, good_advantages);
        r->mutable_options()->set_label_smoothing(0.1f);
      }));
  add("policy: class weights", Code::INVALID_ARGUMENT, "does not compose",
      ForwardWith([this, good_advantages](auto* r) {
        Policy(r, good_advantages);
        r->mutable_options()->set_class_weights(weights_);
      }));

  // ----------------------------------------------------------- Segments
  add("segments: id out of range", Code::INVALID_ARGUMENT,
      "segment id [3] = 2 is outside [0, 2)", ForwardWith([](auto* r) {
        Segments(r, {0, 0, 1, 2}, 2);
      }));
  add("segments: negative id", Code::INVALID_ARGUMENT,
      "segment id [0] = -1 is outside [0, 2)", ForwardWith([](auto* r) {
        Segments(r, {-1, 0, 1, 1}, 2);
      }));
  add("segments: count 0", Code::INVALID_ARGUMENT,
      "segments.count = 0 must be in [1, N = 4]", ForwardWith([](auto* r) {
        Segments(r, {0, 0, 0, 0}, 0);
      }));
  add("segments: count above N", Code::INVALID_ARGUMENT,
      "segments.count = 5 must be in [1, N = 4]", ForwardWith([](auto* r) {
        Segments(r, {0, 0, 0, 0}, 5);
      }));
  add("segments: ids of the wrong length", Code::INVALID_ARGUMENT,
      "segments.ids_inline has 12 bytes; [4] of int32 needs 16",
      ForwardWith([](auto* r) {
        Segments(r, {0, 0, 0}, 1);
      }));
  add("segments: ids of int64", Code::INVALID_ARGUMENT, "ids_inline.dtype",
      ForwardWith([](auto* r) {
        Segments(r, {0, 0, 0, 0}, 1);
        r->mutable_segments()->mutable_ids_inline()->set_dtype(pb::DTYPE_INT64);
      }));
  add("segments: a segment reduction with SUM", Code::INVALID_ARGUMENT,
      "needs the options' reduction to be MEAN", ForwardWith([](auto* r) {
        Segments(r, {0, 0, 1, 1}, 2);
        r->mutable_segments()->set_reduction(
            pb::SEGMENT_REDUCTION_SEQ_MEAN_TOKEN_SUM);
        r->mutable_options()->set_reduction(pb::REDUCTION_SUM);
      }));
  add("segments: no ids", Code::INVALID_ARGUMENT, "segments needs ids",
      ForwardWith([](auto* r) { r->mutable_segments()->set_count(1); }));

  // ------------------------------------------ LinearForward (in place, dW)
  add("linear policy: NaN advantage", Code::INVALID_ARGUMENT,
      "policy advantages[2] = nan is not finite",
      LinearForwardWith([kNaN](auto* r) {
        Policy(r, {1.0f, 1.0f, kNaN, 1.0f});
      }));
  add("linear distillation: top-k index out of range", Code::INVALID_ARGUMENT,
      "top-k index [1, 1] = 5 is outside [0, 5)",
      LinearForwardWith([](auto* r) {
        std::vector<int32_t> indices = GoodIndices();
        indices[3] = kVocab;
        TopK(r, indices, GoodLogprobs());
      }));
  add("linear distillation: dense teacher of another shape",
      Code::INVALID_ARGUMENT,
      "must be a float tensor of the logits' shape [4, 5], got float32 [256, "
      "640]",
      LinearForwardWith([this](auto* r) {
        r->mutable_distillation()->set_teacher_logits(big_);
      }));
  add("linear policy: class weights", Code::INVALID_ARGUMENT,
      "does not compose", LinearForwardWith([this, good_advantages](auto* r) {
        Policy(r, good_advantages);
        r->mutable_options()->set_class_weights(weights_);
      }));
  add("linear policy: without targets", Code::INVALID_ARGUMENT,
      "targets are required", LinearForwardWith([good_advantages](auto* r) {
        r->clear_targets_handle();
        Policy(r, good_advantages);
      }));
  add("linear segments: id out of range", Code::INVALID_ARGUMENT,
      "segment id [3] = 2 is outside [0, 2)", LinearForwardWith([](auto* r) {
        Segments(r, {0, 0, 1, 2}, 2);
      }));

  // ----------------------------------------------------------- Evaluate
  // A distillation header with a top-k teacher of k = 2 in the blocks.
  auto kd_header = [] {
    pb::EvaluateRequest request =
        EvalHeader(kVocab, pb::DTYPE_FLOAT32, pb::DTYPE_INT32);
    request.mutable_header()->mutable_distillation()->set_alpha(0.0f);
    request.mutable_header()->set_teacher_top_k(2);
    request.mutable_header()->set_teacher_indices_dtype(pb::DTYPE_INT32);
    return request;
  };
  // One block of one row with `indices` and logprobs -1.
  auto kd_block = [](std::vector<int32_t> indices) {
    pb::EvaluateRequest request =
        EvalBlock(std::string(kVocab * 4, '\0'), std::string());
    request.mutable_block()->set_teacher_indices(Bytes(indices));
    request.mutable_block()->set_teacher_logprobs(
        Bytes(std::vector<float>(indices.size(), -1.0f)));
    return request;
  };
  add("evaluate distillation: a teacher in the header", Code::INVALID_ARGUMENT,
      "header.distillation.teacher must be unset", [this, kd_header] {
        pb::EvaluateRequest header = kd_header();
        header.mutable_header()->mutable_distillation()->set_teacher_logits(
            logits_);
        return Evaluate({header});
      });
  add("evaluate distillation: two teacher forms", Code::INVALID_ARGUMENT,
      "exactly one of header.teacher_logits_dtype and header.teacher_top_k",
      [this, kd_header] {
        pb::EvaluateRequest header = kd_header();
        header.mutable_header()->set_teacher_logits_dtype(pb::DTYPE_FLOAT32);
        return Evaluate({header});
      });
  add("evaluate distillation: k > V", Code::INVALID_ARGUMENT,
      "top-k k = 6 must be in [1, min(V, 512)]", [this, kd_header] {
        pb::EvaluateRequest header = kd_header();
        header.mutable_header()->set_teacher_top_k(6);
        return Evaluate({header});
      });
  add("evaluate distillation: no targets dtype with alpha > 0",
      Code::INVALID_ARGUMENT,
      "header.targets_dtype is DTYPE_UNSPECIFIED; expected one of INT32, "
      "INT64",
      [this, kd_header] {
        pb::EvaluateRequest header = kd_header();
        header.mutable_header()->mutable_distillation()->set_alpha(0.5f);
        header.mutable_header()->set_targets_dtype(pb::DTYPE_UNSPECIFIED);
        return Evaluate({header});
      });
  add("evaluate distillation: targets in a block without a targets dtype",
      Code::INVALID_ARGUMENT,
      "block 0: targets has 4 bytes, but header.targets_dtype is "
      "DTYPE_UNSPECIFIED",
      [this, kd_header, kd_block] {
        pb::EvaluateRequest header = kd_header();
        header.mutable_header()->set_targets_dtype(pb::DTYPE_UNSPECIFIED);
        pb::EvaluateRequest block = kd_block({0, 1});
        block.mutable_block()->set_targets(Bytes(std::vector<int32_t>{0}));
        return Evaluate({header, block});
      });
  add("evaluate distillation over hidden states: k > the weight's V",
      Code::INVALID_ARGUMENT, "top-k k = 6 must be in [1, min(V, 512)]",
      [this, kd_header] {
        pb::EvaluateRequest header = kd_header();
        header.mutable_header()->set_vocab(0);  // the weight's
        header.mutable_header()->set_weight(head_);
        header.mutable_header()->set_teacher_top_k(6);
        return Evaluate({header});
      });
  add("evaluate distillation over hidden states: a ragged block",
      Code::INVALID_ARGUMENT,
      "block 0: 5 hidden-state bytes are not a whole number of rows of 12",
      [this, kd_header] {
        pb::EvaluateRequest header = kd_header();
        header.mutable_header()->set_weight(head_);
        return Evaluate({header, EvalBlock(std::string(5, '\0'), "")});
      });
  add("evaluate distillation: a block's index out of range",
      Code::INVALID_ARGUMENT, "top-k index [0, 1] = 5 is outside [0, 5)",
      [this, kd_header, kd_block] {
        return Evaluate({kd_header(), kd_block({0, kVocab})});
      });
  add("evaluate distillation: a block's indices of the wrong size",
      Code::INVALID_ARGUMENT,
      "block 0: teacher_indices has 4 bytes; 1 rows need 8",
      [this, kd_header, kd_block] {
        pb::EvaluateRequest block = kd_block({0, 1});
        block.mutable_block()->set_teacher_indices(
            Bytes(std::vector<int32_t>{0}));
        return Evaluate({kd_header(), block});
      });
  // A PPO header whose advantages and sampling logprobs come in the blocks.
  auto policy_header = [] {
    pb::EvaluateRequest request =
        EvalHeader(kVocab, pb::DTYPE_FLOAT32, pb::DTYPE_INT32);
    request.mutable_header()->mutable_policy()->set_loss(
        pb::POLICY_LOSS_PPO_CLIP);
    return request;
  };
  // One block of one row (target 0) with `advantage` and sampling logprob -1.
  auto policy_block = [](float advantage) {
    pb::EvaluateRequest request =
        EvalBlock(std::string(kVocab * 4, '\0'), std::string(4, '\0'));
    request.mutable_block()->set_advantages(
        Bytes(std::vector<float>{advantage}));
    request.mutable_block()->set_sampling_logprobs(
        Bytes(std::vector<float>{-1.0f}));
    return request;
  };
  add("evaluate policy: advantages in the header", Code::INVALID_ARGUMENT,
      "advantages, sampling_logprobs and reference_logprobs must be unset",
      [this, policy_header] {
        pb::EvaluateRequest header = policy_header();
        header.mutable_header()->mutable_policy()->set_advantages_handle(
            logits_);
        return Evaluate({header});
      });
  add("evaluate policy: with a distillation", Code::INVALID_ARGUMENT,
      "distillation and policy cannot be combined", [this, policy_header] {
        pb::EvaluateRequest header = policy_header();
        header.mutable_header()->mutable_distillation()->set_alpha(0.0f);
        header.mutable_header()->set_teacher_top_k(2);
        header.mutable_header()->set_teacher_indices_dtype(pb::DTYPE_INT32);
        return Evaluate({header});
      });
  add("evaluate policy: unspecified loss", Code::INVALID_ARGUMENT,
      "policy.loss must be IMPORTANCE_SAMPLING, PPO_CLIP or CISPO",
      [this, policy_header] {
        pb::EvaluateRequest header = policy_header();
        header.mutable_header()->mutable_policy()->set_loss(
            pb::POLICY_LOSS_UNSPECIFIED);
        return Evaluate({header});
      });
  add("evaluate policy: kl_coef without reference logprobs",
      Code::INVALID_ARGUMENT, "policy.kl_coef > 0 needs reference logprobs",
      [this, policy_header] {
        pb::EvaluateRequest header = policy_header();
        header.mutable_header()->mutable_policy()->set_kl_coef(0.1f);
        return Evaluate({header});
      });
  add("evaluate policy: reference logprobs without a policy",
      Code::INVALID_ARGUMENT, "policy_reference_logprobs is set without",
      [this] {
        pb::EvaluateRequest header =
            EvalHeader(kVocab, pb::DTYPE_FLOAT32, pb::DTYPE_INT32);
        header.mutable_header()->set_policy_reference_logprobs(true);
        return Evaluate({header});
      });
  add("evaluate policy: label smoothing", Code::INVALID_ARGUMENT,
      "label_smoothing does not compose with policy losses",
      [this, policy_header] {
        pb::EvaluateRequest header = policy_header();
        header.mutable_header()->mutable_options()->set_label_smoothing(0.1f);
        return Evaluate({header});
      });
  add("evaluate policy: a NaN advantage", Code::INVALID_ARGUMENT,
      "policy advantages[0] = nan is not finite",
      [this, policy_header, policy_block] {
        return Evaluate(
            {policy_header(),
             policy_block(std::numeric_limits<float>::quiet_NaN())});
      });
  add("evaluate policy: a block without advantages", Code::INVALID_ARGUMENT,
      "block 0: advantages has 0 bytes; 1 rows need 4",
      [this, policy_header, policy_block] {
        pb::EvaluateRequest block = policy_block(1.0f);
        block.mutable_block()->clear_advantages();
        return Evaluate({policy_header(), block});
      });
  add("evaluate policy: a block without targets", Code::INVALID_ARGUMENT,
      "block 0: targets has 0 bytes; 1 rows need 4",
      [this, policy_header, policy_block] {
        pb::EvaluateRequest block = policy_block(1.0f);
        block.mutable_block()->clear_targets();
        return Evaluate({policy_header(), block});
      });
  add("evaluate policy: reference logprobs the header does not name",
      Code::INVALID_ARGUMENT,
      "block 0: reference_logprobs without header.policy_reference_logprobs",
      [this, policy_header, policy_block] {
        pb::EvaluateRequest block = policy_block(1.0f);
        block.mutable_block()->set_reference_logprobs(
            Bytes(std::vector<float>{-1.0f}));
        return Evaluate({policy_header(), block});
      });
  add("evaluate segments: an id past the count", Code::INVALID_ARGUMENT,
      "segment id [0] = 3 is outside [0, 3)", [this] {
        pb::EvaluateRequest header =
            EvalHeader(kVocab, pb::DTYPE_FLOAT32, pb::DTYPE_INT32);
        header.mutable_header()->mutable_segments()->set_count(3);
        pb::EvaluateRequest block =
            EvalBlock(std::string(kVocab * 4, '\0'), std::string(4, '\0'));
        block.mutable_block()->set_segment_ids(Bytes(std::vector<int32_t>{3}));
        return Evaluate({header, block});
      });
}

}  // namespace bad_requests
}  // namespace lossd
