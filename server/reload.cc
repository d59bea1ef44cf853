// ConfigWatcher: a thread that compares the watched files' contents with the
// last ones on a period, and reloads what changed.
#include "server/reload.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"

namespace lossd {

std::string Fingerprint(const std::vector<std::string>& paths) {
  // The files are small (certificates, tokens, quotas): their whole contents
  // are the fingerprint, so that no change is missed whatever the mtime.
  std::string fingerprint;
  for (const std::string& path : paths) {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream contents;
    if (in) {
      contents << in.rdbuf();
      absl::StrAppend(&fingerprint, "ok ", contents.str().size(), " ",
                      contents.str(), "\n");
    } else {
      absl::StrAppend(&fingerprint, "error ", std::strerror(errno), "\n");
    }
  }
  return fingerprint;
}

ConfigWatcher::ConfigWatcher(std::vector<ReloadSource> sources,
                             absl::Duration interval, Observer observer)
    : interval_(interval), observer_(std::move(observer)) {
  {
    absl::MutexLock lock(&mu_);
    for (ReloadSource& source : sources) {
      std::string fingerprint = Fingerprint(source.paths);
      watched_.push_back({std::move(source), std::move(fingerprint)});
    }
  }
  thread_ = std::thread([this] { Loop(); });
}

ConfigWatcher::~ConfigWatcher() {
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

absl::Status ConfigWatcher::Reload() {
  absl::MutexLock lock(&mu_);
  return CheckLocked(/*force=*/true);
}

absl::Status ConfigWatcher::CheckNow() {
  absl::MutexLock lock(&mu_);
  return CheckLocked(/*force=*/false);
}

absl::Status ConfigWatcher::CheckLocked(bool force) {
  absl::Status first;
  for (Watched& watched : watched_) {
    std::string fingerprint = Fingerprint(watched.source.paths);
    if (!force && fingerprint == watched.fingerprint) continue;
    // Recorded whatever the outcome: a bad file is reported once, and
    // retried when it changes again.
    watched.fingerprint = std::move(fingerprint);
    const absl::Status status = watched.source.reload();
    if (observer_) observer_(watched.source.name, status);
    if (first.ok()) first = status;
  }
  return first;
}

void ConfigWatcher::Loop() {
  while (!stop_.WaitForNotificationWithTimeout(interval_)) {
    CheckNow().IgnoreError();
  }
}

}  // namespace lossd
