// Test helper: scrapes a Prometheus /metrics endpoint over loopback with one
// plain HTTP/1.0 GET on a socket (no HTTP client dependency) and parses the
// text exposition format into samples that tests can look up.
#ifndef LOSSD_TESTS_E2E_SCRAPE_H_
#define LOSSD_TESTS_E2E_SCRAPE_H_

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace lossd {
namespace scrape {

// One sample line: name{labels} value.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0.0;
};

// GETs http://127.0.0.1:`port``path` and returns the body of a 200 response.
// UNAVAILABLE when the connection fails, INTERNAL for a non-200 answer or a
// malformed response. Blocking; thread-safe.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);

// Parses the text format (comments and blank lines skipped). INVALID_ARGUMENT
// naming the first line that is not a sample.
absl::StatusOr<std::vector<Sample>> ParseTextFormat(const std::string& text);

// The value of the sample `name` whose labels are exactly `labels`, if any.
std::optional<double> FindSample(
    const std::vector<Sample>& samples, const std::string& name,
    const std::map<std::string, std::string>& labels = {});

// HttpGet(port, "/metrics") then ParseTextFormat.
absl::StatusOr<std::vector<Sample>> Scrape(int port);

}  // namespace scrape
}  // namespace lossd

#endif  // LOSSD_TESTS_E2E_SCRAPE_H_
