// spind's report of a written budget table (service/budget_probe.h): every table is published;
// a miss-target session's level recomputes are logged at most once per kLevelLogInterval, with
// the count left out, while the other reasons are always logged.
#include "budget_probe.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace spin::service {
namespace {

struct Recorder {
  int published = 0;
  std::vector<std::string> lines;
  std::function<void(Session&)> publish() {
    return [this](Session&) { ++published; };
  }
  std::function<void(const char*, const std::string&)> log() {
    return [this](const char*, const std::string& l) { lines.push_back(l); };
  }
};

TEST(ReportBudgets, LevelRecomputesAreLoggedOncePerIntervalWithTheCountLeftOut) {
  Session s;
  s.id = "s-1";
  Recorder r;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 5; ++i) {
    s.budget_recomputes += 1;
    s.budget_reason = i % 2 ? "slack (layer 1)" : "miss 0.0300 over level 0.0200 (layer 0)";
    ReportBudgets(s, t0 + std::chrono::seconds(i), r.publish(), r.log());
  }
  EXPECT_EQ(r.published, 5);
  ASSERT_EQ(r.lines.size(), 1u);
  EXPECT_EQ(r.lines[0],
            "session s-1: per-layer budgets recomputed (miss 0.0300 over level 0.0200 (layer 0)), "
            "recompute 1");
  // Other reasons are not limited, and do not reset the count.
  s.budget_reason = "target";
  ReportBudgets(s, t0 + std::chrono::seconds(6), r.publish(), r.log());
  ASSERT_EQ(r.lines.size(), 2u);
  EXPECT_EQ(r.lines[1], "session s-1: per-layer budgets recomputed (target), recompute 5");
  // The next level line after the interval says how many were left out (4).
  s.budget_recomputes += 1;
  s.budget_reason = "slack (layer 2)";
  ReportBudgets(s, t0 + kLevelLogInterval, r.publish(), r.log());
  ASSERT_EQ(r.lines.size(), 3u);
  EXPECT_EQ(r.lines[2],
            "session s-1: per-layer budgets recomputed (slack (layer 2)), recompute 6; 4 level "
            "recomputes since the last such line not logged");
  EXPECT_EQ(s.level_unlogged, 0u);
  EXPECT_EQ(r.published, 7);
}

}  // namespace
}  // namespace spin::service
