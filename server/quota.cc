// TenantQuotas: the per-tenant books behind RESOURCE_EXHAUSTED for quotas.
#include "server/quota.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "server/byte_size.h"

namespace lossd {
namespace {

// One "KEY=VALUE" of a quota line, applied to `limits`.
absl::Status ApplyQuotaField(absl::string_view field, TenantLimits* limits) {
  const size_t equals = field.find('=');
  if (equals == absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", field, "' is not KEY=VALUE"));
  }
  const absl::string_view key = field.substr(0, equals);
  const absl::string_view value = field.substr(equals + 1);
  int64_t number = -1;
  if (key == "max_bytes") {
    absl::StatusOr<int64_t> bytes = ParseByteSize(value);
    if (!bytes.ok()) return bytes.status();
    limits->max_bytes = *bytes;
    return absl::OkStatus();
  }
  if (!absl::SimpleAtoi(value, &number) || number < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        key, "='", value, "' is not a count >= 0 (0 = unlimited)"));
  }
  if (key == "max_tensors") {
    limits->max_tensors = number;
  } else if (key == "max_inflight") {
    limits->max_in_flight = number;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown key '", key, "' (max_bytes, max_tensors or max_inflight)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<QuotaConfig> ParseQuotaFile(absl::string_view text,
                                           TenantLimits base) {
  // A file of nothing but whitespace is what a truncated or failed write
  // leaves (an emptied ConfigMap, a shell's '>'), never a configuration: were
  // it read as "no line", a reload would drop every limit. A file meant to
  // set none holds a comment at least, as the shipped one does.
  if (absl::StripAsciiWhitespace(text).empty()) {
    return absl::InvalidArgumentError(
        "the quota file is empty (nothing but whitespace); a file that sets "
        "no per-tenant limit holds a comment at least");
  }
  // Two passes: the default line may come anywhere, and every tenant's line
  // starts from it.
  std::vector<std::pair<int, std::vector<absl::string_view>>> lines;
  int line_number = 0;
  bool have_default = false;
  QuotaConfig config;
  config.defaults = base;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    const size_t comment = line.find('#');
    if (comment != absl::string_view::npos) line = line.substr(0, comment);
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    if (fields.empty()) continue;
    if (fields.size() < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "quota file line ", line_number,
          ": expected 'TENANT KEY=VALUE...' (keys max_bytes, max_tensors, ",
          "max_inflight)"));
    }
    if (fields[0] == "*") {
      if (have_default) {
        return absl::InvalidArgumentError(absl::StrCat(
            "quota file line ", line_number, ": a second default line ('*')"));
      }
      have_default = true;
      for (size_t i = 1; i < fields.size(); ++i) {
        const absl::Status status =
            ApplyQuotaField(fields[i], &config.defaults);
        if (!status.ok()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "quota file line ", line_number, ": ", status.message()));
        }
      }
      continue;
    }
    lines.emplace_back(line_number, std::move(fields));
  }
  for (const auto& [number, fields] : lines) {
    TenantLimits limits = config.defaults;
    for (size_t i = 1; i < fields.size(); ++i) {
      const absl::Status status = ApplyQuotaField(fields[i], &limits);
      if (!status.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("quota file line ", number, ": ", status.message()));
      }
    }
    if (!config.overrides.emplace(std::string(fields[0]), limits).second) {
      return absl::InvalidArgumentError(absl::StrCat("quota file line ", number,
                                                     ": tenant '", fields[0],
                                                     "' repeated from above"));
    }
  }
  return config;
}

namespace internal {

// Shared by TenantQuotas and every outstanding charge and slot, so that
// returning one after the quotas are gone stays safe.
class QuotaLedger {
 public:
  QuotaLedger(TenantLimits defaults,
              absl::flat_hash_map<std::string, TenantLimits> overrides)
      : defaults_(defaults), overrides_(std::move(overrides)) {}

  TenantLimits LimitsOf(const std::string& tenant) const
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return LimitsOfLocked(tenant);
  }

  void SetLimits(TenantLimits defaults,
                 absl::flat_hash_map<std::string, TenantLimits> overrides)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    defaults_ = defaults;
    overrides_ = std::move(overrides);
  }

  std::vector<std::string> ConfiguredTenants() const ABSL_LOCKS_EXCLUDED(mu_) {
    std::vector<std::string> tenants;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [tenant, limits] : overrides_) tenants.push_back(tenant);
    }
    std::sort(tenants.begin(), tenants.end());
    return tenants;
  }

  // `count`: 1 for a tensor, 0 for an RPC's working bytes.
  absl::Status Charge(const std::string& tenant, int64_t bytes, int64_t count)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    const TenantLimits limits = LimitsOfLocked(tenant);
    QuotaUsage& usage = usage_[tenant];
    if (count > 0 && limits.max_tensors > 0 &&
        usage.tensors >= limits.max_tensors) {
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
    usage.tensors += count;
    return absl::OkStatus();
  }

  void Uncharge(const std::string& tenant, int64_t bytes, int64_t count)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    QuotaUsage& usage = usage_[tenant];
    usage.bytes -= bytes;
    usage.tensors -= count;
    DropIfIdleLocked(tenant);
  }

  absl::Status Enter(const std::string& tenant) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    const TenantLimits limits = LimitsOfLocked(tenant);
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
  TenantLimits LimitsOfLocked(const std::string& tenant) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = overrides_.find(tenant);
    return it == overrides_.end() ? defaults_ : it->second;
  }

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

  mutable absl::Mutex mu_;
  TenantLimits defaults_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, TenantLimits> overrides_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, QuotaUsage> usage_ ABSL_GUARDED_BY(mu_);
};

}  // namespace internal

// ---------------------------------------------------------------- charge

QuotaCharge::QuotaCharge(std::shared_ptr<internal::QuotaLedger> ledger,
                         std::string tenant, int64_t bytes, int64_t tensors)
    : ledger_(std::move(ledger)),
      tenant_(std::move(tenant)),
      bytes_(bytes),
      tensors_(tensors) {}

QuotaCharge::QuotaCharge(QuotaCharge&& other) noexcept
    : ledger_(std::move(other.ledger_)),
      tenant_(std::move(other.tenant_)),
      bytes_(other.bytes_),
      tensors_(other.tensors_) {
  other.ledger_.reset();
}

QuotaCharge& QuotaCharge::operator=(QuotaCharge&& other) noexcept {
  if (this != &other) {
    Reset();
    ledger_ = std::move(other.ledger_);
    tenant_ = std::move(other.tenant_);
    bytes_ = other.bytes_;
    tensors_ = other.tensors_;
    other.ledger_.reset();
  }
  return *this;
}

QuotaCharge::~QuotaCharge() { Reset(); }

void QuotaCharge::Reset() {
  if (ledger_ == nullptr) return;
  ledger_->Uncharge(tenant_, bytes_, tensors_);
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
  absl::Status status = ledger_->Charge(tenant, bytes, 1);
  if (!status.ok()) return status;
  return QuotaCharge(ledger_, tenant, bytes, 1);
}

absl::StatusOr<QuotaCharge> TenantQuotas::ChargeBytes(const std::string& tenant,
                                                      int64_t bytes) {
  absl::Status status = ledger_->Charge(tenant, bytes, 0);
  if (!status.ok()) return status;
  return QuotaCharge(ledger_, tenant, bytes, 0);
}

absl::StatusOr<InFlightSlot> TenantQuotas::EnterRpc(const std::string& tenant) {
  absl::Status status = ledger_->Enter(tenant);
  if (!status.ok()) return status;
  return InFlightSlot(ledger_, tenant);
}

void TenantQuotas::SetLimits(
    TenantLimits defaults,
    absl::flat_hash_map<std::string, TenantLimits> overrides) {
  ledger_->SetLimits(defaults, std::move(overrides));
}

std::vector<std::string> TenantQuotas::ConfiguredTenants() const {
  return ledger_->ConfiguredTenants();
}

TenantLimits TenantQuotas::LimitsOf(const std::string& tenant) const {
  return ledger_->LimitsOf(tenant);
}

QuotaUsage TenantQuotas::UsageOf(const std::string& tenant) const {
  return ledger_->UsageOf(tenant);
}

}  // namespace lossd
