// Input tensors, upload sources and download files of tensor_file.h.
#include "client/tensor_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace lossd {
namespace {

constexpr char kSafetensorsSuffix[] = ".safetensors";
constexpr char kSafetensorsSeparator[] = ".safetensors:";

absl::Status ErrnoError(int error, absl::string_view what,
                        absl::string_view path) {
  return absl::ErrnoToStatus(error, absl::StrCat(what, " ", path));
}

// Writes all of [data, data + bytes) at `offset`, through short writes.
absl::Status WriteAt(int fd, const void* data, std::size_t bytes,
                     uint64_t offset, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = pwrite(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "cannot write", path);
    }
    p += n;
    bytes -= static_cast<std::size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

// Gives every page of the shared file mapping [mapping, mapping + bytes) its
// storage and a writable page-table entry, a 64 MiB chunk per task of
// `pool`, before the download's stores reach it: in one thread (fallocate,
// then MAP_POPULATE) this costs about a second a GiB of /dev/shm on the build
// machine, ahead of the first byte, and faults taken by the converting
// threads slow the transfer where cores are few. MADV_POPULATE_WRITE reports
// a full file system as EFAULT, where a store would raise SIGBUS; a kernel
// without it (before 5.14) gets the storage from posix_fallocate, then one
// store a page.
absl::Status PopulateMapping(uint8_t* mapping, uint64_t bytes, int fd,
                             ConvertPool* pool, const std::string& path) {
  constexpr uint64_t kChunk = uint64_t{64} << 20;
  constexpr uint64_t kPage = 4096;
  const auto chunks = static_cast<int64_t>((bytes + kChunk - 1) / kChunk);
  std::atomic<bool> unsupported{false};
  absl::Status status =
      pool->ParallelFor(chunks, [&](int64_t chunk) -> absl::Status {
        const uint64_t begin = static_cast<uint64_t>(chunk) * kChunk;
        const uint64_t length = std::min(kChunk, bytes - begin);
#ifdef MADV_POPULATE_WRITE
        if (madvise(mapping + begin, length, MADV_POPULATE_WRITE) == 0) {
          return absl::OkStatus();
        }
        if (errno == EFAULT) {
          return absl::ResourceExhaustedError(
              absl::StrCat("no space for the ", bytes, " bytes of ", path));
        }
        if (errno != EINVAL) {
          return ErrnoError(errno, "cannot allocate the pages of", path);
        }
#endif
        unsupported = true;
        return absl::OkStatus();
      });
  if (!status.ok() || !unsupported) return status;
  const int allocated = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (allocated != 0 && allocated != EOPNOTSUPP && allocated != EINVAL) {
    return ErrnoError(allocated, "cannot allocate", path);
  }
  return pool->ParallelFor(chunks, [&](int64_t chunk) -> absl::Status {
    const uint64_t begin = static_cast<uint64_t>(chunk) * kChunk;
    const uint64_t end = std::min(begin + kChunk, bytes);
    for (uint64_t at = begin; at < end; at += kPage) {
      reinterpret_cast<volatile uint8_t*>(mapping)[at] = 0;
    }
    return absl::OkStatus();
  });
}

}  // namespace

TensorFileSpec ParseTensorFileSpec(const std::string& arg) {
  TensorFileSpec spec;
  const std::size_t at = arg.find(kSafetensorsSeparator);
  if (at != std::string::npos) {
    spec.path = arg.substr(0, at + std::strlen(kSafetensorsSuffix));
    spec.name = arg.substr(at + std::strlen(kSafetensorsSeparator));
    spec.safetensors = true;
    return spec;
  }
  spec.path = arg;
  spec.safetensors = absl::EndsWith(arg, kSafetensorsSuffix);
  return spec;
}

bool LooksLikeTensorFile(const std::string& arg) {
  return absl::EndsWith(arg, ".npy") ||
         absl::EndsWith(arg, kSafetensorsSuffix) ||
         absl::StrContains(arg, kSafetensorsSeparator);
}

absl::StatusOr<std::unique_ptr<InputTensor>> InputTensor::Open(
    const std::string& arg) {
  const TensorFileSpec spec = ParseTensorFileSpec(arg);
  std::unique_ptr<InputTensor> input(new InputTensor());
  if (!spec.safetensors) {
    absl::StatusOr<std::unique_ptr<NpyFile>> npy = NpyFile::Open(spec.path);
    if (!npy.ok()) return npy.status();
    input->npy_ = *std::move(npy);
    const NpyHeader& header = input->npy_->header();
    input->dtype_ = header.dtype;
    input->shape_ = header.shape;
    input->elements_ = header.elements;
    input->data_ = input->npy_->data();
    input->description_ = spec.path;
    return input;
  }
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(spec.path);
  if (!file.ok()) return file.status();
  input->safetensors_ = *std::move(file);
  absl::StatusOr<const SafetensorsTensor*> tensor =
      input->safetensors_->Find(spec.name);
  if (!tensor.ok()) return tensor.status();
  input->description_ = absl::StrCat(spec.path, ":", (*tensor)->name);
  if ((*tensor)->dtype == DType::kInvalid) {
    return absl::InvalidArgumentError(absl::StrCat(
        input->description_, ": dtype ", (*tensor)->dtype_name.substr(0, 40),
        " is not supported (lossd takes F32, F16, BF16, I32 "
        "and I64)"));
  }
  input->dtype_ = (*tensor)->dtype;
  input->shape_ = (*tensor)->shape;
  input->elements_ = (*tensor)->elements;
  input->data_ = input->safetensors_->data(**tensor);
  return input;
}

std::function<absl::StatusOr<const void*>(int64_t, std::size_t, void*)>
MakeUploadSource(const InputTensor& input, DType send_dtype,
                 ConvertPool* pool) {
  return
      [&input, send_dtype, pool](int64_t offset, std::size_t bytes,
                                 void* scratch) -> absl::StatusOr<const void*> {
        const uint64_t out_size = DTypeSize(send_dtype);
        const uint64_t total = input.elements() * out_size;
        if (offset < 0 || static_cast<uint64_t>(offset) > total ||
            bytes > total - static_cast<uint64_t>(offset) ||
            offset % out_size != 0 || bytes % out_size != 0) {
          return absl::InternalError(absl::StrCat(
              "upload source asked for ", bytes, " bytes at ", offset, " of ",
              total, " (elements of ", out_size, " bytes)"));
        }
        const uint64_t first = static_cast<uint64_t>(offset) / out_size;
        const uint8_t* src = input.data() + first * DTypeSize(input.dtype());
        if (send_dtype == input.dtype()) return src;
        absl::Status status = pool->Convert(src, input.dtype(), scratch,
                                            send_dtype, bytes / out_size);
        if (!status.ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat(input.description(), ": ", status.message()));
        }
        return static_cast<const void*>(scratch);
      };
}

absl::StatusOr<std::unique_ptr<OutputTensorFile>> OutputTensorFile::Create(
    const std::string& arg, DType sent_dtype, absl::Span<const int64_t> shape,
    const std::string& default_name, ConvertPool* pool, WriteMode mode) {
  const TensorFileSpec spec = ParseTensorFileSpec(arg);
  std::unique_ptr<OutputTensorFile> out(new OutputTensorFile());
  out->path_ = spec.path;
  out->sent_dtype_ = sent_dtype;
  out->pool_ = pool;
  uint64_t elements = 1;
  for (int64_t dim : shape) {
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("negative dimension ", dim, " in shape"));
    }
    elements *= static_cast<uint64_t>(dim);
  }
  out->sent_bytes_ = elements * DTypeSize(sent_dtype);
  std::string header;
  if (spec.safetensors) {
    out->file_dtype_ = sent_dtype;
    out->tensor_name_ = spec.name.empty() ? default_name : spec.name;
    absl::StatusOr<std::string> encoded =
        EncodeSafetensorsHeader(out->tensor_name_, sent_dtype, shape);
    if (!encoded.ok()) return encoded.status();
    header = *std::move(encoded);
  } else {
    // numpy has no bf16: the exact float32 values instead.
    out->file_dtype_ =
        sent_dtype == DType::kBFloat16 ? DType::kFloat32 : sent_dtype;
    absl::StatusOr<std::string> encoded =
        EncodeNpyHeader(out->file_dtype_, shape);
    if (!encoded.ok()) return encoded.status();
    header = *std::move(encoded);
  }
  out->data_offset_ = header.size();
  // Beside the path, so the final rename stays within one file system.
  out->temp_path_ = absl::StrCat(spec.path, ".lossctl-", getpid(), ".part");
  out->fd_ = open(out->temp_path_.c_str(),
                  O_CREAT | O_TRUNC | O_RDWR | O_CLOEXEC, 0666);
  if (out->fd_ < 0) return ErrnoError(errno, "cannot create", out->temp_path_);
  if (mode == WriteMode::kMapped) {
    const uint64_t file_bytes =
        out->data_offset_ + elements * DTypeSize(out->file_dtype_);
    if (ftruncate(out->fd_, static_cast<off_t>(file_bytes)) != 0) {
      return ErrnoError(errno, "cannot size", out->temp_path_);
    }
    void* mapping = mmap(nullptr, file_bytes, PROT_READ | PROT_WRITE,
                         MAP_SHARED, out->fd_, 0);
    if (mapping == MAP_FAILED) {
      return ErrnoError(errno, "cannot mmap", out->temp_path_);
    }
    out->mapping_ = static_cast<uint8_t*>(mapping);
    out->mapping_bytes_ = file_bytes;
    absl::Status populated = PopulateMapping(out->mapping_, file_bytes,
                                             out->fd_, pool, out->temp_path_);
    if (!populated.ok()) return populated;
    std::memcpy(out->mapping_, header.data(), header.size());
    return out;
  }
  absl::Status written =
      WriteAt(out->fd_, header.data(), header.size(), 0, out->temp_path_);
  if (!written.ok()) return written;
  return out;
}

OutputTensorFile::~OutputTensorFile() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_bytes_);
  if (fd_ >= 0) close(fd_);
  if (!committed_ && !temp_path_.empty()) unlink(temp_path_.c_str());
}

absl::Status OutputTensorFile::Write(int64_t offset, const void* data,
                                     std::size_t bytes) {
  const uint64_t sent_size = DTypeSize(sent_dtype_);
  if (offset < 0 || static_cast<uint64_t>(offset) > sent_bytes_ ||
      bytes > sent_bytes_ - static_cast<uint64_t>(offset) ||
      offset % sent_size != 0 || bytes % sent_size != 0) {
    return absl::InternalError(absl::StrCat("download piece of ", bytes,
                                            " bytes at ", offset, " of ",
                                            sent_bytes_, " bytes"));
  }
  const uint64_t file_size = DTypeSize(file_dtype_);
  const uint64_t first = static_cast<uint64_t>(offset) / sent_size;
  const uint64_t count = bytes / sent_size;
  // Slices of a piece go to the pool: one core converts and writes well
  // below what the connections deliver. Each converts into a buffer of its
  // own thread that stays in cache, then writes it.
  constexpr uint64_t kSliceElements = 64 << 10;
  const uint64_t slices = (count + kSliceElements - 1) / kSliceElements;
  const uint8_t* in = static_cast<const uint8_t*>(data);
  absl::Status status = pool_->ParallelFor(
      static_cast<int64_t>(slices), [&](int64_t slice) -> absl::Status {
        const uint64_t begin = static_cast<uint64_t>(slice) * kSliceElements;
        const uint64_t n = std::min(kSliceElements, count - begin);
        const uint64_t at = data_offset_ + (first + begin) * file_size;
        if (mapping_ != nullptr) {
          return ConvertElements(in + begin * sent_size, sent_dtype_,
                                 mapping_ + at, file_dtype_, n);
        }
        if (file_dtype_ == sent_dtype_) {
          return WriteAt(fd_, in + begin * sent_size, n * sent_size, at,
                         temp_path_);
        }
        thread_local std::vector<uint8_t> buffer;
        buffer.resize(kSliceElements * 8);
        absl::Status converted = ConvertElements(
            in + begin * sent_size, sent_dtype_, buffer.data(), file_dtype_, n);
        if (!converted.ok()) return converted;
        return WriteAt(fd_, buffer.data(), n * file_size, at, temp_path_);
      });
  if (!status.ok()) return status;
  written_ += bytes;
  return absl::OkStatus();
}

absl::Status OutputTensorFile::Commit() {
  if (committed_ || fd_ < 0) {
    return absl::FailedPreconditionError("committed twice");
  }
  if (written_.load() != sent_bytes_) {
    return absl::DataLossError(absl::StrCat(
        path_, ": ", written_.load(), " of ", sent_bytes_, " bytes arrived"));
  }
  if (mapping_ != nullptr) {
    // As with pwrite, the kernel writes the pages back to a disk file later.
    munmap(std::exchange(mapping_, nullptr), mapping_bytes_);
  }
  const int fd = std::exchange(fd_, -1);
  if (close(fd) != 0) return ErrnoError(errno, "cannot write", temp_path_);
  if (rename(temp_path_.c_str(), path_.c_str()) != 0) {
    return ErrnoError(errno, absl::StrCat("cannot rename ", temp_path_, " to"),
                      path_);
  }
  committed_ = true;
  return absl::OkStatus();
}

}  // namespace lossd
