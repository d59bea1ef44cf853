// common/files.h: reading a named file, and the errors that name its option.
#include "common/files.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

namespace lossd {
namespace {

using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/lossd_files_test_" +
         std::to_string(getpid()) + "_" + name;
}

TEST(ReadNonEmptyFileTest, ReadsTheWholeFile) {
  const std::string path = TempPath("pem");
  const std::string contents("-----BEGIN\n\0binary\xff\n", 19);
  std::ofstream(path, std::ios::binary) << contents;
  EXPECT_EQ(*ReadNonEmptyFile("--tls_cert", path), contents);
  unlink(path.c_str());
}

TEST(ReadNonEmptyFileTest, MissingAndEmptyFilesNameTheOption) {
  const std::string missing = TempPath("missing");
  absl::StatusOr<std::string> read = ReadNonEmptyFile("--tokens_file", missing);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(read.status().message(),
              HasSubstr("--tokens_file: cannot read '" + missing + "'"));
  const std::string empty = TempPath("empty");
  std::ofstream(empty, std::ios::binary).flush();
  read = ReadNonEmptyFile("tls_ca_file", empty);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(read.status().message(),
              HasSubstr("tls_ca_file: '" + empty + "' is empty"));
  unlink(empty.c_str());
}

}  // namespace
}  // namespace lossd
