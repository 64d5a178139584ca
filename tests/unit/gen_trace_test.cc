#include "gen_trace.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "npy.h"
#include "trace.h"

namespace spin {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed at the end: generated traces run to tens of MiB.
class ScopedTestDir {
 public:
  ScopedTestDir() {
    const auto* info = testing::UnitTest::GetInstance()->current_test_info();
    path_ =
        (fs::path(testing::TempDir()) / "gen_trace_test" / info->test_suite_name() / info->name())
            .string();
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ScopedTestDir() { fs::remove_all(path_); }
  ScopedTestDir(const ScopedTestDir&) = delete;
  ScopedTestDir& operator=(const ScopedTestDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Small enough for many tests, big enough to have regions, bands and a shift.
GenTraceOptions SmallOptions() {
  GenTraceOptions o;
  o.layers = 3;
  o.slots = 4096;
  o.steps = 40;
  o.topk = 512;
  return o;
}

TEST(GenTraceOptions, DefaultsResolve) {
  const GenTraceOptions o;
  EXPECT_TRUE(ValidateGenTraceOptions(o).ok());
  EXPECT_EQ(ResolvedPromptLen(o), 16384 - 256 - 64);
  EXPECT_EQ(ShiftSteps(o), (std::vector<int>{85, 170}));
  GenTraceOptions none = o;
  none.shifts = 0;
  EXPECT_TRUE(ShiftSteps(none).empty());
}

TEST(GenTraceOptions, RejectsBadOptions) {
  const ScopedTestDir tmp;
  struct Case {
    void (*edit)(GenTraceOptions&);
    const char* phrase;
  } cases[] = {
      {[](GenTraceOptions& o) { o.layers = 0; }, "layers is 0; must be > 0"},
      {[](GenTraceOptions& o) { o.rows = -1; }, "rows is -1; must be > 0"},
      {[](GenTraceOptions& o) { o.topk = 0; }, "topk is 0"},
      {[](GenTraceOptions& o) { o.accept_rate = 1.5; }, "accept_rate is 1.5; must be in [0, 1]"},
      {[](GenTraceOptions& o) { o.nonfinite_rate = -0.1; }, "nonfinite_rate is -0.1"},
      {[](GenTraceOptions& o) { o.noise_scale = -1; }, "noise_scale is -1"},
      {[](GenTraceOptions& o) { o.shifts = -1; }, "shifts and shift_needles must be >= 0"},
      {[](GenTraceOptions& o) { o.prompt_len = 16200; }, "prompt_len 16200 with steps=256"},
      {[](GenTraceOptions& o) { o.slots = 200; }, "raise slots"},
      {[](GenTraceOptions& o) { o.prompt_len = 0; }, "prompt_len 0"},
  };
  for (const Case& c : cases) {
    GenTraceOptions o;
    c.edit(o);
    absl::Status status = ValidateGenTraceOptions(o);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.phrase;
    EXPECT_NE(status.message().find(c.phrase), std::string::npos)
        << "\"" << status.message() << "\" lacks \"" << c.phrase << "\"";
    EXPECT_EQ(GenerateTrace(tmp.path() + "/t", o).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(GenerateTrace, SameSeedSameBytesOtherSeedOtherBytes) {
  const ScopedTestDir tmp;
  const std::string dir = tmp.path();
  GenTraceOptions o = SmallOptions();
  ASSERT_TRUE(GenerateTrace(dir + "/a", o).ok());
  ASSERT_TRUE(GenerateTrace(dir + "/b", o).ok());
  o.seed = 2;
  ASSERT_TRUE(GenerateTrace(dir + "/c", o).ok());
  for (const char* file : {"meta.json", "scores.npy"}) {
    EXPECT_EQ(ReadBytes(dir + "/a/" + file), ReadBytes(dir + "/b/" + file)) << file;
  }
  EXPECT_NE(ReadBytes(dir + "/a/scores.npy"), ReadBytes(dir + "/c/scores.npy"));
}

TEST(GenerateTrace, SingleRowTraceIsWellFormed) {
  const ScopedTestDir tmp;
  const std::string dir = tmp.path();
  const GenTraceOptions o = SmallOptions();
  ASSERT_TRUE(GenerateTrace(dir, o).ok());
  absl::StatusOr<Trace> trace = LoadTrace(dir);
  ASSERT_TRUE(trace.ok()) << trace.status();
  const TraceMeta& m = trace->meta();
  EXPECT_EQ(m.layers, o.layers);
  EXPECT_EQ(m.steps, o.steps);
  EXPECT_EQ(m.rows, 1);
  EXPECT_EQ(m.block_size, o.block_size);
  EXPECT_EQ(m.topk, o.topk);
  EXPECT_EQ(trace->n_max(), o.slots);
  EXPECT_TRUE(m.accepted.empty());
  for (int t = 0; t < m.steps; ++t) {
    EXPECT_EQ(m.ctx_len[t], ResolvedPromptLen(o) + t);
    EXPECT_EQ(m.q_pos[t], m.ctx_len[t] - 1);
    for (int l = 0; l < m.layers; ++l) {
      const float* z = trace->scores(t, l, 0);
      for (int i = 0; i < m.ctx_len[t]; ++i) ASSERT_TRUE(std::isfinite(z[i]));
      // Attention sinks lead every step.
      EXPECT_GT(z[0], z[m.ctx_len[t] / 2]);
    }
  }
}

TEST(GenerateTrace, MtpTraceHasPrefixValidAcceptance) {
  const ScopedTestDir tmp;
  const std::string dir = tmp.path();
  GenTraceOptions o = SmallOptions();
  o.rows = 3;
  o.steps = 200;
  o.accept_rate = 0.6;
  ASSERT_TRUE(GenerateTrace(dir, o).ok());
  absl::StatusOr<Trace> trace = LoadTrace(dir);
  ASSERT_TRUE(trace.ok()) << trace.status();
  const TraceMeta& m = trace->meta();
  EXPECT_EQ(m.rows, 3);
  ASSERT_EQ(m.accepted.size(), 200u);
  EXPECT_EQ(m.ctx_len[0], ResolvedPromptLen(o));
  double accepted_sum = 0;
  for (int t = 0; t < m.steps; ++t) {
    EXPECT_GE(m.accepted[t], 1);  // row 0 is the verified token
    EXPECT_LE(m.accepted[t], m.rows);
    EXPECT_EQ(m.q_pos[t], m.ctx_len[t] - 1);
    if (t + 1 < m.steps) {
      EXPECT_EQ(m.ctx_len[t + 1], m.ctx_len[t] + m.accepted[t]);
    }
    accepted_sum += m.accepted[t];
    for (int r = 0; r < m.rows; ++r) {
      const float* z = trace->scores(t, 0, r);
      EXPECT_TRUE(std::isfinite(z[m.ctx_len[t] + r - 1]));  // the row's own key
      if (m.ctx_len[t] + r < trace->n_max()) {
        EXPECT_EQ(z[m.ctx_len[t] + r], 0.0f);  // beyond the row's context
      }
    }
  }
  // E[accepted] = 1 + p + p^2 for three rows.
  EXPECT_NEAR(accepted_sum / m.steps, 1 + 0.6 + 0.36, 0.15);
  // Rows of one step are consecutive queries over the same context: as correlated as
  // consecutive steps.
  const float* r0 = trace->scores(10, 1, 0);
  const float* r2 = trace->scores(10, 1, 2);
  double dot = 0, n0 = 0, n2 = 0, m0 = 0, m2 = 0;
  const int n = m.ctx_len[10];
  for (int i = 0; i < n; ++i) {
    m0 += r0[i] / n;
    m2 += r2[i] / n;
  }
  for (int i = 0; i < n; ++i) {
    dot += (r0[i] - m0) * (r2[i] - m2);
    n0 += (r0[i] - m0) * (r0[i] - m0);
    n2 += (r2[i] - m2) * (r2[i] - m2);
  }
  EXPECT_GT(dot / std::sqrt(n0 * n2), 0.7);
}

TEST(GenerateTrace, NonFiniteScoresAtTheRequestedRate) {
  const ScopedTestDir tmp;
  const std::string dir = tmp.path();
  GenTraceOptions o = SmallOptions();
  o.nonfinite_rate = 0.01;
  ASSERT_TRUE(GenerateTrace(dir, o).ok());
  absl::StatusOr<Trace> trace = LoadTrace(dir);
  ASSERT_TRUE(trace.ok()) << trace.status();
  int64_t bad = 0, total = 0;
  bool nan = false, pos_inf = false, neg_inf = false;
  for (int t = 0; t < o.steps; ++t) {
    for (int l = 0; l < o.layers; ++l) {
      const float* z = trace->scores(t, l, 0);
      for (int i = 0; i < trace->meta().ctx_len[t]; ++i, ++total) {
        if (std::isfinite(z[i])) continue;
        ++bad;
        nan |= std::isnan(z[i]);
        pos_inf |= z[i] == std::numeric_limits<float>::infinity();
        neg_inf |= z[i] == -std::numeric_limits<float>::infinity();
      }
    }
  }
  EXPECT_NEAR(static_cast<double>(bad) / total, 0.01, 0.002);
  EXPECT_TRUE(nan && pos_inf && neg_inf);
  absl::StatusOr<TraceStats> stats = ComputeTraceStats(*trace);
  ASSERT_TRUE(stats.ok());
  EXPECT_TRUE(std::isfinite(stats->prev_iter_pearson));
  EXPECT_TRUE(std::isfinite(stats->prev_iter_recall));
}

// The default trace (256 steps x 8 layers x 16384 slots, 128 MiB), generated once per process
// (ctest runs each test in its own process, so the tests are few and the directory per-pid).
class DefaultTrace : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string((fs::path(testing::TempDir()) / "gen_trace_test" /
                            ("DefaultTrace." + std::to_string(::getpid())))
                               .string());
    fs::remove_all(*dir_);
    const auto start = std::chrono::steady_clock::now();
    absl::Status status = GenerateTrace(*dir_, GenTraceOptions());
    seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_TRUE(status.ok()) << status;
    absl::StatusOr<Trace> trace = LoadTrace(*dir_);
    ASSERT_TRUE(trace.ok()) << trace.status();
    trace_ = new Trace(*std::move(trace));
    absl::StatusOr<TraceStats> stats = ComputeTraceStats(*trace_);
    ASSERT_TRUE(stats.ok()) << stats.status();
    stats_ = new TraceStats(*std::move(stats));
  }
  static void TearDownTestSuite() {
    delete stats_;
    delete trace_;
    if (dir_ != nullptr) fs::remove_all(*dir_);
    delete dir_;
  }
  void SetUp() override { ASSERT_NE(stats_, nullptr) << "generating the default trace failed"; }

  static std::string* dir_;
  static Trace* trace_;
  static TraceStats* stats_;
  static double seconds_;
};

std::string* DefaultTrace::dir_ = nullptr;
Trace* DefaultTrace::trace_ = nullptr;
TraceStats* DefaultTrace::stats_ = nullptr;
double DefaultTrace::seconds_ = 0;

TEST_F(DefaultTrace, StatsInThePapersRangeForRealModels) {
  RecordProperty("generate_seconds", std::to_string(seconds_));
  std::cout << "default trace: generated in " << seconds_ << " s\n" << FormatTraceStats(*stats_);
  // Paper, Table 1 (real DeepSeek models): prev-iter Pearson 0.85-0.91, top-K recall 0.58-0.82.
  EXPECT_GE(stats_->prev_iter_pearson, 0.85);
  EXPECT_LE(stats_->prev_iter_pearson, 0.91);
  EXPECT_GE(stats_->prev_iter_recall, 0.58);
  EXPECT_LE(stats_->prev_iter_recall, 0.82);
  // And near the middle, so small model changes do not silently drift out of range.
  EXPECT_NEAR(stats_->prev_iter_pearson, 0.88, 0.02);
  EXPECT_NEAR(stats_->prev_iter_recall, 0.70, 0.04);
  // Cross-layer correlation well below prev-iter, as in the paper (0.29-0.55 there).
  EXPECT_GT(stats_->prev_layer_pearson, 0.2);
  EXPECT_LT(stats_->prev_layer_pearson, 0.6);

  // Layers differ in difficulty.
  ASSERT_EQ(stats_->per_layer_pearson.size(), 8u);
  ASSERT_EQ(stats_->per_layer_recall.size(), 8u);
  const auto [pmin, pmax] =
      std::minmax_element(stats_->per_layer_pearson.begin(), stats_->per_layer_pearson.end());
  const auto [rmin, rmax] =
      std::minmax_element(stats_->per_layer_recall.begin(), stats_->per_layer_recall.end());
  EXPECT_GT(*pmax - *pmin, 0.08);
  EXPECT_GT(*rmax - *rmin, 0.1);
  // The hardest layer by Pearson is also among the hard ones by recall.
  const size_t hardest = pmin - stats_->per_layer_pearson.begin();
  EXPECT_LT(stats_->per_layer_recall[hardest], stats_->prev_iter_recall);

  // The top-K is clustered into blocks: 2048 of ~16K slots spread evenly would touch nearly every
  // 64-slot block.
  EXPECT_LT(stats_->topk_block_coverage, 0.8);
  EXPECT_GT(stats_->topk_block_coverage, 0.3);
}

TEST_F(DefaultTrace, ShiftsAreVisibleAsRecallDipsAndStay) {
  const std::vector<int> shifts = ShiftSteps(GenTraceOptions());
  ASSERT_EQ(shifts, (std::vector<int>{85, 170})) << "the loops below must check two shifts";
  const std::vector<double>& recall = stats_->per_step_recall;
  ASSERT_EQ(recall.size(), 256u);
  EXPECT_TRUE(std::isnan(recall[0]));
  for (int s : shifts) {
    EXPECT_LT(recall[s], recall[s - 1] - 0.03) << "shift at step " << s;
    EXPECT_LT(recall[s], recall[s + 1] - 0.03) << "shift at step " << s;
    EXPECT_LT(stats_->per_step_pearson[s], stats_->per_step_pearson[s - 1] - 0.03);
  }
  // The worst step of the whole trace is a shift.
  const int worst = std::min_element(recall.begin() + 1, recall.end()) - recall.begin();
  EXPECT_NE(std::find(shifts.begin(), shifts.end(), worst), shifts.end()) << worst;

  // Recall recovers at once: the needles persist (needles that flickered would keep costing it).
  for (int s : shifts) {
    double after = 0;
    for (int t = s + 1; t <= s + 10; ++t) after += recall[t] / 10;
    EXPECT_NEAR(after, stats_->prev_iter_recall, 0.05);
  }
}

TEST(GenerateTrace, OtherSeedsAlsoLandInRange) {
  // A smaller trace of the same density (K / N = 1/8) for other seeds: the tuning is not
  // specific to seed 1.
  const ScopedTestDir tmp;
  for (uint64_t seed : {2, 3}) {
    const std::string dir = tmp.path() + "/" + std::to_string(seed);
    GenTraceOptions o;
    o.seed = seed;
    o.slots = 8192;
    o.topk = 1024;
    o.steps = 96;
    ASSERT_TRUE(GenerateTrace(dir, o).ok());
    absl::StatusOr<Trace> trace = LoadTrace(dir);
    ASSERT_TRUE(trace.ok()) << trace.status();
    absl::StatusOr<TraceStats> stats = ComputeTraceStats(*trace);
    ASSERT_TRUE(stats.ok());
    EXPECT_GE(stats->prev_iter_pearson, 0.85) << "seed " << seed;
    EXPECT_LE(stats->prev_iter_pearson, 0.91) << "seed " << seed;
    EXPECT_GE(stats->prev_iter_recall, 0.58) << "seed " << seed;
    EXPECT_LE(stats->prev_iter_recall, 0.82) << "seed " << seed;
  }
}

// Hand-made traces with known statistics.
class StatsOf : public testing::Test {
 protected:
  // One layer, one row, 10 slots; step t has context 8 + t. Steps are zero-padded to 10.
  absl::StatusOr<TraceStats> Compute(const std::vector<std::vector<float>>& steps, int topk) {
    TraceMeta meta;
    meta.layers = 1;
    meta.block_size = 2;
    meta.topk = topk;
    meta.steps = static_cast<int>(steps.size());
    std::vector<float> scores;
    for (int t = 0; t < meta.steps; ++t) {
      meta.q_pos.push_back(7 + t);
      meta.ctx_len.push_back(8 + t);
      std::vector<float> row = steps[t];
      row.resize(10, 0.0f);
      scores.insert(scores.end(), row.begin(), row.end());
    }
    const ScopedTestDir tmp;
    const std::string dir = tmp.path();
    EXPECT_TRUE(WriteTrace(dir, meta, 10, scores.data()).ok());
    absl::StatusOr<Trace> trace = LoadTrace(dir);
    if (!trace.ok()) return trace.status();
    return ComputeTraceStats(*trace);
  }

  ScopedTestDir tmp_;
};

TEST_F(StatsOf, KnownPearsonAndRecall) {
  // Step 1 reverses step 0 on the 8 shared slots; its 9th slot is new context.
  absl::StatusOr<TraceStats> s =
      Compute({{0, 1, 2, 3, 4, 5, 6, 7, 0}, {7, 6, 5, 4, 3, 2, 1, 0, 100}}, 3);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NEAR(s->prev_iter_pearson, -1.0, 1e-9);  // over slots < ctx_len[0] = 8 only
  // top3(step 0) = {5, 6, 7}; top3(step 1) = {8, 0, 1}: no overlap.
  EXPECT_EQ(s->prev_iter_recall, 0.0);
  EXPECT_EQ(s->per_layer_recall, std::vector<double>{0.0});
}

TEST_F(StatsOf, TiesGoToTheLowerSlot) {
  // All equal: both top-4 sets are slots {0..3}, recall 1.
  absl::StatusOr<TraceStats> s =
      Compute({std::vector<float>(10, 1.0f), std::vector<float>(10, 1.0f)}, 4);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->prev_iter_recall, 1.0);
  EXPECT_TRUE(std::isnan(s->prev_iter_pearson));  // no variance: the pair is skipped
  // Top-K coverage: slots 0..3 fill 2 of 4 blocks (block size 2, ctx 8), 2 of 5 at ctx 9.
  EXPECT_NEAR(s->topk_block_coverage, (2.0 / 4 + 2.0 / 5) / 2, 1e-12);
}

TEST_F(StatsOf, RecallDividesByMinOfKAndContext) {
  // K = 20 exceeds the context: each top-K is the whole (finite) context.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  absl::StatusOr<TraceStats> s =
      Compute({{1, 2, 3, 4, 5, 6, 7, nan, 0}, {1, 2, 3, 4, 5, 6, 7, 8, 9}}, 20);
  ASSERT_TRUE(s.ok());
  // top(0) = 7 finite slots, top(1) = 9 slots, overlap 7, divided by min(20, 9).
  EXPECT_NEAR(s->prev_iter_recall, 7.0 / 9.0, 1e-12);
  EXPECT_NEAR(s->prev_iter_pearson, 1.0, 1e-9);  // NaN pair skipped
}

TEST_F(StatsOf, NeedsTwoSteps) {
  absl::StatusOr<TraceStats> s = Compute({{1, 2, 3, 4, 5, 6, 7, 8, 9}}, 2);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("at least 2 steps"), std::string::npos);
}

}  // namespace
}  // namespace spin
