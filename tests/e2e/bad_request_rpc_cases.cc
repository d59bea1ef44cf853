// The bad-request table, RPC by RPC: each field of each request, wrong.
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "tests/e2e/bad_requests.h"

namespace lossd {
namespace bad_requests {

void BadRequestsTest::AddRpcCases(std::vector<Case>* cases) {
  auto add = [cases](std::string name, Code code, std::string message,
                     std::function<grpc::Status()> run) {
    cases->push_back(
        {std::move(name), code, std::move(message), std::move(run)});
  };
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  const float kInf = std::numeric_limits<float>::infinity();
  const int64_t kMax = std::numeric_limits<int64_t>::max();
  const std::string row(kVocab * 4, '\0');  // one fp32 row of zeros
  const std::string target32(4, '\0');

  // ------------------------------------------------------------ Upload
  add("upload: empty stream", Code::INVALID_ARGUMENT, "ended before a header",
      UploadWith({}));
  add("upload: missing dtype", Code::INVALID_ARGUMENT,
      "header.dtype is DTYPE_UNSPECIFIED; expected one of FLOAT32, BFLOAT16, "
      "FLOAT16, INT32, INT64",
      UploadWith({Header(pb::DTYPE_UNSPECIFIED, {2}), Chunk(8)}));
  add("upload: unknown dtype", Code::INVALID_ARGUMENT,
      "header.dtype is 17, which is no DType",
      UploadWith({Header(static_cast<pb::DType>(17), {2}), Chunk(8)}));
  add("upload: negative dtype", Code::INVALID_ARGUMENT,
      "header.dtype is -1, which is no DType",
      UploadWith({Header(static_cast<pb::DType>(-1), {2})}));
  add("upload: no dims", Code::INVALID_ARGUMENT, "1 or 2 dimensions, got 0",
      UploadWith({Header(pb::DTYPE_FLOAT32, {})}));
  add("upload: 3-D", Code::INVALID_ARGUMENT, "1 or 2 dimensions, got 3",
      UploadWith({Header(pb::DTYPE_FLOAT32, {2, 2, 2}), Chunk(32)}));
  add("upload: zero dim", Code::INVALID_ARGUMENT, "dimension 0 must be > 0",
      UploadWith({Header(pb::DTYPE_FLOAT32, {0, 4})}));
  add("upload: negative dim", Code::INVALID_ARGUMENT,
      "dimension -3 must be > 0",
      UploadWith({Header(pb::DTYPE_FLOAT32, {4, -3})}));
  add("upload: min int64 dim", Code::INVALID_ARGUMENT, "must be > 0",
      UploadWith(
          {Header(pb::DTYPE_INT64, {std::numeric_limits<int64_t>::min()})}));
  add("upload: N*V overflows", Code::INVALID_ARGUMENT, "overflows int64",
      UploadWith(
          {Header(pb::DTYPE_FLOAT32, {int64_t{1} << 32, int64_t{1} << 32})}));
  add("upload: N*V*elem overflows", Code::INVALID_ARGUMENT, "overflows int64",
      UploadWith(
          {Header(pb::DTYPE_FLOAT32, {int64_t{1} << 31, int64_t{1} << 30})}));
  add("upload: int64 max elements", Code::INVALID_ARGUMENT, "overflows int64",
      UploadWith({Header(pb::DTYPE_INT64, {kMax})}));
  add("upload: 2^62 bytes over budget", Code::RESOURCE_EXHAUSTED,
      "requested 4611686018427387904 bytes",
      UploadWith({Header(pb::DTYPE_FLOAT32, {int64_t{1} << 40, 1 << 20})}));
  add("upload: over budget", Code::RESOURCE_EXHAUSTED,
      "budget exceeded: requested 1048580 bytes",
      UploadWith({Header(pb::DTYPE_FLOAT32, {kBudget / 4 + 1})}));
  add("upload: data before header", Code::INVALID_ARGUMENT,
      "data before the header",
      UploadWith({Chunk(8), Header(pb::DTYPE_FLOAT32, {2})}));
  add("upload: two headers", Code::INVALID_ARGUMENT, "a second header",
      UploadWith({Header(pb::DTYPE_FLOAT32, {2}), Chunk(8),
                  Header(pb::DTYPE_FLOAT32, {2})}));
  add("upload: more bytes (two chunks)", Code::INVALID_ARGUMENT,
      "more bytes than the header says",
      UploadWith({Header(pb::DTYPE_FLOAT32, {2}), Chunk(4), Chunk(8)}));
  add("upload: more bytes (one chunk)", Code::INVALID_ARGUMENT,
      "more bytes than the header says",
      UploadWith({Header(pb::DTYPE_INT64, {2}), Chunk(17)}));
  add("upload: fewer bytes", Code::INVALID_ARGUMENT,
      "fewer bytes than the header says: 8 expected, 7 received",
      UploadWith({Header(pb::DTYPE_FLOAT32, {2}), Chunk(7)}));
  add("upload: no bytes", Code::INVALID_ARGUMENT,
      "fewer bytes than the header says: 8 expected, 0 received",
      UploadWith({Header(pb::DTYPE_FLOAT32, {2})}));
  add("upload: empty message", Code::INVALID_ARGUMENT,
      "neither header nor chunk",
      UploadWith({Header(pb::DTYPE_FLOAT32, {2}), pb::UploadRequest()}));
  add("upload: cancelled after the header", Code::CANCELLED, "", [this] {
    grpc::ClientContext context;
    pb::UploadResponse response;
    auto writer = stub_->Upload(&context, &response);
    const int64_t before = server_->store()->Stats().used_bytes;
    writer->Write(Header(pb::DTYPE_FLOAT32, {1000}));
    writer->Write(Chunk(1000));
    // Reserved at the header; then the client goes away.
    EXPECT_TRUE(
        server_->store()->AwaitUsedBytes(before + 4000, absl::Seconds(10)));
    context.TryCancel();
    return writer->Finish();
  });

  // ------------------------------------------------------------ Download
  add("download: unknown handle", Code::NOT_FOUND, "unknown handle",
      [this] { return Download(unknown_, pb::DTYPE_UNSPECIFIED, 0); });
  add("download: malformed handle", Code::INVALID_ARGUMENT,
      "handle: malformed handle",
      [this] { return Download(malformed_, pb::DTYPE_UNSPECIFIED, 0); });
  add("download: released handle", Code::NOT_FOUND, "was released",
      [this] { return Download(released_, pb::DTYPE_UNSPECIFIED, 0); });
  add("download: foreign handle", Code::NOT_FOUND, "belongs to instance",
      [this] { return Download(foreign_, pb::DTYPE_UNSPECIFIED, 0); });
  add("download: empty handle", Code::INVALID_ARGUMENT, "handle: empty handle",
      [this] { return Download("", pb::DTYPE_UNSPECIFIED, 0); });
  add("download: int64 -> float32", Code::INVALID_ARGUMENT,
      "cannot convert int64 to float32",
      [this] { return Download(targets64_, pb::DTYPE_FLOAT32, 0); });
  add("download: int32 -> bfloat16", Code::INVALID_ARGUMENT,
      "cannot convert int32 to bfloat16",
      [this] { return Download(targets32_, pb::DTYPE_BFLOAT16, 0); });
  add("download: float32 -> int64", Code::INVALID_ARGUMENT,
      "cannot convert float32 to int64",
      [this] { return Download(logits_, pb::DTYPE_INT64, 0); });
  add("download: int64 -> int32", Code::INVALID_ARGUMENT,
      "cannot convert int64 to int32",
      [this] { return Download(targets64_, pb::DTYPE_INT32, 0); });
  add("download: unknown dtype", Code::INVALID_ARGUMENT,
      "dtype is 42, which is no DType",
      [this] { return Download(logits_, static_cast<pb::DType>(42), 0); });
  add("download: negative chunk_bytes", Code::INVALID_ARGUMENT,
      "chunk_bytes = -1 is outside",
      [this] { return Download(logits_, pb::DTYPE_UNSPECIFIED, -1); });
  add("download: chunk_bytes < one element", Code::INVALID_ARGUMENT,
      "smaller than one element",
      [this] { return Download(logits_, pb::DTYPE_FLOAT32, 3); });
  add("download: chunk_bytes < one int64", Code::INVALID_ARGUMENT,
      "smaller than one element",
      [this] { return Download(targets64_, pb::DTYPE_UNSPECIFIED, 7); });
  add("download: huge chunk_bytes", Code::INVALID_ARGUMENT, "is outside",
      [this] { return Download(logits_, pb::DTYPE_UNSPECIFIED, kMax); });

  // ------------------------------------------------------------ Describe
  add("describe: unknown", Code::NOT_FOUND, "unknown handle",
      [this] { return Describe(unknown_); });
  add("describe: malformed", Code::INVALID_ARGUMENT, "malformed handle",
      [this] { return Describe(malformed_); });
  add("describe: released", Code::NOT_FOUND, "was released",
      [this] { return Describe(released_); });
  add("describe: foreign", Code::NOT_FOUND, "belongs to instance",
      [this] { return Describe(foreign_); });
  add("describe: no dash", Code::INVALID_ARGUMENT, "malformed handle",
      [this] { return Describe("nope"); });

  // ------------------------------------------------------------ Release
  add("release: unknown", Code::NOT_FOUND, "unknown handle",
      [this] { return Release(unknown_); });
  add("release: malformed", Code::INVALID_ARGUMENT, "malformed handle",
      [this] { return Release(malformed_); });
  add("release: released twice", Code::NOT_FOUND, "was released",
      [this] { return Release(released_); });
  add("release: foreign", Code::NOT_FOUND, "belongs to instance",
      [this] { return Release(foreign_); });
  add("release: empty", Code::INVALID_ARGUMENT, "empty handle",
      [this] { return Release(""); });

  // ------------------------------------------------------------ Forward
  add("forward: unknown logits", Code::NOT_FOUND, "unknown handle",
      ForwardWith([this](auto* r) { r->set_logits(unknown_); }));
  add("forward: malformed logits", Code::INVALID_ARGUMENT,
      "logits: malformed handle",
      ForwardWith([this](auto* r) { r->set_logits(malformed_); }));
  add("forward: released logits", Code::NOT_FOUND, "was released",
      ForwardWith([this](auto* r) { r->set_logits(released_); }));
  add("forward: foreign logits", Code::NOT_FOUND, "belongs to instance",
      ForwardWith([this](auto* r) { r->set_logits(foreign_); }));
  add("forward: unknown targets", Code::NOT_FOUND, "unknown handle",
      ForwardWith([this](auto* r) { r->set_targets_handle(unknown_); }));
  add("forward: released targets", Code::NOT_FOUND, "was released",
      ForwardWith([this](auto* r) { r->set_targets_handle(released_); }));
  add("forward: foreign targets", Code::NOT_FOUND, "belongs to instance",
      ForwardWith([this](auto* r) { r->set_targets_handle(foreign_); }));
  add("forward: unknown class_weights", Code::NOT_FOUND, "unknown handle",
      ForwardWith([this](auto* r) {
        r->mutable_options()->set_class_weights(unknown_);
      }));
  add("forward: foreign class_weights", Code::NOT_FOUND, "belongs to instance",
      ForwardWith([this](auto* r) {
        r->mutable_options()->set_class_weights(foreign_);
      }));
  add("forward: malformed class_weights", Code::INVALID_ARGUMENT,
      "options.class_weights: malformed handle", ForwardWith([this](auto* r) {
        r->mutable_options()->set_class_weights("x");
      }));
  add("forward: logits are int64 targets", Code::INVALID_ARGUMENT,
      "logits must be a 2-D float tensor, got int64 [4]",
      ForwardWith([this](auto* r) { r->set_logits(targets64_); }));
  add("forward: logits are 1-D", Code::INVALID_ARGUMENT,
      "logits must be a 2-D float tensor, got float32 [5]",
      ForwardWith([this](auto* r) { r->set_logits(weights_); }));
  add("forward: no targets", Code::INVALID_ARGUMENT, "targets missing",
      ForwardWith([](auto* r) { r->clear_targets_handle(); }));
  add("forward: targets too short", Code::INVALID_ARGUMENT,
      "targets must be int32 or int64 [4], got int64 [2]",
      ForwardWith([this](auto* r) { r->set_targets_handle(short_targets_); }));
  add("forward: targets are floats", Code::INVALID_ARGUMENT, "got float32 [4]",
      ForwardWith([this](auto* r) { r->set_targets_handle(float_targets_); }));
  add("forward: targets are 2-D logits", Code::INVALID_ARGUMENT,
      "got float32 [4, 5]",
      ForwardWith([this](auto* r) { r->set_targets_handle(gradient_mean_); }));
  add("forward: inline targets without dtype", Code::INVALID_ARGUMENT,
      "targets_inline.dtype is DTYPE_UNSPECIFIED; expected one of INT32, INT64",
      ForwardWith([](auto* r) {
        r->mutable_targets_inline()->set_data(std::string(32, '\0'));
      }));
  add("forward: inline float targets", Code::INVALID_ARGUMENT,
      "targets_inline.dtype is DTYPE_FLOAT32; expected one of INT32, INT64",
      ForwardWith([](auto* r) {
        r->mutable_targets_inline()->set_dtype(pb::DTYPE_FLOAT32);
        r->mutable_targets_inline()->set_data(std::string(16, '\0'));
      }));
  add("forward: inline targets unknown dtype", Code::INVALID_ARGUMENT,
      "targets_inline.dtype is 99, which is no DType", ForwardWith([](auto* r) {
        r->mutable_targets_inline()->set_dtype(static_cast<pb::DType>(99));
      }));
  add("forward: inline int64 targets too long", Code::INVALID_ARGUMENT,
      "inline targets have 40 bytes, 4 rows of int64 need 32",
      ForwardInline(pb::DTYPE_INT64, {0, 1, 2, 3, 4}));
  add("forward: inline int32 targets too short", Code::INVALID_ARGUMENT,
      "inline targets have 12 bytes, 4 rows of int32 need 16",
      ForwardInline(pb::DTYPE_INT32, {0, 1, 2}));
  add("forward: int64 target = V", Code::INVALID_ARGUMENT,
      "targets[2] = 5 is out of range",
      ForwardInline(pb::DTYPE_INT64, {0, 1, kVocab, 2}));
  add("forward: int64 target < 0", Code::INVALID_ARGUMENT,
      "targets[1] = -1 is out of range",
      ForwardInline(pb::DTYPE_INT64, {0, -1, 1, 2}));
  add("forward: int64 target huge", Code::INVALID_ARGUMENT,
      "targets[3] = 9223372036854775807",
      ForwardInline(pb::DTYPE_INT64, {0, 1, 2, kMax}));
  add("forward: int64 target most negative", Code::INVALID_ARGUMENT,
      "targets[0] = -9223372036854775808",
      ForwardInline(pb::DTYPE_INT64,
                    {std::numeric_limits<int64_t>::min(), 1, 2, 3}));
  add("forward: int32 target = V", Code::INVALID_ARGUMENT,
      "targets[3] = 5 is out of range",
      ForwardInline(pb::DTYPE_INT32, {0, 1, 2, kVocab}));
  add("forward: int32 target < 0", Code::INVALID_ARGUMENT,
      "targets[0] = -7 is out of range",
      ForwardInline(pb::DTYPE_INT32, {-7, 1, 2, 3}));
  add("forward: int32 target int32 min", Code::INVALID_ARGUMENT,
      "targets[1] = -2147483648",
      ForwardInline(pb::DTYPE_INT32,
                    {0, std::numeric_limits<int32_t>::min(), 2, 3}));
  add("forward: -100 is not ignored with ignore_index -1",
      Code::INVALID_ARGUMENT, "targets[0] = -100 is out of range",
      ForwardInline(pb::DTYPE_INT32, {-100, 1, 2, 3}, -1));
  add("forward: label_smoothing < 0", Code::INVALID_ARGUMENT,
      "label_smoothing = -0.1 is outside [0, 1]", ForwardWith([](auto* r) {
        r->mutable_options()->set_label_smoothing(-0.1f);
      }));
  add("forward: label_smoothing > 1", Code::INVALID_ARGUMENT,
      "label_smoothing = 1.5 is outside [0, 1]", ForwardWith([](auto* r) {
        r->mutable_options()->set_label_smoothing(1.5f);
      }));
  add("forward: label_smoothing NaN", Code::INVALID_ARGUMENT,
      "label_smoothing = nan is not finite", ForwardWith([kNaN](auto* r) {
        r->mutable_options()->set_label_smoothing(kNaN);
      }));
  add("forward: softcap < 0", Code::INVALID_ARGUMENT, "softcap = -1 is < 0",
      ForwardWith([](auto* r) { r->mutable_options()->set_softcap(-1.0f); }));
  add("forward: softcap inf", Code::INVALID_ARGUMENT,
      "softcap = inf is not finite", ForwardWith([kInf](auto* r) {
        r->mutable_options()->set_softcap(kInf);
      }));
  add("forward: z_loss_scale < 0", Code::INVALID_ARGUMENT,
      "z_loss_scale = -0.5 is < 0", ForwardWith([](auto* r) {
        r->mutable_options()->set_z_loss_scale(-0.5f);
      }));
  add("forward: z_loss_scale NaN", Code::INVALID_ARGUMENT,
      "z_loss_scale = nan is not finite", ForwardWith([kNaN](auto* r) {
        r->mutable_options()->set_z_loss_scale(kNaN);
      }));
  add("forward: normalizer < 0", Code::INVALID_ARGUMENT,
      "normalizer = -2 is < 0",
      ForwardWith([](auto* r) { r->mutable_options()->set_normalizer(-2.0); }));
  add("forward: normalizer -inf", Code::INVALID_ARGUMENT,
      "normalizer = -inf is not finite", ForwardWith([](auto* r) {
        r->mutable_options()->set_normalizer(
            -std::numeric_limits<double>::infinity());
      }));
  add("forward: grad_scale NaN", Code::INVALID_ARGUMENT,
      "grad_scale = nan is not finite", ForwardWith([kNaN](auto* r) {
        r->mutable_options()->set_grad_scale(kNaN);
      }));
  add("forward: unknown reduction", Code::INVALID_ARGUMENT,
      "unknown reduction 7", ForwardWith([](auto* r) {
        r->mutable_options()->set_reduction(static_cast<pb::Reduction>(7));
      }));
  add("forward: unknown mode", Code::INVALID_ARGUMENT, "unknown gradient mode",
      ForwardWith(
          [](auto* r) { r->set_mode(static_cast<pb::GradientMode>(-4)); }));
  add("forward: weights of length V-1", Code::INVALID_ARGUMENT,
      "class_weights must be float32 [5], got float32 [4]",
      ForwardWith([this](auto* r) {
        r->mutable_options()->set_class_weights(short_weights_);
      }));
  add("forward: int32 weights", Code::INVALID_ARGUMENT,
      "class_weights must be float32 [5], got int32 [5]",
      ForwardWith([this](auto* r) {
        r->mutable_options()->set_class_weights(int_weights_);
      }));
  add("forward: 2-D weights", Code::INVALID_ARGUMENT,
      "class_weights must be float32 [5], got float32 [1, 5]",
      ForwardWith([this](auto* r) {
        r->mutable_options()->set_class_weights(weights_2d_);
      }));
  add("forward: on a consumed handle", Code::FAILED_PRECONDITION,
      "its logits were consumed",
      ForwardWith([this](auto* r) { r->set_logits(gradient_mean_); }));
  add("forward: out of place on a consumed handle", Code::FAILED_PRECONDITION,
      "its logits were consumed", ForwardWith([this](auto* r) {
        r->set_logits(gradient_none_);
        r->set_mode(pb::GRADIENT_MODE_OUT_OF_PLACE);
      }));
  add("forward: no room for an out-of-place gradient", Code::RESOURCE_EXHAUSTED,
      "requested 655360 bytes", [this] {
        pb::ForwardRequest request;
        request.set_logits(big_);
        request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT32);
        request.mutable_targets_inline()->set_data(std::string(256 * 4, '\0'));
        request.set_mode(pb::GRADIENT_MODE_OUT_OF_PLACE);
        return Forward(request);
      });
  add("forward: in place while a Download reads it", Code::FAILED_PRECONDITION,
      "is being read", [this] {
        grpc::ClientContext context;
        pb::DownloadRequest download;
        download.set_handle(big_);
        download.set_chunk_bytes(4);
        auto reader = stub_->Download(&context, download);
        pb::DownloadResponse response;
        EXPECT_TRUE(reader->Read(&response));  // the header: the lease is held
        pb::ForwardRequest request;
        request.set_logits(big_);
        request.mutable_targets_inline()->set_dtype(pb::DTYPE_INT32);
        request.mutable_targets_inline()->set_data(std::string(256 * 4, '\0'));
        const grpc::Status status = Forward(request);
        context.TryCancel();
        while (reader->Read(&response)) {
        }
        reader->Finish();
        return status;
      });

  // ------------------------------------------------------------ Backward
  add("backward: on logits", Code::FAILED_PRECONDITION, "holds logits",
      BackwardWith(logits_, [](auto* r) { r->set_scalar(1.0); }));
  add("backward: on targets", Code::FAILED_PRECONDITION, "holds logits",
      BackwardWith(targets64_, [](auto* r) { r->set_scalar(1.0); }));
  add("backward: no grad_output", Code::INVALID_ARGUMENT, "no grad_output",
      BackwardWith(gradient_mean_, [](auto*) {}));
  add("backward: NaN", Code::INVALID_ARGUMENT, "not finite",
      BackwardWith(gradient_mean_, [](auto* r) { r->set_scalar(NAN); }));
  add("backward: -inf", Code::INVALID_ARGUMENT, "not finite",
      BackwardWith(gradient_mean_, [](auto* r) { r->set_scalar(-INFINITY); }));
  add("backward: beyond float32", Code::INVALID_ARGUMENT, "float32",
      BackwardWith(gradient_mean_, [](auto* r) { r->set_scalar(1e300); }));
  add("backward: empty per-token", Code::INVALID_ARGUMENT,
      "per-token grad_output is empty",
      BackwardWith(gradient_none_, [](auto* r) { r->mutable_per_token(); }));
  add("backward: per-token on a mean gradient", Code::INVALID_ARGUMENT,
      "needs a gradient computed with reduction NONE",
      BackwardWith(gradient_mean_, [](auto* r) {
        for (int i = 0; i < kRows; ++i) r->mutable_per_token()->add_values(1);
      }));
  add("backward: per-token too short", Code::INVALID_ARGUMENT,
      "per-token grad_output has 3 values, the gradient has 4 rows",
      BackwardWith(gradient_none_, [](auto* r) {
        for (int i = 0; i < 3; ++i) r->mutable_per_token()->add_values(1);
      }));
  add("backward: per-token too long", Code::INVALID_ARGUMENT,
      "per-token grad_output has 5 values",
      BackwardWith(gradient_none_, [](auto* r) {
        for (int i = 0; i < 5; ++i) r->mutable_per_token()->add_values(1);
      }));
  add("backward: per-token NaN", Code::INVALID_ARGUMENT,
      "grad_output[2] = nan is not finite",
      BackwardWith(gradient_none_, [kNaN](auto* r) {
        for (int i = 0; i < kRows; ++i) {
          r->mutable_per_token()->add_values(i == 2 ? kNaN : 1.0f);
        }
      }));
  add("backward: per-token +inf", Code::INVALID_ARGUMENT,
      "grad_output[0] = inf is not finite",
      BackwardWith(gradient_none_, [kInf](auto* r) {
        for (int i = 0; i < kRows; ++i) {
          r->mutable_per_token()->add_values(i == 0 ? kInf : 1.0f);
        }
      }));
  add("backward: per-token -inf last", Code::INVALID_ARGUMENT,
      "grad_output[3] = -inf is not finite",
      BackwardWith(gradient_none_, [kInf](auto* r) {
        for (int i = 0; i < kRows; ++i) {
          r->mutable_per_token()->add_values(i == kRows - 1 ? -kInf : 1.0f);
        }
      }));
  add("backward: another factor after materialize", Code::FAILED_PRECONDITION,
      "materialized with another grad_output",
      BackwardWith(gradient_materialized_,
                   [](auto* r) { r->set_scalar(3.0); }));
  add("backward: unknown", Code::NOT_FOUND, "unknown handle",
      BackwardWith(unknown_, [](auto* r) { r->set_scalar(1.0); }));
  add("backward: malformed", Code::INVALID_ARGUMENT,
      "gradient: malformed handle",
      BackwardWith(malformed_, [](auto* r) { r->set_scalar(1.0); }));
  add("backward: released", Code::NOT_FOUND, "was released",
      BackwardWith(released_, [](auto* r) { r->set_scalar(1.0); }));
  add("backward: foreign", Code::NOT_FOUND, "belongs to instance",
      BackwardWith(foreign_, [](auto* r) { r->set_scalar(1.0); }));

  // ------------------------------------------------------- LinearForward
  // A non-finite per-row factor, in place with a new accumulator: refused
  // before the hidden states are written or an accumulator is made.
  add("linear: token_grad_output NaN", Code::INVALID_ARGUMENT,
      "token_grad_output[1] = nan is not finite",
      LinearForwardWith(
          [kNaN](auto* r) { r->set_token_grad_output(1, kNaN); }));
  add("linear: token_grad_output +inf", Code::INVALID_ARGUMENT,
      "token_grad_output[0] = inf is not finite",
      LinearForwardWith(
          [kInf](auto* r) { r->set_token_grad_output(0, kInf); }));
  add("linear: token_grad_output -inf, out of place", Code::INVALID_ARGUMENT,
      "token_grad_output[3] = -inf is not finite",
      LinearForwardWith([kInf](auto* r) {
        r->set_mode(pb::GRADIENT_MODE_OUT_OF_PLACE);
        r->set_token_grad_output(3, -kInf);
      }));
  add("linear: token_grad_output NaN, dX only", Code::INVALID_ARGUMENT,
      "token_grad_output[2] = nan is not finite",
      LinearForwardWith([kNaN](auto* r) {
        r->set_accumulate(pb::ACCUMULATE_MODE_NONE);
        r->set_token_grad_output(2, kNaN);
      }));
  add("linear: NaN grad_scale", Code::INVALID_ARGUMENT, "not finite",
      LinearForwardWith(
          [kNaN](auto* r) { r->mutable_options()->set_grad_scale(kNaN); }));
  add("linear: token_grad_output too short", Code::INVALID_ARGUMENT,
      "token_grad_output has 3 values, the hidden states have 4 rows",
      LinearForwardWith(
          [](auto* r) { r->mutable_token_grad_output()->RemoveLast(); }));

  // ------------------------------------------------------------ Evaluate
  const pb::EvaluateRequest good =
      EvalHeader(kVocab, pb::DTYPE_FLOAT32, pb::DTYPE_INT32);
  auto with_options = [good](std::function<void(pb::LossOptions*)> mutate) {
    pb::EvaluateRequest request = good;
    mutate(request.mutable_header()->mutable_options());
    return request;
  };
  add("evaluate: empty stream", Code::INVALID_ARGUMENT, "ended before a header",
      EvaluateWith({}));
  add("evaluate: data before header", Code::INVALID_ARGUMENT,
      "data before the header", EvaluateWith({EvalBlock(row, target32), good}));
  add("evaluate: two headers", Code::INVALID_ARGUMENT, "a second header",
      EvaluateWith({good, EvalBlock(row, target32), good}));
  add("evaluate: empty message", Code::INVALID_ARGUMENT,
      "neither header nor block", EvaluateWith({good, pb::EvaluateRequest()}));
  add("evaluate: reduction NONE", Code::INVALID_ARGUMENT,
      "reduction NONE is not allowed", EvaluateWith({with_options([](auto* o) {
        o->set_reduction(pb::REDUCTION_NONE);
      })}));
  add("evaluate: unknown reduction", Code::INVALID_ARGUMENT,
      "unknown reduction 12", EvaluateWith({with_options([](auto* o) {
        o->set_reduction(static_cast<pb::Reduction>(12));
      })}));
  add("evaluate: label_smoothing NaN", Code::INVALID_ARGUMENT,
      "label_smoothing = nan",
      EvaluateWith(
          {with_options([kNaN](auto* o) { o->set_label_smoothing(kNaN); })}));
  add("evaluate: softcap < 0", Code::INVALID_ARGUMENT, "softcap = -3 is < 0",
      EvaluateWith({with_options([](auto* o) { o->set_softcap(-3.0f); })}));
  add("evaluate: vocab 0", Code::INVALID_ARGUMENT, "vocab = 0 must be > 0",
      EvaluateWith({EvalHeader(0, pb::DTYPE_FLOAT32, pb::DTYPE_INT32)}));
  add("evaluate: vocab < 0", Code::INVALID_ARGUMENT, "vocab = -5 must be > 0",
      EvaluateWith({EvalHeader(-5, pb::DTYPE_FLOAT32, pb::DTYPE_INT32)}));
  add("evaluate: row bytes overflow int64", Code::INVALID_ARGUMENT,
      "overflows int64",
      EvaluateWith(
          {EvalHeader(int64_t{1} << 62, pb::DTYPE_FLOAT32, pb::DTYPE_INT32),
           EvalBlock(row, target32)}));
  add("evaluate: int64 max vocab", Code::INVALID_ARGUMENT, "overflows int64",
      EvaluateWith({EvalHeader(kMax, pb::DTYPE_BFLOAT16, pb::DTYPE_INT64),
                    EvalBlock(row, target32)}));
  add("evaluate: missing logits dtype", Code::INVALID_ARGUMENT,
      "header.logits_dtype is DTYPE_UNSPECIFIED; expected one of FLOAT32, "
      "BFLOAT16, FLOAT16",
      EvaluateWith(
          {EvalHeader(kVocab, pb::DTYPE_UNSPECIFIED, pb::DTYPE_INT32)}));
  add("evaluate: int logits", Code::INVALID_ARGUMENT,
      "header.logits_dtype is DTYPE_INT64; expected one of FLOAT32, BFLOAT16, "
      "FLOAT16",
      EvaluateWith({EvalHeader(kVocab, pb::DTYPE_INT64, pb::DTYPE_INT32)}));
  add("evaluate: float targets", Code::INVALID_ARGUMENT,
      "header.targets_dtype is DTYPE_FLOAT16; expected one of INT32, INT64",
      EvaluateWith({EvalHeader(kVocab, pb::DTYPE_FLOAT32, pb::DTYPE_FLOAT16)}));
  add("evaluate: unknown targets dtype", Code::INVALID_ARGUMENT,
      "header.targets_dtype is 6, which is no DType",
      EvaluateWith(
          {EvalHeader(kVocab, pb::DTYPE_FLOAT32, static_cast<pb::DType>(6))}));
  add("evaluate: partial row", Code::INVALID_ARGUMENT,
      "not a whole number of rows",
      EvaluateWith({good, EvalBlock(row + std::string(4, '\0'), target32)}));
  add("evaluate: targets for fewer rows", Code::INVALID_ARGUMENT,
      "2 rows of logits but 4 bytes of targets",
      EvaluateWith({good, EvalBlock(row + row, target32)}));
  add("evaluate: targets without logits", Code::INVALID_ARGUMENT,
      "0 rows of logits but 4 bytes of targets",
      EvaluateWith({good, EvalBlock("", target32)}));
  add("evaluate: no rows", Code::INVALID_ARGUMENT, "no rows at all",
      EvaluateWith({good, EvalBlock("", "")}));
  add("evaluate: target out of range", Code::INVALID_ARGUMENT,
      "targets[1] = 5 is out of range", [this, row, good] {
        std::vector<int32_t> targets = {0, kVocab};
        return Evaluate({good, EvalBlock(row + row, Bytes(targets))});
      });
  add("evaluate: unknown class_weights", Code::NOT_FOUND, "unknown handle",
      [this, with_options] {
        return Evaluate({with_options(
            [this](auto* o) { o->set_class_weights(unknown_); })});
      });
  add("evaluate: class_weights of length V-1", Code::INVALID_ARGUMENT,
      "class_weights must be float32 [5]", [this, with_options] {
        return Evaluate({with_options(
            [this](auto* o) { o->set_class_weights(short_weights_); })});
      });

  // ----------------------------------------- Evaluate over hidden states
  // logits_ (fp32 [4, 5]) is the weight: V = 4, H = 5, `row` one hidden row;
  // short_weights_ (fp32 [4]) a bias that fits it.
  auto hidden = [this](std::function<void(pb::EvaluateHeader*)> mutate) {
    pb::EvaluateRequest request =
        EvalHeader(0, pb::DTYPE_UNSPECIFIED, pb::DTYPE_INT32);
    request.mutable_header()->set_weight(logits_);
    mutate(request.mutable_header());
    return request;
  };
  const pb::EvaluateRequest hidden_good = hidden([](auto*) {});
  add("evaluate hidden: unknown weight", Code::NOT_FOUND,
      "header.weight: unknown handle",
      EvaluateWith({hidden([this](auto* h) { h->set_weight(unknown_); })}));
  add("evaluate hidden: released weight", Code::NOT_FOUND,
      "header.weight: handle " + released_ + " was released",
      EvaluateWith({hidden([this](auto* h) { h->set_weight(released_); })}));
  add("evaluate hidden: foreign weight", Code::NOT_FOUND,
      "header.weight: handle " + foreign_ + " belongs to instance",
      EvaluateWith({hidden([this](auto* h) { h->set_weight(foreign_); })}));
  add("evaluate hidden: malformed weight", Code::INVALID_ARGUMENT,
      "header.weight",
      EvaluateWith({hidden([this](auto* h) { h->set_weight(malformed_); })}));
  add("evaluate hidden: malformed bias", Code::INVALID_ARGUMENT, "header.bias",
      EvaluateWith({hidden([this](auto* h) { h->set_bias(malformed_); })}));
  add("evaluate hidden: unknown bias", Code::NOT_FOUND,
      "header.bias: unknown handle",
      EvaluateWith({hidden([this](auto* h) { h->set_bias(unknown_); })}));
  add("evaluate hidden: bias without weight", Code::INVALID_ARGUMENT,
      "header.bias is set but header.weight is not", EvaluateWith({[&] {
        pb::EvaluateRequest request = good;
        request.mutable_header()->set_bias(short_weights_);
        return request;
      }()}));
  add("evaluate hidden: 1-D weight", Code::INVALID_ARGUMENT,
      "header.weight must be a 2-D float tensor [V, H] (float32, bfloat16 or "
      "float16), got float32 [5]",
      EvaluateWith({hidden([this](auto* h) { h->set_weight(weights_); })}));
  add("evaluate hidden: int weight", Code::INVALID_ARGUMENT,
      "header.weight must be a 2-D float tensor [V, H] (float32, bfloat16 or "
      "float16), got int32 [5]",
      EvaluateWith({hidden([this](auto* h) { h->set_weight(int_weights_); })}));
  add("evaluate hidden: weight holds a gradient", Code::INVALID_ARGUMENT,
      "header.weight " + gradient_mean_ + " holds a gradient",
      EvaluateWith(
          {hidden([this](auto* h) { h->set_weight(gradient_mean_); })}));
  add("evaluate hidden: bias of V+1", Code::INVALID_ARGUMENT,
      "header.bias must be float32 [4] (the weight's dtype and V), got "
      "float32 [5]",
      EvaluateWith({hidden([this](auto* h) { h->set_bias(weights_); })}));
  add("evaluate hidden: int bias", Code::INVALID_ARGUMENT,
      "header.bias must be float32 [4] (the weight's dtype and V), got int32 "
      "[5]",
      EvaluateWith({hidden([this](auto* h) { h->set_bias(int_weights_); })}));
  add("evaluate hidden: vocab not V", Code::INVALID_ARGUMENT,
      "header.vocab = 5 but header.weight has V = 4 ([4, 5]); send 0 or 4",
      EvaluateWith({hidden([](auto* h) { h->set_vocab(kVocab); })}));
  add("evaluate hidden: vocab < 0", Code::INVALID_ARGUMENT,
      "header.vocab = -1 must be 0 (the weight's V) or V",
      EvaluateWith({hidden([](auto* h) { h->set_vocab(-1); })}));
  add("evaluate hidden: logits_dtype not the weight's", Code::INVALID_ARGUMENT,
      "header.logits_dtype is DTYPE_BFLOAT16 but header.weight is float32; "
      "the hidden states have the weight's dtype: send DTYPE_UNSPECIFIED or "
      "DTYPE_FLOAT32",
      EvaluateWith(
          {hidden([](auto* h) { h->set_logits_dtype(pb::DTYPE_BFLOAT16); })}));
  add("evaluate hidden: int logits_dtype", Code::INVALID_ARGUMENT,
      "header.logits_dtype is DTYPE_INT32; expected one of FLOAT32, BFLOAT16, "
      "FLOAT16 or DTYPE_UNSPECIFIED",
      EvaluateWith(
          {hidden([](auto* h) { h->set_logits_dtype(pb::DTYPE_INT32); })}));
  add("evaluate hidden: class_weights not [V]", Code::INVALID_ARGUMENT,
      "class_weights must be float32 [4], got float32 [5]",
      EvaluateWith({hidden([this](auto* h) {
        h->mutable_options()->set_class_weights(weights_);
      })}));
  add("evaluate hidden: partial row", Code::INVALID_ARGUMENT,
      "block 0: 24 hidden-state bytes are not a whole number of rows of 20 "
      "bytes (H = 5 values of float32)",
      EvaluateWith(
          {hidden_good, EvalBlock(row + std::string(4, '\0'), target32)}));
  add("evaluate hidden: targets for fewer rows", Code::INVALID_ARGUMENT,
      "block 0: 2 rows of hidden states but 4 bytes of targets (4 each)",
      EvaluateWith({hidden_good, EvalBlock(row + row, target32)}));
  add("evaluate hidden: target out of range", Code::INVALID_ARGUMENT,
      "targets[1] = 4 is out of range", [this, row, hidden_good] {
        const std::vector<int32_t> targets = {0, kRows};
        return Evaluate({hidden_good, EvalBlock(row + row, Bytes(targets))});
      });
  add("evaluate hidden: no rows", Code::INVALID_ARGUMENT, "no rows at all",
      EvaluateWith({hidden_good}));
}

}  // namespace bad_requests
}  // namespace lossd
