// Runs the lossctl binary against a real lossd: what a user types (upload, ls,
// forward, backward, download, eval, rm) works, prints parseable results, and
// fails with the gRPC code name and a non-zero exit status.
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/client.h"
#include "client/npy.h"
#include "client/safetensors.h"
#include "common/float16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/lossd_process.h"

namespace lossd {
namespace {

using ::lossd::client_test::CommandResult;
using ::lossd::client_test::LossdProcess;
using ::lossd::client_test::RunCommand;
using ::lossd::client_test::TempDir;
using ::testing::HasSubstr;

class LossctlTest : public ::testing::Test {
 protected:
  static constexpr int64_t kRows = 64;
  static constexpr int64_t kVocab = 300;

  void SetUp() override {
    seed_ = std::random_device{}();
    std::mt19937 rng(seed_);
    absl::StatusOr<std::unique_ptr<LossdProcess>> server =
        LossdProcess::Start(LOSSD_BINARY_PATH);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(server_->address());
    ASSERT_TRUE(client.ok());
    client_ = *std::move(client);

    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::uniform_int_distribution<int64_t> target(0, kVocab - 1);
    logits_.resize(kRows * kVocab);
    for (float& v : logits_) v = normal(rng);
    targets_.resize(kRows);
    for (int64_t& t : targets_) t = target(rng);
    targets_[5] = -100;
    logits_path_ = dir_.File("logits.npy");
    targets_path_ = dir_.File("targets.npy");
    ASSERT_TRUE(WriteNpy(logits_path_, DType::kFloat32, {kRows, kVocab},
                         logits_.data(), logits_.size() * sizeof(float))
                    .ok());
    ASSERT_TRUE(WriteNpy(targets_path_, DType::kInt64, {kRows}, targets_.data(),
                         targets_.size() * sizeof(int64_t))
                    .ok());
  }

  void TearDown() override {
    if (HasFailure()) std::fprintf(stderr, "random seed: %u\n", seed_);
  }

  // Runs lossctl with --server pointing at the test's lossd.
  CommandResult Lossctl(std::vector<std::string> args) {
    args.insert(args.begin(),
                {LOSSCTL_BINARY_PATH, "--server=" + server_->address()});
    absl::StatusOr<CommandResult> result = RunCommand(args);
    EXPECT_TRUE(result.ok()) << result.status();
    return result.ok() ? *result : CommandResult();
  }

  // Uploads a file with lossctl and returns the handle it printed.
  std::string UploadHandle(std::vector<std::string> args) {
    args.insert(args.begin(), "upload");
    CommandResult up = Lossctl(args);
    EXPECT_EQ(up.exit_code, 0) << up.err;
    return std::string(absl::StripAsciiWhitespace(up.out));
  }

  // Writes `values` (int32 or fp32) as the .npy file `name` of `shape` in
  // the test's directory; its path.
  template <typename V>
  std::string WriteRowsFile(const std::string& name, std::vector<int64_t> shape,
                            const std::vector<V>& values) {
    const std::string path = dir_.File(name);
    const DType dtype =
        std::is_same_v<V, int32_t> ? DType::kInt32 : DType::kFloat32;
    EXPECT_TRUE(
        WriteNpy(path, dtype, shape, values.data(), values.size() * sizeof(V))
            .ok())
        << path;
    return path;
  }

  // The value after `key` in a "key value key value ..." line.
  static double Field(const std::string& line, const std::string& key) {
    std::vector<std::string> words = absl::StrSplit(
        absl::StripAsciiWhitespace(line), ' ', absl::SkipEmpty());
    for (std::size_t i = 0; i + 1 < words.size(); i += 2) {
      double value;
      if (words[i] == key && absl::SimpleAtod(words[i + 1], &value)) {
        return value;
      }
    }
    ADD_FAILURE() << "no '" << key << "' in: " << line;
    return NAN;
  }

  unsigned seed_ = 0;
  TempDir dir_;
  std::unique_ptr<LossdProcess> server_;
  std::unique_ptr<Client> client_;
  std::vector<float> logits_;
  std::vector<int64_t> targets_;
  std::string logits_path_;
  std::string targets_path_;
};

TEST_F(LossctlTest, HealthAndInfo) {
  CommandResult health = Lossctl({"health"});
  EXPECT_EQ(health.exit_code, 0) << health.err;
  EXPECT_THAT(health.out, HasSubstr("liveness SERVING"));
  EXPECT_THAT(health.out, HasSubstr("readiness SERVING"));
  CommandResult info = Lossctl({"info"});
  EXPECT_EQ(info.exit_code, 0) << info.err;
  EXPECT_THAT(info.out, HasSubstr("device cpu"));
  // The server picked a free data port (--data_port=0): a real one shows.
  EXPECT_THAT(info.out, HasSubstr("data_port "));
  EXPECT_THAT(info.out, ::testing::Not(HasSubstr("data_port 0\n")));
}

TEST_F(LossctlTest, UploadListEvalRemove) {
  const std::string handle = UploadHandle({logits_path_, "--label=demo"});
  ASSERT_FALSE(handle.empty());

  CommandResult ls = Lossctl({"ls"});
  EXPECT_EQ(ls.exit_code, 0) << ls.err;
  EXPECT_THAT(ls.out, HasSubstr(handle));
  EXPECT_THAT(ls.out, HasSubstr("demo"));
  EXPECT_THAT(ls.out, HasSubstr("[64, 300]"));

  // eval prints what Forward without a gradient computes on the same data.
  ForwardOptions options;
  options.mode = GradientMode::kNone;
  absl::StatusOr<ForwardResult> fwd = client_->Forward(
      handle, Targets::Inline(DType::kInt64, targets_.data(), kRows * 8),
      options);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  for (const char* block_rows : {"0", "1", "5", "64"}) {
    CommandResult eval = Lossctl({"eval", logits_path_, targets_path_,
                                  absl::StrCat("--block_rows=", block_rows)});
    ASSERT_EQ(eval.exit_code, 0) << eval.err;
    EXPECT_NEAR(Field(eval.out, "loss"), fwd->loss, 1e-10 * fwd->loss)
        << eval.out;
    EXPECT_NEAR(Field(eval.out, "accuracy"),
                static_cast<double>(fwd->correct_tokens) / fwd->valid_tokens,
                1e-6);
    EXPECT_EQ(Field(eval.out, "tokens"), kRows - 1);
    // Not a terminal and no --progress: no progress bar.
    EXPECT_THAT(eval.err, ::testing::Not(HasSubstr("%")));
  }
  CommandResult progress =
      Lossctl({"eval", logits_path_, targets_path_, "--progress"});
  ASSERT_EQ(progress.exit_code, 0) << progress.err;
  EXPECT_THAT(progress.err, HasSubstr("100.0%"));

  // Options reach the server: a sum is rows times the mean.
  CommandResult sum =
      Lossctl({"eval", logits_path_, targets_path_, "--reduction=sum"});
  ASSERT_EQ(sum.exit_code, 0) << sum.err;
  EXPECT_NEAR(Field(sum.out, "loss"), fwd->loss * (kRows - 1),
              1e-9 * fwd->loss * kRows);

  CommandResult rm = Lossctl({"rm", handle});
  EXPECT_EQ(rm.exit_code, 0) << rm.err;
  EXPECT_THAT(rm.out, HasSubstr("released " + handle));
  CommandResult rm_again = Lossctl({"rm", handle});
  EXPECT_EQ(rm_again.exit_code, 1);
  EXPECT_THAT(rm_again.err, HasSubstr("NOT_FOUND"));
  ls = Lossctl({"ls"});
  EXPECT_THAT(ls.out, ::testing::Not(HasSubstr(handle)));
}

TEST_F(LossctlTest, ForwardBackwardDownload) {
  const std::string handle = UploadHandle({logits_path_});
  CommandResult fwd = Lossctl({"forward", handle, targets_path_});
  ASSERT_EQ(fwd.exit_code, 0) << fwd.err;
  EXPECT_THAT(fwd.out, HasSubstr("gradient " + handle));
  EXPECT_EQ(Field(fwd.out, "valid"), kRows - 1);

  const std::string plain = dir_.File("grad.npy");
  CommandResult down = Lossctl({"download", handle, plain});
  ASSERT_EQ(down.exit_code, 0) << down.err;

  CommandResult back = Lossctl({"backward", handle, "--grad_output=0.25"});
  ASSERT_EQ(back.exit_code, 0) << back.err;
  EXPECT_THAT(back.out, HasSubstr("GRADIENT pending_scale 0.25"));
  const std::string scaled = dir_.File("grad_scaled.npy");
  down = Lossctl({"download", handle, scaled});
  ASSERT_EQ(down.exit_code, 0) << down.err;

  absl::StatusOr<std::unique_ptr<NpyFile>> g = NpyFile::Open(plain);
  absl::StatusOr<std::unique_ptr<NpyFile>> g4 = NpyFile::Open(scaled);
  ASSERT_TRUE(g.ok() && g4.ok());
  EXPECT_EQ((*g)->header().shape, (std::vector<int64_t>{kRows, kVocab}));
  const float* a = reinterpret_cast<const float*>((*g)->data());
  const float* b = reinterpret_cast<const float*>((*g4)->data());
  double row_sum = 0.0;
  for (int64_t i = 0; i < kRows * kVocab; ++i) {
    ASSERT_EQ(b[i], a[i] * 0.25f) << i;
    if (i < kVocab) row_sum += a[i];
  }
  EXPECT_NEAR(row_sum, 0.0, 1e-6);

  // The logits were consumed: the server says so, lossctl passes it on.
  CommandResult again = Lossctl({"forward", handle, targets_path_});
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_THAT(again.err, HasSubstr("FAILED_PRECONDITION"));
}

// lossctl linear: the loss of X W^T and dW into an accumulator it prints,
// then added to by a second call naming it (with --linear_precision=fast,
// which the CPU computes the same).
TEST_F(LossctlTest, LinearForwardAccumulates) {
  constexpr int64_t kWidth = 8;
  std::vector<float> hidden(kRows * kWidth), weight(kVocab * kWidth);
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = 0.01f * (i % 97);
  for (size_t i = 0; i < weight.size(); ++i) weight[i] = 0.02f * (i % 31);
  const std::string hidden_path = dir_.File("hidden.npy");
  const std::string weight_path = dir_.File("weight.npy");
  ASSERT_TRUE(WriteNpy(hidden_path, DType::kFloat32, {kRows, kWidth},
                       hidden.data(), hidden.size() * sizeof(float))
                  .ok());
  ASSERT_TRUE(WriteNpy(weight_path, DType::kFloat32, {kVocab, kWidth},
                       weight.data(), weight.size() * sizeof(float))
                  .ok());
  const std::string w = UploadHandle({weight_path});
  CommandResult first =
      Lossctl({"linear", UploadHandle({hidden_path}), w, targets_path_});
  ASSERT_EQ(first.exit_code, 0) << first.err;
  EXPECT_EQ(Field(first.out, "valid"), kRows - 1);
  const std::string marker = "weight_grad ";
  const size_t at = first.out.find(marker);
  ASSERT_NE(at, std::string::npos) << first.out;
  const std::string dw =
      std::string(absl::StripAsciiWhitespace(first.out.substr(
          at + marker.size(), first.out.find('\n', at) - at - marker.size())));
  absl::StatusOr<DownloadedTensor> once = client_->Download(dw);
  ASSERT_TRUE(once.ok()) << once.status();

  CommandResult second = Lossctl(
      {"linear", UploadHandle({hidden_path}), w, targets_path_,
       "--weight_grad=" + dw, "--accumulate=add", "--linear_precision=fast"});
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_THAT(second.out, HasSubstr("weight_grad " + dw));
  absl::StatusOr<DownloadedTensor> twice = client_->Download(dw);
  ASSERT_TRUE(twice.ok()) << twice.status();
  const float* a = reinterpret_cast<const float*>(once->data.data());
  const float* b = reinterpret_cast<const float*>(twice->data.data());
  for (int64_t i = 0; i < kVocab * kWidth; ++i) {
    ASSERT_NEAR(b[i], 2 * a[i], 1e-6f + 1e-5f * std::fabs(a[i])) << i;
  }

  CommandResult bad = Lossctl({"linear", UploadHandle({hidden_path}), w,
                               targets_path_, "--accumulate=sometimes"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err, HasSubstr("--accumulate=sometimes"));
  CommandResult bad_precision =
      Lossctl({"linear", UploadHandle({hidden_path}), w, targets_path_,
               "--linear_precision=half"});
  EXPECT_NE(bad_precision.exit_code, 0);
  EXPECT_THAT(bad_precision.err, HasSubstr("--linear_precision=half"));
}

// lossctl eval --weight: a file of hidden states against the stored weight
// (and bias) gives LinearForward's loss without a gradient, over the stream
// and over data connections; the header's mismatches are named.
TEST_F(LossctlTest, EvalHiddenStatesAgainstAStoredWeight) {
  constexpr int64_t kWidth = 8;
  std::vector<float> hidden(kRows * kWidth), weight(kVocab * kWidth);
  std::vector<float> bias(kVocab);
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = 0.01f * (i % 97);
  for (size_t i = 0; i < weight.size(); ++i) weight[i] = 0.02f * (i % 31);
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = 0.03f * (i % 7);
  const std::string hidden_path = dir_.File("eval-hidden.npy");
  ASSERT_TRUE(WriteNpy(hidden_path, DType::kFloat32, {kRows, kWidth},
                       hidden.data(), hidden.size() * sizeof(float))
                  .ok());
  absl::StatusOr<TensorInfo> w = client_->Upload(
      DType::kFloat32, {kVocab, kWidth}, weight.data(), weight.size() * 4);
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<TensorInfo> b =
      client_->Upload(DType::kFloat32, {kVocab}, bias.data(), bias.size() * 4);
  ASSERT_TRUE(b.ok()) << b.status();
  absl::StatusOr<TensorInfo> x = client_->Upload(
      DType::kFloat32, {kRows, kWidth}, hidden.data(), hidden.size() * 4);
  ASSERT_TRUE(x.ok()) << x.status();
  LinearForwardOptions options;
  options.mode = GradientMode::kNone;
  options.bias = b->handle;
  absl::StatusOr<LinearForwardResult> want = client_->LinearForward(
      x->handle, w->handle,
      Targets::Inline(DType::kInt64, targets_.data(), targets_.size() * 8),
      options);
  ASSERT_TRUE(want.ok()) << want.status();
  for (const char* connections :
       {"--stripe_min_bytes=67108864", "--stripe_min_bytes=1"}) {
    SCOPED_TRACE(connections);
    CommandResult eval =
        Lossctl({"eval", hidden_path, targets_path_, "--weight=" + w->handle,
                 "--bias=" + b->handle, "--block_rows=7", connections});
    ASSERT_EQ(eval.exit_code, 0) << eval.err;
    EXPECT_NEAR(Field(eval.out, "loss"), want->forward.loss,
                1e-6 * want->forward.loss)
        << eval.out;
    EXPECT_EQ(Field(eval.out, "tokens"), kRows - 1);
  }
  CommandResult bf16 = Lossctl({"eval", hidden_path, targets_path_,
                                "--weight=" + w->handle, "--dtype=bf16"});
  EXPECT_NE(bf16.exit_code, 0);
  EXPECT_THAT(bf16.err, HasSubstr("INVALID_ARGUMENT"));
  EXPECT_THAT(bf16.err, HasSubstr("header.logits_dtype is DTYPE_BFLOAT16"));
  CommandResult bias_only =
      Lossctl({"eval", hidden_path, targets_path_, "--bias=" + b->handle});
  EXPECT_NE(bias_only.exit_code, 0);
  EXPECT_THAT(bias_only.err, HasSubstr("bias is set but weight is not"));
}

TEST_F(LossctlTest, PerTokenBackwardFromNpy) {
  const std::string handle = UploadHandle({logits_path_});
  CommandResult fwd =
      Lossctl({"forward", handle, targets_path_, "--reduction=none",
               "--mode=out_of_place", "--gradient_label=g"});
  ASSERT_EQ(fwd.exit_code, 0) << fwd.err;
  const std::string marker = "gradient ";
  const std::size_t at = fwd.out.find(marker);
  ASSERT_NE(at, std::string::npos) << fwd.out;
  const std::string gradient(
      absl::StripAsciiWhitespace(fwd.out.substr(at + marker.size())));
  ASSERT_NE(gradient, handle);

  std::vector<float> factors(kRows);
  for (int64_t r = 0; r < kRows; ++r) factors[r] = 0.5f + r;
  const std::string factors_path = dir_.File("factors.npy");
  ASSERT_TRUE(WriteNpy(factors_path, DType::kFloat32, {kRows}, factors.data(),
                       factors.size() * sizeof(float))
                  .ok());
  CommandResult back =
      Lossctl({"backward", gradient, "--grad_output=" + factors_path});
  ASSERT_EQ(back.exit_code, 0) << back.err;
  EXPECT_THAT(back.out, HasSubstr("(per-token)"));
  absl::StatusOr<TensorInfo> info = client_->Describe(gradient);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->pending_token_scale);
  EXPECT_EQ(info->label, "g");

  // A count that is not N is refused by the server, named by lossctl.
  ASSERT_TRUE(
      WriteNpy(factors_path, DType::kFloat32, {3}, factors.data(), 12).ok());
  CommandResult bad =
      Lossctl({"backward", gradient, "--grad_output=" + factors_path});
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.err, HasSubstr("INVALID_ARGUMENT"));
}

TEST_F(LossctlTest, UploadAsBf16AndDownloadRoundTrip) {
  const std::string exact = UploadHandle({logits_path_});
  const std::string out = dir_.File("same.npy");
  CommandResult down = Lossctl({"download", exact, out});
  ASSERT_EQ(down.exit_code, 0) << down.err;
  absl::StatusOr<std::unique_ptr<NpyFile>> same = NpyFile::Open(out);
  ASSERT_TRUE(same.ok());
  ASSERT_EQ((*same)->data_bytes(), logits_.size() * sizeof(float));
  EXPECT_EQ(std::memcmp((*same)->data(), logits_.data(), logits_.size() * 4),
            0);

  const std::string handle = UploadHandle({logits_path_, "--dtype=bf16"});
  absl::StatusOr<TensorInfo> info = client_->Describe(handle);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->dtype, DType::kBFloat16);
  // A bf16 download is stored as exact float32 (numpy has no bf16).
  const std::string widened = dir_.File("bf16.npy");
  down = Lossctl({"download", handle, widened});
  ASSERT_EQ(down.exit_code, 0) << down.err;
  absl::StatusOr<std::unique_ptr<NpyFile>> file = NpyFile::Open(widened);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->header().dtype, DType::kFloat32);
  const float* values = reinterpret_cast<const float*>((*file)->data());
  for (std::size_t i = 0; i < logits_.size(); ++i) {
    ASSERT_EQ(values[i], BF16ToFloat(FloatToBF16(logits_[i]))) << i;
  }
}

// A tensor of at least --stripe_min_bytes goes over the server's data
// connection (--data_connection, on by default) or, turned off, as gRPC
// stripes: the bytes arrive unchanged either way.
TEST_F(LossctlTest, UploadOverDataConnectionOrStripes) {
  for (const char* flag : {"--data_connection", "--data_connection=false",
                           "--nodata_connection"}) {
    SCOPED_TRACE(flag);
    const std::string handle =
        UploadHandle({logits_path_, "--stripe_min_bytes=1", flag});
    ASSERT_FALSE(handle.empty());
    absl::StatusOr<DownloadedTensor> got = client_->Download(handle);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->data.size(), logits_.size() * sizeof(float));
    EXPECT_EQ(std::memcmp(got->data.data(), logits_.data(), got->data.size()),
              0);
    ASSERT_TRUE(client_->Release(handle).ok());
  }
}

// upload --overwrite=HANDLE replaces a stored tensor's contents from a .npy
// or .safetensors file over each transport an upload of its size takes; the
// handle printed is HANDLE, and nothing new is stored.
TEST_F(LossctlTest, UploadOverwriteReplacesInPlace) {
  const std::string handle = UploadHandle({logits_path_, "--label=head"});
  ASSERT_FALSE(handle.empty());
  std::vector<float> updated(logits_.size());
  for (std::size_t i = 0; i < updated.size(); ++i) {
    updated[i] = logits_[i] * 0.5f + 1.0f;
  }
  const std::string npy = dir_.File("updated.npy");
  ASSERT_TRUE(WriteNpy(npy, DType::kFloat32, {kRows, kVocab}, updated.data(),
                       updated.size() * sizeof(float))
                  .ok());
  auto expect_contents = [&](const std::vector<float>& want) {
    absl::StatusOr<DownloadedTensor> got = client_->Download(handle);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->data.size(), want.size() * sizeof(float));
    EXPECT_EQ(std::memcmp(got->data.data(), want.data(), got->data.size()), 0);
    absl::StatusOr<TensorInfo> info = client_->Describe(handle);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->label, "head");
  };
  for (const std::vector<std::string>& transport :
       std::vector<std::vector<std::string>>{
           {},
           {"--stripe_min_bytes=1", "--data_connection"},
           {"--stripe_min_bytes=1", "--nodata_connection"}}) {
    SCOPED_TRACE(absl::StrJoin(transport, " "));
    std::vector<std::string> args = {"upload", npy, "--overwrite=" + handle};
    args.insert(args.end(), transport.begin(), transport.end());
    CommandResult over = Lossctl(args);
    ASSERT_EQ(over.exit_code, 0) << over.err;
    EXPECT_EQ(absl::StripAsciiWhitespace(over.out), handle);
    expect_contents(updated);
    // Back to the first contents, for the next transport to change.
    args[1] = logits_path_;
    ASSERT_EQ(Lossctl(args).exit_code, 0);
    expect_contents(logits_);
  }

  // From a safetensors file.
  absl::StatusOr<std::string> header =
      EncodeSafetensorsHeader("w", DType::kFloat32, {kRows, kVocab});
  ASSERT_TRUE(header.ok()) << header.status();
  const std::string safetensors = dir_.File("updated.safetensors");
  {
    std::ofstream file(safetensors, std::ios::binary);
    file << *header;
    file.write(reinterpret_cast<const char*>(updated.data()),
               updated.size() * sizeof(float));
  }
  CommandResult from_safetensors =
      Lossctl({"upload", safetensors + ":w", "--overwrite=" + handle});
  ASSERT_EQ(from_safetensors.exit_code, 0) << from_safetensors.err;
  expect_contents(updated);

  // Refused, nothing changed: another dtype, an unknown handle, a flag that
  // names what the overwritten tensor keeps.
  CommandResult other_dtype = Lossctl(
      {"upload", logits_path_, "--dtype=bf16", "--overwrite=" + handle});
  EXPECT_EQ(other_dtype.exit_code, 1);
  EXPECT_THAT(other_dtype.err, HasSubstr("INVALID_ARGUMENT"));
  CommandResult unknown =
      Lossctl({"upload", logits_path_,
               "--overwrite=00000000-0123456789abcdef0123456789abcdef"});
  EXPECT_EQ(unknown.exit_code, 1);
  EXPECT_THAT(unknown.err, HasSubstr("NOT_FOUND"));
  CommandResult labelled = Lossctl(
      {"upload", logits_path_, "--overwrite=" + handle, "--label=other"});
  EXPECT_EQ(labelled.exit_code, 2);
  EXPECT_THAT(labelled.err, HasSubstr("--label=other does not go with "
                                      "--overwrite"));
  expect_contents(updated);
  absl::StatusOr<ListResult> listed = client_->List();
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->tensors.size(), 1u);
}

TEST_F(LossctlTest, ErrorsAreNamedAndExitNonZero) {
  CommandResult unknown = Lossctl({"frobnicate"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_THAT(unknown.err, HasSubstr("unknown command"));
  CommandResult missing = Lossctl({"upload", dir_.File("missing.npy")});
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_THAT(missing.err, HasSubstr("NOT_FOUND"));
  CommandResult bad = Lossctl({"describe-nothing"});
  EXPECT_NE(bad.exit_code, 0);
  CommandResult no_handle =
      Lossctl({"download", "00000000-0123456789abcdef0123456789abcdef",
               dir_.File("x.npy")});
  EXPECT_EQ(no_handle.exit_code, 1);
  EXPECT_THAT(no_handle.err, HasSubstr("NOT_FOUND"));
  // Targets of the wrong length for the logits.
  const std::string short_targets = dir_.File("short.npy");
  ASSERT_TRUE(
      WriteNpy(short_targets, DType::kInt64, {3}, targets_.data(), 24).ok());
  CommandResult mismatch = Lossctl({"eval", logits_path_, short_targets});
  EXPECT_EQ(mismatch.exit_code, 1);
  EXPECT_THAT(mismatch.err, HasSubstr("INVALID_ARGUMENT"));
  CommandResult bad_reduction =
      Lossctl({"eval", logits_path_, targets_path_, "--reduction=median"});
  EXPECT_EQ(bad_reduction.exit_code, 2);
  CommandResult bad_wait = Lossctl({"info", "--connect_wait=-1s"});
  EXPECT_EQ(bad_wait.exit_code, 2);
  EXPECT_THAT(bad_wait.err, HasSubstr("--connect_wait"));
}

// The line of `out` that starts with `key` and a space.
std::string LineOf(const std::string& out, const std::string& key) {
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (absl::StartsWith(line, key + " ")) return std::string(line);
  }
  ADD_FAILURE() << "no line '" << key << " ...' in: " << out;
  return "";
}

// A top-k teacher's JSD (beta 0.3, tau 2) with the tail bucket, as the
// flags --top_k_tail=bucket --divergence=jsd --beta=0.3 --temperature=2 say.
DistillationOptions TopKJsd(int64_t k, const std::vector<int32_t>& indices,
                            const std::vector<float>& logprobs) {
  DistillationOptions distillation;
  distillation.top_k = k;
  distillation.top_k_indices = LossInput::Inline(indices);
  distillation.top_k_logprobs = LossInput::Inline(logprobs);
  distillation.tail = TopKTail::kBucket;
  distillation.divergence = Divergence::kJsd;
  distillation.beta = 0.3f;
  distillation.temperature = 2.0f;
  return distillation;
}

SegmentOptions Segments(const std::vector<int32_t>& ids, int64_t count) {
  SegmentOptions segments;
  segments.ids = LossInput::Inline(ids);
  segments.count = count;
  return segments;
}

// forward's post-training flags: a top-k teacher and segment ids from .npy
// files, then a PPO loss with an advantages file and old logprobs by handle;
// what lossctl prints is what lossd::Client gets for the same request.
TEST_F(LossctlTest, ForwardPostTrainingFlagsMatchTheClient) {
  constexpr int64_t kTopK = 3;
  std::vector<int32_t> indices(kRows * kTopK), ids(kRows);
  std::vector<float> logprobs(kRows * kTopK), advantages(kRows),
      old_logprobs(kRows);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kTopK; ++j) {
      indices[r * kTopK + j] = static_cast<int32_t>((r + 7 * j) % kVocab);
      logprobs[r * kTopK + j] = -1.5f - j;
    }
    ids[r] = static_cast<int32_t>(r / 16);
    advantages[r] = (r % 3) - 1.0f;
    old_logprobs[r] = -5.0f - 0.01f * r;
  }
  const std::string indices_path =
      WriteRowsFile("indices.npy", {kRows, kTopK}, indices);
  const std::string logprobs_path =
      WriteRowsFile("logprobs.npy", {kRows, kTopK}, logprobs);
  const std::string ids_path = WriteRowsFile("ids.npy", {kRows}, ids);
  const std::string advantages_path =
      WriteRowsFile("advantages.npy", {kRows}, advantages);
  const std::string handle = UploadHandle({logits_path_});

  CommandResult distill =
      Lossctl({"forward", handle, "none", "--mode=none",
               "--teacher_indices=" + indices_path,
               "--teacher_logprobs=" + logprobs_path, "--top_k_tail=bucket",
               "--divergence=jsd", "--beta=0.3", "--temperature=2",
               "--segments=" + ids_path, "--num_segments=4"});
  ASSERT_EQ(distill.exit_code, 0) << distill.err;
  ForwardOptions options;
  options.mode = GradientMode::kNone;
  options.distillation = TopKJsd(kTopK, indices, logprobs);
  options.segments = Segments(ids, 4);
  absl::StatusOr<ForwardResult> want =
      client_->Forward(handle, Targets(), options);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(Field(distill.out, "loss"), want->loss);
  EXPECT_EQ(
      Field(LineOf(distill.out, "distillation_loss"), "distillation_loss"),
      want->distillation_loss);
  for (int s = 0; s < 4; ++s) {
    const std::string line =
        LineOf(distill.out, absl::StrCat("segment ", s, " loss"));
    EXPECT_EQ(line,
              absl::StrFormat("segment %d loss %.17g tokens %d", s,
                              want->segment_loss[s], want->segment_tokens[s]));
  }

  // eval streams the same teacher and segment ids from the files, beside
  // the logits and targets: the numbers of a Forward of all rows; over data
  // connections the same lines as over the stream.
  auto eval_over = [&](const char* transport) {
    return Lossctl({"eval", logits_path_, targets_path_, "--block_rows=5",
                    "--teacher_indices=" + indices_path,
                    "--teacher_logprobs=" + logprobs_path,
                    "--top_k_tail=bucket", "--divergence=jsd", "--beta=0.3",
                    "--temperature=2", "--segments=" + ids_path,
                    "--num_segments=4", transport});
  };
  CommandResult eval = eval_over("--data_connection=false");
  ASSERT_EQ(eval.exit_code, 0) << eval.err;
  CommandResult over_data = eval_over("--stripe_min_bytes=1");
  ASSERT_EQ(over_data.exit_code, 0) << over_data.err;
  EXPECT_EQ(over_data.out, eval.out);
  want = client_->Forward(
      handle, Targets::Inline(DType::kInt64, targets_.data(), kRows * 8),
      options);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_NEAR(Field(eval.out, "loss"), want->loss, 1e-10 * want->loss);
  EXPECT_NEAR(Field(LineOf(eval.out, "distillation_loss"), "distillation_loss"),
              want->distillation_loss, 1e-12 * want->distillation_loss);
  for (int s = 0; s < 4; ++s) {
    const std::string line =
        LineOf(eval.out, absl::StrCat("segment ", s, " loss"));
    EXPECT_NEAR(Field(line, "loss"), want->segment_loss[s],
                1e-12 * want->segment_loss[s]);
    EXPECT_EQ(Field(line, "tokens"), want->segment_tokens[s]);
  }
  // Without targets ("none", alpha 0) eval gives forward's numbers, and the
  // same lines over the stream and over data connections.
  std::vector<std::string> no_targets_out;
  for (const char* transport :
       {"--data_connection=false", "--stripe_min_bytes=1"}) {
    CommandResult no_targets =
        Lossctl({"eval", logits_path_, "none", "--block_rows=5",
                 "--teacher_indices=" + indices_path,
                 "--teacher_logprobs=" + logprobs_path, "--top_k_tail=bucket",
                 "--divergence=jsd", "--beta=0.3", "--temperature=2",
                 "--segments=" + ids_path, "--num_segments=4", transport});
    ASSERT_EQ(no_targets.exit_code, 0) << transport << ": " << no_targets.err;
    EXPECT_NEAR(Field(no_targets.out, "loss"), Field(distill.out, "loss"),
                1e-10 * std::abs(Field(distill.out, "loss")))
        << transport;
    no_targets_out.push_back(no_targets.out);
  }
  EXPECT_EQ(no_targets_out[0], no_targets_out[1]);

  absl::StatusOr<TensorInfo> old_handle =
      client_->Upload(DType::kFloat32, {kRows}, old_logprobs.data(), kRows * 4);
  ASSERT_TRUE(old_handle.ok()) << old_handle.status();
  CommandResult ppo =
      Lossctl({"forward", handle, targets_path_, "--mode=none",
               "--policy_loss=ppo", "--advantages=" + advantages_path,
               "--old_logprobs=" + old_handle->handle, "--epsilon_high=0.3",
               "--token_logprob", "--token_ratio"});
  ASSERT_EQ(ppo.exit_code, 0) << ppo.err;
  ForwardOptions policy_options;
  policy_options.mode = GradientMode::kNone;
  policy_options.token_logprob = true;
  policy_options.token_ratio = true;
  policy_options.token_clipped = true;
  PolicyGradientOptions policy;
  policy.loss = PolicyLossKind::kPpoClip;
  policy.advantages = LossInput::Inline(advantages);
  policy.sampling_logprobs = LossInput::Handle(old_handle->handle);
  policy.epsilon_high = 0.3f;
  policy_options.policy = policy;
  want = client_->Forward(
      handle, Targets::Inline(DType::kInt64, targets_.data(), kRows * 8),
      policy_options);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(Field(ppo.out, "loss"), want->loss);
  const std::string stats = LineOf(ppo.out, "clipped_tokens");
  EXPECT_EQ(Field(stats, "clipped_tokens"), want->policy_stats.clipped_tokens);
  EXPECT_EQ(Field(stats, "ratio_sum"), want->policy_stats.ratio_sum);
  EXPECT_FLOAT_EQ(Field(LineOf(ppo.out, "row 7 logprob"), "logprob"),
                  want->token_logprob[7]);
  ASSERT_EQ(want->token_ratio.size(), static_cast<std::size_t>(kRows));
  ASSERT_EQ(want->token_clipped.size(), static_cast<std::size_t>(kRows));
  int64_t clipped = 0;
  for (int r = 0; r < kRows; ++r) {
    const std::string line = LineOf(ppo.out, absl::StrCat("row ", r, " ratio"));
    EXPECT_FLOAT_EQ(Field(line, "ratio"), want->token_ratio[r]) << r;
    EXPECT_EQ(Field(line, "clipped"), want->token_clipped[r] ? 1 : 0) << r;
    clipped += want->token_clipped[r];
  }
  EXPECT_EQ(clipped, want->policy_stats.clipped_tokens);

  // eval streams the policy's inputs from files beside the logits: the same
  // loss and statistics over blocks.
  const std::string old_path = dir_.File("old_logprobs.npy");
  ASSERT_TRUE(WriteNpy(old_path, DType::kFloat32, {kRows}, old_logprobs.data(),
                       kRows * 4)
                  .ok());
  CommandResult ppo_eval =
      Lossctl({"eval", logits_path_, targets_path_, "--block_rows=5",
               "--policy_loss=ppo", "--advantages=" + advantages_path,
               "--old_logprobs=" + old_path, "--epsilon_high=0.3"});
  ASSERT_EQ(ppo_eval.exit_code, 0) << ppo_eval.err;
  EXPECT_NEAR(Field(ppo_eval.out, "loss"), want->loss,
              1e-10 * std::abs(want->loss));
  const std::string eval_stats = LineOf(ppo_eval.out, "clipped_tokens");
  EXPECT_EQ(Field(eval_stats, "clipped_tokens"),
            want->policy_stats.clipped_tokens);
  EXPECT_NEAR(Field(eval_stats, "ratio_sum"), want->policy_stats.ratio_sum,
              1e-10 * want->policy_stats.ratio_sum);

  // The same PPO loss through `lossctl linear` on X = I and W = the logits'
  // transpose (Z is then the logits exactly).
  std::vector<float> identity(kRows * kRows, 0.0f), weight(kVocab * kRows);
  for (int64_t r = 0; r < kRows; ++r) {
    identity[r * kRows + r] = 1.0f;
    for (int64_t v = 0; v < kVocab; ++v) {
      weight[v * kRows + r] = logits_[r * kVocab + v];
    }
  }
  absl::StatusOr<TensorInfo> hidden = client_->Upload(
      DType::kFloat32, {kRows, kRows}, identity.data(), identity.size() * 4);
  absl::StatusOr<TensorInfo> head = client_->Upload(
      DType::kFloat32, {kVocab, kRows}, weight.data(), weight.size() * 4);
  ASSERT_TRUE(hidden.ok() && head.ok());
  CommandResult linear =
      Lossctl({"linear", hidden->handle, head->handle, targets_path_,
               "--mode=none", "--accumulate=none", "--policy_loss=ppo",
               "--advantages=" + advantages_path,
               "--old_logprobs=" + old_handle->handle, "--epsilon_high=0.3",
               "--token_ratio"});
  ASSERT_EQ(linear.exit_code, 0) << linear.err;
  EXPECT_EQ(Field(linear.out, "loss"), want->loss);
  EXPECT_EQ(Field(LineOf(linear.out, "clipped_tokens"), "clipped_tokens"),
            want->policy_stats.clipped_tokens);
  EXPECT_FLOAT_EQ(Field(LineOf(linear.out, "row 5 ratio"), "ratio"),
                  want->token_ratio[5]);

  CommandResult bad = Lossctl({"forward", handle, targets_path_,
                               "--policy_loss=grpo", "--advantages=x"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr("--policy_loss=grpo"));
}

// lossctl eval --weight with the post-training flags: hidden states from a
// file against the stored head give LinearForward's numbers in mode NONE
// (docs/api.md, "In Evaluate"), over the stream and over data connections: a
// top-k distillation with segments, then a PPO loss.
TEST_F(LossctlTest, EvalWithAWeightTakesThePostTrainingFlags) {
  constexpr int64_t kWidth = 8;
  constexpr int64_t kTopK = 3;
  std::vector<float> hidden(kRows * kWidth), weight(kVocab * kWidth);
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = 0.05f * (i % 37);
  for (size_t i = 0; i < weight.size(); ++i)
    weight[i] = 0.04f * (i % 29) - 0.5f;
  std::vector<int32_t> indices(kRows * kTopK), ids(kRows);
  std::vector<float> logprobs(kRows * kTopK), advantages(kRows),
      old_logprobs(kRows);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t j = 0; j < kTopK; ++j) {
      indices[r * kTopK + j] = static_cast<int32_t>((3 * r + 11 * j) % kVocab);
      logprobs[r * kTopK + j] = -1.2f - 0.5f * j;
    }
    ids[r] = static_cast<int32_t>(r / 20);
    advantages[r] = (r % 5) * 0.5f - 1.0f;
    old_logprobs[r] = -5.5f + 0.02f * r;
  }
  const std::string hidden_path =
      WriteRowsFile("pt-hidden.npy", {kRows, kWidth}, hidden);
  const std::string indices_path =
      WriteRowsFile("pt-indices.npy", {kRows, kTopK}, indices);
  const std::string logprobs_path =
      WriteRowsFile("pt-logprobs.npy", {kRows, kTopK}, logprobs);
  const std::string ids_path = WriteRowsFile("pt-ids.npy", {kRows}, ids);
  const std::string advantages_path =
      WriteRowsFile("pt-advantages.npy", {kRows}, advantages);
  const std::string old_path =
      WriteRowsFile("pt-old.npy", {kRows}, old_logprobs);
  absl::StatusOr<TensorInfo> w = client_->Upload(
      DType::kFloat32, {kVocab, kWidth}, weight.data(), weight.size() * 4);
  absl::StatusOr<TensorInfo> x = client_->Upload(
      DType::kFloat32, {kRows, kWidth}, hidden.data(), hidden.size() * 4);
  ASSERT_TRUE(w.ok() && x.ok());
  const Targets targets =
      Targets::Inline(DType::kInt64, targets_.data(), targets_.size() * 8);

  LinearForwardOptions options;
  options.mode = GradientMode::kNone;
  options.distillation = TopKJsd(kTopK, indices, logprobs);
  options.distillation->alpha = 0.25f;
  options.segments = Segments(ids, 4);
  absl::StatusOr<LinearForwardResult> want =
      client_->LinearForward(x->handle, w->handle, targets, options);
  ASSERT_TRUE(want.ok()) << want.status();
  const ForwardResult& kd = want->forward;
  for (const char* transport :
       {"--stripe_min_bytes=67108864", "--stripe_min_bytes=1"}) {
    SCOPED_TRACE(transport);
    CommandResult eval = Lossctl(
        {"eval", hidden_path, targets_path_, "--weight=" + w->handle,
         "--block_rows=5", "--teacher_indices=" + indices_path,
         "--teacher_logprobs=" + logprobs_path, "--top_k_tail=bucket",
         "--divergence=jsd", "--beta=0.3", "--temperature=2", "--alpha=0.25",
         "--segments=" + ids_path, "--num_segments=4", transport});
    ASSERT_EQ(eval.exit_code, 0) << eval.err;
    EXPECT_NEAR(Field(eval.out, "loss"), kd.loss, 1e-6 * std::abs(kd.loss))
        << eval.out;
    EXPECT_NEAR(
        Field(LineOf(eval.out, "distillation_loss"), "distillation_loss"),
        kd.distillation_loss, 1e-6 * std::abs(kd.distillation_loss));
    for (int s = 0; s < 4; ++s) {
      const std::string line =
          LineOf(eval.out, absl::StrCat("segment ", s, " loss"));
      EXPECT_NEAR(Field(line, "loss"), kd.segment_loss[s],
                  1e-6 * std::abs(kd.segment_loss[s]))
          << line;
      EXPECT_EQ(Field(line, "tokens"), kd.segment_tokens[s]) << line;
    }
  }

  LinearForwardOptions ppo_options;
  ppo_options.mode = GradientMode::kNone;
  PolicyGradientOptions policy;
  policy.loss = PolicyLossKind::kPpoClip;
  policy.advantages = LossInput::Inline(advantages);
  policy.sampling_logprobs = LossInput::Inline(old_logprobs);
  policy.epsilon_high = 0.3f;
  ppo_options.policy = policy;
  want = client_->LinearForward(x->handle, w->handle, targets, ppo_options);
  ASSERT_TRUE(want.ok()) << want.status();
  const ForwardResult& ppo = want->forward;
  for (const char* transport :
       {"--stripe_min_bytes=67108864", "--stripe_min_bytes=1"}) {
    SCOPED_TRACE(transport);
    CommandResult eval = Lossctl(
        {"eval", hidden_path, targets_path_, "--weight=" + w->handle,
         "--block_rows=5", "--policy_loss=ppo",
         "--advantages=" + advantages_path, "--old_logprobs=" + old_path,
         "--epsilon_high=0.3", transport});
    ASSERT_EQ(eval.exit_code, 0) << eval.err;
    EXPECT_NEAR(Field(eval.out, "loss"), ppo.loss, 1e-6 * std::abs(ppo.loss))
        << eval.out;
    const std::string stats = LineOf(eval.out, "clipped_tokens");
    EXPECT_EQ(Field(stats, "clipped_tokens"), ppo.policy_stats.clipped_tokens)
        << stats;
    EXPECT_NEAR(Field(stats, "ratio_sum"), ppo.policy_stats.ratio_sum,
                1e-6 * ppo.policy_stats.ratio_sum)
        << stats;
  }
}

// --connect_wait: how long a command waits for a server that is down.
TEST_F(LossctlTest, ConnectWaitBoundsTheWaitForADownServer) {
  ASSERT_TRUE(server_->Stop().ok());
  for (const char* wait : {"0", "2s"}) {
    SCOPED_TRACE(wait);
    const absl::Time start = absl::Now();
    CommandResult down =
        Lossctl({"info", absl::StrCat("--connect_wait=", wait)});
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(down.exit_code, 1);
    EXPECT_THAT(down.err, HasSubstr("UNAVAILABLE"));
    if (std::string(wait) == "0") {
      EXPECT_LT(took, absl::Seconds(1.5));
    } else {
      EXPECT_GE(took, absl::Seconds(2));
    }
  }
}

}  // namespace
}  // namespace lossd
