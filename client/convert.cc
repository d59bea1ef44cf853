// The conversion loops of convert.h, written branch-free (selects instead of
// ifs) so that the compiler vectorizes them, and cloned for AVX2 where the CPU
// has it: one core then converts several GB/s instead of a few hundred MB/s.
#include "client/convert.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"

namespace lossd {
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LOSSD_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define LOSSD_VECTOR_CLONES
#endif

inline uint32_t Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float FromBits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// Round to nearest even; a NaN keeps its sign and top payload bits and gets
// the quiet bit, so that a payload only in the dropped bits stays a NaN.
inline uint16_t ToBF16(uint32_t bits) {
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet
                                                                  : rounded);
}

// All ones when `condition` holds, else zero: selects written as masks, since
// GCC turns nested ?: on these values into branches and stops vectorizing.
inline uint32_t Mask(bool condition) {
  return 0u - static_cast<uint32_t>(condition);
}

inline uint32_t Select(uint32_t mask, uint32_t if_set, uint32_t if_clear) {
  return (if_set & mask) | (if_clear & ~mask);
}

// IEEE half, round to nearest even, with subnormals; |x| >= 65520 gives inf;
// a NaN stays a quiet NaN with its sign and top payload bits.
inline uint16_t ToHalf(uint32_t bits) {
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  const uint32_t nan = 0x7e00u | ((magnitude >> 13) & 0x3ffu);
  // Below 2^-14 the half is subnormal: adding 0.5f makes the fp32 adder
  // round (to nearest even) at the half's last subnormal bit, 2^-24.
  const uint32_t subnormal = Bits(FromBits(magnitude) + 0.5f) - Bits(0.5f);
  const uint32_t normal = (magnitude + (static_cast<uint32_t>(15 - 127) << 23) +
                           0xfffu + ((magnitude >> 13) & 1u)) >>
                          13;
  uint32_t value = Select(Mask(magnitude < 0x38800000u), subnormal, normal);
  value = Select(Mask(magnitude >= 0x477ff000u), 0x7c00u, value);
  value = Select(Mask(magnitude > 0x7f800000u), nan, value);
  return static_cast<uint16_t>(sign | value);
}

// Exact: every half, subnormals included, is an fp32.
inline uint32_t FromHalf(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;
  const uint32_t special = 0x7f800000u | (mantissa << 13);
  const uint32_t subnormal =
      Bits(static_cast<float>(static_cast<int32_t>(mantissa)) * 0x1p-24f);
  const uint32_t normal = ((exponent + 112u) << 23) | (mantissa << 13);
  uint32_t value = Select(Mask(exponent == 0), subnormal, normal);
  value = Select(Mask(exponent == 0x1fu), special, value);
  return sign | value;
}

// The loops take byte pointers and memcpy each element: file data need not be
// aligned (a safetensors tensor may start at any offset).
LOSSD_VECTOR_CLONES
void FloatToBF16Loop(const uint8_t* __restrict src, uint8_t* __restrict dst,
                     std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + 4 * i, 4);
    const uint16_t out = ToBF16(bits);
    std::memcpy(dst + 2 * i, &out, 2);
  }
}

LOSSD_VECTOR_CLONES
void FloatToHalfLoop(const uint8_t* __restrict src, uint8_t* __restrict dst,
                     std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + 4 * i, 4);
    const uint16_t out = ToHalf(bits);
    std::memcpy(dst + 2 * i, &out, 2);
  }
}

LOSSD_VECTOR_CLONES
void BF16ToFloatLoop(const uint8_t* __restrict src, uint8_t* __restrict dst,
                     std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, 2);
    const uint32_t out = static_cast<uint32_t>(bits) << 16;
    std::memcpy(dst + 4 * i, &out, 4);
  }
}

LOSSD_VECTOR_CLONES
void HalfToFloatLoop(const uint8_t* __restrict src, uint8_t* __restrict dst,
                     std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, 2);
    const uint32_t out = FromHalf(bits);
    std::memcpy(dst + 4 * i, &out, 4);
  }
}

// Between the two 16-bit formats through fp32 (exact widening, one rounding).
absl::Status SixteenToSixteen(const uint8_t* src, DType from, uint8_t* dst,
                              DType to, std::size_t count) {
  constexpr std::size_t kBlock = 1024;
  uint8_t wide[4 * kBlock];
  for (std::size_t first = 0; first < count; first += kBlock) {
    const std::size_t n = std::min(kBlock, count - first);
    if (from == DType::kBFloat16) {
      BF16ToFloatLoop(src + 2 * first, wide, n);
    } else {
      HalfToFloatLoop(src + 2 * first, wide, n);
    }
    if (to == DType::kBFloat16) {
      FloatToBF16Loop(wide, dst + 2 * first, n);
    } else {
      FloatToHalfLoop(wide, dst + 2 * first, n);
    }
  }
  return absl::OkStatus();
}

bool IsFloat(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 ||
         dtype == DType::kFloat16;
}

}  // namespace

bool CanConvert(DType from, DType to) {
  if (from == to) return DTypeSize(from) > 0;
  if (IsFloat(from) && IsFloat(to)) return true;
  return from == DType::kInt64 && to == DType::kInt32;
}

absl::Status ConvertElements(const void* src_bytes, DType from, void* dst_bytes,
                             DType to, uint64_t count) {
  const uint8_t* src = static_cast<const uint8_t*>(src_bytes);
  uint8_t* dst = static_cast<uint8_t*>(dst_bytes);
  if (!CanConvert(from, to)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot convert ", DTypeName(from), " to ", DTypeName(to),
                     " (float32, bfloat16 and float16 convert to each "
                     "other; int64 to int32)"));
  }
  if (count == 0) return absl::OkStatus();
  if (from == to) {
    std::memcpy(dst, src, count * DTypeSize(from));
    return absl::OkStatus();
  }
  if (from == DType::kFloat32) {
    if (to == DType::kBFloat16) {
      FloatToBF16Loop(src, dst, count);
    } else {
      FloatToHalfLoop(src, dst, count);
    }
    return absl::OkStatus();
  }
  if (to == DType::kFloat32) {
    if (from == DType::kBFloat16) {
      BF16ToFloatLoop(src, dst, count);
    } else {
      HalfToFloatLoop(src, dst, count);
    }
    return absl::OkStatus();
  }
  if (IsFloat(from)) return SixteenToSixteen(src, from, dst, to, count);
  for (uint64_t i = 0; i < count; ++i) {
    int64_t value;
    std::memcpy(&value, src + 8 * i, 8);
    if (value < std::numeric_limits<int32_t>::min() ||
        value > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("element ", i, " = ", value, " does not fit int32"));
    }
    const int32_t narrow = static_cast<int32_t>(value);
    std::memcpy(dst + 4 * i, &narrow, 4);
  }
  return absl::OkStatus();
}

struct ConvertPool::Batch {
  const std::function<absl::Status(int64_t)>* task = nullptr;
  int64_t tasks = 0;
  int64_t next = 0;      // the next task to start
  int64_t finished = 0;  // tasks that have returned
  absl::Status status;   // the first error
  absl::CondVar all_finished;
};

ConvertPool::ConvertPool(int threads) {
  if (threads <= 0) {
    threads =
        std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    threads -= 1;
  }
  workers_.reserve(threads);
  for (int i = 0; i < threads; ++i) {
    workers_.emplace_back([this] { WorkerLoop(); });
  }
}

ConvertPool::~ConvertPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    work_ready_.SignalAll();
  }
  for (std::thread& worker : workers_) worker.join();
}

void ConvertPool::RunNext(Batch& batch) {
  const int64_t index = batch.next++;
  if (batch.next == batch.tasks) {
    // Fully started: no one needs to find it any more.
    batches_.erase(std::find_if(
        batches_.begin(), batches_.end(),
        [&](const std::shared_ptr<Batch>& b) { return b.get() == &batch; }));
  }
  mu_.Unlock();
  absl::Status status = (*batch.task)(index);
  mu_.Lock();
  if (!status.ok() && batch.status.ok()) batch.status = std::move(status);
  if (++batch.finished == batch.tasks) batch.all_finished.SignalAll();
}

void ConvertPool::WorkerLoop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    while (!stopping_ && batches_.empty()) work_ready_.Wait(&mu_);
    if (stopping_) return;
    // Keeps the batch alive while its task runs unlocked.
    std::shared_ptr<Batch> batch = batches_.front();
    RunNext(*batch);
  }
}

absl::Status ConvertPool::ParallelFor(
    int64_t tasks, const std::function<absl::Status(int64_t)>& task) {
  if (tasks <= 0) return absl::OkStatus();
  if (tasks == 1 || workers_.empty()) {
    absl::Status first;
    for (int64_t i = 0; i < tasks; ++i) {
      absl::Status status = task(i);
      if (!status.ok() && first.ok()) first = std::move(status);
    }
    return first;
  }
  auto batch = std::make_shared<Batch>();
  batch->task = &task;
  batch->tasks = tasks;
  absl::MutexLock lock(&mu_);
  batches_.push_back(batch);
  work_ready_.SignalAll();
  // The caller works on its own batch too, so a ParallelFor never waits on
  // workers busy with other callers' batches while it could make progress.
  while (batch->next < batch->tasks) RunNext(*batch);
  while (batch->finished < batch->tasks) batch->all_finished.Wait(&mu_);
  return batch->status;
}

absl::Status ConvertPool::Convert(const void* src, DType from, void* dst,
                                  DType to, uint64_t count) {
  if (!CanConvert(from, to)) return ConvertElements(src, from, dst, to, count);
  const uint64_t out_size = DTypeSize(to);
  const uint64_t min_slice = std::max<uint64_t>(1, kMinSliceBytes / out_size);
  const uint64_t max_tasks = static_cast<uint64_t>(workers()) + 1;
  const uint64_t tasks =
      std::max<uint64_t>(1, std::min(max_tasks, count / min_slice));
  // Slices of whole 64-element groups, so that each starts aligned as the
  // buffer does.
  const uint64_t per_task = (count / tasks + 63) / 64 * 64;
  const uint8_t* in = static_cast<const uint8_t*>(src);
  uint8_t* out = static_cast<uint8_t*>(dst);
  const uint64_t in_size = DTypeSize(from);
  return ParallelFor(static_cast<int64_t>(tasks), [&](int64_t t) {
    const uint64_t first = std::min(count, static_cast<uint64_t>(t) * per_task);
    const uint64_t n = t + 1 == static_cast<int64_t>(tasks)
                           ? count - first
                           : std::min(per_task, count - first);
    return ConvertElements(in + first * in_size, from, out + first * out_size,
                           to, n);
  });
}

}  // namespace lossd
