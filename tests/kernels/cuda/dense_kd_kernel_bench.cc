// The dense-teacher pieces' kernel alone (cudaEvents around the launch, the
// statistics without the gradient, then the whole call), so that the call's
// host part and the kernel's two passes are measured apart. Disabled bench.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <utility>
#include <vector>

#include "common/float16.h"
#include "gtest/gtest.h"
#include "kernels/cuda/dense_kd_pieces.h"
#include "kernels/cuda/device_limits.h"
#include "kernels/cuda/dispatch.h"
#include "kernels/cuda/post_training_cuda_host.h"
#include "kernels/cuda/post_training_policy.h"

namespace lossd {
namespace {

// Device memory freed at the end of the scope.
class DeviceMemory {
 public:
  explicit DeviceMemory(size_t bytes) {
    EXPECT_EQ(cudaMalloc(&pointer_, std::max<size_t>(bytes, 1)), cudaSuccess);
  }
  ~DeviceMemory() { cudaFree(pointer_); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  void* get() const { return pointer_; }

 private:
  void* pointer_ = nullptr;
};

// bf16 rows [rows, vocab] of N(0, sigma): 64 random rows, doubled by device
// copies (a realistic spread of maxima and exponents at memcpy's speed).
void FillRows(void* device, int64_t rows, int64_t vocab, float sigma,
              uint32_t seed) {
  const int64_t first = std::min<int64_t>(rows, 64);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<uint16_t> host(static_cast<size_t>(first * vocab));
  for (uint16_t& h : host) h = FloatToBF16(normal(rng));
  ASSERT_EQ(
      cudaMemcpy(device, host.data(), host.size() * 2, cudaMemcpyHostToDevice),
      cudaSuccess);
  auto* bytes = static_cast<char*>(device);
  for (int64_t done = first; done < rows; done *= 2) {
    const int64_t n = std::min(done, rows - done);
    ASSERT_EQ(cudaMemcpy(bytes + done * vocab * 2, bytes,
                         static_cast<size_t>(n * vocab * 2),
                         cudaMemcpyDeviceToDevice),
              cudaSuccess);
  }
}

// Median of 5 after a warm-up, in seconds, of what `enqueue` puts on the
// default stream, by events (`reps` 1: the one call alone, for a profiler).
template <typename Enqueue>
double EventTime(Enqueue enqueue, int reps) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(start);
    enqueue();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms * 1e-3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin() + (reps > 1 ? 1 : 0), times.end());
  return times[(times.size() + (reps > 1 ? 1 : 0)) / 2];
}

// Dense KD (forward KL, reverse KL, JSD(0.5), forward KL at tau 2) bf16 in
// place at 8192 x 128256 and 16384 x 131072, student N(0, 2) and teacher
// N(0, 2.5): the kernel with its gradient, the kernel's statistics alone
// (forward only), and the whole synchronous call, against a device copy.
// LOSSD_BENCH_ONCE=1: one launch of each kernel with its gradient, at the
// first shape and nothing else (for a profiler). LOSSD_DKD_PIECE_KIB=n: pieces
// of n KiB (student and teacher together) instead of the policy's, for the
// kernel rows (the whole call keeps the policy's).
// Run with --gtest_also_run_disabled_tests --gtest_filter=*BenchDistillation*.
TEST(DenseKdKernelBench, DISABLED_BenchDistillationKernels) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    GTEST_SKIP() << "no CUDA GPU visible";
  }
  const bool once = std::getenv("LOSSD_BENCH_ONCE") != nullptr;
  const int reps = once ? 1 : 6;
  for (const auto& [rows, vocab] :
       {std::pair<int64_t, int64_t>{8192, 128256}, {16384, 131072}}) {
    const size_t bytes = static_cast<size_t>(rows * vocab) * 2;
    DeviceMemory student(bytes), teacher(bytes), copy(bytes);
    FillRows(student.get(), rows, vocab, 2.0f, 1);
    FillRows(teacher.get(), rows, vocab, 2.5f, 2);
    std::vector<int64_t> targets(rows);
    for (int64_t row = 0; row < rows; ++row) {
      targets[row] = (row * 7919) % vocab;
    }
    DeviceMemory d_targets(targets.size() * 8);
    cudaMemcpy(d_targets.get(), targets.data(), targets.size() * 8,
               cudaMemcpyHostToDevice);
    const std::vector<float> scale(rows, 1.0f / rows);
    DeviceMemory d_scale(scale.size() * 4);
    cudaMemcpy(d_scale.get(), scale.data(), scale.size() * 4,
               cudaMemcpyHostToDevice);
    DeviceMemory d_rows(rows * sizeof(PostTrainingCudaRow));
    const double copy_s = EventTime(
        [&] {
          cudaMemcpyAsync(copy.get(), student.get(), bytes,
                          cudaMemcpyDeviceToDevice);
        },
        reps);

    cuda_ce::DeviceLimits limits;
    ASSERT_EQ(cuda_ce::CurrentDeviceLimits(&limits), cudaSuccess);
    cuda_ce::PostTrainingShape shape;
    CrossEntropyArgs base;
    base.rows = rows;
    base.vocab = base.row_stride = vocab;
    base.logits_dtype = DType::kBFloat16;
    base.logits = base.gradient = student.get();
    base.mode = GradientMode::kInPlace;
    base.targets = d_targets.get();
    base.targets_dtype = DType::kInt64;
    shape.logits =
        cuda_ce::ShapeOf(cuda_ce::FillParams(base, nullptr), base.logits_dtype);
    shape.distillation = shape.dense_teacher = shape.targets = true;
    shape.teacher_element_bytes = 2;
    shape.teacher_whole_vectors = true;
    const auto choice = cuda_ce::ChoosePostTrainingSchedule(shape, limits);
    ASSERT_TRUE(choice.has_value());
    cuda_ce::ScheduleChoice chosen = *choice;
    if (const char* kib = std::getenv("LOSSD_DKD_PIECE_KIB")) {
      // (pieces of another size, student and teacher bytes together: a
      // sweep of the piece size without rebuilding)
      chosen.chunk = std::atoi(kib) * 1024 / 4 / 8 * 8;
      chosen.pieces =
          static_cast<int>((vocab + chosen.chunk - 1) / chosen.chunk);
    }
    DeviceMemory workspace(cuda_ce::DenseKdWorkspaceBytes(rows, chosen.pieces));

    std::printf(
        "bench: kernels bf16 %lld x %lld in place (%d pieces of %d): "
        "copy %.3f ms (events)\n",
        static_cast<long long>(rows), static_cast<long long>(vocab),
        chosen.pieces, chosen.chunk, copy_s * 1e3);
    const std::pair<Divergence, float> kinds[] = {
        {Divergence::kForwardKl, 1.0f},
        {Divergence::kReverseKl, 1.0f},
        {Divergence::kJsd, 1.0f},
        {Divergence::kForwardKl, 2.0f}};
    const char* names[] = {"FKL", "RKL", "JSD(0.5)", "FKL tau 2"};
    for (int i = 0; i < 4; ++i) {
      DistillationArgs kd;
      kd.divergence = kinds[i].first;
      kd.temperature = kinds[i].second;
      kd.teacher_logits = teacher.get();
      kd.teacher_dtype = DType::kBFloat16;
      kd.teacher_row_stride = vocab;
      cuda_ce::DenseKdPieces call;
      call.base = base;
      call.kd = kd;
      call.divergence = KernelDivergence(kd);
      call.chunk = chosen.chunk;
      call.pieces = chosen.pieces;
      call.row_scale = static_cast<const float*>(d_scale.get());
      call.rows_out = static_cast<PostTrainingCudaRow*>(d_rows.get());
      call.workspace = workspace.get();
      call.entropy = false;  // (as a call without a policy or token entropy)
      auto launch = [&] {
        EXPECT_EQ(cuda_ce::LaunchDenseKdPieces(call, nullptr), cudaSuccess);
      };
      const double kernel_s = EventTime(launch, reps);
      if (once) continue;
      call.gradient = false;
      const double stats_s = EventTime(launch, reps);
      PostTrainingArgs args;
      args.base = base;
      args.distillation = &kd;
      const double call_s = EventTime(
          [&] {
            PostTrainingResult result;
            EXPECT_TRUE(PostTrainingCuda(args, &result, nullptr).ok());
          },
          reps);
      // (a dense teacher's floor: 1.5 copies)
      std::printf(
          "bench:   dense %s: kernel %.3f ms (%.0f%% of its floor), "
          "statistics alone %.3f ms, whole call %.3f ms (%.0f%%)\n",
          names[i], kernel_s * 1e3, 150.0 * copy_s / kernel_s, stats_s * 1e3,
          call_s * 1e3, 150.0 * copy_s / call_s);
    }
    if (once) break;
  }
}

}  // namespace
}  // namespace lossd
