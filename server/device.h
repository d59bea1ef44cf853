// The memory + compute interface the server runs on. The tensor store and the
// service only see this class, so that the CPU device (cpu_device.h) and the
// CUDA device (cuda_device.h) are interchangeable behind --device.
#ifndef LOSSD_SERVER_DEVICE_H_
#define LOSSD_SERVER_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cross_entropy.h"
#include "kernels/linear_cross_entropy.h"
#include "kernels/linear_post_training.h"
#include "kernels/post_training.h"

namespace lossd {

// Bytes a device has allocated and could hold in total.
struct DeviceMemoryInfo {
  int64_t allocated_bytes = 0;  // live allocations made through Allocate
  int64_t total_bytes = 0;      // physical memory of the device
};

// One compute device. "Device pointers" below are pointers returned by
// Allocate (host pointers for the CPU device, GPU pointers for CUDA). Budgets
// are enforced by the caller (TensorStore); the device only reports what it
// has. Implementations are thread-safe: any method may be called from any
// thread concurrently, on distinct buffers.
class Device {
 public:
  virtual ~Device() = default;

  // "cpu", "cuda:0", ... as shown in TensorRecord.device.
  virtual std::string name() const = 0;

  // True when device pointers may be read and written by host code (the CPU
  // device): callers then skip staging copies of host data.
  virtual bool host_accessible() const = 0;

  virtual DeviceMemoryInfo memory() const = 0;

  // The memory budget the tensor store should use when none is configured, or
  // 0 to let the server pick (a fraction of memory().total_bytes).
  virtual int64_t DefaultBudgetBytes() const { return 0; }

  // Installs the function called (once, from whichever thread meets it) when
  // the device fails in a way that leaves it unusable, e.g. a sticky CUDA
  // error. The server turns readiness off and ends the process from there.
  // Devices that cannot fail like that ignore it. Call before serving.
  virtual void SetFatalErrorHandler(
      std::function<void(const absl::Status&)> /*handler*/) {}

  // Allocates `bytes` (> 0) bytes of device memory, aligned for any dtype.
  // RESOURCE_EXHAUSTED when the device has no room. The caller owns the buffer
  // and returns it with Free.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;

  // Returns a buffer from Allocate. `bytes` is the size it was allocated with.
  // nullptr is ignored.
  virtual void Free(void* buffer, size_t bytes) = 0;

  // Copies `bytes` bytes of host memory to `buffer + offset`. The caller keeps
  // the range inside the allocation. INTERNAL on a device failure.
  virtual absl::Status CopyFromHost(void* buffer, size_t offset,
                                    const void* host, size_t bytes) = 0;

  // As CopyFromHost, but the copy may still be in flight when it returns (the
  // host bytes may be reused at once): a streamed upload calls it per chunk so
  // that the device copy of one chunk overlaps the receipt of the next. The
  // bytes are only guaranteed in `buffer` after FinishWrites(buffer) returns
  // OK. Calls for one buffer come from one thread at a time. `buffer` may
  // also point inside an allocation: writers of disjoint ranges of one
  // allocation (the stripes of a striped upload) each pass their range's
  // start, from their own threads, and each calls FinishWrites with it before
  // the allocation is freed.
  virtual absl::Status CopyFromHostAsync(void* buffer, size_t offset,
                                         const void* host, size_t bytes) {
    return CopyFromHost(buffer, offset, host, bytes);
  }

  // Host memory the caller fills itself (from a socket, say) for the write
  // pipeline of CopyFromHostAsync into `buffer`, which saves the copy into
  // staging: BeginHostWrite lends a host window of `bytes` (1 to
  // `max_bytes`) for `buffer + offset`, and CommitHostWrite(buffer, n) hands
  // its first n bytes to the device (as CopyFromHostAsync would; n may be 0).
  // One window per buffer at a time, from one thread; FinishWrites as above.
  // On a host-accessible device the window is the destination itself.
  struct HostWindow {
    void* host = nullptr;
    size_t bytes = 0;
  };
  virtual absl::StatusOr<HostWindow> BeginHostWrite(void* buffer, size_t offset,
                                                    size_t max_bytes) {
    if (!host_accessible()) {
      return absl::UnimplementedError("this device has no host windows");
    }
    return HostWindow{static_cast<char*>(buffer) + offset, max_bytes};
  }
  virtual absl::Status CommitHostWrite(void* /*buffer*/, size_t /*bytes*/) {
    return absl::OkStatus();
  }

  // Waits for every CopyFromHostAsync into `buffer`. OK when there were none;
  // otherwise the first copy error. Free(buffer) waits by itself.
  virtual absl::Status FinishWrites(void* /*buffer*/) {
    return absl::OkStatus();
  }

  // Reads `count` elements starting at flat element `first` of a
  // [rows, row_length] tensor at `buffer` (src_dtype) into host memory
  // `host_dst` (dst_dtype), multiplying floating-point values by `scale` and,
  // when `host_row_scale` (a host array of [rows] factors) is not null, by
  // host_row_scale[element / row_length]. INVALID_ARGUMENT for a conversion
  // between integer and floating-point dtypes or a scaled integer tensor.
  virtual absl::Status ReadConverted(const void* buffer, DType src_dtype,
                                     int64_t first, int64_t count,
                                     int64_t row_length, float scale,
                                     const float* host_row_scale,
                                     void* host_dst, DType dst_dtype) = 0;

  // Multiplies `count` floating-point elements of `buffer` (a [rows,
  // row_length] tensor of `dtype`) in place by `scale` and, when not null, by
  // host_row_scale[element / row_length], with one rounding per element.
  virtual absl::Status ScaleInPlace(void* buffer, DType dtype, int64_t count,
                                    int64_t row_length, float scale,
                                    const float* host_row_scale) = 0;

  // Runs the cross-entropy contract of kernels/cross_entropy.h. logits,
  // targets, class_weights and gradient are device pointers; the per-token
  // outputs (token_loss, token_lse, token_argmax) are HOST pointers (the device
  // stages them when it must). INVALID_ARGUMENT for bad options or a target
  // out of range, in which case no buffer is changed; INTERNAL for a device
  // failure. Blocks until the result is ready.
  virtual absl::Status CrossEntropy(const CrossEntropyArgs& args,
                                    CrossEntropyResult* result) = 0;

  // Runs the post-training losses of kernels/post_training.h (distillation,
  // policy losses, segments). Tensor inputs (logits, targets, teacher, top-k,
  // advantages, logprobs, segment ids) and the gradient are device pointers;
  // the per-token outputs are HOST pointers. The caller has run
  // CheckPostTrainingData on host copies of the small inputs. INVALID_ARGUMENT
  // for bad arguments (no buffer changed); INTERNAL for a device failure.
  // Blocks until the result is ready. UNIMPLEMENTED on a device without it.
  virtual absl::Status PostTraining(const PostTrainingArgs& /*args*/,
                                    PostTrainingResult* /*result*/) {
    return absl::UnimplementedError(
        "this device has no post-training losses yet");
  }
  // Whether this device runs PostTraining and LinearPostTraining (not their
  // UNIMPLEMENTED defaults): ServerInfo.features lists "post_training" only
  // then, so that clients refuse such calls before sending them.
  virtual bool serves_post_training() const { return false; }

  // Copies `bytes` bytes from `src` to `dst`, both inside allocations of this
  // device and not overlapping. Blocks until the copy is done. INTERNAL on a
  // device failure.
  virtual absl::Status CopyWithin(void* dst, const void* src, size_t bytes) = 0;

  // The device memory LinearCrossEntropy(args) allocates for itself beyond
  // its inputs and outputs (its workspace), for the caller to charge to the
  // memory budget before the call. Pure; 0 for a device without it.
  virtual int64_t LinearCrossEntropyWorkspaceBytes(
      const LinearCrossEntropyArgs& /*args*/) const {
    return 0;
  }

  // Runs the linear cross-entropy contract of kernels/linear_cross_entropy.h
  // (LinearForward). x, weight, bias, targets, class_weights, dx, grad_weight
  // and grad_bias are device pointers; token_grad_output and the per-token
  // outputs are HOST pointers (staged by the device when it must).
  // INVALID_ARGUMENT for bad arguments or a target out of range (then no
  // buffer is changed); RESOURCE_EXHAUSTED when its working memory does not
  // fit; CANCELLED when args.cancelled said so between chunks (the outputs
  // then partly written); INTERNAL for a device failure. Blocks until the
  // result is ready. UNIMPLEMENTED on a device without it.
  virtual absl::Status LinearCrossEntropy(
      const LinearCrossEntropyArgs& /*args*/, CrossEntropyResult* /*result*/) {
    return absl::UnimplementedError("this device has no linear cross-entropy");
  }

  // LinearForward with a post-training loss (kernels/linear_post_training.h):
  // pointers as for LinearCrossEntropy, the small inputs checked already
  // (CheckPostTrainingData on host copies). Its working memory is
  // LinearCrossEntropyWorkspaceBytes(args.linear). UNIMPLEMENTED by default.
  virtual absl::Status LinearPostTraining(
      const LinearPostTrainingArgs& /*args*/, PostTrainingResult* /*result*/) {
    return absl::UnimplementedError(
        "this device has no linear post-training losses");
  }
};

}  // namespace lossd

#endif  // LOSSD_SERVER_DEVICE_H_
