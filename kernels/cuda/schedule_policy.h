// The cross-entropy dispatch as a policy (issue 26): a pure function from a
// call's shape, dtype, mode, options and alignment and the device's limits to
// a schedule and its sizes, every threshold named in Sm90Policy. Plain C++
// (no CUDA headers), so that a CPU-only test checks the decision table.
#ifndef LOSSD_KERNELS_CUDA_SCHEDULE_POLICY_H_
#define LOSSD_KERNELS_CUDA_SCHEDULE_POLICY_H_

#include <optional>

#include "kernels/cuda/launch_params.h"

namespace lossd {
namespace cuda_ce {

// The fused schedules, one a file in kernels/cuda/: CrossEntropyCudaSchedule
// less kAuto, with the same values (dispatch.cc checks them).
enum class Schedule : int {
  kGenericRows = 1,
  kClusterRegisterRows = 2,
  kClusterStreamRows = 3,
  kClusterSliceRows = 4,
  kSplitRowForward = 5,
  kL2RowPieces = 6,
  kSmemRowPieces = 7,
};

// "generic rows", "smem row pieces", ...: for messages and tests.
const char* ScheduleName(Schedule schedule);

// What the choice depends on, from the call's arguments.
struct ScheduleShape {
  int element_bytes = 4;      // of the logits: 2 (bf16, fp16) or 4 (fp32)
  long long rows = 0;         // 1 .. INT_MAX
  int vocab = 0;              // 1 .. INT_MAX
  bool forward_only = false;  // no gradient (GradientMode::kNone)
  bool in_place = false;      // the gradient overwrites the logits
  // Softcap, class weights or label smoothing. The schedules take them as
  // they take the plain options; only cluster register rows has a build of
  // its own for them (ScheduleChoice::general).
  bool options_on = false;
  // Logits (and gradient) 16-byte aligned and a row stride of whole 16-byte
  // vectors: every row starts on a vector.
  bool aligned_rows = false;
  // ... and the vocab a whole number of vectors too (the schedules that copy
  // or keep whole vectors of a row need it).
  bool whole_vectors = false;
  // The gradient (if any) as far from a 16-byte boundary as the logits: the
  // schedules that handle a row's unaligned edges themselves (smem row
  // pieces, split row forward) take any row then.
  bool edges_ok = false;

  long long RowBytes() const {
    return static_cast<long long>(vocab) * element_bytes;
  }
  int VectorElements() const { return 16 / element_bytes; }
};

// What the policy needs of the device (cudaDeviceGetAttribute), and of the
// smem row pieces kernel's sm_90 builds on it (ptxas -v; the kernel is not
// visible outside smem_row_pieces.cu, whose launch still asks the occupancy
// API and refuses what does not fit).
struct DeviceLimits {
  int sms = 0;                   // cudaDevAttrMultiProcessorCount
  int smem_per_block_optin = 0;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
  int smem_per_sm = 0;           // cudaDevAttrMaxSharedMemoryPerMultiprocessor
  // cudaDevAttrReservedSharedMemoryPerBlock: the runtime's share of each
  // block's shared memory.
  int smem_reserved_per_block = 1024;
  int smem_granularity = 128;  // shared memory allocation unit (sm_80 on)
  // The smem row pieces kernel: blocks a SM holds for its registers and
  // threads. Its __launch_bounds__(256, 4) keeps its builds at 56-64
  // registers a thread: 65536 / (64 * 256) = 4 (2048 threads would allow 8).
  int pieces_blocks_per_sm = 4;
  // ... and its static shared memory: the bulk-copy builds 240 bytes (their
  // chunk barriers), the threads'-loads builds 176.
  int pieces_static_smem_bulk = 240;
  int pieces_static_smem_loads = 176;
};

// The thresholds of the decision and of the schedules' sizes, measured on the
// H200 (bench/NOTES.md, bench/RESULTS.md). max_pieces and max_cluster may only
// be lowered: the workspace and the kernels hold at most kMaxPieces and
// kMaxCluster.
struct Sm90Policy {
  // Rows shorter than this go to cluster register rows or generic rows: the
  // fast schedules' per-row work (a cluster's barriers, a row's pieces
  // meeting) costs more than it saves there.
  long long short_row_bytes = 32 * 1024;
  // fp32 forward+gradient takes smem row pieces from this row size: shorter
  // rows measured faster on cluster slice rows (87-88% of copy against
  // 85-86% at V = 32000 without bulk copies; bench/NOTES.md). 2-byte rows take
  // them from short_row_bytes.
  long long fp32_smem_pieces_row_bytes = 120 * 1024;
  // Forward+gradient rows longer than this (strictly) that nothing faster
  // took go to cluster stream rows.
  long long stream_rows_row_bytes = 160 * 1024;

  // Sizes (KiB of a row piece or a block's slice; the knobs of
  // CrossEntropyCudaConfig override them for a named schedule).
  int smem_piece_kib = 48;        // smem row pieces: four blocks a SM
  int l2_piece_kib = 64;          // L2 row pieces
  int split_piece_kib = 256;      // split row forward
  int slice_kib = 32;             // cluster slice rows
  int stream_slice_kib = 128;     // cluster stream rows
  int l2_group_mib = 4;           // L2 row pieces: MiB of rows a group
  int max_pieces = kMaxPieces;    // pieces a row (split, L2, smem pieces)
  int max_cluster = kMaxCluster;  // blocks a cluster (non-portable past 8)
  int block_threads = kThreads;   // threads a block of the sized schedules
  // Cluster register rows: the most 16-byte vectors a thread holds (64 KiB
  // a block, measured fastest at every vocab: fewer blocks a row mean fewer
  // cluster barriers). Rows that fit one smaller block take that.
  int register_rows_max_vpt = 16;

  // Smem row pieces: what its launch (smem_row_pieces.cu, MakePlan) asks of
  // a piece. It leaves 9 Stats and 64 bytes of the opt-in limit to the
  // kernel's static shared memory ...
  int pieces_smem_headroom = 9 * 16 + 64;
  // ... and brings a piece in by bulk copies in at most 8 chunks of 16 KiB
  // (kBulkChunks of kU * 256 vectors): 128 KiB a piece.
  int pieces_bulk_chunk_bytes = 16 * 1024;
  int pieces_bulk_chunks = 8;
};

// A schedule and its sizes: what LaunchSchedule (dispatch.cc) passes to the
// schedule's launcher (schedules.h).
struct ScheduleChoice {
  Schedule schedule = Schedule::kGenericRows;
  // p.chunk: elements a row piece (split row forward, L2 and smem row
  // pieces) or a block's slice (cluster schedules); 0 for generic rows.
  int chunk = 0;
  int pieces = 0;   // row pieces a row (split row forward, L2/smem pieces)
  int cluster = 0;  // blocks a cluster, one cluster a row (cluster schedules)
  int vectors_per_thread = 0;  // cluster register rows: 1, 2, 4, 8 or 16
  int group_rows = 0;          // L2 row pieces: rows a group
  // Smem row pieces: pieces come in by bulk copies (else the threads' loads).
  bool bulk = false;
  // Smem row pieces, split row forward: the build for rows of any alignment
  // and vocab (a row's unaligned edges one element at a time).
  bool edges = false;
  // Cluster register rows: the build with softcap, class weights and label
  // smoothing.
  bool general = false;

  bool operator==(const ScheduleChoice& o) const;
  bool operator!=(const ScheduleChoice& o) const { return !(*this == o); }
};

// The sizes CrossEntropyCudaConfig may set for a named schedule (0: the
// policy's own).
struct ScheduleKnobs {
  int piece_kib = 0;           // piece or slice KiB
  int vectors_per_thread = 0;  // cluster register rows
  int group_mib = 0;           // L2 row pieces
};

// The decision, measured on the H200 (bench/NOTES.md, bench/RESULTS.md). The
// options (softcap, class weights, label smoothing) do not enter it: every
// schedule takes them, and a row's shape decides.
//
//   mode          rows                                    schedule
//   forward only  >= 32 KiB, rows x pieces <= INT_MAX     split row forward
//                 else aligned, rows x cluster <= INT_MAX cluster stream rows
//   fwd+gradient  2-byte >= 32 KiB or fp32 >= 120 KiB,
//                 whole vectors or edges ok, pieces fit   smem row pieces
//                 else whole vectors, 2-byte, in place    L2 row pieces
//   fwd+gradient  whole vectors, 32-512 KiB               cluster slice rows
//   fwd+gradient  aligned, > 160 KiB                      cluster stream rows
//   any           aligned, <= 16 x 64 KiB, rows x cluster
//                 <= INT_MAX (rows under 32 KiB and
//                 whatever the above did not take)        cluster register rows
//   any           otherwise                               generic rows
//
// Split row forward and smem row pieces take rows of any alignment and vocab
// (their edges one element at a time: the gradient must then sit as far from
// a 16-byte boundary as the logits); the cluster schedules need rows that
// start on 16-byte vectors ("aligned") and some a vocab of whole vectors.
// Forward only falls back to cluster stream rows (aligned rows) only past
// INT_MAX blocks. The smem row pieces need a piece (about 48 KiB, more past
// 32 pieces a row) to fit a block's shared memory and, by bulk copies, 8
// chunks of 16 KiB (SmemPiecesFit): on the H200, rows up to 4 MiB by bulk
// copies (fp32, out of place, rows with edges) and ~7 MiB by the threads'
// loads (2-byte logits in place), past which 2-byte in place takes L2 row
// pieces and the rest cluster stream rows.
//
// Pure and thread-safe. Always a schedule that can take the shape (generic
// rows take any).
ScheduleChoice ChooseSchedule(const ScheduleShape& shape,
                              const DeviceLimits& device,
                              const Sm90Policy& policy = {});

// Sizes a named schedule for `shape` (knobs as CrossEntropyCudaConfig's) as
// ChooseSchedule would if it chose it. std::nullopt where the schedule cannot
// take the shape (CrossEntropyCudaLaunch's cudaErrorInvalidValue), or a knob
// is out of range (vectors_per_thread not 1, 2, 4, 8 or 16). Cluster register
// rows on rows it cannot take (unaligned, a cluster past max_cluster) gives
// generic rows, as the automatic choice does. Whether smem row pieces fit the
// device is left to its launcher (cudaErrorInvalidConfiguration). Pure.
std::optional<ScheduleChoice> SizeSchedule(Schedule schedule,
                                           const ScheduleShape& shape,
                                           const ScheduleKnobs& knobs = {},
                                           const Sm90Policy& policy = {});

// Blocks of the smem row pieces kernel resident on one SM with a piece of
// `piece_bytes` of dynamic shared memory (`bulk`: a bulk-copy build), as
// cudaOccupancyMaxActiveBlocksPerMultiprocessor gives it for that kernel; 0
// where the block does not fit. Pure.
int PiecesBlocksPerSm(long long piece_bytes, bool bulk,
                      const DeviceLimits& device);

// Whether smem row pieces run `pieces` pieces a row of `piece_bytes` each on
// the device: the pure twin of SmemRowPiecesFit (schedules.h). The piece fits
// a block's shared memory (and, by bulk copies, the chunk barriers), and at
// least `pieces` blocks are resident at once (the kernel's waits need that
// many: no deadlock then). Pure.
bool SmemPiecesFit(long long piece_bytes, int pieces, bool bulk,
                   const DeviceLimits& device, const Sm90Policy& policy = {});

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_SCHEDULE_POLICY_H_
