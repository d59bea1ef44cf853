// LossdService: request validation, protobuf <-> store/device mapping, and the
// reactors of the streaming RPCs (Upload, Download, Evaluate).
#include "server/service.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/status_macros.h"

namespace lossd {

namespace pb = ::lossd::v1;

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl and gRPC share the canonical code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

namespace {

// Until authentication exists every caller is the default tenant.
const std::string& TenantOf(const grpc::CallbackServerContext* /*context*/) {
  static const std::string* const kTenant = new std::string(kDefaultTenant);
  return *kTenant;
}

absl::Status DrainingError() {
  return absl::UnavailableError("lossd is draining; retry on another instance");
}

absl::StatusOr<DType> ParseDType(int value, absl::string_view field,
                                 bool allow_unspecified) {
  if (value == pb::DTYPE_UNSPECIFIED && allow_unspecified) {
    return DType::kInvalid;
  }
  if (value < pb::DTYPE_FLOAT32 || value > pb::DTYPE_INT64) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": ", value == 0 ? "missing dtype" : "unknown dtype ", value));
  }
  return static_cast<DType>(value);
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    default:
      return "invalid";
  }
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    absl::StrAppend(&text, i ? ", " : "", shape[i]);
  }
  return text + "]";
}

void ToProtoTime(absl::Time time, google::protobuf::Timestamp* out) {
  const int64_t nanos = absl::ToUnixNanos(time);
  int64_t seconds = nanos / 1000000000;
  int64_t rest = nanos % 1000000000;
  if (rest < 0) {
    rest += 1000000000;
    --seconds;
  }
  out->set_seconds(seconds);
  out->set_nanos(static_cast<int32_t>(rest));
}

void ToProto(const TensorInfo& info, pb::TensorInfo* out) {
  out->set_handle(info.handle);
  out->set_dtype(static_cast<pb::DType>(info.dtype));
  for (int64_t dim : info.shape) out->add_shape(dim);
  out->set_bytes(info.bytes);
  out->set_device(info.device);
  out->set_state(static_cast<pb::TensorState>(info.state));
  out->set_tenant(info.tenant);
  out->set_label(info.label);
  ToProtoTime(info.created, out->mutable_created());
  ToProtoTime(info.last_used, out->mutable_last_used());
  out->set_pending_scale(info.pending_scale);
  out->set_pending_token_scale(info.pending_token_scale);
}

absl::Status CheckFinite(double value, absl::string_view field) {
  if (!std::isfinite(value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " = ", value, " is not finite"));
  }
  return absl::OkStatus();
}

// Maps and checks LossOptions (everything but class_weights, a handle).
absl::StatusOr<CrossEntropyOptions> ParseLossOptions(
    const pb::LossOptions& in) {
  CrossEntropyOptions out;
  if (in.has_ignore_index()) out.ignore_index = in.ignore_index();
  RETURN_IF_ERROR(CheckFinite(in.label_smoothing(), "label_smoothing"));
  if (in.label_smoothing() < 0.0f || in.label_smoothing() > 1.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "label_smoothing = ", in.label_smoothing(), " is outside [0, 1]"));
  }
  out.label_smoothing = in.label_smoothing();
  switch (in.reduction()) {
    case pb::REDUCTION_UNSPECIFIED:
    case pb::REDUCTION_MEAN:
      out.reduction = Reduction::kMean;
      break;
    case pb::REDUCTION_SUM:
      out.reduction = Reduction::kSum;
      break;
    case pb::REDUCTION_NONE:
      out.reduction = Reduction::kNone;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown reduction ", in.reduction()));
  }
  RETURN_IF_ERROR(CheckFinite(in.z_loss_scale(), "z_loss_scale"));
  if (in.z_loss_scale() < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("z_loss_scale = ", in.z_loss_scale(), " is < 0"));
  }
  out.z_loss_scale = in.z_loss_scale();
  RETURN_IF_ERROR(CheckFinite(in.softcap(), "softcap"));
  if (in.softcap() < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("softcap = ", in.softcap(), " is < 0"));
  }
  out.softcap = in.softcap();
  RETURN_IF_ERROR(CheckFinite(in.normalizer(), "normalizer"));
  if (in.normalizer() < 0.0) {
    return absl::InvalidArgumentError(
        absl::StrCat("normalizer = ", in.normalizer(), " is < 0"));
  }
  out.normalizer = in.normalizer();
  if (in.has_grad_scale()) {
    RETURN_IF_ERROR(CheckFinite(in.grad_scale(), "grad_scale"));
    out.grad_scale = in.grad_scale();
  }
  return out;
}

absl::StatusOr<GradientMode> ParseMode(int mode) {
  switch (mode) {
    case pb::GRADIENT_MODE_UNSPECIFIED:
    case pb::GRADIENT_MODE_IN_PLACE:
      return GradientMode::kInPlace;
    case pb::GRADIENT_MODE_OUT_OF_PLACE:
      return GradientMode::kOutOfPlace;
    case pb::GRADIENT_MODE_NONE:
      return GradientMode::kNone;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown gradient mode ", mode));
  }
}

// Host bytes made visible to the device: the bytes themselves on a
// host-accessible device, else a device copy freed on destruction.
class Staged {
 public:
  Staged() = default;
  Staged(const Staged&) = delete;
  Staged& operator=(const Staged&) = delete;
  ~Staged() {
    if (device_ != nullptr) device_->Free(owned_, bytes_);
  }

  absl::Status Stage(Device* device, const void* host, size_t bytes) {
    if (device->host_accessible() || bytes == 0) {
      pointer_ = host;
      return absl::OkStatus();
    }
    ASSIGN_OR_RETURN(owned_, device->Allocate(bytes));
    device_ = device;
    bytes_ = bytes;
    pointer_ = owned_;
    return device->CopyFromHost(owned_, 0, host, bytes);
  }
  const void* get() const { return pointer_; }

 private:
  Device* device_ = nullptr;
  void* owned_ = nullptr;
  size_t bytes_ = 0;
  const void* pointer_ = nullptr;
};

// A stored fp32 [vocab] class-weights tensor, leased for one computation.
absl::StatusOr<ReadLease> LeaseClassWeights(TensorStore* store,
                                            const std::string& tenant,
                                            const std::string& handle,
                                            int64_t vocab) {
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> weights, store->Get(tenant, handle));
  if (weights->dtype() != DType::kFloat32 || weights->shape().size() != 1 ||
      weights->shape()[0] != vocab) {
    return absl::InvalidArgumentError(absl::StrCat(
        "class_weights must be float32 [", vocab, "], got ",
        DTypeName(weights->dtype()), " ", ShapeString(weights->shape())));
  }
  if (weights->state() != TensorState::kLogits) {
    return absl::InvalidArgumentError("class_weights holds a gradient");
  }
  return store->BeginRead(std::move(weights));
}

// Finishes a unary RPC with `status`, and leaves the drain count.
grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context,
                                      const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// ---------------------------------------------------------------- Upload

class UploadReactor final : public grpc::ServerReadReactor<pb::UploadRequest> {
 public:
  UploadReactor(LossdService* service, grpc::CallbackServerContext* context,
                pb::UploadResponse* response)
      : service_(service), context_(context), response_(response) {
    if (!service_->Enter()) {
      entered_ = false;
      End(ToGrpcStatus(DrainingError()));
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // End of the client's stream, or a cancelled / broken one.
      if (context_->IsCancelled()) {
        pending_.reset();
        End(grpc::Status::CANCELLED);
        return;
      }
      End(ToGrpcStatus(Complete()));
      return;
    }
    const absl::Status status = Consume();
    if (!status.ok()) {
      pending_.reset();
      End(ToGrpcStatus(status));
      return;
    }
    StartRead(&request_);
  }

  void OnCancel() override { cancelled_ = true; }

  void OnDone() override {
    // The pending tensor (and its reservation) goes before the drain count.
    pending_.reset();
    if (entered_) service_->Leave();
    delete this;
  }

 private:
  absl::Status Consume() {
    switch (request_.kind_case()) {
      case pb::UploadRequest::kHeader: {
        if (pending_ != nullptr) {
          return absl::InvalidArgumentError("a second header");
        }
        const pb::TensorHeader& header = request_.header();
        ASSIGN_OR_RETURN(
            DType dtype,
            ParseDType(header.dtype(), "header.dtype", /*allow_unspecified=*/
                       false));
        std::vector<int64_t> shape(header.shape().begin(),
                                   header.shape().end());
        ASSIGN_OR_RETURN(pending_, service_->store()->Create(
                                       TenantOf(context_), dtype,
                                       std::move(shape), header.label()));
        return absl::OkStatus();
      }
      case pb::UploadRequest::kChunk:
        if (pending_ == nullptr) {
          return absl::InvalidArgumentError("data before the header");
        }
        RETURN_IF_ERROR(
            pending_->Append(request_.chunk().data(), request_.chunk().size()));
        if (service_->metrics() != nullptr) {
          service_->metrics()->AddTransferBytes(
              TransferDirection::kUpload,
              static_cast<int64_t>(request_.chunk().size()));
        }
        return absl::OkStatus();
      default:
        return absl::InvalidArgumentError(
            "an UploadRequest with neither header nor chunk");
    }
  }

  absl::Status Complete() {
    if (pending_ == nullptr) {
      return absl::InvalidArgumentError("the stream ended before a header");
    }
    absl::StatusOr<std::shared_ptr<Tensor>> tensor = pending_->Commit();
    pending_.reset();
    if (!tensor.ok()) return tensor.status();
    ToProto((*tensor)->Info(), response_->mutable_tensor());
    return absl::OkStatus();
  }

  // Finishes the RPC with `status`. Recorded before Finish, so that a client
  // that has its status also sees it counted.
  void End(const grpc::Status& status) {
    service_->RecordRpc("Upload", status.error_code(), start_);
    Finish(status);
  }

  LossdService* const service_;
  const absl::Time start_ = absl::Now();
  grpc::CallbackServerContext* const context_;
  pb::UploadResponse* const response_;
  pb::UploadRequest request_;
  std::unique_ptr<PendingTensor> pending_;
  bool entered_ = true;
  bool cancelled_ = false;
};

// ---------------------------------------------------------------- Download

class DownloadReactor final
    : public grpc::ServerWriteReactor<pb::DownloadResponse> {
 public:
  DownloadReactor(LossdService* service, grpc::CallbackServerContext* context,
                  const pb::DownloadRequest& request)
      : service_(service) {
    if (!service_->Enter()) {
      entered_ = false;
      End(ToGrpcStatus(DrainingError()));
      return;
    }
    const absl::Status status = Start(context, request);
    if (!status.ok()) {
      End(ToGrpcStatus(status));
      return;
    }
    StartWrite(&response_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      End(grpc::Status(grpc::StatusCode::CANCELLED, "the stream broke"));
      return;
    }
    if (next_element_ >= elements_) {
      End(grpc::Status::OK);
      return;
    }
    const absl::Status status = FillChunk();
    if (!status.ok()) {
      End(ToGrpcStatus(status));
      return;
    }
    StartWrite(&response_);
  }

  void OnDone() override {
    lease_ = ReadLease();
    if (entered_) service_->Leave();
    delete this;
  }

 private:
  absl::Status Start(grpc::CallbackServerContext* context,
                     const pb::DownloadRequest& request) {
    ASSIGN_OR_RETURN(DType as_dtype, ParseDType(request.dtype(), "dtype",
                                                /*allow_unspecified=*/true));
    if (request.chunk_bytes() < 0 ||
        request.chunk_bytes() > service_->options().max_chunk_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk_bytes = ", request.chunk_bytes(), " is outside [0, ",
          service_->options().max_chunk_bytes, "]"));
    }
    ASSIGN_OR_RETURN(
        std::shared_ptr<Tensor> tensor,
        service_->store()->Get(TenantOf(context), request.handle()));
    const DType stored = tensor->dtype();
    if (as_dtype == DType::kInvalid) as_dtype = stored;
    if (IsLogitsDType(stored) != IsLogitsDType(as_dtype) ||
        (!IsLogitsDType(stored) && stored != as_dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot convert ", DTypeName(stored), " to ", DTypeName(as_dtype)));
    }
    const int64_t out_size = static_cast<int64_t>(DTypeSize(as_dtype));
    const int64_t chunk_bytes = request.chunk_bytes() == 0
                                    ? service_->options().default_chunk_bytes
                                    : request.chunk_bytes();
    chunk_elements_ = chunk_bytes / out_size;
    if (chunk_elements_ < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk_bytes = ", chunk_bytes,
                       " is smaller than one element of ", out_size, " bytes"));
    }
    lease_ = service_->store()->BeginRead(std::move(tensor));
    dtype_ = as_dtype;
    elements_ = lease_.tensor()->elements();
    TensorInfo info = lease_.tensor()->Info();
    // The header describes what is sent: converted, with the factor applied.
    info.dtype = as_dtype;
    info.bytes = elements_ * out_size;
    info.pending_scale = lease_.view().scale;
    info.pending_token_scale = !lease_.view().row_scale.empty();
    ToProto(info, response_.mutable_header());
    return absl::OkStatus();
  }

  absl::Status FillChunk() {
    const Tensor& tensor = *lease_.tensor();
    const int64_t count = std::min(chunk_elements_, elements_ - next_element_);
    std::string* chunk = response_.mutable_chunk();
    chunk->resize(static_cast<size_t>(count) * DTypeSize(dtype_));
    const ReadView& view = lease_.view();
    RETURN_IF_ERROR(tensor.device()->ReadConverted(
        tensor.data(), tensor.dtype(), next_element_, count,
        tensor.row_length(), static_cast<float>(view.scale),
        view.row_scale.empty() ? nullptr : view.row_scale.data(), chunk->data(),
        dtype_));
    next_element_ += count;
    if (service_->metrics() != nullptr) {
      service_->metrics()->AddTransferBytes(
          TransferDirection::kDownload, static_cast<int64_t>(chunk->size()));
    }
    return absl::OkStatus();
  }

  // Finishes the RPC with `status`. Recorded before Finish, so that a client
  // that has its status also sees it counted.
  void End(const grpc::Status& status) {
    service_->RecordRpc("Download", status.error_code(), start_);
    Finish(status);
  }

  LossdService* const service_;
  const absl::Time start_ = absl::Now();
  pb::DownloadResponse response_;
  ReadLease lease_;
  DType dtype_ = DType::kInvalid;
  int64_t elements_ = 0;
  int64_t chunk_elements_ = 0;
  int64_t next_element_ = 0;
  bool entered_ = true;
};

// ---------------------------------------------------------------- Evaluate

class EvaluateReactor final
    : public grpc::ServerReadReactor<pb::EvaluateRequest> {
 public:
  EvaluateReactor(LossdService* service, grpc::CallbackServerContext* context,
                  pb::EvaluateResponse* response)
      : service_(service), context_(context), response_(response) {
    if (!service_->Enter()) {
      entered_ = false;
      End(ToGrpcStatus(DrainingError()));
      return;
    }
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      if (context_->IsCancelled()) {
        End(grpc::Status::CANCELLED);
        return;
      }
      End(ToGrpcStatus(Complete()));
      return;
    }
    const absl::Status status = Consume();
    if (!status.ok()) {
      End(ToGrpcStatus(status));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override {
    weights_ = ReadLease();
    if (entered_) service_->Leave();
    delete this;
  }

 private:
  absl::Status Consume() {
    switch (request_.kind_case()) {
      case pb::EvaluateRequest::kHeader:
        if (have_header_) {
          return absl::InvalidArgumentError("a second header");
        }
        have_header_ = true;
        return StartEvaluation(request_.header());
      case pb::EvaluateRequest::kBlock:
        if (!have_header_) {
          return absl::InvalidArgumentError("data before the header");
        }
        return EvaluateBlock(request_.block());
      default:
        return absl::InvalidArgumentError(
            "an EvaluateRequest with neither header nor block");
    }
  }

  absl::Status StartEvaluation(const pb::EvaluateHeader& header) {
    ASSIGN_OR_RETURN(options_, ParseLossOptions(header.options()));
    if (options_.reduction == Reduction::kNone) {
      return absl::InvalidArgumentError(
          "Evaluate reduces: reduction NONE is not allowed");
    }
    if (header.vocab() <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("vocab = ", header.vocab(), " must be > 0"));
    }
    vocab_ = header.vocab();
    ASSIGN_OR_RETURN(logits_dtype_,
                     ParseDType(header.logits_dtype(), "logits_dtype", false));
    if (!IsLogitsDType(logits_dtype_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("logits_dtype must be a float dtype, got ",
                       DTypeName(logits_dtype_)));
    }
    ASSIGN_OR_RETURN(targets_dtype_, ParseDType(header.targets_dtype(),
                                                "targets_dtype", false));
    if (!IsTargetsDType(targets_dtype_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("targets_dtype must be int32 or int64, got ",
                       DTypeName(targets_dtype_)));
    }
    if (!header.options().class_weights().empty()) {
      ASSIGN_OR_RETURN(weights_, LeaseClassWeights(
                                     service_->store(), TenantOf(context_),
                                     header.options().class_weights(), vocab_));
      // The mean's denominator sums w[target] on the host.
      host_weights_.resize(static_cast<size_t>(vocab_));
      const Tensor& weights = *weights_.tensor();
      RETURN_IF_ERROR(weights.device()->ReadConverted(
          weights.data(), DType::kFloat32, 0, vocab_, vocab_, 1.0f, nullptr,
          host_weights_.data(), DType::kFloat32));
    }
    return absl::OkStatus();
  }

  absl::Status EvaluateBlock(const pb::RowBlock& block) {
    const int64_t row_bytes =
        vocab_ * static_cast<int64_t>(DTypeSize(logits_dtype_));
    const int64_t logits_bytes = static_cast<int64_t>(block.logits().size());
    if (logits_bytes % row_bytes != 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "block %d: %d logits bytes are not a whole number of rows of %d "
          "bytes",
          blocks_, logits_bytes, row_bytes));
    }
    const int64_t rows = logits_bytes / row_bytes;
    const int64_t target_size = static_cast<int64_t>(DTypeSize(targets_dtype_));
    if (static_cast<int64_t>(block.targets().size()) != rows * target_size) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "block %d: %d rows of logits but %d bytes of targets (%d each)",
          blocks_, rows, block.targets().size(), target_size));
    }
    ++blocks_;
    Metrics* const metrics = service_->metrics();
    if (metrics != nullptr) {
      metrics->AddTransferBytes(
          TransferDirection::kEvaluate,
          logits_bytes + static_cast<int64_t>(block.targets().size()));
    }
    if (rows == 0) return absl::OkStatus();

    Device* device = service_->store()->device();
    Staged logits;
    Staged targets;
    RETURN_IF_ERROR(
        logits.Stage(device, block.logits().data(), block.logits().size()));
    RETURN_IF_ERROR(
        targets.Stage(device, block.targets().data(), block.targets().size()));
    CrossEntropyArgs args;
    args.rows = rows;
    args.vocab = vocab_;
    args.row_stride = vocab_;
    args.logits_dtype = logits_dtype_;
    args.logits = logits.get();
    args.targets_dtype = targets_dtype_;
    args.targets = targets.get();
    args.class_weights =
        weights_.tensor() == nullptr
            ? nullptr
            : static_cast<const float*>(weights_.tensor()->data());
    args.options = options_;
    // Blocks are summed here and reduced once at the end, in block order.
    args.options.reduction = Reduction::kSum;
    args.mode = GradientMode::kNone;
    CrossEntropyResult result;
    const absl::Time start = absl::Now();
    RETURN_IF_ERROR(device->CrossEntropy(args, &result));
    if (metrics != nullptr) {
      metrics->ObserveKernel(device->name(), "cross_entropy",
                             absl::ToDoubleSeconds(absl::Now() - start));
    }

    loss_sum_ += result.loss;
    z_loss_sum_ += result.z_loss;
    rows_ += rows;
    valid_tokens_ += result.valid_tokens;
    correct_tokens_ += result.correct_tokens;
    nonfinite_rows_ += result.nonfinite_rows;
    // Targets were checked by the kernel: valid ones index the weights.
    for (int64_t row = 0; row < rows; ++row) {
      int64_t target;
      if (targets_dtype_ == DType::kInt32) {
        int32_t value;
        std::memcpy(&value, block.targets().data() + row * 4, 4);
        target = value;
      } else {
        std::memcpy(&target, block.targets().data() + row * 8, 8);
      }
      if (target == options_.ignore_index) continue;
      weight_sum_ += host_weights_.empty()
                         ? 1.0
                         : static_cast<double>(host_weights_[target]);
    }
    return absl::OkStatus();
  }

  absl::Status Complete() {
    if (!have_header_) {
      return absl::InvalidArgumentError("the stream ended before a header");
    }
    if (rows_ == 0) return absl::InvalidArgumentError("no rows at all");
    double loss = loss_sum_;
    double z_loss = z_loss_sum_;
    double denominator = 0.0;
    if (options_.reduction == Reduction::kMean) {
      denominator = options_.normalizer > 0.0
                        ? options_.normalizer
                        : (valid_tokens_ > 0 ? weight_sum_ : 0.0);
      loss = denominator != 0.0 ? loss_sum_ / denominator : 0.0;
      z_loss = denominator != 0.0 ? z_loss_sum_ / denominator : 0.0;
    }
    response_->set_loss(loss);
    response_->set_z_loss(z_loss);
    response_->set_rows(rows_);
    response_->set_valid_tokens(valid_tokens_);
    response_->set_correct_tokens(correct_tokens_);
    response_->set_nonfinite_rows(nonfinite_rows_);
    response_->set_denominator(denominator);
    return absl::OkStatus();
  }

  // Finishes the RPC with `status`. Recorded before Finish, so that a client
  // that has its status also sees it counted.
  void End(const grpc::Status& status) {
    service_->RecordRpc("Evaluate", status.error_code(), start_);
    Finish(status);
  }

  LossdService* const service_;
  const absl::Time start_ = absl::Now();
  grpc::CallbackServerContext* const context_;
  pb::EvaluateResponse* const response_;
  pb::EvaluateRequest request_;
  bool entered_ = true;
  bool have_header_ = false;
  CrossEntropyOptions options_;
  int64_t vocab_ = 0;
  DType logits_dtype_ = DType::kInvalid;
  DType targets_dtype_ = DType::kInvalid;
  ReadLease weights_;
  std::vector<float> host_weights_;
  int64_t blocks_ = 0;
  double loss_sum_ = 0.0;
  double z_loss_sum_ = 0.0;
  double weight_sum_ = 0.0;
  int64_t rows_ = 0;
  int64_t valid_tokens_ = 0;
  int64_t correct_tokens_ = 0;
  int64_t nonfinite_rows_ = 0;
};

}  // namespace

// ---------------------------------------------------------------- service

LossdService::LossdService(TensorStore* store, ServiceOptions options,
                           Metrics* metrics)
    : store_(store), options_(std::move(options)), metrics_(metrics) {}

void LossdService::RecordRpc(const char* method, grpc::StatusCode code,
                             absl::Time start) const {
  if (metrics_ == nullptr) return;
  metrics_->ObserveRpc(method, static_cast<absl::StatusCode>(code),
                       absl::Now() - start);
}

LossdService::~LossdService() = default;

void LossdService::StartDraining() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

bool LossdService::WaitForIdle(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]()
                  ABSL_SHARED_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

int64_t LossdService::in_flight() const {
  absl::MutexLock lock(&mu_);
  return in_flight_;
}

bool LossdService::Enter() {
  absl::MutexLock lock(&mu_);
  if (draining_) return false;
  ++in_flight_;
  return true;
}

void LossdService::Leave() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

void LossdService::FillServerInfo(pb::ServerInfo* info) const {
  const StoreStats stats = store_->Stats();
  info->set_instance_id(store_->instance_id());
  info->set_device(store_->device()->name());
  info->set_budget_bytes(stats.budget_bytes);
  info->set_used_bytes(stats.used_bytes);
  info->set_free_bytes(stats.budget_bytes - stats.used_bytes);
  info->set_tensors(stats.tensors);
  info->set_version(options_.version);
}

// Runs `body` as one counted (drain) and recorded (metrics) unary RPC.
#define LOSSD_UNARY(method, context, body)                                     \
  do {                                                                         \
    const absl::Time lossd_rpc_start_ = absl::Now();                           \
    if (!Enter()) {                                                            \
      RecordRpc(method, grpc::StatusCode::UNAVAILABLE, lossd_rpc_start_);      \
      return FinishUnary(context, DrainingError());                            \
    }                                                                          \
    const absl::Status lossd_rpc_status_ = (body);                             \
    RecordRpc(method, static_cast<grpc::StatusCode>(lossd_rpc_status_.code()), \
              lossd_rpc_start_);                                               \
    Leave();                                                                   \
    return FinishUnary(context, lossd_rpc_status_);                            \
  } while (0)

grpc::ServerReadReactor<pb::UploadRequest>* LossdService::Upload(
    grpc::CallbackServerContext* context, pb::UploadResponse* response) {
  return new UploadReactor(this, context, response);
}

grpc::ServerWriteReactor<pb::DownloadResponse>* LossdService::Download(
    grpc::CallbackServerContext* context, const pb::DownloadRequest* request) {
  return new DownloadReactor(this, context, *request);
}

grpc::ServerReadReactor<pb::EvaluateRequest>* LossdService::Evaluate(
    grpc::CallbackServerContext* context, pb::EvaluateResponse* response) {
  return new EvaluateReactor(this, context, response);
}

grpc::ServerUnaryReactor* LossdService::Describe(
    grpc::CallbackServerContext* context, const pb::DescribeRequest* request,
    pb::TensorInfo* response) {
  LOSSD_UNARY("Describe", context, DoDescribe(*request, response));
}

grpc::ServerUnaryReactor* LossdService::List(
    grpc::CallbackServerContext* context, const pb::ListRequest* /*request*/,
    pb::ListResponse* response) {
  LOSSD_UNARY("List", context, DoList(response));
}

grpc::ServerUnaryReactor* LossdService::Release(
    grpc::CallbackServerContext* context, const pb::ReleaseRequest* request,
    pb::ReleaseResponse* response) {
  LOSSD_UNARY("Release", context, DoRelease(*request, response));
}

grpc::ServerUnaryReactor* LossdService::Forward(
    grpc::CallbackServerContext* context, const pb::ForwardRequest* request,
    pb::ForwardResponse* response) {
  LOSSD_UNARY("Forward", context, DoForward(*request, response));
}

grpc::ServerUnaryReactor* LossdService::Backward(
    grpc::CallbackServerContext* context, const pb::BackwardRequest* request,
    pb::BackwardResponse* response) {
  LOSSD_UNARY("Backward", context, DoBackward(*request, response));
}

grpc::ServerUnaryReactor* LossdService::GetServerInfo(
    grpc::CallbackServerContext* context,
    const pb::GetServerInfoRequest* /*request*/, pb::ServerInfo* response) {
  LOSSD_UNARY("GetServerInfo", context,
              (FillServerInfo(response), absl::OkStatus()));
}

#undef LOSSD_UNARY

absl::Status LossdService::DoDescribe(const pb::DescribeRequest& request,
                                      pb::TensorInfo* response) {
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor,
                   store_->Get(kDefaultTenant, request.handle()));
  ToProto(tensor->Info(), response);
  return absl::OkStatus();
}

absl::Status LossdService::DoList(pb::ListResponse* response) {
  for (const TensorInfo& info : store_->List(kDefaultTenant)) {
    ToProto(info, response->add_tensors());
  }
  FillServerInfo(response->mutable_server());
  return absl::OkStatus();
}

absl::Status LossdService::DoRelease(const pb::ReleaseRequest& request,
                                     pb::ReleaseResponse* response) {
  ASSIGN_OR_RETURN(const int64_t bytes,
                   store_->Release(kDefaultTenant, request.handle()));
  response->set_released_bytes(bytes);
  return absl::OkStatus();
}

absl::Status LossdService::DoForward(const pb::ForwardRequest& request,
                                     pb::ForwardResponse* response) {
  const std::string tenant = kDefaultTenant;
  // Request-only checks first: nothing is looked up for a malformed request.
  ASSIGN_OR_RETURN(CrossEntropyOptions options,
                   ParseLossOptions(request.options()));
  ASSIGN_OR_RETURN(GradientMode mode, ParseMode(request.mode()));
  if (request.targets_case() == pb::ForwardRequest::TARGETS_NOT_SET) {
    return absl::InvalidArgumentError("targets missing (handle or inline)");
  }
  DType inline_dtype = DType::kInvalid;
  if (request.targets_case() == pb::ForwardRequest::kTargetsInline) {
    ASSIGN_OR_RETURN(inline_dtype, ParseDType(request.targets_inline().dtype(),
                                              "targets_inline.dtype", false));
    if (!IsTargetsDType(inline_dtype)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "targets must be int32 or int64, got ", DTypeName(inline_dtype)));
    }
  }

  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> logits,
                   store_->Get(tenant, request.logits()));
  if (!IsLogitsDType(logits->dtype()) || logits->shape().size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "logits must be a 2-D float tensor, got ", DTypeName(logits->dtype()),
        " ", ShapeString(logits->shape())));
  }
  const int64_t rows = logits->shape()[0];
  const int64_t vocab = logits->shape()[1];

  Device* device = store_->device();
  ReadLease targets_lease;
  Staged inline_targets;
  const void* targets = nullptr;
  DType targets_dtype = inline_dtype;
  if (request.targets_case() == pb::ForwardRequest::kTargetsHandle) {
    ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor,
                     store_->Get(tenant, request.targets_handle()));
    if (!IsTargetsDType(tensor->dtype()) || tensor->shape().size() != 1 ||
        tensor->shape()[0] != rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          "targets must be int32 or int64 [", rows, "], got ",
          DTypeName(tensor->dtype()), " ", ShapeString(tensor->shape())));
    }
    targets_dtype = tensor->dtype();
    targets_lease = store_->BeginRead(std::move(tensor));
    targets = targets_lease.tensor()->data();
  } else {
    const std::string& data = request.targets_inline().data();
    const int64_t expected =
        rows * static_cast<int64_t>(DTypeSize(inline_dtype));
    if (static_cast<int64_t>(data.size()) != expected) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "inline targets have %d bytes, %d rows of %s need %d", data.size(),
          rows, DTypeName(inline_dtype), expected));
    }
    RETURN_IF_ERROR(inline_targets.Stage(device, data.data(), data.size()));
    targets = inline_targets.get();
  }

  ReadLease weights_lease;
  if (!request.options().class_weights().empty()) {
    ASSIGN_OR_RETURN(
        weights_lease,
        LeaseClassWeights(store_, tenant, request.options().class_weights(),
                          vocab));
  }

  ASSIGN_OR_RETURN(
      ForwardLease lease,
      store_->BeginForward(logits, mode == GradientMode::kInPlace));
  std::unique_ptr<PendingTensor> gradient;
  if (mode == GradientMode::kOutOfPlace) {
    ASSIGN_OR_RETURN(
        gradient,
        store_->Create(tenant, logits->dtype(), logits->shape(),
                       request.gradient_label(), TensorState::kGradient));
  }

  std::vector<float> token_loss(request.outputs().token_loss() ? rows : 0);
  std::vector<float> token_lse(request.outputs().token_lse() ? rows : 0);
  std::vector<int32_t> token_argmax(request.outputs().token_argmax() ? rows
                                                                     : 0);
  CrossEntropyArgs args;
  args.rows = rows;
  args.vocab = vocab;
  args.row_stride = vocab;
  args.logits_dtype = logits->dtype();
  args.logits = logits->data();
  args.targets_dtype = targets_dtype;
  args.targets = targets;
  args.class_weights =
      weights_lease.tensor() == nullptr
          ? nullptr
          : static_cast<const float*>(weights_lease.tensor()->data());
  args.options = options;
  args.mode = mode;
  switch (mode) {
    case GradientMode::kInPlace:
      args.gradient = logits->data();
      break;
    case GradientMode::kOutOfPlace:
      args.gradient = gradient->data();
      break;
    case GradientMode::kNone:
      args.gradient = nullptr;
      break;
  }
  args.token_loss = token_loss.empty() ? nullptr : token_loss.data();
  args.token_lse = token_lse.empty() ? nullptr : token_lse.data();
  args.token_argmax = token_argmax.empty() ? nullptr : token_argmax.data();

  CrossEntropyResult result;
  const auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(device->CrossEntropy(args, &result));
  const std::chrono::duration<double> elapsed =
      std::chrono::steady_clock::now() - start;
  if (metrics_ != nullptr) {
    metrics_->ObserveKernel(device->name(), "cross_entropy", elapsed.count());
  }

  switch (mode) {
    case GradientMode::kInPlace:
      lease.FinishInPlace(options.reduction);
      response->set_gradient(logits->handle());
      break;
    case GradientMode::kOutOfPlace: {
      gradient->MarkFilled();
      ASSIGN_OR_RETURN(std::shared_ptr<Tensor> out,
                       gradient->Commit(options.reduction));
      response->set_gradient(out->handle());
      break;
    }
    case GradientMode::kNone:
      break;
  }
  response->set_loss(result.loss);
  response->set_z_loss(result.z_loss);
  response->set_valid_tokens(result.valid_tokens);
  response->set_correct_tokens(result.correct_tokens);
  response->set_nonfinite_rows(result.nonfinite_rows);
  response->set_denominator(result.denominator);
  response->set_kernel_seconds(elapsed.count());
  response->mutable_token_loss()->Add(token_loss.begin(), token_loss.end());
  response->mutable_token_lse()->Add(token_lse.begin(), token_lse.end());
  response->mutable_token_argmax()->Add(token_argmax.begin(),
                                        token_argmax.end());
  return absl::OkStatus();
}

absl::Status LossdService::DoBackward(const pb::BackwardRequest& request,
                                      pb::BackwardResponse* response) {
  double scale = 1.0;
  std::vector<float> token_scale;
  switch (request.grad_output_case()) {
    case pb::BackwardRequest::kScalar:
      scale = request.scalar();
      break;
    case pb::BackwardRequest::kPerToken:
      if (request.per_token().values().empty()) {
        return absl::InvalidArgumentError("per-token grad_output is empty");
      }
      token_scale.assign(request.per_token().values().begin(),
                         request.per_token().values().end());
      break;
    default:
      return absl::InvalidArgumentError("no grad_output");
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor,
                   store_->Get(kDefaultTenant, request.gradient()));
  bool kernel_launched = false;
  const auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(
      store_->RecordGradOutput(tensor, scale, std::move(token_scale),
                               request.materialize(), &kernel_launched));
  if (kernel_launched && metrics_ != nullptr) {
    // Includes the store's bookkeeping around the pass, which is tiny next to
    // a pass over N·V elements.
    const std::chrono::duration<double> elapsed =
        std::chrono::steady_clock::now() - start;
    metrics_->ObserveKernel(tensor->device()->name(), "scale", elapsed.count());
  }
  ToProto(tensor->Info(), response->mutable_tensor());
  response->set_kernel_launched(kernel_launched);
  return absl::OkStatus();
}

}  // namespace lossd
