// spind's node-wide default policy (service/node_defaults.h): merges, refusals, and concurrent
// operators who set different fields.
#include "node_defaults.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace spin::service {
namespace {

namespace pb = spin::v1;

pb::SetDefaultPolicyRequest SetSparsity(double x) {
  pb::SetDefaultPolicyRequest r;
  r.mutable_defaults()->set_target_sparsity(x);
  return r;
}

pb::SetDefaultPolicyRequest SetExploration(double x) {
  pb::SetDefaultPolicyRequest r;
  r.mutable_defaults()->set_exploration(x);
  return r;
}

TEST(NodeDefaults, SetFieldsMergeAndABadValueChangesNothing) {
  NodeDefaults d("");
  ASSERT_TRUE(d.Set(SetSparsity(0.4), nullptr).ok());
  absl::StatusOr<pb::PolicyDefaults> now = d.Set(SetExploration(0.1), nullptr);
  ASSERT_TRUE(now.ok());
  EXPECT_DOUBLE_EQ(now->target_sparsity(), 0.4);
  EXPECT_DOUBLE_EQ(now->exploration(), 0.1);
  EXPECT_FALSE(d.Set(SetSparsity(1.5), nullptr).ok());
  std::optional<pb::PolicyDefaults> kept = d.ChangedSince(0);
  ASSERT_TRUE(kept.has_value());
  EXPECT_DOUBLE_EQ(kept->target_sparsity(), 0.4);
}

// Two operators at once, each setting only its own field, many times: every Set must see the
// other's last write. With the read and the write in two lock sections, a Set could write back
// the defaults it read before the other's write, and the other's field was lost.
TEST(NodeDefaults, ConcurrentSetsOfDifferentFieldsLoseNothing) {
  for (int round = 0; round < 20; ++round) {
    NodeDefaults d("");
    constexpr int kSets = 2000;
    std::thread a([&] {
      for (int i = 1; i <= kSets; ++i)
        ASSERT_TRUE(d.Set(SetSparsity(i / (kSets + 1.0)), nullptr).ok());
    });
    std::thread b([&] {
      for (int i = 1; i <= kSets; ++i) {
        ASSERT_TRUE(d.Set(SetExploration(i / (kSets + 1.0) * 0.5), nullptr).ok());
      }
    });
    a.join();
    b.join();
    std::optional<pb::PolicyDefaults> now = d.ChangedSince(0);
    ASSERT_TRUE(now.has_value());
    ASSERT_DOUBLE_EQ(now->target_sparsity(), kSets / (kSets + 1.0)) << "round " << round;
    ASSERT_DOUBLE_EQ(now->exploration(), kSets / (kSets + 1.0) * 0.5) << "round " << round;
  }
}

}  // namespace
}  // namespace spin::service
