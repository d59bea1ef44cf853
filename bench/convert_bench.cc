// Throughput of lossctl's host-side work, which sits on the path of every
// file upload and download: dtype conversion on one core and over the pool,
// reading a mapped file, and writing an output file with pwrite or through a
// mapping. Run on the machine whose figures matter (tmpfs paths for /dev/shm).
//
//   build/bench/convert_bench [--mib=1024] [--dir=/dev/shm] [--downloads_only]
//                             [--download_ways=pwrite,fault,ahead,slice,fallocate]
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "client/convert.h"

ABSL_FLAG(int, mib, 1024, "MiB of fp32 input per measurement");
ABSL_FLAG(std::string, dir, "/dev/shm", "where the file measurements write");
ABSL_FLAG(int, repeats, 3, "runs per measurement (the best is printed)");
ABSL_FLAG(std::string, download_ways, "pwrite,fault,ahead,slice,fallocate",
          "the download-file ways to measure: pwrite, and the mapped file's "
          "ways of giving its pages their storage (see Populate)");
ABSL_FLAG(bool, downloads_only, false,
          "only the download-file measurements (bf16 -> fp32 file)");

namespace lossd {
namespace {

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
      .count();
}

template <typename F>
double Best(const F& run) {
  double best = 1e30;
  for (int i = 0; i < absl::GetFlag(FLAGS_repeats); ++i) {
    const auto start = std::chrono::steady_clock::now();
    run();
    best = std::min(best, Seconds(start));
  }
  return best;
}

void Report(const char* what, double bytes_in, double bytes_out, double s) {
  std::printf("%-52s %7.3f s  in %6.2f GB/s  out %6.2f GB/s\n", what, s,
              bytes_in / s / 1e9, bytes_out / s / 1e9);
}

// Seconds of each phase of one download into a fresh mapped file.
struct MappedPhases {
  double create = 0, populate = 0, convert = 0, unmap = 0, unlink = 0;
  double Total() const { return create + populate + convert + unmap; }
};

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

// bf16 [count] at `b16` into a new fp32 file at `path` through a shared
// mapping, as lossctl's download writes it (slices of 256 KiB of output over
// `pool`); see the caller for the variants.
// How a mapped download's pages get their storage: faulted by the converting
// stores, populated (MADV_POPULATE_WRITE) over the pool ahead of the data, per
// slice just before its stores, or fallocated whole by one call first and
// then populated per slice.
enum class Populate { kFault, kAhead, kSlice, kFallocate };

MappedPhases MappedDownload(const std::string& path, const uint16_t* b16,
                            std::size_t count, Populate populate,
                            bool parallel_unmap, ConvertPool& pool) {
  const bool populate_slices =
      populate == Populate::kSlice || populate == Populate::kFallocate;
  MappedPhases phases;
  constexpr std::size_t kSlice = 64 << 10;  // elements per task
  constexpr std::size_t kChunk = 64 << 20;  // bytes per populate/unmap task
  const std::size_t bytes = count * 4;
  const auto chunks = static_cast<int64_t>((bytes + kChunk - 1) / kChunk);
  auto start = std::chrono::steady_clock::now();
  unlink(path.c_str());
  const int fd = open(path.c_str(), O_CREAT | O_TRUNC | O_RDWR, 0600);
  if (ftruncate(fd, bytes) != 0) std::perror("ftruncate");
  char* map = static_cast<char*>(
      mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  phases.create = Seconds(start);
  start = std::chrono::steady_clock::now();
  if (populate == Populate::kFallocate &&
      fallocate(fd, 0, 0, static_cast<off_t>(bytes)) != 0) {
    std::perror("fallocate");
  }
  close(fd);
  if (populate == Populate::kAhead) {
    (void)pool.ParallelFor(chunks, [&](int64_t c) {
      const std::size_t begin = c * kChunk;
      madvise(map + begin, std::min(kChunk, bytes - begin),
              MADV_POPULATE_WRITE);
      return absl::OkStatus();
    });
  }
  phases.populate = Seconds(start);
  start = std::chrono::steady_clock::now();
  const auto tasks = static_cast<int64_t>((count + kSlice - 1) / kSlice);
  (void)pool.ParallelFor(tasks, [&](int64_t t) {
    const std::size_t first = t * kSlice;
    const std::size_t n = std::min(kSlice, count - first);
    if (populate_slices) {
      madvise(map + first * 4, n * 4, MADV_POPULATE_WRITE);
    }
    return ConvertElements(b16 + first, DType::kBFloat16, map + first * 4,
                           DType::kFloat32, n);
  });
  phases.convert = Seconds(start);
  start = std::chrono::steady_clock::now();
  if (parallel_unmap) {
    (void)pool.ParallelFor(chunks, [&](int64_t c) {
      const std::size_t begin = c * kChunk;
      madvise(map + begin, std::min(kChunk, bytes - begin), MADV_DONTNEED);
      return absl::OkStatus();
    });
  }
  munmap(map, bytes);
  phases.unmap = Seconds(start);
  start = std::chrono::steady_clock::now();
  unlink(path.c_str());
  phases.unlink = Seconds(start);
  return phases;
}

int Main() {
  const std::size_t count = std::size_t{256} * 1024 * absl::GetFlag(FLAGS_mib);
  std::vector<float> f32(count);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (std::size_t i = 0; i < count; i += 4096) {
    const float v = normal(rng);
    for (std::size_t j = i; j < std::min(count, i + 4096); ++j) {
      f32[j] = v + static_cast<float>(j - i) * 1e-3f;
    }
  }
  std::vector<uint16_t> b16(count);
  std::vector<float> back(count);
  ConvertPool pool;
  std::printf("%zu fp32 elements (%.2f GB); pool of %d workers + caller\n",
              count, count * 4 / 1e9, pool.workers());
  const std::string path = absl::GetFlag(FLAGS_dir) + "/convert_bench.f32";
  if (absl::GetFlag(FLAGS_downloads_only)) {
    (void)pool.Convert(f32.data(), DType::kFloat32, b16.data(),
                       DType::kBFloat16, count);
  } else {
    for (auto [name, from, to] :
         {std::make_tuple("fp32->bf16", DType::kFloat32, DType::kBFloat16),
          std::make_tuple("fp32->fp16", DType::kFloat32, DType::kFloat16)}) {
      const void* src = f32.data();
      Report((std::string(name) + " one core").c_str(), count * 4.0,
             count * 2.0, Best([&] {
               (void)ConvertElements(src, from, b16.data(), to, count);
             }));
      Report(
          (std::string(name) + " pool").c_str(), count * 4.0, count * 2.0,
          Best([&] { (void)pool.Convert(src, from, b16.data(), to, count); }));
      const DType back_from = to;
      Report((std::string(name) + " back, one core").c_str(), count * 2.0,
             count * 4.0, Best([&] {
               (void)ConvertElements(b16.data(), back_from, back.data(),
                                     DType::kFloat32, count);
             }));
    }
    Report("memcpy fp32, one core", count * 4.0, count * 4.0,
           Best([&] { std::memcpy(back.data(), f32.data(), count * 4); }));

    // A file as lossctl upload reads it: freshly mapped each time.
    {
      const int fd = open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0600);
      if (fd < 0 ||
          write(fd, f32.data(), count * 4) != static_cast<ssize_t>(count * 4)) {
        std::perror(path.c_str());
        return 1;
      }
      close(fd);
    }
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
    Report("mapped file, MADV_POPULATE_READ per 16 MiB + convert", count * 4.0,
           count * 2.0, Best([&] {
             const int fd = open(path.c_str(), O_RDONLY);
             char* map = static_cast<char*>(
                 mmap(nullptr, count * 4, PROT_READ, MAP_PRIVATE, fd, 0));
             close(fd);
             constexpr std::size_t kPiece = 4 << 20;  // elements
             for (std::size_t first = 0; first < count; first += kPiece) {
               const std::size_t n = std::min(kPiece, count - first);
               madvise(map + first * 4, n * 4, MADV_POPULATE_READ);
               (void)ConvertElements(map + first * 4, DType::kFloat32,
                                     b16.data() + first, DType::kBFloat16, n);
             }
             munmap(map, count * 4);
           }));
    for (bool parallel : {false, true}) {
      Report(parallel ? "mapped file fp32->bf16, pool"
                      : "mapped file fp32->bf16, one core",
             count * 4.0, count * 2.0, Best([&] {
               const int fd = open(path.c_str(), O_RDONLY);
               void* map =
                   mmap(nullptr, count * 4, PROT_READ, MAP_PRIVATE, fd, 0);
               close(fd);
               if (parallel) {
                 (void)pool.Convert(map, DType::kFloat32, b16.data(),
                                    DType::kBFloat16, count);
               } else {
                 (void)ConvertElements(map, DType::kFloat32, b16.data(),
                                       DType::kBFloat16, count);
               }
               munmap(map, count * 4);
             }));
    }

    // The same through pread into a cache-sized buffer (no page-table faults,
    // one more copy).
    Report("pread file + fp32->bf16, one core", count * 4.0, count * 2.0,
           Best([&] {
             const int fd = open(path.c_str(), O_RDONLY);
             constexpr std::size_t kChunk = 64 << 10;  // elements
             std::vector<float> buffer(kChunk);
             for (std::size_t first = 0; first < count; first += kChunk) {
               const std::size_t n = std::min(kChunk, count - first);
               if (pread(fd, buffer.data(), n * 4, first * 4) < 0) break;
               (void)ConvertElements(buffer.data(), DType::kFloat32,
                                     b16.data() + first, DType::kBFloat16, n);
             }
             close(fd);
           }));
  }

  // Writing a download (bf16 -> fp32 file): convert into a small buffer and
  // pwrite, or convert straight into a shared mapping of the output file.
  const std::string out = absl::GetFlag(FLAGS_dir) + "/convert_bench.out";
  constexpr std::size_t kSlice = 256 << 10;  // elements per task
  const std::size_t tasks = (count + kSlice - 1) / kSlice;
  for (bool parallel : {false, true}) {
    if (!absl::StrContains(absl::GetFlag(FLAGS_download_ways), "pwrite")) {
      break;
    }
    Report(parallel ? "bf16 -> fp32 file, pwrite, pool"
                    : "bf16 -> fp32 file, pwrite, one core",
           count * 2.0, count * 4.0, Best([&] {
             unlink(out.c_str());
             const int fd =
                 open(out.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0600);
             auto task = [&](int64_t t) {
               thread_local std::vector<float> buffer(kSlice);
               const std::size_t first = t * kSlice;
               const std::size_t n = std::min(kSlice, count - first);
               (void)ConvertElements(b16.data() + first, DType::kBFloat16,
                                     buffer.data(), DType::kFloat32, n);
               if (pwrite(fd, buffer.data(), n * 4, first * 4) < 0) {
                 return absl::InternalError("pwrite");
               }
               return absl::OkStatus();
             };
             if (parallel) {
               (void)pool.ParallelFor(tasks, task);
             } else {
               for (std::size_t t = 0; t < tasks; ++t) (void)task(t);
             }
             close(fd);
           }));
  }
  // The same into a shared mapping of the output file, phase by phase, for
  // each way of giving the pages their storage (see Populate) and of
  // unmapping (one munmap, or the page-table entries dropped over the pool
  // first).
  const std::vector<std::pair<std::string, Populate>> ways = {
      {"fault", Populate::kFault},
      {"ahead", Populate::kAhead},
      {"slice", Populate::kSlice},
      {"fallocate", Populate::kFallocate}};
  for (const auto& [name, populate] : ways) {
    if (!absl::StrContains(absl::GetFlag(FLAGS_download_ways), name)) continue;
    for (bool parallel_unmap : {false, true}) {
      const char* how = populate == Populate::kFault   ? "faulted by stores"
                        : populate == Populate::kAhead ? "populated ahead"
                        : populate == Populate::kSlice
                            ? "populated per slice"
                            : "fallocated, per slice";
      MappedPhases best;
      for (int i = 0; i < absl::GetFlag(FLAGS_repeats); ++i) {
        const MappedPhases run = MappedDownload(out, b16.data(), count,
                                                populate, parallel_unmap, pool);
        if (i == 0 || run.Total() < best.Total()) best = run;
      }
      std::printf(
          "bf16 -> fp32 file, mapped, pool, %-21s %-8s %7.3f s  (create "
          "%.3f, populate %.3f, convert %.3f, unmap %.3f; unlink %.3f)  out "
          "%6.2f GB/s\n",
          how, parallel_unmap ? "unmap//" : "munmap", best.Total(), best.create,
          best.populate, best.convert, best.unmap, best.unlink,
          count * 4.0 / best.Total() / 1e9);
    }
  }
  unlink(out.c_str());
  unlink(path.c_str());
  return 0;
}

}  // namespace
}  // namespace lossd

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return lossd::Main();
}
