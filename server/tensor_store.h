// The tensors lossd holds behind handles: their memory (under a budget),
// states (LOGITS -> GRADIENT), pending grad_output, leases and TTL expiry.
// Knows nothing about gRPC or protobuf; the service maps its results to RPCs.
#ifndef LOSSD_SERVER_TENSOR_STORE_H_
#define LOSSD_SERVER_TENSOR_STORE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/loss_options.h"
#include "server/device.h"
#include "server/quota.h"

namespace lossd {

// The tenant of every caller when the server authenticates no one (no
// --tokens_file, no mTLS); every API takes a tenant.
inline constexpr char kDefaultTenant[] = "default";

// A consistent snapshot of one tensor's metadata.
struct TensorRecord {
  std::string handle;
  std::string tenant;
  std::string label;
  std::string device;
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  int64_t bytes = 0;
  TensorState state = TensorState::kLogits;
  absl::Time created;
  absl::Time last_used;
  double pending_scale = 1.0;        // grad_output recorded by Backward
  bool pending_token_scale = false;  // per-token factors recorded
};

// What a tensor keeps on the host besides its label (the Tensor, its handle
// twice, the map entry, the allocation record and the handle remembered after
// it goes), rounded up. Counted with the tensor's and its label's bytes
// against its tenant's max_bytes quota.
inline constexpr int64_t kTensorBookkeepingBytes = 1024;

// A place in List's order (creation time to the nanosecond, then handle):
// List pages start after it. An empty handle is the start of the list.
struct ListPosition {
  int64_t created_unix_nanos = 0;
  std::string handle;
};

// Memory figures of a store.
struct StoreStats {
  int64_t budget_bytes = 0;
  int64_t used_bytes = 0;  // reserved (uploads in progress) + held
  int64_t tensors = 0;
};

// The tensors one tenant holds (committed ones; uploads in progress count only
// in StoreStats::used_bytes).
struct TenantUsage {
  std::string tenant;
  int64_t tensors = 0;
  int64_t bytes = 0;
};

// What a reader sees of a tensor for the duration of its lease: the factor to
// apply to a gradient on the way out (1 and no per-token factors for logits).
struct ReadView {
  double scale = 1.0;
  std::vector<float> row_scale;  // empty, or [rows]
};

class TensorStore;
class ReadLease;
class ForwardLease;

namespace internal {
class MemoryAccount;
// A device buffer together with its share of the budget; both are returned
// when the last owner lets go.
class Allocation;
}  // namespace internal

// One stored tensor. Shared by the store and by the RPCs using it: the memory
// is returned when the last shared_ptr goes, so a Release during a Download is
// safe. Immutable fields are readable without locks; the rest is reached
// through TensorStore and the leases. Thread-safe.
class Tensor {
 public:
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  ~Tensor();

  const std::string& handle() const { return handle_; }
  const std::string& tenant() const { return tenant_; }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t bytes() const { return bytes_; }
  int64_t elements() const;
  // shape[0]; and shape[1], or 1 for a 1-D tensor.
  int64_t rows() const { return shape_[0]; }
  int64_t row_length() const { return shape_.size() == 2 ? shape_[1] : 1; }
  Device* device() const;
  // The device buffer. Writing it is only allowed under a ForwardLease (or
  // by TensorStore); reading it under a ReadLease or a ForwardLease.
  void* data() const;

  TensorRecord Info() const ABSL_LOCKS_EXCLUDED(mu_);
  TensorState state() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend class TensorStore;
  friend class ReadLease;
  friend class ForwardLease;

  Tensor(std::string handle, std::string tenant, std::string label, DType dtype,
         std::vector<int64_t> shape,
         std::shared_ptr<internal::Allocation> allocation, TensorState state,
         absl::Time now);

  void TouchLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool IdleLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return readers_ == 0 && !forward_running_ && !writing_;
  }

  const std::string handle_;
  const std::string tenant_;
  const std::string label_;
  const DType dtype_;
  const std::vector<int64_t> shape_;
  const int64_t bytes_;
  const absl::Time created_;
  const std::shared_ptr<internal::Allocation> allocation_;

  mutable absl::Mutex mu_;
  TensorState state_ ABSL_GUARDED_BY(mu_);
  absl::Time last_used_ ABSL_GUARDED_BY(mu_);
  int readers_ ABSL_GUARDED_BY(mu_) = 0;
  bool forward_running_ ABSL_GUARDED_BY(mu_) = false;
  // The buffer is being changed in place (Forward in place, materialize):
  // readers wait for it to end.
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  // For a gradient: the reduction it was computed with, the factor recorded
  // by Backward, and (materialize) the factor already applied to the buffer.
  Reduction reduction_ ABSL_GUARDED_BY(mu_) = Reduction::kMean;
  double pending_scale_ ABSL_GUARDED_BY(mu_) = 1.0;
  std::vector<float> pending_token_scale_ ABSL_GUARDED_BY(mu_);
  bool materialized_ ABSL_GUARDED_BY(mu_) = false;
  double applied_scale_ ABSL_GUARDED_BY(mu_) = 1.0;
  std::vector<float> applied_token_scale_ ABSL_GUARDED_BY(mu_);
};

// Shared read access to a tensor (Download, targets, class weights). Waits for
// an in-place write to finish when it starts; while it lives an in-place
// Forward on the tensor fails. Movable, not copyable.
class ReadLease {
 public:
  ReadLease() = default;
  ReadLease(ReadLease&& other) noexcept;
  ReadLease& operator=(ReadLease&& other) noexcept;
  ~ReadLease();

  const std::shared_ptr<Tensor>& tensor() const { return tensor_; }
  // The pending grad_output as it was when the lease began.
  const ReadView& view() const { return view_; }

 private:
  friend class TensorStore;
  ReadLease(std::shared_ptr<Tensor> tensor, ReadView view,
            std::function<absl::Time()> clock);
  void Reset();

  std::shared_ptr<Tensor> tensor_;
  ReadView view_;
  std::function<absl::Time()> clock_;
};

// The right to run one Forward on a logits tensor. Exactly one can exist per
// tensor at a time. Movable, not copyable; dropping it without Finish leaves
// the tensor as it was.
class ForwardLease {
 public:
  ForwardLease() = default;
  ForwardLease(ForwardLease&& other) noexcept;
  ForwardLease& operator=(ForwardLease&& other) noexcept;
  ~ForwardLease();

  const std::shared_ptr<Tensor>& tensor() const { return tensor_; }

  // Records that an in-place Forward wrote the gradient into the buffer: the
  // tensor moves to GRADIENT with no pending factor. Only for in-place leases.
  void FinishInPlace(Reduction reduction);

  // Records that the buffer holds new values (an overwrite): the tensor moves
  // to LOGITS, and a gradient's pending or applied factors are dropped. Only
  // for in-place leases.
  void FinishOverwrite();

 private:
  friend class TensorStore;
  ForwardLease(std::shared_ptr<Tensor> tensor, bool in_place,
               std::function<absl::Time()> clock);
  void Reset();

  std::shared_ptr<Tensor> tensor_;
  bool in_place_ = false;
  std::function<absl::Time()> clock_;
};

// Device memory an RPC works in (an Evaluate's block buffers), charged to
// the memory budget as tensors are (not to a tenant's quota) until it goes.
// Empty when default-constructed. Movable; not thread-safe.
class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  void* data() const;  // null when empty
  size_t bytes() const { return bytes_; }

 private:
  friend class TensorStore;
  ScratchBuffer(std::shared_ptr<internal::Allocation> allocation, size_t bytes)
      : allocation_(std::move(allocation)), bytes_(bytes) {}
  std::shared_ptr<internal::Allocation> allocation_;
  size_t bytes_ = 0;
};

// A tensor being filled (an Upload in progress, or the output of a Forward):
// its memory is reserved and allocated but it has no visible handle yet.
// Destroying it without Commit returns everything. Not thread-safe: one owner.
class PendingTensor {
 public:
  PendingTensor(const PendingTensor&) = delete;
  PendingTensor& operator=(const PendingTensor&) = delete;
  ~PendingTensor();

  int64_t bytes() const { return bytes_; }
  int64_t received_bytes() const { return received_; }
  void* data() const;

  // Appends upload bytes. INVALID_ARGUMENT (and nothing written) when they
  // would exceed the size of the header; INTERNAL on a device failure.
  absl::Status Append(const void* host, size_t bytes);

  // Declares the buffer fully written by the device (a Forward output).
  void MarkFilled() { received_ = bytes_; }

  // Publishes the tensor under its handle. INVALID_ARGUMENT when fewer bytes
  // than the header said were received (the pending tensor is then still
  // discarded on destruction). May be called once.
  // An overwrite (TensorStore::Overwrite) returns the overwritten tensor,
  // now in state LOGITS, under its own handle.
  absl::StatusOr<std::shared_ptr<Tensor>> Commit(
      Reduction gradient_reduction = Reduction::kMean);

 private:
  friend class TensorStore;
  // The upload's idempotency key (empty: none), claimed in the store from
  // Create on: the committed tensor takes it over; otherwise destruction
  // frees it.
  std::string idempotency_key_;
  PendingTensor(TensorStore* store, std::string tenant, std::string label,
                DType dtype, std::vector<int64_t> shape, TensorState state,
                std::shared_ptr<internal::Allocation> allocation);

  TensorStore* const store_;
  const std::string tenant_;
  const std::string label_;
  const DType dtype_;
  const std::vector<int64_t> shape_;
  const TensorState state_;
  const int64_t bytes_;
  std::shared_ptr<internal::Allocation> allocation_;
  int64_t received_ = 0;
  bool committed_ = false;
  // An overwrite: the exclusive write lease on the tensor whose buffer this
  // is (empty otherwise).
  ForwardLease overwrite_;
};

// All the tensors of one instance on one device. Thread-safe; lock order is
// store -> tensor -> memory account.
class TensorStore {
 public:
  struct Options {
    int64_t budget_bytes = 0;  // > 0
    absl::Duration ttl = absl::Hours(1);
    // Injectable for tests; defaults to absl::Now.
    std::function<absl::Time()> clock;
    // How many released/expired handles are remembered to explain NOT_FOUND.
    size_t remembered_handles = 1 << 16;
    // Fixed instance id (tests): 8 lower-case hex digits (common/handle.h);
    // empty = 8 random ones.
    std::string instance_id;
    // Per-tenant byte and tensor quotas, charged by Create on top of the
    // budget; null = none. Shared: tensors may outlive the store.
    std::shared_ptr<TenantQuotas> quotas;
  };

  // `device` must outlive the store and every tensor it hands out.
  TensorStore(Device* device, Options options);
  TensorStore(const TensorStore&) = delete;
  TensorStore& operator=(const TensorStore&) = delete;
  ~TensorStore();

  const std::string& instance_id() const { return instance_id_; }
  Device* device() const { return device_; }
  absl::Duration ttl() const { return options_.ttl; }
  absl::Time Now() const { return clock_(); }

  // Reserves and allocates a tensor of `dtype` and `shape`. INVALID_ARGUMENT
  // for an invalid dtype, not 1 or 2 dims, a dimension <= 0 or a size
  // overflow; RESOURCE_EXHAUSTED (naming requested, used and budget bytes)
  // when it does not fit the budget or the device, or (naming the tenant and
  // its numbers) when it passes the tenant's quota, which is charged the
  // tensor's bytes, the label's bytes and kTensorBookkeepingBytes. The label
  // is the caller's to bound. The caller owns the result.
  //
  // With an `idempotency_key` (an upload's, non-empty), the pending tensor
  // claims the key among `tenant`'s: its tensor, once committed, is what the
  // key names until it is released or expires (FindUpload); a pending tensor
  // destroyed uncommitted frees the key. ABORTED (nothing reserved) when the
  // key is claimed already: by an upload in flight, or by a stored tensor
  // (an upload that committed after the caller's FindUpload).
  absl::StatusOr<std::unique_ptr<PendingTensor>> Create(
      const std::string& tenant, DType dtype, std::vector<int64_t> shape,
      std::string label, TensorState state = TensorState::kLogits,
      const std::string& idempotency_key = "");

  // The stored tensor that `tenant`'s upload with `idempotency_key` committed
  // (touched as used), or null when the key names none (never used, its
  // tensor released or expired, or its upload still in flight: Create then
  // says ABORTED). ALREADY_EXISTS when the tensor's dtype, shape or label are
  // not `dtype`, `shape` and `label` (the message names both).
  absl::StatusOr<std::shared_ptr<Tensor>> FindUpload(
      const std::string& tenant, const std::string& idempotency_key,
      DType dtype, const std::vector<int64_t>& shape, const std::string& label);

  // Allocates `bytes` (> 0) of working memory on the device that an RPC of
  // `tenant` holds (an Evaluate's block buffers, LinearForward's staged dX):
  // charged to the tenant's byte quota, then to the budget, until the buffer
  // goes. RESOURCE_EXHAUSTED as Create (the quota's message naming the
  // tenant and its numbers).
  absl::StatusOr<ScratchBuffer> AllocateScratch(const std::string& tenant,
                                                int64_t bytes);

  // Charges `bytes` of host memory that an RPC of `tenant` holds (a data
  // connection's frame buffer) to the tenant's byte quota until the charge
  // goes; an empty charge without quotas. RESOURCE_EXHAUSTED (naming the
  // tenant and its numbers) past the quota, nothing charged then.
  absl::StatusOr<QuotaCharge> ChargeTenantBytes(const std::string& tenant,
                                                int64_t bytes);

  // Charges `bytes` (>= 0) of working memory that the device allocates by
  // itself for an RPC of `tenant` (a kernel's workspace) to the tenant's byte
  // quota and the budget, until the result goes; its data() is null.
  // RESOURCE_EXHAUSTED as AllocateScratch, the message beginning with `what`.
  absl::StatusOr<ScratchBuffer> ChargeWorkspace(const std::string& tenant,
                                                int64_t bytes,
                                                absl::string_view what);

  // The tensor `handle` of `tenant`, touched as used. INVALID_ARGUMENT (before
  // any lookup) when the handle is empty or not of the shape of
  // common/handle.h; NOT_FOUND when it is unknown, of another tenant, of
  // another instance, released or expired (the message says which when it
  // can).
  absl::StatusOr<std::shared_ptr<Tensor>> Get(const std::string& tenant,
                                              const std::string& handle);

  // Removes `handle` from the store and returns its size. NOT_FOUND as Get.
  // Users holding the tensor keep it until they finish.
  absl::StatusOr<int64_t> Release(const std::string& tenant,
                                  const std::string& handle);

  // The tensors of `tenant`, oldest first (ties by handle).
  std::vector<TensorRecord> List(const std::string& tenant);

  // One page of List's order: at most `limit` tensors of `tenant` that come
  // after `after`; `*more` says whether others follow the page. Paging on
  // from a page's last tensor sees every tensor once when none is added or
  // removed meanwhile (a tensor created meanwhile comes on a later page).
  std::vector<TensorRecord> List(const std::string& tenant,
                                 const ListPosition& after, size_t limit,
                                 bool* more);

  StoreStats Stats() const;

  // What each tenant holds now, ordered by tenant. One pass under the store
  // lock (for metrics scrapes, not for hot paths).
  std::vector<TenantUsage> UsageByTenant() const;

  // Starts reading `tensor`: waits while an in-place write runs on it.
  ReadLease BeginRead(std::shared_ptr<Tensor> tensor);

  // Starts a Forward on `tensor`. FAILED_PRECONDITION when it holds a
  // gradient, when another Forward runs on it, or (in_place) while it is
  // being read.
  absl::StatusOr<ForwardLease> BeginForward(std::shared_ptr<Tensor> tensor,
                                            bool in_place);

  // Starts an exclusive write of `tensor`'s buffer whatever its state (an
  // accumulator of LinearForward, an overwrite): FAILED_PRECONDITION while
  // anything else reads or writes it. The lease's FinishOverwrite (or
  // nothing) decides the state; dropping it ends the write.
  absl::StatusOr<ForwardLease> BeginWrite(std::shared_ptr<Tensor> tensor);

  // As BeginRead, but FAILED_PRECONDITION instead of waiting while the
  // tensor is being written (a call that must not wait on a client's upload).
  absl::StatusOr<ReadLease> TryBeginRead(std::shared_ptr<Tensor> tensor);

  // Starts overwriting the stored tensor `handle` of `tenant` with new bytes
  // of the same `dtype` and `shape`: the PendingTensor's buffer is the
  // tensor's own (no memory is reserved), its Commit returns the tensor.
  // NOT_FOUND as Get; INVALID_ARGUMENT for another dtype or shape;
  // FAILED_PRECONDITION as BeginWrite. Until the PendingTensor goes, the tensor
  // is written (other users fail or wait as for an in-place Forward).
  absl::StatusOr<std::unique_ptr<PendingTensor>> Overwrite(
      const std::string& tenant, const std::string& handle, DType dtype,
      const std::vector<int64_t>& shape);

  // Records grad_output for a gradient (Backward): `token_scale` empty means
  // the scalar `scale`. With `materialize`, applies it to the buffer on the
  // device, in place; `*kernel_launched` says whether that ran. The factor
  // replaces the previous one. FAILED_PRECONDITION when the tensor holds
  // logits, is being read or written, or was materialized with another
  // factor; INVALID_ARGUMENT for a non-finite factor, per-token factors whose
  // count is not rows or for a gradient not computed with reduction NONE.
  absl::Status RecordGradOutput(const std::shared_ptr<Tensor>& tensor,
                                double scale, std::vector<float> token_scale,
                                bool materialize, bool* kernel_launched);

  // Drops tensors idle for longer than the TTL (not in use by any RPC);
  // returns how many.
  int ExpireIdle();

  // Waits until the used bytes equal `bytes` or `timeout` passes; returns
  // whether they do. For tests: uploads are torn down asynchronously.
  bool AwaitUsedBytes(int64_t bytes, absl::Duration timeout) const;

 private:
  friend class PendingTensor;

  std::string NewHandle() const;
  absl::StatusOr<std::shared_ptr<Tensor>> Publish(
      const std::string& tenant, std::string label, DType dtype,
      std::vector<int64_t> shape, TensorState state,
      std::shared_ptr<internal::Allocation> allocation, Reduction reduction);
  void ForgetLocked(const std::string& handle, const char* reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A pending tensor with an idempotency key was committed as `handle`
  // (BindUploadKey) or dropped (FreeUploadKey).
  void BindUploadKey(const std::string& tenant, const std::string& key,
                     const std::string& handle) ABSL_LOCKS_EXCLUDED(mu_);
  void FreeUploadKey(const std::string& tenant, const std::string& key)
      ABSL_LOCKS_EXCLUDED(mu_);
  void MaybeSweep() ABSL_LOCKS_EXCLUDED(mu_);

  Device* const device_;
  const Options options_;
  const std::function<absl::Time()> clock_;
  const std::string instance_id_;
  const std::shared_ptr<internal::MemoryAccount> account_;

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Tensor>> tensors_
      ABSL_GUARDED_BY(mu_);
  // Recently released or expired handles and why, oldest first.
  absl::flat_hash_map<std::string, const char*> gone_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> gone_order_ ABSL_GUARDED_BY(mu_);
  absl::Time last_sweep_ ABSL_GUARDED_BY(mu_);
  // Uploads' idempotency keys, per tenant: (tenant, key) -> the handle of
  // the tensor committed under it, or "" while its upload is in flight; and
  // back from handle to (tenant, key), to forget a key with its tensor.
  using UploadKey = std::pair<std::string, std::string>;
  absl::flat_hash_map<UploadKey, std::string> upload_keys_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, UploadKey> handle_keys_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lossd

#endif  // LOSSD_SERVER_TENSOR_STORE_H_
