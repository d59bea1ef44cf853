// Tensors in files for lossctl, at memory speed: an input file (.npy or
// safetensors) is mapped and its pieces converted on all cores straight into
// the client's send buffers (an UploadSource); a download is converted and
// written piece by piece at its place in the output file while later pieces
// arrive (a DownloadSink). Nothing of full size is copied or allocated.
#ifndef LOSSD_CLIENT_TENSOR_FILE_H_
#define LOSSD_CLIENT_TENSOR_FILE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/convert.h"
#include "client/npy.h"
#include "client/safetensors.h"
#include "common/dtype.h"

namespace lossd {

// A tensor argument of lossctl: "FILE.npy", "FILE.safetensors" (its only
// tensor) or "FILE.safetensors:NAME".
struct TensorFileSpec {
  std::string path;
  std::string name;  // the safetensors tensor; empty = not given
  bool safetensors = false;
};

// Splits `arg` at ".safetensors:" (so the tensor name may hold ':').
// A path ending in ".safetensors" is safetensors; anything else is .npy.
TensorFileSpec ParseTensorFileSpec(const std::string& arg);

// True when `arg` names a tensor file rather than a handle: it ends in
// ".npy" or ".safetensors", or contains ".safetensors:".
bool LooksLikeTensorFile(const std::string& arg);

// A tensor of an input file, memory-mapped. Immutable; thread-safe.
class InputTensor {
 public:
  // Opens `arg` (see TensorFileSpec). Errors as NpyFile::Open and
  // SafetensorsFile::Open/Find; INVALID_ARGUMENT, naming the file and the
  // tensor, for a safetensors dtype lossd does not take.
  static absl::StatusOr<std::unique_ptr<InputTensor>> Open(
      const std::string& arg);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  uint64_t elements() const { return elements_; }
  uint64_t bytes() const { return elements_ * DTypeSize(dtype_); }
  // bytes() bytes of little-endian elements, valid while *this lives.
  const uint8_t* data() const { return data_; }
  // "FILE.npy" or "FILE.safetensors:NAME", for messages.
  const std::string& description() const { return description_; }

 private:
  InputTensor() = default;

  std::unique_ptr<NpyFile> npy_;
  std::unique_ptr<SafetensorsFile> safetensors_;
  DType dtype_ = DType::kInvalid;
  std::vector<int64_t> shape_;
  uint64_t elements_ = 0;
  const uint8_t* data_ = nullptr;
  std::string description_;
};

// Returns the UploadSource contract's function (client/client.h) for
// `input` sent as `send_dtype`: a piece points into the mapping when the
// dtypes are equal, else `pool` converts it into the scratch buffer. The
// caller checks CanConvert(input.dtype(), send_dtype) first. `input` and
// `pool` must outlive the upload. INTERNAL from the function: a piece not
// of whole elements or outside the tensor.
std::function<absl::StatusOr<const void*>(int64_t, std::size_t, void*)>
MakeUploadSource(const InputTensor& input, DType send_dtype, ConvertPool* pool);

// The file a download is written into. Create writes the header; Write (the
// DownloadSink contract, thread-safe) converts each piece and writes it at
// its place; Commit checks that every byte came and moves the file to its
// path. The data goes to a temporary file beside the path, so a failed or
// interrupted download never leaves a truncated file there, nor destroys
// the file it would replace. Not copyable.
class OutputTensorFile {
 public:
  // For a tensor of `sent_dtype` and `shape` as it arrives. `arg` names the
  // file (see TensorFileSpec): a .npy file stores bf16 as float32 (numpy has
  // no bf16; exact); a safetensors file stores the tensor as sent, named
  // spec.name or else `default_name`. INVALID_ARGUMENT: a dtype the format
  // cannot hold, a bad name; the errno-derived code when the file cannot be
  // created, sized, mapped or written.
  //
  // How the data reaches the file: kPwrite converts each slice into a small
  // buffer and pwrite()s it; kMapped sizes the file first and converts
  // straight into a shared mapping of it, each slice's pages given their
  // storage (MADV_POPULATE_WRITE) by the converting thread just before its
  // stores, while later pieces are in flight; Commit drops the page-table
  // entries over the pool. tmpfs serializes the writes to one file on its
  // inode lock while stores into a mapping proceed on every thread, so on
  // many cores the mapping wins (lossctl's default; measured in
  // bench/SERVICE_RESULTS.md), while on two cores pwrite can be faster. A
  // full file system is RESOURCE_EXHAUSTED in both modes, never SIGBUS.
  enum class WriteMode { kPwrite, kMapped };
  static absl::StatusOr<std::unique_ptr<OutputTensorFile>> Create(
      const std::string& arg, DType sent_dtype, absl::Span<const int64_t> shape,
      const std::string& default_name, ConvertPool* pool,
      WriteMode mode = WriteMode::kPwrite);

  // Removes the temporary file unless Commit succeeded.
  ~OutputTensorFile();
  OutputTensorFile(const OutputTensorFile&) = delete;
  OutputTensorFile& operator=(const OutputTensorFile&) = delete;

  // Writes the `bytes` bytes of the tensor as sent that start at byte
  // `offset`, converted to file_dtype(). Concurrent calls must cover
  // disjoint ranges. INTERNAL: not whole elements, or outside the tensor;
  // the errno-derived code on I/O errors.
  absl::Status Write(int64_t offset, const void* data, std::size_t bytes);

  // DATA_LOSS when fewer bytes were written than the tensor has; the
  // errno-derived code when the file cannot be closed or renamed.
  absl::Status Commit();

  DType file_dtype() const { return file_dtype_; }
  const std::string& path() const { return path_; }
  // The tensor name in a safetensors file; empty for .npy.
  const std::string& tensor_name() const { return tensor_name_; }

 private:
  OutputTensorFile() = default;

  std::string path_;
  std::string temp_path_;
  std::string tensor_name_;
  int fd_ = -1;
  // The whole file, shared, in WriteMode::kMapped; else nullptr.
  uint8_t* mapping_ = nullptr;
  uint64_t mapping_bytes_ = 0;
  // Write populates each slice's pages before its stores (MADV_POPULATE_WRITE
  // works); else the file was fallocated whole.
  bool populate_slices_ = false;
  bool committed_ = false;
  DType sent_dtype_ = DType::kInvalid;
  DType file_dtype_ = DType::kInvalid;
  uint64_t data_offset_ = 0;  // where the data starts in the file
  uint64_t sent_bytes_ = 0;   // of the whole tensor as sent
  ConvertPool* pool_ = nullptr;
  std::atomic<uint64_t> written_{0};  // bytes as sent
};

}  // namespace lossd

#endif  // LOSSD_CLIENT_TENSOR_FILE_H_
