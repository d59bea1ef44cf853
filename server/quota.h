// Per-tenant quotas (bytes, tensors, in-flight RPCs): one tenant cannot use up
// what the device budget leaves for the others. The device budget itself
// stays in the TensorStore; these limits come on top of it.
#ifndef LOSSD_SERVER_QUOTA_H_
#define LOSSD_SERVER_QUOTA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace lossd {

// Limits of one tenant; 0 means unlimited.
struct TenantLimits {
  int64_t max_bytes = 0;      // reserved + held tensor bytes
  int64_t max_tensors = 0;    // tensors being uploaded or held
  int64_t max_in_flight = 0;  // RPCs of lossd.v1.Lossd running at once
};

// The limits of a quota file (docs/operations.md, Quotas): one default for
// every tenant it does not name, and the tenants it names.
struct QuotaConfig {
  TenantLimits defaults;
  absl::flat_hash_map<std::string, TenantLimits> overrides;
};

// Parses the text of a quota file on top of `base` (the --tenant_max_* flags):
// lines "TENANT KEY=VALUE..." with KEY one of max_bytes (a byte count such as
// 4G), max_tensors, max_inflight; TENANT "*" is the default line, whose keys
// replace `base`'s; a tenant's line starts from the defaults and replaces the
// keys it names. '#' starts a comment. INVALID_ARGUMENT for an empty text
// (nothing but whitespace; one with only comments sets no limit), and naming
// the line for an unknown key, a malformed or negative value, a repeated
// tenant, or a line without a key.
absl::StatusOr<QuotaConfig> ParseQuotaFile(absl::string_view text,
                                           TenantLimits base);

// What a tenant uses now.
struct QuotaUsage {
  int64_t bytes = 0;
  int64_t tensors = 0;
  int64_t in_flight = 0;
};

class TenantQuotas;

namespace internal {
class QuotaLedger;
}  // namespace internal

// One tensor's share of its tenant's quota (its bytes and a count of one),
// or an RPC's working bytes (no count), returned when the charge is destroyed.
// Holds the ledger alive, so it may outlive the TenantQuotas that made it (a
// tensor freed after shutdown). Movable, not copyable; not thread-safe (one
// owner).
class QuotaCharge {
 public:
  QuotaCharge() = default;
  QuotaCharge(QuotaCharge&& other) noexcept;
  QuotaCharge& operator=(QuotaCharge&& other) noexcept;
  ~QuotaCharge();

 private:
  friend class TenantQuotas;
  QuotaCharge(std::shared_ptr<internal::QuotaLedger> ledger, std::string tenant,
              int64_t bytes, int64_t tensors);
  void Reset();

  std::shared_ptr<internal::QuotaLedger> ledger_;
  std::string tenant_;
  int64_t bytes_ = 0;
  int64_t tensors_ = 0;  // 1 for a tensor, 0 for working bytes
};

// One running RPC of a tenant, returned when destroyed. Movable, not
// copyable; not thread-safe (one owner).
class InFlightSlot {
 public:
  InFlightSlot() = default;
  InFlightSlot(InFlightSlot&& other) noexcept;
  InFlightSlot& operator=(InFlightSlot&& other) noexcept;
  ~InFlightSlot();

 private:
  friend class TenantQuotas;
  InFlightSlot(std::shared_ptr<internal::QuotaLedger> ledger,
               std::string tenant);
  void Reset();

  std::shared_ptr<internal::QuotaLedger> ledger_;
  std::string tenant_;
};

// The quota books of every tenant. Thread-safe.
class TenantQuotas {
 public:
  // `defaults` apply to every tenant without an entry in `overrides`.
  explicit TenantQuotas(
      TenantLimits defaults,
      absl::flat_hash_map<std::string, TenantLimits> overrides = {});
  TenantQuotas(const TenantQuotas&) = delete;
  TenantQuotas& operator=(const TenantQuotas&) = delete;
  ~TenantQuotas();

  // Charges one tensor of `bytes` to `tenant`. RESOURCE_EXHAUSTED naming the
  // tenant, the request, its usage and its limit when either the byte or the
  // tensor limit would be passed; nothing is charged then.
  absl::StatusOr<QuotaCharge> ChargeTensor(const std::string& tenant,
                                           int64_t bytes);

  // Charges `bytes` that an RPC of `tenant` holds while it runs (a host
  // buffer, no tensor) to its byte quota. RESOURCE_EXHAUSTED as
  // ChargeTensor's byte limit; the tensor limit does not apply.
  absl::StatusOr<QuotaCharge> ChargeBytes(const std::string& tenant,
                                          int64_t bytes);

  // Counts one running RPC of `tenant`. RESOURCE_EXHAUSTED (naming the
  // numbers) when the tenant already runs its limit.
  absl::StatusOr<InFlightSlot> EnterRpc(const std::string& tenant);

  // Replaces every limit (live reload). Charges and slots already taken stay;
  // the next ChargeTensor or EnterRpc is judged by the new limits.
  void SetLimits(TenantLimits defaults,
                 absl::flat_hash_map<std::string, TenantLimits> overrides);

  TenantLimits LimitsOf(const std::string& tenant) const;
  QuotaUsage UsageOf(const std::string& tenant) const;
  // The tenants that have limits of their own, sorted.
  std::vector<std::string> ConfiguredTenants() const;

 private:
  const std::shared_ptr<internal::QuotaLedger> ledger_;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_QUOTA_H_
