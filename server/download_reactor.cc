// The Download reactor (download_reactor.h).
#include "server/download_reactor.h"

#include <algorithm>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "common/tensor_math.h"
#include "server/data_connection_checks.h"
#include "server/data_plane.h"
#include "server/end_link.h"
#include "server/grpc_status.h"
#include "server/tensor_info_proto.h"
#include "server/validation.h"

namespace lossd {

namespace pb = ::lossd::v1;

namespace {

class DownloadReactor;
using DownloadLink = EndLink<DownloadReactor>;

class DownloadReactor final
    : public grpc::ServerWriteReactor<pb::DownloadResponse> {
 public:
  DownloadReactor(RpcSupport* rpc, grpc::CallbackServerContext* context,
                  const pb::DownloadRequest& request)
      : rpc_(rpc), admission_(rpc, *context) {
    if (!admission_.status().ok()) {
      End(ToGrpcStatus(admission_.status()));
      return;
    }
    // Held from here: a transfer over data connections may end as soon as
    // Start registers it (on a connection's thread); its outcome then waits
    // here and finds the header being written.
    absl::MutexLock lock(&mu_);
    const absl::Status status = Start(request);
    if (!status.ok()) {
      RefuseDataToken(*rpc_, request.data_token());
      End(ToGrpcStatus(status));
      return;
    }
    StartWrite(&response_);
    if (transfer_ != nullptr) {
      writing_header_ = true;
    } else {
      Prefetch();
    }
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (transfer_ != nullptr) {
      // The header of a download over data connections: the RPC ends when
      // the transfer does (or now, if it already did).
      writing_header_ = false;
      if (deferred_.has_value()) {
        End(ok ? ToGrpcStatus(*deferred_)
               : grpc::Status(grpc::StatusCode::CANCELLED, "the stream broke"));
      } else if ((!ok || cancelled_) && link_->Claim()) {
        End(grpc::Status(
            grpc::StatusCode::CANCELLED,
            ok ? "the download was cancelled" : "the stream broke"));
      }
      return;
    }
    if (!ok) {
      End(grpc::Status(grpc::StatusCode::CANCELLED, "the stream broke"));
      return;
    }
    if (!spare_status_.ok()) {
      End(ToGrpcStatus(spare_status_));
      return;
    }
    if (!spare_ready_) {
      End(grpc::Status::OK);
      return;
    }
    response_.Swap(&spare_);
    spare_ready_ = false;
    StartWrite(&response_);
    Prefetch();
  }

  // A download over data connections has no write in flight while its
  // transfer runs: cancellation (or the deadline) only shows here.
  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    if (transfer_ == nullptr) return;
    if (writing_header_) {
      cancelled_ = true;  // OnWriteDone ends the RPC
      return;
    }
    if (!link_->Claim()) return;
    End(grpc::Status(grpc::StatusCode::CANCELLED,
                     "the download was cancelled"));
  }

  void OnDone() override {
    lease_ = ReadLease();
    admission_.Release();
    delete this;
  }

  // The data connections' outcome, from the transfer's last connection (or
  // the data plane's sweeper), by the party that claimed the link.
  void EndFromTransfer(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      if (writing_header_) {
        deferred_ = status;  // OnWriteDone ends the RPC
        return;
      }
    }
    // Outside mu_: once finished, gRPC may delete this reactor at any time.
    End(ToGrpcStatus(status));
  }

 private:
  absl::Status Start(const pb::DownloadRequest& request) {
    ASSIGN_OR_RETURN(
        DownloadSpec spec,
        ValidateDownloadRequest(request, rpc_->options().max_chunk_bytes));
    RETURN_IF_ERROR(CheckDataConnections(*rpc_, request.data_token(),
                                         request.data_connections(),
                                         "download without a data_token"));
    DType as_dtype = spec.dtype;
    ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor,
                     rpc_->store()->Get(admission_.tenant(), request.handle()));
    const DType stored = tensor->dtype();
    if (as_dtype == DType::kInvalid) as_dtype = stored;
    const int64_t out_size = static_cast<int64_t>(DTypeSize(as_dtype));
    ASSIGN_OR_RETURN(
        chunk_elements_,
        DownloadChunkElements(stored, as_dtype,
                              spec.chunk_bytes == 0
                                  ? rpc_->options().default_chunk_bytes
                                  : spec.chunk_bytes));
    ASSIGN_OR_RETURN(const ElementRange range,
                     DownloadElements(spec, as_dtype, tensor->elements()));
    lease_ = rpc_->store()->BeginRead(std::move(tensor));
    dtype_ = as_dtype;
    next_element_ = range.first;
    elements_ = range.end;
    TensorRecord info = lease_.tensor()->Info();
    // The header describes what is sent: converted, with the factor applied,
    // and only the range asked for.
    info.dtype = as_dtype;
    info.bytes = (range.end - range.first) * out_size;
    info.pending_scale = lease_.view().scale;
    info.pending_token_scale = !lease_.view().row_scale.empty();
    ToProto(info, response_.mutable_header());
    if (request.data_token().empty()) return absl::OkStatus();
    auto link = std::make_shared<DownloadLink>(this);
    ASSIGN_OR_RETURN(transfer_,
                     rpc_->data_plane()->Expect(
                         request.data_token(),
                         DataRanges(range.end - range.first, out_size,
                                    std::max(1, request.data_connections())),
                         SendWork(range.first, out_size),
                         [link](const absl::Status& status) {
                           if (link->Claim())
                             link->reactor->EndFromTransfer(status);
                         }));
    link_ = std::move(link);
    return absl::OkStatus();
  }

  // The work of one data connection: its elements, converted and scaled on
  // the device in pieces of at least kDataPieceBytes, sent as they come. Two
  // host buffers: the next piece is read (on a helper thread) while this one
  // is sent. Runs while the lease is held (End cancels the transfer, which
  // waits for every connection's work to stop, before it lets the lease go).
  DataTransfer::Work SendWork(int64_t first, int64_t out_size) {
    const Tensor* const tensor = lease_.tensor().get();
    const ReadView* const view = &lease_.view();
    const int64_t piece = std::max(chunk_elements_, kDataPieceBytes / out_size);
    return [tensor, view, first, out_size, piece, dtype = dtype_,
            metrics = rpc_->metrics(), tenant = admission_.tenant()](
               int index, int fd,
               const DataTransfer::Range& range) -> absl::Status {
      const int64_t count = range.bytes / out_size;
      const int64_t start = first + range.offset / out_size;
      auto read = [&](int64_t at, int64_t n, char* into) {
        return tensor->device()->ReadConverted(
            tensor->data(), tensor->dtype(), start + at, n,
            tensor->row_length(), static_cast<float>(view->scale),
            view->row_scale.empty() ? nullptr : view->row_scale.data(), into,
            dtype);
      };
      const size_t buffer_bytes =
          static_cast<size_t>(std::min(count, piece) * out_size);
      std::vector<char> host[2];
      host[0].resize(buffer_bytes);
      if (count > piece) host[1].resize(buffer_bytes);
      RETURN_IF_ERROR(read(0, std::min(piece, count), host[0].data()));
      int64_t sent = 0;
      for (int64_t done = 0, k = 0; done < count; ++k) {
        const int64_t n = std::min(piece, count - done);
        const int64_t next = std::min(piece, count - done - n);
        // Joined before anything returns: no read outlives the work.
        std::future<absl::Status> reading;
        if (next > 0) {
          try {
            reading = std::async(std::launch::async, read, done + n, next,
                                 host[(k + 1) % 2].data());
          } catch (const std::system_error&) {
            // No thread to be had: the next piece is read after this one.
          }
        }
        const size_t bytes = static_cast<size_t>(n * out_size);
        const absl::Status sending = SendOnDataConnection(
            fd, index, host[k % 2].data(), bytes, sent, range.bytes);
        absl::Status read_next;
        if (reading.valid()) {
          read_next = reading.get();
        } else if (next > 0 && sending.ok()) {
          read_next = read(done + n, next, host[(k + 1) % 2].data());
        }
        RETURN_IF_ERROR(sending);
        RETURN_IF_ERROR(read_next);
        sent += static_cast<int64_t>(bytes);
        done += n;
        if (metrics != nullptr) {
          metrics->AddTransferBytes(TransferDirection::kDownload,
                                    static_cast<int64_t>(bytes), tenant);
        }
      }
      return absl::OkStatus();
    };
  }

  // Reads the next chunk into spare_ while response_ is being sent, so that
  // the device's conversion and copy overlap the network.
  void Prefetch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (next_element_ >= elements_) return;
    spare_status_ = FillChunk(&spare_);
    spare_ready_ = spare_status_.ok();
  }

  absl::Status FillChunk(pb::DownloadResponse* out) {
    const Tensor& tensor = *lease_.tensor();
    const int64_t count = std::min(chunk_elements_, elements_ - next_element_);
    std::string* chunk = out->mutable_chunk();
    chunk->resize(static_cast<size_t>(count) * DTypeSize(dtype_));
    const ReadView& view = lease_.view();
    RETURN_IF_ERROR(tensor.device()->ReadConverted(
        tensor.data(), tensor.dtype(), next_element_, count,
        tensor.row_length(), static_cast<float>(view.scale),
        view.row_scale.empty() ? nullptr : view.row_scale.data(), chunk->data(),
        dtype_));
    next_element_ += count;
    if (rpc_->metrics() != nullptr) {
      rpc_->metrics()->AddTransferBytes(TransferDirection::kDownload,
                                        static_cast<int64_t>(chunk->size()),
                                        admission_.tenant());
    }
    return absl::OkStatus();
  }

  // Finishes the RPC with `status`. Recorded before Finish, so that a client
  // that has its status also sees it counted.
  void End(const grpc::Status& status) {
    // No data connection reads the tensor any more.
    if (transfer_ != nullptr) transfer_->Cancel();
    rpc_->RecordRpc("Download", status.error_code(), start_,
                    admission_.tenant());
    // The read lease ends before the client can see the status, so that an
    // RPC it sends next (Backward with materialize) does not find the tensor
    // still in use.
    lease_ = ReadLease();
    Finish(status);
  }

  // What a data connection's piece of the download is at least.
  static constexpr int64_t kDataPieceBytes = int64_t{4} << 20;

  RpcSupport* const rpc_;
  const absl::Time start_ = absl::Now();
  // Writes complete on gRPC's threads: one reaction at a time here.
  absl::Mutex mu_;
  pb::DownloadResponse response_;
  pb::DownloadResponse spare_ ABSL_GUARDED_BY(mu_);
  bool spare_ready_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status spare_status_ ABSL_GUARDED_BY(mu_);
  ReadLease lease_;
  DType dtype_ = DType::kInvalid;
  int64_t elements_ = 0;
  int64_t chunk_elements_ = 0;
  int64_t next_element_ = 0;
  Admission admission_;
  // A download over data connections: its transfer, the link that ties the
  // transfer's outcome to this RPC, and that outcome when it came while the
  // header was still being written.
  std::shared_ptr<DataTransfer> transfer_;
  std::shared_ptr<DownloadLink> link_;
  bool writing_header_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<absl::Status> deferred_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // while writing the header
};

}  // namespace

grpc::ServerWriteReactor<pb::DownloadResponse>* NewDownloadReactor(
    RpcSupport* rpc, grpc::CallbackServerContext* context,
    const pb::DownloadRequest& request) {
  return new DownloadReactor(rpc, context, request);
}

}  // namespace lossd
