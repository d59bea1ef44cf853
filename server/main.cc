// lossd: the GPU-resident cross-entropy service. Parses flags, serves until
// SIGTERM/SIGINT, then drains and exits 0. SIGHUP reloads the certificate,
// token and quota files.
#include <csignal>
#include <cstdio>
#include <string>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "server/flags.h"
#include "server/server.h"

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "lossd [--port=50051] [--device=auto|cpu|cuda] [--memory_budget=8G] ...");
  // --help and --helpshort list the flags of files that look like the
  // program's main file (".../lossd.cc" by absl's default); lossd's are all
  // in server/flags.cc. --helpfull still adds those of gRPC and absl. absl
  // heads each file's flags with the path the file was compiled from, a
  // build machine's: lossd's are headed "lossd" instead.
  absl::FlagsUsageConfig usage;
  usage.normalize_filename = [](absl::string_view file) -> std::string {
    if (absl::EndsWith(file, "server/flags.cc")) return "lossd";
    return std::string(file);
  };
  const auto lossd_flags = [](absl::string_view file) {
    return file == "lossd" || absl::EndsWith(file, "server/flags.cc");
  };
  usage.contains_help_flags = lossd_flags;
  usage.contains_helpshort_flags = lossd_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::ParseCommandLine(argc, argv);

  // Blocked before any thread starts, so that every thread inherits the mask
  // and the signals are only taken by sigwait below.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  absl::StatusOr<lossd::ServerConfig> config = lossd::ConfigFromFlags();
  if (!config.ok()) {
    std::fprintf(stderr, "lossd: %s\n", config.status().ToString().c_str());
    return 2;
  }
  // Process policy for an unusable device (sticky CUDA error): exit at once
  // with status 3.
  config->on_fatal_device_error = lossd::ExitAfterFatalDeviceError;
  absl::StatusOr<std::unique_ptr<lossd::LossdServer>> server =
      lossd::LossdServer::Start(*config);
  if (!server.ok()) {
    std::fprintf(stderr, "lossd: %s\n", server.status().ToString().c_str());
    return 1;
  }
  int signal = 0;
  while (sigwait(&signals, &signal) == 0 && signal == SIGHUP) {
    // Failures are logged and counted by the server; the old files stay.
    std::fprintf(stderr, "lossd: SIGHUP, reloading configuration files\n");
    (*server)->Reload().IgnoreError();
  }
  std::fprintf(stderr, "lossd: signal %d, draining (up to %s)\n", signal,
               absl::FormatDuration(config->drain_timeout).c_str());
  const bool clean = (*server)->Drain();
  std::fprintf(stderr, "lossd: stopped%s\n",
               clean ? "" : " (drain timeout: running RPCs were cancelled)");
  return 0;
}
