// TensorStore: handles, budget accounting, states, leases and TTL expiry.
#include "server/tensor_store.h"

#include <sys/random.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/echo.h"
#include "common/handle.h"
#include "common/status_macros.h"
#include "common/tensor_math.h"

namespace lossd {
namespace internal {

// Bytes reserved or held against the budget. Shared by the store and every
// allocation so that memory freed after the store is gone stays consistent.
class MemoryAccount {
 public:
  explicit MemoryAccount(int64_t budget) : budget_(budget) {}

  absl::Status Reserve(int64_t bytes) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (bytes > budget_ - used_) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "memory budget exceeded: requested %d bytes, %d of %d bytes used "
          "(%d free)",
          bytes, used_, budget_, budget_ - used_));
    }
    used_ += bytes;
    return absl::OkStatus();
  }
  void Return(int64_t bytes) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    used_ -= bytes;
  }
  int64_t used() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return used_;
  }
  int64_t budget() const { return budget_; }
  bool AwaitUsed(int64_t bytes, absl::Duration timeout) const {
    absl::MutexLock lock(&mu_);
    auto reached = [this, bytes]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return used_ == bytes;
    };
    return mu_.AwaitWithTimeout(absl::Condition(&reached), timeout);
  }

 private:
  const int64_t budget_;
  mutable absl::Mutex mu_;
  int64_t used_ ABSL_GUARDED_BY(mu_) = 0;
};

class Allocation {
 public:
  Allocation(Device* device, void* data, int64_t bytes,
             std::shared_ptr<MemoryAccount> account,
             QuotaCharge charge = QuotaCharge())
      : device_(device),
        data_(data),
        bytes_(bytes),
        account_(std::move(account)),
        charge_(std::move(charge)) {}
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;
  ~Allocation() {
    device_->Free(data_, static_cast<size_t>(bytes_));
    account_->Return(bytes_);
  }
  Device* device() const { return device_; }
  void* data() const { return data_; }

 private:
  Device* const device_;
  void* const data_;
  const int64_t bytes_;
  const std::shared_ptr<MemoryAccount> account_;
  // The tenant's quota, returned with the memory.
  QuotaCharge charge_;
};

}  // namespace internal

namespace {

constexpr int kInstanceIdHexDigits = kHandleInstanceHexDigits;
constexpr int kHandleRandomBytes = kHandleRandomHexDigits / 2;  // 128 bits
constexpr absl::Duration kMaxSweepInterval = absl::Seconds(1);
constexpr char kReleased[] = "released";
constexpr char kExpired[] = "expired";

// Handles are capabilities until authentication exists: they come from the
// kernel's CSPRNG, not from a seeded generator.
std::string RandomHex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t filled = 0;
  while (filled < bytes) {
    const ssize_t got = getrandom(raw.data() + filled, bytes - filled, 0);
    if (got > 0) filled += static_cast<size_t>(got);
  }
  return absl::BytesToHexString(raw);
}

// Where a tensor stands in List's order: by creation time (to the
// nanosecond, as page tokens carry it), then by handle.
bool ListsBefore(int64_t created_a, const std::string& handle_a,
                 int64_t created_b, const std::string& handle_b) {
  return created_a != created_b ? created_a < created_b : handle_a < handle_b;
}

}  // namespace

// ---------------------------------------------------------------- Tensor

Tensor::Tensor(std::string handle, std::string tenant, std::string label,
               DType dtype, std::vector<int64_t> shape,
               std::shared_ptr<internal::Allocation> allocation,
               TensorState state, absl::Time now)
    : handle_(std::move(handle)),
      tenant_(std::move(tenant)),
      label_(std::move(label)),
      dtype_(dtype),
      shape_(std::move(shape)),
      bytes_(elements() * static_cast<int64_t>(DTypeSize(dtype))),
      created_(now),
      allocation_(std::move(allocation)),
      state_(state),
      last_used_(now) {}

Tensor::~Tensor() = default;

int64_t Tensor::elements() const {
  int64_t count = 1;
  for (int64_t dim : shape_) count *= dim;
  return count;
}

Device* Tensor::device() const { return allocation_->device(); }
void* Tensor::data() const { return allocation_->data(); }

TensorRecord Tensor::Info() const {
  TensorRecord info;
  info.handle = handle_;
  info.tenant = tenant_;
  info.label = label_;
  info.device = device()->name();
  info.dtype = dtype_;
  info.shape = shape_;
  info.bytes = bytes_;
  info.created = created_;
  absl::MutexLock lock(&mu_);
  info.state = state_;
  info.last_used = last_used_;
  info.pending_scale = pending_scale_;
  info.pending_token_scale = !pending_token_scale_.empty();
  return info;
}

TensorState Tensor::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

void Tensor::TouchLocked(absl::Time now) {
  last_used_ = std::max(last_used_, now);
}

// ---------------------------------------------------------------- leases

ReadLease::ReadLease(std::shared_ptr<Tensor> tensor, ReadView view,
                     std::function<absl::Time()> clock)
    : tensor_(std::move(tensor)),
      view_(std::move(view)),
      clock_(std::move(clock)) {}

ReadLease::ReadLease(ReadLease&& other) noexcept
    : tensor_(std::move(other.tensor_)),
      view_(std::move(other.view_)),
      clock_(std::move(other.clock_)) {
  other.tensor_.reset();
}

ReadLease& ReadLease::operator=(ReadLease&& other) noexcept {
  if (this != &other) {
    Reset();
    tensor_ = std::move(other.tensor_);
    view_ = std::move(other.view_);
    clock_ = std::move(other.clock_);
    other.tensor_.reset();
  }
  return *this;
}

ReadLease::~ReadLease() { Reset(); }

void ReadLease::Reset() {
  if (tensor_ == nullptr) return;
  {
    absl::MutexLock lock(&tensor_->mu_);
    --tensor_->readers_;
    tensor_->TouchLocked(clock_());
  }
  tensor_.reset();
}

ForwardLease::ForwardLease(std::shared_ptr<Tensor> tensor, bool in_place,
                           std::function<absl::Time()> clock)
    : tensor_(std::move(tensor)),
      in_place_(in_place),
      clock_(std::move(clock)) {}

ForwardLease::ForwardLease(ForwardLease&& other) noexcept
    : tensor_(std::move(other.tensor_)),
      in_place_(other.in_place_),
      clock_(std::move(other.clock_)) {
  other.tensor_.reset();
}

ForwardLease& ForwardLease::operator=(ForwardLease&& other) noexcept {
  if (this != &other) {
    Reset();
    tensor_ = std::move(other.tensor_);
    in_place_ = other.in_place_;
    clock_ = std::move(other.clock_);
    other.tensor_.reset();
  }
  return *this;
}

ForwardLease::~ForwardLease() { Reset(); }

void ForwardLease::FinishInPlace(Reduction reduction) {
  if (tensor_ == nullptr || !in_place_) return;
  absl::MutexLock lock(&tensor_->mu_);
  tensor_->state_ = TensorState::kGradient;
  tensor_->reduction_ = reduction;
  tensor_->pending_scale_ = 1.0;
  tensor_->pending_token_scale_.clear();
  tensor_->materialized_ = false;
}

void ForwardLease::FinishOverwrite() {
  if (tensor_ == nullptr || !in_place_) return;
  absl::MutexLock lock(&tensor_->mu_);
  tensor_->state_ = TensorState::kLogits;
  tensor_->reduction_ = Reduction::kMean;
  tensor_->pending_scale_ = 1.0;
  tensor_->pending_token_scale_.clear();
  tensor_->materialized_ = false;
  tensor_->applied_scale_ = 1.0;
  tensor_->applied_token_scale_.clear();
}

void ForwardLease::Reset() {
  if (tensor_ == nullptr) return;
  {
    absl::MutexLock lock(&tensor_->mu_);
    tensor_->forward_running_ = false;
    if (in_place_) tensor_->writing_ = false;
    tensor_->TouchLocked(clock_());
  }
  tensor_.reset();
}

// ---------------------------------------------------------------- pending

PendingTensor::PendingTensor(TensorStore* store, std::string tenant,
                             std::string label, DType dtype,
                             std::vector<int64_t> shape, TensorState state,
                             std::shared_ptr<internal::Allocation> allocation)
    : store_(store),
      tenant_(std::move(tenant)),
      label_(std::move(label)),
      dtype_(dtype),
      shape_(std::move(shape)),
      state_(state),
      bytes_(*StoredTensorBytes(dtype_, shape_)),
      allocation_(std::move(allocation)) {}

PendingTensor::~PendingTensor() {
  if (!committed_ && !idempotency_key_.empty()) {
    store_->FreeUploadKey(tenant_, idempotency_key_);
  }
  // An abandoned overwrite: its copies must land before others may use the
  // buffer again (a new tensor's Free waits by itself).
  if (overwrite_.tensor() != nullptr && !committed_) {
    allocation_->device()->FinishWrites(allocation_->data()).IgnoreError();
  }
}

void* PendingTensor::data() const { return allocation_->data(); }

void* ScratchBuffer::data() const {
  return allocation_ != nullptr ? allocation_->data() : nullptr;
}

absl::Status PendingTensor::Append(const void* host, size_t bytes) {
  if (committed_) return absl::FailedPreconditionError("already committed");
  if (static_cast<int64_t>(bytes) > bytes_ - received_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "more bytes than the header says: %d expected, at least %d received",
        bytes_, received_ + static_cast<int64_t>(bytes)));
  }
  // Asynchronous: the device copy of this chunk overlaps the receipt of the
  // next one; Commit waits for all of them.
  RETURN_IF_ERROR(allocation_->device()->CopyFromHostAsync(
      allocation_->data(), static_cast<size_t>(received_), host, bytes));
  received_ += static_cast<int64_t>(bytes);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Tensor>> PendingTensor::Commit(
    Reduction gradient_reduction) {
  if (committed_) return absl::FailedPreconditionError("already committed");
  if (received_ != bytes_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("fewer bytes than the header says: %d expected, %d "
                        "received",
                        bytes_, received_));
  }
  RETURN_IF_ERROR(allocation_->device()->FinishWrites(allocation_->data()));
  committed_ = true;
  if (overwrite_.tensor() != nullptr) {
    std::shared_ptr<Tensor> tensor = overwrite_.tensor();
    overwrite_.FinishOverwrite();
    overwrite_ = ForwardLease();
    return tensor;
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor,
                   store_->Publish(tenant_, label_, dtype_, shape_, state_,
                                   std::move(allocation_), gradient_reduction));
  if (!idempotency_key_.empty()) {
    store_->BindUploadKey(tenant_, idempotency_key_, tensor->handle());
  }
  return tensor;
}

// ---------------------------------------------------------------- store

TensorStore::TensorStore(Device* device, Options options)
    : device_(device),
      options_(std::move(options)),
      clock_(options_.clock ? options_.clock : [] { return absl::Now(); }),
      instance_id_(options_.instance_id.empty()
                       ? RandomHex(kInstanceIdHexDigits / 2)
                       : options_.instance_id),
      account_(
          std::make_shared<internal::MemoryAccount>(options_.budget_bytes)) {
  absl::MutexLock lock(&mu_);
  last_sweep_ = clock_();
}

TensorStore::~TensorStore() = default;

std::string TensorStore::NewHandle() const {
  return absl::StrCat(instance_id_, "-", RandomHex(kHandleRandomBytes));
}

absl::StatusOr<std::unique_ptr<PendingTensor>> TensorStore::Create(
    const std::string& tenant, DType dtype, std::vector<int64_t> shape,
    std::string label, TensorState state, const std::string& idempotency_key) {
  ASSIGN_OR_RETURN(const int64_t bytes, StoredTensorBytes(dtype, shape));
  MaybeSweep();
  if (!idempotency_key.empty()) {
    absl::MutexLock lock(&mu_);
    auto [it, claimed] =
        upload_keys_.try_emplace(UploadKey(tenant, idempotency_key), "");
    if (!claimed) {
      return absl::AbortedError(absl::StrCat(
          "idempotency_key '", idempotency_key, "' ",
          it->second.empty()
              ? "is taken by an upload in flight; retry when it has ended"
              : "was just taken by an upload that completed; retry to get "
                "its tensor"));
    }
  }
  // From here on a failure frees the key again (the pending tensor that
  // would hold it is not made).
  auto free_key = [&](absl::Status status) {
    if (!idempotency_key.empty()) FreeUploadKey(tenant, idempotency_key);
    return status;
  };
  // The tenant's quota first: a tenant over its own limit learns that, not
  // how full the device is. The quota counts what the tensor keeps on the
  // host too (its label and bookkeeping): many tiny tensors with long labels
  // would otherwise hold host memory no limit sees.
  QuotaCharge charge;
  if (options_.quotas != nullptr) {
    const int64_t charged =
        bytes + static_cast<int64_t>(label.size()) + kTensorBookkeepingBytes;
    absl::StatusOr<QuotaCharge> charged_or =
        options_.quotas->ChargeTensor(tenant, charged);
    if (!charged_or.ok()) {
      return free_key(absl::Status(
          charged_or.status().code(),
          absl::StrCat(charged_or.status().message(), "; a tensor counts ",
                       "its bytes (", bytes, "), its label's (", label.size(),
                       ") and ", kTensorBookkeepingBytes,
                       " bytes of bookkeeping")));
    }
    charge = *std::move(charged_or);
  }
  if (absl::Status reserved = account_->Reserve(bytes); !reserved.ok()) {
    return free_key(reserved);
  }
  absl::StatusOr<void*> data = device_->Allocate(static_cast<size_t>(bytes));
  if (!data.ok()) {
    account_->Return(bytes);
    return free_key(data.status());
  }
  auto allocation = std::make_shared<internal::Allocation>(
      device_, *data, bytes, account_, std::move(charge));
  std::unique_ptr<PendingTensor> pending(
      new PendingTensor(this, tenant, std::move(label), dtype, std::move(shape),
                        state, std::move(allocation)));
  pending->idempotency_key_ = idempotency_key;
  return pending;
}

absl::StatusOr<std::shared_ptr<Tensor>> TensorStore::FindUpload(
    const std::string& tenant, const std::string& idempotency_key, DType dtype,
    const std::vector<int64_t>& shape, const std::string& label) {
  MaybeSweep();
  std::string handle;
  {
    absl::MutexLock lock(&mu_);
    auto it = upload_keys_.find(UploadKey(tenant, idempotency_key));
    if (it == upload_keys_.end() || it->second.empty()) return nullptr;
    handle = it->second;
  }
  // Touches it; a Release or expiry since the lookup took the key with it.
  absl::StatusOr<std::shared_ptr<Tensor>> tensor = Get(tenant, handle);
  if (!tensor.ok()) return nullptr;
  const TensorRecord info = (*tensor)->Info();
  if (info.dtype != dtype || info.shape != shape || info.label != label) {
    return absl::AlreadyExistsError(absl::StrCat(
        "idempotency_key '", idempotency_key, "' names tensor ", handle, ", ",
        DTypeName(info.dtype), " ", ShapeString(info.shape), " label ",
        Echo(info.label), "; this upload is ", DTypeName(dtype), " ",
        ShapeString(shape), " label ", Echo(label),
        " (a new upload needs a new key)"));
  }
  return tensor;
}

void TensorStore::BindUploadKey(const std::string& tenant,
                                const std::string& key,
                                const std::string& handle) {
  absl::MutexLock lock(&mu_);
  UploadKey name(tenant, key);
  // Released (or expired) between Publish and here: the key goes with it.
  if (!tensors_.contains(handle)) {
    upload_keys_.erase(name);
    return;
  }
  upload_keys_[name] = handle;
  handle_keys_.emplace(handle, std::move(name));
}

void TensorStore::FreeUploadKey(const std::string& tenant,
                                const std::string& key) {
  absl::MutexLock lock(&mu_);
  upload_keys_.erase(UploadKey(tenant, key));
}

absl::StatusOr<QuotaCharge> TensorStore::ChargeTenantBytes(
    const std::string& tenant, int64_t bytes) {
  if (options_.quotas == nullptr) return QuotaCharge();
  return options_.quotas->ChargeBytes(tenant, bytes);
}

absl::StatusOr<ScratchBuffer> TensorStore::AllocateScratch(
    const std::string& tenant, int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("scratch of ", bytes, " bytes"));
  }
  // The tenant's quota first, as for a tensor.
  ASSIGN_OR_RETURN(QuotaCharge charge, ChargeTenantBytes(tenant, bytes));
  RETURN_IF_ERROR(account_->Reserve(bytes));
  absl::StatusOr<void*> data = device_->Allocate(static_cast<size_t>(bytes));
  if (!data.ok()) {
    account_->Return(bytes);
    return data.status();
  }
  return ScratchBuffer(std::make_shared<internal::Allocation>(
                           device_, *data, bytes, account_, std::move(charge)),
                       static_cast<size_t>(bytes));
}

absl::StatusOr<ScratchBuffer> TensorStore::ChargeWorkspace(
    const std::string& tenant, int64_t bytes, absl::string_view what) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("workspace of ", bytes, " bytes"));
  }
  if (bytes == 0) return ScratchBuffer();
  const auto named = [what](const absl::Status& status) {
    return absl::Status(status.code(),
                        absl::StrCat(what, ": ", status.message()));
  };
  absl::StatusOr<QuotaCharge> charge = ChargeTenantBytes(tenant, bytes);
  if (!charge.ok()) return named(charge.status());
  if (absl::Status reserved = account_->Reserve(bytes); !reserved.ok()) {
    return named(reserved);
  }
  // Device::Free ignores the null buffer: the allocation only returns the
  // bytes to the account and the quota.
  return ScratchBuffer(
      std::make_shared<internal::Allocation>(device_, nullptr, bytes, account_,
                                             *std::move(charge)),
      static_cast<size_t>(bytes));
}

absl::StatusOr<std::shared_ptr<Tensor>> TensorStore::Publish(
    const std::string& tenant, std::string label, DType dtype,
    std::vector<int64_t> shape, TensorState state,
    std::shared_ptr<internal::Allocation> allocation, Reduction reduction) {
  std::shared_ptr<Tensor> tensor(
      new Tensor(NewHandle(), tenant, std::move(label), dtype, std::move(shape),
                 std::move(allocation), state, clock_()));
  {
    absl::MutexLock tensor_lock(&tensor->mu_);
    tensor->reduction_ = reduction;
  }
  absl::MutexLock lock(&mu_);
  tensors_[tensor->handle()] = tensor;
  return tensor;
}

absl::StatusOr<std::shared_ptr<Tensor>> TensorStore::Get(
    const std::string& tenant, const std::string& handle) {
  // Before any lookup: a handle of the wrong shape was never issued by any
  // instance, and is the caller's mistake rather than a tensor gone.
  RETURN_IF_ERROR(CheckHandle(handle, "handle"));
  MaybeSweep();
  const absl::string_view instance =
      absl::string_view(handle).substr(0, kHandleInstanceHexDigits);
  if (instance != instance_id_) {
    return absl::NotFoundError(absl::StrCat(
        "handle ", handle, " belongs to instance ", instance,
        ", this is instance ", instance_id_, " (restarted or other pod)"));
  }
  std::shared_ptr<Tensor> tensor;
  {
    absl::MutexLock lock(&mu_);
    auto it = tensors_.find(handle);
    if (it == tensors_.end() || it->second->tenant() != tenant) {
      auto gone = gone_.find(handle);
      // A released handle of another tenant reads as unknown, like any other
      // handle of that tenant.
      if (gone != gone_.end() && it == tensors_.end()) {
        return absl::NotFoundError(
            absl::StrCat("handle ", handle, " was ", gone->second));
      }
      return absl::NotFoundError(absl::StrCat("unknown handle ", handle));
    }
    tensor = it->second;
  }
  absl::MutexLock lock(&tensor->mu_);
  tensor->TouchLocked(clock_());
  return tensor;
}

absl::StatusOr<int64_t> TensorStore::Release(const std::string& tenant,
                                             const std::string& handle) {
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor, Get(tenant, handle));
  absl::MutexLock lock(&mu_);
  auto it = tensors_.find(handle);
  // A concurrent Release or expiry may have won since Get.
  if (it == tensors_.end()) {
    auto gone = gone_.find(handle);
    return absl::NotFoundError(
        absl::StrCat("handle ", handle, " was ",
                     gone != gone_.end() ? gone->second : kReleased));
  }
  tensors_.erase(it);
  ForgetLocked(handle, kReleased);
  return tensor->bytes();
}

void TensorStore::ForgetLocked(const std::string& handle, const char* reason) {
  // An idempotency key names its tensor for the tensor's life only.
  if (auto keyed = handle_keys_.find(handle); keyed != handle_keys_.end()) {
    upload_keys_.erase(keyed->second);
    handle_keys_.erase(keyed);
  }
  if (options_.remembered_handles == 0) return;
  if (gone_.emplace(handle, reason).second) gone_order_.push_back(handle);
  while (gone_order_.size() > options_.remembered_handles) {
    gone_.erase(gone_order_.front());
    gone_order_.pop_front();
  }
}

std::vector<TensorRecord> TensorStore::List(const std::string& tenant) {
  bool more = false;
  return List(tenant, ListPosition(), std::numeric_limits<size_t>::max(),
              &more);
}

std::vector<TensorRecord> TensorStore::List(const std::string& tenant,
                                            const ListPosition& after,
                                            size_t limit, bool* more) {
  MaybeSweep();
  // Only the handles and creation times (immutable) are read under the
  // store lock; the records of the page alone are built, outside it.
  std::vector<std::shared_ptr<Tensor>> mine;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [handle, tensor] : tensors_) {
      if (tensor->tenant() != tenant) continue;
      if (!after.handle.empty() &&
          !ListsBefore(after.created_unix_nanos, after.handle,
                       absl::ToUnixNanos(tensor->created_), handle)) {
        continue;
      }
      mine.push_back(tensor);
    }
  }
  const auto before = [](const std::shared_ptr<Tensor>& a,
                         const std::shared_ptr<Tensor>& b) {
    return ListsBefore(absl::ToUnixNanos(a->created_), a->handle(),
                       absl::ToUnixNanos(b->created_), b->handle());
  };
  *more = mine.size() > limit;
  if (*more) {
    std::partial_sort(mine.begin(), mine.begin() + limit, mine.end(), before);
    mine.resize(limit);
  } else {
    std::sort(mine.begin(), mine.end(), before);
  }
  std::vector<TensorRecord> infos;
  infos.reserve(mine.size());
  for (const auto& tensor : mine) infos.push_back(tensor->Info());
  return infos;
}

StoreStats TensorStore::Stats() const {
  StoreStats stats;
  stats.budget_bytes = account_->budget();
  stats.used_bytes = account_->used();
  absl::MutexLock lock(&mu_);
  stats.tensors = static_cast<int64_t>(tensors_.size());
  return stats;
}

std::vector<TenantUsage> TensorStore::UsageByTenant() const {
  std::map<std::string, TenantUsage> by_tenant;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [handle, tensor] : tensors_) {
      TenantUsage& usage = by_tenant[tensor->tenant()];
      ++usage.tensors;
      usage.bytes += tensor->bytes();
    }
  }
  std::vector<TenantUsage> usages;
  usages.reserve(by_tenant.size());
  for (auto& [tenant, usage] : by_tenant) {
    usage.tenant = tenant;
    usages.push_back(std::move(usage));
  }
  return usages;
}

ReadLease TensorStore::BeginRead(std::shared_ptr<Tensor> tensor) {
  ReadView view;
  {
    absl::MutexLock lock(&tensor->mu_);
    Tensor* raw = tensor.get();
    auto not_writing = [raw]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(raw->mu_) {
      return !raw->writing_;
    };
    tensor->mu_.Await(absl::Condition(&not_writing));
    ++tensor->readers_;
    tensor->TouchLocked(clock_());
    if (tensor->state_ == TensorState::kGradient) {
      view.scale = tensor->pending_scale_;
      view.row_scale = tensor->pending_token_scale_;
    }
  }
  return ReadLease(std::move(tensor), std::move(view), clock_);
}

absl::StatusOr<ForwardLease> TensorStore::BeginForward(
    std::shared_ptr<Tensor> tensor, bool in_place) {
  {
    absl::MutexLock lock(&tensor->mu_);
    if (tensor->state_ == TensorState::kGradient) {
      return absl::FailedPreconditionError(absl::StrCat(
          "handle ", tensor->handle(),
          " holds a gradient: its logits were consumed by a Forward"));
    }
    if (tensor->forward_running_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "handle ", tensor->handle(), ": a Forward is running on it"));
    }
    if (in_place && tensor->readers_ > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "handle ", tensor->handle(),
          " is being read (Download); an in-place Forward would change it"));
    }
    tensor->forward_running_ = true;
    if (in_place) tensor->writing_ = true;
    tensor->TouchLocked(clock_());
  }
  return ForwardLease(std::move(tensor), in_place, clock_);
}

absl::StatusOr<ForwardLease> TensorStore::BeginWrite(
    std::shared_ptr<Tensor> tensor) {
  {
    absl::MutexLock lock(&tensor->mu_);
    if (tensor->forward_running_ || tensor->writing_ || tensor->readers_ > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "handle ", tensor->handle(),
          " is in use by another RPC (a Forward, LinearForward, Download or "
          "overwrite); it cannot be written now"));
    }
    tensor->forward_running_ = true;
    tensor->writing_ = true;
    tensor->TouchLocked(clock_());
  }
  return ForwardLease(std::move(tensor), /*in_place=*/true, clock_);
}

absl::StatusOr<ReadLease> TensorStore::TryBeginRead(
    std::shared_ptr<Tensor> tensor) {
  ReadView view;
  {
    absl::MutexLock lock(&tensor->mu_);
    if (tensor->writing_) {
      return absl::FailedPreconditionError(
          absl::StrCat("handle ", tensor->handle(),
                       " is being written (an in-place Forward, LinearForward "
                       "or overwrite); it cannot be read now"));
    }
    ++tensor->readers_;
    tensor->TouchLocked(clock_());
    if (tensor->state_ == TensorState::kGradient) {
      view.scale = tensor->pending_scale_;
      view.row_scale = tensor->pending_token_scale_;
    }
  }
  return ReadLease(std::move(tensor), std::move(view), clock_);
}

absl::StatusOr<std::unique_ptr<PendingTensor>> TensorStore::Overwrite(
    const std::string& tenant, const std::string& handle, DType dtype,
    const std::vector<int64_t>& shape) {
  ASSIGN_OR_RETURN(std::shared_ptr<Tensor> tensor, Get(tenant, handle));
  if (tensor->dtype() != dtype || tensor->shape() != shape) {
    return absl::InvalidArgumentError(absl::StrCat(
        "overwrite_handle ", handle, " is ", DTypeName(tensor->dtype()), " ",
        ShapeString(tensor->shape()), "; the header says ", DTypeName(dtype),
        " ", ShapeString(shape), " (an overwrite keeps dtype and shape)"));
  }
  ASSIGN_OR_RETURN(ForwardLease lease, BeginWrite(tensor));
  std::unique_ptr<PendingTensor> pending(
      new PendingTensor(this, tenant, tensor->label_, dtype, shape,
                        TensorState::kLogits, tensor->allocation_));
  pending->overwrite_ = std::move(lease);
  return pending;
}

absl::Status TensorStore::RecordGradOutput(
    const std::shared_ptr<Tensor>& tensor, double scale,
    std::vector<float> token_scale, bool materialize, bool* kernel_launched) {
  *kernel_launched = false;
  const bool per_token = !token_scale.empty();
  if (!std::isfinite(scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad_output ", scale, " is not finite"));
  }
  for (size_t i = 0; i < token_scale.size(); ++i) {
    if (!std::isfinite(token_scale[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "grad_output[", i, "] = ", token_scale[i], " is not finite"));
    }
  }
  {
    absl::MutexLock lock(&tensor->mu_);
    tensor->TouchLocked(clock_());
    if (tensor->state_ != TensorState::kGradient) {
      return absl::FailedPreconditionError(
          absl::StrCat("handle ", tensor->handle(),
                       " holds logits, not a gradient (run Forward first)"));
    }
    if (per_token && tensor->reduction_ != Reduction::kNone) {
      return absl::InvalidArgumentError(
          "per-token grad_output needs a gradient computed with reduction "
          "NONE");
    }
    if (per_token &&
        static_cast<int64_t>(token_scale.size()) != tensor->rows()) {
      return absl::InvalidArgumentError(
          absl::StrCat("per-token grad_output has ", token_scale.size(),
                       " values, the gradient has ", tensor->rows(), " rows"));
    }
    if (tensor->materialized_) {
      if (scale == tensor->applied_scale_ &&
          token_scale == tensor->applied_token_scale_) {
        // The same factor again: already applied, nothing to do.
        return absl::OkStatus();
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "handle ", tensor->handle(),
          " was materialized with another grad_output; it cannot change"));
    }
    if (!materialize) {
      tensor->pending_scale_ = per_token ? 1.0 : scale;
      tensor->pending_token_scale_ = std::move(token_scale);
      return absl::OkStatus();
    }
    if (tensor->writing_ || tensor->readers_ > 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("handle ", tensor->handle(),
                       " is in use by another RPC; materialize it later"));
    }
    tensor->writing_ = true;
  }
  // The buffer is ours alone now (writing_ keeps readers out).
  const double applied = per_token ? 1.0 : scale;
  const absl::Status status = tensor->device()->ScaleInPlace(
      tensor->data(), tensor->dtype(), tensor->elements(), tensor->row_length(),
      static_cast<float>(applied), per_token ? token_scale.data() : nullptr);
  absl::MutexLock lock(&tensor->mu_);
  tensor->writing_ = false;
  RETURN_IF_ERROR(status);
  *kernel_launched = true;
  tensor->materialized_ = true;
  tensor->applied_scale_ = applied;
  tensor->applied_token_scale_ = std::move(token_scale);
  tensor->pending_scale_ = 1.0;
  tensor->pending_token_scale_.clear();
  return absl::OkStatus();
}

void TensorStore::MaybeSweep() {
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_();
    if (now - last_sweep_ < std::min(kMaxSweepInterval, options_.ttl / 4)) {
      return;
    }
  }
  ExpireIdle();
}

int TensorStore::ExpireIdle() {
  // Tensors are destroyed outside the lock: freeing memory can be slow.
  std::vector<std::shared_ptr<Tensor>> expired;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_();
    last_sweep_ = now;
    for (auto it = tensors_.begin(); it != tensors_.end();) {
      Tensor* tensor = it->second.get();
      bool expire;
      {
        absl::MutexLock tensor_lock(&tensor->mu_);
        expire =
            tensor->IdleLocked() && now - tensor->last_used_ > options_.ttl;
      }
      if (expire) {
        ForgetLocked(it->first, kExpired);
        expired.push_back(std::move(it->second));
        tensors_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  return static_cast<int>(expired.size());
}

bool TensorStore::AwaitUsedBytes(int64_t bytes, absl::Duration timeout) const {
  return account_->AwaitUsed(bytes, timeout);
}

}  // namespace lossd
