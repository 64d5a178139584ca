// Observation rules of docs/design.md §5 (EMA, non-finite scores, MTP prefix-valid replay, probe
// miss curves, reset) and the no-change guarantee of rejected calls, on the CPU backend.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "test_arena.h"

namespace spin::testing {
namespace {

Geometry Geo(uint32_t slots, uint32_t topk = 64, uint32_t rows = 1, uint32_t seqs = 1,
             StateDtype dt = StateDtype::kFp32) {
  Geometry g;
  g.layers = 2;
  g.max_seqs = seqs;
  g.max_slots = slots;
  g.block_size = 64;
  g.topk = topk;
  g.max_rows = rows;
  g.dtype = dt;
  return g;
}

Policy Pol(double rho, float alpha = 0.75f, uint32_t period = 0) {
  Policy p;
  p.target_sparsity = rho;
  p.exploration = 0.0;
  p.alpha = alpha;
  p.probe_period = period;
  return p;
}

TEST(Observe, FirstObservationSetsThenEmaBlends) {
  TestArena t(Geo(128), Pol(0.5, 0.75f));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  OneSeqStep s{0, 100, 99};
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());  // fresh: dense, compacted == logical
  std::vector<float> z(100);
  for (int i = 0; i < 100; ++i) z[i] = static_cast<float>(i);
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 100).ok());
  EXPECT_FALSE(t.Fresh(0, 0));
  EXPECT_TRUE(t.Fresh(0, 1));
  EXPECT_EQ(t.Get(0, 0, 0, 10), 10.0f);          // V[10] = z
  EXPECT_EQ(t.Get(0, 0, 1, 89), 10.0f);          // D[99 - 10] = z
  EXPECT_TRUE(std::isnan(t.Get(0, 0, 0, 100)));  // beyond the context: untouched
  // Second step, one slot further: V blends 0.75 * old + 0.25 * new.
  s.ctx = 101;
  s.q = 100;
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  // B = 2, rho 0.5 -> m = max(1, 1) = 1... the floor ceil(64/64) = 1; query block 1 only.
  ASSERT_EQ(t.Selected(), (std::vector<int>{1}));
  std::vector<float> z2(64, 0.0f);
  for (int c = 0; c < 37; ++c) z2[c] = 4.0f;
  ASSERT_TRUE(t.dp().Observe(0, z2.data(), 64).ok());
  EXPECT_EQ(t.Get(0, 0, 0, 64), 49.0f);  // 0.75 * 64 + 0.25 * 4, exact
  EXPECT_EQ(t.Get(0, 0, 0, 10), 10.0f);  // not scored this step: unchanged
  EXPECT_EQ(t.Get(0, 0, 0, 100), 4.0f);  // first observation of slot 100
  EXPECT_EQ(t.view().stats[0].observed, 100u + 37u);
}

TEST(Observe, NonFiniteScoresAreSkippedAndCounted) {
  TestArena t(Geo(128), Pol(0.0));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  OneSeqStep s{0, 8, 7};
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  std::vector<float> z = {1, NAN, INFINITY, -INFINITY, 5, 6, 7, 8};
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 8).ok());
  EXPECT_EQ(t.view().stats[0].bad_scores, 3u);
  EXPECT_EQ(t.view().stats[0].observed, 5u);
  EXPECT_TRUE(std::isnan(t.Get(0, 0, 0, 1)));
  EXPECT_TRUE(std::isnan(t.Get(0, 0, 0, 2)));
  EXPECT_TRUE(std::isnan(t.Get(0, 0, 1, 7 - 3)));
  EXPECT_EQ(t.Get(0, 0, 0, 4), 5.0f);
  // A later finite score still sets the skipped slot as a first observation.
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  std::vector<float> z2(8, 2.0f);
  ASSERT_TRUE(t.dp().Observe(0, z2.data(), 8).ok());
  EXPECT_EQ(t.Get(0, 0, 0, 1), 2.0f);
}

TEST(Observe, MtpReplaysOnlyAcceptedRowsInOrder) {
  const float alpha = 0.5f;
  TestArena t(Geo(256, 64, 3), Pol(0.0, alpha));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  OneSeqStep s{0, 100, 99};  // rows see 100, 101, 102 slots
  ASSERT_TRUE(t.dp().BeginStep(s.batch(3)).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  ASSERT_EQ(t.Selected(), (std::vector<int>{0, 1}));
  const int stride = 128;
  std::vector<float> z(3 * stride, 0.0f);
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < 100 + r; ++i) z[r * stride + i] = static_cast<float>(10 * (r + 1));
  }
  int32_t accepted = 2;
  ASSERT_TRUE(t.dp().Observe(0, z.data(), stride, &accepted).ok());
  // Slot 5: row 0 sets 10, row 1 blends 0.5 * 10 + 0.5 * 20 = 15; row 2 is rejected.
  EXPECT_EQ(t.Get(0, 0, 0, 5), 15.0f);
  // Slot 100 exists for rows 1 and 2 only: row 1 sets it; row 2 must not.
  EXPECT_EQ(t.Get(0, 0, 0, 100), 20.0f);
  EXPECT_TRUE(std::isnan(t.Get(0, 0, 0, 101)));
  // D: row 0 (q = 99) sets D[94] from slot 5 -> 10; row 1 (q = 100) sets D[95] from slot 5 ->
  // 20 and blends D[94] with slot 6 -> 15. D[0] came from slots 99 and 100.
  EXPECT_EQ(t.Get(0, 0, 1, 94), 15.0f);
  EXPECT_EQ(t.Get(0, 0, 1, 95), 15.0f);          // row 0 slot 4 -> 10, row 1 slot 5 -> blend 15
  EXPECT_TRUE(std::isnan(t.Get(0, 0, 1, 101)));  // only row 2 reaches offset 101
  // With accepted = 0 nothing changes and the pair stays fresh.
  TestArena u(Geo(256, 64, 3), Pol(0.0, alpha));
  ASSERT_TRUE(u.dp().ResetSequence(0, 1).ok());
  ASSERT_TRUE(u.dp().BeginStep(s.batch(3)).ok());
  ASSERT_TRUE(u.dp().Select(0).ok());
  const std::vector<uint8_t> before = u.Snapshot();
  int32_t none = 0;
  ASSERT_TRUE(u.dp().Observe(0, z.data(), stride, &none).ok());
  EXPECT_TRUE(u.Fresh(0, 0));
  EXPECT_TRUE(std::isnan(u.Get(0, 0, 0, 5)));
  // Not a byte of the arena changed: state, summaries, statistics, curves, outputs.
  EXPECT_TRUE(u.Snapshot() == before) << "Observe with accepted = 0 changed the arena";
}

// The engine contract for MTP: acceptance is unknown when a layer observes, so Observe without
// accepted counts applies row 0 only: byte for byte what accepted = 1 does, and not what
// accepting every row does.
TEST(Observe, WithoutAcceptedCountsOnlyRowZeroIsApplied) {
  OneSeqStep s{0, 100, 99};
  const int stride = 128;
  std::vector<float> z(3 * stride, 0.0f);
  for (int r = 0; r < 3; ++r) {
    for (int i = 0; i < 100 + r; ++i) z[r * stride + i] = static_cast<float>(10 * (r + 1) + i % 7);
  }
  auto run = [&](const int32_t* accepted) {
    auto t = std::make_unique<TestArena>(Geo(256, 64, 3), Pol(0.0, 0.5f));
    EXPECT_TRUE(t->dp().ResetSequence(0, 1).ok());
    EXPECT_TRUE(t->dp().BeginStep(s.batch(3)).ok());
    EXPECT_TRUE(t->dp().Select(0).ok());
    EXPECT_TRUE(t->dp().Observe(0, z.data(), stride, accepted).ok());
    return t;
  };
  const int32_t one = 1, all = 3;
  auto none = run(nullptr);
  auto row0 = run(&one);
  auto every = run(&all);
  EXPECT_TRUE(none->Snapshot() == row0->Snapshot()) << "no accepted counts != accepted 1";
  EXPECT_FALSE(none->Snapshot() == every->Snapshot()) << "draft rows were applied";
  EXPECT_EQ(none->Get(0, 0, 0, 5), 15.0f);           // row 0's score, 10 + 5 % 7
  EXPECT_TRUE(std::isnan(none->Get(0, 0, 0, 100)));  // only draft rows reach slot 100
  EXPECT_FALSE(none->Fresh(0, 0));
}

// The probe tests' sequence: 10 blocks, K = 128 (2 blocks at least), probe period 2, target 0.5.
// Prediction: block b scores 10 - b except the query block 9. Its first step (a probe step) is
// begun and layer 0 selected (densely).
void BeginProbeStep(TestArena& t, const OneSeqStep& s) {
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  for (int i = 0; i < 640; ++i) t.Set(0, 0, 0, i, static_cast<float>(10 - i / 64));
  t.SetFresh(0, 0, false);
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());  // step 0: probe
  ASSERT_TRUE(t.dp().Select(0).ok());
  ASSERT_EQ(t.Selected().size(), 10u);
}

// The same sequence's first step, its pair still fresh (scored densely without a ranking):
// reset, step 0 (a probe step) begun and layer 0 selected.
void BeginFreshProbeStep(TestArena& t, const OneSeqStep& s) {
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
}

// The probe tests' logits: the dense top-K lies in blocks 0 and 5 (64 slots each).
std::vector<float> ProbeLogits() {
  std::vector<float> z(640, 0.0f);
  for (int i = 0; i < 64; ++i) z[i] = 100.0f;
  for (int i = 320; i < 384; ++i) z[i] = 90.0f;
  return z;
}

TEST(Observe, ProbeStepAccumulatesTheMissCurve) {
  TestArena t(Geo(640, 128), Pol(0.5, 0.5f, 2));
  OneSeqStep s{0, 640, 639};
  ASSERT_NO_FATAL_FAILURE(BeginProbeStep(t, s));
  const std::vector<float> z = ProbeLogits();
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 640).ok());
  const uint64_t* curve = t.view().curves;
  // Ranking: 9 (query), 0, 1, 2, 3, 4, 5, ... keep f -> m = max(2, ceil(10 f)).
  // m <= 6 keeps block 0 only (64 missed); m >= 7 keeps both (0 missed).
  for (int p = 0; p < kCurvePoints; ++p) {
    const int m = KeptBlocks(10, 128, 64, 1.0 - CurveKeepFraction(p));
    EXPECT_EQ(curve[p], m >= 7 ? 0u : 64u) << "keep " << CurveKeepFraction(p);
  }
  EXPECT_EQ(t.view().stats[0].probe_steps, 1u);
  EXPECT_EQ(t.view().stats[0].probe_topk, 128u);
  EXPECT_EQ(t.view().stats[0].probe_missed, 64u);  // rho 0.5 -> m = 5
  // The probe step also updated the state from every slot.
  EXPECT_EQ(t.Get(0, 0, 0, 0), 55.0f);  // 0.5 * 10 + 0.5 * 100, exact
  // Step 1 is not a probe step: the curve stays.
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.Selected().size(), 5u);
  std::vector<float> zc(5 * 64, 1.0f);
  ASSERT_TRUE(t.dp().Observe(0, zc.data(), 5 * 64).ok());
  EXPECT_EQ(t.view().stats[0].probe_steps, 1u);
}

TEST(Observe, FreshProbeStepTakesNoCurveSample) {
  TestArena t(Geo(640, 128), Pol(0.5, 0.5f, 2));
  OneSeqStep s{0, 640, 639};
  ASSERT_NO_FATAL_FAILURE(BeginFreshProbeStep(t, s));
  std::vector<float> z(640, 1.0f);
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 640).ok());
  EXPECT_EQ(t.view().stats[0].probe_steps, 0u);
  EXPECT_EQ(t.view().curves[0], 0u);
}

// RemapTopK: the engine's top-K given for the probe (docs/design.md §5, "given by the engine") is
// what the curve counts, once per selection, and the layer's Observe then computes none. Here the
// engine's top-K (blocks 0 and 8, some padding and an index past the row) differs from the
// logits' dense top-K (blocks 0 and 5), so the counts show which one was used.
TEST(Observe, ProbeCountsTheEngineTopKGivenToRemapTopK) {
  TestArena t(Geo(640, 128), Pol(0.5, 0.5f, 2));
  OneSeqStep s{0, 640, 639};
  ASSERT_NO_FATAL_FAILURE(BeginProbeStep(t, s));
  const uint64_t* curve = t.view().curves;
  const LayerStats& st = t.view().stats[0];
  std::vector<int32_t> topk(140, -1);  // compacted = logical: the probing row is dense
  for (int i = 0; i < 64; ++i) topk[i] = i, topk[64 + i] = 512 + i;
  topk[130] = 640;  // past the row: -1, not counted
  // Plain Remap maps and counts nothing.
  std::vector<int32_t> plain = topk;
  ASSERT_TRUE(t.dp().Remap(plain.data(), 140).ok());
  EXPECT_EQ(st.probe_steps, 0u);
  EXPECT_EQ(plain[130], -1);
  std::vector<int32_t> given = topk;
  ASSERT_TRUE(t.dp().RemapTopK(given.data(), 140).ok());
  EXPECT_EQ(given, plain);  // the same mapping
  // Ranking: 9 (query), 0, 1, ..., 8: block 8 is kept from m = 10 on, block 0 from m = 2.
  for (int p = 0; p < kCurvePoints; ++p) {
    const int m = KeptBlocks(10, 128, 64, 1.0 - CurveKeepFraction(p));
    EXPECT_EQ(curve[p], m >= 10 ? 0u : 64u) << "keep " << CurveKeepFraction(p);
  }
  EXPECT_EQ(st.probe_steps, 1u);
  EXPECT_EQ(st.probe_topk, 128u);   // the valid indices given
  EXPECT_EQ(st.probe_missed, 64u);  // rho 0.5 -> m = 5: block 8 is not kept
  // A second RemapTopK of the same selection only maps; Observe applies the EMA and counts no
  // top-K of its own (its logits' would miss 64 at m <= 6, not 64 up to m = 9).
  const std::vector<uint64_t> before(curve, curve + kCurvePoints);
  given = topk;
  ASSERT_TRUE(t.dp().RemapTopK(given.data(), 140).ok());
  const std::vector<float> z = ProbeLogits();
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 640).ok());
  EXPECT_EQ(std::vector<uint64_t>(curve, curve + kCurvePoints), before);
  EXPECT_EQ(st.probe_steps, 1u);
  EXPECT_EQ(t.Get(0, 0, 0, 0), 55.0f);  // the EMA as without the given top-K
  // Selected again, the layer counts a given top-K again: an empty one is a probe step of no
  // slots.
  ASSERT_TRUE(t.dp().Select(0).ok());
  std::vector<int32_t> none(8, -1);
  ASSERT_TRUE(t.dp().RemapTopK(none.data(), 8).ok());
  EXPECT_EQ(st.probe_steps, 2u);
  EXPECT_EQ(st.probe_topk, 128u);
  // Once per selection, whichever counts first: Observe after RemapTopK computes nothing, and
  // after Observe computed the top-K (selected again), RemapTopK and a second Observe count
  // nothing.
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 640).ok());
  EXPECT_EQ(st.probe_steps, 2u);
  ASSERT_TRUE(t.dp().Select(0).ok());
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 640).ok());
  EXPECT_EQ(st.probe_steps, 3u);
  const uint64_t topk_then = st.probe_topk;
  given = topk;
  ASSERT_TRUE(t.dp().RemapTopK(given.data(), 140).ok());
  EXPECT_EQ(given, plain);  // still mapped
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 640).ok());
  EXPECT_EQ(st.probe_steps, 3u);
  EXPECT_EQ(st.probe_topk, topk_then);
  // Without a Select in the step, RemapTopK is refused like Remap.
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  EXPECT_EQ(t.dp().RemapTopK(none.data(), 8).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.dp().RemapTopK(nullptr, 8).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.dp().RemapTopK(nullptr, 8).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.dp().RemapTopK(none.data(), -1).code(), absl::StatusCode::kInvalidArgument);
}

// RemapAndObserve is RemapTopK then Observe, byte for byte; each bad argument (of either call)
// is refused before anything runs: the arena and the top-K buffer unchanged.
TEST(Observe, RemapAndObserveIsRemapTopKThenObserveAndRefusesAsAWhole) {
  TestArena one(Geo(640, 128), Pol(0.5, 0.5f, 2)), two(Geo(640, 128), Pol(0.5, 0.5f, 2));
  OneSeqStep s{0, 640, 639};
  ASSERT_NO_FATAL_FAILURE(BeginProbeStep(one, s));
  ASSERT_NO_FATAL_FAILURE(BeginProbeStep(two, s));
  std::vector<int32_t> topk(140, -1);
  for (int i = 0; i < 64; ++i) topk[i] = i, topk[64 + i] = 512 + i;
  const std::vector<float> z = ProbeLogits();
  // Refusals first, on `one`: nothing changes.
  const std::vector<uint8_t> before = one.Snapshot();
  std::vector<int32_t> idx = topk;
  EXPECT_EQ(one.dp().RemapAndObserve(2, idx.data(), 140, z.data(), 640).code(),
            absl::StatusCode::kOutOfRange);
  EXPECT_EQ(one.dp().RemapAndObserve(1, idx.data(), 140, z.data(), 640).code(),
            absl::StatusCode::kFailedPrecondition);  // layer 1 is not the selected one
  EXPECT_EQ(one.dp().RemapAndObserve(0, nullptr, 140, z.data(), 640).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(one.dp().RemapAndObserve(0, idx.data(), -1, z.data(), 640).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(one.dp().RemapAndObserve(0, idx.data(), 140, z.data(), 639).code(),
            absl::StatusCode::kInvalidArgument);  // the logits stride below the dense row
  const int32_t bad_accepted = 2;
  EXPECT_EQ(one.dp().RemapAndObserve(0, idx.data(), 140, z.data(), 640, &bad_accepted).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(idx, topk);
  EXPECT_TRUE(one.Snapshot() == before);
  // The one call against the two.
  ASSERT_TRUE(one.dp().RemapAndObserve(0, idx.data(), 140, z.data(), 640).ok());
  std::vector<int32_t> idx2 = topk;
  ASSERT_TRUE(two.dp().RemapTopK(idx2.data(), 140).ok());
  ASSERT_TRUE(two.dp().Observe(0, z.data(), 640).ok());
  EXPECT_EQ(idx, idx2);
  EXPECT_TRUE(one.Snapshot() == two.Snapshot());
  EXPECT_EQ(one.view().stats[0].probe_topk, 128u);  // the given top-K was counted
}

// Without RemapTopK, or when the pair does not probe, nothing is counted at the remap; a fresh
// pair's given top-K is not a probe either.
TEST(Observe, RemapTopKOfAPairThatDoesNotProbeCountsNothing) {
  TestArena t(Geo(640, 128), Pol(0.5, 0.5f, 2));
  OneSeqStep s{0, 640, 639};
  ASSERT_NO_FATAL_FAILURE(BeginFreshProbeStep(t, s));
  std::vector<int32_t> topk(128);
  for (int i = 0; i < 128; ++i) topk[i] = i;
  ASSERT_TRUE(t.dp().RemapTopK(topk.data(), 128).ok());
  EXPECT_EQ(t.view().stats[0].probe_steps, 0u);
  std::vector<float> z(640, 1.0f);
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 640).ok());
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());  // step 1: no probe
  ASSERT_TRUE(t.dp().Select(0).ok());
  for (int i = 0; i < 128; ++i) topk[i] = i;
  ASSERT_TRUE(t.dp().RemapTopK(topk.data(), 128).ok());
  EXPECT_EQ(t.view().stats[0].probe_steps, 0u);
  EXPECT_EQ(t.view().curves[0], 0u);
}

// A sparse step's top-K given to RemapTopK measures the step's miss from row 0's exploration
// blocks (docs/budgets.md, "Measured between probes"): each top-K slot in an explored block
// stands for (unranked - explored) / explored more in the unexplored blocks. B = 64 blocks,
// rho 0.5 -> m = 32 kept, exploration 0.25 -> 8 explored and 24 ranked (the query block 63 and
// the 23 best others, 40..62: the state scores block j as j), so 40 blocks are unranked and a
// hit weighs (40 - 8) / 8 = 4 slots. Counted once per selection, on sparse pairs only.
TEST(Observe, SparseRemapTopKEstimatesTheMissFromExplorationBlocks) {
  Policy p = Pol(0.5, 0.5f, 0);
  p.exploration = 0.25;
  TestArena t(Geo(4096, 128), p);
  ASSERT_TRUE(t.dp().ResetSequence(0, 7).ok());
  OneSeqStep s{0, 4095, 4094};
  std::vector<float> z(4096);
  for (int i = 0; i < 4096; ++i) z[i] = static_cast<float>(i / 64);
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());  // fresh: dense, estimates nothing
  ASSERT_TRUE(t.dp().Select(0).ok());
  std::vector<int32_t> dense_topk(128);
  for (int i = 0; i < 128; ++i) dense_topk[i] = i;
  ASSERT_TRUE(t.dp().RemapTopK(dense_topk.data(), 128).ok());
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 4096).ok());
  const LayerStats& st = t.view().stats[0];
  EXPECT_EQ(st.explore_steps, 0u);
  s = OneSeqStep{0, 4096, 4095};
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  const std::vector<int> ids = t.Selected();
  ASSERT_EQ(ids.size(), 32u);
  std::vector<int> explored, ranked;
  for (int c = 0; c < 32; ++c) (ids[c] < 40 ? explored : ranked).push_back(c);
  ASSERT_EQ(explored.size(), 8u);
  ASSERT_EQ(ids[ranked.front()], 40);
  // The given top-K, compacted: 3 slots in explored blocks, 100 in ranked ones, 2 past the row
  // (not valid) and padding.
  std::vector<int32_t> topk(110, -1);
  topk[0] = explored[0] * 64 + 5, topk[1] = explored[0] * 64 + 6, topk[2] = explored[5] * 64;
  for (int i = 0; i < 100; ++i) topk[3 + i] = ranked[i % 24] * 64 + i / 24;
  topk[103] = 32 * 64, topk[104] = 40 * 64;
  std::vector<int32_t> plain = topk;
  ASSERT_TRUE(t.dp().Remap(plain.data(), 110).ok());  // a plain Remap counts nothing
  EXPECT_EQ(st.explore_steps, 0u);
  ASSERT_TRUE(t.dp().RemapTopK(topk.data(), 110).ok());
  EXPECT_EQ(topk, plain);
  EXPECT_EQ(st.explore_steps, 1u);
  EXPECT_EQ(st.explore_topk, 103u);
  EXPECT_EQ(st.explore_est, 3u * 4 * kExploreEstUnit);
  EXPECT_EQ(ExploreHitWeight(40, 8), 4 * kExploreEstUnit);
  EXPECT_EQ(st.probe_steps, 0u);
  // Once per selection: a second RemapTopK, and Observe, add nothing.
  topk = plain;
  ASSERT_TRUE(t.dp().RemapTopK(topk.data(), 110).ok());
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 4096).ok());
  EXPECT_EQ(st.explore_steps, 1u);
  EXPECT_EQ(st.explore_est, 3u * 4 * kExploreEstUnit);
  // Observe alone computes no sparse top-K: nothing is estimated.
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 4096).ok());
  EXPECT_EQ(st.explore_steps, 1u);
  // Without exploration there is nothing to estimate from.
  Policy q = p;
  q.exploration = 0;
  ASSERT_TRUE(WritePolicy(t.view(), q).ok());
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  topk.assign(8, 0);
  ASSERT_TRUE(t.dp().RemapTopK(topk.data(), 8).ok());
  EXPECT_EQ(st.explore_steps, 1u);
  EXPECT_EQ(st.explore_topk, 103u);
}

// The exploration estimate is row 0's alone: with MTP rows, a block row 0 explored counts as
// explored even when another row ranked it too. Two arenas fed the same row-0 history (one with a
// second query row, whose own blocks get non-finite scores so that both states stay equal) select
// the same row-0 blocks and, given the same row-0 top-K, estimate exactly the same miss.
TEST(Observe, TheExplorationEstimateIsRowZerosAloneWithMtpRows) {
  Policy p = Pol(0.6, 0.5f, 0);
  p.exploration = 0.2;
  TestArena one(Geo(64 * 48, 96, 1), p), two(Geo(64 * 48, 96, 3), p);
  ASSERT_TRUE(one.dp().ResetSequence(0, 11).ok());
  ASSERT_TRUE(two.dp().ResetSequence(0, 11).ok());
  std::mt19937 rng(5);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<float> truth(64 * 48);
  for (float& x : truth) x = noise(rng);
  const int32_t stride = 64 * 48;
  uint64_t hits_seen = 0;
  for (int t = 0; t < 400; ++t) {
    for (float& x : truth) x = 0.8f * x + 0.6f * noise(rng);
    const int32_t ctx = 64 * 40 + t;
    OneSeqStep s{0, ctx, ctx - 1};
    ASSERT_TRUE(one.dp().BeginStep(s.batch(1)).ok());
    ASSERT_TRUE(two.dp().BeginStep(s.batch(3)).ok());
    for (int32_t layer = 0; layer < 2; ++layer) {
      ASSERT_TRUE(one.dp().Select(layer).ok());
      ASSERT_TRUE(two.dp().Select(layer).ok());
      const std::vector<int> u1 = one.Selected(), u2 = two.Selected();
      // Row 0's top-K, given in each arena's compacted order: K slots of row 0's union by truth.
      std::vector<int32_t> slots;
      for (int j : u1) {
        for (int32_t i = j * 64; i < std::min((j + 1) * 64, ctx); ++i) slots.push_back(i);
      }
      std::sort(slots.begin(), slots.end(),
                [&](int32_t a, int32_t b) { return truth[a] > truth[b]; });
      slots.resize(std::min<size_t>(slots.size(), 96));
      auto compact = [](const std::vector<int>& u, int32_t slot) {
        const int k = static_cast<int>(std::lower_bound(u.begin(), u.end(), slot / 64) - u.begin());
        return k * 64 + slot % 64;
      };
      std::vector<int32_t> k1, k2(3 * 96, -1);
      for (int32_t slot : slots) k1.push_back(compact(u1, slot));
      for (size_t i = 0; i < slots.size(); ++i) k2[i] = compact(u2, slots[i]);
      ASSERT_TRUE(one.dp().RemapTopK(k1.data(), static_cast<int32_t>(k1.size())).ok());
      ASSERT_TRUE(two.dp().RemapTopK(k2.data(), 96).ok());
      // Scores of row 0's union in both; the second arena's other blocks (row 1's) get NaN.
      std::vector<float> z1(stride, NAN), z2(3 * stride, NAN);
      for (size_t k = 0; k < u1.size(); ++k) {
        for (int c = 0; c < 64 && u1[k] * 64 + c < ctx; ++c) z1[k * 64 + c] = truth[u1[k] * 64 + c];
      }
      for (size_t k = 0; k < u2.size(); ++k) {
        if (!std::binary_search(u1.begin(), u1.end(), u2[k])) continue;
        for (int c = 0; c < 64 && u2[k] * 64 + c < ctx; ++c) z2[k * 64 + c] = truth[u2[k] * 64 + c];
      }
      const int32_t acc = 1;
      ASSERT_TRUE(one.dp().Observe(layer, z1.data(), stride, &acc).ok());
      ASSERT_TRUE(two.dp().Observe(layer, z2.data(), stride, &acc).ok());
    }
  }
  for (int32_t layer = 0; layer < 2; ++layer) {
    const LayerStats &a = one.view().stats[layer], &b = two.view().stats[layer];
    EXPECT_EQ(a.explore_steps, b.explore_steps) << "layer " << layer;
    EXPECT_EQ(a.explore_topk, b.explore_topk) << "layer " << layer;
    EXPECT_EQ(a.explore_est, b.explore_est) << "layer " << layer;
    EXPECT_GT(a.explore_steps, 300u);
    hits_seen += a.explore_est;
  }
  EXPECT_GT(hits_seen, 0u) << "the top-K should reach some explored blocks";
}

// The probe's count at the current budget uses the budget the step's selection used: a policy
// written between Select and Observe applies from the next step, to the probe as to the
// selection.
TEST(Observe, ProbeMissesAtTheBudgetOfTheStep) {
  TestArena t(Geo(640, 128), Pol(0.5, 0.5f, 2));
  OneSeqStep s{0, 640, 639};
  ASSERT_NO_FATAL_FAILURE(BeginProbeStep(t, s));
  // At rho 0.3 the kept 7 blocks (9, 0 .. 5) would hold the whole top-K; the step's 0.5 keeps 5.
  ASSERT_TRUE(WritePolicy(t.view(), Pol(0.3, 0.5f, 2)).ok());
  const std::vector<float> z = ProbeLogits();
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 640).ok());
  EXPECT_EQ(t.view().stats[0].probe_steps, 1u);
  EXPECT_EQ(t.view().stats[0].probe_missed, 64u);
}

// Whether a pair probes is decided by its Select: a pair fresh at Select is scored densely
// without a ranking, so a second Observe of that selection (the pair no longer fresh) takes no
// curve sample either.
TEST(Observe, ProbeIsDecidedAtSelect) {
  TestArena t(Geo(640, 128), Pol(0.5, 0.5f, 2));
  OneSeqStep s{0, 640, 639};
  ASSERT_NO_FATAL_FAILURE(BeginFreshProbeStep(t, s));
  std::vector<float> z(640, 1.0f);
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 640).ok());
  EXPECT_FALSE(t.Fresh(0, 0));
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 640).ok());
  EXPECT_EQ(t.view().stats[0].probe_steps, 0u);
  // Selected again, the pair (no longer fresh, still a probe step) probes.
  ASSERT_TRUE(t.dp().Select(0).ok());
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 640).ok());
  EXPECT_EQ(t.view().stats[0].probe_steps, 1u);
}

TEST(Observe, ResetForgetsEverything) {
  TestArena t(Geo(128), Pol(0.0));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  OneSeqStep s{0, 100, 99};
  ASSERT_TRUE(t.dp().BeginStep(s.batch()).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  std::vector<float> z(100, 3.0f);
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 100).ok());
  ASSERT_FALSE(t.Fresh(0, 0));
  ASSERT_TRUE(t.dp().ResetSequence(0, 2).ok());
  EXPECT_TRUE(t.Fresh(0, 0));
  EXPECT_EQ(t.view().seqs[0].key, 2u);
  EXPECT_EQ(t.view().seqs[0].steps, 0u);
  for (int i = 0; i < 128; ++i) {
    EXPECT_TRUE(std::isnan(t.Get(0, 0, 0, i)));
    EXPECT_TRUE(std::isnan(t.Get(0, 0, 1, i)));
  }
  // The step begun before the reset no longer refers to the sequence.
  ASSERT_TRUE(t.dp().Select(0).ok());
  EXPECT_EQ(t.view().union_count[0], 0);
}

TEST(Observe, RejectedCallsChangeNothing) {
  TestArena t(Geo(256, 64, 2, 2), Pol(0.5));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  ASSERT_TRUE(t.dp().ResetSequence(1, 2).ok());
  int32_t seq[2] = {0, 1}, ctx[2] = {100, 100}, q[2] = {99, 99};
  ASSERT_TRUE(t.dp().BeginStep(StepBatch{seq, ctx, q, 2, 1}).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  const std::vector<uint8_t> before = t.Snapshot();
  auto same = [&] { return t.Snapshot() == before; };

  EXPECT_EQ(t.dp().ResetSequence(2, 0).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(t.dp().ResetSequence(-1, 0).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(t.dp().Select(2).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(t.dp().Select(-1).code(), absl::StatusCode::kOutOfRange);
  std::vector<float> z(2 * 2 * 128, 1.0f);
  EXPECT_EQ(t.dp().Observe(1, z.data(), 128).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t.dp().Observe(0, z.data(), 50).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.dp().Observe(0, nullptr, 128).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.dp().Observe(0, z.data(), -1).code(), absl::StatusCode::kInvalidArgument);
  int32_t bad_acc[2] = {1, 2};  // rows = 1
  EXPECT_EQ(t.dp().Observe(0, z.data(), 128, bad_acc).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(same());

  auto begin = [&](std::vector<int32_t> s, std::vector<int32_t> c, std::vector<int32_t> p,
                   int rows) {
    return t.dp().BeginStep(
        StepBatch{s.data(), c.data(), p.data(), static_cast<int32_t>(s.size()), rows});
  };
  EXPECT_EQ(begin({0, 2}, {10, 10}, {9, 9}, 1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(begin({0, 0}, {10, 10}, {9, 9}, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(begin({0, 1}, {10, 0}, {9, 9}, 1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(begin({0, 1}, {10, 256}, {9, 9}, 2).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(begin({0, 1}, {10, 10}, {9, -1}, 1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(begin({0, 1}, {10, 10}, {9, 255}, 2).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(begin({0, 1}, {10, 10}, {9, 9}, 3).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(begin({0, 1, -1}, {10, 10, 0}, {9, 9, 0}, 1).code(),
            absl::StatusCode::kInvalidArgument);  // more entries than max_seqs
  EXPECT_TRUE(same());

  TestArena u(Geo(256, 64, 1, 2), Pol(0.5));
  ASSERT_TRUE(u.dp().ResetSequence(0, 1).ok());
  const std::vector<uint8_t> ub = u.Snapshot();
  int32_t s2[2] = {0, 1}, c2[2] = {10, 10}, q2[2] = {9, 9};
  EXPECT_EQ(u.dp().BeginStep(StepBatch{s2, c2, q2, 2, 1}).code(),
            absl::StatusCode::kFailedPrecondition);  // sequence 1 never opened
  EXPECT_TRUE(u.Snapshot() == ub);
}

// A step of padding entries only still needs a logits buffer (the CUDA backend cannot tell on the
// host that nothing will be read; both backends refuse alike, cuda_parity_test.cc): refused, and
// nothing changes; with a buffer and stride 0 it is accepted and changes nothing.
TEST(Observe, APaddingOnlyStepStillNeedsLogits) {
  TestArena t(Geo(256, 64, 1, 2), Pol(0.5));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  int32_t seq[2] = {-1, -1}, ctx[2] = {0, 0}, q[2] = {0, 0};
  ASSERT_TRUE(t.dp().BeginStep(StepBatch{seq, ctx, q, 2, 1}).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  const std::vector<uint8_t> before = t.Snapshot();
  const absl::Status s = t.dp().Observe(0, nullptr, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("logits are required: a step of 2 entries"), std::string::npos) << s;
  EXPECT_TRUE(t.Snapshot() == before);
  const float none = 0.0f;
  EXPECT_TRUE(t.dp().Observe(0, &none, 0).ok());
  EXPECT_TRUE(t.Snapshot() == before);
}

TEST(Observe, SequencesAreIsolated) {
  TestArena t(Geo(256, 64, 1, 2), Pol(0.0));
  ASSERT_TRUE(t.dp().ResetSequence(0, 1).ok());
  ASSERT_TRUE(t.dp().ResetSequence(1, 2).ok());
  int32_t seq[2] = {1, 0}, ctx[2] = {10, 20}, q[2] = {9, 19};
  ASSERT_TRUE(t.dp().BeginStep(StepBatch{seq, ctx, q, 2, 1}).ok());
  ASSERT_TRUE(t.dp().Select(0).ok());
  std::vector<float> z(2 * 64);
  for (int c = 0; c < 64; ++c) {
    z[c] = 1.0f;       // entry 0 = sequence 1
    z[64 + c] = 2.0f;  // entry 1 = sequence 0
  }
  ASSERT_TRUE(t.dp().Observe(0, z.data(), 64).ok());
  EXPECT_EQ(t.Get(1, 0, 0, 3), 1.0f);
  EXPECT_EQ(t.Get(0, 0, 0, 3), 2.0f);
  EXPECT_TRUE(std::isnan(t.Get(1, 0, 0, 15)));  // sequence 1 has 10 slots
  EXPECT_EQ(t.Get(0, 0, 0, 15), 2.0f);
}

// Runs identical dense observations through fp32 and bf16 state: every bf16 value stays within
// its rounding of the fp32 value (relative 2^-8 per store, compounded over the EMA steps), and
// the selections made from the two states agree on nearly every block.
TEST(Observe, Bf16TracksFp32) {
  const int n = 64 * 64;
  TestArena f(Geo(n, 256, 1, 1, StateDtype::kFp32), Pol(0.0, 0.5f));
  TestArena h(Geo(n, 256, 1, 1, StateDtype::kBf16), Pol(0.0, 0.5f));
  std::mt19937 rng(5);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<float> base(n);
  for (float& b : base) b = 3.0f * noise(rng);
  for (TestArena* t : {&f, &h}) ASSERT_TRUE(t->dp().ResetSequence(0, 9).ok());
  const int steps = 20;
  for (int step = 0; step < steps; ++step) {
    OneSeqStep s{0, n - steps + step, n - steps - 1 + step};
    std::vector<float> z(s.ctx);
    for (int i = 0; i < s.ctx; ++i) z[i] = base[i] + 0.3f * noise(rng);
    for (TestArena* t : {&f, &h}) {
      ASSERT_TRUE(t->dp().BeginStep(s.batch()).ok());
      ASSERT_TRUE(t->dp().Select(0).ok());
      ASSERT_EQ(t->Selected().size(), static_cast<size_t>(n / 64));
      ASSERT_TRUE(t->dp().Observe(0, z.data(), s.ctx).ok());
    }
  }
  for (int which = 0; which < 2; ++which) {
    for (int i = 0; i < n; ++i) {
      const float a = f.Get(0, 0, which, i), b = h.Get(0, 0, which, i);
      ASSERT_EQ(std::isnan(a), std::isnan(b)) << i;
      if (std::isnan(a)) continue;
      // Error relative to the scores' scale (~3): EMA blends of large values land near 0.
      ASSERT_LE(std::fabs(a - b), 0.01f * (std::fabs(a) + 3.0f)) << which << " " << i;
    }
  }
  size_t agree = 0, total = 0;
  Policy sparse = Pol(0.5, 0.5f);
  for (TestArena* t : {&f, &h}) ASSERT_TRUE(WritePolicy(t->view(), sparse).ok());
  for (int step = 0; step < 5; ++step) {
    OneSeqStep s{0, n - 5 + step, n - 6 + step};
    std::vector<std::vector<int>> sel;
    for (TestArena* t : {&f, &h}) {
      ASSERT_TRUE(t->dp().BeginStep(s.batch()).ok());
      ASSERT_TRUE(t->dp().Select(0).ok());
      sel.push_back(t->Selected());
    }
    ASSERT_EQ(sel[0].size(), 32u);
    for (int j : sel[0]) agree += std::binary_search(sel[1].begin(), sel[1].end(), j);
    total += sel[0].size();
  }
  EXPECT_GE(static_cast<double>(agree) / total, 0.9);
}

// The arena's V block summaries (arena.h) equal their definition after every call: NaN while
// any entry of the block is unset, else the largest entry. Two sequences, MTP rows with random
// acceptance, scores with NaN and inf, sparse steps, a reset, and a partial last block.
TEST(Observe, VBlockSummariesFollowV) {
  for (StateDtype dt : {StateDtype::kFp32, StateDtype::kBf16}) {
    SCOPED_TRACE(dt == StateDtype::kFp32 ? "fp32" : "bf16");
    const Geometry g = Geo(64 * 6 + 24, 64, 2, 2, dt);
    TestArena t(g, Pol(0.5, 0.5f, 3));
    const ArenaView& a = t.view();
    auto check = [&](const char* when) {
      for (int s = 0; s < 2; ++s) {
        for (int l = 0; l < 2; ++l) {
          for (uint32_t j = 0; j < a.max_blocks; ++j) {
            float want = -INFINITY;
            for (uint32_t i = j * 64; i < std::min<uint32_t>((j + 1) * 64, g.max_slots); ++i) {
              const float x = t.Get(s, l, 0, static_cast<int>(i));
              if (std::isnan(x)) {
                want = NAN;
                break;
              }
              want = std::max(want, x);
            }
            const float got = a.VSummaries(s, l)[j];
            if (std::isnan(want)) {
              ASSERT_TRUE(std::isnan(got))
                  << when << " seq " << s << " layer " << l << " block " << j;
            } else {
              ASSERT_EQ(got, want) << when << " seq " << s << " layer " << l << " block " << j;
            }
          }
        }
      }
    };
    int set_blocks = 0;  // summaries that hold a maximum at the end (the test is not vacuous)
    check("after init");
    ASSERT_TRUE(t.dp().ResetSequence(0, 11).ok());
    ASSERT_TRUE(t.dp().ResetSequence(1, 12).ok());
    std::mt19937 rng(5);
    std::vector<int32_t> ctx = {380, 90};  // sequence 0 runs into the partial last block
    const int stride = 64 * 7;
    for (int step = 0; step < 30; ++step) {
      if (step == 6) {
        ASSERT_TRUE(t.dp().ResetSequence(1, 13).ok());
        check("after reset");
      }
      const int32_t seq[2] = {0, 1}, c[2] = {ctx[0], ctx[1]}, q[2] = {ctx[0] - 1, ctx[1] - 1};
      ASSERT_TRUE(t.dp().BeginStep(StepBatch{seq, c, q, 2, 2}).ok());
      int32_t acc[2];
      for (int l = 0; l < 2; ++l) {
        ASSERT_TRUE(t.dp().Select(l).ok());
        std::vector<float> z(2 * 2 * stride);
        for (float& x : z) {
          const int u = static_cast<int>(rng() % 400);
          x = u == 0 ? NAN : u == 1 ? INFINITY : static_cast<float>(rng() % 1000) / 100.0f;
        }
        for (int e = 0; e < 2; ++e) acc[e] = static_cast<int32_t>(rng() % 3);
        ASSERT_TRUE(t.dp().Observe(l, z.data(), stride, acc).ok());
        check("after observe");
      }
      for (int e = 0; e < 2; ++e)
        ctx[e] = std::min<int32_t>(ctx[e] + std::max(1, acc[e]), 64 * 6 + 23);
    }
    for (int s = 0; s < 2; ++s) {
      for (uint32_t j = 0; j < a.max_blocks; ++j)
        set_blocks += std::isnan(a.VSummaries(s, 0)[j]) ? 0 : 1;
    }
    EXPECT_GE(set_blocks, 4);
    // Sequence 0 reached the end: its partial last block (slots 384 .. 407) was observed whole.
    EXPECT_FALSE(std::isnan(a.VSummaries(0, 0)[a.max_blocks - 1]));
  }
}

}  // namespace
}  // namespace spin::testing
