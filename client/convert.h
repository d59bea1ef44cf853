// Element conversion on the client (fp32 <-> bf16 / fp16, int64 -> int32):
// lossctl converts files to the dtype sent and downloads to the file's dtype
// at memory speed, so the loops are vectorized and a piece can be split over
// every core (ConvertPool). Bit-exact with common/float16.h.
#ifndef LOSSD_CLIENT_CONVERT_H_
#define LOSSD_CLIENT_CONVERT_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/dtype.h"

namespace lossd {

// Converts `count` elements of dtype `from` at `src` into dtype `to` at
// `dst` (a copy when the dtypes are equal). Floats round to nearest even
// (NaN stays NaN, overflow gives inf); int64 -> int32 is range-checked.
// INVALID_ARGUMENT: another pair of dtypes, or an int64 that does not fit
// int32 (dst then holds a partial result). src and dst must not overlap.
// Thread-safe (pure function).
absl::Status ConvertElements(const void* src, DType from, void* dst, DType to,
                             uint64_t count);

// True when ConvertElements takes this pair of dtypes.
bool CanConvert(DType from, DType to);

// A fixed set of worker threads that run the tasks of ParallelFor calls,
// from any number of calling threads at once (the 4 transfer threads of a
// data-connection upload each convert their own piece): one conversion per
// core is far below what 4 connections carry. Thread-safe. Not copyable.
class ConvertPool {
 public:
  // `threads` workers besides the callers; 0 = hardware_concurrency() - 1,
  // so that with the calling thread every core takes part.
  explicit ConvertPool(int threads = 0);
  // Waits for running tasks; no ParallelFor may be in progress.
  ~ConvertPool();
  ConvertPool(const ConvertPool&) = delete;
  ConvertPool& operator=(const ConvertPool&) = delete;

  int workers() const { return static_cast<int>(workers_.size()); }

  // Runs task(0) ... task(tasks - 1) on the workers and the calling thread
  // and returns when all have finished: OK, or the error of one that failed
  // (the others still run).
  absl::Status ParallelFor(int64_t tasks,
                           const std::function<absl::Status(int64_t)>& task);

  // ConvertElements of `count` elements split into slices of at least
  // kMinSliceBytes of output over the pool. Errors as ConvertElements.
  absl::Status Convert(const void* src, DType from, void* dst, DType to,
                       uint64_t count);

  // Smaller slices cost more in hand-offs than their parallelism gains.
  static constexpr std::size_t kMinSliceBytes = std::size_t{256} << 10;

 private:
  struct Batch;
  void WorkerLoop();
  // Starts the next task of `batch` (which has one left), unlocking mu_
  // while it runs.
  void RunNext(Batch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  absl::CondVar work_ready_;
  // Batches with tasks not yet started, oldest first.
  std::deque<std::shared_ptr<Batch>> batches_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace lossd

#endif  // LOSSD_CLIENT_CONVERT_H_
