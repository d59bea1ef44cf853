// The safetensors reader and writer (client/safetensors.h) and lossctl's file
// sources and sinks (client/tensor_file.h), without a server: headers written
// the way the format's reference writer does are read back; every kind of
// malformed header is refused with a message naming what is wrong; uploads
// convert piece by piece and downloads land at their offsets in either format.
#include "client/safetensors.h"

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/tensor_file.h"
#include "common/float16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;

// An 8-byte little-endian length, then `json` (and `data` after it).
std::string File(const std::string& json, const std::string& data = "") {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>((static_cast<uint64_t>(json.size()) >> (8 * i)) &
                               0xff);
  }
  return out + json + data;
}

absl::StatusOr<SafetensorsHeader> Parse(const std::string& file) {
  return ParseSafetensorsHeader(file, file.size());
}

// The message of a refused header, with its code checked.
std::string Refusal(const std::string& file) {
  absl::StatusOr<SafetensorsHeader> header = Parse(file);
  EXPECT_FALSE(header.ok()) << file.substr(8);
  if (header.ok()) return "";
  EXPECT_EQ(header.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(header.status().message());
}

class TempFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/safetensors_test_XXXXXX";
    ASSERT_NE(mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    ASSERT_EQ(system(absl::StrCat("rm -rf '", dir_, "'").c_str()), 0);
  }
  std::string Path(const std::string& name) const {
    return absl::StrCat(dir_, "/", name);
  }
  static void Write(const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary) << bytes;
  }
  static std::string Read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::string dir_;
};

TEST(SafetensorsHeaderTest, ReadsSeveralTensorsAndMetadata) {
  const std::string json =
      R"({"__metadata__": {"format": "pt"},)"
      R"( "b": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [16, 28]},)"
      R"( "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
      R"( "s": {"dtype": "I64", "shape": [], "data_offsets": [28, 36]},)"
      R"( "e": {"dtype": "F64", "shape": [0, 5], "data_offsets": [36, 36]}})"
      "   ";
  absl::StatusOr<SafetensorsHeader> header =
      Parse(File(json, std::string(36, 'x')));
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->data_offset, 8 + json.size());
  EXPECT_EQ(header->data_bytes, 36u);
  EXPECT_EQ(header->metadata.at("format"), "pt");
  ASSERT_EQ(header->tensors.size(), 4u);
  const SafetensorsTensor& a = header->tensors[0];
  EXPECT_EQ(a.name, "a");
  EXPECT_EQ(a.dtype, DType::kFloat32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(a.begin, 0u);
  EXPECT_EQ(a.end, 16u);
  EXPECT_EQ(header->tensors[1].dtype, DType::kBFloat16);
  EXPECT_EQ(header->tensors[1].elements, 6u);
  // F64 is a valid safetensors dtype that lossd does not take.
  EXPECT_EQ(header->tensors[2].name, "e");
  EXPECT_EQ(header->tensors[2].dtype, DType::kInvalid);
  EXPECT_EQ(header->tensors[2].dtype_name, "F64");
  EXPECT_EQ(header->tensors[3].elements, 1u);
  EXPECT_EQ(header->tensors[3].shape, std::vector<int64_t>{});
}

TEST(SafetensorsHeaderTest, NewerDTypesAreAcceptedUntilSelected) {
  absl::StatusOr<SafetensorsHeader> header = Parse(
      File(R"({"w": {"dtype": "F4", "shape": [8], "data_offsets": [0, 4]}})",
           "abcd"));
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->tensors[0].dtype, DType::kInvalid);
}

TEST(SafetensorsHeaderTest, RefusesMalformedHeaders) {
  const auto entry = [](const std::string& body) {
    return absl::StrCat(R"({"t": )", body, "}");
  };
  EXPECT_THAT(Refusal("1234567"), HasSubstr("shorter than its 8-byte"));
  std::string huge(8, '\0');
  huge[4] = 1;  // 2^32 bytes of header
  EXPECT_THAT(Refusal(huge), HasSubstr("exceeds the format's limit"));
  EXPECT_THAT(Refusal(File("{}").substr(0, 9)), HasSubstr("truncated"));
  EXPECT_THAT(Refusal(File("[1, 2]")), HasSubstr("does not start with '{'"));
  EXPECT_THAT(Refusal(File("{\"a\": ")), HasSubstr("not valid JSON"));
  EXPECT_THAT(Refusal(File("{} {}")), HasSubstr("not valid JSON"));
  EXPECT_THAT(
      Refusal(File(
          R"({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},)"
          R"( "t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
          "12345678")),
      HasSubstr("duplicate key 't'"));
  EXPECT_THAT(
      Refusal(File(entry(R"({"dtype": "F32", "dtype": "F16", "shape": [1],)"
                         R"( "data_offsets": [0, 4]})"),
                   "1234")),
      HasSubstr("duplicate key 'dtype'"));
  EXPECT_THAT(Refusal(File(entry("[]"))), HasSubstr("not an object"));
  EXPECT_THAT(Refusal(File(entry(R"({"dtype": "F32", "shape": [1]})"))),
              HasSubstr("needs the keys"));
  EXPECT_THAT(Refusal(File(entry(
                  R"({"dtype": 3, "shape": [1], "data_offsets": [0, 4]})"))),
              HasSubstr("\"dtype\" is not a string"));
  EXPECT_THAT(
      Refusal(File(
          entry(R"({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]})"))),
      HasSubstr("a dimension is not an integer"));
  EXPECT_THAT(
      Refusal(File(entry(
          R"({"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]})"))),
      HasSubstr("a dimension is not an integer"));
  EXPECT_THAT(Refusal(File(entry(
                  R"({"dtype": "F32", "shape": 4, "data_offsets": [0, 4]})"))),
              HasSubstr("\"shape\" is not an array"));
  EXPECT_THAT(
      Refusal(File(entry(R"({"dtype": "U8", "shape": [4294967296, 4294967296],)"
                         R"( "data_offsets": [0, 0]})"))),
      HasSubstr("overflows 64 bits"));
  EXPECT_THAT(Refusal(File(entry(
                  R"({"dtype": "F32", "shape": [1], "data_offsets": [0]})"))),
              HasSubstr("is not [BEGIN, END]"));
  EXPECT_THAT(
      Refusal(File(
          entry(R"({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]})"),
          "1234")),
      HasSubstr("reversed"));
  EXPECT_THAT(
      Refusal(File(
          entry(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]})"),
          "1234")),
      HasSubstr("truncated safetensors file: tensor 't'"));
  EXPECT_THAT(
      Refusal(File(
          entry(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]})"),
          "1234")),
      HasSubstr("needs 2 x 4"));
  EXPECT_THAT(
      Refusal(File(
          R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
          R"( "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
          "12345678")),
      HasSubstr("tensors 'a' and 'b' overlap"));
  EXPECT_THAT(Refusal(File(R"({"__metadata__": {"k": 1}})")),
              HasSubstr("\"__metadata__\" value of 'k' is not a string"));
  EXPECT_THAT(Refusal(File(R"({"__metadata__": []})")),
              HasSubstr("\"__metadata__\" is not an object"));
  std::string deep_shape = "[";
  for (int i = 0; i < 65; ++i) deep_shape += i ? ", 1" : "1";
  deep_shape += "]";
  EXPECT_THAT(Refusal(File(entry(
                  absl::StrCat(R"({"dtype": "F32", "shape": )", deep_shape,
                               R"(, "data_offsets": [0, 4]})")))),
              HasSubstr("more than 64 dimensions"));
}

TEST(SafetensorsHeaderTest, EncodedHeaderParsesBackAligned) {
  absl::StatusOr<std::string> header = EncodeSafetensorsHeader(
      "grad", DType::kBFloat16, {3, 5}, {{"source", "lossd"}});
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->size() % 8, 0u);
  absl::StatusOr<SafetensorsHeader> parsed =
      ParseSafetensorsHeader(*header, header->size() + 30);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->tensors.size(), 1u);
  EXPECT_EQ(parsed->tensors[0].name, "grad");
  EXPECT_EQ(parsed->tensors[0].dtype_name, "BF16");
  EXPECT_EQ(parsed->tensors[0].shape, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(parsed->tensors[0].end, 30u);
  EXPECT_EQ(parsed->data_offset, header->size());
  EXPECT_EQ(parsed->metadata.at("source"), "lossd");
  EXPECT_FALSE(EncodeSafetensorsHeader("", DType::kFloat32, {1}).ok());
  EXPECT_FALSE(
      EncodeSafetensorsHeader("__metadata__", DType::kFloat32, {1}).ok());
  EXPECT_FALSE(EncodeSafetensorsHeader("x", DType::kFloat32, {-1}).ok());
}

TEST_F(TempFiles, FileFindsTensorsByName) {
  std::vector<float> values = {1.5f, -2.0f, 3.25f};
  std::string data(reinterpret_cast<const char*>(values.data()), 12);
  const std::string path = Path("two.safetensors");
  Write(
      path,
      File(
          R"({"logits": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},)"
          R"( "odd": {"dtype": "U8", "shape": [1], "data_offsets": [12, 13]}})",
          data + "z"));
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<const SafetensorsTensor*> logits = (*file)->Find("logits");
  ASSERT_TRUE(logits.ok());
  EXPECT_EQ(std::memcmp((*file)->data(**logits), values.data(), 12), 0);
  absl::StatusOr<const SafetensorsTensor*> missing = (*file)->Find("nope");
  EXPECT_THAT(missing.status().message(),
              HasSubstr("no tensor 'nope'; it holds 2: 'logits', 'odd'"));
  EXPECT_THAT((*file)->Find("").status().message(),
              HasSubstr("name a tensor as"));

  absl::StatusOr<std::unique_ptr<InputTensor>> odd =
      InputTensor::Open(path + ":odd");
  EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(odd.status().message(),
              HasSubstr(":odd: dtype U8 is not supported"));
  absl::StatusOr<std::unique_ptr<InputTensor>> input =
      InputTensor::Open(path + ":logits");
  ASSERT_TRUE(input.ok()) << input.status();
  EXPECT_EQ((*input)->dtype(), DType::kFloat32);
  EXPECT_EQ((*input)->bytes(), 12u);
  EXPECT_EQ((*input)->description(), path + ":logits");

  EXPECT_EQ(SafetensorsFile::Open(Path("absent.safetensors")).status().code(),
            absl::StatusCode::kNotFound);
  Write(Path("bad.safetensors"), File("{\"x\": 1}"));
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> bad =
      SafetensorsFile::Open(Path("bad.safetensors"));
  EXPECT_THAT(bad.status().message(),
              HasSubstr("bad.safetensors: malformed safetensors header"));
}

TEST(TensorFileSpecTest, SplitsNameAfterSuffix) {
  TensorFileSpec spec = ParseTensorFileSpec("a:b/out.safetensors:x:y");
  EXPECT_EQ(spec.path, "a:b/out.safetensors");
  EXPECT_EQ(spec.name, "x:y");
  EXPECT_TRUE(spec.safetensors);
  spec = ParseTensorFileSpec("out.safetensors");
  EXPECT_TRUE(spec.safetensors);
  EXPECT_EQ(spec.name, "");
  spec = ParseTensorFileSpec("logits.npy");
  EXPECT_FALSE(spec.safetensors);
  EXPECT_TRUE(LooksLikeTensorFile("t.npy"));
  EXPECT_TRUE(LooksLikeTensorFile("t.safetensors:targets"));
  EXPECT_FALSE(LooksLikeTensorFile("0a1b2c-3d4e"));
}

// The upload source converts exactly the piece asked for, into scratch, and
// points into the mapping when no conversion is needed.
TEST_F(TempFiles, UploadSourceConvertsPieces) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<float> values(100000);
  for (float& v : values) v = normal(rng);
  const std::string path = Path("logits.npy");
  ASSERT_TRUE(WriteNpy(path, DType::kFloat32, {1000, 100}, values.data(),
                       values.size() * 4)
                  .ok());
  absl::StatusOr<std::unique_ptr<InputTensor>> input = InputTensor::Open(path);
  ASSERT_TRUE(input.ok()) << input.status();
  ConvertPool pool(2);
  auto source = MakeUploadSource(**input, DType::kBFloat16, &pool);
  std::vector<uint16_t> scratch(60000);
  absl::StatusOr<const void*> piece =
      source(2 * 30000, 2 * 60000, scratch.data());
  ASSERT_TRUE(piece.ok()) << piece.status();
  EXPECT_EQ(*piece, scratch.data());
  for (int i = 0; i < 60000; ++i) {
    ASSERT_EQ(scratch[i], FloatToBF16(values[30000 + i])) << i;
  }
  EXPECT_EQ(source(2 * 99999, 4, scratch.data()).status().code(),
            absl::StatusCode::kInternal);
  EXPECT_EQ(source(1, 2, scratch.data()).status().code(),
            absl::StatusCode::kInternal);
  auto same = MakeUploadSource(**input, DType::kFloat32, &pool);
  piece = same(400, 800, scratch.data());
  ASSERT_TRUE(piece.ok());
  EXPECT_EQ(*piece, (*input)->data() + 400);
}

// Pieces written out of order, from several threads, in both formats.
TEST_F(TempFiles, OutputFileTakesPiecesInAnyOrder) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t rows = 300, vocab = 1001;
  std::vector<uint16_t> bf16(rows * vocab);
  for (uint16_t& v : bf16) v = FloatToBF16(normal(rng));
  ConvertPool pool(2);
  for (const auto mode : {OutputTensorFile::WriteMode::kPwrite,
                          OutputTensorFile::WriteMode::kMapped}) {
    for (const std::string name :
         {"grad.npy", "grad.safetensors", "g.safetensors:g2"}) {
      SCOPED_TRACE(absl::StrCat(
          name, mode == OutputTensorFile::WriteMode::kMapped ? " mapped"
                                                             : " pwrite"));
      const std::string spec_path = ParseTensorFileSpec(Path(name)).path;
      unlink(spec_path.c_str());  // from the other mode
      absl::StatusOr<std::unique_ptr<OutputTensorFile>> out =
          OutputTensorFile::Create(Path(name), DType::kBFloat16, {rows, vocab},
                                   "gradient", &pool, mode);
      ASSERT_TRUE(out.ok()) << out.status();
      const std::size_t total = bf16.size() * 2;
      const std::size_t piece = 2 * 40000;
      std::vector<std::thread> threads;
      for (int t = 0; t < 2; ++t) {
        threads.emplace_back([&, t] {
          // Thread 0 takes even pieces from the back, thread 1 odd ones.
          const std::size_t pieces = (total + piece - 1) / piece;
          for (std::size_t i = pieces; i-- > 0;) {
            if (static_cast<int>(i % 2) != t) continue;
            const std::size_t offset = i * piece;
            const std::size_t n = std::min(piece, total - offset);
            EXPECT_TRUE(
                (*out)
                    ->Write(offset,
                            reinterpret_cast<const char*>(bf16.data()) + offset,
                            n)
                    .ok());
          }
        });
      }
      for (std::thread& thread : threads) thread.join();
      // Nothing at the path until Commit.
      EXPECT_NE(access(spec_path.c_str(), F_OK), 0);
      ASSERT_TRUE((*out)->Commit().ok());
      absl::StatusOr<std::unique_ptr<InputTensor>> back =
          InputTensor::Open(Path(name));
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ((*back)->shape(), (std::vector<int64_t>{rows, vocab}));
      if ((*back)->dtype() == DType::kFloat32) {
        EXPECT_EQ(name, "grad.npy");
        const uint8_t* data = (*back)->data();
        for (std::size_t i = 0; i < bf16.size(); ++i) {
          float value;
          std::memcpy(&value, data + 4 * i, 4);
          ASSERT_EQ(value, BF16ToFloat(bf16[i])) << i;
        }
      } else {
        EXPECT_EQ((*back)->dtype(), DType::kBFloat16);
        EXPECT_EQ(std::memcmp((*back)->data(), bf16.data(), total), 0);
        EXPECT_EQ(
            (*back)->description(),
            spec_path + (name == "g.safetensors:g2" ? ":g2" : ":gradient"));
      }
    }
  }
}

TEST_F(TempFiles, IncompleteDownloadLeavesNoFile) {
  ConvertPool pool(1);
  const std::string path = Path("partial.npy");
  Write(path, "old contents");
  {
    absl::StatusOr<std::unique_ptr<OutputTensorFile>> out =
        OutputTensorFile::Create(path, DType::kFloat32, {10}, "", &pool);
    ASSERT_TRUE(out.ok());
    const float values[5] = {1, 2, 3, 4, 5};
    ASSERT_TRUE((*out)->Write(0, values, 20).ok());
    EXPECT_EQ((*out)->Write(20, values, 24).code(),
              absl::StatusCode::kInternal);
    absl::Status commit = (*out)->Commit();
    EXPECT_EQ(commit.code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(commit.message(), HasSubstr("20 of 40 bytes arrived"));
  }
  EXPECT_EQ(Read(path), "old contents");
  // The temporary file is gone too.
  EXPECT_EQ(system(absl::StrCat("test -z \"$(ls '", dir_,
                                "' | grep -v partial.npy$)\"")
                       .c_str()),
            0);
}

}  // namespace
}  // namespace lossd
