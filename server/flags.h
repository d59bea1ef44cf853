// The command-line flags of the lossd binary and their translation into a
// ServerConfig, kept apart from main so that parsing can be tested.
#ifndef LOSSD_SERVER_FLAGS_H_
#define LOSSD_SERVER_FLAGS_H_

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "server/byte_size.h"
#include "server/server.h"

ABSL_DECLARE_FLAG(int, port);
ABSL_DECLARE_FLAG(std::string, host);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, memory_budget);
ABSL_DECLARE_FLAG(std::string, device_reserve);
ABSL_DECLARE_FLAG(std::string, staging_bytes);
ABSL_DECLARE_FLAG(absl::Duration, ttl);
ABSL_DECLARE_FLAG(std::string, chunk_bytes);
ABSL_DECLARE_FLAG(int, threads);
ABSL_DECLARE_FLAG(absl::Duration, drain_timeout);
ABSL_DECLARE_FLAG(std::string, port_file);
ABSL_DECLARE_FLAG(int, metrics_port);
ABSL_DECLARE_FLAG(std::string, metrics_port_file);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_client_ca);
ABSL_DECLARE_FLAG(std::string, cert_tenant);
ABSL_DECLARE_FLAG(std::string, tokens_file);
ABSL_DECLARE_FLAG(int, health_port);
ABSL_DECLARE_FLAG(std::string, health_port_file);
ABSL_DECLARE_FLAG(std::string, tenant_max_bytes);
ABSL_DECLARE_FLAG(int64_t, tenant_max_tensors);
ABSL_DECLARE_FLAG(int64_t, tenant_max_inflight);
ABSL_DECLARE_FLAG(std::string, quota_file);
ABSL_DECLARE_FLAG(absl::Duration, reload_interval);
ABSL_DECLARE_FLAG(absl::Duration, stripe_timeout);
ABSL_DECLARE_FLAG(std::string, advertise_features);
ABSL_DECLARE_FLAG(int, data_max_connections);
ABSL_DECLARE_FLAG(absl::Duration, data_auth_timeout);
ABSL_DECLARE_FLAG(int, data_max_unauthenticated_per_peer);

namespace lossd {

// The ServerConfig the flags describe. INVALID_ARGUMENT naming the flag when
// one is malformed.
absl::StatusOr<ServerConfig> ConfigFromFlags();

}  // namespace lossd

#endif  // LOSSD_SERVER_FLAGS_H_
