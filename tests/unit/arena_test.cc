#include "spin/arena.h"

#include <cmath>
#include <cstring>

#include "gtest/gtest.h"
#include "test_arena.h"

namespace spin::testing {
namespace {

Geometry Geo(StateDtype dt = StateDtype::kFp32) {
  Geometry g;
  g.layers = 3;
  g.max_seqs = 2;
  g.max_slots = 1000;
  g.block_size = 64;
  g.topk = 128;
  g.max_rows = 2;
  g.dtype = dt;
  return g;
}

TEST(Arena, StateCostsEightBytesPerSlotFp32AndFourBf16) {
  const uint64_t fp32 = ArenaBytes(Geo(StateDtype::kFp32));
  const uint64_t bf16 = ArenaBytes(Geo(StateDtype::kBf16));
  // The state dominates: 2 seqs x 3 layers x 1000 slots x (V + D).
  EXPECT_GE(fp32, 2u * 3 * 1000 * 8);
  EXPECT_GE(bf16, 2u * 3 * 1000 * 4);
  EXPECT_NEAR(static_cast<double>(fp32 - bf16), 2.0 * 3 * 1000 * 4, 512.0);
  EXPECT_EQ(fp32 % kArenaAlign, 0u);
}

TEST(Arena, InitWritesAValidHeaderAndUnsetState) {
  for (StateDtype dt : {StateDtype::kFp32, StateDtype::kBf16}) {
    TestArena t(Geo(dt));
    auto view = ViewArena(t.base(), t.bytes());
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->geometry.max_slots, 1000u);
    EXPECT_EQ(view->max_blocks, 16u);
    EXPECT_EQ(view->header->version, kArenaLayoutVersion);
    for (int s = 0; s < 2; ++s) {
      for (int l = 0; l < 3; ++l) {
        EXPECT_TRUE(t.Fresh(s, l));
        EXPECT_TRUE(std::isnan(t.Get(s, l, 0, 0)));
        EXPECT_TRUE(std::isnan(t.Get(s, l, 1, 999)));
      }
    }
    EXPECT_EQ(view->sparsity[2], 0.5);
    EXPECT_EQ(view->policy->epoch, 1u);
  }
}

// A miss-target arena starts dense: before the first probe curve nothing says what a sparsity
// would miss (a daemon's session ran its first steps at the uniform target before 2026-12-07,
// until the probe thread's first pass). The other modes start at the target.
TEST(Arena, InitialBudgetIsDenseOnlyForAMissTarget) {
  Policy p;
  p.target_sparsity = 0.6;
  p.probe_period = 8;
  for (BudgetMode mode : {BudgetMode::kUniform, BudgetMode::kPerLayer, BudgetMode::kMissTarget}) {
    p.budget_mode = mode;
    p.miss_target = mode == BudgetMode::kMissTarget ? 0.02 : 0.0;
    const double want = mode == BudgetMode::kMissTarget ? 0.0 : 0.6;
    EXPECT_EQ(InitialBudget(p), want);
    TestArena t(Geo(), p);
    for (int l = 0; l < 3; ++l) EXPECT_EQ(t.view().sparsity[l], want) << "mode " << int(mode);
  }
}

TEST(Arena, ViewRejectsWhatIsNotAnArena) {
  TestArena t(Geo());
  EXPECT_FALSE(ViewArena(t.base(), 16).ok());
  EXPECT_FALSE(ViewArena(t.base(), t.bytes() - 1).ok());
  EXPECT_FALSE(ViewArena(t.base() + 8, t.bytes() - 256).ok());
  auto* h = reinterpret_cast<ArenaHeader*>(t.base());
  h->version = 99;
  EXPECT_EQ(ViewArena(t.base(), t.bytes()).status().code(), absl::StatusCode::kFailedPrecondition);
  h->version = kArenaLayoutVersion;
  h->off_state += 256;
  EXPECT_FALSE(ViewArena(t.base(), t.bytes()).ok());
  h->off_state -= 256;
  h->magic = 0;
  EXPECT_NE(ViewArena(t.base(), t.bytes()).status().message().find("magic"), std::string::npos);
  h->magic = kArenaMagic;
  EXPECT_TRUE(ViewArena(t.base(), t.bytes()).ok());
}

TEST(Arena, GeometryLimits) {
  Geometry g = Geo();
  EXPECT_TRUE(ValidateGeometry(g).ok());
  g.layers = 0;
  EXPECT_NE(ValidateGeometry(g).message().find("layers"), std::string::npos);
  g = Geo();
  g.max_rows = kMaxRows + 1;
  EXPECT_FALSE(ValidateGeometry(g).ok());
  g = Geo();
  g.max_slots = kMaxSlots + 1;
  EXPECT_FALSE(ValidateGeometry(g).ok());
  g = Geo();
  g.dtype = static_cast<StateDtype>(7);
  EXPECT_FALSE(ValidateGeometry(g).ok());
}

TEST(Arena, PolicyValidationAndWrite) {
  TestArena t(Geo());
  Policy p;
  p.target_sparsity = 0.3;
  p.exploration = 0.1;
  p.alpha = 0.9f;
  p.probe_period = 8;
  ASSERT_TRUE(WritePolicy(t.view(), p).ok());
  EXPECT_EQ(t.view().policy->epoch, 2u);
  EXPECT_EQ(t.view().sparsity[0], 0.3);
  EXPECT_EQ(FloatBits(t.view().policy->beta), 0x3DCCCCD0u);  // 1 - 0.9f = 0.100000024, exact
  const Policy back = ReadPolicy(t.view());
  EXPECT_EQ(back.probe_period, 8u);
  EXPECT_EQ(back.alpha, 0.9f);
  for (Policy bad :
       {Policy{1.0}, Policy{-0.1}, Policy{NAN}, Policy{0.5, 1.0}, Policy{0.5, -1},
        Policy{0.5, 0.05, 1.0f}, Policy{0.5, 0.05, NAN}, Policy{0.5, 0.05, 0.5f, (1u << 20) + 1},
        Policy{0.5, 0.05, 0.5f, 0, static_cast<BudgetMode>(0)}}) {
    const std::vector<uint8_t> before = t.Snapshot();
    EXPECT_EQ(WritePolicy(t.view(), bad).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(t.Snapshot() == before);
  }
}

}  // namespace
}  // namespace spin::testing
