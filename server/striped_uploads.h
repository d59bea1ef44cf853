// Striped uploads (lossd.v1.UploadStripe): the assembly of one tensor from K
// Upload streams, the registry of the uploads in progress per tenant and
// upload_id, and the sweeper that abandons those whose stripes do not all
// arrive in time. No gRPC here: a stripe's RPC is a StripeParticipant.
#ifndef LOSSD_SERVER_STRIPED_UPLOADS_H_
#define LOSSD_SERVER_STRIPED_UPLOADS_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "server/end_link.h"
#include "server/stripe_spec.h"
#include "server/tensor_store.h"

namespace lossd {

// A striped upload is assembled by several Upload RPCs (one per stripe, each
// a StripeParticipant); the classes below are what they share. Lock order: a
// reactor's mu_ -> StripedUploads::mu_ -> StripeAssembly::mu_ -> the store's
// locks. Whoever decides an upload's fate (the stripe that commits it, the
// stripe that fails it, or the sweeper that abandons it) ends the other
// stripes' RPCs only after releasing StripedUploads::mu_ and
// StripeAssembly::mu_; it may hold its own reactor's mu_ then, and takes the
// others' one at a time (only one party ever decides an upload's fate, so two
// reactors never wait for each other).

// The RPC of one stripe, as the party that decides the upload's fate sees it.
class StripeParticipant {
 public:
  // Ends the stripe's RPC on behalf of the party that decided the upload's
  // fate, which claimed the stripe's link: with `status`, and on OK with the
  // committed tensor `info`.
  virtual void EndFromAssembly(const absl::Status& status,
                               const TensorRecord* info) = 0;

 protected:
  ~StripeParticipant() = default;
};
using StripeLink = EndLink<StripeParticipant>;

// Ends the RPC of each link not claimed yet: with `status`, and on OK with a
// response describing `info`. Call holding no assembly or registry lock.
void EndStripes(const std::vector<std::shared_ptr<StripeLink>>& links,
                const absl::Status& status, const TensorRecord* info);

// "stripe 3: INVALID_ARGUMENT: ...": why an upload failed, for the others.
std::string StripeCause(int index, const absl::Status& status);

// What every stripe of one upload must agree on.
struct StripeHeader {
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  std::string label;
  int count = 1;
  std::string idempotency_key;   // empty: none
  std::string overwrite_handle;  // empty = a new tensor
};

// One striped upload being assembled: the reserved tensor and its stripes.
// Thread-safe.
class StripeAssembly {
 public:
  StripeAssembly(std::string key, std::string upload_id, StripeHeader header,
                 std::shared_ptr<PendingTensor> pending, absl::Time deadline)
      : key_(std::move(key)),
        upload_id_(std::move(upload_id)),
        header_(std::move(header)),
        deadline_(deadline),
        pending_(std::move(pending)),
        links_(static_cast<size_t>(header_.count)) {}
  StripeAssembly(const StripeAssembly&) = delete;
  StripeAssembly& operator=(const StripeAssembly&) = delete;

  const std::string& key() const { return key_; }
  const std::string& upload_id() const { return upload_id_; }
  const StripeHeader& header() const { return header_; }

  // Attaches stripe `index` through `link`. Success: the pending tensor to
  // write into (the caller drops it once its writes are finished).
  // INVALID_ARGUMENT when `header` differs from the upload's or `index` is
  // already attached; ABORTED when the upload already completed or failed.
  absl::StatusOr<std::shared_ptr<PendingTensor>> Join(
      const StripeHeader& header, int index, std::shared_ptr<StripeLink> link)
      ABSL_LOCKS_EXCLUDED(mu_);

  // What a stripe whose bytes are all written learns.
  struct DoneResult {
    bool wait = false;     // others are still writing: the RPC waits
    bool decided = false;  // this call decided the upload's fate
    absl::Status status;   // otherwise this stripe's status
    TensorRecord info;     // on OK: the committed tensor
    // Stripes to end (with EndStripes) with `others_status`.
    std::vector<std::shared_ptr<StripeLink>> others;
    absl::Status others_status;
  };
  // Stripe `index` has all its bytes on the device; the last one commits the
  // tensor.
  DoneResult Done(int index) ABSL_LOCKS_EXCLUDED(mu_);

  // Fails the upload because of `cause`. Returns the attached stripes but
  // `exclude` (the failing one, ended by itself; -1 = none), to end with the
  // ABORTED status put in `*aborted`. When the upload's fate was already
  // decided: none, and `*aborted` is OK.
  std::vector<std::shared_ptr<StripeLink>> Fail(int exclude,
                                                const std::string& cause,
                                                absl::Status* aborted)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Not every stripe attached and the deadline passed.
  bool Overdue(absl::Time now) const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Time deadline() const { return deadline_; }
  // The stripes that have not attached, as "2, 5 of 7".
  std::string MissingStripes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  enum class Fate { kOpen, kCommitted, kFailed };

  const std::string key_;
  const std::string upload_id_;
  const StripeHeader header_;
  const absl::Time deadline_;
  mutable absl::Mutex mu_;
  Fate fate_ ABSL_GUARDED_BY(mu_) = Fate::kOpen;
  std::string cause_ ABSL_GUARDED_BY(mu_);  // why it failed
  std::shared_ptr<PendingTensor> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<StripeLink>> links_ ABSL_GUARDED_BY(mu_);
  int attached_ ABSL_GUARDED_BY(mu_) = 0;
  int done_ ABSL_GUARDED_BY(mu_) = 0;
};

// The striped uploads in progress of one service, by tenant and upload_id,
// and the ids recently finished. A sweeper thread abandons the uploads whose
// stripes do not all arrive in time. Thread-safe.
class StripedUploads {
 public:
  struct Attached {
    std::shared_ptr<StripeAssembly> assembly;
    std::shared_ptr<PendingTensor> pending;
  };

  StripedUploads(TensorStore* store, absl::Duration timeout)
      : store_(store), timeout_(timeout), sweeper_([this] { Sweep(); }) {}
  StripedUploads(const StripedUploads&) = delete;
  StripedUploads& operator=(const StripedUploads&) = delete;
  ~StripedUploads() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    sweeper_.join();
  }

  // Attaches stripe `stripe` of `tenant` with `header` through `link`,
  // creating the upload (reserving the whole tensor in the store) when it is
  // the first stripe and `may_create`. Errors: INVALID_ARGUMENT (a header
  // differing from the upload's, an index already attached: the upload then
  // fails), ABORTED (the id recently completed or failed), UNAVAILABLE (no
  // such upload and !may_create: draining), and the store's Create errors.
  absl::StatusOr<Attached> Attach(const std::string& tenant,
                                  const StripeSpec& stripe,
                                  const StripeHeader& header,
                                  std::shared_ptr<StripeLink> link,
                                  bool may_create) ABSL_LOCKS_EXCLUDED(mu_);

  // Fails the upload `upload_id` of `tenant`, if one is open, with `cause`
  // (a stripe whose header was rejected before it could attach).
  void FailIfOpen(const std::string& tenant, const std::string& upload_id,
                  const std::string& cause) ABSL_LOCKS_EXCLUDED(mu_);

  // Forgets an upload whose fate is decided; `what` ("completed", "failed:
  // ...") explains later stripes naming its id.
  void Finished(const StripeAssembly& assembly, std::string what)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  static std::string Key(const std::string& tenant, const std::string& id) {
    // upload_ids never hold '/', tenants may: the id goes first.
    return absl::StrCat(id, "/", tenant);
  }
  void RememberLocked(const std::string& key, std::string what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Sweep() ABSL_LOCKS_EXCLUDED(mu_);

  static constexpr size_t kRememberedIds = 4096;

  TensorStore* const store_;
  const absl::Duration timeout_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<StripeAssembly>> open_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> finished_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> finished_order_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool changed_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sweeper_;  // last: starts once the rest is built
};

}  // namespace lossd

#endif  // LOSSD_SERVER_STRIPED_UPLOADS_H_
