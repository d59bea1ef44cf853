// CudaDevice: stream-ordered device memory, pooled streams and pinned staging
// buffers, device-side conversion for downloads, and the sticky-error report
// that lets the server die rather than limp on a broken context.
#include "server/cuda_device.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cross_entropy_validate.h"
#include "kernels/cuda/convert_cuda.h"
#include "kernels/cuda/cross_entropy_cuda.h"
#include "kernels/cuda/cross_entropy_cuda_host.h"
#include "kernels/cuda/linear_cross_entropy_cuda.h"
#include "kernels/cuda/post_training_cuda_host.h"

namespace lossd {
namespace {

// Copies an upload's bytes into pinned staging. The staging buffer is read
// next by the GPU's DMA, not by the CPU, so large copies use non-temporal
// stores: no read for ownership of the destination and no eviction of the
// receive buffers from the caches. FlushUpload fences them before the DMA.
void StreamCopy(char* dst, const char* src, size_t n) {
#if defined(__SSE2__)
  constexpr size_t kStreamFrom = 4096;
  if (n >= kStreamFrom) {
    const size_t head = (16 - reinterpret_cast<std::uintptr_t>(dst) % 16) % 16;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
      const __m128i* from = reinterpret_cast<const __m128i*>(src);
      __m128i* to = reinterpret_cast<__m128i*>(dst);
      const __m128i a = _mm_loadu_si128(from);
      const __m128i b = _mm_loadu_si128(from + 1);
      const __m128i c = _mm_loadu_si128(from + 2);
      const __m128i d = _mm_loadu_si128(from + 3);
      _mm_stream_si128(to, a);
      _mm_stream_si128(to + 1, b);
      _mm_stream_si128(to + 2, c);
      _mm_stream_si128(to + 3, d);
    }
  }
#endif
  std::memcpy(dst, src, n);
}

// Where a call's per-token outputs (those it asks for: token_loss, token_lse,
// token_argmax) lie in its device block, from a given offset on.
struct TokenOutputs {
  size_t loss = 0;
  size_t lse = 0;
  size_t argmax = 0;
  size_t end = 0;  // the block's size
};

template <typename Args>
TokenOutputs LayOutTokenOutputs(const Args& args, size_t rows, size_t offset) {
  TokenOutputs at;
  at.loss = offset;
  if (args.token_loss != nullptr) offset += AlignUp(rows * sizeof(float));
  at.lse = offset;
  if (args.token_lse != nullptr) offset += AlignUp(rows * sizeof(float));
  at.argmax = offset;
  if (args.token_argmax != nullptr) offset += AlignUp(rows * sizeof(int32_t));
  at.end = offset;
  return at;
}

// Points the outputs `device_args` asks for (a copy of the caller's args,
// whose pointers are host memory) into `block`, where the kernels write.
template <typename Args>
void PointTokenOutputs(const TokenOutputs& at, char* block, Args* device_args) {
  if (device_args->token_loss != nullptr) {
    device_args->token_loss = reinterpret_cast<float*>(block + at.loss);
  }
  if (device_args->token_lse != nullptr) {
    device_args->token_lse = reinterpret_cast<float*>(block + at.lse);
  }
  if (device_args->token_argmax != nullptr) {
    device_args->token_argmax = reinterpret_cast<int32_t*>(block + at.argmax);
  }
}

// Copies the outputs asked for from the device block back to the caller's
// arrays with `copy(host, device, bytes)`; the first error stops it.
template <typename Args, typename Copy>
absl::Status CopyTokenOutputs(const Args& args, const Args& device_args,
                              size_t rows, const Copy& copy) {
  absl::Status status;
  if (args.token_loss != nullptr) {
    status =
        copy(args.token_loss, device_args.token_loss, rows * sizeof(float));
  }
  if (status.ok() && args.token_lse != nullptr) {
    status = copy(args.token_lse, device_args.token_lse, rows * sizeof(float));
  }
  if (status.ok() && args.token_argmax != nullptr) {
    status = copy(args.token_argmax, device_args.token_argmax,
                  rows * sizeof(int32_t));
  }
  return status;
}

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    // No driver or no device: the error is not sticky, clear it.
    cudaGetLastError();
    return 0;
  }
  return count;
}

bool IsStickyCudaError(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContextIsDestroyed:
    case cudaErrorDevicesUnavailable:
    case cudaErrorUnknown:
      return true;
    default:
      return false;
  }
}

absl::StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::Create(
    const CudaDeviceOptions& options) {
  const int count = CudaDeviceCount();
  if (options.ordinal < 0 || options.ordinal >= count) {
    return absl::FailedPreconditionError(
        count == 0 ? std::string("no CUDA device is visible (no GPU or no "
                                 "driver); use --device=cpu")
                   : absl::StrCat("CUDA device ", options.ordinal,
                                  " does not exist (", count, " visible)"));
  }
  if (options.staging_bytes == 0) {
    return absl::InvalidArgumentError("staging_bytes must be > 0");
  }
  std::unique_ptr<CudaDevice> device(new CudaDevice(options));
  RETURN_IF_ERROR(
      device->Check(cudaSetDevice(options.ordinal), "select device"));
  // Creates the context now rather than on the first request.
  RETURN_IF_ERROR(device->Check(cudaFree(nullptr), "initialize context"));
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  RETURN_IF_ERROR(
      device->Check(cudaMemGetInfo(&free_bytes, &total_bytes), "memory info"));
  device->free_at_start_ = static_cast<int64_t>(free_bytes);
  device->total_bytes_ = static_cast<int64_t>(total_bytes);
  RETURN_IF_ERROR(device->Check(
      cudaDeviceGetDefaultMemPool(&device->pool_, options.ordinal),
      "default memory pool"));
  // Freed memory stays cached in the pool (budgets bound it); Allocate trims
  // the cache when a request does not fit.
  uint64_t threshold = std::numeric_limits<uint64_t>::max();
  RETURN_IF_ERROR(device->Check(
      cudaMemPoolSetAttribute(device->pool_, cudaMemPoolAttrReleaseThreshold,
                              &threshold),
      "memory pool threshold"));
  return device;
}

CudaDevice::CudaDevice(const CudaDeviceOptions& options) : options_(options) {}

CudaDevice::~CudaDevice() {
  cudaSetDevice(options_.ordinal);
  std::vector<void*> buffers;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [buffer, upload] : uploads_) buffers.push_back(buffer);
  }
  for (void* buffer : buffers) EndUpload(buffer, false).IgnoreError();
  absl::MutexLock lock(&mu_);
  for (cudaStream_t stream : streams_) {
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
  }
  for (const Staging& staging : staging_) {
    cudaEventDestroy(staging.done);
    cudaFreeHost(staging.host);
  }
}

std::string CudaDevice::name() const {
  return absl::StrCat("cuda:", options_.ordinal);
}

DeviceMemoryInfo CudaDevice::memory() const {
  return {allocated_bytes_.load(std::memory_order_relaxed), total_bytes_};
}

int64_t CudaDevice::DefaultBudgetBytes() const {
  return std::max<int64_t>(0, free_at_start_ - options_.reserve_bytes);
}

void CudaDevice::SetFatalErrorHandler(
    std::function<void(const absl::Status&)> handler) {
  absl::MutexLock lock(&fatal_mu_);
  fatal_handler_ = std::move(handler);
}

absl::Status CudaDevice::Check(cudaError_t error, const char* what) {
  // The code and message come from the one mapping (RESOURCE_EXHAUSTED for
  // out of memory, INTERNAL otherwise); what is added here is the device's
  // name and the sticky-error handling.
  const absl::Status status =
      CudaStatus(error, absl::StrCat(name(), ": ", what));
  if (status.ok()) return status;
  if (error == cudaErrorMemoryAllocation || !IsStickyCudaError(error)) {
    // Recoverable: clear it so that the next call does not see it again.
    cudaGetLastError();
    return status;
  }
  const absl::Status fatal = absl::InternalError(absl::StrCat(
      status.message(), " (sticky error: the CUDA context is unusable)"));
  std::function<void(const absl::Status&)> handler;
  {
    absl::MutexLock lock(&fatal_mu_);
    if (!fatal_reported_) {
      fatal_reported_ = true;
      handler = fatal_handler_;
    }
  }
  if (handler) {
    handler(fatal);
  } else {
    std::fprintf(stderr, "lossd: %s\n", fatal.ToString().c_str());
  }
  return fatal;
}

absl::StatusOr<cudaStream_t> CudaDevice::AcquireStream() {
  {
    absl::MutexLock lock(&mu_);
    if (!streams_.empty()) {
      cudaStream_t stream = streams_.back();
      streams_.pop_back();
      return stream;
    }
  }
  cudaStream_t stream = nullptr;
  // Non-blocking: never ordered behind the legacy default stream.
  RETURN_IF_ERROR(Check(
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream"));
  return stream;
}

absl::StatusOr<CudaDevice::PooledStream> CudaDevice::TakeStream() {
  ASSIGN_OR_RETURN(cudaStream_t stream, AcquireStream());
  return PooledStream(this, stream);
}

void CudaDevice::ReleaseStream(cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  streams_.push_back(stream);
}

absl::StatusOr<CudaDevice::Staging> CudaDevice::AcquireStaging() {
  {
    absl::MutexLock lock(&mu_);
    if (!staging_.empty()) {
      Staging staging = staging_.back();
      staging_.pop_back();
      return staging;
    }
  }
  Staging staging;
  RETURN_IF_ERROR(Check(cudaHostAlloc(&staging.host, options_.staging_bytes,
                                      cudaHostAllocPortable),
                        "pinned staging buffer"));
  const absl::Status status = Check(
      cudaEventCreateWithFlags(&staging.done, cudaEventDisableTiming), "event");
  if (!status.ok()) {
    cudaFreeHost(staging.host);
    return status;
  }
  return staging;
}

void CudaDevice::ReleaseStaging(Staging staging) {
  absl::MutexLock lock(&mu_);
  staging_.push_back(staging);
}

absl::Status CudaDevice::AllocateOn(void** pointer, size_t bytes,
                                    cudaStream_t stream) {
  cudaError_t error = cudaMallocFromPoolAsync(pointer, bytes, pool_, stream);
  if (error == cudaErrorMemoryAllocation) {
    // Memory cached by the pool may be what is missing: give it back, retry.
    cudaGetLastError();
    cudaStreamSynchronize(stream);
    cudaMemPoolTrimTo(pool_, 0);
    error = cudaMallocFromPoolAsync(pointer, bytes, pool_, stream);
  }
  if (error == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat(
        name(), ": cannot allocate ", bytes, " bytes of device memory (",
        allocated_bytes_.load(std::memory_order_relaxed), " of ", total_bytes_,
        " bytes held by lossd)"));
  }
  return Check(error, "cudaMallocAsync");
}

absl::StatusOr<void*> CudaDevice::Allocate(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("allocation of 0 bytes");
  RETURN_IF_ERROR(Check(cudaSetDevice(options_.ordinal), "select device"));
  ASSIGN_OR_RETURN(const PooledStream stream, TakeStream());
  void* buffer = nullptr;
  absl::Status status = AllocateOn(&buffer, bytes, stream.get());
  // Synchronized so that the buffer may be used on any stream from now on.
  if (status.ok()) {
    status =
        Check(cudaStreamSynchronize(stream.get()), "allocation synchronize");
  }
  if (!status.ok()) return status;
  allocated_bytes_.fetch_add(static_cast<int64_t>(bytes),
                             std::memory_order_relaxed);
  return buffer;
}

void CudaDevice::Free(void* buffer, size_t bytes) {
  if (buffer == nullptr) return;
  cudaSetDevice(options_.ordinal);
  // A cancelled upload may still be copying into the buffer; what it has
  // gathered in staging is not wanted any more.
  EndUpload(buffer, false).IgnoreError();
  absl::StatusOr<cudaStream_t> stream = AcquireStream();
  if (stream.ok()) {
    // Every other use of the buffer has completed (all methods but uploads
    // synchronize), so the free needs no cross-stream ordering.
    Check(cudaFreeAsync(buffer, *stream), "cudaFreeAsync").IgnoreError();
    ReleaseStream(*stream);
  } else {
    Check(cudaFree(buffer), "cudaFree").IgnoreError();
  }
  allocated_bytes_.fetch_sub(static_cast<int64_t>(bytes),
                             std::memory_order_relaxed);
}

absl::Status CudaDevice::CopyFromHost(void* buffer, size_t offset,
                                      const void* host, size_t bytes) {
  RETURN_IF_ERROR(CopyFromHostAsync(buffer, offset, host, bytes));
  return FinishWrites(buffer);
}

absl::StatusOr<CudaDevice::Upload*> CudaDevice::FindOrStartUpload(
    void* buffer) {
  {
    absl::MutexLock lock(&mu_);
    auto it = uploads_.find(buffer);
    if (it != uploads_.end()) return it->second.get();
  }
  // Only this thread uploads into `buffer`: no one else can insert it.
  auto fresh = std::make_unique<Upload>();
  ASSIGN_OR_RETURN(fresh->stream, AcquireStream());
  for (Staging& staging : fresh->staging) {
    absl::StatusOr<Staging> acquired = AcquireStaging();
    if (!acquired.ok()) {
      ReleaseStream(fresh->stream);
      for (Staging& held : fresh->staging) {
        if (held.host != nullptr) ReleaseStaging(held);
      }
      return acquired.status();
    }
    staging = *acquired;
  }
  Upload* const upload = fresh.get();
  absl::MutexLock lock(&mu_);
  uploads_[buffer] = std::move(fresh);
  return upload;
}

absl::Status CudaDevice::CopyFromHostAsync(void* buffer, size_t offset,
                                           const void* host, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Check(cudaSetDevice(options_.ordinal), "select device"));
  ASSIGN_OR_RETURN(Upload* const upload, FindOrStartUpload(buffer));
  if (!upload->error.ok()) return upload->error;
  const char* from = static_cast<const char*>(host);
  char* to = static_cast<char*>(buffer) + offset;
  if (upload->filled > 0 && upload->filled_to + upload->filled != to) {
    // Not a continuation: what is gathered goes on its own.
    RETURN_IF_ERROR(FlushUpload(upload));
  }
  while (bytes > 0) {
    Staging& staging = upload->staging[upload->next];
    if (upload->filled == 0) {
      // Waits for the copy of two buffers ago; the previous one keeps
      // running while this one fills.
      const absl::Status status =
          Check(cudaEventSynchronize(staging.done), "upload wait");
      if (!status.ok()) {
        upload->error = status;
        return status;
      }
      upload->filled_to = to;
    }
    const size_t piece =
        std::min(bytes, options_.staging_bytes - upload->filled);
    StreamCopy(static_cast<char*>(staging.host) + upload->filled, from, piece);
    upload->filled += piece;
    from += piece;
    to += piece;
    bytes -= piece;
    if (upload->filled == options_.staging_bytes) {
      RETURN_IF_ERROR(FlushUpload(upload));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Device::HostWindow> CudaDevice::BeginHostWrite(
    void* buffer, size_t offset, size_t max_bytes) {
  if (max_bytes == 0) {
    return absl::InvalidArgumentError("an empty host window");
  }
  RETURN_IF_ERROR(Check(cudaSetDevice(options_.ordinal), "select device"));
  ASSIGN_OR_RETURN(Upload* const upload, FindOrStartUpload(buffer));
  if (!upload->error.ok()) return upload->error;
  // What CopyFromHostAsync gathered goes on its own.
  RETURN_IF_ERROR(FlushUpload(upload));
  Staging& staging = upload->staging[upload->next];
  // The copy of two windows ago; the previous one keeps running.
  const absl::Status status =
      Check(cudaEventSynchronize(staging.done), "upload wait");
  if (!status.ok()) {
    upload->error = status;
    return status;
  }
  upload->filled_to = static_cast<char*>(buffer) + offset;
  return HostWindow{staging.host, std::min(max_bytes, options_.staging_bytes)};
}

absl::Status CudaDevice::CommitHostWrite(void* buffer, size_t bytes) {
  Upload* upload = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = uploads_.find(buffer);
    if (it != uploads_.end()) upload = it->second.get();
  }
  if (upload == nullptr || upload->filled_to == nullptr) {
    return absl::FailedPreconditionError("no host window is open");
  }
  if (bytes > options_.staging_bytes) {
    return absl::InvalidArgumentError("more bytes than the host window");
  }
  if (bytes == 0) {
    upload->filled_to = nullptr;
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(Check(cudaSetDevice(options_.ordinal), "select device"));
  upload->filled = bytes;
  return FlushUpload(upload);
}

absl::Status CudaDevice::FlushUpload(Upload* upload) {
  if (upload->filled == 0) return absl::OkStatus();
  Staging& staging = upload->staging[upload->next];
#if defined(__SSE2__)
  _mm_sfence();  // StreamCopy's stores are visible before the DMA reads them
#endif
  absl::Status status =
      Check(cudaMemcpyAsync(upload->filled_to, staging.host, upload->filled,
                            cudaMemcpyHostToDevice, upload->stream),
            "upload copy");
  if (status.ok()) {
    status =
        Check(cudaEventRecord(staging.done, upload->stream), "upload record");
  }
  upload->filled = 0;
  upload->filled_to = nullptr;
  upload->next ^= 1;
  if (!status.ok()) upload->error = status;
  return status;
}

absl::Status CudaDevice::EndUpload(void* buffer, bool flush) {
  std::unique_ptr<Upload> upload;
  {
    absl::MutexLock lock(&mu_);
    auto it = uploads_.find(buffer);
    if (it == uploads_.end()) return absl::OkStatus();
    upload = std::move(it->second);
    uploads_.erase(it);
  }
  if (flush && upload->error.ok()) FlushUpload(upload.get()).IgnoreError();
  absl::Status status = upload->error;
  const absl::Status synced =
      Check(cudaStreamSynchronize(upload->stream), "upload synchronize");
  if (status.ok()) status = synced;
  ReleaseStream(upload->stream);
  for (const Staging& staging : upload->staging) ReleaseStaging(staging);
  return status;
}

absl::Status CudaDevice::FinishWrites(void* buffer) {
  RETURN_IF_ERROR(Check(cudaSetDevice(options_.ordinal), "select device"));
  return EndUpload(buffer, true);
}

absl::Status CudaDevice::CopyToHost(void* host, const void* device,
                                    size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return absl::OkStatus();
  Staging staging[2];
  for (Staging& one : staging) {
    absl::StatusOr<Staging> acquired = AcquireStaging();
    if (!acquired.ok()) {
      for (Staging& held : staging) {
        if (held.host != nullptr) ReleaseStaging(held);
      }
      return acquired.status();
    }
    one = *acquired;
  }
  const size_t piece_bytes = options_.staging_bytes;
  const size_t pieces = (bytes + piece_bytes - 1) / piece_bytes;
  auto length = [&](size_t piece) {
    return std::min(piece_bytes, bytes - piece * piece_bytes);
  };
  auto enqueue = [&](size_t piece) {
    Staging& into = staging[piece % 2];
    absl::Status status = Check(
        cudaMemcpyAsync(into.host,
                        static_cast<const char*>(device) + piece * piece_bytes,
                        length(piece), cudaMemcpyDeviceToHost, stream),
        "download copy");
    if (!status.ok()) return status;
    return Check(cudaEventRecord(into.done, stream), "download record");
  };
  // Two pieces in flight: the device copies piece k + 1 while the host
  // copies piece k out of pinned memory.
  absl::Status status = enqueue(0);
  for (size_t piece = 0; status.ok() && piece < pieces; ++piece) {
    if (piece + 1 < pieces) status = enqueue(piece + 1);
    if (!status.ok()) break;
    Staging& from = staging[piece % 2];
    status = Check(cudaEventSynchronize(from.done), "download wait");
    if (!status.ok()) break;
    std::memcpy(static_cast<char*>(host) + piece * piece_bytes, from.host,
                length(piece));
  }
  if (!status.ok()) {
    // Nothing may still write the staging buffers when they are reused.
    cudaStreamSynchronize(stream);
  }
  for (const Staging& one : staging) ReleaseStaging(one);
  return status;
}

absl::StatusOr<float*> CudaDevice::StageRowScale(const float* host_row_scale,
                                                 int64_t rows,
                                                 cudaStream_t stream) {
  void* device = nullptr;
  const size_t bytes = static_cast<size_t>(rows) * sizeof(float);
  RETURN_IF_ERROR(AllocateOn(&device, bytes, stream));
  // From pageable memory: the call returns once the bytes are staged by the
  // driver, so the host array may go away afterwards.
  absl::Status status = Check(cudaMemcpyAsync(device, host_row_scale, bytes,
                                              cudaMemcpyHostToDevice, stream),
                              "row scale copy");
  if (!status.ok()) {
    cudaFreeAsync(device, stream);
    return status;
  }
  return static_cast<float*>(device);
}

absl::Status CudaDevice::ReadConverted(const void* buffer, DType src_dtype,
                                       int64_t first, int64_t count,
                                       int64_t row_length, float scale,
                                       const float* host_row_scale,
                                       void* host_dst, DType dst_dtype) {
  const bool floats = IsLogitsDType(src_dtype) && IsLogitsDType(dst_dtype);
  if (DTypeSize(src_dtype) == 0 || DTypeSize(dst_dtype) == 0 ||
      (!floats && (src_dtype != dst_dtype || scale != 1.0f ||
                   host_row_scale != nullptr))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ReadConverted: cannot convert dtype ", static_cast<int>(src_dtype),
        " to ", static_cast<int>(dst_dtype), " with scale ", scale));
  }
  if (first < 0 || count < 0 || (host_row_scale != nullptr && row_length < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ReadConverted: bad range first=", first, " count=", count,
                     " row_length=", row_length));
  }
  if (count == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Check(cudaSetDevice(options_.ordinal), "select device"));
  const char* src = static_cast<const char*>(buffer) +
                    static_cast<size_t>(first) * DTypeSize(src_dtype);
  const size_t out_bytes = static_cast<size_t>(count) * DTypeSize(dst_dtype);
  ASSIGN_OR_RETURN(const PooledStream pooled, TakeStream());
  const cudaStream_t stream = pooled.get();
  if (src_dtype == dst_dtype && scale == 1.0f && host_row_scale == nullptr) {
    return CopyToHost(host_dst, src, out_bytes, stream);
  }
  StreamBlock row_scale_block(stream);
  StreamBlock scratch_block(stream);
  float* row_scale = nullptr;
  int64_t local_first = first;
  absl::Status status;
  if (host_row_scale != nullptr) {
    const int64_t first_row = first / row_length;
    const int64_t last_row = (first + count - 1) / row_length;
    // Only the rows this range touches travel; indices become relative.
    absl::StatusOr<float*> staged = StageRowScale(
        host_row_scale + first_row, last_row - first_row + 1, stream);
    status = staged.status();
    if (status.ok()) *row_scale_block.address() = row_scale = *staged;
    local_first = first - first_row * row_length;
  }
  if (status.ok()) {
    status = AllocateOn(scratch_block.address(), out_bytes, stream);
  }
  void* const scratch = scratch_block.get();
  if (status.ok()) {
    status = Check(
        ConvertScaleCudaLaunch(src, src_dtype, scratch, dst_dtype, local_first,
                               count, row_length, scale, row_scale, stream),
        "convert kernel");
  }
  if (status.ok()) status = CopyToHost(host_dst, scratch, out_bytes, stream);
  scratch_block.Free();
  row_scale_block.Free();
  const absl::Status synced =
      Check(cudaStreamSynchronize(stream), "download synchronize");
  return status.ok() ? synced : status;
}

absl::Status CudaDevice::ScaleInPlace(void* buffer, DType dtype, int64_t count,
                                      int64_t row_length, float scale,
                                      const float* host_row_scale) {
  if (!IsLogitsDType(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ScaleInPlace: dtype ", static_cast<int>(dtype),
                     " is not a floating-point dtype"));
  }
  if (count < 0 || (host_row_scale != nullptr && row_length < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ScaleInPlace: bad count ", count, " or row_length ", row_length));
  }
  if (count == 0 || (scale == 1.0f && host_row_scale == nullptr)) {
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(Check(cudaSetDevice(options_.ordinal), "select device"));
  ASSIGN_OR_RETURN(const PooledStream pooled, TakeStream());
  const cudaStream_t stream = pooled.get();
  StreamBlock row_scale_block(stream);
  float* row_scale = nullptr;
  absl::Status status;
  if (host_row_scale != nullptr) {
    absl::StatusOr<float*> staged = StageRowScale(
        host_row_scale, (count + row_length - 1) / row_length, stream);
    status = staged.status();
    if (status.ok()) *row_scale_block.address() = row_scale = *staged;
  }
  if (status.ok()) {
    status =
        Check(ConvertScaleCudaLaunch(buffer, dtype, buffer, dtype, 0, count,
                                     row_length, scale, row_scale, stream),
              "scale kernel");
  }
  row_scale_block.Free();
  const absl::Status synced =
      Check(cudaStreamSynchronize(stream), "scale synchronize");
  return status.ok() ? synced : status;
}

absl::Status CudaDevice::CrossEntropy(const CrossEntropyArgs& args,
                                      CrossEntropyResult* result) {
  if (result == nullptr) {
    return absl::InvalidArgumentError("cross_entropy: result is nullptr");
  }
  RETURN_IF_ERROR(ValidateCrossEntropyArgs(args));
  RETURN_IF_ERROR(Check(cudaSetDevice(options_.ordinal), "select device"));

  // One block: the kernel's scratch, then the per-token outputs requested
  // (args' are host pointers; the kernel writes device memory).
  const size_t rows = static_cast<size_t>(args.rows);
  const size_t scratch_bytes = AlignUp(CrossEntropyCudaScratchBytes(args.rows));
  const TokenOutputs outputs = LayOutTokenOutputs(args, rows, scratch_bytes);
  const size_t block_bytes = outputs.end;

  ASSIGN_OR_RETURN(const PooledStream pooled, TakeStream());
  const cudaStream_t stream = pooled.get();
  ASSIGN_OR_RETURN(const Staging staging, AcquireStaging());
  StreamBlock device_block(stream);
  absl::Status status = AllocateOn(device_block.address(), block_bytes, stream);
  char* const block = static_cast<char*>(device_block.get());
  CrossEntropyArgs device_args = args;
  if (status.ok()) {
    PointTokenOutputs(outputs, block, &device_args);
    // The kernels' one host wrapper; its INTERNAL errors are looked at again
    // below (Check of the final synchronize), where a sticky one is fatal.
    status = CrossEntropyCudaRun(
        device_args, block, scratch_bytes,
        static_cast<CrossEntropyCudaResult*>(staging.host), stream, result);
    if (!status.ok()) cudaGetLastError();
  }
  if (status.ok()) {
    status =
        CopyTokenOutputs(args, device_args, rows,
                         [&](void* host, const void* device, size_t bytes) {
                           return CopyToHost(host, device, bytes, stream);
                         });
  }
  device_block.Free();
  const absl::Status synced =
      Check(cudaStreamSynchronize(stream), "cross_entropy free");
  ReleaseStaging(staging);
  RETURN_IF_ERROR(synced);
  return status;
}

absl::Status CudaDevice::PostTraining(const PostTrainingArgs& args,
                                      PostTrainingResult* result) {
  RETURN_IF_ERROR(Check(cudaSetDevice(options_.ordinal), "select device"));
  ASSIGN_OR_RETURN(const PooledStream stream, TakeStream());
  absl::Status status = PostTrainingCuda(args, result, stream.get());
  if (status.code() == absl::StatusCode::kInternal) {
    // A sticky error is fatal for the device: Check reports it.
    const absl::Status synced =
        Check(cudaStreamSynchronize(stream.get()), "post_training");
    if (!synced.ok()) status = synced;
  }
  return status;
}

absl::Status CudaDevice::CopyWithin(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  RETURN_IF_ERROR(Check(cudaSetDevice(options_.ordinal), "select device"));
  ASSIGN_OR_RETURN(const PooledStream stream, TakeStream());
  const absl::Status status = Check(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream.get()),
      "device copy");
  const absl::Status synced =
      Check(cudaStreamSynchronize(stream.get()), "device copy synchronize");
  return status.ok() ? synced : status;
}

namespace {

// The kernel's configuration for `args`, as LinearCrossEntropy runs it.
LinearCrossEntropyCudaConfig LinearConfig(const LinearCrossEntropyArgs& args) {
  LinearCrossEntropyCudaConfig config;
  if (args.fast_products) config.precision = LinearPrecision::kFast;
  return config;
}

// The device block of LinearCrossEntropy's host arrays: token_grad_output
// first, then the per-token outputs.
TokenOutputs LinearTokenBlock(const LinearCrossEntropyArgs& args) {
  const size_t rows = static_cast<size_t>(std::max<int64_t>(args.rows, 0));
  return LayOutTokenOutputs(
      args, rows,
      args.token_grad_output != nullptr ? AlignUp(rows * sizeof(float)) : 0);
}

}  // namespace

int64_t CudaDevice::LinearCrossEntropyWorkspaceBytes(
    const LinearCrossEntropyArgs& args) const {
  const LinearCrossEntropyCudaConfig config = LinearConfig(args);
  return static_cast<int64_t>(
      PlanLinearCrossEntropyCuda(args, &config).workspace_bytes +
      LinearTokenBlock(args).end);
}

absl::Status CudaDevice::LinearCrossEntropy(const LinearCrossEntropyArgs& args,
                                            CrossEntropyResult* result) {
  if (result == nullptr) {
    return absl::InvalidArgumentError(
        "linear_cross_entropy: result is nullptr");
  }
  RETURN_IF_ERROR(Check(cudaSetDevice(options_.ordinal), "select device"));

  // One block for the host arrays the kernel reads or writes on the device.
  const size_t rows = static_cast<size_t>(std::max<int64_t>(args.rows, 0));
  const size_t grad_output_offset = 0;
  const TokenOutputs outputs = LinearTokenBlock(args);
  const size_t block_bytes = outputs.end;

  ASSIGN_OR_RETURN(const PooledStream pooled, TakeStream());
  const cudaStream_t stream = pooled.get();
  StreamBlock device_block(stream);
  absl::Status status;
  if (block_bytes > 0) {
    status = AllocateOn(device_block.address(), block_bytes, stream);
  }
  char* const block = static_cast<char*>(device_block.get());
  LinearCrossEntropyArgs device_args = args;
  if (status.ok() && args.token_grad_output != nullptr) {
    float* staged = reinterpret_cast<float*>(block + grad_output_offset);
    // From pageable memory: staged by the driver before the call returns.
    status = Check(
        cudaMemcpyAsync(staged, args.token_grad_output, rows * sizeof(float),
                        cudaMemcpyHostToDevice, stream),
        "token_grad_output copy");
    device_args.token_grad_output = staged;
  }
  if (status.ok()) {
    PointTokenOutputs(outputs, block, &device_args);
    // Its INTERNAL errors are looked at again below (Check of the final
    // synchronize), where a sticky one is fatal.
    const LinearCrossEntropyCudaConfig config = LinearConfig(device_args);
    status = LinearCrossEntropyCuda(device_args, result, stream, &config);
    if (!status.ok()) cudaGetLastError();
  }
  if (status.ok()) {
    status =
        CopyTokenOutputs(args, device_args, rows,
                         [&](void* host, const void* device, size_t bytes) {
                           return CopyToHost(host, device, bytes, stream);
                         });
  }
  device_block.Free();
  const absl::Status synced =
      Check(cudaStreamSynchronize(stream), "linear_cross_entropy free");
  RETURN_IF_ERROR(synced);
  return status;
}

absl::Status CudaDevice::LinearPostTraining(const LinearPostTrainingArgs& args,
                                            PostTrainingResult* result) {
  RETURN_IF_ERROR(Check(cudaSetDevice(options_.ordinal), "select device"));
  const size_t rows =
      static_cast<size_t>(std::max<int64_t>(args.linear.rows, 0));
  ASSIGN_OR_RETURN(const PooledStream pooled, TakeStream());
  const cudaStream_t stream = pooled.get();
  StreamBlock device_block(stream);
  absl::Status status;
  LinearPostTrainingArgs device_args = args;
  if (args.linear.token_grad_output != nullptr && rows > 0) {
    status = AllocateOn(device_block.address(), rows * sizeof(float), stream);
    if (status.ok()) {
      float* staged = static_cast<float*>(device_block.get());
      // From pageable memory: staged by the driver before the call returns.
      status = Check(
          cudaMemcpyAsync(staged, args.linear.token_grad_output,
                          rows * sizeof(float), cudaMemcpyHostToDevice, stream),
          "token_grad_output copy");
      device_args.linear.token_grad_output = staged;
    }
  }
  if (status.ok()) {
    // The per-token outputs stay host pointers: the kernel copies its rows
    // back and writes them there.
    const LinearCrossEntropyCudaConfig config = LinearConfig(args.linear);
    status = LinearPostTrainingCuda(device_args, result, stream, &config);
    if (!status.ok()) cudaGetLastError();
  }
  device_block.Free();
  RETURN_IF_ERROR(
      Check(cudaStreamSynchronize(stream), "linear_post_training free"));
  return status;
}

}  // namespace lossd
