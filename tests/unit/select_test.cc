// One test per selection rule of docs/design.md §5 on the CPU reference backend.
#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "oracle.h"
#include "test_arena.h"

namespace spin::testing {
namespace {

Geometry Geo(uint32_t slots, uint32_t topk = 64, uint32_t rows = 1, uint32_t seqs = 1,
             uint32_t layers = 2, StateDtype dt = StateDtype::kFp32) {
  Geometry g;
  g.layers = layers;
  g.max_seqs = seqs;
  g.max_slots = slots;
  g.block_size = 64;
  g.topk = topk;
  g.max_rows = rows;
  g.dtype = dt;
  return g;
}

Policy Pol(double rho, double gamma = 0.0, uint32_t period = 0) {
  Policy p;
  p.target_sparsity = rho;
  p.exploration = gamma;
  p.probe_period = period;
  return p;
}

// Gives block j of (seq 0, layer 0) the predicted score s[j] through V only (D unset -> the
// prediction is V), and marks the pair as observed.
void SetBlockScores(TestArena& t, const std::vector<float>& s, int n, int seq = 0, int layer = 0) {
  for (int i = 0; i < n; ++i) t.Set(seq, layer, 0, i, s[i / 64]);
  t.SetFresh(seq, layer, false);
}

std::vector<int> Range(int lo, int hi) {
  std::vector<int> v;
  for (int i = lo; i < hi; ++i) v.push_back(i);
  return v;
}

TEST(Select, FreshSequenceIsDense) {
  TestArena t(Geo(64 * 10), Pol(0.5));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  OneSeqStep s{0, 64 * 10, 64 * 10 - 1};
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected(), Range(0, 10));
  EXPECT_EQ(t.view().stats[0].dense_steps, 1u);
  EXPECT_EQ(t.view().compact_len[0], 640);
}

TEST(Select, KeepsTopBlocksAndTheQueryBlock) {
  TestArena t(Geo(64 * 10), Pol(0.6));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  // m = max(ceil(64/64)=1, ceil(0.4 * 10)) = 4: query block 9, then blocks 2, 5, 7.
  SetBlockScores(t, {0, 1, 9, 2, 3, 8, 1, 7, 0, 0}, 640);
  OneSeqStep s{0, 640, 639};
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected(), (std::vector<int>{2, 5, 7, 9}));
  EXPECT_EQ(t.view().stats[0].sparse_blocks_kept, 4u);
  EXPECT_EQ(t.view().stats[0].sparse_blocks_total, 10u);
}

TEST(Select, RoundingOfKeptBlocksAtRho04B100) {
  TestArena t(Geo(64 * 100), Pol(0.4));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  std::vector<float> s(100);
  for (int j = 0; j < 100; ++j) s[j] = static_cast<float>((j * 37) % 100);
  SetBlockScores(t, s, 6400);
  OneSeqStep st{0, 6400, 6399};
  ASSERT_TRUE(t.dp().BeginStep(st.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected().size(), 60u);
}

// Both backends read the budgets and the exploration share once per step, when it begins (the
// CUDA backend selects every layer then): a policy written during a step applies from the next.
TEST(Select, PolicyWrittenDuringAStepAppliesFromTheNextStep) {
  TestArena t(Geo(64 * 10), Pol(0.6));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  SetBlockScores(t, {0, 1, 9, 2, 3, 8, 1, 7, 0, 0}, 640);
  OneSeqStep s{0, 640, 639};
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(WritePolicy(t.view(), Pol(0.8)).ok());  // m = ceil(0.2 * 10) = 2 from now on
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected(), (std::vector<int>{2, 5, 7, 9})) << "the step began at 0.6";
  ASSERT_TRUE(t.dp().Select(1).ok());  // layer 1 is fresh: dense either way
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected(), (std::vector<int>{2, 9}));
}

TEST(Select, TopKFloorKeepsCeilKOverBBlocks) {
  // K = 640 slots need at least 10 blocks even at 90% sparsity of 20 blocks.
  TestArena t(Geo(64 * 20, 640), Pol(0.9));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  SetBlockScores(t, std::vector<float>(20, 1.0f), 1280);
  OneSeqStep s{0, 1280, 1279};
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected().size(), 10u);
}

TEST(Select, TiesGoToTheLowerBlockId) {
  TestArena t(Geo(64 * 10), Pol(0.7));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  // m = 3: query block 9 and the two lowest ids among the equal blocks 1, 3, 4, 6.
  SetBlockScores(t, {0, 5, 0, 5, 5, 0, 5, 0, 0, 0}, 640);
  OneSeqStep s{0, 640, 639};
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected(), (std::vector<int>{1, 3, 9}));
}

TEST(Select, PartialLastBlockPoolsOnlyValidSlots) {
  // 3 full blocks + 10 slots of block 3. A huge V in slot 3*64+20 (beyond the context) must not
  // count; a high slot inside the partial block must.
  TestArena t(Geo(64 * 8), Pol(0.5));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  const int n = 64 * 3 + 10;
  for (int i = 0; i < 64 * 8; ++i) t.Set(0, 0, 0, i, 0.0f);
  t.Set(0, 0, 0, 64 * 3 + 20, 100.0f);
  t.Set(0, 0, 0, 64 * 1 + 5, 2.0f);
  t.SetFresh(0, 0, false);
  // Query in block 0, so the partial block 3 must win on its own scores: B = 4, m = 2.
  OneSeqStep s{0, n, 10};
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected(), (std::vector<int>{0, 1}));
  // Now make a slot inside the partial block the best: it is chosen and its compacted row is
  // 64 (block 0) + 10 (partial block 3).
  t.Set(0, 0, 0, 64 * 3 + 9, 50.0f);
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected(), (std::vector<int>{0, 3}));
  EXPECT_EQ(t.view().compact_len[0], 74);
}

TEST(Select, UnsetStatisticsAreScoredFirst) {
  TestArena t(Geo(64 * 6), Pol(0.5));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  const int n = 64 * 6;
  // Everything observed and low, except block 2 where V and D are both unset (no evidence)
  // and block 4 where V is unset but D (the diagonal term) is high.
  for (int i = 0; i < n; ++i) {
    t.Set(0, 0, 0, i, 1.0f);
    t.Set(0, 0, 1, i, -1.0f);
  }
  t.SetFresh(0, 0, false);
  const int q = n - 1;
  for (int i = 128; i < 192; ++i) {
    t.Set(0, 0, 0, i, NAN);
    t.Set(0, 0, 1, q - i, NAN);
  }
  t.Set(0, 0, 0, 4 * 64 + 3, NAN);
  t.Set(0, 0, 1, q - (4 * 64 + 3), 5.0f);
  // m = 3: query block 5, then block 2 (+inf), then block 4 (5.0 > 1.0).
  OneSeqStep s{0, n, q};
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected(), (std::vector<int>{2, 4, 5}));
}

TEST(Select, DiagonalTermUsesTheOffsetFromTheQuery) {
  TestArena t(Geo(64 * 8), Pol(0.75));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  const int n = 64 * 8, q = n - 1;
  for (int i = 0; i < n; ++i) {
    t.Set(0, 0, 0, i, 0.0f);
    t.Set(0, 0, 1, i, 0.0f);
  }
  t.SetFresh(0, 0, false);
  t.Set(0, 0, 1, 300, 9.0f);  // offset 300 from the query: slot 211, block 3
  OneSeqStep s{0, n, q};
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected(), (std::vector<int>{3, 7}));
}

TEST(Select, QueryBlockIsForcedEvenWhenItScoresLowest) {
  TestArena t(Geo(64 * 12), Pol(0.8));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  SetBlockScores(t, {9, 8, 7, 6, 5, 4, 3, 2, 1, -5}, 640);
  // Query slot 300 sits in block 4 although the context has 10 blocks: m = 2 -> {0, 4}.
  OneSeqStep s{0, 640, 300};
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected(), (std::vector<int>{0, 4}));
  // The query block is clamped to the last block when q lies past the context.
  s.q = 700;
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected(), (std::vector<int>{0, 9}));
}

std::vector<int> ExploreRun(uint64_t seed, uint64_t key, uint32_t step_skip = 0) {
  Geometry g = Geo(64 * 200);
  TestArena t(g, Pol(0.5, 0.2), seed);
  EXPECT_TRUE(t.dp().ResetSequence(0, key).ok());
  std::vector<float> s(200);
  for (int j = 0; j < 200; ++j) s[j] = static_cast<float>(200 - j);
  SetBlockScores(t, s, 64 * 200);
  OneSeqStep st{0, 64 * 200, 64 * 200 - 1};
  for (uint32_t i = 0; i <= step_skip; ++i) {
    EXPECT_TRUE(t.dp().BeginStep(st.batch()).ok());
  }
  EXPECT_TRUE(t.dp().Select(0).ok());
  return t.Selected();
}

TEST(Select, ExplorationCountAndDeterminism) {
  // m = 100, m_e = 20: query block 199, top 79 blocks 0..78, 20 explored among 79..198.
  const std::vector<int> a = ExploreRun(11, 5);
  ASSERT_EQ(a.size(), 100u);
  int explored = 0;
  for (int j : a) {
    if (j >= 79 && j < 199) ++explored;
  }
  EXPECT_EQ(explored, 20);
  for (int j = 0; j < 79; ++j) EXPECT_TRUE(std::binary_search(a.begin(), a.end(), j)) << j;
  EXPECT_TRUE(std::binary_search(a.begin(), a.end(), 199));
  EXPECT_EQ(a, ExploreRun(11, 5));     // same seed and key: same blocks
  EXPECT_NE(a, ExploreRun(11, 6));     // other sequence key: other blocks
  EXPECT_NE(a, ExploreRun(12, 5));     // other session seed: other blocks
  EXPECT_NE(a, ExploreRun(11, 5, 1));  // next step: other blocks
}

// The expected draws come from the oracle's own Philox and key derivation (oracle.h), not from
// the numerics the data plane uses.
TEST(Select, ExploredBlocksAreTheSmallestDraws) {
  const uint64_t seed = 3, key = 4;
  const std::vector<int> a = ExploreRun(seed, key);
  std::vector<std::pair<uint64_t, int>> draws;
  for (int j = 79; j < 199; ++j) {
    draws.push_back({OracleExplorationDraw(OracleExplorationKey(seed, key), 0, 0, 0, j), j});
  }
  std::sort(draws.begin(), draws.end());
  std::vector<int> want(79);
  for (int j = 0; j < 79; ++j) want[j] = j;
  for (int k = 0; k < 20; ++k) want.push_back(draws[k].second);
  want.push_back(199);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(a, want);
}

TEST(Select, ProbeStepIsDense) {
  TestArena t(Geo(64 * 10), Pol(0.6, 0.0, 4));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  SetBlockScores(t, {0, 1, 9, 2, 3, 8, 1, 7, 0, 0}, 640);
  OneSeqStep s{0, 640, 639};
  for (int step = 0; step < 9; ++step) {
    ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
    ASSERT_TRUE(t.dp().Select(0).ok());
    EXPECT_EQ(t.Selected().size(), step % 4 == 0 ? 10u : 4u) << "step " << step;
  }
  EXPECT_EQ(t.view().stats[0].dense_steps, 3u);
}

TEST(Select, MtpRowsSelectIndependentlyAndShareTheUnion) {
  TestArena t(Geo(64 * 10, 64, 2), Pol(0.8));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  const int n = 64 * 9;  // row 0: 576 slots (9 blocks), row 1: 577 (10 blocks)
  for (int i = 0; i < 640; ++i) t.Set(0, 0, 0, i, 0.0f);
  t.Set(0, 0, 0, 64 * 2, 5.0f);  // block 2: best for both rows
  t.SetFresh(0, 0, false);
  OneSeqStep s{0, n, n - 1};
  ASSERT_TRUE(t.dp().BeginStep(s.batch(2)).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  // Row 0: m = ceil(0.2 * 9) = 2 -> {2, 8}; row 1: m = 2 -> {2, 9}. Union {2, 8, 9}.
  EXPECT_EQ(t.Selected(), (std::vector<int>{2, 8, 9}));
  EXPECT_EQ(t.view().compact_len[0], 128);  // row 0 sees blocks 2 and 8
  EXPECT_EQ(t.view().compact_len[1], 129);  // row 1 also sees the one slot of block 9
}

TEST(Select, CompactedPhysicalTableAndRemap) {
  TestArena t(Geo(64 * 10), Pol(0.6));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  SetBlockScores(t, {0, 1, 9, 2, 3, 8, 1, 7, 0, 0}, 620);
  OneSeqStep s{0, 620, 619};  // last block 9 holds 44 slots
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  std::vector<int32_t> table(t.view().max_blocks);
  for (size_t j = 0; j < table.size(); ++j) table[j] = 1000 + 3 * static_cast<int>(j);
  ASSERT_TRUE(t.dp().Select(0, table.data(), table.size()).ok());
  ASSERT_EQ(t.Selected(), (std::vector<int>{2, 5, 7, 9}));
  const int32_t* phys = t.view().phys;
  EXPECT_EQ(std::vector<int>(phys, phys + 4), (std::vector<int>{1006, 1015, 1021, 1027}));
  EXPECT_EQ(t.view().compact_len[0], 64 * 3 + 44);
  std::vector<int32_t> idx = {0, 63, 64, 130, 192, 235, 236, -1};
  ASSERT_TRUE(t.dp().Remap(idx.data(), static_cast<int32_t>(idx.size())).ok());
  EXPECT_EQ(idx, (std::vector<int32_t>{128, 191, 320, 450, 576, 619, -1, -1}));
}

// The engine's table given at BeginStep (StepBatch::block_table) is what a Select without a
// table of its own publishes through; a Select's own table still wins; a stride below the
// session's max blocks is refused and the step is not begun (nothing changes).
TEST(Select, TheStepsBlockTableServesEverySelectWithoutOne) {
  TestArena t(Geo(64 * 10), Pol(0.6));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  SetBlockScores(t, {0, 1, 9, 2, 3, 8, 1, 7, 0, 0}, 620);
  const int32_t mb = static_cast<int32_t>(t.view().max_blocks);
  std::vector<int32_t> table(mb), other(mb);
  for (int j = 0; j < mb; ++j) table[j] = 1000 + 3 * j, other[j] = 7 * j;
  OneSeqStep s{0, 620, 619};
  StepBatch bad = s.batch();
  bad.block_table = table.data();
  bad.table_stride = mb - 1;
  const absl::Status refused = t.dp().BeginStep(bad);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("stride"), std::string::npos) << refused;
  EXPECT_EQ(t.view().seqs[0].steps, 0u) << "a refused step advances nothing";
  StepBatch b = s.batch();
  b.block_table = table.data();
  b.table_stride = mb;
  ASSERT_TRUE(t.dp().BeginStep(b).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  ASSERT_EQ(t.Selected(), (std::vector<int>{2, 5, 7, 9}));
  const int32_t* phys = t.view().phys;
  EXPECT_EQ(std::vector<int>(phys, phys + 4), (std::vector<int>{1006, 1015, 1021, 1027}));
  ASSERT_TRUE(t.dp().Select(0, other.data(), mb).ok());
  EXPECT_EQ(std::vector<int>(phys, phys + 4), (std::vector<int>{14, 35, 49, 63}));
  // The next step without a table: a Select without one fills no physical table.
  OneSeqStep s2{0, 621, 620};
  ASSERT_TRUE(t.dp().BeginStep(s2.batch()).ok());
  std::vector<int32_t> before(phys, phys + 4);
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(std::vector<int>(phys, phys + 4), std::vector<int>(before.begin(), before.end()));
}

// An entry without a sequence (seq -1) is served dense over its ctx_len slots and touches no
// state: ctx_len 0 is an empty entry (padding); a positive one selects every block of its rows,
// through the table, with identity remap; nothing is counted, observed or advanced.
TEST(Select, EntriesWithoutASequenceAreServedDense) {
  TestArena t(Geo(64 * 4, 64, 2, 3), Pol(0.5));
  ASSERT_TRUE(t.dp().ResetSequence(2, 1).ok());
  const int32_t mb = static_cast<int32_t>(t.view().max_blocks);
  std::vector<int32_t> table(3 * mb);
  for (int j = 0; j < 3 * mb; ++j) table[j] = 100 + j;
  int32_t seq[3] = {-1, 2, -1}, ctx[3] = {0, 200, 129}, q[3] = {0, 199, 0};
  StepBatch b{seq, ctx, q, 3, 2};
  b.block_table = table.data();
  b.table_stride = mb;
  ASSERT_TRUE(t.dp().BeginStep(b).ok());
  ASSERT_TRUE(t.dp().Select(1).ok());
  EXPECT_EQ(t.view().union_count[0], 0);
  EXPECT_EQ(t.view().compact_len[0], 0);
  EXPECT_EQ(t.view().compact_len[1], 0);
  EXPECT_EQ(t.Selected(2), Range(0, 3));  // rows of 129 and 130 slots
  EXPECT_EQ(t.view().compact_len[2 * 2 + 0], 129);
  EXPECT_EQ(t.view().compact_len[2 * 2 + 1], 130);
  const int32_t* phys = t.view().phys + 2 * mb;
  EXPECT_EQ(std::vector<int>(phys, phys + 3),
            (std::vector<int>{100 + 2 * mb, 101 + 2 * mb, 102 + 2 * mb}));
  EXPECT_EQ(t.view().stats[1].steps, 1u) << "only the sequence's entry is counted";
  // Remap: identity for the dense entry (within its row's length), -1 for the empty one.
  std::vector<int32_t> idx(3 * 2 * 4, 0);
  for (int r = 0; r < 6; ++r) {
    idx[r * 4 + 0] = 0, idx[r * 4 + 1] = 128, idx[r * 4 + 2] = 129, idx[r * 4 + 3] = -1;
  }
  ASSERT_TRUE(t.dp().Remap(idx.data(), 4).ok());
  EXPECT_EQ(std::vector<int32_t>(idx.begin(), idx.begin() + 4), (std::vector<int32_t>{-1, -1, -1, -1}));
  EXPECT_EQ(std::vector<int32_t>(idx.begin() + 16, idx.begin() + 20),
            (std::vector<int32_t>{0, 128, -1, -1}));
  EXPECT_EQ(std::vector<int32_t>(idx.begin() + 20, idx.begin() + 24),
            (std::vector<int32_t>{0, 128, 129, -1}));
}

// A step of entries without sequences is the dense indexer's step: every block of every entry,
// and the arena's SPIN state (records, sequences, statistics) is the same after its Select and
// Observe as before it. A ctx_len out of range is refused and changes nothing.
TEST(Select, AStepWithoutSequencesIsDenseAndChangesNoState) {
  TestArena t(Geo(64 * 4, 64, 1, 2), Pol(0.75, 0.0, 2));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  ASSERT_TRUE(t.dp().ResetSequence(1, 2).ok());
  SetBlockScores(t, {1, 2, 3, 4}, 256, 0, 0);
  int32_t seq[2] = {-1, -1}, ctx[2] = {256, 70}, q[2] = {0, 0};
  int32_t bad_ctx[2] = {256, 257};
  const std::vector<uint8_t> before = t.Snapshot();
  const absl::Status refused = t.dp().BeginStep(StepBatch{seq, bad_ctx, q, 2, 1});
  EXPECT_EQ(refused.code(), absl::StatusCode::kOutOfRange) << refused;
  EXPECT_NE(refused.message().find("padding ctx_len 257"), std::string::npos) << refused;
  EXPECT_EQ(t.Snapshot(), before) << "a refused step changes nothing";
  ASSERT_TRUE(t.dp().BeginStep(StepBatch{seq, ctx, q, 2, 1}).ok());
  const SeqRecord s0 = t.view().seqs[0];
  const std::vector<uint8_t> begun = t.Snapshot();
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected(0), Range(0, 4));
  EXPECT_EQ(t.Selected(1), Range(0, 2));
  std::vector<float> logits(2 * 256, 1.0f);
  ASSERT_TRUE(t.dp().Observe(0, logits.data(), 256).ok());
  EXPECT_EQ(t.view().seqs[0].steps, s0.steps);
  EXPECT_EQ(t.view().stats[0].steps, 0u);
  EXPECT_EQ(t.view().stats[0].observed, 0u);
  // Only the outputs and the step header moved: the state records are as they were.
  const ArenaView& v = t.view();
  const uint8_t* rec = reinterpret_cast<const uint8_t*>(v.StateRecord(0, 0));
  const uint8_t* base = reinterpret_cast<const uint8_t*>(v.header);
  const size_t off = static_cast<size_t>(rec - base);
  EXPECT_TRUE(std::equal(begun.begin() + off, begun.begin() + off + 2 * 256 * 4,
                         reinterpret_cast<const uint8_t*>(rec)));
}

TEST(Select, Bf16StateSelectsLikeFp32OnRepresentableScores) {
  for (StateDtype dt : {StateDtype::kFp32, StateDtype::kBf16}) {
    TestArena t(Geo(64 * 10, 64, 1, 1, 2, dt), Pol(0.6));
    ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
    SetBlockScores(t, {0, 1, 9, 2, 3, 8, 1, 7, 0, 0}, 640);
    OneSeqStep s{0, 640, 639};
    ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
    ASSERT_TRUE(t.dp().Select(0).ok());
    EXPECT_EQ(t.Selected(), (std::vector<int>{2, 5, 7, 9}));
  }
}

}  // namespace
}  // namespace spin::testing
