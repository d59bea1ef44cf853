// The dispatch's decision table (kernels/cuda/schedule_policy.h) on the CPU:
// every row of it at the bench's shapes with the H200's limits, the sizes each
// schedule gets, the options taking the fast schedules, smaller devices, and
// the occupancy arithmetic of the smem row pieces.
#include "kernels/cuda/schedule_policy.h"

#include <climits>
#include <ostream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace cuda_ce {

void PrintTo(const ScheduleChoice& c, std::ostream* os) {
  *os << ScheduleName(c.schedule) << " {chunk " << c.chunk << ", pieces "
      << c.pieces << ", cluster " << c.cluster << ", vpt "
      << c.vectors_per_thread << ", group_rows " << c.group_rows << ", bulk "
      << c.bulk << ", edges " << c.edges << ", general " << c.general << "}";
}

namespace {

constexpr int kKiB = 1024;

// The H200 (and H100): 132 SMs, 227 KiB of shared memory a block (opt-in),
// 228 KiB a SM.
DeviceLimits H200() {
  DeviceLimits d;
  d.sms = 132;
  d.smem_per_block_optin = 227 * kKiB;
  d.smem_per_sm = 228 * kKiB;
  return d;
}

enum class Mode { kForwardOnly, kOutOfPlace, kInPlace };

// Where the rows sit. kContiguous: the bench's logits, 16-byte aligned, row
// stride = vocab (rows aligned where the vocab is whole vectors, else edges,
// the gradient at the logits' offset). kPaddedStride: rows on 16-byte
// vectors, the vocab not necessarily whole vectors. kGradientOff: out of
// place with the gradient 2 bytes off the logits' alignment.
enum class Layout { kContiguous, kPaddedStride, kGradientOff };

ScheduleShape Shape(long long rows, int vocab, int element_bytes, Mode mode,
                    Layout layout = Layout::kContiguous, bool options = false) {
  ScheduleShape s;
  s.element_bytes = element_bytes;
  s.rows = rows;
  s.vocab = vocab;
  s.forward_only = mode == Mode::kForwardOnly;
  s.in_place = mode == Mode::kInPlace;
  s.options_on = options;
  const bool whole = static_cast<long long>(vocab) * element_bytes % 16 == 0;
  switch (layout) {
    case Layout::kContiguous:
      s.aligned_rows = whole;
      s.whole_vectors = whole;
      s.edges_ok = true;
      break;
    case Layout::kPaddedStride:
      s.aligned_rows = true;
      s.whole_vectors = whole;
      s.edges_ok = true;
      break;
    case Layout::kGradientOff:
      s.aligned_rows = false;
      s.whole_vectors = false;
      s.edges_ok = s.forward_only;
      break;
  }
  return s;
}

ScheduleChoice Generic() { return ScheduleChoice{}; }
ScheduleChoice Register(int vpt, int chunk, int cluster) {
  ScheduleChoice c;
  c.schedule = Schedule::kClusterRegisterRows;
  c.vectors_per_thread = vpt;
  c.chunk = chunk;
  c.cluster = cluster;
  return c;
}
ScheduleChoice Stream(int chunk, int cluster) {
  ScheduleChoice c;
  c.schedule = Schedule::kClusterStreamRows;
  c.chunk = chunk;
  c.cluster = cluster;
  return c;
}
ScheduleChoice Slices(int chunk, int cluster) {
  ScheduleChoice c;
  c.schedule = Schedule::kClusterSliceRows;
  c.chunk = chunk;
  c.cluster = cluster;
  return c;
}
ScheduleChoice Split(int chunk, int pieces, bool edges = false) {
  ScheduleChoice c;
  c.schedule = Schedule::kSplitRowForward;
  c.chunk = chunk;
  c.pieces = pieces;
  c.edges = edges;
  return c;
}
ScheduleChoice L2(int chunk, int pieces, int group_rows) {
  ScheduleChoice c;
  c.schedule = Schedule::kL2RowPieces;
  c.chunk = chunk;
  c.pieces = pieces;
  c.group_rows = group_rows;
  return c;
}
// `bulk`: bulk copies; else the threads' loads.
ScheduleChoice Smem(int chunk, int pieces, bool bulk, bool edges = false) {
  ScheduleChoice c;
  c.schedule = Schedule::kSmemRowPieces;
  c.chunk = chunk;
  c.pieces = pieces;
  c.bulk = bulk;
  c.edges = edges;
  return c;
}
constexpr bool kBulk = true;
constexpr bool kLoads = false;
constexpr bool kEdges = true;

struct Row {
  std::string name;
  ScheduleShape shape;
  ScheduleChoice want;
};

// Each row with and without the options (softcap, class weights, label
// smoothing): the same schedule and sizes, the options' build of cluster
// register rows where that is the choice.
void CheckRows(const std::vector<Row>& rows, const DeviceLimits& device) {
  for (const Row& row : rows) {
    for (bool options : {false, true}) {
      ScheduleShape s = row.shape;
      s.options_on = options;
      ScheduleChoice want = row.want;
      want.general = options && want.schedule == Schedule::kClusterRegisterRows;
      EXPECT_EQ(ChooseSchedule(s, device), want)
          << row.name << (options ? ", options on" : ", plain options");
    }
  }
}

// The bench's shapes (bench/RESULTS.md), contiguous logits: fp32 and the
// 2-byte types (bf16 and fp16 alike: the policy sees the element size), in
// every mode. Sizes as the dispatch computed them before the policy (a
// throwaway comparison of the two over 29M shapes, names and knobs).
TEST(SchedulePolicyTest, BenchShapesOnTheH200) {
  const std::vector<Row> rows = {
      // 8192 x 32000: 125 KiB fp32 rows (>= 120 KiB: smem row pieces), 62.5
      // KiB bf16.
      {"8192x32000 fp32 fwd", Shape(8192, 32000, 4, Mode::kForwardOnly),
       Split(32000, 1)},
      {"8192x32000 fp32 out", Shape(8192, 32000, 4, Mode::kOutOfPlace),
       Smem(10668, 3, kBulk)},
      {"8192x32000 fp32 in", Shape(8192, 32000, 4, Mode::kInPlace),
       Smem(10668, 3, kBulk)},
      {"8192x32000 bf16 fwd", Shape(8192, 32000, 2, Mode::kForwardOnly),
       Split(32000, 1)},
      {"8192x32000 bf16 out", Shape(8192, 32000, 2, Mode::kOutOfPlace),
       Smem(16000, 2, kBulk)},
      {"8192x32000 bf16 in", Shape(8192, 32000, 2, Mode::kInPlace),
       Smem(16000, 2, kLoads)},
      // 8192 x 128256
      {"8192x128256 fp32 fwd", Shape(8192, 128256, 4, Mode::kForwardOnly),
       Split(64128, 2)},
      {"8192x128256 fp32 out", Shape(8192, 128256, 4, Mode::kOutOfPlace),
       Smem(11660, 11, kBulk)},
      {"8192x128256 fp32 in", Shape(8192, 128256, 4, Mode::kInPlace),
       Smem(11660, 11, kBulk)},
      {"8192x128256 bf16 fwd", Shape(8192, 128256, 2, Mode::kForwardOnly),
       Split(128256, 1)},
      {"8192x128256 bf16 out", Shape(8192, 128256, 2, Mode::kOutOfPlace),
       Smem(21376, 6, kBulk)},
      {"8192x128256 bf16 in", Shape(8192, 128256, 2, Mode::kInPlace),
       Smem(21376, 6, kLoads)},
      // 4096 x 262144: fp32 1 MiB rows in 22 pieces (four blocks a SM).
      {"4096x262144 fp32 fwd", Shape(4096, 262144, 4, Mode::kForwardOnly),
       Split(65536, 4)},
      {"4096x262144 fp32 out", Shape(4096, 262144, 4, Mode::kOutOfPlace),
       Smem(11916, 22, kBulk)},
      {"4096x262144 fp32 in", Shape(4096, 262144, 4, Mode::kInPlace),
       Smem(11916, 22, kBulk)},
      {"4096x262144 bf16 fwd", Shape(4096, 262144, 2, Mode::kForwardOnly),
       Split(131072, 2)},
      {"4096x262144 bf16 out", Shape(4096, 262144, 2, Mode::kOutOfPlace),
       Smem(23832, 11, kBulk)},
      {"4096x262144 bf16 in", Shape(4096, 262144, 2, Mode::kInPlace),
       Smem(23832, 11, kLoads)},
      // 16384 x 131072
      {"16384x131072 fp32 fwd", Shape(16384, 131072, 4, Mode::kForwardOnly),
       Split(65536, 2)},
      {"16384x131072 fp32 out", Shape(16384, 131072, 4, Mode::kOutOfPlace),
       Smem(11916, 11, kBulk)},
      {"16384x131072 fp32 in", Shape(16384, 131072, 4, Mode::kInPlace),
       Smem(11916, 11, kBulk)},
      {"16384x131072 bf16 fwd", Shape(16384, 131072, 2, Mode::kForwardOnly),
       Split(131072, 1)},
      {"16384x131072 bf16 out", Shape(16384, 131072, 2, Mode::kOutOfPlace),
       Smem(21848, 6, kBulk)},
      {"16384x131072 bf16 in", Shape(16384, 131072, 2, Mode::kInPlace),
       Smem(21848, 6, kLoads)},
      // 8192 x 50257: unaligned rows, the pieces' edges; bulk copies even in
      // place (the threads'-loads build with edges spills).
      {"8192x50257 fp32 fwd", Shape(8192, 50257, 4, Mode::kForwardOnly),
       Split(50260, 1, kEdges)},
      {"8192x50257 fp32 out", Shape(8192, 50257, 4, Mode::kOutOfPlace),
       Smem(10052, 5, kBulk, kEdges)},
      {"8192x50257 fp32 in", Shape(8192, 50257, 4, Mode::kInPlace),
       Smem(10052, 5, kBulk, kEdges)},
      {"8192x50257 bf16 fwd", Shape(8192, 50257, 2, Mode::kForwardOnly),
       Split(50264, 1, kEdges)},
      {"8192x50257 bf16 out", Shape(8192, 50257, 2, Mode::kOutOfPlace),
       Smem(16760, 3, kBulk, kEdges)},
      {"8192x50257 bf16 in", Shape(8192, 50257, 2, Mode::kInPlace),
       Smem(16760, 3, kBulk, kEdges)},
      // 8192 x 50304: 50257 padded to whole vectors.
      {"8192x50304 fp32 fwd", Shape(8192, 50304, 4, Mode::kForwardOnly),
       Split(50304, 1)},
      {"8192x50304 fp32 out", Shape(8192, 50304, 4, Mode::kOutOfPlace),
       Smem(10064, 5, kBulk)},
      {"8192x50304 fp32 in", Shape(8192, 50304, 4, Mode::kInPlace),
       Smem(10064, 5, kBulk)},
      {"8192x50304 bf16 fwd", Shape(8192, 50304, 2, Mode::kForwardOnly),
       Split(50304, 1)},
      {"8192x50304 bf16 out", Shape(8192, 50304, 2, Mode::kOutOfPlace),
       Smem(16768, 3, kBulk)},
      {"8192x50304 bf16 in", Shape(8192, 50304, 2, Mode::kInPlace),
       Smem(16768, 3, kLoads)},
  };
  CheckRows(rows, H200());
}

// The rows of the table the bench's shapes do not reach, on the H200.
TEST(SchedulePolicyTest, DecisionTableOnTheH200) {
  const std::vector<Row> rows = {
      // Rows under 32 KiB: cluster register rows (the smallest block that
      // holds the row), or generic rows where rows are not aligned.
      {"short bf16", Shape(8192, 16000, 2, Mode::kInPlace),
       Register(8, 16384, 1)},
      {"short bf16 fwd", Shape(8192, 16000, 2, Mode::kForwardOnly),
       Register(8, 16384, 1)},
      {"short fp32 out", Shape(8192, 8000, 4, Mode::kOutOfPlace),
       Register(8, 8192, 1)},
      {"short bf16 one vector", Shape(7, 8, 2, Mode::kInPlace),
       Register(1, 2048, 1)},
      {"short unaligned", Shape(8192, 16001, 2, Mode::kInPlace), Generic()},
      {"short padded stride",
       Shape(8192, 16001, 2, Mode::kInPlace, Layout::kPaddedStride),
       Register(8, 16384, 1)},
      // fp32 rows of 32-120 KiB, whole vectors: cluster slice rows.
      {"fp32 117 KiB out", Shape(8192, 30000, 4, Mode::kOutOfPlace),
       Slices(7500, 4)},
      {"fp32 117 KiB in", Shape(8192, 30000, 4, Mode::kInPlace),
       Slices(7500, 4)},
      {"fp32 62.5 KiB in", Shape(8192, 16000, 4, Mode::kInPlace),
       Slices(8000, 2)},
      // ... not whole vectors: cluster register rows where aligned, else
      // generic rows (smem row pieces start at 120 KiB for fp32).
      {"fp32 117 KiB padded",
       Shape(8192, 30001, 4, Mode::kInPlace, Layout::kPaddedStride),
       Register(16, 16384, 2)},
      {"fp32 117 KiB unaligned", Shape(8192, 30001, 4, Mode::kInPlace),
       Generic()},
      // Rows on 16-byte vectors whose vocab is not: the pieces' edges.
      {"bf16 50257 padded out",
       Shape(8192, 50257, 2, Mode::kOutOfPlace, Layout::kPaddedStride),
       Smem(16760, 3, kBulk, kEdges)},
      {"bf16 50257 padded fwd",
       Shape(8192, 50257, 2, Mode::kForwardOnly, Layout::kPaddedStride),
       Split(50264, 1, kEdges)},
      // The gradient off the logits' alignment: no edges, no vectors.
      {"gradient off, bf16 50304",
       Shape(8192, 50304, 2, Mode::kOutOfPlace, Layout::kGradientOff),
       Generic()},
      {"gradient off, fp32 128256",
       Shape(8192, 128256, 4, Mode::kOutOfPlace, Layout::kGradientOff),
       Generic()},
      // The smem row pieces' reach: 32 pieces of at most 128 KiB by bulk
      // copies (4 MiB rows), of at most 227 KiB less 208 bytes by the
      // threads' loads (2-byte in place, 3715840 elements, ~7.09 MiB).
      {"fp32 4 MiB out", Shape(64, 1 << 20, 4, Mode::kOutOfPlace),
       Smem(32768, 32, kBulk)},
      {"fp32 4 MiB + 16 bytes out", Shape(64, (1 << 20) + 4, 4, Mode::kInPlace),
       Stream(66560, 16)},
      {"bf16 4 MiB out", Shape(64, 1 << 21, 2, Mode::kOutOfPlace),
       Smem(65536, 32, kBulk)},
      {"bf16 4 MiB + 16 bytes out",
       Shape(64, (1 << 21) + 8, 2, Mode::kOutOfPlace), Stream(133120, 16)},
      {"bf16 7.09 MiB in", Shape(8192, 3715840, 2, Mode::kInPlace),
       Smem(116120, 32, kLoads)},
      // Past it, 2-byte in place: L2 row pieces (a 4 MiB group: one row).
      {"bf16 7.09 MiB + 16 bytes in", Shape(8192, 3715848, 2, Mode::kInPlace),
       L2(116128, 32, 1)},
      {"bf16 8 MiB in", Shape(8192, 1 << 22, 2, Mode::kInPlace),
       L2(131072, 32, 1)},
      // ... the rest, aligned: cluster stream rows (> 160 KiB).
      {"bf16 8 MiB out", Shape(8192, 1 << 22, 2, Mode::kOutOfPlace),
       Stream(262144, 16)},
      {"fp32 8 MiB in", Shape(64, 1 << 21, 4, Mode::kInPlace),
       Stream(131072, 16)},
      // ... unaligned: generic rows.
      {"bf16 8 MiB unaligned in", Shape(8192, (1 << 22) + 1, 2, Mode::kInPlace),
       Generic()},
      // Forward only: split row forward at any length.
      {"bf16 8 MiB fwd", Shape(8192, 1 << 22, 2, Mode::kForwardOnly),
       Split(131072, 32)},
      {"bf16 8 MiB unaligned fwd",
       Shape(8192, (1 << 22) + 1, 2, Mode::kForwardOnly),
       Split(131080, 32, kEdges)},
      // rows x pieces past INT_MAX: forward only takes cluster stream rows
      // (16 blocks a row against 32), else generic rows (cluster register
      // rows need at least as many blocks a row; grids hold INT_MAX blocks).
      {"fwd 10^8 x 8 MiB", Shape(100000000, 1 << 22, 2, Mode::kForwardOnly),
       Stream(262144, 16)},
      {"fwd 2^30 x 512 KiB", Shape(1LL << 30, 262144, 2, Mode::kForwardOnly),
       Generic()},
      // Smem row pieces count rows x pieces in 64 bits (a persistent grid).
      {"fwd+gradient 2^30 x 512 KiB",
       Shape(1LL << 30, 262144, 2, Mode::kInPlace), Smem(23832, 11, kLoads)},
  };
  CheckRows(rows, H200());
}

// Devices with fewer SMs or less shared memory move the choice off smem row
// pieces where a row's pieces cannot all be resident or a piece does not fit.
TEST(SchedulePolicyTest, SmallerDevicesMoveTheChoice) {
  DeviceLimits one_sm = H200();
  one_sm.sms = 1;  // four blocks of 48 KiB pieces: rows of at most 4 pieces
  CheckRows(
      {
          {"1 SM: 2 pieces", Shape(8192, 32000, 2, Mode::kInPlace),
           Smem(16000, 2, kLoads)},
          {"1 SM: 4 pieces", Shape(8192, 96000, 2, Mode::kInPlace),
           Smem(24000, 4, kLoads)},
          {"1 SM: 5 pieces, in place", Shape(8192, 100000, 2, Mode::kInPlace),
           L2(25000, 4, 20)},
          {"1 SM: 5 pieces, out of place",
           Shape(8192, 100000, 2, Mode::kOutOfPlace), Slices(14288, 7)},
          {"1 SM: bf16 128256 in", Shape(8192, 128256, 2, Mode::kInPlace),
           L2(32064, 4, 16)},
          {"1 SM: bf16 128256 out", Shape(8192, 128256, 2, Mode::kOutOfPlace),
           Slices(16032, 8)},
          {"1 SM: fp32 128256", Shape(8192, 128256, 4, Mode::kInPlace),
           Slices(8016, 16)},
          {"1 SM: fp32 262144", Shape(4096, 262144, 4, Mode::kInPlace),
           Stream(32768, 8)},
          {"1 SM: 50257 in", Shape(8192, 50257, 2, Mode::kInPlace),
           Smem(16760, 3, kBulk, kEdges)},
          {"1 SM: fwd (no residency needed)",
           Shape(8192, 128256, 2, Mode::kForwardOnly), Split(128256, 1)},
      },
      one_sm);

  // 99 KiB a block, 100 KiB a SM (sm_86's): pieces past 99 KiB go.
  DeviceLimits small_smem = H200();
  small_smem.sms = 84;
  small_smem.smem_per_block_optin = 99 * kKiB;
  small_smem.smem_per_sm = 100 * kKiB;
  CheckRows(
      {
          {"99 KiB: bf16 128256 in", Shape(8192, 128256, 2, Mode::kInPlace),
           Smem(21376, 6, kLoads)},
          {"99 KiB: fp32 1 MiB", Shape(4096, 262144, 4, Mode::kOutOfPlace),
           Smem(11916, 22, kBulk)},
          {"99 KiB: fp32 4 MiB", Shape(64, 1 << 20, 4, Mode::kOutOfPlace),
           Stream(65536, 16)},
          {"99 KiB: bf16 4 MiB in", Shape(64, 1 << 21, 2, Mode::kInPlace),
           L2(65536, 32, 1)},
          {"99 KiB: bf16 3 MiB in", Shape(64, 3 << 19, 2, Mode::kInPlace),
           Smem(49152, 32, kLoads)},
      },
      small_smem);
}

// Blocks a SM of the smem row pieces kernel against a piece's size, as
// cudaOccupancyMaxActiveBlocksPerMultiprocessor gives them on the H200 (its
// formula in cuda_occupancy.h; checked there for every piece size, both
// builds).
TEST(SchedulePolicyTest, PiecesBlocksPerSmOnTheH200) {
  const DeviceLimits h200 = H200();
  EXPECT_EQ(PiecesBlocksPerSm(16 * kKiB, kBulk, h200), 4);  // registers
  EXPECT_EQ(PiecesBlocksPerSm(48 * kKiB, kBulk, h200), 4);
  // 4 blocks: 57 KiB of a SM's 228 each, less the runtime's 1 KiB and the
  // kernel's static shared memory (240 / 176 bytes), in 128-byte units.
  EXPECT_EQ(PiecesBlocksPerSm(57104, kBulk, h200), 4);
  EXPECT_EQ(PiecesBlocksPerSm(57120, kBulk, h200), 3);
  EXPECT_EQ(PiecesBlocksPerSm(57168, kLoads, h200), 4);
  EXPECT_EQ(PiecesBlocksPerSm(57184, kLoads, h200), 3);
  EXPECT_EQ(PiecesBlocksPerSm(64 * kKiB, kBulk, h200), 3);
  EXPECT_EQ(PiecesBlocksPerSm(128 * kKiB, kBulk, h200), 1);
  EXPECT_EQ(PiecesBlocksPerSm(227 * kKiB - 176, kLoads, h200), 1);
  EXPECT_EQ(PiecesBlocksPerSm(227 * kKiB - 160, kLoads, h200), 0);
}

TEST(SchedulePolicyTest, SmemPiecesFitOnTheH200) {
  const DeviceLimits h200 = H200();
  EXPECT_TRUE(SmemPiecesFit(48 * kKiB, 32, kBulk, h200));
  // By bulk copies at most 8 chunks of 16 KiB.
  EXPECT_TRUE(SmemPiecesFit(128 * kKiB, 32, kBulk, h200));
  EXPECT_FALSE(SmemPiecesFit(128 * kKiB + 16, 32, kBulk, h200));
  // By the threads' loads, the opt-in limit less MakePlan's 208 bytes.
  EXPECT_TRUE(SmemPiecesFit(227 * kKiB - 208, 32, kLoads, h200));
  EXPECT_FALSE(SmemPiecesFit(227 * kKiB - 192, 32, kLoads, h200));
  // Every piece of a row resident at once: 132 SMs x 4 blocks.
  EXPECT_TRUE(SmemPiecesFit(48 * kKiB, 528, kBulk, h200));
  EXPECT_FALSE(SmemPiecesFit(48 * kKiB, 529, kBulk, h200));
}

// A named schedule (CrossEntropyCudaConfig): sized as the automatic choice
// would, the knobs applied, nullopt where it cannot take the shape.
TEST(SchedulePolicyTest, NamedSchedules) {
  const ScheduleShape in_place = Shape(8192, 128256, 2, Mode::kInPlace);
  const ScheduleShape fwd = Shape(8192, 128256, 2, Mode::kForwardOnly);
  // Every schedule takes the options: the same sizes as without them.
  for (Schedule named :
       {Schedule::kClusterStreamRows, Schedule::kClusterSliceRows,
        Schedule::kL2RowPieces, Schedule::kSmemRowPieces,
        Schedule::kSplitRowForward, Schedule::kClusterRegisterRows,
        Schedule::kGenericRows}) {
    const ScheduleShape plain =
        named == Schedule::kSplitRowForward ? fwd : in_place;
    ScheduleShape options = plain;
    options.options_on = true;
    const auto a = SizeSchedule(named, plain);
    const auto b = SizeSchedule(named, options);
    ASSERT_TRUE(a.has_value()) << ScheduleName(named);
    ASSERT_TRUE(b.has_value()) << ScheduleName(named);
    EXPECT_EQ(a->schedule, named);
    ScheduleChoice want = *a;
    want.general = named == Schedule::kClusterRegisterRows;
    EXPECT_EQ(*b, want) << ScheduleName(named);
  }
  EXPECT_EQ(SizeSchedule(Schedule::kClusterStreamRows, in_place),
            Stream(65536, 2));
  EXPECT_EQ(SizeSchedule(Schedule::kClusterSliceRows, in_place),
            Slices(16032, 8));
  EXPECT_EQ(SizeSchedule(Schedule::kL2RowPieces, in_place), L2(32064, 4, 16));
  EXPECT_EQ(SizeSchedule(Schedule::kClusterRegisterRows, in_place),
            Register(16, 32768, 4));

  // The knobs (the GPU tests' small shapes).
  const ScheduleShape small = Shape(96, 8192, 2, Mode::kInPlace);
  EXPECT_EQ(SizeSchedule(Schedule::kSmemRowPieces, small, {8, 0, 0}),
            Smem(4096, 2, kLoads));
  EXPECT_EQ(SizeSchedule(Schedule::kL2RowPieces, small, {8, 0, 1}),
            L2(4096, 2, 64));
  EXPECT_EQ(SizeSchedule(Schedule::kSplitRowForward,
                         Shape(200, 16384, 2, Mode::kForwardOnly), {8, 0, 0}),
            Split(4096, 4));
  EXPECT_EQ(SizeSchedule(Schedule::kClusterSliceRows,
                         Shape(300, 16000, 4, Mode::kInPlace), {8, 0, 0}),
            Slices(2000, 8));
  EXPECT_EQ(SizeSchedule(Schedule::kClusterStreamRows,
                         Shape(7, 100004, 4, Mode::kInPlace), {16, 0, 0}),
            Stream(7168, 14));
  EXPECT_EQ(SizeSchedule(Schedule::kClusterRegisterRows, small, {0, 2, 0}),
            Register(2, 4096, 2));

  // What each cannot take.
  const ScheduleShape unaligned = Shape(8192, 50257, 2, Mode::kInPlace);
  EXPECT_FALSE(SizeSchedule(Schedule::kClusterStreamRows, unaligned));
  EXPECT_FALSE(SizeSchedule(Schedule::kClusterSliceRows, unaligned));
  EXPECT_FALSE(SizeSchedule(Schedule::kL2RowPieces, unaligned));
  EXPECT_FALSE(SizeSchedule(Schedule::kClusterSliceRows,
                            Shape(4096, 262144, 4, Mode::kInPlace)));
  EXPECT_FALSE(SizeSchedule(Schedule::kSplitRowForward, in_place));
  EXPECT_FALSE(SizeSchedule(Schedule::kSmemRowPieces, fwd));
  EXPECT_FALSE(SizeSchedule(Schedule::kL2RowPieces, fwd));
  EXPECT_FALSE(SizeSchedule(Schedule::kL2RowPieces,
                            Shape(8192, 128256, 4, Mode::kInPlace)));
  EXPECT_FALSE(SizeSchedule(
      Schedule::kSmemRowPieces,
      Shape(8192, 50304, 2, Mode::kOutOfPlace, Layout::kGradientOff)));
  EXPECT_FALSE(SizeSchedule(Schedule::kSplitRowForward,
                            Shape(1LL << 30, 262144, 2, Mode::kForwardOnly)));
  EXPECT_FALSE(SizeSchedule(Schedule::kClusterRegisterRows, small, {0, 3, 0}));
  // Cluster register rows gives generic rows where it cannot, as auto does.
  EXPECT_EQ(SizeSchedule(Schedule::kClusterRegisterRows, unaligned), Generic());
  EXPECT_EQ(SizeSchedule(Schedule::kClusterRegisterRows,
                         Shape(64, 1 << 21, 4, Mode::kInPlace)),
            Generic());
  // Smem row pieces leave the device's fit to the launch.
  EXPECT_EQ(SizeSchedule(Schedule::kSmemRowPieces,
                         Shape(64, 1 << 22, 4, Mode::kInPlace)),
            Smem(131072, 32, kBulk));
  EXPECT_FALSE(SizeSchedule(static_cast<Schedule>(0), in_place));
}

// Pure: the same inputs give the same choice, whatever was asked between.
TEST(SchedulePolicyTest, Pure) {
  std::vector<ScheduleShape> shapes;
  for (int element_bytes : {2, 4}) {
    for (long long rows : {1LL, 8192LL, 1LL << 30}) {
      for (int vocab : {1, 8, 16001, 32000, 50257, 128256, 1 << 22}) {
        for (Mode mode :
             {Mode::kForwardOnly, Mode::kOutOfPlace, Mode::kInPlace}) {
          for (Layout layout : {Layout::kContiguous, Layout::kPaddedStride,
                                Layout::kGradientOff}) {
            for (bool options : {false, true}) {
              shapes.push_back(
                  Shape(rows, vocab, element_bytes, mode, layout, options));
            }
          }
        }
      }
    }
  }
  DeviceLimits one_sm = H200();
  one_sm.sms = 1;
  for (const DeviceLimits& device : {H200(), one_sm}) {
    std::vector<ScheduleChoice> first;
    for (const ScheduleShape& s : shapes) {
      first.push_back(ChooseSchedule(s, device));
    }
    for (size_t i = shapes.size(); i-- > 0;) {
      EXPECT_EQ(ChooseSchedule(shapes[i], device), first[i]) << i;
      EXPECT_EQ(ChooseSchedule(shapes[i], device), first[i]) << i;
    }
  }
}

// The thresholds are the policy's: moving one moves the choice.
TEST(SchedulePolicyTest, ThresholdsAreNamed) {
  const ScheduleShape fp32_117k = Shape(8192, 30000, 4, Mode::kInPlace);
  EXPECT_EQ(ChooseSchedule(fp32_117k, H200()).schedule,
            Schedule::kClusterSliceRows);
  Sm90Policy policy;
  policy.fp32_smem_pieces_row_bytes = 64 * kKiB;
  EXPECT_EQ(ChooseSchedule(fp32_117k, H200(), policy), Smem(10000, 3, kBulk));
  policy = {};
  policy.short_row_bytes = 128 * kKiB;
  EXPECT_EQ(
      ChooseSchedule(Shape(8192, 32000, 2, Mode::kInPlace), H200(), policy),
      Register(16, 32768, 1));
  policy = {};
  policy.smem_piece_kib = 64;
  EXPECT_EQ(
      ChooseSchedule(Shape(8192, 128256, 2, Mode::kInPlace), H200(), policy),
      Smem(32064, 4, kLoads));
}

}  // namespace
}  // namespace cuda_ce
}  // namespace lossd
