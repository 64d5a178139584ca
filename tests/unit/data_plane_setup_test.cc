#include "spin/data_plane_setup.h"

#include <cstdlib>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "spin/budget.h"

namespace spin {
namespace {

Geometry Geo() {
  Geometry g;
  g.layers = 2;
  g.max_seqs = 1;
  g.max_slots = 512;
  g.block_size = 64;
  g.topk = 64;
  return g;
}

DataPlaneSpec Spec(BudgetMode mode = BudgetMode::kUniform, uint32_t probe_period = 0) {
  DataPlaneSpec s;
  s.geometry = Geo();
  s.seed = 3;
  s.policy.target_sparsity = 0.5;
  s.policy.budget_mode = mode;
  s.policy.probe_period = probe_period;
  return s;
}

TEST(DataPlaneSetup, NewDataPlaneOwnsAFreshHostArena) {
  absl::StatusOr<std::unique_ptr<DataPlane>> dp = NewDataPlane(Spec());
  ASSERT_TRUE(dp.ok()) << dp.status();
  const ArenaView& a = (*dp)->arena();
  EXPECT_FALSE((*dp)->on_device());
  EXPECT_EQ(a.header->seed, 3u);
  EXPECT_EQ(a.geometry.max_slots, 512u);
  EXPECT_EQ(a.policy->epoch, 1u);
  EXPECT_EQ(a.sparsity[1], 0.5);
  // What ViewArena accepts: the same header a process mapping it would check.
  EXPECT_TRUE(ViewArena(a.header, ArenaBytes(a.geometry)).ok());
}

TEST(DataPlaneSetup, MakeDataPlaneUsesTheCallersMemory) {
  const uint64_t bytes = ArenaBytes(Geo());
  void* mem = std::aligned_alloc(kArenaAlign, bytes);
  ASSERT_NE(mem, nullptr);
  {
    absl::StatusOr<std::unique_ptr<DataPlane>> dp = MakeDataPlane(mem, bytes, Spec());
    ASSERT_TRUE(dp.ok()) << dp.status();
    EXPECT_EQ(static_cast<void*>((*dp)->arena().header), mem);
    EXPECT_FALSE(MakeDataPlane(mem, bytes - 1, Spec()).ok()) << "too small";
  }
  std::free(mem);  // not the data plane's
}

TEST(DataPlaneSetup, RefusesBadSpecs) {
  DataPlaneSpec s = Spec();
  s.geometry.layers = 0;
  EXPECT_FALSE(NewDataPlane(s).ok());
  s = Spec();
  s.policy.target_sparsity = 1.0;
  EXPECT_FALSE(NewDataPlane(s).ok());
  s = Spec();
  s.on_device = true;
  if (!CudaAvailable()) {
    EXPECT_FALSE(NewDataPlane(s).ok()) << "no device here";
  }
}

TEST(DataPlaneSetup, PolicyAndBudgetWritesAdvanceTheEpoch) {
  std::unique_ptr<DataPlane> dp = *NewDataPlane(Spec());
  Policy p;
  p.target_sparsity = 0.25;
  p.budget_mode = BudgetMode::kPerLayer;
  ASSERT_TRUE(WriteArenaPolicy(*dp, p).ok());
  absl::StatusOr<ArenaPolicy> ap = ReadArenaPolicy(*dp);
  ASSERT_TRUE(ap.ok());
  EXPECT_EQ(ap->epoch, 2u);
  EXPECT_EQ(ap->target_sparsity, 0.25);
  EXPECT_EQ(dp->arena().sparsity[0], 0.5) << "a per-layer policy leaves the table";
  const std::vector<double> table = {0.1, 0.7};
  ASSERT_TRUE(WriteArenaBudgets(*dp, table).ok());
  EXPECT_EQ(dp->arena().policy->epoch, 3u);
  EXPECT_EQ(dp->arena().sparsity[1], 0.7);
  const std::vector<double> bad = {0.1, 1.0};
  EXPECT_FALSE(WriteArenaBudgets(*dp, bad).ok());
  EXPECT_FALSE(WriteArenaBudgets(*dp, std::vector<double>{0.1}).ok());
  EXPECT_EQ(dp->arena().policy->epoch, 3u) << "a refused table changes nothing";
  EXPECT_EQ(dp->arena().sparsity[1], 0.7);
}

// The first table: uniform at the target, dense for a miss target (InitialBudget), whatever the
// table holds before (a miss-target session's first steps ran at the target until 2026-12-07).
TEST(LocalBudgets, WriteInitialIsTheTargetOrDenseForAMissTarget) {
  for (BudgetMode mode : {BudgetMode::kPerLayer, BudgetMode::kMissTarget}) {
    DataPlaneSpec spec = Spec(mode, 2);
    if (mode == BudgetMode::kMissTarget) spec.policy.miss_target = 0.02;
    std::unique_ptr<DataPlane> dp = *NewDataPlane(spec);
    const std::vector<double> other(Geo().layers, 0.3);
    ASSERT_TRUE(WriteArenaBudgets(*dp, other).ok());
    absl::StatusOr<LocalBudgets> budgets = LocalBudgets::Create(Geo());
    ASSERT_TRUE(budgets.ok()) << budgets.status();
    ASSERT_TRUE(budgets->WriteInitial(*dp).ok());
    for (uint32_t l = 0; l < Geo().layers; ++l) {
      EXPECT_EQ(dp->arena().sparsity[l], mode == BudgetMode::kMissTarget ? 0.0 : 0.5);
    }
  }
}

// The loop replay and the torch ops' local sessions run: a table only after probe steps, each
// with a new epoch, the first one uniform at the target.
TEST(LocalBudgets, RecomputesAfterProbeStepsOnly) {
  EXPECT_FALSE(LocalBudgets::Create(Geo(), BudgetTuning{.smoothing = 0}).ok());
  std::unique_ptr<DataPlane> dp = *NewDataPlane(Spec(BudgetMode::kPerLayer, 2));
  absl::StatusOr<LocalBudgets> budgets = LocalBudgets::Create(Geo());
  ASSERT_TRUE(budgets.ok()) << budgets.status();
  ASSERT_TRUE(budgets->WriteInitial(*dp).ok());
  EXPECT_EQ(dp->arena().policy->epoch, 2u);
  ASSERT_TRUE(dp->ResetSequence(0, 9).ok());
  std::mt19937 rng(5);
  std::normal_distribution<float> z(0, 1);
  std::vector<float> logits(512);
  const int32_t seq = 0, ctx = 512, q = 511;
  uint64_t written = 0;
  for (int64_t t = 0; t < 12; ++t) {
    ASSERT_TRUE(dp->BeginStep(StepBatch{&seq, &ctx, &q, 1, 1}).ok());
    for (int32_t l = 0; l < 2; ++l) {
      ASSERT_TRUE(dp->Select(l).ok());
      for (float& x : logits) x = z(rng) * (l + 1);
      ASSERT_TRUE(dp->Observe(l, logits.data(), 512).ok());
    }
    const uint64_t epoch = dp->arena().policy->epoch;
    absl::StatusOr<bool> wrote = budgets->AfterStep(*dp, t);
    ASSERT_TRUE(wrote.ok()) << wrote.status();
    if (t % 2 != 0) {
      EXPECT_FALSE(*wrote) << "step " << t << " is no probe step";
    }
    EXPECT_EQ(dp->arena().policy->epoch, epoch + (*wrote ? 1 : 0));
    written += *wrote;
  }
  EXPECT_GT(written, 0u);
  EXPECT_EQ(budgets->recomputes(), written);
}

}  // namespace
}  // namespace spin
