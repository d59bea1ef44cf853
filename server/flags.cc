// Flag definitions of lossd (see docs/operations.md for their use).
#include "server/flags.h"

#include <algorithm>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/data_wire.h"
#include "common/server_features.h"
#include "common/status_macros.h"

ABSL_FLAG(int, port, 50051, "gRPC port; 0 picks a free one (see --port_file)");
ABSL_FLAG(std::string, host, "0.0.0.0", "address to listen on");
ABSL_FLAG(std::string, device, "auto",
          "auto | cpu | cuda (auto = cuda when built with CUDA and a GPU is "
          "visible, else cpu)");
ABSL_FLAG(std::string, memory_budget, "auto",
          "bytes the tensors may use, e.g. 8G or 512M; auto = half the RAM "
          "(cpu) or most of the device memory (cuda)");
ABSL_FLAG(absl::Duration, ttl, absl::Hours(1),
          "idle tensors are dropped after this long");
ABSL_FLAG(std::string, device_reserve, "2G",
          "cuda: device memory kept out of the automatic --memory_budget "
          "(the budget is the free memory at start minus this)");
ABSL_FLAG(std::string, staging_bytes, "4M",
          "cuda: bytes of one pinned staging buffer (64K to 256M); "
          "transfers move through two a transfer in pieces of this size");
ABSL_FLAG(std::string, chunk_bytes, "1M", "default Download chunk size");
ABSL_FLAG(int, threads, 0, "compute threads of the cpu device; 0 = all cores");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(30),
          "on SIGTERM, how long running RPCs may take before shutdown");
ABSL_FLAG(std::string, port_file, "",
          "write the bound port to this file once serving");
ABSL_FLAG(int, metrics_port, 9090,
          "plain-HTTP port of /metrics (Prometheus), on --host; 0 picks a "
          "free one (see --metrics_port_file), -1 turns metrics off");
ABSL_FLAG(std::string, metrics_port_file, "",
          "write the bound metrics port to this file before --port_file");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain of the server; with --tls_key, the gRPC port "
          "speaks TLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: clients must present a certificate it signed "
          "(mutual TLS), which names their tenant (see --cert_tenant)");
ABSL_FLAG(std::string, cert_tenant, "cn",
          "mutual TLS: the tenant is the client certificate's cn (subject "
          "Common Name), san (first subject alternative name) or san:PREFIX "
          "(first SAN starting with PREFIX, PREFIX removed)");
ABSL_FLAG(std::string, tokens_file, "",
          "bearer tokens, lines 'TOKEN TENANT'; set, every lossd RPC needs "
          "'authorization: Bearer TOKEN'");
ABSL_FLAG(int, health_port, -1,
          "plaintext port serving only grpc.health.v1 (for probes when the "
          "gRPC port needs mutual TLS); 0 picks a free one, -1 = off");
ABSL_FLAG(std::string, health_port_file, "",
          "write the bound health port to this file before --port_file");
ABSL_FLAG(std::string, tenant_max_bytes, "0",
          "per-tenant quota of tensor bytes (uploads in progress included), "
          "e.g. 4G; 0 = none");
ABSL_FLAG(int64_t, tenant_max_tensors, 0,
          "per-tenant quota of tensors held or being uploaded; 0 = none");
ABSL_FLAG(int64_t, tenant_max_inflight, 0,
          "per-tenant quota of lossd RPCs running at once; 0 = none");
ABSL_FLAG(std::string, quota_file, "",
          "per-tenant quotas, lines 'TENANT max_bytes=4G max_tensors=N "
          "max_inflight=N' ('*' = every other tenant), on top of the "
          "--tenant_max_* flags; reloaded when it changes");
ABSL_FLAG(absl::Duration, reload_interval, absl::Seconds(10),
          "how often --tls_cert, --tls_key, --tls_client_ca, --tokens_file "
          "and --quota_file are checked for changes (SIGHUP reloads them "
          "at once)");

ABSL_FLAG(int, data_port, 50052,
          "plain TCP port of upload data connections (an Upload's bytes "
          "straight into pinned memory, no gRPC in between; lossd::Client "
          "uses it for large tensors); 0 picks a free one, -1 = off; off "
          "when the main port uses TLS");
ABSL_FLAG(absl::Duration, data_timeout, absl::Seconds(60),
          "an upload whose data connection does not come, or sends nothing, "
          "for this long fails DEADLINE_EXCEEDED");
ABSL_FLAG(int, data_max_connections, 64,
          "authenticated data connections served at once, each on a thread "
          "of its own (an Evaluate's for the whole evaluation); further ones "
          "wait until one ends. In [1, 4096]");
ABSL_FLAG(absl::Duration, data_auth_timeout, absl::Seconds(1),
          "a data connection that has not sent its preamble naming a "
          "registered token this long after it was accepted is closed "
          "(capped at --data_timeout)");
ABSL_FLAG(int, data_max_unauthenticated_per_peer, 128,
          "data connections of one peer address (IPv6: its /64) that have "
          "not yet named a registered token; further ones are closed at "
          "once. In [64, 65536] (one transfer has up to 64 connections)");
ABSL_FLAG(absl::Duration, stripe_timeout, absl::Seconds(60),
          "a striped Upload whose stripes have not all arrived this long "
          "after the first is abandoned (every stripe fails ABORTED)");
ABSL_FLAG(std::string, advertise_features, "all",
          "for tests of clients against older servers: the comma-separated "
          "names GetServerInfo lists as served ('all' = every feature of "
          "this build; '' = none, as a server from before the list). The "
          "server still serves every feature");

namespace lossd {
namespace {

// --advertise_features: nullopt for "all", else its names, each one this
// build serves.
absl::StatusOr<std::optional<std::vector<std::string>>> AdvertisedFeatures() {
  const std::string flag = absl::GetFlag(FLAGS_advertise_features);
  if (flag == "all") return std::nullopt;
  std::vector<std::string> names;
  for (absl::string_view name : absl::StrSplit(flag, ',', absl::SkipEmpty())) {
    if (std::find(std::begin(kServedFeatures), std::end(kServedFeatures),
                  name) == std::end(kServedFeatures)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--advertise_features names '", name, "'; this build serves ",
          absl::StrJoin(kServedFeatures, ",")));
    }
    names.emplace_back(name);
  }
  return names;
}

}  // namespace

absl::StatusOr<ServerConfig> ConfigFromFlags() {
  ServerConfig config;
  config.port = absl::GetFlag(FLAGS_port);
  config.host = absl::GetFlag(FLAGS_host);
  config.device = absl::GetFlag(FLAGS_device);
  absl::StatusOr<int64_t> budget =
      ParseByteSize(absl::GetFlag(FLAGS_memory_budget));
  if (!budget.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--memory_budget: ", budget.status().message()));
  }
  config.memory_budget = *budget;
  absl::StatusOr<int64_t> reserve =
      ParseByteSize(absl::GetFlag(FLAGS_device_reserve));
  if (!reserve.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device_reserve: ", reserve.status().message()));
  }
  config.device_reserve = *reserve;
  absl::StatusOr<int64_t> staging =
      ParseByteSize(absl::GetFlag(FLAGS_staging_bytes));
  if (!staging.ok() || *staging < (int64_t{64} << 10) ||
      *staging > (int64_t{256} << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--staging_bytes: '", absl::GetFlag(FLAGS_staging_bytes),
                     "' is not a byte count from 64K to 256M"));
  }
  config.staging_bytes = *staging;
  config.ttl = absl::GetFlag(FLAGS_ttl);
  absl::StatusOr<int64_t> chunk =
      ParseByteSize(absl::GetFlag(FLAGS_chunk_bytes));
  if (!chunk.ok() || *chunk <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--chunk_bytes: '", absl::GetFlag(FLAGS_chunk_bytes),
                     "' is not a positive byte count"));
  }
  config.chunk_bytes = *chunk;
  config.threads = absl::GetFlag(FLAGS_threads);
  if (config.threads < 0) {
    return absl::InvalidArgumentError("--threads must be >= 0");
  }
  config.drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  config.port_file = absl::GetFlag(FLAGS_port_file);
  config.metrics_port = absl::GetFlag(FLAGS_metrics_port);
  if (config.metrics_port < -1 || config.metrics_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_port=", config.metrics_port,
                     " is outside [-1, 65535] (-1 = off)"));
  }
  config.metrics_port_file = absl::GetFlag(FLAGS_metrics_port_file);
  config.auth.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  config.auth.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  config.auth.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  config.auth.cert_tenant = absl::GetFlag(FLAGS_cert_tenant);
  config.auth.tokens_file = absl::GetFlag(FLAGS_tokens_file);
  config.health_port = absl::GetFlag(FLAGS_health_port);
  if (config.health_port < -1 || config.health_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--health_port=", config.health_port,
                     " is outside [-1, 65535] (-1 = off)"));
  }
  config.health_port_file = absl::GetFlag(FLAGS_health_port_file);
  absl::StatusOr<int64_t> tenant_bytes =
      ParseByteSize(absl::GetFlag(FLAGS_tenant_max_bytes));
  if (!tenant_bytes.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tenant_max_bytes: ", tenant_bytes.status().message()));
  }
  config.tenant_limits.max_bytes = *tenant_bytes;
  config.tenant_limits.max_tensors = absl::GetFlag(FLAGS_tenant_max_tensors);
  config.tenant_limits.max_in_flight = absl::GetFlag(FLAGS_tenant_max_inflight);
  if (config.tenant_limits.max_tensors < 0 ||
      config.tenant_limits.max_in_flight < 0) {
    return absl::InvalidArgumentError(
        "--tenant_max_tensors and --tenant_max_inflight must be >= 0");
  }
  config.quota_file = absl::GetFlag(FLAGS_quota_file);
  config.reload_interval = absl::GetFlag(FLAGS_reload_interval);
  if (config.reload_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--reload_interval must be positive");
  }
  config.data_port = absl::GetFlag(FLAGS_data_port);
  if (config.data_port < -1 || config.data_port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--data_port=", config.data_port,
                     " is outside [-1, 65535] (-1 = off)"));
  }
  config.data_timeout = absl::GetFlag(FLAGS_data_timeout);
  if (config.data_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--data_timeout must be positive");
  }
  config.data_max_connections = absl::GetFlag(FLAGS_data_max_connections);
  if (config.data_max_connections < 1 || config.data_max_connections > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("--data_max_connections=", config.data_max_connections,
                     " is outside [1, 4096]"));
  }
  config.data_auth_timeout = absl::GetFlag(FLAGS_data_auth_timeout);
  if (config.data_auth_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--data_auth_timeout must be positive");
  }
  config.data_max_unauthenticated_per_peer =
      absl::GetFlag(FLAGS_data_max_unauthenticated_per_peer);
  if (config.data_max_unauthenticated_per_peer < kMaxDataConnections ||
      config.data_max_unauthenticated_per_peer > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("--data_max_unauthenticated_per_peer=",
                     config.data_max_unauthenticated_per_peer, " is outside [",
                     kMaxDataConnections, ", 65536]"));
  }
  config.stripe_timeout = absl::GetFlag(FLAGS_stripe_timeout);
  if (config.stripe_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--stripe_timeout must be positive");
  }
  ASSIGN_OR_RETURN(config.advertised_features, AdvertisedFeatures());
  return config;
}

}  // namespace lossd
