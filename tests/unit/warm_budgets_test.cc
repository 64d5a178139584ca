// The warm-budget store (service/warm_budgets.h): round trip, and every file it must ignore
// (each with a log line saying why): another geometry, another model, too old, malformed,
// out-of-range values; model names that are not safe file names.
#include "warm_budgets.h"

#include <unistd.h>

#include <ctime>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace spin::service {
namespace {

Geometry Geo() {
  Geometry g;
  g.layers = 2;
  g.max_seqs = 1;
  g.max_slots = 64 * 100;
  g.block_size = 64;
  g.topk = 256;
  return g;
}

struct Store {
  std::string dir = ::testing::TempDir() + "/warm-" + std::to_string(getpid());
  std::vector<std::string> logs;
  WarmBudgets warm{dir, std::chrono::hours(24), [this](const char* level, const std::string& m) {
                     logs.push_back(std::string(level) + ": " + m);
                   }};
  Store() {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  ~Store() { std::filesystem::remove_all(dir); }
};

std::vector<MissCurve> Curves() {
  std::vector<MissCurve> c(2);
  for (int p = 0; p < kCurvePoints; ++p) {
    c[0][p] = 0.5 / (p + 1);
    c[1][p] = 0.9 / (p + 1);
  }
  return c;
}

TEST(WarmBudgets, RoundTripAndWhatIsIgnored) {
  Store s;
  EXPECT_FALSE(s.warm.Load("m", Geo()).has_value()) << "nothing saved yet";
  EXPECT_TRUE(s.logs.empty()) << "a model seen for the first time is not worth a log line";
  s.warm.Save("m", Geo(), Curves(), 90);
  std::optional<WarmCurves> w = s.warm.Load("m", Geo());
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->curves, Curves());
  EXPECT_EQ(w->num_blocks, 90);
  EXPECT_NEAR(static_cast<double>(w->saved_unix), static_cast<double>(std::time(nullptr)), 5);
  // No temporary file is left behind.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(s.dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);

  Geometry other = Geo();
  other.topk = 512;
  EXPECT_FALSE(s.warm.Load("m", other).has_value());
  ASSERT_EQ(s.logs.size(), 1u);
  EXPECT_NE(s.logs[0].find("saved for 2 layers, block size 64, top-K 256"), std::string::npos)
      << s.logs[0];

  auto rewrite = [&](const std::function<void(nlohmann::json&)>& f) {
    nlohmann::json j;
    std::ifstream(s.warm.PathOf("m")) >> j;
    f(j);
    std::ofstream(s.warm.PathOf("m"), std::ios::trunc) << j.dump();
  };
  rewrite([](nlohmann::json& j) { j["saved_unix"] = std::time(nullptr) - 25 * 3600; });
  EXPECT_FALSE(s.warm.Load("m", Geo()).has_value());
  EXPECT_NE(s.logs.back().find("past --warm-max-age-hours 24"), std::string::npos) << s.logs.back();
  rewrite([](nlohmann::json& j) {
    j["saved_unix"] = std::time(nullptr);
    j["curves"][1][3] = 1.5;
  });
  EXPECT_FALSE(s.warm.Load("m", Geo()).has_value());
  EXPECT_NE(s.logs.back().find("a curve value 1.5"), std::string::npos) << s.logs.back();
  rewrite([](nlohmann::json& j) {
    j["curves"][1][3] = 0.1;
    j["model"] = "n";
  });
  EXPECT_FALSE(s.warm.Load("m", Geo()).has_value());
  EXPECT_NE(s.logs.back().find("another model"), std::string::npos);
  rewrite([](nlohmann::json& j) { j.erase("model"); });
  EXPECT_FALSE(s.warm.Load("m", Geo()).has_value());
  EXPECT_NE(s.logs.back().find("malformed"), std::string::npos) << s.logs.back();
  std::ofstream(s.warm.PathOf("m"), std::ios::trunc) << "[1, 2";
  EXPECT_FALSE(s.warm.Load("m", Geo()).has_value());
  EXPECT_NE(s.logs.back().find("not JSON"), std::string::npos);
  // Saving again repairs it.
  s.warm.Save("m", Geo(), Curves(), 90);
  EXPECT_TRUE(s.warm.Load("m", Geo()).has_value());
}

TEST(WarmBudgets, ModelNamesAreSafeFileNames) {
  for (const char* ok : {"deepseek-v3.2", "DeepSeek_V3.2-Exp", "a"}) {
    EXPECT_TRUE(ValidateModelName(ok).ok()) << ok;
  }
  for (const std::string& bad :
       {std::string(""), std::string(".hidden"), std::string("a/b"), std::string("../x"),
        std::string(129, 'a'), std::string("sp ace"), std::string("nul\0x", 5)}) {
    EXPECT_FALSE(ValidateModelName(bad).ok()) << bad;
  }
}

TEST(WarmBudgets, DisabledAndUnwritableStoresDoNothingButLog) {
  std::vector<std::string> logs;
  WarmBudgets off("", std::chrono::hours(1), nullptr);
  EXPECT_FALSE(off.enabled());
  off.Save("m", Geo(), Curves(), 10);
  EXPECT_FALSE(off.Load("m", Geo()).has_value());
  WarmBudgets missing(::testing::TempDir() + "/no-such-dir-" + std::to_string(getpid()),
                      std::chrono::hours(1),
                      [&](const char*, const std::string& m) { logs.push_back(m); });
  missing.Save("m", Geo(), Curves(), 10);
  ASSERT_EQ(logs.size(), 1u);
  EXPECT_NE(logs[0].find("exists and is writable"), std::string::npos) << logs[0];
}

}  // namespace
}  // namespace spin::service
