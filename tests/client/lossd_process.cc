// Process plumbing for the client tests (see lossd_process.h): posix_spawn,
// pidfd + poll for waits with a timeout, inotify for the port file.
#include "tests/client/lossd_process.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/inotify.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

extern char** environ;

namespace lossd {
namespace client_test {
namespace {

absl::Status Errno(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

int PidfdOpen(pid_t pid) {
  return static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
}

int ExitCode(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return -1;
}

absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv,
                            posix_spawn_file_actions_t* actions) {
  std::vector<char*> args;
  for (const std::string& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid;
  const int rc =
      posix_spawn(&pid, args[0], actions, nullptr, args.data(), environ);
  if (rc != 0) {
    return absl::InternalError(
        absl::StrCat("cannot start ", argv[0], ": ", std::strerror(rc)));
  }
  return pid;
}

// Milliseconds left until `deadline`, for poll().
int MillisLeft(absl::Time deadline) {
  const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(ms, INT_MAX)));
}

// The port in `path` once the file holds a complete "PORT\n"; 0 otherwise.
int ReadPort(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string content = text.str();
  if (content.empty() || content.back() != '\n') return 0;
  int port = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(content), &port)) return 0;
  return port;
}

}  // namespace

LossdProcess::LossdProcess(pid_t pid, int pidfd, std::string dir, int port)
    : pid_(pid), pidfd_(pidfd), dir_(std::move(dir)), port_(port) {}

absl::StatusOr<std::unique_ptr<LossdProcess>> LossdProcess::Start(
    const std::string& binary, const std::vector<std::string>& extra_args,
    absl::Duration timeout) {
  char dir_template[] = "/tmp/lossd_client_test_XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return Errno("mkdtemp");
  const std::string dir = dir_template;
  const std::string port_file = dir + "/port";

  // Watch before starting, so the rename cannot be missed.
  const int inotify = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  if (inotify < 0) return Errno("inotify_init1");
  if (inotify_add_watch(inotify, dir.c_str(), IN_MOVED_TO | IN_CLOSE_WRITE) <
      0) {
    close(inotify);
    return Errno("inotify_add_watch");
  }
  // Metrics off and a free data port: tests run in parallel and must not
  // compete for fixed ports.
  std::vector<std::string> argv = {binary,         "--host=127.0.0.1",
                                   "--port=0",     "--port_file=" + port_file,
                                   "--device=cpu", "--metrics_port=-1",
                                   "--data_port=0"};
  argv.insert(argv.end(), extra_args.begin(), extra_args.end());
  absl::StatusOr<pid_t> pid = Spawn(argv, nullptr);
  if (!pid.ok()) {
    close(inotify);
    return pid.status();
  }
  const int pidfd = PidfdOpen(*pid);
  auto process = std::unique_ptr<LossdProcess>(
      new LossdProcess(*pid, pidfd, dir, /*port=*/0));

  const absl::Time deadline = absl::Now() + timeout;
  absl::Status status = absl::OkStatus();
  while (true) {
    process->port_ = ReadPort(port_file);
    if (process->port_ > 0) break;
    pollfd fds[2] = {{inotify, POLLIN, 0}, {pidfd, POLLIN, 0}};
    const int ready = poll(fds, pidfd >= 0 ? 2 : 1, MillisLeft(deadline));
    if (ready < 0 && errno != EINTR) {
      status = Errno("poll");
      break;
    }
    if (ready == 0) {
      status = absl::DeadlineExceededError(
          absl::StrCat(binary, " wrote no port file within ",
                       absl::FormatDuration(timeout)));
      break;
    }
    if (pidfd >= 0 && (fds[1].revents & POLLIN)) {
      status = absl::InternalError(
          absl::StrCat(binary, " exited before serving (see its stderr)"));
      break;
    }
    char events[4096];
    while (read(inotify, events, sizeof(events)) > 0) {
    }
  }
  close(inotify);
  if (!status.ok()) return status;  // the destructor stops the process
  return process;
}

std::string LossdProcess::address() const {
  return absl::StrCat("127.0.0.1:", port_);
}

absl::StatusOr<int> LossdProcess::Stop(absl::Duration timeout) {
  if (stopped_) return absl::FailedPreconditionError("already stopped");
  stopped_ = true;
  kill(pid_, SIGTERM);
  if (pidfd_ >= 0) {
    pollfd fd = {pidfd_, POLLIN, 0};
    if (poll(&fd, 1, absl::ToInt64Milliseconds(timeout)) == 0) {
      kill(pid_, SIGKILL);
    }
  }
  int wait_status = 0;
  if (waitpid(pid_, &wait_status, 0) != pid_) return Errno("waitpid");
  return ExitCode(wait_status);
}

LossdProcess::~LossdProcess() {
  if (!stopped_) Stop().IgnoreError();
  if (pidfd_ >= 0) close(pidfd_);
  unlink((dir_ + "/port").c_str());
  unlink((dir_ + "/port.tmp").c_str());
  rmdir(dir_.c_str());
}

absl::StatusOr<CommandResult> RunCommand(const std::vector<std::string>& argv) {
  int out_pipe[2], err_pipe[2];
  if (pipe2(out_pipe, O_CLOEXEC) != 0) return Errno("pipe2");
  if (pipe2(err_pipe, O_CLOEXEC) != 0) {
    close(out_pipe[0]);
    close(out_pipe[1]);
    return Errno("pipe2");
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out_pipe[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err_pipe[1], STDERR_FILENO);
  absl::StatusOr<pid_t> pid = Spawn(argv, &actions);
  posix_spawn_file_actions_destroy(&actions);
  close(out_pipe[1]);
  close(err_pipe[1]);
  CommandResult result;
  if (pid.ok()) {
    pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
    std::string* sinks[2] = {&result.out, &result.err};
    int open_fds = 2;
    while (open_fds > 0) {
      if (poll(fds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        break;
      }
      for (int i = 0; i < 2; ++i) {
        if (fds[i].fd < 0 || fds[i].revents == 0) continue;
        char buffer[8192];
        const ssize_t n = read(fds[i].fd, buffer, sizeof(buffer));
        if (n > 0) {
          sinks[i]->append(buffer, static_cast<std::size_t>(n));
        } else {
          fds[i].fd = -1;
          --open_fds;
        }
      }
    }
    int wait_status = 0;
    waitpid(*pid, &wait_status, 0);
    result.exit_code = ExitCode(wait_status);
  }
  close(out_pipe[0]);
  close(err_pipe[0]);
  if (!pid.ok()) return pid.status();
  return result;
}

TempDir::TempDir() {
  char dir_template[] = "/tmp/lossd_client_test_XXXXXX";
  if (mkdtemp(dir_template) != nullptr) path_ = dir_template;
}

TempDir::~TempDir() {
  if (path_.empty()) return;
  if (DIR* dir = opendir(path_.c_str())) {
    while (dirent* entry = readdir(dir)) {
      const std::string name = entry->d_name;
      if (name != "." && name != "..") unlink((path_ + "/" + name).c_str());
    }
    closedir(dir);
  }
  rmdir(path_.c_str());
}

std::string TempDir::File(const std::string& name) const {
  return path_ + "/" + name;
}

}  // namespace client_test
}  // namespace lossd
