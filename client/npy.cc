// The .npy reader and writer of npy.h. The header is a Python dict literal;
// this file parses the small subset numpy writes with a hand-written scanner
// that bounds-checks every step, because the input is untrusted.
#include "client/npy.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lossd {
namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr std::size_t kMagicBytes = 6;
// Where numpy aligns the data (64 since numpy 1.x for mmap friendliness).
constexpr std::size_t kDataAlignment = 64;

absl::Status Malformed(absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("malformed .npy header: ", why));
}

// A cursor over the header dict literal. Every accessor checks the bounds.
class HeaderScanner {
 public:
  explicit HeaderScanner(absl::string_view text) : text_(text) {}

  void SkipSpace() {
    while (pos_ < text_.size() &&
           (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' ||
            text_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool AtEnd() const { return pos_ >= text_.size(); }
  char Peek() const { return AtEnd() ? '\0' : text_[pos_]; }
  bool Consume(char c) {
    if (Peek() != c || AtEnd()) return false;
    ++pos_;
    return true;
  }
  bool ConsumeWord(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  // A Python string literal in single or double quotes, without escapes
  // (numpy never writes any in the keys and values we accept).
  absl::StatusOr<std::string> String() {
    const char quote = Peek();
    if (quote != '\'' && quote != '"') {
      return Malformed(
          absl::StrCat("expected a quoted string at offset ", pos_));
    }
    ++pos_;
    const std::size_t start = pos_;
    while (!AtEnd() && text_[pos_] != quote) {
      if (text_[pos_] == '\\') {
        return Malformed("escape sequences in strings are not supported");
      }
      ++pos_;
    }
    if (AtEnd()) return Malformed("unterminated string");
    std::string value(text_.substr(start, pos_ - start));
    ++pos_;
    return value;
  }

  absl::StatusOr<bool> Bool() {
    if (ConsumeWord("True")) return true;
    if (ConsumeWord("False")) return false;
    return Malformed(absl::StrCat("expected True or False at offset ", pos_));
  }

  // A non-negative decimal integer (Python 2 files may append 'L').
  absl::StatusOr<int64_t> Dimension() {
    if (Peek() == '-') {
      return absl::InvalidArgumentError(
          "malformed .npy header: negative dimension in shape");
    }
    if (!absl::ascii_isdigit(static_cast<unsigned char>(Peek()))) {
      return Malformed(absl::StrCat("expected a dimension at offset ", pos_));
    }
    int64_t value = 0;
    while (!AtEnd() &&
           absl::ascii_isdigit(static_cast<unsigned char>(Peek()))) {
      const int digit = text_[pos_] - '0';
      if (value > (std::numeric_limits<int64_t>::max() - digit) / 10) {
        return Malformed("a dimension does not fit in 64 bits");
      }
      value = value * 10 + digit;
      ++pos_;
    }
    if (Peek() == 'L' || Peek() == 'l') ++pos_;
    return value;
  }

  // A tuple of dimensions: "()", "(3,)", "(2, 3)", "(2, 3,)".
  absl::StatusOr<std::vector<int64_t>> Shape() {
    if (!Consume('(')) {
      return Malformed(absl::StrCat("expected '(' for shape at offset ", pos_));
    }
    std::vector<int64_t> shape;
    SkipSpace();
    while (!Consume(')')) {
      if (AtEnd()) return Malformed("unterminated shape tuple");
      if (shape.size() >= static_cast<std::size_t>(kMaxNpyRank)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "malformed .npy header: more than ", kMaxNpyRank, " dimensions"));
      }
      absl::StatusOr<int64_t> dim = Dimension();
      if (!dim.ok()) return dim.status();
      shape.push_back(*dim);
      SkipSpace();
      if (Consume(',')) {
        SkipSpace();
        continue;
      }
      SkipSpace();
      if (!Consume(')')) {
        return Malformed(
            absl::StrCat("expected ',' or ')' in shape at offset ", pos_));
      }
      // Python needs the trailing comma for a 1-tuple; "(3)" is the int 3.
      if (shape.size() == 1) return Malformed("shape (N) is not a tuple");
      return shape;
    }
    return shape;
  }

  std::size_t pos() const { return pos_; }

 private:
  absl::string_view text_;
  std::size_t pos_ = 0;
};

absl::StatusOr<DType> DTypeFromDescr(absl::string_view descr) {
  if (descr == "<f4") return DType::kFloat32;
  if (descr == "<f2") return DType::kFloat16;
  if (descr == "<i4") return DType::kInt32;
  if (descr == "<i8") return DType::kInt64;
  if (descr == "<u2" || descr == "|V2" || descr == "<V2" ||
      descr == "bfloat16") {
    return absl::InvalidArgumentError(absl::StrCat(
        "unsupported .npy dtype '", descr,
        "': bf16 arrays (ml_dtypes) are out of scope; save them as float32 "
        "and upload with --dtype=bf16"));
  }
  if (!descr.empty() && descr[0] == '>') {
    return absl::InvalidArgumentError(absl::StrCat(
        "unsupported .npy dtype '", descr,
        "': big-endian data; convert with arr.astype(arr.dtype.newbyteorder("
        "'<'))"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported .npy dtype '", descr,
                   "': expected one of '<f4', '<f2', '<i4', '<i8'"));
}

absl::StatusOr<std::string> DescrFromDType(DType dtype) {
  if (dtype == DType::kBFloat16) {
    return absl::InvalidArgumentError(
        ".npy cannot hold bf16 natively; convert to float32 first");
  }
  const char* typestr = DTypeNumpyTypestr(dtype);
  if (typestr == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "no .npy dtype for lossd dtype ", static_cast<int>(dtype)));
  }
  return std::string(typestr);
}

// Parses the dict literal; `header` receives dtype and shape.
absl::Status ParseDict(absl::string_view text, NpyHeader* header) {
  HeaderScanner scan(text);
  scan.SkipSpace();
  if (!scan.Consume('{')) return Malformed("the header is not a dict");
  bool have_descr = false, have_order = false, have_shape = false;
  bool fortran_order = false;
  std::string descr;
  scan.SkipSpace();
  while (!scan.Consume('}')) {
    if (scan.AtEnd()) return Malformed("unterminated dict");
    absl::StatusOr<std::string> key = scan.String();
    if (!key.ok()) return key.status();
    scan.SkipSpace();
    if (!scan.Consume(':')) return Malformed("expected ':' after a key");
    scan.SkipSpace();
    if (*key == "descr") {
      if (have_descr) return Malformed("duplicate key 'descr'");
      have_descr = true;
      if (scan.Peek() == '[') {
        return absl::InvalidArgumentError(
            "unsupported .npy dtype: structured arrays are not supported");
      }
      absl::StatusOr<std::string> value = scan.String();
      if (!value.ok()) return value.status();
      descr = *std::move(value);
    } else if (*key == "fortran_order") {
      if (have_order) return Malformed("duplicate key 'fortran_order'");
      have_order = true;
      absl::StatusOr<bool> value = scan.Bool();
      if (!value.ok()) return value.status();
      fortran_order = *value;
    } else if (*key == "shape") {
      if (have_shape) return Malformed("duplicate key 'shape'");
      have_shape = true;
      absl::StatusOr<std::vector<int64_t>> value = scan.Shape();
      if (!value.ok()) return value.status();
      header->shape = *std::move(value);
    } else {
      return Malformed(absl::StrCat("unexpected key '", *key, "'"));
    }
    scan.SkipSpace();
    if (scan.Consume(',')) {
      scan.SkipSpace();
      continue;
    }
    if (scan.AtEnd()) return Malformed("unterminated dict");
    if (!scan.Consume('}')) return Malformed("expected ',' or '}' in dict");
    break;
  }
  scan.SkipSpace();
  if (!scan.AtEnd()) return Malformed("trailing characters after the dict");
  if (!have_descr || !have_order || !have_shape) {
    return Malformed(
        "the dict needs exactly the keys 'descr', 'fortran_order', 'shape'");
  }
  absl::StatusOr<DType> dtype = DTypeFromDescr(descr);
  if (!dtype.ok()) return dtype.status();
  header->dtype = *dtype;
  if (fortran_order && header->shape.size() > 1) {
    return absl::InvalidArgumentError(
        ".npy file is in Fortran order; save it with np.ascontiguousarray");
  }
  uint64_t elements = 1;
  for (int64_t dim : header->shape) {
    const uint64_t d = static_cast<uint64_t>(dim);
    if (d != 0 && elements > std::numeric_limits<uint64_t>::max() / d) {
      return Malformed(absl::StrCat("shape (",
                                    absl::StrJoin(header->shape, ", "),
                                    ") overflows 64 bits"));
    }
    elements *= d;
  }
  const uint64_t item = DTypeSize(header->dtype);
  if (elements > std::numeric_limits<uint64_t>::max() / item ||
      elements * item >
          static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return Malformed(absl::StrCat("shape (", absl::StrJoin(header->shape, ", "),
                                  ") overflows 64 bits"));
  }
  header->elements = elements;
  header->data_bytes = elements * item;
  return absl::OkStatus();
}

absl::Status ErrnoStatus(int error, absl::string_view what,
                         absl::string_view path) {
  return absl::ErrnoToStatus(error, absl::StrCat(what, " ", path));
}

}  // namespace

absl::StatusOr<NpyHeader> ParseNpyHeader(absl::string_view bytes) {
  if (bytes.size() < kMagicBytes + 2 ||
      std::memcmp(bytes.data(), kMagic, kMagicBytes) != 0) {
    return absl::InvalidArgumentError(
        "not a .npy file (missing the \\x93NUMPY magic)");
  }
  NpyHeader header;
  const uint8_t major = static_cast<uint8_t>(bytes[kMagicBytes]);
  const uint8_t minor = static_cast<uint8_t>(bytes[kMagicBytes + 1]);
  if (major < 1 || major > 3 || minor != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported .npy format version ", major, ".", minor,
                     " (expected 1.0, 2.0 or 3.0)"));
  }
  header.major_version = major;
  const std::size_t length_bytes = major == 1 ? 2 : 4;
  const std::size_t prefix = kMagicBytes + 2 + length_bytes;
  if (bytes.size() < prefix) return Malformed("truncated before header length");
  uint64_t header_len = 0;
  for (std::size_t i = 0; i < length_bytes; ++i) {
    header_len |=
        static_cast<uint64_t>(static_cast<uint8_t>(bytes[kMagicBytes + 2 + i]))
        << (8 * i);
  }
  if (header_len > kMaxNpyHeaderBytes) {
    return Malformed(absl::StrCat("header length ", header_len,
                                  " exceeds the limit of ",
                                  kMaxNpyHeaderBytes));
  }
  if (bytes.size() - prefix < header_len) {
    return Malformed(absl::StrCat("truncated: the header says ", header_len,
                                  " bytes, ", bytes.size() - prefix,
                                  " are present"));
  }
  absl::string_view text = bytes.substr(prefix, header_len);
  // Version 1 and 2 headers are latin-1; 3 is utf-8. Only ASCII can make up
  // a dict we accept, so anything else is rejected the same way.
  for (char c : text) {
    if (static_cast<unsigned char>(c) >= 0x80 ||
        (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t' &&
         c != '\r')) {
      return Malformed("non-printable character in header");
    }
  }
  absl::Status parsed = ParseDict(text, &header);
  if (!parsed.ok()) return parsed;
  header.data_offset = prefix + header_len;
  return header;
}

absl::StatusOr<std::string> EncodeNpyHeader(DType dtype,
                                            absl::Span<const int64_t> shape) {
  absl::StatusOr<std::string> descr = DescrFromDType(dtype);
  if (!descr.ok()) return descr.status();
  if (shape.size() > static_cast<std::size_t>(kMaxNpyRank)) {
    return absl::InvalidArgumentError(
        absl::StrCat("more than ", kMaxNpyRank, " dimensions"));
  }
  for (int64_t dim : shape) {
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("negative dimension ", dim, " in shape"));
    }
  }
  std::string shape_text = absl::StrJoin(shape, ", ");
  if (shape.size() == 1) shape_text += ",";
  std::string dict =
      absl::StrCat("{'descr': '", *descr,
                   "', 'fortran_order': False, 'shape': (", shape_text, "), }");
  // Pad with spaces and end with '\n' so the data is aligned.
  for (int major : {1, 2}) {
    const std::size_t prefix = kMagicBytes + 2 + (major == 1 ? 2 : 4);
    const std::size_t unpadded = prefix + dict.size() + 1;
    const std::size_t total =
        (unpadded + kDataAlignment - 1) / kDataAlignment * kDataAlignment;
    const std::size_t header_len = total - prefix;
    if (major == 1 && header_len > 0xffff) continue;
    std::string out(kMagic, kMagicBytes);
    out.push_back(static_cast<char>(major));
    out.push_back(0);
    for (std::size_t i = 0; i < prefix - kMagicBytes - 2; ++i) {
      out.push_back(static_cast<char>((header_len >> (8 * i)) & 0xff));
    }
    out += dict;
    out.append(header_len - dict.size() - 1, ' ');
    out.push_back('\n');
    return out;
  }
  return absl::InvalidArgumentError("header too long");
}

NpyFile::NpyFile(NpyHeader header, void* mapping, std::size_t mapping_bytes,
                 const uint8_t* data)
    : header_(std::move(header)),
      mapping_(mapping),
      mapping_bytes_(mapping_bytes),
      data_(data) {}

NpyFile::~NpyFile() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_bytes_);
}

absl::StatusOr<std::unique_ptr<NpyFile>> NpyFile::Open(
    const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open", path);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int error = errno;
    close(fd);
    return ErrnoStatus(error, "cannot stat", path);
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a file"));
  }
  const std::size_t size = static_cast<std::size_t>(st.st_size);
  if (size == 0) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a .npy file (empty)"));
  }
  void* mapping = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_error = errno;
  close(fd);  // the mapping keeps the file alive
  if (mapping == MAP_FAILED) {
    return absl::InternalError(
        absl::StrCat("cannot mmap ", path, ": ", std::strerror(map_error)));
  }
  const absl::string_view bytes(static_cast<const char*>(mapping), size);
  absl::StatusOr<NpyHeader> header = ParseNpyHeader(bytes);
  if (!header.ok()) {
    munmap(mapping, size);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", header.status().message()));
  }
  if (size - header->data_offset < header->data_bytes) {
    munmap(mapping, size);
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": truncated .npy file: the header says ", header->data_bytes,
        " data bytes, the file holds ", size - header->data_offset));
  }
  madvise(mapping, size, MADV_SEQUENTIAL);
  const uint8_t* data =
      static_cast<const uint8_t*>(mapping) + header->data_offset;
  return std::unique_ptr<NpyFile>(
      new NpyFile(*std::move(header), mapping, size, data));
}

NpyWriter::NpyWriter(std::FILE* file, std::string path, uint64_t expected_bytes)
    : file_(file), path_(std::move(path)), expected_bytes_(expected_bytes) {}

NpyWriter::~NpyWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

absl::StatusOr<std::unique_ptr<NpyWriter>> NpyWriter::Create(
    const std::string& path, DType dtype, absl::Span<const int64_t> shape) {
  absl::StatusOr<std::string> header = EncodeNpyHeader(dtype, shape);
  if (!header.ok()) return header.status();
  uint64_t elements = 1;
  for (int64_t dim : shape) {
    if (dim != 0 && elements > std::numeric_limits<uint64_t>::max() /
                                   static_cast<uint64_t>(dim)) {
      return absl::InvalidArgumentError("shape overflows 64 bits");
    }
    elements *= static_cast<uint64_t>(dim);
  }
  if (elements > std::numeric_limits<uint64_t>::max() / DTypeSize(dtype)) {
    return absl::InvalidArgumentError("shape overflows 64 bits");
  }
  std::FILE* file = std::fopen(path.c_str(), "wbe");
  if (file == nullptr) return ErrnoStatus(errno, "cannot create", path);
  if (std::fwrite(header->data(), 1, header->size(), file) != header->size()) {
    const int error = errno;
    std::fclose(file);
    return ErrnoStatus(error, "cannot write", path);
  }
  return std::unique_ptr<NpyWriter>(
      new NpyWriter(file, path, elements * DTypeSize(dtype)));
}

absl::Status NpyWriter::Append(const void* data, std::size_t bytes) {
  if (file_ == nullptr) return absl::FailedPreconditionError("closed");
  if (bytes > expected_bytes_ - written_bytes_) {
    return absl::OutOfRangeError(absl::StrCat(
        path_, ": appending ", bytes, " bytes after ", written_bytes_,
        " exceeds the ", expected_bytes_, " bytes of the header"));
  }
  if (bytes > 0 && std::fwrite(data, 1, bytes, file_) != bytes) {
    return ErrnoStatus(errno, "cannot write", path_);
  }
  written_bytes_ += bytes;
  return absl::OkStatus();
}

absl::Status NpyWriter::Close() {
  if (file_ == nullptr) return absl::FailedPreconditionError("closed twice");
  std::FILE* file = std::exchange(file_, nullptr);
  if (std::fclose(file) != 0) return ErrnoStatus(errno, "cannot write", path_);
  if (written_bytes_ != expected_bytes_) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": ", written_bytes_, " of ", expected_bytes_,
                     " data bytes written"));
  }
  return absl::OkStatus();
}

absl::Status WriteNpy(const std::string& path, DType dtype,
                      absl::Span<const int64_t> shape, const void* data,
                      std::size_t bytes) {
  absl::StatusOr<std::unique_ptr<NpyWriter>> writer =
      NpyWriter::Create(path, dtype, shape);
  if (!writer.ok()) return writer.status();
  if ((*writer)->expected_bytes() != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(bytes, " bytes given, dtype and shape need ",
                     (*writer)->expected_bytes()));
  }
  absl::Status appended = (*writer)->Append(data, bytes);
  if (!appended.ok()) return appended;
  return (*writer)->Close();
}

}  // namespace lossd
