// Kernel benchmark of the fused CUDA cross-entropy (issue 3): measures the
// device-to-device copy bandwidth, then each configuration as a ratio to it,
// with the share of each measurement the board spent at its power limit.
// Usage: cross_entropy_bench [--sweep] [--profile] [--forward | --gradient]
//                            [--bf16] [--label_smoothing=EPS]
//                            [--option_sets] [--out=RESULTS.md]
// --sweep also runs every schedule that can take each configuration (the
// variants and knobs of the experiments are gone: bench/NOTES.md).
// --label_smoothing runs every configuration with that option.
// --option_sets runs every configuration with each option set users run:
// plain, label smoothing 0.1, softcap 30, class weights, z-loss 1e-4, and all
// four together.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bench/cuda_check.h"
#include "kernels/cuda/cross_entropy_cuda.h"

namespace {

// Logits [n] of random values in [-8, 8) from a hash of (seed, index).
template <typename T>
__global__ void FillRandom(T* out, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    const float u = static_cast<float>(x >> 40) * (1.0f / 16777216.0f);
    out[i] = T(u * 16.0f - 8.0f);
  }
}

// Read-only reference for forward-only: every 16-byte vector of `in` read
// once, xor-folded so that no load is dropped; one word written a thread.
__global__ void ReadAll(const uint4* in, size_t n, unsigned* out) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  unsigned acc = 0;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldg(in + i), b = __ldg(in + i + stride),
                c = __ldg(in + i + 2 * stride), d = __ldg(in + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
    acc ^= c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = __ldg(in + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// Fingerprint of `n` words (a position-weighted sum: the same bits give the
// same value), for sweeps to tell whether a variant's gradient has the
// default launch's bits.
__global__ void Fingerprint(const unsigned* in, size_t n,
                            unsigned long long* out) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  unsigned long long acc = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
       i < n; i += stride) {
    acc += static_cast<unsigned long long>(in[i]) * (2 * i + 1);
  }
  atomicAdd(out, acc);
}

// L2 reference: `reps` passes over `n` vectors that stay in L2, read with
// __ldcg (past L1, which would hold a block's share on the later passes).
__global__ void ReadL2(const uint4* in, size_t n, int reps, unsigned* out) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  unsigned acc = 0;
  for (int r = 0; r < reps; ++r) {
    size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
      const uint4 a = __ldcg(in + i), b = __ldcg(in + i + stride),
                  c = __ldcg(in + i + 2 * stride),
                  d = __ldcg(in + i + 3 * stride);
      acc += a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
      acc += c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

__global__ void FillTargets(int64_t* out, int64_t n, int64_t vocab,
                            uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t x = (i + 7) * 0xd1b54a32d192ed03ull ^ seed;
    x ^= x >> 29;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 32;
    out[i] = (i % 50 == 49) ? -100 : static_cast<int64_t>(x % vocab);
  }
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Config {
  int64_t rows, vocab;
  lossd::DType dtype;
  lossd::GradientMode mode;
};

struct OptionSet {
  const char* name;
  float label_smoothing;
  float softcap;
  bool weights;
  float z_loss_scale;
};

// Class weights [n] in [0.25, 2) from a hash of the index.
__global__ void FillWeights(float* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    uint64_t x = (i + 3) * 0x9e3779b97f4a7c15ull;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    out[i] = 0.25f + 1.75f * static_cast<float>(x >> 40) / 16777216.0f;
  }
}

// The driver's NVML (libnvidia-ml.so.1, opened at run time and kept open:
// the toolkit here has no nvml.h) for the board with PCI bus id `bus_id`: the
// time it spent held at its power limit.
class Nvml {
 public:
  explicit Nvml(const char* bus_id) {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (lib == nullptr) return;
    const auto init = reinterpret_cast<int (*)()>(dlsym(lib, "nvmlInit_v2"));
    const auto handle = reinterpret_cast<int (*)(const char*, void**)>(
        dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    violation_ = reinterpret_cast<int (*)(void*, int, unsigned long long*)>(
        dlsym(lib, "nvmlDeviceGetViolationStatus"));
    if (init == nullptr || handle == nullptr || violation_ == nullptr ||
        init() != 0 || handle(bus_id, &dev_) != 0) {
      dev_ = nullptr;
    }
  }
  bool ok() const { return dev_ != nullptr; }
  // Nanoseconds spent held at the power limit (NVML_PERF_POLICY_POWER).
  unsigned long long PowerCappedNs() const {
    unsigned long long v[2] = {0, 0};  // nvmlViolationTime_t
    violation_(dev_, 0, v);
    return v[1];
  }

 private:
  void* dev_ = nullptr;
  int (*violation_)(void*, int, unsigned long long*) = nullptr;
};

std::string CappedText(double pct) {
  if (pct < 0) return "n/a";
  char text[32];
  std::snprintf(text, sizeof(text), "%.0f%%", pct);
  return text;
}

const char* Name(lossd::DType d) {
  return d == lossd::DType::kFloat32 ? "fp32" : "bf16";
}

}  // namespace

int main(int argc, char** argv) {
  bool sweep = false;          // every schedule that takes the configuration
  bool profile = false;        // one small config, for ncu
  bool forward = false;        // forward-only configurations only
  bool gradient_only = false;  // forward+gradient configurations only
  bool bf16_only = false;      // bf16 configurations only
  float label_smoothing = 0.0f;
  bool option_sets = false;
  std::string out_path;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--sweep") == 0) sweep = true;
    if (std::strcmp(argv[i], "--gradient") == 0) gradient_only = true;
    if (std::strncmp(argv[i], "--out=", 6) == 0) out_path = argv[i] + 6;
    if (std::strcmp(argv[i], "--profile") == 0) profile = true;
    if (std::strcmp(argv[i], "--forward") == 0) forward = true;
    if (std::strcmp(argv[i], "--bf16") == 0) bf16_only = true;
    if (std::strcmp(argv[i], "--option_sets") == 0) option_sets = true;
    if (std::strncmp(argv[i], "--label_smoothing=", 18) == 0) {
      label_smoothing = std::strtof(argv[i] + 18, nullptr);
    }
  }
  const int kWarmup = 3;
  const int kRuns = profile ? 2 : 25;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cudaEvent_t t0, t1;
  CHECK_CUDA(cudaEventCreate(&t0));
  CHECK_CUDA(cudaEventCreate(&t1));

  // Copy bandwidth: 4 GiB D2D, bytes read + written.
  const size_t copy_bytes = profile ? size_t{1} << 28 : size_t{4} << 30;
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, copy_bytes));
  CHECK_CUDA(cudaMalloc(&b, copy_bytes));
  FillRandom<float>
      <<<4096, 256, 0, stream>>>(static_cast<float*>(a), copy_bytes / 4, 1);
  std::vector<float> times;
  // After each median_ms: the share of its wall time (warm-up included) the
  // board spent held at its power limit, in percent; -1 without NVML.
  char bus_id[32] = "";
  CHECK_CUDA(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), 0));
  const Nvml nvml(bus_id);
  double capped_pct = -1.0;
  // Median ms of kRuns timed calls of `enqueue` (CUDA events) after at least
  // kWarmup calls and, outside --profile, kWarmupMs of them (with three
  // warm-up calls alone, the first bf16 configuration, 8192 x 32000, read 3-5
  // points under the same launch measured later in the same process:
  // bench/NOTES.md, the row wait). `prepare` runs before each call, untimed.
  // -1 when `enqueue` fails (returns false).
  const double kWarmupMs = profile ? 0.0 : 100.0;
  const auto median_ms = [&](const auto& prepare,
                             const auto& enqueue) -> double {
    times.clear();
    const auto start = std::chrono::steady_clock::now();
    const unsigned long long capped0 = nvml.ok() ? nvml.PowerCappedNs() : 0;
    const auto warming = [&](int i) {
      return i < kWarmup || std::chrono::duration<double, std::milli>(
                                std::chrono::steady_clock::now() - start)
                                    .count() < kWarmupMs;
    };
    for (int i = 0, timed = 0; timed < kRuns; ++i) {
      const bool warm_up = warming(i);
      prepare();
      CHECK_CUDA(cudaEventRecord(t0, stream));
      const bool ok = enqueue();
      CHECK_CUDA(cudaEventRecord(t1, stream));
      if (!ok) return -1.0;
      CHECK_CUDA(cudaEventSynchronize(t1));
      float ms;
      CHECK_CUDA(cudaEventElapsedTime(&ms, t0, t1));
      if (!warm_up) {
        times.push_back(ms);
        ++timed;
      }
    }
    if (nvml.ok()) {
      const double ns = std::chrono::duration<double, std::nano>(
                            std::chrono::steady_clock::now() - start)
                            .count();
      capped_pct = 100.0 * (nvml.PowerCappedNs() - capped0) / ns;
    }
    return Median(times);
  };
  const auto nothing = [] {};
  const double copy_ms = median_ms(nothing, [&] {
    CHECK_CUDA(
        cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice, stream));
    return true;
  });
  const double copy_gbs = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;
  const double copy_capped_pct = capped_pct;
  // Read-only bandwidth, for the forward-only rows (reported, not the ratio's
  // denominator).
  const unsigned read_grid = 8 * prop.multiProcessorCount;
  const double read_ms = median_ms(nothing, [&] {
    ReadAll<<<read_grid, 256, 0, stream>>>(static_cast<const uint4*>(a),
                                           copy_bytes / 16,
                                           static_cast<unsigned*>(b));
    return true;
  });
  const double read_gbs = 1.0 * copy_bytes / (read_ms * 1e-3) / 1e9;
  // L2 read bandwidth: 16 MiB read 64 times (reported: the ceiling of
  // schedules that re-read rows from L2).
  constexpr size_t kL2Bytes = size_t{16} << 20;
  constexpr int kL2Reps = 64;
  const double l2_ms = median_ms(nothing, [&] {
    ReadL2<<<read_grid, 256, 0, stream>>>(static_cast<const uint4*>(a),
                                          kL2Bytes / 16, kL2Reps,
                                          static_cast<unsigned*>(b));
    return true;
  });
  const double l2_gbs = 1.0 * kL2Bytes * kL2Reps / (l2_ms * 1e-3) / 1e9;
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  std::printf(
      "device %s, %d SMs; D2D copy %.0f GB/s (read+write, median of %d, "
      "power-capped %s); read-only %.0f GB/s (%.1f%% of copy); L2-resident "
      "read %.0f GB/s\n",
      prop.name, prop.multiProcessorCount, copy_gbs, kRuns,
      CappedText(copy_capped_pct).c_str(), read_gbs,
      100.0 * read_gbs / copy_gbs, l2_gbs);

  using lossd::DType;
  using lossd::GradientMode;
  std::vector<Config> configs;
  for (DType d : {DType::kFloat32, DType::kBFloat16}) {
    if (bf16_only && d != DType::kBFloat16) continue;
    if (profile) {
      if (d == DType::kBFloat16) {
        configs.push_back({4096, 131072, d, GradientMode::kInPlace});
      }
      continue;
    }
    configs.push_back({8192, 32000, d, GradientMode::kInPlace});
    configs.push_back({8192, 128256, d, GradientMode::kInPlace});
    configs.push_back({4096, 262144, d, GradientMode::kInPlace});
    configs.push_back({16384, 131072, d, GradientMode::kInPlace});
    configs.push_back({16384, 131072, d, GradientMode::kNone});
    configs.push_back({8192, 128256, d, GradientMode::kNone});
    // GPT-2's vocabulary: rows of 50257 elements start off 16-byte
    // boundaries; 50304 (its padded size) is the aligned twin.
    configs.push_back({8192, 50257, d, GradientMode::kInPlace});
    configs.push_back({8192, 50304, d, GradientMode::kInPlace});
    configs.push_back({8192, 50257, d, GradientMode::kNone});
    configs.push_back({8192, 50304, d, GradientMode::kNone});
    if (sweep) {
      configs.push_back({16384, 131072, d, GradientMode::kOutOfPlace});
    }
  }
  if (forward || gradient_only) {
    configs.erase(std::remove_if(configs.begin(), configs.end(),
                                 [&](const Config& c) {
                                   return (c.mode == GradientMode::kNone) !=
                                          forward;
                                 }),
                  configs.end());
  }
  std::vector<OptionSet> sets = {{label_smoothing > 0 ? "smoothing" : "plain",
                                  label_smoothing, 0.0f, false, 0.0f}};
  if (option_sets) {
    sets = {{"plain", 0.0f, 0.0f, false, 0.0f},
            {"smoothing 0.1", 0.1f, 0.0f, false, 0.0f},
            {"softcap 30", 0.0f, 30.0f, false, 0.0f},
            {"class weights", 0.0f, 0.0f, true, 0.0f},
            {"z-loss 1e-4", 0.0f, 0.0f, false, 1e-4f},
            {"all four", 0.1f, 30.0f, true, 1e-4f}};
  }
  std::string table =
      "| N x V | dtype | mode | options | variant | ms (median) | GB/s | % of "
      "copy | power-capped |\n"
      "|---|---|---|---|---|---|---|---|---|\n";
  for (const Config& c : configs) {
    const size_t esize = lossd::DTypeSize(c.dtype);
    const size_t bytes = c.rows * c.vocab * esize;
    void *pristine, *work, *targets, *ws;
    lossd::CrossEntropyCudaResult* result;
    CHECK_CUDA(cudaMalloc(&pristine, bytes));
    CHECK_CUDA(cudaMalloc(&work, bytes));
    void* grad = nullptr;
    if (c.mode == GradientMode::kOutOfPlace) {
      CHECK_CUDA(cudaMalloc(&grad, bytes));
    }
    CHECK_CUDA(cudaMalloc(&targets, c.rows * 8));
    const size_t ws_bytes = lossd::CrossEntropyCudaWorkspaceBytes(c.rows);
    CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
    CHECK_CUDA(cudaMalloc(&result, sizeof(*result)));
    float* weights = nullptr;
    CHECK_CUDA(cudaMalloc(&weights, c.vocab * sizeof(float)));
    FillWeights<<<64, 256, 0, stream>>>(weights, c.vocab);
    if (c.dtype == DType::kFloat32) {
      FillRandom<float><<<4096, 256, 0, stream>>>(static_cast<float*>(pristine),
                                                  c.rows * c.vocab, 42);
    } else {
      FillRandom<__nv_bfloat16><<<4096, 256, 0, stream>>>(
          static_cast<__nv_bfloat16*>(pristine), c.rows * c.vocab, 42);
    }
    FillTargets<<<64, 256, 0, stream>>>(static_cast<int64_t*>(targets), c.rows,
                                        c.vocab, 7);
    CHECK_CUDA(cudaGetLastError());
    lossd::CrossEntropyArgs args;
    args.rows = c.rows;
    args.vocab = c.vocab;
    args.row_stride = c.vocab;
    args.logits_dtype = c.dtype;
    args.logits = work;
    args.targets = targets;
    args.targets_dtype = DType::kInt64;
    args.mode = c.mode;
    args.gradient = c.mode == GradientMode::kInPlace ? work : grad;
    // (name, config): auto first, then with --sweep every schedule by name
    // (those that cannot take the configuration say so).
    std::vector<std::pair<std::string, lossd::CrossEntropyCudaConfig>>
        variants = {{"auto", {}}};
    if (sweep) {
      using S = lossd::CrossEntropyCudaSchedule;
      for (const auto& [schedule, name] :
           std::vector<std::pair<S, const char*>>{
               {S::kSmemRowPieces, "smem row pieces"},
               {S::kL2RowPieces, "L2 row pieces"},
               {S::kClusterSliceRows, "cluster slice rows"},
               {S::kClusterStreamRows, "cluster stream rows"},
               {S::kSplitRowForward, "split row forward"},
               {S::kClusterRegisterRows, "cluster register rows"},
               {S::kGenericRows, "generic rows"}}) {
        lossd::CrossEntropyCudaConfig named;
        named.schedule = schedule;
        variants.push_back({name, named});
      }
      // The default launch once more, last: drift within the process (the
      // board warming up to its power limit) shows as a gap to the first.
      variants.push_back({"auto again", {}});
    }
    for (const OptionSet& set : sets) {
      args.options.label_smoothing = set.label_smoothing;
      args.options.softcap = set.softcap;
      args.options.z_loss_scale = set.z_loss_scale;
      args.class_weights = set.weights ? weights : nullptr;
      for (const auto& variant : variants) {
        // (named references, not structured bindings: the lambdas below
        // capture them)
        const std::string& vname_str = variant.first;
        const lossd::CrossEntropyCudaConfig& cfg = variant.second;
        const bool is_auto = vname_str == "auto";
        // A fresh copy of the logits before every run, not timed.
        const double ms = median_ms(
            [&] {
              CHECK_CUDA(cudaMemcpyAsync(work, pristine, bytes,
                                         cudaMemcpyDeviceToDevice, stream));
            },
            [&] {
              if (lossd::CrossEntropyCudaLaunch(args, result, ws, ws_bytes,
                                                stream, &cfg) == cudaSuccess) {
                return true;
              }
              cudaGetLastError();
              return false;
            });
        const bool ok = ms >= 0;
        const char* vname = vname_str.c_str();
        if (!ok) {
          std::printf("%6lld x %-6lld %s %-8s %s %-8s  (not launchable)\n",
                      (long long)c.rows, (long long)c.vocab, Name(c.dtype),
                      c.mode == GradientMode::kNone ? "fwd" : "fwd+grad",
                      set.name, vname);
          continue;
        }
        lossd::CrossEntropyCudaResult host;
        CHECK_CUDA(
            cudaMemcpy(&host, result, sizeof(host), cudaMemcpyDeviceToHost));
        const double moved = static_cast<double>(bytes) *
                             (c.mode == GradientMode::kNone ? 1 : 2);
        const double gbs = moved / (ms * 1e-3) / 1e9;
        char line[256];
        std::snprintf(
            line, sizeof(line),
            "| %lld x %lld | %s | %s | %s | %s | %.3f | %.0f | %.1f%% "
            "| %s |\n",
            (long long)c.rows, (long long)c.vocab, Name(c.dtype),
            c.mode == GradientMode::kNone      ? "forward"
            : c.mode == GradientMode::kInPlace ? "fwd+grad"
                                               : "fwd+grad (out)",
            set.name, vname, ms, gbs, 100.0 * gbs / copy_gbs,
            CappedText(capped_pct).c_str());
        std::printf("%s", line);
        if (is_auto) table += line;
        if (variants.size() > 1 && c.mode != GradientMode::kNone) {
          unsigned long long* fp = nullptr;
          CHECK_CUDA(cudaMalloc(&fp, sizeof(*fp)));
          CHECK_CUDA(cudaMemsetAsync(fp, 0, sizeof(*fp), stream));
          Fingerprint<<<1024, 256, 0, stream>>>(
              static_cast<const unsigned*>(args.gradient), bytes / 4, fp);
          unsigned long long h = 0;
          CHECK_CUDA(cudaMemcpy(&h, fp, sizeof(h), cudaMemcpyDeviceToHost));
          CHECK_CUDA(cudaFree(fp));
          std::printf("  gradient bits %016llx, loss %.9g\n", h, host.loss);
        }
        if (host.error != 0 || host.valid_tokens <= 0 || !(host.loss > 0) ||
            host.nonfinite_rows != 0) {
          std::printf(
              "  result looks wrong: error %d loss %g valid %lld nonfinite "
              "%lld\n",
              host.error, host.loss, host.valid_tokens, host.nonfinite_rows);
        }
      }
    }
    CHECK_CUDA(cudaFree(pristine));
    CHECK_CUDA(cudaFree(work));
    CHECK_CUDA(cudaFree(grad));
    CHECK_CUDA(cudaFree(targets));
    CHECK_CUDA(cudaFree(ws));
    CHECK_CUDA(cudaFree(result));
    CHECK_CUDA(cudaFree(weights));
  }
  std::printf("\n%s", table.c_str());
  if (!out_path.empty()) {
    FILE* f = std::fopen(out_path.c_str(), "w");
    if (f == nullptr) return 1;
    char date[64];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
    std::fprintf(
        f,
        "# Cross-entropy kernel benchmark\n\n"
        "Written by `cross_entropy_bench --out=...` (see "
        "scripts/gpu-bundle) on %s, %s (%d SMs).\n"
        "Median of %d runs after %d warm-ups (and at least 100 ms of them), "
        "CUDA events, random "
        "logits in [-8, 8), a fresh copy of the logits before every "
        "run (not timed), 2%% ignored rows, mean reduction, options as the "
        "table's column says (class weights in [0.25, 2)). Bytes: one "
        "read + one write of the logits (forward-only: one read).\n\n"
        "D2D copy bandwidth (4 GiB, read + write): **%.0f GB/s** "
        "(power-capped %s); for "
        "reference, a read-only pass over the same 4 GiB: %.0f GB/s (%.1f%% "
        "of the copy); a read of 16 MiB that stays in L2 (64 passes): %.0f "
        "GB/s\n\n"
        "\"power-capped\": the share of the measurement's time (warm-up "
        "included) that the board spent held at its power limit (NVML's "
        "power violation time), which lowers the SM clock.\n\n%s",
        date, prop.name, prop.multiProcessorCount, kRuns, kWarmup, copy_gbs,
        CappedText(copy_capped_pct).c_str(), read_gbs,
        100.0 * read_gbs / copy_gbs, l2_gbs, table.c_str());
    std::fclose(f);
  }
  return 0;
}
