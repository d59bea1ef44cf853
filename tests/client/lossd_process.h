// Test helpers that run real processes: a lossd server on 127.0.0.1:0 (its
// port read from --port_file, waiting on inotify rather than sleeping), and
// one-shot commands such as lossctl with their output captured.
#ifndef LOSSD_TESTS_CLIENT_LOSSD_PROCESS_H_
#define LOSSD_TESTS_CLIENT_LOSSD_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace lossd {
namespace client_test {

// A lossd child process. Not thread-safe.
class LossdProcess {
 public:
  // Starts `binary --host=127.0.0.1 --port=0 --port_file=... --device=cpu
  // --metrics_port=-1 --data_port=0` plus `extra_args`, and returns once the
  // server wrote its port file. DEADLINE_EXCEEDED when that takes longer than
  // `timeout`; INTERNAL when the process cannot start or exits first (its
  // stderr is the test's).
  static absl::StatusOr<std::unique_ptr<LossdProcess>> Start(
      const std::string& binary,
      const std::vector<std::string>& extra_args = {},
      absl::Duration timeout = absl::Seconds(60));

  // Stops the server (Stop) if it is still running.
  ~LossdProcess();
  LossdProcess(const LossdProcess&) = delete;
  LossdProcess& operator=(const LossdProcess&) = delete;

  int port() const { return port_; }
  std::string address() const;  // "127.0.0.1:PORT"

  // SIGTERM, then waits up to `timeout` (SIGKILL after it). Returns the exit
  // code, or 128 + signal number when killed by a signal.
  absl::StatusOr<int> Stop(absl::Duration timeout = absl::Seconds(60));

 private:
  LossdProcess(pid_t pid, int pidfd, std::string dir, int port);

  pid_t pid_;
  int pidfd_;  // for waiting with a timeout
  std::string dir_;
  int port_;
  bool stopped_ = false;
};

struct CommandResult {
  int exit_code = -1;  // 128 + signal when killed by one
  std::string out;
  std::string err;
};

// Runs `argv` (argv[0] a path) to completion, capturing stdout and stderr.
// INTERNAL when it cannot be started.
absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv);

// A fresh directory under /tmp, removed with its files on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const;

 private:
  std::string path_;
};

}  // namespace client_test
}  // namespace lossd

#endif  // LOSSD_TESTS_CLIENT_LOSSD_PROCESS_H_
