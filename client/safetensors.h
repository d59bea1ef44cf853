// safetensors files for lossctl: the format of model outputs in the Hugging
// Face ecosystem (an 8-byte little-endian header length, a JSON header, then
// the raw little-endian bytes of every tensor). The reader treats every file
// as hostile (it is fuzzed): the JSON is parsed by nlohmann-json and every
// offset and size is checked for overflow and against the file.
//
// Accepted: any tensor list the format allows, in any order, with gaps
// between tensors; lossd reads tensors of dtype F32, F16, BF16, I32 and I64
// (other dtypes, known or newer ones, are INVALID_ARGUMENT only when
// selected). Rejected as malformed: a header over kMaxSafetensorsHeaderBytes
// (the format's 100 MB), a header that is not one JSON object, duplicate
// keys, an entry without "dtype", "shape" or "data_offsets", negative or
// non-integer dimensions, more than kMaxSafetensorsRank of them, offsets
// outside the file or reversed, a size other than elements x dtype size,
// overlapping tensors, and a "__metadata__" that is not an object of strings.
#ifndef LOSSD_CLIENT_SAFETENSORS_H_
#define LOSSD_CLIENT_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/dtype.h"

namespace lossd {

// The format's limit on the JSON header.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;
// Dimensions per tensor (numpy's limit; the format sets none).
inline constexpr std::size_t kMaxSafetensorsRank = 64;

// One tensor of a header.
struct SafetensorsTensor {
  std::string name;
  std::string dtype_name;  // as in the file: "F32", "BF16", "U8", ...
  // The lossd dtype of dtype_name; kInvalid for dtypes lossd does not take.
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;  // [] is a scalar: one element
  uint64_t elements = 0;
  // [begin, end) relative to the start of the data (after the header).
  uint64_t begin = 0;
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsTensor> tensors;  // sorted by name
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // 8 + the header length
  uint64_t data_bytes = 0;   // the largest end of a tensor
};

// Parses the header at the start of `prefix` (which must hold at least the
// 8-byte length and the JSON) of a file of `file_bytes` bytes. Success: every
// tensor lies inside the file, data_offset + end <= file_bytes.
// INVALID_ARGUMENT with the reason for anything malformed (see above) or a
// file too short for its header or tensors. Never reads past `prefix`.
// Thread-safe (pure function).
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(
    absl::string_view prefix, uint64_t file_bytes);

// The safetensors dtype name of a lossd dtype ("F32", "BF16", ...), or
// nullptr for kInvalid.
const char* SafetensorsDTypeName(DType dtype);

// The header of a file holding one tensor `name` of `dtype` and `shape`:
// length, JSON and the spaces that pad the data's start to 8 bytes, as the
// reference writer does. `metadata` goes to "__metadata__" when not empty.
// The tensor's bytes follow directly. INVALID_ARGUMENT: an empty name or
// "__metadata__", kInvalid, a negative dimension, a size overflowing 64 bits.
absl::StatusOr<std::string> EncodeSafetensorsHeader(
    const std::string& name, DType dtype, absl::Span<const int64_t> shape,
    const std::map<std::string, std::string>& metadata = {});

// A safetensors file opened read-only and memory-mapped (tensors are read
// lazily from the page cache, never copied whole). Immutable after Open;
// safe to read from several threads. Not copyable.
class SafetensorsFile {
 public:
  // NOT_FOUND: no such file. PERMISSION_DENIED: unreadable.
  // INVALID_ARGUMENT: as ParseSafetensorsHeader, prefixed with the path.
  // INTERNAL: mmap failed.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::string& path);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const SafetensorsHeader& header() const { return header_; }
  const std::string& path() const { return path_; }

  // The tensor called `name`; an empty name selects the only tensor of a file
  // that has one. INVALID_ARGUMENT naming the tensors there are: no such
  // tensor, or an empty name with several. The pointer is into header().
  absl::StatusOr<const SafetensorsTensor*> Find(const std::string& name) const;

  // The bytes of `tensor` (one of header().tensors); valid while *this lives.
  const uint8_t* data(const SafetensorsTensor& tensor) const {
    return data_ + tensor.begin;
  }

 private:
  SafetensorsFile(std::string path, SafetensorsHeader header, void* mapping,
                  std::size_t mapping_bytes);

  std::string path_;
  SafetensorsHeader header_;
  void* mapping_;
  std::size_t mapping_bytes_;
  const uint8_t* data_;
};

}  // namespace lossd

#endif  // LOSSD_CLIENT_SAFETENSORS_H_
