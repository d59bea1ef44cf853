// TenantQuotas: the per-tenant books behind RESOURCE_EXHAUSTED for quotas.
#include "server/quota.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace lossd {
namespace internal {

// Shared by TenantQuotas and every outstanding charge and slot, so that
// returning one after the quotas are gone stays safe.
class QuotaLedger {
 public:
  QuotaLedger(TenantLimits defaults,
              absl::flat_hash_map<std::string, TenantLimits> overrides)
      : defaults_(defaults), overrides_(std::move(overrides)) {}

  TenantLimits LimitsOf(const std::string& tenant) const {
    auto it = overrides_.find(tenant);
    return it == overrides_.end() ? defaults_ : it->second;
  }

  absl::Status Charge(const std::string& tenant, int64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_) {
    const TenantLimits limits = LimitsOf(tenant);
    absl::MutexLock lock(&mu_);
    QuotaUsage& usage = usage_[tenant];
    if (limits.max_tensors > 0 && usage.tensors >= limits.max_tensors) {
      const int64_t tensors = usage.tensors;
      DropIfIdleLocked(tenant);
      return absl::ResourceExhaustedError(absl::StrFormat(
          "tenant '%s' tensor quota exceeded: %d of %d tensors held", tenant,
          tensors, limits.max_tensors));
    }
    if (limits.max_bytes > 0 && bytes > limits.max_bytes - usage.bytes) {
      const int64_t used = usage.bytes;
      DropIfIdleLocked(tenant);
      return absl::ResourceExhaustedError(absl::StrFormat(
          "tenant '%s' byte quota exceeded: requested %d bytes, %d of %d "
          "bytes used (%d free)",
          tenant, bytes, used, limits.max_bytes, limits.max_bytes - used));
    }
    usage.bytes += bytes;
    ++usage.tensors;
    return absl::OkStatus();
  }

  void Uncharge(const std::string& tenant, int64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    QuotaUsage& usage = usage_[tenant];
    usage.bytes -= bytes;
    --usage.tensors;
    DropIfIdleLocked(tenant);
  }

  absl::Status Enter(const std::string& tenant) ABSL_LOCKS_EXCLUDED(mu_) {
    const TenantLimits limits = LimitsOf(tenant);
    absl::MutexLock lock(&mu_);
    QuotaUsage& usage = usage_[tenant];
    if (limits.max_in_flight > 0 && usage.in_flight >= limits.max_in_flight) {
      const int64_t running = usage.in_flight;
      return absl::ResourceExhaustedError(absl::StrFormat(
          "tenant '%s' in-flight RPC quota exceeded: %d of %d RPCs running",
          tenant, running, limits.max_in_flight));
    }
    ++usage.in_flight;
    return absl::OkStatus();
  }

  void Leave(const std::string& tenant) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    --usage_[tenant].in_flight;
    DropIfIdleLocked(tenant);
  }

  QuotaUsage UsageOf(const std::string& tenant) const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto it = usage_.find(tenant);
    return it == usage_.end() ? QuotaUsage() : it->second;
  }

 private:
  // Tenants come and go (one per certificate, say): an idle one leaves no
  // entry behind.
  void DropIfIdleLocked(const std::string& tenant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = usage_.find(tenant);
    if (it != usage_.end() && it->second.bytes == 0 &&
        it->second.tensors == 0 && it->second.in_flight == 0) {
      usage_.erase(it);
    }
  }

  const TenantLimits defaults_;
  const absl::flat_hash_map<std::string, TenantLimits> overrides_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, QuotaUsage> usage_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal

// ---------------------------------------------------------------- charge

QuotaCharge::QuotaCharge(std::shared_ptr<internal::QuotaLedger> ledger,
                         std::string tenant, int64_t bytes)
    : ledger_(std::move(ledger)), tenant_(std::move(tenant)), bytes_(bytes) {}

QuotaCharge::QuotaCharge(QuotaCharge&& other) noexcept
    : ledger_(std::move(other.ledger_)),
      tenant_(std::move(other.tenant_)),
      bytes_(other.bytes_) {
  other.ledger_.reset();
}

QuotaCharge& QuotaCharge::operator=(QuotaCharge&& other) noexcept {
  if (this != &other) {
    Reset();
    ledger_ = std::move(other.ledger_);
    tenant_ = std::move(other.tenant_);
    bytes_ = other.bytes_;
    other.ledger_.reset();
  }
  return *this;
}

QuotaCharge::~QuotaCharge() { Reset(); }

void QuotaCharge::Reset() {
  if (ledger_ == nullptr) return;
  ledger_->Uncharge(tenant_, bytes_);
  ledger_.reset();
}

// ---------------------------------------------------------------- slot

InFlightSlot::InFlightSlot(std::shared_ptr<internal::QuotaLedger> ledger,
                           std::string tenant)
    : ledger_(std::move(ledger)), tenant_(std::move(tenant)) {}

InFlightSlot::InFlightSlot(InFlightSlot&& other) noexcept
    : ledger_(std::move(other.ledger_)), tenant_(std::move(other.tenant_)) {
  other.ledger_.reset();
}

InFlightSlot& InFlightSlot::operator=(InFlightSlot&& other) noexcept {
  if (this != &other) {
    Reset();
    ledger_ = std::move(other.ledger_);
    tenant_ = std::move(other.tenant_);
    other.ledger_.reset();
  }
  return *this;
}

InFlightSlot::~InFlightSlot() { Reset(); }

void InFlightSlot::Reset() {
  if (ledger_ == nullptr) return;
  ledger_->Leave(tenant_);
  ledger_.reset();
}

// ---------------------------------------------------------------- quotas

TenantQuotas::TenantQuotas(
    TenantLimits defaults,
    absl::flat_hash_map<std::string, TenantLimits> overrides)
    : ledger_(std::make_shared<internal::QuotaLedger>(defaults,
                                                      std::move(overrides))) {}

TenantQuotas::~TenantQuotas() = default;

absl::StatusOr<QuotaCharge> TenantQuotas::ChargeTensor(
    const std::string& tenant, int64_t bytes) {
  absl::Status status = ledger_->Charge(tenant, bytes);
  if (!status.ok()) return status;
  return QuotaCharge(ledger_, tenant, bytes);
}

absl::StatusOr<InFlightSlot> TenantQuotas::EnterRpc(const std::string& tenant) {
  absl::Status status = ledger_->Enter(tenant);
  if (!status.ok()) return status;
  return InFlightSlot(ledger_, tenant);
}

TenantLimits TenantQuotas::LimitsOf(const std::string& tenant) const {
  return ledger_->LimitsOf(tenant);
}

QuotaUsage TenantQuotas::UsageOf(const std::string& tenant) const {
  return ledger_->UsageOf(tenant);
}

}  // namespace lossd
