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
#include "common/status_macros.h"

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

// Page-aligned bounds of [begin, begin + bytes) within a mapping.
struct PageSpan {
  uint8_t* begin;
  std::size_t bytes;
};
PageSpan PagesOf(uint8_t* begin, uint64_t bytes) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t first = reinterpret_cast<uintptr_t>(begin) & ~(page - 1);
  const uintptr_t end =
      (reinterpret_cast<uintptr_t>(begin) + bytes + page - 1) & ~(page - 1);
  return {reinterpret_cast<uint8_t*>(first), end - first};
}

// Gives the pages under [begin, begin + bytes) of a shared file mapping
// their storage and a writable page-table entry, so that stores into them
// cannot fault. A full file system is RESOURCE_EXHAUSTED here (the kernel
// reports it as EFAULT), where a store would raise SIGBUS. UNIMPLEMENTED: a
// kernel without MADV_POPULATE_WRITE (before 5.14).
absl::Status PopulatePages(uint8_t* begin, uint64_t bytes,
                           const std::string& path) {
#ifdef MADV_POPULATE_WRITE
  const PageSpan span = PagesOf(begin, bytes);
  if (madvise(span.begin, span.bytes, MADV_POPULATE_WRITE) == 0) {
    return absl::OkStatus();
  }
  if (errno == EFAULT) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no space left for the data of ", path));
  }
  if (errno != EINVAL) {
    return ErrnoError(errno, "cannot allocate the pages of", path);
  }
#endif
  return absl::UnimplementedError("no MADV_POPULATE_WRITE");
}

// Unmaps the shared file mapping [mapping, mapping + bytes), its page-table
// entries dropped (MADV_DONTNEED: for a shared mapping the data stays in the
// file) a 64 MiB chunk per task of `pool` first.
absl::Status UnmapInParallel(uint8_t* mapping, uint64_t bytes,
                             ConvertPool* pool) {
  constexpr uint64_t kChunk = uint64_t{64} << 20;
  const auto chunks = static_cast<int64_t>((bytes + kChunk - 1) / kChunk);
  if (chunks > 1) {
    pool->ParallelFor(chunks,
                      [&](int64_t chunk) {
                        const uint64_t begin =
                            static_cast<uint64_t>(chunk) * kChunk;
                        madvise(mapping + begin,
                                std::min(kChunk, bytes - begin), MADV_DONTNEED);
                        return absl::OkStatus();
                      })
        .IgnoreError();
  }
  if (munmap(mapping, bytes) != 0) {
    return absl::ErrnoToStatus(errno, "cannot unmap the download file");
  }
  return absl::OkStatus();
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
    // The data's pages are populated by the threads that convert into them,
    // slice by slice while later pieces are in flight (see Write), not all
    // ahead of the first byte.
    absl::Status populated =
        PopulatePages(out->mapping_, header.size(), out->temp_path_);
    if (absl::IsUnimplemented(populated)) {
      // Without MADV_POPULATE_WRITE the storage comes from fallocate, in one
      // call ahead of the data, so that no store can meet a full file system
      // (a file system without fallocate is written as it is).
      const int allocated =
          posix_fallocate(out->fd_, 0, static_cast<off_t>(file_bytes));
      if (allocated != 0 && allocated != EOPNOTSUPP && allocated != EINVAL) {
        return ErrnoError(allocated, "cannot allocate", out->temp_path_);
      }
      populated = absl::OkStatus();
    } else {
      out->populate_slices_ = true;
    }
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
          // Populated just before the stores, the fresh (zeroed) pages are
          // still in this core's cache when the conversion overwrites them.
          if (populate_slices_) {
            RETURN_IF_ERROR(
                PopulatePages(mapping_ + at, n * file_size, temp_path_));
          }
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
    // The page-table entries go on the pool's threads at once: one thread
    // unmapping a 4.3 GB file took 0.1-0.3 s on the 16-core H100 machine
    // (bench/convert_bench --downloads_only).
    uint8_t* const mapping = std::exchange(mapping_, nullptr);
    RETURN_IF_ERROR(UnmapInParallel(mapping, mapping_bytes_, pool_));
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
