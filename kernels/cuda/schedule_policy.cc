// The dispatch's decision table and the schedules' sizes (schedule_policy.h),
// apart from the launch so that a CPU test can check them.
#include "kernels/cuda/schedule_policy.h"

#include <algorithm>
#include <climits>

namespace lossd {
namespace cuda_ce {
namespace {

constexpr long long kKiB = 1024;

long long CeilDiv(long long a, long long b) { return (a + b - 1) / b; }
long long RoundUp(long long a, long long b) { return CeilDiv(a, b) * b; }

// A row cut into `pieces` pieces (or a cluster's `pieces` slices) of `chunk`
// elements, each a whole number of `unit` elements; the last may be shorter.
// `pieces` as asked comes out smaller where rounding `chunk` up leaves the
// last ones empty.
struct RowCut {
  long long chunk;
  long long pieces;
};
RowCut CutRow(const ScheduleShape& s, long long pieces, long long unit) {
  const long long chunk = RoundUp(CeilDiv(s.vocab, pieces), unit);
  return {chunk, CeilDiv(s.vocab, chunk)};
}

// Split row forward, L2 and smem row pieces: pieces of about `piece_kib` KiB,
// at most max_pieces a row (pieces grow past piece_kib instead), whole
// vectors.
RowCut SplitRow(const ScheduleShape& s, int piece_kib, const Sm90Policy& p) {
  const long long per_row = std::min<long long>(
      p.max_pieces, std::max(1LL, CeilDiv(s.RowBytes(), piece_kib * kKiB)));
  return CutRow(s, per_row, s.VectorElements());
}
// Cluster slice rows: slices of about `slice_kib` KiB, whole vectors; the
// cluster may come out past max_cluster (then the shape does not fit).
RowCut SliceRows(const ScheduleShape& s, int slice_kib) {
  return CutRow(s, std::max(1LL, CeilDiv(s.RowBytes(), slice_kib * kKiB)),
                s.VectorElements());
}
// Cluster stream rows: slices of about `slice_kib` KiB, a whole number of
// block_threads-vector batches each, at most max_cluster (slices grow past
// slice_kib instead).
RowCut StreamRows(const ScheduleShape& s, int slice_kib, const Sm90Policy& p) {
  const long long cluster = std::min<long long>(
      p.max_cluster, std::max(1LL, CeilDiv(s.RowBytes(), slice_kib * kKiB)));
  return CutRow(s, cluster,
                static_cast<long long>(p.block_threads) * s.VectorElements());
}

ScheduleChoice Generic() { return ScheduleChoice{}; }

// One sizer a schedule: the choice, or nullopt where it cannot take the shape.
std::optional<ScheduleChoice> Sized(Schedule schedule, long long chunk,
                                    long long pieces, long long cluster) {
  if (chunk > INT_MAX) return std::nullopt;  // (vocab near INT_MAX, rounded)
  ScheduleChoice c;
  c.schedule = schedule;
  c.chunk = static_cast<int>(chunk);
  c.pieces = static_cast<int>(pieces);
  c.cluster = static_cast<int>(cluster);
  return c;
}

std::optional<ScheduleChoice> RegisterRows(const ScheduleShape& s, int vpt,
                                           const Sm90Policy& p) {
  if (vpt == 0) {
    // The largest slice, unless the row fits one smaller block.
    vpt = p.register_rows_max_vpt;
    for (int v = 1; v < p.register_rows_max_vpt; v *= 2) {
      if (s.vocab <=
          static_cast<long long>(v) * p.block_threads * s.VectorElements()) {
        vpt = v;
        break;
      }
    }
  } else if (vpt < 1 || vpt > p.register_rows_max_vpt || (vpt & (vpt - 1))) {
    return std::nullopt;  // the kernel has builds for powers of two
  }
  const long long chunk =
      static_cast<long long>(vpt) * p.block_threads * s.VectorElements();
  const long long cluster = CeilDiv(s.vocab, chunk);
  if (!s.aligned_rows || cluster > p.max_cluster ||
      s.rows * cluster > INT_MAX) {
    return Generic();  // as the automatic choice does for such rows
  }
  auto c = Sized(Schedule::kClusterRegisterRows, chunk, 0, cluster);
  c->vectors_per_thread = vpt;
  c->general = s.options_on;
  return c;
}

std::optional<ScheduleChoice> StreamRowsChoice(const ScheduleShape& s,
                                               int piece_kib,
                                               const Sm90Policy& p) {
  const RowCut c =
      StreamRows(s, piece_kib > 0 ? piece_kib : p.stream_slice_kib, p);
  if (!s.aligned_rows || s.rows * c.pieces > INT_MAX) return std::nullopt;
  return Sized(Schedule::kClusterStreamRows, c.chunk, 0, c.pieces);
}

std::optional<ScheduleChoice> SliceRowsChoice(const ScheduleShape& s,
                                              int piece_kib,
                                              const Sm90Policy& p) {
  const RowCut c = SliceRows(s, piece_kib > 0 ? piece_kib : p.slice_kib);
  if (!s.whole_vectors || c.pieces > p.max_cluster) return std::nullopt;
  return Sized(Schedule::kClusterSliceRows, c.chunk, 0, c.pieces);
}

std::optional<ScheduleChoice> SplitRowForwardChoice(const ScheduleShape& s,
                                                    int piece_kib,
                                                    const Sm90Policy& p) {
  const RowCut c =
      SplitRow(s, piece_kib > 0 ? piece_kib : p.split_piece_kib, p);
  // (forward only: no gradient to misalign, any row goes)
  if (!s.forward_only || s.rows * c.pieces > INT_MAX) return std::nullopt;
  auto choice = Sized(Schedule::kSplitRowForward, c.chunk, c.pieces, 0);
  if (choice) choice->edges = !s.whole_vectors;
  return choice;
}

std::optional<ScheduleChoice> L2RowPiecesChoice(const ScheduleShape& s,
                                                const ScheduleKnobs& knobs,
                                                const Sm90Policy& p) {
  if (s.forward_only || !s.whole_vectors || s.element_bytes != 2) {
    return std::nullopt;
  }
  const RowCut c =
      SplitRow(s, knobs.piece_kib > 0 ? knobs.piece_kib : p.l2_piece_kib, p);
  const long long group_bytes =
      static_cast<long long>(knobs.group_mib > 0 ? knobs.group_mib
                                                 : p.l2_group_mib)
      << 20;
  auto choice = Sized(Schedule::kL2RowPieces, c.chunk, c.pieces, 0);
  if (choice) {
    choice->group_rows = static_cast<int>(
        std::min(std::max(1LL, group_bytes / s.RowBytes()), s.rows));
  }
  return choice;
}

std::optional<ScheduleChoice> SmemRowPiecesChoice(const ScheduleShape& s,
                                                  int piece_kib,
                                                  const Sm90Policy& p) {
  if (s.forward_only || !(s.whole_vectors || s.edges_ok)) return std::nullopt;
  const RowCut c = SplitRow(s, piece_kib > 0 ? piece_kib : p.smem_piece_kib, p);
  auto choice = Sized(Schedule::kSmemRowPieces, c.chunk, c.pieces, 0);
  if (choice) {
    // Pieces come in by bulk copies (bench/NOTES.md, smem row pieces: fp32
    // 87-91% -> 89.5-93% of copy, bf16 out of place 87.7% -> 88.8% on
    // average) except 2-byte logits in place, where the threads' own loads
    // measured the same or better (89.1 / 88.6 / 89.1% against 87.1 / 89.3
    // / 89.1% at 8192x128256 / 4096x262144 / 16384x131072, means of 5).
    // Rows with edges: bulk copies always (the threads' loads build spills
    // there).
    choice->bulk = s.element_bytes == 4 || !s.in_place || !s.whole_vectors;
    choice->edges = !s.whole_vectors;
  }
  return choice;
}

}  // namespace

const char* ScheduleName(Schedule schedule) {
  switch (schedule) {
    case Schedule::kGenericRows:
      return "generic rows";
    case Schedule::kClusterRegisterRows:
      return "cluster register rows";
    case Schedule::kClusterStreamRows:
      return "cluster stream rows";
    case Schedule::kClusterSliceRows:
      return "cluster slice rows";
    case Schedule::kSplitRowForward:
      return "split row forward";
    case Schedule::kL2RowPieces:
      return "L2 row pieces";
    case Schedule::kSmemRowPieces:
      return "smem row pieces";
  }
  return "unknown schedule";
}

bool ScheduleChoice::operator==(const ScheduleChoice& o) const {
  return schedule == o.schedule && chunk == o.chunk && pieces == o.pieces &&
         cluster == o.cluster && vectors_per_thread == o.vectors_per_thread &&
         group_rows == o.group_rows && bulk == o.bulk && edges == o.edges &&
         general == o.general;
}

int PiecesBlocksPerSm(long long piece_bytes, bool bulk, const DeviceLimits& d) {
  // As the occupancy calculator (cuda_occupancy.h) counts a block: its
  // static and dynamic shared memory and the runtime's reservation, in
  // allocation units, against the SM's (the default carveout: all of it).
  const long long static_smem =
      bulk ? d.pieces_static_smem_bulk : d.pieces_static_smem_loads;
  if (piece_bytes < 0 || piece_bytes + static_smem > d.smem_per_block_optin) {
    return 0;
  }
  const long long per_block =
      RoundUp(piece_bytes + static_smem + d.smem_reserved_per_block,
              d.smem_granularity);
  return static_cast<int>(
      std::min<long long>(d.pieces_blocks_per_sm, d.smem_per_sm / per_block));
}

bool SmemPiecesFit(long long piece_bytes, int pieces, bool bulk,
                   const DeviceLimits& d, const Sm90Policy& p) {
  if (piece_bytes > d.smem_per_block_optin - p.pieces_smem_headroom) {
    return false;
  }
  if (bulk &&
      CeilDiv(piece_bytes, p.pieces_bulk_chunk_bytes) > p.pieces_bulk_chunks) {
    return false;
  }
  const long long per_sm = PiecesBlocksPerSm(piece_bytes, bulk, d);
  return per_sm > 0 && d.sms * per_sm >= pieces;
}

std::optional<ScheduleChoice> SizeSchedule(Schedule schedule,
                                           const ScheduleShape& s,
                                           const ScheduleKnobs& knobs,
                                           const Sm90Policy& p) {
  switch (schedule) {
    case Schedule::kGenericRows:
      return Generic();
    case Schedule::kClusterRegisterRows:
      return RegisterRows(s, knobs.vectors_per_thread, p);
    case Schedule::kClusterStreamRows:
      return StreamRowsChoice(s, knobs.piece_kib, p);
    case Schedule::kClusterSliceRows:
      return SliceRowsChoice(s, knobs.piece_kib, p);
    case Schedule::kSplitRowForward:
      return SplitRowForwardChoice(s, knobs.piece_kib, p);
    case Schedule::kL2RowPieces:
      return L2RowPiecesChoice(s, knobs, p);
    case Schedule::kSmemRowPieces:
      return SmemRowPiecesChoice(s, knobs.piece_kib, p);
  }
  return std::nullopt;
}

ScheduleChoice ChooseSchedule(const ScheduleShape& s, const DeviceLimits& d,
                              const Sm90Policy& p) {
  const long long row_bytes = s.RowBytes();
  if (s.forward_only && row_bytes >= p.short_row_bytes) {
    if (auto c = SplitRowForwardChoice(s, 0, p)) return *c;
    // Past INT_MAX blocks of pieces:
    if (auto c = StreamRowsChoice(s, 0, p)) return *c;
  }
  if (!s.forward_only) {
    const long long smem_from =
        s.element_bytes == 2 ? p.short_row_bytes : p.fp32_smem_pieces_row_bytes;
    if (row_bytes >= smem_from) {
      const auto c = SmemRowPiecesChoice(s, 0, p);
      if (c && SmemPiecesFit(static_cast<long long>(c->chunk) * s.element_bytes,
                             c->pieces, c->bulk, d, p)) {
        return *c;
      }
      // Pieces past shared memory (or this device's resident blocks):
      if (s.in_place) {
        if (auto l2 = L2RowPiecesChoice(s, {}, p)) return *l2;
      }
    }
    if (row_bytes >= p.short_row_bytes) {
      if (auto c = SliceRowsChoice(s, 0, p)) return *c;
    }
    if (row_bytes > p.stream_rows_row_bytes) {
      if (auto c = StreamRowsChoice(s, 0, p)) return *c;
    }
  }
  // Short rows, and what the fast schedules above did not take.
  return *RegisterRows(s, 0, p);
}

}  // namespace cuda_ce
}  // namespace lossd
