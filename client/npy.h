// NumPy .npy files for lossctl: logits and targets come from Python as .npy,
// and gradients go back the same way. The reader treats every file as hostile
// (it is fuzzed): sizes are checked for overflow and against the file length.
//
// Supported: format versions 1.0, 2.0 and 3.0; little-endian '<f4' (float32),
// '<f2' (float16), '<i4' (int32), '<i8' (int64); C order only. Out of scope:
// bf16 (ml_dtypes stores it as '<u2' or 'V2', which cannot be told apart from
// plain uint16 / void data), big-endian data, Fortran order (accepted only for
// rank <= 1, where it is the same layout), structured and object dtypes. Each
// is INVALID_ARGUMENT with a message saying so.
#ifndef LOSSD_CLIENT_NPY_H_
#define LOSSD_CLIENT_NPY_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/dtype.h"

namespace lossd {

// Headers longer than this are rejected; numpy itself writes ~128 bytes and
// refuses more than 10000 by default.
inline constexpr std::size_t kMaxNpyHeaderBytes = 1 << 20;
// numpy's own limit on the number of dimensions.
inline constexpr int kMaxNpyRank = 64;

// What the header of a .npy file says.
struct NpyHeader {
  int major_version = 1;  // 1, 2 or 3
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;   // () is a scalar: one element
  uint64_t elements = 0;        // product of shape
  uint64_t data_bytes = 0;      // elements * DTypeSize(dtype)
  std::size_t data_offset = 0;  // where the data starts
};

// Parses the header at the start of `bytes`, which must contain at least the
// whole header (not necessarily the data). Success: the parsed header, with
// elements and data_bytes computed without overflow. INVALID_ARGUMENT: not a
// .npy file, an unknown version, a truncated or malformed header, a dtype out
// of scope, Fortran order, a negative dimension, more than kMaxNpyRank
// dimensions, or sizes that overflow 64 bits. Never reads past `bytes`.
// Thread-safe (pure function).
absl::StatusOr<NpyHeader> ParseNpyHeader(absl::string_view bytes);

// The header bytes numpy would write for an array of `dtype` and `shape` (C
// order): version 1.0, or 2.0 when the header does not fit 1.0; padded so the
// data starts on a 64-byte boundary. INVALID_ARGUMENT for a dtype that .npy
// cannot hold natively (bf16, kInvalid) or a negative dimension.
absl::StatusOr<std::string> EncodeNpyHeader(DType dtype,
                                            absl::Span<const int64_t> shape);

// A .npy file opened read-only and memory-mapped, so multi-GB logits are read
// lazily by the kernel's page cache rather than copied. Immutable after Open;
// safe to read from several threads. Not copyable.
class NpyFile {
 public:
  // Success: the file is mapped and its length covers header + data (extra
  // trailing bytes are ignored, as numpy does). NOT_FOUND: no such file.
  // PERMISSION_DENIED: cannot be read. INVALID_ARGUMENT: as ParseNpyHeader,
  // or the file is shorter than the header says. INTERNAL: mmap failed.
  static absl::StatusOr<std::unique_ptr<NpyFile>> Open(const std::string& path);

  ~NpyFile();
  NpyFile(const NpyFile&) = delete;
  NpyFile& operator=(const NpyFile&) = delete;

  const NpyHeader& header() const { return header_; }
  // data_bytes() bytes of little-endian elements; valid while *this lives.
  const uint8_t* data() const { return data_; }
  uint64_t data_bytes() const { return header_.data_bytes; }

 private:
  NpyFile(NpyHeader header, void* mapping, std::size_t mapping_bytes,
          const uint8_t* data);

  NpyHeader header_;
  void* mapping_;  // nullptr for an empty mapping
  std::size_t mapping_bytes_;
  const uint8_t* data_;
};

// Writes a .npy file incrementally, so a download can stream to disk in
// chunks. Not thread-safe. Not copyable.
class NpyWriter {
 public:
  // Creates (truncates) `path` and writes the header. INVALID_ARGUMENT as
  // EncodeNpyHeader; the errno-derived code when the file cannot be created.
  static absl::StatusOr<std::unique_ptr<NpyWriter>> Create(
      const std::string& path, DType dtype, absl::Span<const int64_t> shape);

  // Closes the file if Close was not called; the file is then incomplete.
  ~NpyWriter();
  NpyWriter(const NpyWriter&) = delete;
  NpyWriter& operator=(const NpyWriter&) = delete;

  // Appends raw little-endian element bytes. OUT_OF_RANGE when the total
  // would exceed what the header says; the errno-derived code on I/O error.
  absl::Status Append(const void* data, std::size_t bytes);

  // Flushes and closes. FAILED_PRECONDITION when fewer bytes were appended
  // than the header says; the errno-derived code on I/O error.
  absl::Status Close();

  // Data bytes the header promises.
  uint64_t expected_bytes() const { return expected_bytes_; }

 private:
  NpyWriter(std::FILE* file, std::string path, uint64_t expected_bytes);

  std::FILE* file_;
  std::string path_;
  uint64_t expected_bytes_;
  uint64_t written_bytes_ = 0;
};

// Writes a whole array in one call (NpyWriter underneath). INVALID_ARGUMENT
// when `bytes` does not match dtype and shape; otherwise as NpyWriter.
absl::Status WriteNpy(const std::string& path, DType dtype,
                      absl::Span<const int64_t> shape, const void* data,
                      std::size_t bytes);

}  // namespace lossd

#endif  // LOSSD_CLIENT_NPY_H_
