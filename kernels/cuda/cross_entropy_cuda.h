// The CUDA backend of the cross-entropy contract (kernels/cross_entropy.h):
// device-side launch with no host synchronization, for the server's streams.
// CUDA runtime headers only; the absl wrapper is cross_entropy_cuda_host.h.
#ifndef LOSSD_KERNELS_CUDA_CROSS_ENTROPY_CUDA_H_
#define LOSSD_KERNELS_CUDA_CROSS_ENTROPY_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cross_entropy.h"

namespace lossd {

// Written to device memory by CrossEntropyCudaLaunch. Same meaning as
// CrossEntropyResult, plus the bad-target report: when `error` is
// kCrossEntropyBadTarget, nothing else was written anywhere (gradient,
// per-token outputs and logits are untouched) and the sums are 0.
struct CrossEntropyCudaResult {
  double loss;
  double z_loss;
  double denominator;
  long long valid_tokens;
  long long correct_tokens;
  long long nonfinite_rows;
  long long bad_row;     // first row whose target is out of range, or -1
  long long bad_target;  // that row's target value
  int error;             // 0 = ok, kCrossEntropyBadTarget
  int reserved;
};

constexpr int kCrossEntropyBadTarget = 1;

// Tuning override for benchmarks and tests; 0 fields mean "choose".
//
// version 9 (the default for forward+gradient with the plain options on 16-byte
// aligned rows, V a multiple of 16 bytes: bf16/fp16 rows of 32 KiB and more,
// fp32 rows of 120 KiB and more) splits every row into pieces of about
// slice_kib (default 48; larger where a row would pass 32 pieces), each kept in
// the shared memory of the persistent block that read it until its row's
// statistics are merged, then written as gradient from there; ctas_per_sm 2
// picks 512-thread blocks, two a SM, 8 128-thread blocks, eight a SM (default:
// 256 threads, four a SM where shared memory allows); piece_load chooses how a
// piece comes in (default: bulk copies, except the threads' loads for 2-byte
// logits in place); rows whose pieces pass a block's shared memory take
// another path.
//
// version 8 (the fallback where v9 cannot keep per_row blocks resident) runs
// v7's row pieces in one persistent kernel, the statistics of a group of rows
// (group_mib, default 4) `stages` groups (default 2) before the gradient of
// that group, which re-reads its rows from L2; slice_kib sets the piece
// (default 64); the statistics loads keep their lines in L2 with an evict-last
// priority, the gradient's re-reads and stores evict-first (cache_hints 1 turns
// this off).
//
// version 7 (the default for forward-only with the plain options on 16-byte
// aligned rows of 32 KiB and more, V a multiple of 16 bytes) splits every row
// into pieces of slice_kib (default 256; larger where a row would pass 16
// pieces) on independent blocks and merges each row's piece statistics in a
// second kernel; stages 1 keeps one batch of loads in flight a thread, 0 or 2
// two.
//
// version 6 (the default for fp32 forward+gradient with the plain options -- no
// softcap, class weights or label smoothing -- on 16-byte aligned rows of 32 to
// 120 KiB, V a multiple of 16 bytes) streams each block's row slice into shared
// memory with bulk copies, in persistent clusters with an mbarrier exchange:
// slice_kib (default 32, or 64 past 16 slices a row) sets the slice and so the
// cluster size (<= 16), ctas_per_sm 2 the 256-thread build for two blocks a SM
// (default with 32 KiB slices), otherwise one 512-thread block, stages the
// shared-memory buffers (0 = as many as fit, >= 2).
//
// version 5 (the default for forward+gradient rows past 160 KiB that v6 cannot
// take, and forward-only rows that v7 cannot) streams each block's row slice
// twice, the second read from L2, in persistent clusters; version 4 keeps the
// slice in registers, a cluster per row. v5: slice_kib (32, 64, 128...; default
// 128) sets each block's slice and so the cluster size ceil(row bytes / slice),
// raised where it would pass 16; ctas_per_sm 4 picks the build for 4 blocks a
// SM (64 registers, spills), 0 or 3 the one for 3, others cap resident blocks
// through shared memory.
//
// v4: vectors_per_thread (1, 2, 4, 8 or 16) sets the slice kept in registers
// (vectors_per_thread * 256 threads * 16 bytes); the cluster size ceil(vocab /
// slice) must come out <= 16. generic = true forces the simple one-block-per-
// row path (no clusters, rows re-read from L2).
struct CrossEntropyCudaConfig {
  int vectors_per_thread = 0;
  bool generic = false;
  int version = 0;
  int slice_kib = 0;
  int ctas_per_sm = 0;
  int group_mib = 0;     // v8: MiB of rows a group (0 = 4)
  int stages = 0;        // v6: shared-memory stages (0 = as many as fit); v7
                         // batches in flight
  int cache_hints = 0;   // v8: 0 or 2 = L2 eviction priorities (statistics
                         // loads evict-last, the gradient's re-reads and
                         // stores evict-first); 1 = none
  int prefetch_kib = 0;  // v9: each item prefetches the piece this many KiB
                         // of logits ahead into L2 (0 = automatic, < 0 none)
  int ablate = 0;  // v9, diagnostic (bench only, results wrong): stages left
                   // out (1 the row wait, 2 the gradient math, 4 the
                   // statistics, 8 the sleep between slot polls), to
                   // measure what each costs
  // v9, diagnostic (bench only): when not null, device memory of 5 words an
  // item (rows x pieces a row) that each item fills with %globaltimer at its
  // take, after its statistics, after its row wait and after its gradient,
  // then (SM id << 32 | block index).
  unsigned long long* trace = nullptr;
  int piece_load = 0;  // v9: how a piece comes into shared memory: 0 =
                       // automatic, 1 = the threads' loads, 2 = bulk copies
                       // (the TMA unit) issued when the piece is taken
};

// Bytes of device workspace CrossEntropyCudaLaunch needs for `rows` rows
// (aligned to 256 bytes). Thread-safe, pure.
std::size_t CrossEntropyCudaWorkspaceBytes(int64_t rows);

// Enqueues the fused cross-entropy on `stream`: a target check, the fused
// loss+gradient kernel and a fixed-order reduction into *device_result.
// `args` must already be valid (ValidateCrossEntropyArgs) and hold device
// pointers; `device_result` and `workspace` (>= CrossEntropyCudaWorkspaceBytes)
// are device memory owned by the caller and must outlive the stream work. The
// result is deterministic: the same inputs give the same bits on every run.
// Returns cudaSuccess when the work was enqueued; cudaErrorInvalidValue for a
// too-small workspace or an unsupported shape (vocab >= 2^31); or a launch
// error. A bad target is not a launch error: it is reported in
// device_result->error once the stream reaches it. Thread-safe for distinct
// buffers; `config` (may be nullptr) overrides the automatic choice of path.
cudaError_t CrossEntropyCudaLaunch(
    const CrossEntropyArgs& args, CrossEntropyCudaResult* device_result,
    void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
    const CrossEntropyCudaConfig* config = nullptr);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_CROSS_ENTROPY_CUDA_H_
