// lossd::RoutingClient: one client for several lossd instances (a list of
// endpoints, or a headless Service's DNS name). Every handle names its
// instance, so its RPCs go to the owner; new tensors go to the emptiest one.
#ifndef LOSSD_CLIENT_ROUTER_H_
#define LOSSD_CLIENT_ROUTER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/client.h"

namespace lossd {

struct RoutingOptions {
  // Options of the connection to each endpoint.
  ClientOptions client;
  // How old an instance's free-memory figure may be when an upload is placed.
  // Zero asks every instance (GetServerInfo, cheap) before each placement,
  // which keeps concurrent clients from piling onto one instance.
  absl::Duration server_info_max_age = absl::ZeroDuration();
  // Deadline of those GetServerInfo probes, so that an unreachable pod delays
  // a placement by at most this much instead of gRPC's connect timeout.
  absl::Duration probe_deadline = absl::Seconds(5);
  // A placement re-resolves DNS names whose answer is older than this; a
  // handle of an unknown instance always re-resolves.
  absl::Duration resolve_interval = absl::Seconds(10);
};

// What one endpoint said about itself.
struct InstanceStatus {
  std::string endpoint;  // "10.1.2.3:50051", or a static target as given
  absl::Status status;   // of its GetServerInfo (or List)
  ServerInfo info;       // meaningful when status.ok()
};

// List() over every instance.
struct RoutedListResult {
  std::vector<TensorInfo> tensors;        // of every instance that answered
  std::vector<InstanceStatus> instances;  // one per endpoint, in order
};

// A client of several lossd instances, with the methods of lossd::Client.
//
// Targets: each is "host:port" (or any gRPC target URI) naming one instance,
// or "dns:///NAME[:PORT]" (port default 50051) naming every address NAME
// resolves to (getaddrinfo: all A and AAAA records), one endpoint each: the
// form for a Kubernetes headless Service. Each endpoint's instance id comes
// from GetServerInfo.
//
// Routing: a handle is "<instance id>-<random>"; Describe, Download, Release,
// Forward and Backward go to the endpoint serving that instance. A handle of
// an instance no endpoint serves (after re-resolving DNS and asking every
// endpoint) is NOT_FOUND with a message saying the instance is gone
// (restarted or removed); when its endpoint itself answers, the message is
// the server's ("... this is instance Y (restarted or other pod)").
// Upload and Evaluate go to the instance with the most free memory; on
// UNAVAILABLE (down, draining) Upload tries the next one. With a single
// static target every call goes to it unchanged and no probe is made.
//
// Errors: those of lossd::Client, plus NOT_FOUND as above, INVALID_ARGUMENT
// for a Forward whose tensors live on different instances (before any RPC),
// UNAVAILABLE when no instance answers a placement probe.
//
// Thread-safe: every method may be called concurrently.
class RoutingClient {
 public:
  // Creates a client over `targets` (at least one; duplicates are dropped).
  // Contacts nothing: DNS names are resolved and instances asked on first
  // use. INVALID_ARGUMENT: no targets, an empty one, a DNS target with an
  // authority ("dns://server/...") or a bad port, options Client::Connect or
  // the routing rejects (non-positive probe_deadline, negative durations).
  static absl::StatusOr<std::unique_ptr<RoutingClient>> Connect(
      std::vector<std::string> targets, RoutingOptions options = {});

  ~RoutingClient();
  RoutingClient(const RoutingClient&) = delete;
  RoutingClient& operator=(const RoutingClient&) = delete;

  const ClientOptions& options() const { return options_.client; }

  // The instance id inside `handle` (the part before the '-').
  // INVALID_ARGUMENT "empty handle" or "malformed handle" (as the server's)
  // when `handle` is not of the shape of common/handle.h.
  static absl::StatusOr<std::string> InstanceOf(const std::string& handle);

  // Client::Upload on the instance with the most free memory (ties: the
  // first endpoint). Success: the metadata; the handle names the instance.
  // UNAVAILABLE when no instance answers; otherwise as Client::Upload.
  absl::StatusOr<TensorInfo> Upload(DType dtype,
                                    absl::Span<const int64_t> shape,
                                    const void* data, std::size_t bytes,
                                    const std::string& label = "",
                                    const ProgressCallback& progress = nullptr);

  // Client::Upload on the instance that holds `near` (a Forward's targets
  // and class weights must live beside its logits). NOT_FOUND as routing.
  absl::StatusOr<TensorInfo> UploadColocated(
      const std::string& near, DType dtype, absl::Span<const int64_t> shape,
      const void* data, std::size_t bytes, const std::string& label = "",
      const ProgressCallback& progress = nullptr);

  // Client::UploadFrom, placed as Upload (the source may be asked again for
  // the same pieces when an instance is found UNAVAILABLE and the next one is
  // tried), or on the instance holding `near` when it is not empty.
  // `idempotency_key` as Client::Upload's (an instance found UNAVAILABLE
  // stored nothing, so the next one gets the same key).
  absl::StatusOr<TensorInfo> UploadFrom(
      DType dtype, absl::Span<const int64_t> shape, const UploadSource& source,
      const std::string& label = "", const ProgressCallback& progress = nullptr,
      const std::string& near = "", const std::string& idempotency_key = "");

  // The handle methods of Client, sent to the handle's owner.
  absl::StatusOr<TensorInfo> DownloadTo(
      const std::string& handle, DType as_dtype,
      const std::function<absl::Status(const TensorInfo&)>& on_header,
      const DownloadSink& sink, const ProgressCallback& progress = nullptr);
  absl::Status DownloadStream(
      const std::string& handle, DType as_dtype,
      const std::function<absl::Status(const TensorInfo&)>& on_header,
      const std::function<absl::Status(const void* data, std::size_t bytes)>&
          on_chunk,
      const ProgressCallback& progress = nullptr);
  absl::StatusOr<DownloadedTensor> Download(
      const std::string& handle, DType as_dtype = DType::kInvalid,
      const ProgressCallback& progress = nullptr);
  absl::StatusOr<TensorInfo> DownloadInto(
      const std::string& handle, DType as_dtype, void* buffer,
      std::size_t capacity, const ProgressCallback& progress = nullptr);
  absl::StatusOr<TensorInfo> Describe(const std::string& handle);
  absl::StatusOr<int64_t> Release(const std::string& handle);
  absl::StatusOr<TensorInfo> Overwrite(
      const std::string& handle, DType dtype, absl::Span<const int64_t> shape,
      const void* data, std::size_t bytes,
      const ProgressCallback& progress = nullptr);
  absl::StatusOr<TensorInfo> OverwriteFrom(
      const std::string& handle, DType dtype, absl::Span<const int64_t> shape,
      const UploadSource& source, const ProgressCallback& progress = nullptr);
  // INVALID_ARGUMENT before any RPC when a targets or class-weights handle
  // names another instance than the logits.
  absl::StatusOr<ForwardResult> Forward(const std::string& logits,
                                        const Targets& targets,
                                        const ForwardOptions& options = {});
  // INVALID_ARGUMENT before any RPC when a handle it names (weight, bias,
  // targets, class weights, accumulators) lives on another instance than
  // the hidden states.
  absl::StatusOr<LinearForwardResult> LinearForward(
      const std::string& hidden, const std::string& weight,
      const Targets& targets, const LinearForwardOptions& options = {});
  absl::StatusOr<BackwardResult> Backward(const std::string& gradient,
                                          double grad_output,
                                          bool materialize = false);
  absl::StatusOr<BackwardResult> Backward(
      const std::string& gradient, absl::Span<const float> token_grad_output,
      bool materialize = false);

  // Client::Evaluate on the instance holding options.weight (else
  // options.class_weights), else on the one with the most free memory. The
  // producer form is not retried elsewhere (its blocks cannot be replayed); the
  // in-memory form moves on to the next instance on UNAVAILABLE, like Upload.
  absl::StatusOr<EvaluateResult> Evaluate(
      int64_t vocab, DType logits_dtype, DType targets_dtype,
      const EvaluateOptions& options, const RowBlockProducer& next_block,
      const ProgressCallback& progress = nullptr);
  absl::StatusOr<EvaluateResult> Evaluate(
      int64_t rows, int64_t vocab, DType logits_dtype, const void* logits,
      DType targets_dtype, const void* targets, const EvaluateOptions& options,
      int64_t block_rows = 0, const ProgressCallback& progress = nullptr);

  // The caller's tensors on every endpoint (every page of each: Client::List),
  // merged in endpoint order. An endpoint that fails is reported in
  // `instances` and skipped; the call fails (with the first endpoint's error)
  // only when every endpoint fails.
  absl::StatusOr<RoutedListResult> List();

  // Re-resolves DNS names and asks every endpoint for its ServerInfo now.
  // One entry per endpoint, in order; never fails as a whole.
  std::vector<InstanceStatus> Instances();

  // Client::Health of every endpoint, in order: (endpoint, result).
  std::vector<std::pair<std::string, absl::StatusOr<bool>>> Health(
      const std::string& service = "");

 private:
  struct Endpoint;
  struct DnsName;

  explicit RoutingClient(RoutingOptions options);

  // Adds a static endpoint at construction.
  absl::Status AddStatic(const std::string& target);
  // Connects a new endpoint for `address` (not yet in the table).
  absl::StatusOr<std::shared_ptr<Endpoint>> MakeEndpoint(
      const std::string& address, const std::string& dns_name);
  // Resolves the DNS names (all when `force`, else the stale ones) and
  // reconciles the endpoint table; instances of vanished addresses are gone.
  void Resolve(bool force) ABSL_LOCKS_EXCLUDED(mu_);
  // Asks `endpoints` for their ServerInfo, in parallel, and records the
  // answers; an instance id that changed marks the old instance restarted.
  void Probe(const std::vector<std::shared_ptr<Endpoint>>& endpoints)
      ABSL_LOCKS_EXCLUDED(mu_);
  void RecordProbeLocked(Endpoint& endpoint, absl::Status status,
                         const ServerInfo& info)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::shared_ptr<Endpoint>> SnapshotLocked() const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // The endpoint serving the instance of `handle` (see the class comment).
  absl::StatusOr<std::shared_ptr<Endpoint>> Route(const std::string& handle);
  // Reachable endpoints, most free memory first, one per instance.
  absl::StatusOr<std::vector<std::shared_ptr<Endpoint>>> Place();
  // Post-processes the error of a call routed to `endpoint` for `handle`:
  // learns of restarts and turns "left DNS" into NOT_FOUND.
  absl::Status Diagnose(Endpoint& endpoint, const std::string& handle,
                        absl::Status status);
  // Bookkeeping after an upload placed on `endpoint` succeeded.
  void NoteUpload(Endpoint& endpoint, const TensorInfo& info)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Runs `call` on the best placed endpoint, moving on after UNAVAILABLE.
  template <typename T, typename Call>
  absl::StatusOr<T> OnBest(const Call& call);
  template <typename T, typename Call>
  absl::StatusOr<T> OnOwner(const std::string& handle, const Call& call);

  const RoutingOptions options_;
  // One static target and no DNS name: no routing, no probes.
  bool passthrough_ = false;

  mutable absl::Mutex mu_;
  // Static targets first (as given), then each DNS name's addresses, sorted.
  std::vector<std::shared_ptr<Endpoint>> endpoints_ ABSL_GUARDED_BY(mu_);
  std::vector<DnsName> dns_names_ ABSL_GUARDED_BY(mu_);
  // Instance id -> endpoint that serves it now.
  std::map<std::string, std::shared_ptr<Endpoint>> owners_ ABSL_GUARDED_BY(mu_);
  // Instance id -> why it is gone ("127.0.0.1:5 restarted as instance ...").
  std::map<std::string, std::string> gone_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lossd

#endif  // LOSSD_CLIENT_ROUTER_H_
