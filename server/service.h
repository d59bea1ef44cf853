// The RPC edge: lossd.v1.Lossd on gRPC's callback API. Validates requests,
// maps protobuf to the store and device types, and maps absl::Status to
// grpc::Status in one place (ToGrpcStatus).
#ifndef LOSSD_SERVER_SERVICE_H_
#define LOSSD_SERVER_SERVICE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "server/auth.h"
#include "server/metrics.h"
#include "server/quota.h"
#include "server/tensor_store.h"

namespace lossd {

// The single absl::Status -> grpc::Status mapping (the codes are the same
// canonical codes).
grpc::Status ToGrpcStatus(const absl::Status& status);

class DataPlane;

struct ServiceOptions {
  int64_t default_chunk_bytes = 1 << 20;  // Download chunk when not asked
  int64_t max_chunk_bytes = 16 << 20;     // largest Download chunk allowed
  std::string version = "0.1.0";
  // Decides each call's tenant; null = every caller is kDefaultTenant. Must
  // outlive the service.
  const Authenticator* authenticator = nullptr;
  // Per-tenant in-flight RPC limits; null = none. Must outlive the service.
  TenantQuotas* quotas = nullptr;
  // A striped upload whose stripes have not all arrived this long after the
  // first is abandoned (every stripe fails ABORTED, nothing is kept).
  absl::Duration stripe_timeout = absl::Seconds(60);
  // Receives the bytes of uploads whose header has a data_token; null = the
  // server offers no data connections. Must outlive the service's RPCs.
  DataPlane* data_plane = nullptr;
};

// The striped uploads in progress (service.cc).
class StripedUploads;

// The lossd.v1.Lossd service. Thread-safe: gRPC calls it from many threads.
// `store` must outlive the service; so must `metrics` (nullable: nothing is
// recorded) until every RPC has finished.
class LossdService final : public lossd::v1::Lossd::CallbackService {
 public:
  LossdService(TensorStore* store, ServiceOptions options,
               Metrics* metrics = nullptr);
  LossdService(const LossdService&) = delete;
  LossdService& operator=(const LossdService&) = delete;
  ~LossdService() override;

  // From now on new RPCs fail with UNAVAILABLE; running ones continue.
  void StartDraining() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until no RPC runs or `timeout` passes; returns whether none runs.
  bool WaitForIdle(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);
  int64_t in_flight() const ABSL_LOCKS_EXCLUDED(mu_);

  grpc::ServerReadReactor<lossd::v1::UploadRequest>* Upload(
      grpc::CallbackServerContext* context,
      lossd::v1::UploadResponse* response) override;
  grpc::ServerWriteReactor<lossd::v1::DownloadResponse>* Download(
      grpc::CallbackServerContext* context,
      const lossd::v1::DownloadRequest* request) override;
  grpc::ServerUnaryReactor* Describe(grpc::CallbackServerContext* context,
                                     const lossd::v1::DescribeRequest* request,
                                     lossd::v1::TensorInfo* response) override;
  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* context,
                                 const lossd::v1::ListRequest* request,
                                 lossd::v1::ListResponse* response) override;
  grpc::ServerUnaryReactor* Release(
      grpc::CallbackServerContext* context,
      const lossd::v1::ReleaseRequest* request,
      lossd::v1::ReleaseResponse* response) override;
  grpc::ServerUnaryReactor* Forward(
      grpc::CallbackServerContext* context,
      const lossd::v1::ForwardRequest* request,
      lossd::v1::ForwardResponse* response) override;
  grpc::ServerUnaryReactor* Backward(
      grpc::CallbackServerContext* context,
      const lossd::v1::BackwardRequest* request,
      lossd::v1::BackwardResponse* response) override;
  grpc::ServerReadReactor<lossd::v1::EvaluateRequest>* Evaluate(
      grpc::CallbackServerContext* context,
      lossd::v1::EvaluateResponse* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(
      grpc::CallbackServerContext* context,
      const lossd::v1::GetServerInfoRequest* request,
      lossd::v1::ServerInfo* response) override;

  // Counts one RPC as running for the drain; false (and nothing counted) when
  // draining, unless `draining` is given: then it is always counted and
  // `*draining` says whether the service drains. Public for the reactors in
  // service.cc.
  bool Enter(bool* draining = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  void Leave() ABSL_LOCKS_EXCLUDED(mu_);
  // Admits one RPC: Enter, then authenticates it (its tenant goes to
  // `*tenant`) and takes one of the tenant's in-flight slots (into `*slot`,
  // to be reset before Leave). UNAVAILABLE when draining, UNAUTHENTICATED /
  // PERMISSION_DENIED from the authenticator, RESOURCE_EXHAUSTED over the
  // tenant's in-flight quota; on error nothing is counted (no Leave due).
  // With `draining` given, a draining service admits the RPC too and sets
  // `*draining` (Upload: a stripe may join an upload already started).
  absl::Status Admit(const grpc::ServerContextBase& context,
                     std::string* tenant, InFlightSlot* slot,
                     bool* draining = nullptr) ABSL_LOCKS_EXCLUDED(mu_);

  TensorStore* store() const { return store_; }
  StripedUploads* stripes() const { return stripes_.get(); }
  // Nullable.
  Metrics* metrics() const { return metrics_; }
  // Reports one finished RPC of `tenant` (empty: not admitted) to the metrics
  // (if any). Called before its status is sent (a client that has the status
  // sees it counted) and before Leave (a drained server has no report in
  // flight).
  void RecordRpc(const char* method, grpc::StatusCode code, absl::Time start,
                 const std::string& tenant = {}) const;
  const ServiceOptions& options() const { return options_; }
  void FillServerInfo(lossd::v1::ServerInfo* info) const;

 private:
  absl::Status DoDescribe(const std::string& tenant,
                          const lossd::v1::DescribeRequest& request,
                          lossd::v1::TensorInfo* response);
  absl::Status DoList(const std::string& tenant,
                      lossd::v1::ListResponse* response);
  absl::Status DoRelease(const std::string& tenant,
                         const lossd::v1::ReleaseRequest& request,
                         lossd::v1::ReleaseResponse* response);
  absl::Status DoForward(const std::string& tenant,
                         const lossd::v1::ForwardRequest& request,
                         lossd::v1::ForwardResponse* response);
  absl::Status DoBackward(const std::string& tenant,
                          const lossd::v1::BackwardRequest& request,
                          lossd::v1::BackwardResponse* response);

  TensorStore* const store_;
  const ServiceOptions options_;
  Metrics* const metrics_;
  const std::unique_ptr<StripedUploads> stripes_;

  mutable absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  int64_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_SERVICE_H_
