// Striped uploads (striped_uploads.h): the assembly's bookkeeping, the
// registry and its sweeper.
#include "server/striped_uploads.h"

#include <algorithm>
#include <utility>

#include "common/echo.h"
#include "common/status_macros.h"
#include "common/tensor_math.h"
#include "server/admission.h"

namespace lossd {

void EndStripes(const std::vector<std::shared_ptr<StripeLink>>& links,
                const absl::Status& status, const TensorRecord* info) {
  for (const std::shared_ptr<StripeLink>& link : links) {
    if (link->Claim()) link->reactor->EndFromAssembly(status, info);
  }
}

std::string StripeCause(int index, const absl::Status& status) {
  return absl::StrCat("stripe ", index, ": ",
                      absl::StatusCodeToString(status.code()), ": ",
                      status.message());
}

absl::StatusOr<std::shared_ptr<PendingTensor>> StripeAssembly::Join(
    const StripeHeader& header, int index, std::shared_ptr<StripeLink> link) {
  absl::MutexLock lock(&mu_);
  if (fate_ != Fate::kOpen) {
    return absl::AbortedError(absl::StrCat(
        "striped upload ", upload_id_,
        fate_ == Fate::kCommitted ? " already completed" : " failed: ", cause_,
        "; a new upload needs a new upload_id"));
  }
  if (header.dtype != header_.dtype || header.shape != header_.shape ||
      header.label != header_.label || header.count != header_.count ||
      header.idempotency_key != header_.idempotency_key ||
      header.overwrite_handle != header_.overwrite_handle) {
    // The overwrite target is named only when one of them has one.
    const bool overwrites =
        !header.overwrite_handle.empty() || !header_.overwrite_handle.empty();
    const auto target = [overwrites](const std::string& handle) {
      return overwrites ? absl::StrCat(" overwriting ", Echo(handle))
                        : std::string();
    };
    return absl::InvalidArgumentError(absl::StrCat(
        "stripe ", index, " of striped upload ", upload_id_, " says ",
        DTypeName(header.dtype), " ", ShapeString(header.shape), " label ",
        Echo(header.label), " idempotency_key ", Echo(header.idempotency_key),
        " in ", header.count, " stripes", target(header.overwrite_handle),
        "; the upload is ", DTypeName(header_.dtype), " ",
        ShapeString(header_.shape), " label ", Echo(header_.label),
        " idempotency_key ", Echo(header_.idempotency_key), " in ",
        header_.count, " stripes", target(header_.overwrite_handle)));
  }
  if (links_[static_cast<size_t>(index)] != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stripe ", index, " of striped upload ", upload_id_, " arrived twice"));
  }
  links_[static_cast<size_t>(index)] = std::move(link);
  ++attached_;
  return pending_;
}

StripeAssembly::DoneResult StripeAssembly::Done(int index) {
  DoneResult result;
  absl::MutexLock lock(&mu_);
  if (fate_ != Fate::kOpen) {
    result.status = absl::AbortedError(
        absl::StrCat("striped upload ", upload_id_, " failed: ", cause_));
    return result;
  }
  if (++done_ < header_.count) {
    result.wait = true;
    return result;
  }
  for (int i = 0; i < header_.count; ++i) {
    if (i != index) result.others.push_back(links_[static_cast<size_t>(i)]);
  }
  links_.clear();
  result.decided = true;
  pending_->MarkFilled();
  absl::StatusOr<std::shared_ptr<Tensor>> tensor = pending_->Commit();
  pending_.reset();
  if (!tensor.ok()) {
    fate_ = Fate::kFailed;
    cause_ = std::string(tensor.status().message());
    result.status = tensor.status();
    result.others_status = absl::AbortedError(
        absl::StrCat("striped upload ", upload_id_, " failed: ", cause_));
    return result;
  }
  fate_ = Fate::kCommitted;
  result.info = (*tensor)->Info();
  return result;
}

std::vector<std::shared_ptr<StripeLink>> StripeAssembly::Fail(
    int exclude, const std::string& cause, absl::Status* aborted) {
  std::vector<std::shared_ptr<StripeLink>> others;
  absl::MutexLock lock(&mu_);
  if (fate_ != Fate::kOpen) {
    *aborted = absl::OkStatus();
    return others;
  }
  fate_ = Fate::kFailed;
  cause_ = cause;
  *aborted = absl::AbortedError(
      absl::StrCat("striped upload ", upload_id_, " failed: ", cause_));
  for (int i = 0; i < static_cast<int>(links_.size()); ++i) {
    if (i != exclude && links_[static_cast<size_t>(i)] != nullptr) {
      others.push_back(links_[static_cast<size_t>(i)]);
    }
  }
  links_.clear();
  // The memory goes once the stripes still writing let go of it too.
  pending_.reset();
  return others;
}

bool StripeAssembly::Overdue(absl::Time now) const {
  absl::MutexLock lock(&mu_);
  return fate_ == Fate::kOpen && attached_ < header_.count && now >= deadline_;
}

std::string StripeAssembly::MissingStripes() const {
  absl::MutexLock lock(&mu_);
  std::string missing;
  for (int i = 0; i < static_cast<int>(links_.size()); ++i) {
    if (links_[static_cast<size_t>(i)] == nullptr) {
      absl::StrAppend(&missing, missing.empty() ? "" : ", ", i);
    }
  }
  return absl::StrCat(missing, " of ", header_.count);
}

absl::StatusOr<StripedUploads::Attached> StripedUploads::Attach(
    const std::string& tenant, const StripeSpec& stripe,
    const StripeHeader& header, std::shared_ptr<StripeLink> link,
    bool may_create) {
  const std::string key = Key(tenant, stripe.upload_id);
  std::vector<std::shared_ptr<StripeLink>> others;
  absl::Status aborted;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    auto found = open_.find(key);
    if (found == open_.end()) {
      auto gone = finished_.find(key);
      if (gone != finished_.end()) {
        return absl::AbortedError(
            absl::StrCat("striped upload ", stripe.upload_id, " already ",
                         gone->second, "; a new upload needs a new upload_id"));
      }
      if (!may_create) return DrainingError();
      ASSIGN_OR_RETURN(
          std::unique_ptr<PendingTensor> pending,
          header.overwrite_handle.empty()
              ? store_->Create(tenant, header.dtype, header.shape, header.label,
                               TensorState::kLogits, header.idempotency_key)
              : store_->Overwrite(tenant, header.overwrite_handle, header.dtype,
                                  header.shape));
      auto assembly = std::make_shared<StripeAssembly>(
          key, stripe.upload_id, header,
          std::shared_ptr<PendingTensor>(std::move(pending)),
          absl::Now() + timeout_);
      ASSIGN_OR_RETURN(std::shared_ptr<PendingTensor> shared,
                       assembly->Join(header, stripe.index, std::move(link)));
      open_[key] = assembly;
      changed_ = true;
      return Attached{std::move(assembly), std::move(shared)};
    }
    std::shared_ptr<StripeAssembly> assembly = found->second;
    absl::StatusOr<std::shared_ptr<PendingTensor>> shared =
        assembly->Join(header, stripe.index, std::move(link));
    if (shared.ok()) return Attached{std::move(assembly), *std::move(shared)};
    status = shared.status();
    if (status.code() != absl::StatusCode::kInvalidArgument) return status;
    // A stripe that contradicts the upload fails all of it.
    others = assembly->Fail(-1, StripeCause(stripe.index, status), &aborted);
    open_.erase(found);
    RememberLocked(key, absl::StrCat("failed: ", aborted.message()));
  }
  EndStripes(others, aborted, nullptr);
  return status;
}

void StripedUploads::FailIfOpen(const std::string& tenant,
                                const std::string& upload_id,
                                const std::string& cause) {
  const std::string key = Key(tenant, upload_id);
  std::vector<std::shared_ptr<StripeLink>> others;
  absl::Status aborted;
  {
    absl::MutexLock lock(&mu_);
    auto found = open_.find(key);
    if (found == open_.end()) return;
    others = found->second->Fail(-1, cause, &aborted);
    open_.erase(found);
    RememberLocked(key, absl::StrCat("failed: ", aborted.message()));
  }
  EndStripes(others, aborted, nullptr);
}

void StripedUploads::Finished(const StripeAssembly& assembly,
                              std::string what) {
  absl::MutexLock lock(&mu_);
  auto found = open_.find(assembly.key());
  if (found != open_.end() && found->second.get() == &assembly) {
    open_.erase(found);
  }
  RememberLocked(assembly.key(), std::move(what));
}

void StripedUploads::RememberLocked(const std::string& key, std::string what) {
  if (finished_.insert_or_assign(key, std::move(what)).second) {
    finished_order_.push_back(key);
  }
  while (finished_order_.size() > kRememberedIds) {
    finished_.erase(finished_order_.front());
    finished_order_.pop_front();
  }
}

void StripedUploads::Sweep() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    absl::Time next = absl::InfiniteFuture();
    for (const auto& [key, assembly] : open_) {
      next = std::min(next, assembly->deadline());
    }
    auto wake = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return stop_ || changed_;
    };
    mu_.AwaitWithDeadline(absl::Condition(&wake), next);
    changed_ = false;
    if (stop_) break;
    const absl::Time now = absl::Now();
    std::vector<std::shared_ptr<StripeAssembly>> overdue;
    for (auto it = open_.begin(); it != open_.end();) {
      if (it->second->Overdue(now)) {
        overdue.push_back(it->second);
        open_.erase(it++);
      } else {
        ++it;
      }
    }
    for (const std::shared_ptr<StripeAssembly>& assembly : overdue) {
      const std::string cause = absl::StrCat(
          "stripes ", assembly->MissingStripes(), " did not arrive within ",
          absl::FormatDuration(timeout_));
      absl::Status aborted;
      std::vector<std::shared_ptr<StripeLink>> others =
          assembly->Fail(-1, cause, &aborted);
      RememberLocked(assembly->key(),
                     absl::StrCat("failed: ", aborted.message()));
      // Ending RPCs takes reactor locks: not under mu_ (a reactor may be
      // waiting for mu_ in Attach while holding its own).
      mu_.Unlock();
      EndStripes(others, aborted, nullptr);
      mu_.Lock();
    }
  }
}

}  // namespace lossd
