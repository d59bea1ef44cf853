// Test helper: a minimal HTTP/1.0 GET and a Prometheus text-format parser,
// enough for lossd's own /metrics (see scrape.h).
#include "tests/e2e/scrape.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace lossd {
namespace scrape {
namespace {

// Closes the socket on every return path.
class Socket {
 public:
  Socket() : fd_(socket(AF_INET, SOCK_STREAM, 0)) {}
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() {
    if (fd_ >= 0) close(fd_);
  }
  int fd() const { return fd_; }

 private:
  const int fd_;
};

// Parses `{a="x",b="y"}` (the braces included) into `labels`; advances
// `text` past it.
bool ParseLabels(absl::string_view* text,
                 std::map<std::string, std::string>* labels) {
  if (!absl::ConsumePrefix(text, "{")) return false;
  while (!absl::ConsumePrefix(text, "}")) {
    const size_t equals = text->find("=\"");
    if (equals == absl::string_view::npos) return false;
    const std::string name(text->substr(0, equals));
    text->remove_prefix(equals + 2);
    std::string value;
    for (;;) {
      if (text->empty()) return false;
      const char c = text->front();
      text->remove_prefix(1);
      if (c == '"') break;
      if (c == '\\') {
        if (text->empty()) return false;
        const char escaped = text->front();
        text->remove_prefix(1);
        value.push_back(escaped == 'n' ? '\n' : escaped);
        continue;
      }
      value.push_back(c);
    }
    (*labels)[name] = value;
    absl::ConsumePrefix(text, ",");
  }
  return true;
}

}  // namespace

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  Socket socket;
  if (socket.fd() < 0) {
    return absl::UnavailableError(
        absl::StrCat("socket: ", std::strerror(errno)));
  }
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(socket.fd(), reinterpret_cast<const sockaddr*>(&address),
              sizeof(address)) != 0) {
    return absl::UnavailableError(absl::StrCat("connect to 127.0.0.1:", port,
                                               ": ", std::strerror(errno)));
  }
  // HTTP/1.0 and no Accept-Encoding: the answer is plain and ends at EOF.
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = send(socket.fd(), request.data() + sent,
                           request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) {
      return absl::UnavailableError(
          absl::StrCat("send: ", std::strerror(errno)));
    }
    sent += static_cast<size_t>(n);
  }
  std::string response;
  char buffer[16384];
  for (;;) {
    const ssize_t n = recv(socket.fd(), buffer, sizeof(buffer), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::UnavailableError(
          absl::StrCat("recv: ", std::strerror(errno)));
    }
    if (n == 0) break;
    response.append(buffer, static_cast<size_t>(n));
  }
  const size_t header_end = response.find("\r\n\r\n");
  if (header_end == std::string::npos) {
    return absl::InternalError(
        absl::StrCat("no end of headers in: ", response.substr(0, 200)));
  }
  const absl::string_view status_line =
      absl::string_view(response).substr(0, response.find("\r\n"));
  if (status_line.find(" 200 ") == absl::string_view::npos) {
    return absl::InternalError(absl::StrCat("GET ", path, ": ", status_line));
  }
  return response.substr(header_end + 4);
}

absl::StatusOr<std::vector<Sample>> ParseTextFormat(const std::string& text) {
  std::vector<Sample> samples;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    Sample sample;
    absl::string_view rest = line;
    const size_t name_end = rest.find_first_of("{ ");
    if (name_end == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("not a sample: ", line));
    }
    sample.name = std::string(rest.substr(0, name_end));
    rest.remove_prefix(name_end);
    if (!rest.empty() && rest.front() == '{' &&
        !ParseLabels(&rest, &sample.labels)) {
      return absl::InvalidArgumentError(
          absl::StrCat("malformed labels: ", line));
    }
    rest = absl::StripLeadingAsciiWhitespace(rest);
    // An optional timestamp follows the value.
    const absl::string_view value = rest.substr(0, rest.find(' '));
    if (value == "Nan" || value == "NaN") {
      sample.value = std::numeric_limits<double>::quiet_NaN();
    } else if (!absl::SimpleAtod(value, &sample.value)) {
      return absl::InvalidArgumentError(absl::StrCat("bad value: ", line));
    }
    samples.push_back(std::move(sample));
  }
  return samples;
}

std::optional<double> FindSample(
    const std::vector<Sample>& samples, const std::string& name,
    const std::map<std::string, std::string>& labels) {
  for (const Sample& sample : samples) {
    if (sample.name == name && sample.labels == labels) return sample.value;
  }
  return std::nullopt;
}

absl::StatusOr<std::vector<Sample>> Scrape(int port) {
  absl::StatusOr<std::string> body = HttpGet(port, "/metrics");
  if (!body.ok()) return body.status();
  return ParseTextFormat(*body);
}

}  // namespace scrape
}  // namespace lossd
