// RoutingClient: the endpoint table (static targets plus DNS answers), what
// each endpoint said its instance is, and the routing and placement built on
// them. The RPCs themselves are lossd::Client's.
#include "client/router.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/handle.h"
#include "common/status_macros.h"

namespace lossd {

namespace {

constexpr int kDefaultPort = 50051;

// "dns:///name:port" or "dns:name:port" (gRPC's spellings without an
// authority), split into name and port. Not a DNS target: name left empty.
struct DnsTarget {
  std::string name;
  int port = kDefaultPort;
};

absl::StatusOr<DnsTarget> ParseDnsTarget(const std::string& target) {
  DnsTarget out;
  absl::string_view rest = target;
  if (absl::ConsumePrefix(&rest, "dns://")) {
    if (!absl::ConsumePrefix(&rest, "/")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "target '", target,
          "': a DNS authority is not supported; use dns:///NAME:PORT"));
    }
  } else if (!absl::ConsumePrefix(&rest, "dns:")) {
    return out;
  }
  absl::string_view host = rest;
  absl::string_view port;
  if (absl::ConsumePrefix(&rest, "[")) {
    const size_t close = rest.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("target '", target, "': unterminated '['"));
    }
    host = rest.substr(0, close);
    rest.remove_prefix(close + 1);
    if (!rest.empty() && !absl::ConsumePrefix(&rest, ":")) {
      return absl::InvalidArgumentError(
          absl::StrCat("target '", target, "': junk after ']'"));
    }
    port = rest;
  } else if (const size_t colon = rest.rfind(':');
             colon != absl::string_view::npos) {
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
  }
  if (host.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("target '", target, "': no host name"));
  }
  out.name = std::string(host);
  if (!port.empty() && (!absl::SimpleAtoi(port, &out.port) || out.port < 1 ||
                        out.port > 65535)) {
    return absl::InvalidArgumentError(
        absl::StrCat("target '", target, "': bad port '", port, "'"));
  }
  return out;
}

// Every address `name` resolves to, as sorted "ip:port" / "[ip6]:port".
absl::StatusOr<std::vector<std::string>> ResolveAll(const DnsTarget& target) {
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* results = nullptr;
  const std::string port = absl::StrCat(target.port);
  const int rc =
      getaddrinfo(target.name.c_str(), port.c_str(), &hints, &results);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve '", target.name, "': ", gai_strerror(rc)));
  }
  std::set<std::string> addresses;
  for (addrinfo* a = results; a != nullptr; a = a->ai_next) {
    char host[NI_MAXHOST];
    if (getnameinfo(a->ai_addr, a->ai_addrlen, host, sizeof(host), nullptr, 0,
                    NI_NUMERICHOST) != 0) {
      continue;
    }
    addresses.insert(a->ai_family == AF_INET6
                         ? absl::StrCat("[", host, "]:", target.port)
                         : absl::StrCat(host, ":", target.port));
  }
  freeaddrinfo(results);
  return std::vector<std::string>(addresses.begin(), addresses.end());
}

// The stored tensor an Evaluate reads, whose instance must run it: the LM
// head's weight, else the class weights; empty when none.
const std::string& EvaluateOwner(const EvaluateOptions& options) {
  return !options.weight.empty() ? options.weight : options.class_weights;
}

}  // namespace

struct RoutingClient::Endpoint {
  std::string address;
  std::string dns_name;  // the name it was resolved from; "" = static
  std::shared_ptr<Client> client;
  // Same connection options but a short deadline, for GetServerInfo probes.
  std::shared_ptr<Client> probe;
  // Guarded by RoutingClient::mu_.
  std::string instance_id;  // last one reported; "" = never reached
  absl::Status probe_status = absl::UnavailableError("not asked yet");
  ServerInfo info;
  absl::Time probed = absl::InfinitePast();
};

struct RoutingClient::DnsName {
  std::string spec;  // as given
  DnsTarget target;
  absl::Time resolved = absl::InfinitePast();
  absl::Status last_error;
};

RoutingClient::RoutingClient(RoutingOptions options)
    : options_(std::move(options)) {}

RoutingClient::~RoutingClient() = default;

absl::StatusOr<std::unique_ptr<RoutingClient>> RoutingClient::Connect(
    std::vector<std::string> targets, RoutingOptions options) {
  if (targets.empty()) return absl::InvalidArgumentError("no lossd targets");
  if (options.probe_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("probe_deadline must be positive");
  }
  if (options.server_info_max_age < absl::ZeroDuration() ||
      options.resolve_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "server_info_max_age and resolve_interval must not be negative");
  }
  auto router = std::unique_ptr<RoutingClient>(new RoutingClient(options));
  std::set<std::string> seen;
  int static_targets = 0;
  for (const std::string& target : targets) {
    if (target.empty()) return absl::InvalidArgumentError("empty target");
    if (!seen.insert(target).second) continue;
    ASSIGN_OR_RETURN(DnsTarget dns, ParseDnsTarget(target));
    if (dns.name.empty()) {
      RETURN_IF_ERROR(router->AddStatic(target));
      ++static_targets;
    } else {
      absl::MutexLock lock(&router->mu_);
      DnsName& name = router->dns_names_.emplace_back();
      name.spec = target;
      name.target = std::move(dns);
    }
  }
  {
    absl::MutexLock lock(&router->mu_);
    router->passthrough_ = static_targets == 1 && router->dns_names_.empty();
  }
  if (static_targets == 0) {
    // Only DNS names: check the connection options now anyway, as a static
    // target would have (an idle channel contacts nothing).
    RETURN_IF_ERROR(Client::Connect("127.0.0.1:1", options.client).status());
  }
  return router;
}

absl::StatusOr<std::shared_ptr<RoutingClient::Endpoint>>
RoutingClient::MakeEndpoint(const std::string& address,
                            const std::string& dns_name) {
  auto endpoint = std::make_shared<Endpoint>();
  endpoint->address = address;
  endpoint->dns_name = dns_name;
  ASSIGN_OR_RETURN(endpoint->client, Client::Connect(address, options_.client));
  ClientOptions probe_options = options_.client;
  probe_options.deadline =
      std::min(options_.client.deadline, options_.probe_deadline);
  ASSIGN_OR_RETURN(endpoint->probe, Client::Connect(address, probe_options));
  return endpoint;
}

absl::Status RoutingClient::AddStatic(const std::string& target) {
  ASSIGN_OR_RETURN(std::shared_ptr<Endpoint> endpoint,
                   MakeEndpoint(target, ""));
  absl::MutexLock lock(&mu_);
  endpoints_.push_back(std::move(endpoint));
  return absl::OkStatus();
}

std::vector<std::shared_ptr<RoutingClient::Endpoint>>
RoutingClient::SnapshotLocked() const {
  return endpoints_;
}

absl::StatusOr<std::string> RoutingClient::InstanceOf(
    const std::string& handle) {
  RETURN_IF_ERROR(CheckHandle(handle, "handle"));
  return handle.substr(0, kHandleInstanceHexDigits);
}

void RoutingClient::Resolve(bool force) {
  std::vector<DnsName> due;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (const DnsName& name : dns_names_) {
      if (force || now - name.resolved > options_.resolve_interval) {
        due.push_back(name);
      }
    }
  }
  for (DnsName& name : due) {
    absl::StatusOr<std::vector<std::string>> addresses =
        ResolveAll(name.target);
    // Connect outside the lock; the table is reconciled below by address,
    // so a concurrent Resolve only wastes an idle channel.
    std::vector<std::shared_ptr<Endpoint>> fresh;
    if (addresses.ok()) {
      for (const std::string& address : *addresses) {
        absl::StatusOr<std::shared_ptr<Endpoint>> endpoint =
            MakeEndpoint(address, name.spec);
        if (endpoint.ok()) fresh.push_back(*std::move(endpoint));
      }
    }
    absl::MutexLock lock(&mu_);
    for (DnsName& known : dns_names_) {
      if (known.spec != name.spec) continue;
      known.resolved = absl::Now();
      known.last_error = addresses.status();
    }
    // A failed lookup keeps the previous answer: DNS hiccups must not make
    // live instances look gone.
    if (!addresses.ok()) continue;
    const std::set<std::string> current(addresses->begin(), addresses->end());
    std::vector<std::shared_ptr<Endpoint>> kept;
    std::set<std::string> have;
    for (std::shared_ptr<Endpoint>& endpoint : endpoints_) {
      if (endpoint->dns_name == name.spec &&
          current.count(endpoint->address) == 0) {
        const std::string& id = endpoint->instance_id;
        if (!id.empty()) {
          auto owner = owners_.find(id);
          if (owner != owners_.end() && owner->second == endpoint) {
            owners_.erase(owner);
            gone_[id] =
                absl::StrCat("its endpoint ", endpoint->address, " left ",
                             name.spec, " (pod removed or not ready)");
          }
        }
        continue;
      }
      have.insert(endpoint->address);
      kept.push_back(std::move(endpoint));
    }
    for (std::shared_ptr<Endpoint>& endpoint : fresh) {
      if (have.insert(endpoint->address).second) {
        kept.push_back(std::move(endpoint));
      }
    }
    endpoints_ = std::move(kept);
  }
}

void RoutingClient::RecordProbeLocked(Endpoint& endpoint, absl::Status status,
                                      const ServerInfo& info) {
  endpoint.probe_status = std::move(status);
  endpoint.probed = absl::Now();
  if (!endpoint.probe_status.ok()) return;
  endpoint.info = info;
  if (endpoint.instance_id != info.instance_id) {
    const std::string& old_id = endpoint.instance_id;
    if (!old_id.empty()) {
      auto owner = owners_.find(old_id);
      if (owner != owners_.end() && owner->second.get() == &endpoint) {
        owners_.erase(owner);
      }
      gone_[old_id] = absl::StrCat(endpoint.address, " restarted as instance ",
                                   info.instance_id);
    }
    endpoint.instance_id = info.instance_id;
  }
  gone_.erase(info.instance_id);
  // An instance reachable at two addresses (A and AAAA records of one pod)
  // keeps the first endpoint that reported it while that one still does.
  auto owner = owners_.find(info.instance_id);
  if (owner == owners_.end() ||
      owner->second->instance_id != info.instance_id) {
    for (const std::shared_ptr<Endpoint>& candidate : endpoints_) {
      if (candidate.get() == &endpoint) {
        owners_[info.instance_id] = candidate;
        break;
      }
    }
  }
}

void RoutingClient::Probe(
    const std::vector<std::shared_ptr<Endpoint>>& endpoints) {
  std::vector<absl::StatusOr<ServerInfo>> answers(
      endpoints.size(), absl::UnavailableError("not asked"));
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < endpoints.size(); ++i) {
      threads.emplace_back([&answers, &endpoints, i] {
        answers[i] = endpoints[i]->probe->GetServerInfo();
      });
    }
    for (std::thread& thread : threads) thread.join();
  }
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < endpoints.size(); ++i) {
    RecordProbeLocked(*endpoints[i], answers[i].status(),
                      answers[i].ok() ? *answers[i] : ServerInfo());
  }
}

absl::StatusOr<std::shared_ptr<RoutingClient::Endpoint>> RoutingClient::Route(
    const std::string& handle) {
  if (passthrough_) {
    absl::MutexLock lock(&mu_);
    return endpoints_.front();
  }
  ASSIGN_OR_RETURN(const std::string instance, InstanceOf(handle));
  const auto gone_error = [&](const std::string& why) {
    return absl::NotFoundError(absl::StrCat("handle ", handle,
                                            " belongs to instance ", instance,
                                            ", which is gone: ", why));
  };
  {
    absl::MutexLock lock(&mu_);
    auto owner = owners_.find(instance);
    if (owner != owners_.end()) return owner->second;
    auto gone = gone_.find(instance);
    if (gone != gone_.end()) return gone_error(gone->second);
  }
  // Unknown: a new pod behind the DNS name, or an endpoint not asked yet.
  Resolve(/*force=*/true);
  std::vector<std::shared_ptr<Endpoint>> endpoints;
  {
    absl::MutexLock lock(&mu_);
    endpoints = SnapshotLocked();
  }
  Probe(endpoints);
  absl::MutexLock lock(&mu_);
  auto owner = owners_.find(instance);
  if (owner != owners_.end()) return owner->second;
  auto gone = gone_.find(instance);
  if (gone != gone_.end()) return gone_error(gone->second);
  std::vector<std::string> seen;
  for (const std::shared_ptr<Endpoint>& endpoint : endpoints_) {
    seen.push_back(
        endpoint->probe_status.ok()
            ? absl::StrCat(endpoint->address, " is ", endpoint->instance_id)
            : absl::StrCat(endpoint->address, " unreachable"));
  }
  return absl::NotFoundError(absl::StrCat(
      "handle ", handle, " belongs to instance ", instance,
      ", which none of the ", endpoints_.size(),
      " lossd endpoints serves: the instance restarted or was removed (",
      absl::StrJoin(seen, ", "), ")"));
}

absl::StatusOr<std::vector<std::shared_ptr<RoutingClient::Endpoint>>>
RoutingClient::Place() {
  std::vector<std::shared_ptr<Endpoint>> endpoints;
  if (passthrough_) {
    absl::MutexLock lock(&mu_);
    return SnapshotLocked();
  }
  Resolve(/*force=*/false);
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (const std::shared_ptr<Endpoint>& endpoint : endpoints_) {
      if (now - endpoint->probed >= options_.server_info_max_age) {
        endpoints.push_back(endpoint);
      }
    }
  }
  Probe(endpoints);
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Endpoint>> reachable;
  std::vector<std::string> errors;
  std::set<std::string> instances;
  for (const std::shared_ptr<Endpoint>& endpoint : endpoints_) {
    if (!endpoint->probe_status.ok()) {
      errors.push_back(absl::StrCat(endpoint->address, ": ",
                                    endpoint->probe_status.ToString()));
    } else if (instances.insert(endpoint->instance_id).second) {
      reachable.push_back(endpoint);
    }
  }
  for (const DnsName& name : dns_names_) {
    if (!name.last_error.ok()) errors.push_back(name.last_error.ToString());
  }
  if (reachable.empty()) {
    return absl::UnavailableError(absl::StrCat("no lossd instance answered",
                                               errors.empty() ? "" : ": ",
                                               absl::StrJoin(errors, "; ")));
  }
  std::stable_sort(reachable.begin(), reachable.end(),
                   [](const std::shared_ptr<Endpoint>& a,
                      const std::shared_ptr<Endpoint>& b) {
                     return a->info.free_bytes > b->info.free_bytes;
                   });
  return reachable;
}

absl::Status RoutingClient::Diagnose(Endpoint& endpoint,
                                     const std::string& handle,
                                     absl::Status status) {
  if (passthrough_) return status;
  if (status.code() == absl::StatusCode::kNotFound &&
      absl::StrContains(status.message(), "this is instance")) {
    // The endpoint restarted: learn its new id so that the other handles of
    // the old instance fail without an RPC. The server's message stands.
    absl::StatusOr<ServerInfo> info = endpoint.probe->GetServerInfo();
    absl::MutexLock lock(&mu_);
    RecordProbeLocked(endpoint, info.status(),
                      info.ok() ? *info : ServerInfo());
    return status;
  }
  if (status.code() != absl::StatusCode::kUnavailable) return status;
  {
    absl::MutexLock lock(&mu_);
    endpoint.probed = absl::InfinitePast();  // placement asks again
  }
  if (endpoint.dns_name.empty()) return status;
  Resolve(/*force=*/true);
  absl::MutexLock lock(&mu_);
  for (const std::shared_ptr<Endpoint>& current : endpoints_) {
    if (current.get() == &endpoint) return status;
  }
  return absl::NotFoundError(
      absl::StrCat("handle ", handle, " belongs to instance ",
                   endpoint.instance_id, ", which is gone: its endpoint ",
                   endpoint.address, " left ", endpoint.dns_name,
                   " (pod removed or not ready); it said: ", status.message()));
}

template <typename T, typename Call>
absl::StatusOr<T> RoutingClient::OnBest(const Call& call) {
  ASSIGN_OR_RETURN(std::vector<std::shared_ptr<Endpoint>> candidates, Place());
  absl::Status last;
  for (const std::shared_ptr<Endpoint>& endpoint : candidates) {
    absl::StatusOr<T> result = call(*endpoint);
    if (result.ok() ||
        result.status().code() != absl::StatusCode::kUnavailable) {
      return result;
    }
    last = result.status();
    absl::MutexLock lock(&mu_);
    endpoint->probed = absl::InfinitePast();
  }
  return last;
}

template <typename T, typename Call>
absl::StatusOr<T> RoutingClient::OnOwner(const std::string& handle,
                                         const Call& call) {
  ASSIGN_OR_RETURN(std::shared_ptr<Endpoint> endpoint, Route(handle));
  absl::StatusOr<T> result = call(*endpoint->client);
  if (!result.ok()) return Diagnose(*endpoint, handle, result.status());
  return result;
}

void RoutingClient::NoteUpload(Endpoint& endpoint, const TensorInfo& info) {
  absl::MutexLock lock(&mu_);
  // Keeps a cached figure (server_info_max_age > 0) roughly current.
  endpoint.info.free_bytes -= info.bytes;
  absl::StatusOr<std::string> instance = InstanceOf(info.handle);
  if (!instance.ok() || *instance != endpoint.instance_id) {
    endpoint.probed = absl::InfinitePast();  // restarted since the probe
  }
}

absl::StatusOr<TensorInfo> RoutingClient::Upload(
    DType dtype, absl::Span<const int64_t> shape, const void* data,
    std::size_t bytes, const std::string& label,
    const ProgressCallback& progress) {
  return OnBest<TensorInfo>(
      [&](Endpoint& endpoint) -> absl::StatusOr<TensorInfo> {
        ASSIGN_OR_RETURN(TensorInfo info,
                         endpoint.client->Upload(dtype, shape, data, bytes,
                                                 label, progress));
        NoteUpload(endpoint, info);
        return info;
      });
}

absl::StatusOr<TensorInfo> RoutingClient::UploadColocated(
    const std::string& near, DType dtype, absl::Span<const int64_t> shape,
    const void* data, std::size_t bytes, const std::string& label,
    const ProgressCallback& progress) {
  return OnOwner<TensorInfo>(near, [&](Client& client) {
    return client.Upload(dtype, shape, data, bytes, label, progress);
  });
}

absl::StatusOr<TensorInfo> RoutingClient::UploadFrom(
    DType dtype, absl::Span<const int64_t> shape, const UploadSource& source,
    const std::string& label, const ProgressCallback& progress,
    const std::string& near, const std::string& idempotency_key) {
  if (!near.empty()) {
    return OnOwner<TensorInfo>(near, [&](Client& client) {
      return client.UploadFrom(dtype, shape, source, label, progress,
                               idempotency_key);
    });
  }
  return OnBest<TensorInfo>(
      [&](Endpoint& endpoint) -> absl::StatusOr<TensorInfo> {
        ASSIGN_OR_RETURN(TensorInfo info, endpoint.client->UploadFrom(
                                              dtype, shape, source, label,
                                              progress, idempotency_key));
        NoteUpload(endpoint, info);
        return info;
      });
}

absl::StatusOr<TensorInfo> RoutingClient::DownloadTo(
    const std::string& handle, DType as_dtype,
    const std::function<absl::Status(const TensorInfo&)>& on_header,
    const DownloadSink& sink, const ProgressCallback& progress) {
  return OnOwner<TensorInfo>(handle, [&](Client& client) {
    return client.DownloadTo(handle, as_dtype, on_header, sink, progress);
  });
}

absl::Status RoutingClient::DownloadStream(
    const std::string& handle, DType as_dtype,
    const std::function<absl::Status(const TensorInfo&)>& on_header,
    const std::function<absl::Status(const void*, std::size_t)>& on_chunk,
    const ProgressCallback& progress) {
  return OnOwner<bool>(handle,
                       [&](Client& client) -> absl::StatusOr<bool> {
                         RETURN_IF_ERROR(client.DownloadStream(
                             handle, as_dtype, on_header, on_chunk, progress));
                         return true;
                       })
      .status();
}

absl::StatusOr<DownloadedTensor> RoutingClient::Download(
    const std::string& handle, DType as_dtype,
    const ProgressCallback& progress) {
  return OnOwner<DownloadedTensor>(handle, [&](Client& client) {
    return client.Download(handle, as_dtype, progress);
  });
}

absl::StatusOr<TensorInfo> RoutingClient::DownloadInto(
    const std::string& handle, DType as_dtype, void* buffer,
    std::size_t capacity, const ProgressCallback& progress) {
  return OnOwner<TensorInfo>(handle, [&](Client& client) {
    return client.DownloadInto(handle, as_dtype, buffer, capacity, progress);
  });
}

absl::StatusOr<TensorInfo> RoutingClient::Describe(const std::string& handle) {
  return OnOwner<TensorInfo>(
      handle, [&](Client& client) { return client.Describe(handle); });
}

absl::StatusOr<int64_t> RoutingClient::Release(const std::string& handle) {
  return OnOwner<int64_t>(
      handle, [&](Client& client) { return client.Release(handle); });
}

absl::StatusOr<TensorInfo> RoutingClient::Overwrite(
    const std::string& handle, DType dtype, absl::Span<const int64_t> shape,
    const void* data, std::size_t bytes, const ProgressCallback& progress) {
  return OnOwner<TensorInfo>(handle, [&](Client& client) {
    return client.Overwrite(handle, dtype, shape, data, bytes, progress);
  });
}

absl::StatusOr<TensorInfo> RoutingClient::OverwriteFrom(
    const std::string& handle, DType dtype, absl::Span<const int64_t> shape,
    const UploadSource& source, const ProgressCallback& progress) {
  return OnOwner<TensorInfo>(handle, [&](Client& client) {
    return client.OverwriteFrom(handle, dtype, shape, source, progress);
  });
}

namespace {

// `check(what, handle)` for every handle of a post-training loss (Forward's
// and LinearForward's options alike).
template <typename Options, typename Check>
absl::Status CheckPostTrainingHandles(const Options& options,
                                      const Check& check) {
  if (options.distillation.has_value()) {
    const DistillationOptions& distillation = *options.distillation;
    RETURN_IF_ERROR(check("teacher_logits", distillation.teacher_logits));
    RETURN_IF_ERROR(check("top_k_indices", distillation.top_k_indices.handle));
    RETURN_IF_ERROR(
        check("top_k_logprobs", distillation.top_k_logprobs.handle));
  }
  if (options.policy.has_value()) {
    RETURN_IF_ERROR(check("advantages", options.policy->advantages.handle));
    RETURN_IF_ERROR(
        check("sampling_logprobs", options.policy->sampling_logprobs.handle));
    RETURN_IF_ERROR(
        check("reference_logprobs", options.policy->reference_logprobs.handle));
  }
  if (options.segments.has_value()) {
    RETURN_IF_ERROR(check("segment ids", options.segments->ids.handle));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ForwardResult> RoutingClient::Forward(
    const std::string& logits, const Targets& targets,
    const ForwardOptions& options) {
  // Only handles that carry an instance id are compared; malformed ones are
  // the owner's to reject.
  absl::StatusOr<std::string> home = InstanceOf(logits);
  const auto check = [&](const char* what,
                         const std::string& handle) -> absl::Status {
    if (handle.empty() || !home.ok()) return absl::OkStatus();
    absl::StatusOr<std::string> instance = InstanceOf(handle);
    if (!instance.ok() || *instance == *home) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        what, " ", handle, " lives on instance ", *instance, ", the logits ",
        logits, " on instance ", *home,
        ": a Forward's tensors must share one instance (upload them with "
        "UploadColocated, or send the targets inline)"));
  };
  RETURN_IF_ERROR(check("targets", targets.handle));
  RETURN_IF_ERROR(check("class_weights", options.class_weights));
  RETURN_IF_ERROR(CheckPostTrainingHandles(options, check));
  return OnOwner<ForwardResult>(logits, [&](Client& client) {
    return client.Forward(logits, targets, options);
  });
}

absl::StatusOr<LinearForwardResult> RoutingClient::LinearForward(
    const std::string& hidden, const std::string& weight,
    const Targets& targets, const LinearForwardOptions& options) {
  absl::StatusOr<std::string> home = InstanceOf(hidden);
  const std::pair<const char*, const std::string*> named[] = {
      {"weight", &weight},
      {"bias", &options.bias},
      {"targets", &targets.handle},
      {"class_weights", &options.class_weights},
      {"weight_grad", &options.weight_grad},
      {"bias_grad", &options.bias_grad}};
  const auto check = [&](const char* what,
                         const std::string& handle) -> absl::Status {
    if (handle.empty() || !home.ok()) return absl::OkStatus();
    absl::StatusOr<std::string> instance = InstanceOf(handle);
    if (!instance.ok() || *instance == *home) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        what, " ", handle, " lives on instance ", *instance,
        ", the hidden states ", hidden, " on instance ", *home,
        ": a LinearForward's tensors must share one instance (upload them "
        "with UploadColocated)"));
  };
  for (const auto& [what, handle] : named) {
    RETURN_IF_ERROR(check(what, *handle));
  }
  RETURN_IF_ERROR(CheckPostTrainingHandles(options, check));
  return OnOwner<LinearForwardResult>(hidden, [&](Client& client) {
    return client.LinearForward(hidden, weight, targets, options);
  });
}

absl::StatusOr<BackwardResult> RoutingClient::Backward(
    const std::string& gradient, double grad_output, bool materialize) {
  return OnOwner<BackwardResult>(gradient, [&](Client& client) {
    return client.Backward(gradient, grad_output, materialize);
  });
}

absl::StatusOr<BackwardResult> RoutingClient::Backward(
    const std::string& gradient, absl::Span<const float> token_grad_output,
    bool materialize) {
  return OnOwner<BackwardResult>(gradient, [&](Client& client) {
    return client.Backward(gradient, token_grad_output, materialize);
  });
}

absl::StatusOr<EvaluateResult> RoutingClient::Evaluate(
    int64_t vocab, DType logits_dtype, DType targets_dtype,
    const EvaluateOptions& options, const RowBlockProducer& next_block,
    const ProgressCallback& progress) {
  const auto call = [&](Client& client) {
    return client.Evaluate(vocab, logits_dtype, targets_dtype, options,
                           next_block, progress);
  };
  if (const std::string& owner = EvaluateOwner(options); !owner.empty()) {
    return OnOwner<EvaluateResult>(owner, call);
  }
  ASSIGN_OR_RETURN(std::vector<std::shared_ptr<Endpoint>> candidates, Place());
  return call(*candidates.front()->client);
}

absl::StatusOr<EvaluateResult> RoutingClient::Evaluate(
    int64_t rows, int64_t vocab, DType logits_dtype, const void* logits,
    DType targets_dtype, const void* targets, const EvaluateOptions& options,
    int64_t block_rows, const ProgressCallback& progress) {
  const auto call = [&](Client& client) {
    return client.Evaluate(rows, vocab, logits_dtype, logits, targets_dtype,
                           targets, options, block_rows, progress);
  };
  if (const std::string& owner = EvaluateOwner(options); !owner.empty()) {
    return OnOwner<EvaluateResult>(owner, call);
  }
  return OnBest<EvaluateResult>(
      [&](Endpoint& endpoint) { return call(*endpoint.client); });
}

absl::StatusOr<RoutedListResult> RoutingClient::List() {
  Resolve(/*force=*/false);
  std::vector<std::shared_ptr<Endpoint>> endpoints;
  {
    absl::MutexLock lock(&mu_);
    endpoints = SnapshotLocked();
  }
  RoutedListResult result;
  absl::Status first_error;
  std::set<std::string> instances;
  for (const std::shared_ptr<Endpoint>& endpoint : endpoints) {
    absl::StatusOr<ListResult> list = endpoint->client->List();
    InstanceStatus& entry = result.instances.emplace_back();
    entry.endpoint = endpoint->address;
    entry.status = list.status();
    if (!list.ok()) {
      if (first_error.ok()) first_error = list.status();
      continue;
    }
    entry.info = list->server;
    {
      absl::MutexLock lock(&mu_);
      RecordProbeLocked(*endpoint, absl::OkStatus(), list->server);
    }
    // One pod at two addresses lists its tensors once.
    if (!instances.insert(list->server.instance_id).second) continue;
    result.tensors.insert(result.tensors.end(), list->tensors.begin(),
                          list->tensors.end());
  }
  if (instances.empty()) {
    if (first_error.ok()) {
      absl::MutexLock lock(&mu_);
      for (const DnsName& name : dns_names_) {
        if (!name.last_error.ok()) return name.last_error;
      }
      return absl::UnavailableError("no lossd endpoint");
    }
    return first_error;
  }
  return result;
}

std::vector<InstanceStatus> RoutingClient::Instances() {
  Resolve(/*force=*/true);
  std::vector<std::shared_ptr<Endpoint>> endpoints;
  {
    absl::MutexLock lock(&mu_);
    endpoints = SnapshotLocked();
  }
  Probe(endpoints);
  std::vector<InstanceStatus> result;
  absl::MutexLock lock(&mu_);
  for (const std::shared_ptr<Endpoint>& endpoint : endpoints) {
    InstanceStatus& entry = result.emplace_back();
    entry.endpoint = endpoint->address;
    entry.status = endpoint->probe_status;
    entry.info = endpoint->info;
  }
  for (const DnsName& name : dns_names_) {
    if (!name.last_error.ok()) {
      result.push_back(InstanceStatus{name.spec, name.last_error, {}});
    }
  }
  return result;
}

std::vector<std::pair<std::string, absl::StatusOr<bool>>> RoutingClient::Health(
    const std::string& service) {
  Resolve(/*force=*/false);
  std::vector<std::shared_ptr<Endpoint>> endpoints;
  std::vector<std::pair<std::string, absl::StatusOr<bool>>> result;
  {
    absl::MutexLock lock(&mu_);
    endpoints = SnapshotLocked();
    for (const DnsName& name : dns_names_) {
      if (!name.last_error.ok())
        result.emplace_back(name.spec, name.last_error);
    }
  }
  for (const std::shared_ptr<Endpoint>& endpoint : endpoints) {
    result.emplace_back(endpoint->address, endpoint->client->Health(service));
  }
  return result;
}

}  // namespace lossd
