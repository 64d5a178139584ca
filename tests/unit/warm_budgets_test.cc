// The warm-budget store (service/warm_budgets.h): round trip, and every file it must ignore
// (each with a log line saying why): another geometry, another model, too old, malformed,
// out-of-range values; model names that are not safe file names.
#include "warm_budgets.h"

#include <sys/stat.h>
#include <unistd.h>

#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <thread>
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

// Issue 34 item 2: the state dir cannot be turned against spind.
// Writes go to a new, exclusively created temporary file with an unpredictable name: symlinks
// planted at every name the old code used (path.tmp.<pid>.<thread hash>) or at the file itself
// are never written through; the file ends up a regular file of spind's.
TEST(StateDir, WritesNeverFollowAPlantedSymlink) {
  Store s;
  const std::string victim = s.dir + "/../victim-" + std::to_string(getpid());
  { std::ofstream(victim) << "precious\n"; }
  const std::string path = s.warm.PathOf("m");
  const std::string learnable =
      path + ".tmp." + std::to_string(getpid()) + "." +
      std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()));
  std::filesystem::create_symlink(victim, learnable);
  std::filesystem::create_symlink(victim, path);
  s.warm.Save("m", Geo(), Curves(), 90);
  std::ifstream in(victim);
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(text, "precious\n") << "a file outside the state dir was written";
  EXPECT_TRUE(std::filesystem::is_regular_file(std::filesystem::symlink_status(path)));
  ASSERT_TRUE(s.warm.Load("m", Geo()).has_value());
  // Nothing left behind but the planted link itself.
  int tmp = 0;
  for (const auto& e : std::filesystem::directory_iterator(s.dir)) {
    if (e.path().string().find(".tmp.") != std::string::npos && e.path() != learnable) ++tmp;
  }
  EXPECT_EQ(tmp, 0);
  std::filesystem::remove(victim);
}

// Only regular files are read, never past a size cap, and none can hang the reader: a FIFO, a
// symlink (to /dev/zero), a directory and an oversize (sparse) file are each refused at once with
// a reason, and Load ignores them with a log line.
TEST(StateDir, ReadsOnlyBoundedRegularFiles) {
  Store s;
  const std::string fifo = s.dir + "/fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  absl::StatusOr<std::string> r = ReadStateFile(fifo, 1024);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("not a regular file"), std::string::npos) << r.status();
  const std::string zero = s.dir + "/zero";
  std::filesystem::create_symlink("/dev/zero", zero);
  r = ReadStateFile(zero, 1024);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("symlink"), std::string::npos) << r.status();
  r = ReadStateFile(s.dir, 1024);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  const std::string big = s.dir + "/big";
  { std::ofstream f(big); }
  std::filesystem::resize_file(big, std::uintmax_t{1} << 30);  // sparse: no disk used
  r = ReadStateFile(big, kMaxDefaultsFileBytes);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("over the"), std::string::npos) << r.status();
  EXPECT_EQ(ReadStateFile(s.dir + "/none", 1024).status().code(), absl::StatusCode::kNotFound);
  { std::ofstream(s.dir + "/ok") << "{}"; }
  r = ReadStateFile(s.dir + "/ok", 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, "{}");
  EXPECT_FALSE(ReadStateFile(s.dir + "/ok", 1).ok());

  // Through Load: a FIFO, a symlink to /dev/zero and a 32 MB file as a model's warm file.
  ASSERT_EQ(mkfifo(s.warm.PathOf("fifo").c_str(), 0600), 0);
  std::filesystem::create_symlink("/dev/zero", s.warm.PathOf("zero"));
  {
    std::ofstream f(s.warm.PathOf("huge"));
    f << std::string(32u << 20, ' ');
  }
  for (const char* model : {"fifo", "zero", "huge"}) {
    s.logs.clear();
    EXPECT_FALSE(s.warm.Load(model, Geo()).has_value()) << model;
    ASSERT_EQ(s.logs.size(), 1u) << model;
    EXPECT_NE(s.logs[0].find("ignored"), std::string::npos) << s.logs[0];
  }
}

// A saved time outside [1970, now + a day] never makes a stale file look fresh (before, -2^63 or
// 1e300 overflowed the age).
TEST(StateDir, OutOfRangeSavedTimesAreIgnored) {
  Store s;
  s.warm.Save("m", Geo(), Curves(), 90);
  nlohmann::json j;
  {
    std::ifstream in(s.warm.PathOf("m"));
    in >> j;
  }
  const int64_t now = static_cast<int64_t>(std::time(nullptr));
  for (const nlohmann::json& t :
       {nlohmann::json(std::numeric_limits<int64_t>::min()), nlohmann::json(1e300),
        nlohmann::json(-1), nlohmann::json(now + 10 * 86400), nlohmann::json("1700000000")}) {
    j["saved_unix"] = t;
    std::ofstream(s.warm.PathOf("m"), std::ios::trunc) << j.dump();
    s.logs.clear();
    EXPECT_FALSE(s.warm.Load("m", Geo()).has_value()) << t.dump();
    ASSERT_EQ(s.logs.size(), 1u) << t.dump();
  }
  j["saved_unix"] = now - 60;
  std::ofstream(s.warm.PathOf("m"), std::ios::trunc) << j.dump();
  EXPECT_TRUE(s.warm.Load("m", Geo()).has_value());
}

}  // namespace
}  // namespace spin::service
