// Live reload of configuration files (certificates, tokens, quotas): lossd is
// stateful, so what changes routinely must change without a restart. Checks
// the files' contents on a period (through symlinks, so Kubernetes' swap of a
// mounted volume's ..data link is seen like an edit) and on demand (SIGHUP).
#ifndef LOSSD_SERVER_RELOAD_H_
#define LOSSD_SERVER_RELOAD_H_

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace lossd {

// One reloadable piece of configuration: the files it is read from and the
// function that reads, checks and applies them (leaving what is in force
// alone when it returns an error).
struct ReloadSource {
  std::string name;  // "tls", "tokens", "quotas": metric label and logs
  std::vector<std::string> paths;
  std::function<absl::Status()> reload;
};

// Calls a source's reload when the contents of its files differ from the last
// check, or for every source when Reload() is called. A failed reload is
// reported once per distinct contents (not again at every period) and is
// retried when the files change again or on Reload(). Thread-safe; reloads
// never run concurrently.
class ConfigWatcher {
 public:
  // After every reload attempt: the source's name and the outcome.
  using Observer =
      std::function<void(const std::string& name, const absl::Status& status)>;

  // Records the files' current contents as loaded (the caller has just read
  // them) and starts checking every `interval` (> 0).
  ConfigWatcher(std::vector<ReloadSource> sources, absl::Duration interval,
                Observer observer);
  ConfigWatcher(const ConfigWatcher&) = delete;
  ConfigWatcher& operator=(const ConfigWatcher&) = delete;
  // Stops the checks (waits for one in progress).
  ~ConfigWatcher();

  // Reloads every source now, changed or not; returns the first error (each
  // is also reported to the observer).
  absl::Status Reload() ABSL_LOCKS_EXCLUDED(mu_);

  // Checks every source once and reloads the changed ones (what the period
  // does). Returns the first error.
  absl::Status CheckNow() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Watched {
    ReloadSource source;
    std::string fingerprint;
  };
  absl::Status CheckLocked(bool force) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Loop();

  const absl::Duration interval_;
  const Observer observer_;
  absl::Mutex mu_;
  std::vector<Watched> watched_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_;
  std::thread thread_;
};

// The contents of `paths` in one string (a missing or unreadable file shows
// as its error), to compare with an earlier one.
std::string Fingerprint(const std::vector<std::string>& paths);

}  // namespace lossd

#endif  // LOSSD_SERVER_RELOAD_H_
