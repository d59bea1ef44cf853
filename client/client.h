// lossd::Client: the C++ client library of the lossd.v1 API. Plain C++ types
// and absl::Status only, so callers never include gRPC or protobuf headers;
// uploads and downloads are chunked so no message comes near the size limits.
#ifndef LOSSD_CLIENT_CLIENT_H_
#define LOSSD_CLIENT_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/loss_options.h"
#include "common/post_training_options.h"

namespace lossd {

namespace v1 {
class TensorHeader;  // lossd.v1's, kept out of this header
}  // namespace v1

// The gRPC service name of lossd; Health(kLossdService) asks for readiness.
inline constexpr char kLossdService[] = "lossd.v1.Lossd";

struct ClientOptions {
  // Bytes of tensor data per Upload / Evaluate message and the chunk size
  // asked of the server on Download. 1 MiB keeps each message far below the
  // limits while amortising per-message costs.
  std::size_t chunk_bytes = 1 << 20;
  // Send and receive limit of the channel (gRPC's default is 4 MiB receive).
  int max_message_bytes = 64 << 20;
  // Deadline of each call, counted from its start; infinite = none.
  absl::Duration deadline = absl::InfiniteDuration();
  // A call made while the connection is not up first waits up to this long
  // (and within `deadline`) for it to come up, through reconnect attempts
  // 100 ms apart at first. So a connection attempt that fails once does not
  // fail the call (gRPC 1.51 can report an attempt on loopback as failed with
  // a stale errno, "No such file or directory"); a server that stays
  // unreachable gives UNAVAILABLE after this wait. Zero = gRPC's fail-fast.
  absl::Duration connect_wait = absl::Seconds(1);
  // Sent as "authorization: Bearer <token>" when not empty (checked by a
  // server started with --tokens_file).
  std::string bearer_token;
  // TLS: on when `tls` is true or any file below is set. PEM files: the CA
  // that signed the server's certificate (empty = the system roots), and for
  // mutual TLS the client's certificate chain and key (both or neither).
  bool tls = false;
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // Overrides the name the server certificate is checked against (tests,
  // or addresses the certificate does not list); empty = the target's host.
  std::string tls_server_name;
  // Data connections: a tensor of at least stripe_min_bytes bytes goes over
  // upload_streams plain TCP connections to the server's data port
  // (ServerInfo.data_port), straight into the server's pinned memory with no
  // gRPC in between, when the server offers one and the channel has no TLS
  // (the data connection has none of its own). Otherwise, or when that port
  // cannot be reached (this Client then stops trying), the tensor is striped
  // as below. Downloads of that size come back over them, and an Evaluate of
  // known size of at least stripe_min_bytes of logits sends its blocks
  // over them.
  bool data_connection = true;
  // Striped upload: a tensor of at least stripe_min_bytes bytes is sent as
  // upload_streams stripes (lossd.v1.UploadStripe), each over its own TCP
  // connection, because one gRPC stream is capped below what the network
  // carries. 1 = always one stream. In [1, 64]. Every connection resolves the
  // same target, so it must name one lossd instance (as a Client's handles
  // already require; lossd::RoutingClient spreads over several).
  int upload_streams = 4;
  std::size_t stripe_min_bytes = std::size_t{64} << 20;
  // Piece size of UploadFrom and DownloadTo: the most bytes one call of an
  // UploadSource or DownloadSink covers, and the size of each of the
  // client's scratch buffers (two per connection, kept for the Client's
  // life). In [64 KiB, 1 GiB].
  std::size_t piece_bytes = std::size_t{8} << 20;
  // A Forward, LinearForward or Evaluate with a post-training loss or output
  // first checks that the server lists "post_training" in
  // ServerInfo.features (asked once per Client, with the first such call),
  // and fails FAILED_PRECONDITION before sending anything when it does not:
  // an older server would skip those fields and answer plain cross entropy.
  // false skips the check, e.g. for a server built with post-training losses
  // but before the features list (docs/api.md, "Server features").
  bool check_server_features = true;
};

// Metadata of a stored tensor (lossd.v1.TensorInfo).
struct TensorInfo {
  std::string handle;
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  int64_t bytes = 0;
  std::string device;  // "cpu", "cuda:0", ...
  TensorState state = TensorState::kUnspecified;
  std::string tenant;
  std::string label;
  absl::Time created = absl::InfinitePast();
  absl::Time last_used = absl::InfinitePast();
  double pending_scale = 1.0;        // grad_output recorded by Backward
  bool pending_token_scale = false;  // per-token grad_output recorded
};

// Identity and memory of a server instance (lossd.v1.ServerInfo).
struct ServerInfo {
  std::string instance_id;
  std::string device;
  int64_t budget_bytes = 0;
  int64_t used_bytes = 0;
  int64_t free_bytes = 0;
  int64_t tensors = 0;
  std::string version;
  int data_port = 0;  // the data-connection port; 0 = none
  // What the server serves beyond the first protocol
  // (common/server_features.h); empty from a server built before the list.
  std::vector<std::string> features;
};

// Tensors per List RPC that Client::List asks for: the server's largest page
// (lossd.v1.ListRequest.page_size).
inline constexpr int kListPageSize = 1000;

struct ListResult {
  std::vector<TensorInfo> tensors;
  ServerInfo server;
};

struct DownloadedTensor {
  TensorInfo info;  // dtype and bytes are those sent (after conversion)
  std::vector<uint8_t> data;
};

// A small input of a post-training loss ([N] or [N, k]): a stored tensor, or
// bytes sent inline with the request (which must stay below
// ClientOptions::max_message_bytes: upload larger ones and name them).
// Inline() does not copy: `data` must outlive the call. A default-constructed
// one is unset.
struct LossInput {
  static LossInput Handle(std::string handle) {
    LossInput t;
    t.handle = std::move(handle);
    return t;
  }
  static LossInput Inline(DType dtype, const void* data, std::size_t bytes) {
    LossInput t;
    t.inline_dtype = dtype;
    t.inline_data = data;
    t.inline_bytes = bytes;
    return t;
  }
  static LossInput Inline(absl::Span<const float> values) {
    return Inline(DType::kFloat32, values.data(),
                  values.size() * sizeof(float));
  }
  static LossInput Inline(absl::Span<const int32_t> values) {
    return Inline(DType::kInt32, values.data(),
                  values.size() * sizeof(int32_t));
  }
  static LossInput Inline(absl::Span<const int64_t> values) {
    return Inline(DType::kInt64, values.data(),
                  values.size() * sizeof(int64_t));
  }
  bool set() const {
    return !handle.empty() || inline_dtype != DType::kInvalid;
  }
  std::string handle;  // used when not empty
  DType inline_dtype = DType::kInvalid;
  const void* inline_data = nullptr;
  std::size_t inline_bytes = 0;
};

// Knowledge distillation (lossd.v1.Distillation; docs/api.md,
// "Distillation"): loss_i = alpha CE(z_i, y_i) + (1 - alpha) D(q_i, p_i) with
// p_i = softmax(z_i / temperature). The teacher is either dense
// (teacher_logits, a stored [N, V] float tensor) or top-k (top_k_indices
// [N, k] int32/int64 and top_k_logprobs [N, k] fp32, by handle or inline).
// In Evaluate the teacher comes in the row blocks instead: set
// evaluate_teacher_dtype (dense rows) or top_k (with top_k_indices_dtype).
struct DistillationOptions {
  std::string teacher_logits;  // handle of the dense teacher; empty = top-k
  // k of the top-k teacher; 0 = from a handle's shape (required inline).
  int32_t top_k = 0;
  LossInput top_k_indices;
  LossInput top_k_logprobs;
  TopKTail tail = TopKTail::kRenormalize;
  float temperature = 1.0f;  // > 0
  float alpha = 0.0f;        // weight of the cross entropy, in [0, 1]
  Divergence divergence = Divergence::kForwardKl;
  float beta = 0.0f;  // kJsd only, in [0, 1]
  // Evaluate only: the dtype of the dense teacher rows in the blocks
  // (kInvalid = a top-k teacher) and of the top-k indices there.
  DType evaluate_teacher_dtype = DType::kInvalid;
  DType top_k_indices_dtype = DType::kInt32;
};

// A per-token policy-gradient loss on the sampled tokens, the targets
// (lossd.v1.PolicyGradient; docs/api.md, "Policy-gradient losses"). Each
// tensor is fp32 [N].
struct PolicyGradientOptions {
  PolicyLossKind loss = PolicyLossKind::kPpoClip;
  LossInput advantages;
  LossInput sampling_logprobs;
  float epsilon_low = 0.2f;           // in [0, 1)
  std::optional<float> epsilon_high;  // unset = epsilon_low
  LossInput reference_logprobs;       // unset = no KL term
  float kl_coef = 0.0f;               // >= 0; > 0 needs reference_logprobs
  KlEstimator kl_estimator = KlEstimator::kK3;
  // Evaluate only (the inputs come in the row blocks, the LossInputs unset):
  // whether every block carries reference_logprobs.
  bool evaluate_reference_logprobs = false;
};

// Packed sequences (lossd.v1.Segments; docs/api.md, "Segments"): ids [N]
// int32 in [0, count). In Evaluate the ids come in the row blocks (`ids`
// unset there).
struct SegmentOptions {
  LossInput ids;
  int32_t count = 0;
  // kNone: the options' reduction over tokens; otherwise the mean over
  // segments of each one's token mean or token sum (needs Reduction::kMean).
  SegmentReduction reduction = SegmentReduction::kNone;
};

// Options of Forward: the loss options of the kernel contract plus what only
// the service knows (handles, mode, outputs), and the post-training losses
// (at most one of distillation and policy; segments with either or none).
struct ForwardOptions {
  CrossEntropyOptions loss;
  std::string class_weights;  // handle of a fp32 [V] tensor; empty = none
  GradientMode mode = GradientMode::kInPlace;
  bool token_loss = false;
  bool token_lse = false;
  bool token_argmax = false;
  bool token_logprob = false;  // log p(target) per row, 0 for ignored rows
  bool token_entropy = false;  // entropy of softmax(z) per row
  bool token_ratio = false;    // policy: r per row, 0 for ignored rows
  bool token_clipped = false;  // policy: whether each row counts as clipped
  std::string gradient_label;  // label of an out-of-place gradient
  std::optional<DistillationOptions> distillation;
  std::optional<PolicyGradientOptions> policy;
  std::optional<SegmentOptions> segments;
};

// A policy-gradient step's metrics, sums over the valid tokens
// (lossd.v1.PolicyStats): divide by valid_tokens for the means.
struct PolicyStats {
  int64_t clipped_tokens = 0;
  double ratio_sum = 0.0;
  double approx_kl_sum = 0.0;  // sum of sampling_logprob - logp
  double kl_sum = 0.0;         // sum of the reference KL, without kl_coef
  double entropy_sum = 0.0;
};

struct ForwardResult {
  double loss = 0.0;
  double z_loss = 0.0;
  int64_t valid_tokens = 0;
  int64_t correct_tokens = 0;
  int64_t nonfinite_rows = 0;
  // The logits handle for kInPlace, a new handle for kOutOfPlace, empty for
  // kNone.
  std::string gradient;
  std::vector<float> token_loss;
  std::vector<float> token_lse;
  std::vector<int32_t> token_argmax;
  double kernel_seconds = 0.0;
  double denominator = 0.0;
  // The post-training outputs: the divergence term alone (reduced as the
  // loss), the policy metrics, each segment's loss sum and valid tokens, and
  // the per-row outputs asked for.
  double distillation_loss = 0.0;
  PolicyStats policy_stats;
  std::vector<double> segment_loss;
  std::vector<int64_t> segment_tokens;
  std::vector<float> token_logprob;
  std::vector<float> token_entropy;
  std::vector<float> token_ratio;
  std::vector<bool> token_clipped;
};

// How LinearForward's weight (and bias) gradient meets its accumulator.
// Values match lossd.v1.AccumulateMode.
enum class LinearAccumulate : int {
  kDefault = 0,  // kAdd when a gradient is formed, kNone for mode kNone
  kAdd = 1,
  kOverwrite = 2,
  kNone = 3,
};

// How LinearForward's CUDA products treat bf16/fp16 inputs (fp32 inputs and
// the CPU compute the same under both). Values match lossd.v1.LinearPrecision.
enum class LinearForwardPrecision : int {
  kExact = 0,  // dW within ~3e-5 of fp32
  // 16-bit products as the peers compute them: a ~1.1x faster kernel, dW
  // 2e-4 to 2e-3 relative error on mild logits, 2e-2 on peaked ones.
  kFast = 1,
};

// Options of LinearForward: Forward's, plus the bias and the accumulators.
struct LinearForwardOptions {
  CrossEntropyOptions loss;
  std::string class_weights;  // handle of a fp32 [V] tensor; empty = none
  GradientMode mode = GradientMode::kInPlace;  // of dX
  bool token_loss = false;
  bool token_lse = false;
  bool token_argmax = false;
  std::string gradient_label;  // label of an out-of-place dX
  std::string bias;            // handle of a [V] tensor; empty = none
  LinearAccumulate accumulate = LinearAccumulate::kDefault;
  // fp32 accumulators of earlier calls; empty = the server makes them.
  std::string weight_grad;
  std::string bias_grad;
  std::string weight_grad_label;
  std::string bias_grad_label;
  // Reduction kNone with a gradient: the per-row grad_output [N].
  std::vector<float> token_grad_output;
  LinearForwardPrecision precision = LinearForwardPrecision::kExact;
  // A post-training loss on Z = X W^T + b instead of cross entropy, and its
  // per-token outputs, as ForwardOptions' (docs/api.md, "In LinearForward").
  bool token_logprob = false;
  bool token_entropy = false;
  bool token_ratio = false;
  bool token_clipped = false;
  std::optional<DistillationOptions> distillation;
  std::optional<PolicyGradientOptions> policy;
  std::optional<SegmentOptions> segments;
};

struct LinearForwardResult {
  ForwardResult forward;    // `gradient` is dX's handle
  std::string weight_grad;  // the accumulators' handles (empty when none)
  std::string bias_grad;
};

struct BackwardResult {
  TensorInfo tensor;
  bool kernel_launched = false;
};

// The targets of a Forward: a stored int32/int64 [N] tensor, or bytes sent
// inline with the request (for small N). Inline() does not copy: `data` must
// outlive the Forward call. A default-constructed one sends no targets (only a
// distillation with alpha 0 takes none).
struct Targets {
  static Targets Handle(std::string handle) {
    Targets t;
    t.handle = std::move(handle);
    return t;
  }
  static Targets Inline(DType dtype, const void* data, std::size_t bytes) {
    Targets t;
    t.inline_dtype = dtype;
    t.inline_data = data;
    t.inline_bytes = bytes;
    return t;
  }
  std::string handle;  // used when not empty
  DType inline_dtype = DType::kInvalid;
  const void* inline_data = nullptr;
  std::size_t inline_bytes = 0;
};

// Options of Evaluate; reduction kNone is not allowed there.
struct EvaluateOptions {
  CrossEntropyOptions loss;
  std::string class_weights;  // handle of a fp32 [V] tensor; empty = none
  // Set: the rows are hidden states [R, H] against this stored LM head W
  // [V, H] (+ bias [V], of W's dtype; empty = none) instead of logits; the
  // `vocab` argument of Evaluate is then H, and the rows' dtype W's.
  std::string weight;
  std::string bias;
  // Only for progress reports (the second argument); -1 = unknown.
  int64_t total_rows = -1;
  // A distillation whose teacher comes in the blocks (teacher_logits and
  // top_k_indices / top_k_logprobs unset; evaluate_teacher_dtype or top_k
  // set), a policy loss whose per-token inputs come in the blocks (its
  // LossInputs unset; evaluate_reference_logprobs says whether reference
  // logprobs come), and segments whose ids come in the blocks (ids unset;
  // global over the stream). Every block then carries each input these
  // declare (over data connections, in the frame after its targets).
  std::optional<DistillationOptions> distillation;
  std::optional<PolicyGradientOptions> policy;
  std::optional<SegmentOptions> segments;
};

// One block of whole rows for Evaluate: rows * vocab logits of the header's
// dtype and rows targets, little-endian. The strings are moved into the
// request, so a producer can fill them without an extra copy. A producer
// whose rows already lie in memory it keeps unchanged until Evaluate returns
// may instead point the views at them (they are used when logits_view's data
// is not null): over data connections they are sent from there, uncopied.
struct RowBlock {
  std::string logits;
  // None for a distillation with alpha 0: on the stream a block may leave
  // them out under any targets dtype; over data connections every block
  // does so when Evaluate's targets dtype is kInvalid, and none otherwise.
  std::string targets;
  // One entry a row, with EvaluateOptions::distillation / segments: dense
  // teacher rows [R, V] of evaluate_teacher_dtype, or top-k indices [R, k] of
  // top_k_indices_dtype and fp32 logprobs [R, k]; int32 segment ids [R].
  std::string teacher_logits;
  std::string teacher_indices;
  std::string teacher_logprobs;
  std::string segment_ids;
  // With EvaluateOptions::policy: fp32 [R] advantages and sampling logprobs,
  // and reference logprobs when the options say they come.
  std::string advantages;
  std::string sampling_logprobs;
  std::string reference_logprobs;
  absl::string_view logits_view;
  absl::string_view targets_view;

  // The bytes this block carries: the views when set, else the strings.
  absl::string_view Logits() const {
    return logits_view.data() != nullptr ? logits_view : logits;
  }
  absl::string_view Targets() const {
    return logits_view.data() != nullptr ? targets_view : targets;
  }
};

struct EvaluateResult {
  double loss = 0.0;
  double z_loss = 0.0;
  int64_t rows = 0;
  int64_t valid_tokens = 0;
  int64_t correct_tokens = 0;
  int64_t nonfinite_rows = 0;
  double denominator = 0.0;
  double distillation_loss = 0.0;  // as ForwardResult's
  PolicyStats policy_stats;        // as ForwardResult's, over the stream
  std::vector<double> segment_loss;
  std::vector<int64_t> segment_tokens;
};

// Called as work proceeds with (done, total): bytes for Upload / Download,
// rows for Evaluate; total is -1 when unknown. Called on the calling thread,
// or (transfers over data connections) on their threads, one at a time.
using ProgressCallback = std::function<void(int64_t done, int64_t total)>;

// Fills *block with the next block and returns true, or returns false when
// there are no more rows. An error aborts the Evaluate and is returned by it.
// Evaluate calls it on a helper thread, one call at a time, so that producing
// the next block overlaps sending the previous one.
using RowBlockProducer = std::function<absl::StatusOr<bool>(RowBlock* block)>;

// Supplies an upload's bytes piece by piece, for tensors that are not in
// host memory as they are sent (a file to convert, a GPU tensor): nothing of
// full size is copied. source(offset, bytes, scratch) returns a pointer to the
// `bytes` bytes of the tensor that start at byte `offset`: into the caller's
// own memory (unchanged until the upload returns), or `scratch` after filling
// it. `scratch` is a buffer of ClientOptions::piece_bytes bytes owned by the
// Client and reused from call to call (the same few buffers for the Client's
// life, so a caller may register them, e.g. pin them for device copies).
// Pieces hold whole elements and at most piece_bytes. Called concurrently
// from the transfer's threads, each thread in increasing offsets; together
// the calls cover the tensor once. An error aborts the upload, which returns
// it.
using UploadSource = std::function<absl::StatusOr<const void*>(
    int64_t offset, std::size_t bytes, void* scratch)>;

// Receives a download's bytes piece by piece: sink(offset, data, bytes) gets
// the `bytes` bytes of the tensor (as sent, after conversion) that start at
// byte `offset`; `data` is valid during the call only and lies at the start of
// one of the scratch buffers UploadSource describes (so a caller that
// registered them for device copies has them registered here too). Pieces
// hold whole elements and at most ClientOptions::piece_bytes; calls come
// concurrently from the transfer's threads, each thread in increasing
// offsets, and together cover the tensor once. An error aborts the download,
// which returns it.
using DownloadSink = std::function<absl::Status(
    int64_t offset, const void* data, std::size_t bytes)>;

// A connection to one lossd instance. Every method is thread-safe and may be
// called concurrently (each call is its own RPC on a shared channel).
//
// Errors: methods return the server's status with its code and message
// (codes documented per RPC in proto/lossd/v1/lossd.proto), UNAVAILABLE when
// the server cannot be reached, DEADLINE_EXCEEDED when options.deadline
// passes, and INVALID_ARGUMENT for arguments rejected before any RPC.
class Client {
 public:
  // Creates a client for `target` ("host:port" or any gRPC target URI) over a
  // plaintext or (options.tls...) TLS channel. Does not contact the server
  // (channels connect lazily; use Health to check). INVALID_ARGUMENT: empty
  // target, chunk_bytes of 0 or larger than max_message_bytes - 4 KiB,
  // max_message_bytes <= 4 KiB, a negative deadline, upload_streams outside
  // [1, 64], piece_bytes outside [64 KiB, 1 GiB], an unreadable TLS file or
  // a certificate without its key.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(
      std::string target, ClientOptions options = {});

  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const ClientOptions& options() const { return options_; }

  // Uploads `bytes` bytes at `data` as a tensor of `dtype` and `shape`, in
  // chunks of options().chunk_bytes. Success: the stored tensor's metadata.
  // A tensor of at least options().stripe_min_bytes goes as
  // options().upload_streams stripes in parallel, over extra connections made
  // on first use and kept by this Client (same credentials and options).
  // INVALID_ARGUMENT (client side): bytes != product(shape) * size of dtype,
  // or data == nullptr with bytes > 0. Server errors as the Upload RPC (for a
  // striped upload, the first stripe's error that is not ABORTED or
  // CANCELLED by the others' failure). On any error the server keeps nothing.
  // `data` is only read during the call.
  //
  // `idempotency_key` (0-128 chars of [A-Za-z0-9_-], empty = none; see
  // docs/api.md, Idempotency keys) names the upload: calling again with the
  // same key after an error whose outcome was unknown (DEADLINE_EXCEEDED,
  // UNAVAILABLE, a broken connection) returns the tensor the first call
  // stored, if it did, instead of storing a second one (the server may answer
  // before all bytes are sent). ALREADY_EXISTS: the key names a stored tensor
  // of another dtype, shape or label; ABORTED: an upload with the key is
  // still in flight.
  absl::StatusOr<TensorInfo> Upload(DType dtype,
                                    absl::Span<const int64_t> shape,
                                    const void* data, std::size_t bytes,
                                    const std::string& label = "",
                                    const ProgressCallback& progress = nullptr,
                                    const std::string& idempotency_key = "");

  // Uploads a tensor of `dtype` and `shape` whose bytes come from `source`
  // (see UploadSource), with Upload's transport choice: data connections for
  // one of at least stripe_min_bytes when the server offers them, else
  // stripes or one stream. While one piece is sent, the next piece of the
  // same connection is being produced. Errors as Upload, and the source's
  // error; on any error the server keeps nothing. `idempotency_key` as
  // Upload's.
  absl::StatusOr<TensorInfo> UploadFrom(
      DType dtype, absl::Span<const int64_t> shape, const UploadSource& source,
      const std::string& label = "", const ProgressCallback& progress = nullptr,
      const std::string& idempotency_key = "");

  // Downloads a tensor, converted to `as_dtype` (kInvalid = as stored) and
  // with its pending grad_output applied, into `sink` (see DownloadSink),
  // with DownloadInto's transport choice. `on_header` (may be null) sees the
  // metadata (dtype and bytes as sent) before the first piece. Errors as
  // DownloadInto, and the callbacks' errors.
  absl::StatusOr<TensorInfo> DownloadTo(
      const std::string& handle, DType as_dtype,
      const std::function<absl::Status(const TensorInfo&)>& on_header,
      const DownloadSink& sink, const ProgressCallback& progress = nullptr);

  // Streams a tensor back, converted to `as_dtype` (kInvalid = as stored) and
  // with its pending grad_output applied. `on_header` sees the metadata first
  // (dtype and bytes as sent); `on_chunk` then receives the data in order.
  // An error from a callback cancels the RPC and is returned. DATA_LOSS: the
  // server sent more or fewer bytes than its header said, or no header.
  // Otherwise server errors as the Download RPC.
  absl::Status DownloadStream(
      const std::string& handle, DType as_dtype,
      const std::function<absl::Status(const TensorInfo&)>& on_header,
      const std::function<absl::Status(const void* data, std::size_t bytes)>&
          on_chunk,
      const ProgressCallback& progress = nullptr);

  // Downloads a whole tensor into memory. When it has at least
  // options().stripe_min_bytes (as sent), it is fetched as
  // options().upload_streams data connections when the server offers them
  // (see ClientOptions::data_connection), else as that many byte ranges in
  // parallel over the extra connections of striped uploads (its size from
  // the handle's Upload or
  // Describe by this client, else from a Describe first; a Backward racing
  // the ranges may leave them with different factors; a server from before
  // ranged Download gets one stream instead). Errors as DownloadStream.
  absl::StatusOr<DownloadedTensor> Download(
      const std::string& handle, DType as_dtype = DType::kInvalid,
      const ProgressCallback& progress = nullptr);

  // Downloads into a caller buffer of `capacity` bytes. Success: metadata;
  // info.bytes bytes were written to `buffer`. OUT_OF_RANGE: the tensor does
  // not fit `capacity` (nothing useful written). Large tensors come in
  // parallel ranges as with Download. Otherwise as DownloadStream.
  absl::StatusOr<TensorInfo> DownloadInto(
      const std::string& handle, DType as_dtype, void* buffer,
      std::size_t capacity, const ProgressCallback& progress = nullptr);

  // Metadata of one tensor. NOT_FOUND: unknown, released, expired, foreign.
  absl::StatusOr<TensorInfo> Describe(const std::string& handle);

  // The caller's tensors, oldest first, and the instance's memory figures:
  // every page of the List RPC, asked for `page_size` tensors at a time (the
  // server's largest page by default). A tensor added or released while the
  // pages come may be missing or, when released, still listed.
  // INVALID_ARGUMENT for page_size <= 0; otherwise the first failing page's
  // status.
  absl::StatusOr<ListResult> List(int page_size = kListPageSize);

  // Frees a tensor; returns the bytes released. NOT_FOUND as Describe.
  absl::StatusOr<int64_t> Release(const std::string& handle);

  // Cross entropy on stored logits (see the Forward RPC). INVALID_ARGUMENT
  // (client side): inline targets with an unknown dtype or null data. With a
  // post-training field (LinearForward and Evaluate alike):
  // FAILED_PRECONDITION (client side, nothing sent) as RequirePostTraining,
  // and UNIMPLEMENTED when the answer lacks the policy_stats or segment sums
  // asked for (a server that skipped them). Server errors as the Forward
  // RPC: NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION (logits consumed or
  // busy), RESOURCE_EXHAUSTED.
  absl::StatusOr<ForwardResult> Forward(const std::string& logits,
                                        const Targets& targets,
                                        const ForwardOptions& options = {});

  // The LM head and the cross-entropy in one call (see the LinearForward
  // RPC): stored hidden states [N, H] times the stored weight [V, H]; dX as
  // options.mode says, the weight gradient accumulated in fp32 into
  // result.weight_grad. INVALID_ARGUMENT (client side) as Forward. Server
  // errors as the LinearForward RPC.
  absl::StatusOr<LinearForwardResult> LinearForward(
      const std::string& hidden, const std::string& weight,
      const Targets& targets, const LinearForwardOptions& options = {});

  // Replaces the contents of the stored tensor `handle` with `bytes` bytes at
  // `data` (same dtype and shape; the handle stays, no memory is allocated),
  // e.g. a weight after an optimizer step. Sent as Upload sends a tensor of
  // that size: over data connections, as options().upload_streams stripes
  // or over one stream. Success: the tensor's metadata, its handle
  // unchanged. INVALID_ARGUMENT (client side) as Upload, and for an empty
  // handle. Server errors as the Upload RPC's overwrite, checked before any
  // byte is written and changing nothing: NOT_FOUND (unknown, released or
  // foreign handle), INVALID_ARGUMENT (other dtype or shape),
  // FAILED_PRECONDITION (a Forward, LinearForward, Download or another
  // overwrite uses the tensor). An overwrite that fails later (a connection
  // breaks, a stripe fails) leaves the contents partly replaced under the
  // same handle: overwrite it again.
  absl::StatusOr<TensorInfo> Overwrite(
      const std::string& handle, DType dtype, absl::Span<const int64_t> shape,
      const void* data, std::size_t bytes,
      const ProgressCallback& progress = nullptr);

  // Overwrite with the bytes from `source` (see UploadSource), as UploadFrom
  // produces them. Errors as Overwrite, and the source's error (the contents
  // may then be partly replaced).
  absl::StatusOr<TensorInfo> OverwriteFrom(
      const std::string& handle, DType dtype, absl::Span<const int64_t> shape,
      const UploadSource& source, const ProgressCallback& progress = nullptr);

  // Records a scalar grad_output for a gradient (applied on download, or now
  // with `materialize`). NOT_FOUND, FAILED_PRECONDITION (holds logits),
  // INVALID_ARGUMENT (non-finite).
  absl::StatusOr<BackwardResult> Backward(const std::string& gradient,
                                          double grad_output,
                                          bool materialize = false);
  // Per-token grad_output [N], for a gradient computed with reduction kNone.
  // INVALID_ARGUMENT also for a count other than N or another reduction.
  absl::StatusOr<BackwardResult> Backward(
      const std::string& gradient, absl::Span<const float> token_grad_output,
      bool materialize = false);

  // Forward-only evaluation of the blocks `next_block` produces; the server
  // retains nothing. At most two produced blocks wait to be sent (per data
  // connection, when they carry the blocks), so memory stays O(block).
  // With options.weight, `vocab` is the row width H of the hidden states
  // the blocks carry (and `logits_dtype` their dtype, the weight's).
  // `targets_dtype` kInvalid: the blocks carry no targets (a distillation
  // with alpha 0 only). Over data connections each block's inputs must be
  // those the options declare, one entry a row; a dense teacher over hidden
  // states first asks the weight's V (Describe).
  // INVALID_ARGUMENT (client side): vocab < 1, bad dtypes, a bias without a
  // weight, a block over data connections that is not whole rows of every
  // declared input. Server errors as the Evaluate RPC; an error of the
  // producer cancels the RPC and is returned.
  absl::StatusOr<EvaluateResult> Evaluate(
      int64_t vocab, DType logits_dtype, DType targets_dtype,
      const EvaluateOptions& options, const RowBlockProducer& next_block,
      const ProgressCallback& progress = nullptr);

  // Convenience: evaluates in-memory logits [rows, vocab] (with
  // options.weight, hidden states [rows, H]) and targets [rows] in blocks of
  // `block_rows` rows (0 = as many as fit options().chunk_bytes, at least
  // one). Errors as Evaluate.
  absl::StatusOr<EvaluateResult> Evaluate(
      int64_t rows, int64_t vocab, DType logits_dtype, const void* logits,
      DType targets_dtype, const void* targets, const EvaluateOptions& options,
      int64_t block_rows = 0, const ProgressCallback& progress = nullptr);

  // Standard gRPC health check (grpc.health.v1). `service` "" asks about
  // liveness, kLossdService about readiness. Success: true when SERVING.
  // NOT_FOUND: the server does not know `service`. UNAVAILABLE: unreachable.
  absl::StatusOr<bool> Health(const std::string& service = "");

  // The server's identity, memory figures and features (also remembered for
  // the feature checks of later calls). Errors as the GetServerInfo RPC.
  absl::StatusOr<ServerInfo> GetServerInfo();

  // OK when the server serves the post-training losses (its
  // ServerInfo.features lists "post_training"; asked once per Client and
  // kept) or options().check_server_features is false. FAILED_PRECONDITION
  // naming the server and `call` when it does not (an empty list: a server
  // from before the list); GetServerInfo's error when the features are not
  // known yet and cannot be asked. Forward, LinearForward and Evaluate call
  // it before sending a post-training request; a caller that uploads large
  // inputs for one first (lossd.torch) calls it before them.
  absl::Status RequirePostTraining(const std::string& call);

 private:
  struct Channel;  // gRPC channel and stubs, kept out of this header
  Client(std::string target, ClientOptions options,
         std::unique_ptr<Channel> channel);

  // Where a download goes: `*vector` (resized), `buffer` of `capacity`
  // bytes, or `*sink` piece by piece, after `*on_header` (may be null).
  struct Destination {
    std::vector<uint8_t>* vector = nullptr;
    void* buffer = nullptr;
    std::size_t capacity = 0;
    const DownloadSink* sink = nullptr;
    const std::function<absl::Status(const TensorInfo&)>* on_header = nullptr;
  };

  // Download over data connections, or as options().upload_streams ranges in
  // parallel, into `destination`, when the converted tensor has at least
  // options().stripe_min_bytes. Success: true and `*info` filled; false when
  // not worth it (nothing fetched, on_header not called). Errors as
  // DownloadInto.
  absl::StatusOr<bool> DownloadInRanges(const std::string& handle,
                                        DType as_dtype,
                                        const Destination& destination,
                                        TensorInfo* info,
                                        const ProgressCallback& progress);

  // Where data connections go: the host of the channel's target and the
  // server's data port; nullopt when this server or channel takes none (TLS,
  // no TCP host, no data port, or one found unreachable before).
  struct DataTarget {
    std::string host;
    int port = 0;
  };
  std::optional<DataTarget> FindDataTarget();
  // `count` sockets connected to `target` (the caller closes them); nullopt
  // when one cannot be made, remembered: gRPC from then on.
  std::optional<std::vector<int>> ConnectData(const DataTarget& target,
                                              int count);
  // Both, for upload_streams connections, and a fresh token for a transfer
  // over them: nullopt as FindDataTarget or ConnectData; an error when no
  // token could be drawn.
  struct DataConnections {
    std::vector<int> fds;
    std::string token;
  };
  std::optional<absl::StatusOr<DataConnections>> OpenDataConnections();

  // Download of the whole (converted) tensor, `total` bytes of
  // `element_bytes`-byte elements, over data connections: into `base`, or
  // through destination.sink when base is null. nullopt when they cannot be
  // used (the caller then takes gRPC).
  std::optional<absl::StatusOr<TensorInfo>> DownloadOverDataConnections(
      const std::string& handle, DType as_dtype, const Destination& destination,
      uint8_t* base, int64_t total, int64_t element_bytes,
      const ProgressCallback& progress);

  // Evaluate (arguments checked) with its blocks over data connections:
  // block b over connection b mod K. nullopt when they cannot be used (the
  // caller then takes the stream).
  std::optional<absl::StatusOr<EvaluateResult>> EvaluateOverDataConnections(
      int64_t vocab, DType logits_dtype, DType targets_dtype,
      const EvaluateOptions& options, const RowBlockProducer& next_block,
      const ProgressCallback& progress);

  // Upload over data connections of the tensor `header` describes (a new
  // one, or an overwrite when header.overwrite_handle is set). nullopt when
  // this server or channel cannot take them (no data port, TLS,
  // unreachable): the caller then uploads over gRPC.
  std::optional<absl::StatusOr<TensorInfo>> UploadOverDataConnection(
      const v1::TensorHeader& header, const UploadSource& source,
      std::size_t bytes, const ProgressCallback& progress);

  // Upload as `stripes` parallel streams (stripes >= 2), each with `header`
  // and its stripe fields.
  absl::StatusOr<TensorInfo> UploadStriped(const v1::TensorHeader& header,
                                           const UploadSource& source,
                                           std::size_t bytes, int stripes,
                                           const ProgressCallback& progress);

  // Upload, UploadFrom, Overwrite and OverwriteFrom after their checks:
  // `bytes` bytes from `source` under `header` over data connections,
  // stripes or one stream.
  absl::StatusOr<TensorInfo> UploadPieces(const v1::TensorHeader& header,
                                          std::size_t bytes,
                                          const UploadSource& source,
                                          const ProgressCallback& progress);

  const std::string target_;
  const ClientOptions options_;
  const std::unique_ptr<Channel> channel_;
};

// Readable names, for CLIs and logs: "float32", "bf16", "int64", ...: the
// DTypeName of common/dtype.h, but "bf16" for kBFloat16.
const char* DTypeString(DType dtype);
// Parses "float32"/"fp32"/"f32", "bfloat16"/"bf16", "float16"/"fp16"/"half",
// "int32", "int64". INVALID_ARGUMENT otherwise.
absl::StatusOr<DType> DTypeFromString(const std::string& name);
// TensorStateName ("LOGITS", "GRADIENT") is common/dtype.h's.

}  // namespace lossd

#endif  // LOSSD_CLIENT_CLIENT_H_
