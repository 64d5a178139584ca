// Per-layer budgets (kernels/include/spin/budget.h): curve shaping, the minimax allocator, the
// probe controller's smoothing, drift rule and recompute count, and the host table write.
#include "spin/budget.h"

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "spin/numerics.h"
#include "test_arena.h"

namespace spin::testing {
namespace {

// miss(f) = scale * (1 - f)^power: smooth, decreasing, zero at keep 1.
MissCurve PowerCurve(double scale, double power) {
  MissCurve c;
  for (int p = 0; p < kCurvePoints; ++p) c[p] = scale * std::pow(1 - CurveKeepFraction(p), power);
  return c;
}

AllocationInput Input(std::vector<MissCurve> curves, int32_t blocks, double rho,
                      int32_t topk = 256) {
  AllocationInput in;
  in.curves = std::move(curves);
  in.num_blocks = blocks;
  in.topk = topk;
  in.block_size = 64;
  in.target_sparsity = rho;
  return in;
}

// Every invariant a table must satisfy, whatever the curves.
void CheckInvariants(const AllocationInput& in, const Allocation& a) {
  const int32_t L = static_cast<int32_t>(in.curves.size());
  ASSERT_EQ(a.blocks.size(), static_cast<size_t>(L));
  ASSERT_EQ(a.sparsity.size(), static_cast<size_t>(L));
  const int32_t uniform = KeptBlocks(in.num_blocks, in.topk, in.block_size, in.target_sparsity);
  const int32_t floor_blocks = std::min<int32_t>(in.num_blocks, CeilDiv(in.topk, in.block_size));
  int64_t sum = 0;
  for (int32_t l = 0; l < L; ++l) {
    EXPECT_GE(a.blocks[l], floor_blocks) << "layer " << l;
    EXPECT_LE(a.blocks[l], in.num_blocks) << "layer " << l;
    EXPECT_GE(a.sparsity[l], 0.0);
    EXPECT_LT(a.sparsity[l], 1.0);
    // The kernels' budget formula gives back exactly the allocated blocks.
    EXPECT_EQ(KeptBlocks(in.num_blocks, in.topk, in.block_size, a.sparsity[l]), a.blocks[l])
        << "layer " << l;
    sum += a.blocks[l];
  }
  EXPECT_EQ(sum, int64_t{uniform} * L);
  EXPECT_EQ(a.total_blocks, sum);
  // The reported worst misses are those of the tables, recomputed here from the curves (not
  // taken from the allocator's own bookkeeping), and the allocation is no worse than uniform.
  double worst = 0, uniform_worst = 0;
  for (int32_t l = 0; l < L; ++l) {
    const MissCurve m = MonotoneCurve(in.curves[l]);
    worst = std::max(worst, CurveMiss(m, static_cast<double>(a.blocks[l]) / in.num_blocks));
    uniform_worst =
        std::max(uniform_worst, CurveMiss(m, static_cast<double>(uniform) / in.num_blocks));
  }
  EXPECT_NEAR(a.worst_miss, worst, 1e-12);
  EXPECT_NEAR(a.uniform_worst_miss, uniform_worst, 1e-12);
  EXPECT_LE(worst, uniform_worst + 1e-12);
}

TEST(MonotoneCurve, KeepsAMonotoneCurveAndPoolsViolators) {
  const MissCurve c = PowerCurve(0.8, 2);
  EXPECT_EQ(MonotoneCurve(c), c);
  MissCurve noisy = c;
  noisy[3] = noisy[2] + 0.1;  // a rise: pooled with its neighbours, not clipped
  const MissCurve m = MonotoneCurve(noisy);
  for (int p = 1; p < kCurvePoints; ++p) EXPECT_LE(m[p], m[p - 1]);
  EXPECT_NEAR(m[2], (noisy[2] + noisy[3]) / 2, 1e-12);
  EXPECT_NEAR(m[3], m[2], 1e-12);
  // Mean preserved (isotonic regression with equal weights), values clamped to [0, 1].
  EXPECT_NEAR(std::accumulate(m.begin(), m.end(), 0.0),
              std::accumulate(noisy.begin(), noisy.end(), 0.0), 1e-9);
  MissCurve wild;
  wild.fill(2.0);
  wild[19] = -1.0;
  const MissCurve w = MonotoneCurve(wild);
  for (double x : w) {
    EXPECT_GE(x, 0.0);
    EXPECT_LE(x, 1.0);
  }
}

TEST(CurveMiss, InterpolatesBetweenGridPointsAndAnchorsAtZero) {
  MissCurve c = PowerCurve(0.5, 1);
  EXPECT_DOUBLE_EQ(CurveMiss(c, 0.0), 1.0);
  EXPECT_NEAR(CurveMiss(c, 0.025), (1.0 + c[0]) / 2, 1e-12);
  EXPECT_NEAR(CurveMiss(c, 0.05), c[0], 1e-12);
  EXPECT_NEAR(CurveMiss(c, 0.125), (c[1] + c[2]) / 2, 1e-12);
  EXPECT_NEAR(CurveMiss(c, 1.0), c[19], 1e-12);
  EXPECT_NEAR(CurveMiss(c, 1.5), c[19], 1e-12);
}

TEST(AllocateBudgets, EqualCurvesGiveTheUniformBudget) {
  for (double rho : {0.0, 0.2, 0.5, 0.7, 0.95}) {
    const AllocationInput in = Input(std::vector<MissCurve>(6, PowerCurve(0.6, 3)), 250, rho);
    absl::StatusOr<Allocation> a = AllocateBudgets(in);
    ASSERT_TRUE(a.ok()) << a.status();
    CheckInvariants(in, *a);
    const int32_t u = KeptBlocks(250, 256, 64, rho);
    for (int32_t m : a->blocks) EXPECT_EQ(m, u) << "rho " << rho;
  }
}

TEST(AllocateBudgets, GivesHardLayersMoreAndLowersTheWorstMiss) {
  std::vector<MissCurve> curves = {PowerCurve(0.1, 2), PowerCurve(0.9, 2), PowerCurve(0.3, 2),
                                   PowerCurve(0.2, 4)};
  const AllocationInput in = Input(curves, 400, 0.5);
  absl::StatusOr<Allocation> a = AllocateBudgets(in);
  ASSERT_TRUE(a.ok()) << a.status();
  CheckInvariants(in, *a);
  EXPECT_GT(a->blocks[1], a->blocks[0]);
  EXPECT_GT(a->blocks[1], KeptBlocks(400, 256, 64, 0.5));
  EXPECT_LT(a->worst_miss, 0.8 * a->uniform_worst_miss);
  // Minimax: the predicted misses of layers above the floor are (nearly) level.
  std::vector<double> miss;
  for (int l = 0; l < 4; ++l) {
    if (a->blocks[l] > 4) miss.push_back(CurveMiss(MonotoneCurve(curves[l]), a->blocks[l] / 400.0));
  }
  ASSERT_GE(miss.size(), 2u) << "levelling needs two layers above the floor";
  const auto [lo, hi] = std::minmax_element(miss.begin(), miss.end());
  EXPECT_LT(*hi - *lo, 0.01);
}

TEST(AllocateBudgets, NoisyNonMonotoneCurves) {
  std::mt19937_64 rng(91);
  std::uniform_real_distribution<double> u(-0.08, 0.08);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<MissCurve> curves;
    const int L = 1 + trial % 9;
    for (int l = 0; l < L; ++l) {
      MissCurve c = PowerCurve(0.2 + 0.1 * (l % 5), 1 + l % 3);
      for (double& x : c) x = std::clamp(x + u(rng), 0.0, 1.0);
      curves.push_back(c);
    }
    const int32_t blocks = 5 + static_cast<int32_t>(rng() % 600);
    const double rho = (rng() % 96) / 100.0;
    const AllocationInput in = Input(curves, blocks, rho, 64 + static_cast<int32_t>(rng() % 512));
    absl::StatusOr<Allocation> a = AllocateBudgets(in);
    ASSERT_TRUE(a.ok()) << a.status();
    CheckInvariants(in, *a);
    if (::testing::Test::HasFailure()) FAIL() << "trial " << trial;
  }
}

TEST(AllocateBudgets, RespectsTheTopKFloor) {
  // K = 1024, b = 64: 16 blocks at least. B = 40 at 80% sparsity: uniform is 16 (the floor), so
  // nothing can move even though layer 0 never misses.
  std::vector<MissCurve> curves = {MissCurve{}, PowerCurve(1.0, 1), PowerCurve(0.5, 1)};
  AllocationInput in = Input(curves, 40, 0.8, 1024);
  absl::StatusOr<Allocation> a = AllocateBudgets(in);
  ASSERT_TRUE(a.ok());
  CheckInvariants(in, *a);
  for (int32_t m : a->blocks) EXPECT_EQ(m, 16);
  // At 50% (20 blocks each) the easy layer gives blocks away but never drops below 16.
  in.target_sparsity = 0.5;
  a = AllocateBudgets(in);
  ASSERT_TRUE(a.ok());
  CheckInvariants(in, *a);
  EXPECT_EQ(a->blocks[0], 16);
  EXPECT_GT(a->blocks[1], 20);
  // A context shorter than the floor: every layer keeps every block.
  in.num_blocks = 10;
  a = AllocateBudgets(in);
  ASSERT_TRUE(a.ok());
  CheckInvariants(in, *a);
  for (int32_t m : a->blocks) EXPECT_EQ(m, 10);
}

TEST(AllocateBudgets, DegenerateCurves) {
  // All zero: nothing to gain anywhere; the leftover spreads evenly (uniform).
  AllocationInput in = Input(std::vector<MissCurve>(5, MissCurve{}), 300, 0.6);
  absl::StatusOr<Allocation> a = AllocateBudgets(in);
  ASSERT_TRUE(a.ok());
  CheckInvariants(in, *a);
  for (int32_t m : a->blocks) EXPECT_EQ(m, KeptBlocks(300, 256, 64, 0.6));
  EXPECT_EQ(a->worst_miss, 0.0);
  // All one (flat, everything missed until every block is kept): uniform again.
  MissCurve ones;
  ones.fill(1.0);
  ones[kCurvePoints - 1] = 0.0;
  in.curves.assign(5, ones);
  a = AllocateBudgets(in);
  ASSERT_TRUE(a.ok());
  CheckInvariants(in, *a);
  for (int32_t m : a->blocks) EXPECT_EQ(m, KeptBlocks(300, 256, 64, 0.6));
  // Sparsity 0: every block everywhere.
  in.target_sparsity = 0.0;
  in.curves = {PowerCurve(0.9, 1), MissCurve{}};
  a = AllocateBudgets(in);
  ASSERT_TRUE(a.ok());
  CheckInvariants(in, *a);
  for (int32_t m : a->blocks) EXPECT_EQ(m, 300);
  for (double r : a->sparsity) EXPECT_EQ(r, 0.0);
  // B = 1.
  in.num_blocks = 1;
  in.target_sparsity = 0.9;
  a = AllocateBudgets(in);
  ASSERT_TRUE(a.ok());
  CheckInvariants(in, *a);
}

TEST(AllocateBudgets, SingleLayerIsTheUniformBudget) {
  for (double rho : {0.1, 0.45, 0.9}) {
    const AllocationInput in = Input({PowerCurve(0.7, 2)}, 777, rho);
    absl::StatusOr<Allocation> a = AllocateBudgets(in);
    ASSERT_TRUE(a.ok());
    CheckInvariants(in, *a);
    EXPECT_EQ(a->blocks[0], KeptBlocks(777, 256, 64, rho));
    EXPECT_DOUBLE_EQ(a->worst_miss, a->uniform_worst_miss);
  }
}

TEST(AllocateBudgets, RejectsBadInput) {
  EXPECT_EQ(AllocateBudgets(Input({}, 10, 0.5)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AllocateBudgets(Input({MissCurve{}}, 0, 0.5)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AllocateBudgets(Input({MissCurve{}}, 10, 1.0)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AllocateBudgets(Input({MissCurve{}}, 10, -0.1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  MissCurve nan{};
  nan[4] = std::nan("");
  absl::Status s = AllocateBudgets(Input({MissCurve{}, nan}, 10, 0.5)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("layer 1"), std::string::npos) << s;
}

// A session's accumulated counters, advanced by hand: each probe adds `curve` * topk missed
// slots per point, and every step adds `blocks` to blocks_total.
struct FakeCounters {
  int layers;
  std::vector<uint64_t> curves;
  std::vector<LayerStats> stats;
  explicit FakeCounters(int l)
      : layers(l), curves(static_cast<size_t>(l) * kCurvePoints, 0), stats(l, LayerStats{}) {}
  void Steps(int n, uint64_t blocks) {
    for (LayerStats& s : stats) {
      s.steps += n;
      s.blocks_total += n * blocks;
    }
  }
  // `missed`: the fraction of the top-K outside the layer's budget (probe_missed), if given.
  void Probe(int layer, const MissCurve& c, uint64_t topk = 1000, double missed = -1) {
    stats[layer].probe_steps += 1;
    stats[layer].probe_topk += topk;
    if (missed >= 0)
      stats[layer].probe_missed += static_cast<uint64_t>(std::llround(missed * topk));
    for (int p = 0; p < kCurvePoints; ++p) {
      curves[static_cast<size_t>(layer) * kCurvePoints + p] +=
          static_cast<uint64_t>(std::llround(c[p] * topk));
    }
  }
  // `steps` sparse steps of the layer measured by their exploration blocks: `topk` slots each,
  // the estimated miss `missed` (LayerStats::explore_*).
  void Explore(int layer, uint64_t steps, double missed, uint64_t topk = 1000) {
    stats[layer].explore_steps += steps;
    stats[layer].explore_topk += steps * topk;
    stats[layer].explore_est += static_cast<uint64_t>(
        std::llround(missed * static_cast<double>(steps * topk * kExploreEstUnit)));
  }
  ProbeSnapshot Snap() const { return ProbeSnapshot{curves, stats}; }
};

Geometry Geo(int layers) {
  Geometry g;
  g.layers = layers;
  g.max_seqs = 1;
  g.max_slots = 64 * 256;
  g.block_size = 64;
  g.topk = 512;
  return g;
}

TEST(BudgetController, WaitsForEveryLayerThenRecomputesOnlyOnDrift) {
  BudgetTuning t;
  t.smoothing = 0.5;
  t.drift_threshold = 0.02;
  BudgetController c(Geo(3), t);
  FakeCounters f(3);
  const std::vector<MissCurve> curves = {PowerCurve(0.2, 2), PowerCurve(0.6, 2),
                                         PowerCurve(0.3, 2)};
  f.Steps(8, 200);
  f.Probe(0, curves[0]);
  f.Probe(1, curves[1]);
  absl::StatusOr<std::optional<BudgetUpdate>> u = c.Update(f.Snap(), 0.5);
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_FALSE(u->has_value()) << "layer 2 has no probe yet";
  f.Probe(2, curves[2]);
  u = c.Update(f.Snap(), 0.5);
  ASSERT_TRUE(u.ok() && u->has_value());
  EXPECT_EQ((*u)->reason, "first");
  EXPECT_EQ((*u)->num_blocks, 200);
  EXPECT_EQ(c.recomputes(), 1u);
  EXPECT_GT((*u)->allocation.blocks[1], (*u)->allocation.blocks[0]);
  // The same curves again: no drift, no recompute; a snapshot with nothing new: none either.
  for (int k = 0; k < 5; ++k) {
    f.Steps(8, 200);
    for (int l = 0; l < 3; ++l) f.Probe(l, curves[l]);
    u = c.Update(f.Snap(), 0.5);
    ASSERT_TRUE(u.ok());
    EXPECT_FALSE(u->has_value()) << "probe " << k;
    u = c.Update(f.Snap(), 0.5);
    ASSERT_TRUE(u.ok());
    EXPECT_FALSE(u->has_value());
  }
  EXPECT_EQ(c.recomputes(), 1u);
  // Layer 0 becomes hard: the EMA (weight 0.5 per probe) crosses the threshold at once.
  f.Steps(8, 200);
  for (int l = 0; l < 3; ++l) f.Probe(l, l == 0 ? PowerCurve(0.9, 1) : curves[l]);
  u = c.Update(f.Snap(), 0.5);
  ASSERT_TRUE(u.ok() && u->has_value());
  EXPECT_NE((*u)->reason.find("drift"), std::string::npos) << (*u)->reason;
  EXPECT_NE((*u)->reason.find("layer 0"), std::string::npos) << (*u)->reason;
  EXPECT_EQ(c.recomputes(), 2u);
  // The smoothed value is halfway between old and new.
  EXPECT_NEAR(c.smoothed()[0][9], 0.5 * (curves[0][9] + PowerCurve(0.9, 1)[9]), 2e-3);
  // A new target recomputes even without drift.
  u = c.Update(f.Snap(), 0.6);
  ASSERT_TRUE(u.ok() && u->has_value());
  EXPECT_EQ((*u)->reason, "target");
  // The context grows by more than 10%: recompute for the new B.
  f.Steps(100, 240);
  u = c.Update(f.Snap(), 0.6);
  ASSERT_TRUE(u.ok() && u->has_value());
  EXPECT_EQ((*u)->reason, "context");
  EXPECT_EQ((*u)->num_blocks, 240);
  EXPECT_EQ(c.recomputes(), 4u);
}

// Warm budgets: a controller seeded with another one's smoothed curves gives the table that
// one would give, at once, and then drifts from those curves like any other.
TEST(BudgetController, WarmStartGivesTheLearnedTableAtOnce) {
  BudgetTuning t;
  t.smoothing = 0.5;
  BudgetController learned(Geo(3), t);
  FakeCounters f(3);
  const std::vector<MissCurve> curves = {PowerCurve(0.2, 2), PowerCurve(0.6, 2),
                                         PowerCurve(0.3, 2)};
  f.Steps(8, 200);
  for (int l = 0; l < 3; ++l) f.Probe(l, curves[l]);
  absl::StatusOr<std::optional<BudgetUpdate>> first = learned.Update(f.Snap(), 0.5);
  ASSERT_TRUE(first.ok() && first->has_value());

  BudgetController warm(Geo(3), t);
  absl::StatusOr<BudgetUpdate> w = warm.Warm(learned.smoothed(), learned.num_blocks(), 0.5);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->reason, "warm");
  EXPECT_EQ(w->sparsity, (*first)->sparsity) << "the same curves give the same table";
  EXPECT_EQ(w->num_blocks, 200);
  EXPECT_EQ(warm.recomputes(), 1u);
  // The same curves from its own probes: no drift, no recompute; a hard layer 0: drift.
  FakeCounters g(3);
  g.Steps(8, 200);
  for (int l = 0; l < 3; ++l) g.Probe(l, curves[l]);
  absl::StatusOr<std::optional<BudgetUpdate>> u = warm.Update(g.Snap(), 0.5);
  ASSERT_TRUE(u.ok());
  EXPECT_FALSE(u->has_value());
  g.Steps(8, 200);
  for (int l = 0; l < 3; ++l) g.Probe(l, l == 0 ? PowerCurve(0.9, 1) : curves[l]);
  u = warm.Update(g.Snap(), 0.5);
  ASSERT_TRUE(u.ok() && u->has_value());
  EXPECT_NE((*u)->reason.find("drift"), std::string::npos) << (*u)->reason;
  // Bad seeds change nothing.
  BudgetController bad(Geo(3), t);
  EXPECT_FALSE(bad.Warm({curves[0], curves[1]}, 200, 0.5).ok());
  std::vector<MissCurve> nan = curves;
  nan[1][4] = std::nan("");
  EXPECT_FALSE(bad.Warm(nan, 200, 0.5).ok());
  EXPECT_FALSE(bad.Warm(curves, 200, 1.0).ok());
  EXPECT_EQ(bad.recomputes(), 0u);
  // B is bounded by the geometry (256 blocks here).
  absl::StatusOr<BudgetUpdate> big = bad.Warm(curves, 1 << 30, 0.5);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->num_blocks, 256);
}

// Miss-target mode: each layer independently takes the fewest blocks whose predicted miss is
// at most the target (checked against a scan of every block count), the floor and B bound it,
// and the controller recomputes when the target changes.
TEST(MissTarget, EachLayerTakesTheFewestBlocksThatMeetTheTarget) {
  const std::vector<MissCurve> curves = {PowerCurve(0.1, 2), PowerCurve(0.5, 2),
                                         PowerCurve(0.9, 1)};
  const AllocationInput in = Input(curves, 200, 0.5, 512);
  for (double target : {0.005, 0.02, 0.1}) {
    absl::StatusOr<Allocation> a = AllocateForMissTarget(in, target);
    ASSERT_TRUE(a.ok()) << a.status();
    for (int l = 0; l < 3; ++l) {
      const MissCurve m = MonotoneCurve(curves[l]);
      int32_t want = 200;
      for (int32_t b = 8; b <= 200; ++b) {  // floor: ceil(512 / 64) = 8 blocks
        if (CurveMiss(m, b / 200.0) <= target) {
          want = b;
          break;
        }
      }
      EXPECT_EQ(a->blocks[l], want) << "target " << target << " layer " << l;
      EXPECT_EQ(KeptBlocks(200, 512, 64, a->sparsity[l]), want);
      EXPECT_LE(CurveMiss(m, a->blocks[l] / 200.0), target + 1e-12);
    }
    EXPECT_LT(a->blocks[0], a->blocks[2]) << "an easier layer needs fewer blocks";
  }
  // A looser target never needs more blocks.
  absl::StatusOr<Allocation> tight = AllocateForMissTarget(in, 0.01);
  absl::StatusOr<Allocation> loose = AllocateForMissTarget(in, 0.05);
  ASSERT_TRUE(tight.ok() && loose.ok());
  for (int l = 0; l < 3; ++l) EXPECT_LE(loose->blocks[l], tight->blocks[l]);
  // With exploration: the fewest m whose expected miss (ranked part, less what the random
  // blocks recover) meets it; never more blocks than making the ranked part alone meet it.
  AllocationInput explored = in;
  explored.exploration = 0.2;
  absl::StatusOr<Allocation> ex = AllocateForMissTarget(explored, 0.02);
  absl::StatusOr<Allocation> plain = AllocateForMissTarget(in, 0.02);
  ASSERT_TRUE(ex.ok() && plain.ok());
  for (int l = 0; l < 3; ++l) {
    const MissCurve mono = MonotoneCurve(curves[l]);
    const int32_t m = ex->blocks[l];
    EXPECT_LE(ExpectedMiss(mono, m, 200, 0.2), 0.02) << "layer " << l;
    if (m > 8) {
      EXPECT_GT(ExpectedMiss(mono, m - 1, 200, 0.2), 0.02) << "the fewest";
    }
    int32_t ranked_only = plain->blocks[l];
    while (ranked_only < 200 &&
           ranked_only - ExplorationBlocks(ranked_only, 0.2) < plain->blocks[l])
      ++ranked_only;
    EXPECT_LE(m, ranked_only) << "layer " << l;
    EXPECT_GE(ex->worst_miss, ExpectedMiss(mono, m, 200, 0.2));
  }
  explored.exploration = 1.0;
  EXPECT_FALSE(AllocateForMissTarget(explored, 0.02).ok());
  EXPECT_FALSE(AllocateForMissTarget(in, 0.0).ok());
  EXPECT_FALSE(AllocateForMissTarget(in, 1.0).ok());
  EXPECT_FALSE(AllocateForMissTarget(in, std::nan("")).ok());

  BudgetController c(Geo(3));
  FakeCounters f(3);
  f.Steps(8, 200);
  for (int l = 0; l < 3; ++l) f.Probe(l, curves[l]);
  absl::StatusOr<std::optional<BudgetUpdate>> u = c.Update(f.Snap(), 0.5, 0.02);
  ASSERT_TRUE(u.ok() && u->has_value());
  absl::StatusOr<Allocation> want = AllocateForMissTarget(
      Input(std::vector<MissCurve>(c.smoothed().begin(), c.smoothed().end()), 200, 0.5, 512), 0.02);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ((*u)->sparsity, want->sparsity);
  u = c.Update(f.Snap(), 0.5, 0.02);
  ASSERT_TRUE(u.ok());
  EXPECT_FALSE(u->has_value()) << "nothing new";
  u = c.Update(f.Snap(), 0.5, 0.05);
  ASSERT_TRUE(u.ok() && u->has_value());
  EXPECT_EQ((*u)->reason, "target");
}

// The expected miss of m kept blocks with exploration: the ranked part's curve miss, less the
// share of it the random blocks recover (they are drawn from the blocks the ranking left out).
TEST(MissTarget, ExpectedMissCountsWhatTheExplorationBlocksRecover) {
  const MissCurve mono = MonotoneCurve(PowerCurve(0.5, 2));
  // m = 100 of 200, gamma 0.2: 20 random blocks from the 120 outside the 80 ranked ones.
  EXPECT_EQ(ExplorationBlocks(100, 0.2), 20);
  EXPECT_NEAR(ExpectedMiss(mono, 100, 200, 0.2), CurveMiss(mono, 0.4) * (1 - 20.0 / 120), 1e-15);
  EXPECT_EQ(ExpectedMiss(mono, 100, 200, 0.0), CurveMiss(mono, 0.5));
  EXPECT_EQ(ExpectedMiss(mono, 200, 200, 0.2), 0.0);
  EXPECT_EQ(ExpectedMiss(mono, 250, 200, 0.2), 0.0);
  for (double gamma : {0.0, 0.05, 0.2, 0.5}) {
    for (int32_t m = 2; m <= 200; ++m) {
      EXPECT_LE(ExpectedMiss(mono, m, 200, gamma), ExpectedMiss(mono, m - 1, 200, gamma) + 1e-15)
          << "non-increasing: gamma " << gamma << " m " << m;
    }
  }
  // The expectation, checked by drawing the exploration blocks: 40 ranked blocks, the missed
  // top-K slots spread unevenly over the 60 blocks outside them, 10 of those drawn at random.
  std::mt19937_64 rng(7);
  std::vector<int> missed_per_block(60);
  int missed = 0;
  for (int j = 0; j < 60; ++j) missed += missed_per_block[j] = (j % 7 == 0) ? 9 : (j % 3 == 0);
  std::vector<int> order(60);
  std::iota(order.begin(), order.end(), 0);
  double recovered = 0;
  const int draws = 20000;
  for (int d = 0; d < draws; ++d) {
    std::shuffle(order.begin(), order.end(), rng);
    for (int k = 0; k < 10; ++k) recovered += missed_per_block[order[k]];
  }
  EXPECT_NEAR(1 - recovered / draws / missed, 1 - 10.0 / 60, 0.01);
}

TEST(MissTarget, EachLayerMeetsItsOwnLevel) {
  const std::vector<MissCurve> curves(3, PowerCurve(0.5, 2));
  AllocationInput in = Input(curves, 200, 0.5, 512);
  in.exploration = 0.05;
  const std::vector<double> levels = {0.01, 0.05, 0.2};
  absl::StatusOr<Allocation> a = AllocateForMissLevels(in, levels);
  ASSERT_TRUE(a.ok()) << a.status();
  for (int l = 0; l < 3; ++l) {
    absl::StatusOr<Allocation> one = AllocateForMissTarget(in, levels[l]);
    ASSERT_TRUE(one.ok());
    EXPECT_EQ(a->blocks[l], one->blocks[l]) << "layer " << l;
  }
  EXPECT_GT(a->blocks[0], a->blocks[1]);
  EXPECT_GT(a->blocks[1], a->blocks[2]);
  EXPECT_FALSE(AllocateForMissLevels(in, std::vector<double>{0.01, 0.05}).ok());
  EXPECT_FALSE(AllocateForMissLevels(in, std::vector<double>{0.01, 0.0, 0.2}).ok());
  EXPECT_FALSE(AllocateForMissLevels(in, std::vector<double>{0.01, 1.0, 0.2}).ok());
  EXPECT_FALSE(AllocateForMissLevels(in, std::vector<double>{0.01, std::nan(""), 0.2}).ok());
}

// Miss-target mode before any probe data: no curve says what a sparsity would miss, so the
// first call returns the dense table once; the first probe data gives the first real table.
// The per-layer mode keeps waiting with the arena's uniform table; going back to it from a cold
// miss-target table before any data gives the uniform table at the target.
TEST(MissTargetController, ColdStartIsDenseUntilEveryLayerHasProbeData) {
  BudgetController c(Geo(3));
  FakeCounters f(3);
  f.Steps(1, 200);
  absl::StatusOr<std::optional<BudgetUpdate>> u = c.Update(f.Snap(), 0.5, 0.02);
  ASSERT_TRUE(u.ok() && u->has_value()) << "the miss-target mode's cold table";
  EXPECT_EQ((*u)->reason, "cold");
  EXPECT_EQ((*u)->sparsity, std::vector<double>(3, 0.0));
  EXPECT_EQ(c.recomputes(), 1u);
  f.Steps(7, 200);
  f.Probe(0, PowerCurve(0.3, 2));
  u = c.Update(f.Snap(), 0.5, 0.02);
  ASSERT_TRUE(u.ok());
  EXPECT_FALSE(u->has_value()) << "still cold: layers 1 and 2 have no probe yet";
  f.Probe(1, PowerCurve(0.3, 2));
  f.Probe(2, PowerCurve(0.3, 2));
  u = c.Update(f.Snap(), 0.5, 0.02);
  ASSERT_TRUE(u.ok() && u->has_value());
  EXPECT_EQ((*u)->reason, "first");
  for (double rho : (*u)->sparsity) EXPECT_GT(rho, 0.2);

  BudgetController per_layer(Geo(3));
  FakeCounters g(3);
  g.Steps(1, 200);
  u = per_layer.Update(g.Snap(), 0.5);
  ASSERT_TRUE(u.ok());
  EXPECT_FALSE(u->has_value()) << "per-layer mode: no table before data, as before";

  BudgetController back(Geo(3));
  ASSERT_TRUE(back.Update(g.Snap(), 0.5, 0.02)->has_value());
  u = back.Update(g.Snap(), 0.4);
  ASSERT_TRUE(u.ok() && u->has_value());
  EXPECT_EQ((*u)->reason, "target");
  EXPECT_EQ((*u)->sparsity, std::vector<double>(3, 0.4));
  u = back.Update(g.Snap(), 0.4);
  ASSERT_TRUE(u.ok());
  EXPECT_FALSE(u->has_value());
}

// The closed loop: every probe step measures each layer's miss at the table in force (the
// probe's count at the layer's budget); a measured excess over the target is debt, paid back
// by lowering the layer's level; a measured shortfall at a sparse table is banked only up to
// credit_share of the target over the payback horizon (a dense table's exact zero in full); a
// new target starts over.
TEST(MissTargetController, MeasuredMissAboveTheTargetIsPaidBack) {
  const double M = 0.05;
  BudgetController c(Geo(2));
  FakeCounters f(2);
  const MissCurve curve = PowerCurve(0.6, 2);
  f.Steps(8, 200);
  f.Probe(0, curve);
  f.Probe(1, curve);
  absl::StatusOr<std::optional<BudgetUpdate>> u = c.Update(f.Snap(), 0.5, M);
  ASSERT_TRUE(u.ok() && u->has_value());
  EXPECT_EQ((*u)->reason, "first");
  const int32_t m0 = (*u)->allocation.blocks[0];
  EXPECT_EQ((*u)->allocation.blocks[1], m0) << "equal curves, equal blocks";
  EXPECT_EQ(c.miss_levels(), std::vector<double>(2, M));
  // The probes measure 3 M at layer 0's budget and exactly M at layer 1's (their curves agree).
  f.Steps(8, 200);
  f.Probe(0, curve, 1000, 3 * M);
  f.Probe(1, curve, 1000, M);
  u = c.Update(f.Snap(), 0.5, M);
  ASSERT_TRUE(u.ok() && u->has_value());
  EXPECT_NE((*u)->reason.find("(layer 0)"), std::string::npos) << (*u)->reason;
  EXPECT_NEAR(c.miss_debt()[0], 2 * M, 1e-9);
  EXPECT_NEAR(c.miss_debt()[1], 0, 1e-9);
  EXPECT_NEAR(c.miss_levels()[0], M - 2 * M / 8, 1e-9) << "paid back over 8 measured steps";
  EXPECT_EQ(c.miss_levels()[1], M);
  EXPECT_GT((*u)->allocation.blocks[0], m0) << "the layer that missed more keeps more";
  EXPECT_EQ((*u)->allocation.blocks[1], m0);
  // A probe that measures no miss at all: layer 0 repays M, layer 1 banks M.
  f.Steps(8, 200);
  f.Probe(0, curve, 1000, 0.0);
  f.Probe(1, curve, 1000, 0.0);
  ASSERT_TRUE(c.Update(f.Snap(), 0.5, M).ok());
  EXPECT_NEAR(c.miss_debt()[0], M, 1e-9);
  EXPECT_NEAR(c.miss_debt()[1], -M, 1e-9);
  f.Steps(8, 200);
  f.Probe(0, curve, 1000, 0.0);
  f.Probe(1, curve, 1000, 0.0);
  u = c.Update(f.Snap(), 0.5, M);
  ASSERT_TRUE(u.ok() && u->has_value());
  EXPECT_NEAR(c.miss_debt()[0], 0, 1e-9);
  EXPECT_NE((*u)->reason.find("slack"), std::string::npos) << (*u)->reason;
  EXPECT_EQ((*u)->allocation.blocks[0], m0) << "repaid: back to the target's blocks";
  // Debt is bounded: however much a probe misses, the level stays >= M / 4 and the debt at
  // most four payback horizons at that level.
  for (int k = 0; k < 20; ++k) {
    f.Steps(8, 200);
    f.Probe(0, curve, 1000, 1.0);
    f.Probe(1, curve, 1000, 0.0);
    ASSERT_TRUE(c.Update(f.Snap(), 0.5, M).ok());
  }
  EXPECT_NEAR(c.miss_debt()[0], 4 * 0.75 * M * 8, 1e-9);
  // Credit at a sparse table is bounded by credit_share: M / 4 over 8 steps, 2 M.
  EXPECT_NEAR(c.miss_debt()[1], -0.25 * M * 8, 1e-9);
  EXPECT_LE(c.miss_levels()[1], 1.25 * M + 1e-12);
  EXPECT_NEAR(c.miss_levels()[0], M / 4, 1e-9);
  // A new miss target is a new contract: the debts start over.
  u = c.Update(f.Snap(), 0.5, 0.03);
  ASSERT_TRUE(u.ok() && u->has_value());
  EXPECT_EQ((*u)->reason, "target");
  EXPECT_EQ(c.miss_debt(), std::vector<double>(2, 0.0));
  EXPECT_EQ(c.miss_levels(), std::vector<double>(2, 0.03));
}

// Between probes, every sparse step whose exploration blocks measured its miss (LayerStats
// explore_*, docs/budgets.md "Measured between probes") moves the layer's debt as a probe does:
// an overshoot right after the first table is seen within the steps that make it, not a probe
// period later.
TEST(MissTargetController, SparseStepsMeasuredByExplorationMoveTheDebt) {
  const double M = 0.02;
  BudgetController c(Geo(2));
  FakeCounters f(2);
  const MissCurve curve = PowerCurve(0.6, 2);
  f.Steps(8, 200);
  f.Probe(0, curve, 1000, 0.0);
  f.Probe(1, curve, 1000, 0.0);
  absl::StatusOr<std::optional<BudgetUpdate>> u = c.Update(f.Snap(), 0.5, M);
  ASSERT_TRUE(u.ok() && u->has_value());
  const std::vector<int32_t> first = (*u)->allocation.blocks;
  const std::vector<double> debt0 = c.miss_debt();
  // Three sparse steps: layer 0 estimated at 3 M each, layer 1 at M.
  f.Steps(3, 200);
  f.Explore(0, 3, 3 * M);
  f.Explore(1, 3, M);
  u = c.Update(f.Snap(), 0.5, M);
  ASSERT_TRUE(u.ok() && u->has_value());
  EXPECT_NEAR(c.miss_debt()[0], debt0[0] + 3 * 2 * M, 1e-6);
  EXPECT_NEAR(c.miss_debt()[1], debt0[1], 1e-6);
  EXPECT_NE((*u)->reason.find("(layer 0)"), std::string::npos) << (*u)->reason;
  EXPECT_GT((*u)->allocation.blocks[0], first[0]);
  // Nothing new: nothing moves.
  const std::vector<double> debt1 = c.miss_debt();
  u = c.Update(f.Snap(), 0.5, M);
  ASSERT_TRUE(u.ok());
  EXPECT_FALSE(u->has_value());
  EXPECT_EQ(c.miss_debt(), debt1);
  // Not in the sparsity-target modes: the estimate is the miss-target mode's.
  BudgetController plain(Geo(2));
  FakeCounters g(2);
  g.Steps(8, 200);
  g.Probe(0, curve);
  g.Probe(1, curve);
  ASSERT_TRUE(plain.Update(g.Snap(), 0.5).ok());
  g.Explore(0, 3, 0.5);
  u = plain.Update(g.Snap(), 0.5);
  ASSERT_TRUE(u.ok());
  EXPECT_FALSE(u->has_value());
  EXPECT_EQ(plain.miss_debt(), std::vector<double>(2, 0.0));
}

// The dense cold table misses exactly nothing: its probe window is credit, spent over the
// payback horizon (the layer's level above the target until then).
TEST(MissTargetController, TheColdWindowIsCredit) {
  const double M = 0.02;
  BudgetController c(Geo(2));
  FakeCounters f(2);
  f.Steps(1, 200);
  ASSERT_TRUE(c.Update(f.Snap(), 0.5, M)->has_value());  // cold
  f.Steps(7, 200);
  f.Probe(0, PowerCurve(0.4, 2), 1000, 0.0);
  f.Probe(1, PowerCurve(0.4, 2), 1000, 0.0);
  absl::StatusOr<std::optional<BudgetUpdate>> u = c.Update(f.Snap(), 0.5, M);
  ASSERT_TRUE(u.ok() && u->has_value());
  EXPECT_EQ((*u)->reason, "first");
  EXPECT_NEAR(c.miss_debt()[0], -M, 1e-12);
  EXPECT_NEAR(c.miss_levels()[0], M + M / 8, 1e-12);
  absl::StatusOr<Allocation> at_target = AllocateForMissTarget(
      Input(std::vector<MissCurve>(c.smoothed().begin(), c.smoothed().end()), 200, 0.5, 512), M);
  ASSERT_TRUE(at_target.ok());
  EXPECT_LE((*u)->allocation.blocks[0], at_target->blocks[0]);
}

TEST(BudgetController, SmallChangesBelowTheThresholdAccumulateUntilTheyCount) {
  BudgetTuning t;
  t.smoothing = 1.0;  // no smoothing: the curve is the last probe window's
  t.drift_threshold = 0.05;
  BudgetController c(Geo(1), t);
  FakeCounters f(1);
  f.Steps(1, 100);
  f.Probe(0, PowerCurve(0.3, 1));
  ASSERT_TRUE(c.Update(f.Snap(), 0.5)->has_value());
  // +0.03 at keep 5% each time, measured against the curves of the last recompute.
  f.Probe(0, PowerCurve(0.33, 1));
  EXPECT_FALSE(c.Update(f.Snap(), 0.5)->has_value());
  f.Probe(0, PowerCurve(0.36, 1));
  EXPECT_TRUE(c.Update(f.Snap(), 0.5)->has_value());
  EXPECT_EQ(c.recomputes(), 2u);
}

TEST(BudgetController, SnapshotWithManyProbesWeighsThemAsManyEmaSteps) {
  BudgetTuning t;
  t.smoothing = 0.3;
  t.drift_threshold = 1.0;
  BudgetController one(Geo(1), t), many(Geo(1), t);
  FakeCounters a(1), b(1);
  a.Steps(1, 100);
  b.Steps(1, 100);
  a.Probe(0, MissCurve{});
  b.Probe(0, MissCurve{});
  ASSERT_TRUE(one.Update(a.Snap(), 0.5).ok());
  ASSERT_TRUE(many.Update(b.Snap(), 0.5).ok());
  MissCurve half;
  half.fill(0.5);
  for (int k = 0; k < 3; ++k) {
    a.Probe(0, half);
    ASSERT_TRUE(one.Update(a.Snap(), 0.5).ok());
    b.Probe(0, half);
  }
  ASSERT_TRUE(many.Update(b.Snap(), 0.5).ok());
  EXPECT_NEAR(one.smoothed()[0][0], 0.5 * (1 - std::pow(0.7, 3)), 1e-9);
  EXPECT_NEAR(many.smoothed()[0][0], one.smoothed()[0][0], 1e-9);
}

TEST(BudgetController, CountersGoingBackwardsRestartTheBaseline) {
  BudgetController c(Geo(2));
  FakeCounters f(2);
  f.Steps(4, 50);
  for (int k = 0; k < 3; ++k) {
    f.Probe(0, PowerCurve(0.2, 1));
    f.Probe(1, PowerCurve(0.2, 1));
  }
  ASSERT_TRUE(c.Update(f.Snap(), 0.4)->has_value());
  FakeCounters g(2);  // a new arena
  g.Steps(1, 50);
  g.Probe(0, PowerCurve(0.8, 1));
  g.Probe(1, PowerCurve(0.2, 1));
  absl::StatusOr<std::optional<BudgetUpdate>> u = c.Update(g.Snap(), 0.4);
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(c.samples()[0], 4u);
  EXPECT_GT(c.smoothed()[0][0], 0.25);  // the new arena's probe counted, not a negative delta
  EXPECT_LE(c.smoothed()[0][0], 0.8);
}

TEST(BudgetController, RejectsBadSnapshots) {
  BudgetController c(Geo(2));
  FakeCounters f(3);
  absl::StatusOr<std::optional<BudgetUpdate>> u = c.Update(f.Snap(), 0.5);
  EXPECT_EQ(u.status().code(), absl::StatusCode::kInvalidArgument);
  FakeCounters g(2);
  EXPECT_EQ(c.Update(g.Snap(), 1.0).status().code(), absl::StatusCode::kInvalidArgument);
  BudgetTuning t;
  t.smoothing = 0;
  EXPECT_FALSE(ValidateBudgetTuning(t).ok());
  t = {};
  t.drift_threshold = -1;
  EXPECT_FALSE(ValidateBudgetTuning(t).ok());
  t = {};
  t.min_probes = 0;
  EXPECT_FALSE(ValidateBudgetTuning(t).ok());
  t = {};
  t.payback_steps = 0.5;
  EXPECT_FALSE(ValidateBudgetTuning(t).ok());
  t.payback_steps = std::nan("");
  EXPECT_FALSE(ValidateBudgetTuning(t).ok());
  t = {};
  t.credit_share = -0.1;
  EXPECT_FALSE(ValidateBudgetTuning(t).ok());
  t.credit_share = 1.5;
  EXPECT_FALSE(ValidateBudgetTuning(t).ok());
  t.credit_share = std::nan("");
  EXPECT_FALSE(ValidateBudgetTuning(t).ok());
  t = {};
  t.level_band = 1;
  EXPECT_FALSE(ValidateBudgetTuning(t).ok());
  t.level_band = -0.1;
  EXPECT_FALSE(ValidateBudgetTuning(t).ok());
  EXPECT_TRUE(ValidateBudgetTuning(BudgetTuning{}).ok());
}

TEST(WriteBudgetTable, WritesTheTableAndAdvancesTheEpoch) {
  TestArena arena(Geo(3), Policy{});
  const ArenaView& a = arena.view();
  const uint64_t epoch = a.policy->epoch;
  const std::vector<double> table = {0.1, 0.7, 0.45};
  ASSERT_TRUE(WriteBudgetTable(a, table).ok());
  EXPECT_EQ(a.policy->epoch, epoch + 1);
  for (int l = 0; l < 3; ++l) EXPECT_EQ(a.sparsity[l], table[l]);
  // Bad tables change nothing.
  EXPECT_FALSE(WriteBudgetTable(a, std::vector<double>{0.1, 0.2}).ok());
  EXPECT_FALSE(WriteBudgetTable(a, std::vector<double>{0.1, 1.0, 0.2}).ok());
  EXPECT_FALSE(WriteBudgetTable(a, std::vector<double>{0.1, std::nan(""), 0.2}).ok());
  EXPECT_EQ(a.policy->epoch, epoch + 1);
  EXPECT_EQ(a.sparsity[1], 0.7);
}

}  // namespace
}  // namespace spin::testing
