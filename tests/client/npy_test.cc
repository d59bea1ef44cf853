// Tests of the .npy reader/writer: byte-exact agreement with numpy's own
// output, round trips, and rejection of malformed or out-of-scope headers
// (the reader sees untrusted files, so every branch of the parser is hit).
#include "client/npy.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;

// A v1 header around `dict`, padded like numpy so the data is 64-aligned.
std::string V1(const std::string& dict) {
  std::string text = dict;
  const std::size_t total = (10 + text.size() + 1 + 63) / 64 * 64;
  text.append(total - 10 - text.size() - 1, ' ');
  text.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(text.size() & 0xff));
  out.push_back(static_cast<char>(text.size() >> 8));
  return out + text;
}

// A v2 or v3 header (4-byte length) around `dict`.
std::string V2(const std::string& dict, int major = 2) {
  std::string text = dict + "\n";
  std::string out("\x93NUMPY", 6);
  out.push_back(static_cast<char>(major));
  out.push_back(0);
  for (int i = 0; i < 4; ++i) {
    out.push_back(static_cast<char>((text.size() >> (8 * i)) & 0xff));
  }
  return out + text;
}

std::string Dict(const std::string& descr, const std::string& shape,
                 const std::string& order = "False") {
  return absl::StrCat("{'descr': '", descr, "', 'fortran_order': ", order,
                      ", 'shape': ", shape, ", }");
}

class TempDir {
 public:
  TempDir() {
    char path[] = "/tmp/lossd_npy_test_XXXXXX";
    dir_ = mkdtemp(path);
  }
  ~TempDir() {
    for (const std::string& f : files_) unlink(f.c_str());
    rmdir(dir_.c_str());
  }
  std::string File(const std::string& name) {
    files_.push_back(absl::StrCat(dir_, "/", name));
    return files_.back();
  }
  std::string Write(const std::string& name, const std::string& bytes) {
    const std::string path = File(name);
    std::FILE* f = std::fopen(path.c_str(), "wb");
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
    return path;
  }

 private:
  std::string dir_;
  std::vector<std::string> files_;
};

TEST(NpyHeaderTest, EncodesExactlyWhatNumpyWrites) {
  // np.save(np.zeros((3,), np.float32)) and friends, numpy 1.24.
  struct Case {
    DType dtype;
    std::vector<int64_t> shape;
    std::string dict;
  } cases[] = {
      {DType::kFloat32, {3}, Dict("<f4", "(3,)")},
      {DType::kInt64, {2, 3}, Dict("<i8", "(2, 3)")},
      {DType::kFloat16, {}, Dict("<f2", "()")},
      {DType::kInt32, {0, 5}, Dict("<i4", "(0, 5)")},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::string> header = EncodeNpyHeader(c.dtype, c.shape);
    ASSERT_TRUE(header.ok()) << header.status();
    EXPECT_EQ(*header, V1(c.dict)) << c.dict;
    EXPECT_EQ(header->size(), 128u);
  }
}

TEST(NpyHeaderTest, ParsesEveryVersionAndSpelling) {
  struct Case {
    std::string bytes;
    DType dtype;
    std::vector<int64_t> shape;
    int major;
  } cases[] = {
      {V1(Dict("<f4", "(2, 3)")), DType::kFloat32, {2, 3}, 1},
      {V2(Dict("<i4", "(7,)")), DType::kInt32, {7}, 2},
      {V2(Dict("<i8", "()"), 3), DType::kInt64, {}, 3},
      {V1("{\"descr\": \"<f2\", \"fortran_order\": False, \"shape\": (4,)}"),
       DType::kFloat16,
       {4},
       1},
      // Python 2 era long literals, keys in another order, no trailing comma.
      {V1("{'shape': (2L, 5L), 'fortran_order': False, 'descr': '<f4'}"),
       DType::kFloat32,
       {2, 5},
       1},
      // Fortran order is the same layout for rank <= 1.
      {V1(Dict("<f4", "(9,)", "True")), DType::kFloat32, {9}, 1},
  };
  for (const Case& c : cases) {
    absl::StatusOr<NpyHeader> header = ParseNpyHeader(c.bytes);
    ASSERT_TRUE(header.ok()) << header.status() << " for " << c.bytes;
    EXPECT_EQ(header->dtype, c.dtype);
    EXPECT_EQ(header->shape, c.shape);
    EXPECT_EQ(header->major_version, c.major);
    EXPECT_EQ(header->data_offset, c.bytes.size());
    uint64_t elements = 1;
    for (int64_t d : c.shape) elements *= d;
    EXPECT_EQ(header->elements, elements);
    EXPECT_EQ(header->data_bytes, elements * DTypeSize(c.dtype));
  }
}

TEST(NpyHeaderTest, RejectsMalformedHeaders) {
  const std::string too_long_len("\x93NUMPY\x02\x00\xff\xff\xff\x7f", 12);
  struct Case {
    std::string bytes;
    std::string message;  // a substring of the error
  } cases[] = {
      {"", "magic"},
      {"\x93NUMPZ\x01\x00", "magic"},
      {std::string("\x93NUMPY\x04\x00\x10\x00", 10), "version 4.0"},
      {std::string("\x93NUMPY\x01\x01\x10\x00", 10), "version 1.1"},
      {std::string("\x93NUMPY\x01\x00", 8), "truncated"},
      {std::string("\x93NUMPY\x01\x00\x40\x00{'descr'", 17), "truncated"},
      {too_long_len, "exceeds the limit"},
      {V1("['descr', '<f4']"), "not a dict"},
      {V1("{'descr': '<f4', 'shape': (2,)}"), "exactly the keys"},
      {V1("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}"),
       "unexpected key 'x'"},
      {V1("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, "
          "'shape': (2,)}"),
       "duplicate key 'descr'"},
      {V1(Dict("<f4", "(-2, 3)")), "negative dimension"},
      {V1(Dict("<f4", "(99999999999999999999,)")), "does not fit in 64 bits"},
      {V1(Dict("<f4", "(4294967296, 4294967296)")), "overflows 64 bits"},
      {V1(Dict("<i8", "(1152921504606846976, 8)")), "overflows 64 bits"},
      {V1(Dict("<f4", "(3)")), "not a tuple"},
      {V1(Dict("<f4", "(3,")), "expected"},
      {V1(Dict("<f4", "[3]")), "expected '('"},
      {V1(Dict(">f4", "(3,)")), "big-endian"},
      {V1(Dict("<u2", "(3,)")), "bf16"},
      {V1(Dict("|V2", "(3,)")), "bf16"},
      {V1(Dict("<f8", "(3,)")), "unsupported .npy dtype '<f8'"},
      {V1(Dict("|O", "(3,)")), "unsupported .npy dtype '|O'"},
      {V1("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,)}"),
       "structured"},
      {V1(Dict("<f4", "(2, 3)", "True")), "Fortran order"},
      {V1(Dict("<f4", "(2, 3)", "Maybe")), "True or False"},
      {V1("{'descr': '<f4, 'fortran_order': False, 'shape': (2,)}"),
       "expected ',' or '}'"},
      {V1("{'descr' '<f4', 'fortran_order': False, 'shape': (2,)}"),
       "expected ':'"},
      {V1("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)"),
       "unterminated dict"},
      {V1("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} junk"),
       "trailing characters"},
      {V1("{'descr': '<f\\x34', 'fortran_order': False, 'shape': (2,)}"),
       "escape"},
      {V1("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)}\x01"),
       "non-printable"},
      {V1("{'d\xc3\xa9scr': '<f4', 'fortran_order': False, 'shape': (2,)}"),
       "non-printable"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<NpyHeader> header = ParseNpyHeader(c.bytes);
    ASSERT_FALSE(header.ok()) << "accepted: " << c.bytes;
    EXPECT_EQ(header.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(header.status().message()), HasSubstr(c.message))
        << "for " << c.bytes;
  }
}

TEST(NpyHeaderTest, RejectsTooManyDimensions) {
  std::string shape = "(";
  for (int i = 0; i <= kMaxNpyRank; ++i) shape += "1, ";
  shape += ")";
  absl::StatusOr<NpyHeader> header = ParseNpyHeader(V1(Dict("<f4", shape)));
  ASSERT_FALSE(header.ok());
  EXPECT_THAT(std::string(header.status().message()), HasSubstr("dimensions"));
}

// Every prefix and random byte corruptions of a valid header must give OK or
// INVALID_ARGUMENT and never read out of bounds (run under ASan to see that).
TEST(NpyHeaderTest, SurvivesTruncationAndCorruption) {
  const std::string valid = V1(Dict("<i8", "(123, 45)"));
  for (std::size_t n = 0; n < valid.size(); ++n) {
    // The prefix is copied so an over-read would leave the allocation.
    const std::string prefix = valid.substr(0, n);
    absl::StatusOr<NpyHeader> header = ParseNpyHeader(prefix);
    ASSERT_FALSE(header.ok()) << n;
    EXPECT_EQ(header.status().code(), absl::StatusCode::kInvalidArgument);
  }
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  for (int round = 0; round < 20000; ++round) {
    std::string bytes = valid;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i) {
      bytes[rng() % bytes.size()] = static_cast<char>(rng() & 0xff);
    }
    absl::StatusOr<NpyHeader> header = ParseNpyHeader(bytes);
    if (header.ok()) {
      EXPECT_LE(header->data_offset, bytes.size()) << "seed " << seed;
    } else {
      EXPECT_EQ(header.status().code(), absl::StatusCode::kInvalidArgument)
          << "seed " << seed << ": " << header.status();
    }
  }
}

template <typename T>
std::vector<T> RandomValues(std::mt19937& rng, std::size_t n) {
  std::vector<T> values(n);
  std::uniform_int_distribution<int64_t> dist(-1000000, 1000000);
  for (T& v : values) v = static_cast<T>(dist(rng)) / static_cast<T>(7);
  return values;
}

TEST(NpyFileTest, RoundTripsEveryDtypeAndShape) {
  TempDir dir;
  const unsigned seed = std::random_device{}();
  std::mt19937 rng(seed);
  const std::vector<std::vector<int64_t>> shapes = {
      {}, {0}, {1}, {17}, {3, 7}, {0, 5}, {2, 3, 4}, {1000, 33}};
  for (DType dtype :
       {DType::kFloat32, DType::kFloat16, DType::kInt32, DType::kInt64}) {
    for (const std::vector<int64_t>& shape : shapes) {
      std::size_t elements = 1;
      for (int64_t d : shape) elements *= d;
      std::vector<uint8_t> data(elements * DTypeSize(dtype));
      for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
      const std::string path =
          dir.File(absl::StrCat("a", static_cast<int>(dtype), "_", shape.size(),
                                "_", elements, ".npy"));
      ASSERT_TRUE(WriteNpy(path, dtype, shape, data.data(), data.size()).ok());
      absl::StatusOr<std::unique_ptr<NpyFile>> file = NpyFile::Open(path);
      ASSERT_TRUE(file.ok()) << file.status();
      EXPECT_EQ((*file)->header().dtype, dtype);
      EXPECT_EQ((*file)->header().shape, shape);
      EXPECT_EQ((*file)->header().data_offset % 64, 0u);
      ASSERT_EQ((*file)->data_bytes(), data.size());
      if (!data.empty()) {
        EXPECT_EQ(std::memcmp((*file)->data(), data.data(), data.size()), 0)
            << "seed " << seed;
      }
    }
  }
  // Values survive as values, not just bytes.
  std::vector<float> values = RandomValues<float>(rng, 1234);
  const std::string path = dir.File("values.npy");
  ASSERT_TRUE(WriteNpy(path, DType::kFloat32, {617, 2}, values.data(),
                       values.size() * sizeof(float))
                  .ok());
  absl::StatusOr<std::unique_ptr<NpyFile>> file = NpyFile::Open(path);
  ASSERT_TRUE(file.ok());
  const float* read = reinterpret_cast<const float*>((*file)->data());
  for (std::size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(read[i], values[i]) << i << " seed " << seed;
  }
}

TEST(NpyFileTest, ReportsFileErrors) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<NpyFile>> missing =
      NpyFile::Open(dir.File("missing.npy"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);

  absl::StatusOr<std::unique_ptr<NpyFile>> empty =
      NpyFile::Open(dir.Write("empty.npy", ""));
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);

  // The header promises 6 floats (24 bytes); 23 are there.
  const std::string truncated =
      V1(Dict("<f4", "(2, 3)")) + std::string(23, '\0');
  absl::StatusOr<std::unique_ptr<NpyFile>> short_file =
      NpyFile::Open(dir.Write("short.npy", truncated));
  ASSERT_FALSE(short_file.ok());
  EXPECT_EQ(short_file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(short_file.status().message()),
              HasSubstr("truncated"));

  // Trailing bytes after the data are ignored, as numpy does.
  absl::StatusOr<std::unique_ptr<NpyFile>> long_file = NpyFile::Open(
      dir.Write("long.npy", V1(Dict("<f4", "(2, 3)")) + std::string(30, 'x')));
  ASSERT_TRUE(long_file.ok()) << long_file.status();
  EXPECT_EQ((*long_file)->data_bytes(), 24u);

  absl::StatusOr<std::unique_ptr<NpyFile>> not_npy =
      NpyFile::Open(dir.Write("text.npy", "hello, world"));
  EXPECT_EQ(not_npy.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(not_npy.status().message()), HasSubstr("text.npy"));
}

TEST(NpyWriterTest, EnforcesTheByteCountOfTheHeader) {
  TempDir dir;
  const int64_t values[5] = {1, 2, 3, 4, 5};
  {
    absl::StatusOr<std::unique_ptr<NpyWriter>> writer =
        NpyWriter::Create(dir.File("over.npy"), DType::kInt64, {4});
    ASSERT_TRUE(writer.ok());
    EXPECT_TRUE((*writer)->Append(values, 16).ok());
    EXPECT_EQ((*writer)->Append(values, 24).code(),
              absl::StatusCode::kOutOfRange);
    EXPECT_TRUE((*writer)->Append(values, 16).ok());
    EXPECT_TRUE((*writer)->Close().ok());
  }
  {
    absl::StatusOr<std::unique_ptr<NpyWriter>> writer =
        NpyWriter::Create(dir.File("under.npy"), DType::kInt64, {4});
    ASSERT_TRUE(writer.ok());
    EXPECT_TRUE((*writer)->Append(values, 8).ok());
    EXPECT_EQ((*writer)->Close().code(), absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(
      WriteNpy(dir.File("mismatch.npy"), DType::kInt64, {4}, values, 40).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NpyWriter::Create(dir.File("bf16.npy"), DType::kBFloat16, {4})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NpyWriter::Create(dir.File("neg.npy"), DType::kInt64, {-1})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NpyWriter::Create("/nonexistent_dir/x.npy", DType::kInt64, {1})
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace lossd
