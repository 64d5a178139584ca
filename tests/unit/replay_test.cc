// End-to-end replay: the data plane driven over traces must match the naive oracle (docs/design.md
// §5) step for step and layer for layer, on traces built here independently of the generator and on
// generated ones.
#include "replay.h"

#include <cmath>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gen_trace.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "oracle.h"
#include "trace.h"

namespace spin::testing {
namespace {

std::string TempDir(const std::string& name) {
  return ::testing::TempDir() + "/spin_replay_" + name;
}

// A random trace with structure the oracle does not know about: per-layer persistent slot
// weights, a recency band, noise, optional NaN/inf, MTP rows with random acceptance, and query
// positions that sometimes trail the context (compressed slots).
Trace RandomTrace(const std::string& dir, int layers, int n_max, int steps, int rows, int topk,
                  uint32_t seed, double nonfinite) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  TraceMeta meta;
  meta.layers = layers;
  meta.block_size = 64;
  meta.topk = topk;
  meta.steps = steps;
  meta.rows = rows;
  std::vector<std::vector<float>> weight(layers, std::vector<float>(n_max));
  for (auto& w : weight) {
    for (float& x : w) x = gauss(rng) + (unit(rng) < 0.02 ? 4.0f : 0.0f);
  }
  int ctx = n_max - steps * rows - 5;
  int last_q = -1;
  std::vector<float> scores(static_cast<size_t>(steps) * layers * rows * n_max, 0.0f);
  for (int t = 0; t < steps; ++t) {
    int q = ctx - 1 - (unit(rng) < 0.3 ? static_cast<int>(unit(rng) * 3) : 0);
    if (q <= last_q) q = last_q + 1;
    last_q = q;
    meta.ctx_len.push_back(ctx);
    meta.q_pos.push_back(q);
    int acc = rows;
    if (rows > 1) {
      acc = 1;
      while (acc < rows && unit(rng) < 0.6) ++acc;
      meta.accepted.push_back(acc);
    }
    for (int l = 0; l < layers; ++l) {
      for (int r = 0; r < rows; ++r) {
        float* z = scores.data() + ((static_cast<size_t>(t) * layers + l) * rows + r) * n_max;
        for (int i = 0; i < n_max; ++i) {
          const int off = q + r - i;
          const float band = off >= 0 && off < 48 ? 3.0f : 0.0f;
          z[i] = weight[l][i] + band + 0.5f * gauss(rng);
          if (nonfinite > 0 && unit(rng) < nonfinite) {
            z[i] = unit(rng) < 0.5 ? NAN : (unit(rng) < 0.5 ? INFINITY : -INFINITY);
          }
        }
      }
      for (float& w : weight[l]) w += 0.05f * gauss(rng);
    }
    ctx += acc;
  }
  EXPECT_TRUE(WriteTrace(dir, meta, n_max, scores.data()).ok());
  absl::StatusOr<Trace> t = LoadTrace(dir);
  EXPECT_TRUE(t.ok()) << t.status();
  return std::move(*t);
}

struct Case {
  double rho, gamma;
  float alpha;
  uint32_t period;
  StateDtype dtype;
};

// Replays with a dump, then walks the oracle through the same trace and compares every line.
void ExpectMatchesOracle(const Trace& trace, const Case& c, const std::string& name) {
  ReplayOptions o;
  o.policy.target_sparsity = c.rho;
  o.policy.exploration = c.gamma;
  o.policy.alpha = c.alpha;
  o.policy.probe_period = c.period;
  o.dtype = c.dtype;
  o.seed = 1234;
  o.sequence_key = 77;
  o.dump_path = TempDir(name + ".jsonl");
  absl::StatusOr<ReplaySummary> sum = Replay(trace, o);
  ASSERT_TRUE(sum.ok()) << sum.status();

  const TraceMeta& m = trace.meta();
  Oracle::Params op;
  op.layers = m.layers;
  op.seqs = 1;
  op.n_max = static_cast<int>(trace.n_max());
  op.block = m.block_size;
  op.topk = m.topk;
  op.rho = c.rho;
  op.gamma = c.gamma;
  op.alpha = c.alpha;
  op.period = c.period;
  op.seed = 1234;
  op.bf16 = c.dtype == StateDtype::kBf16;
  Oracle oracle(op);
  oracle.Reset(0, 77);
  std::ifstream dump(o.dump_path);
  std::string line;
  int lines = 0;
  for (int t = 0; t < m.steps; ++t) {
    oracle.Begin({{0, m.ctx_len[t], m.q_pos[t]}}, m.rows);
    const int acc = m.accepted.empty() ? m.rows : m.accepted[t];
    for (int l = 0; l < m.layers; ++l) {
      const std::vector<int> want = oracle.Select(l)[0];
      ASSERT_TRUE(std::getline(dump, line)) << "dump ends at step " << t;
      ++lines;
      const nlohmann::json j = nlohmann::json::parse(line);
      ASSERT_EQ(j["step"].get<int>(), t);
      ASSERT_EQ(j["layer"].get<int>(), l);
      ASSERT_EQ(j["blocks"].get<std::vector<int>>(), want)
          << name << " step " << t << " layer " << l;
      // Row-0 miss: dense top-K slots in blocks the union skipped.
      const float* z0 = trace.scores(t, l, 0);
      std::vector<int> idx;
      for (int i = 0; i < m.ctx_len[t]; ++i) {
        if (std::isfinite(z0[i])) idx.push_back(i);
      }
      std::sort(idx.begin(), idx.end(),
                [z0](int a, int b) { return z0[a] != z0[b] ? z0[a] > z0[b] : a < b; });
      idx.resize(std::min<size_t>(idx.size(), m.topk));
      int lost = 0;
      for (int i : idx) lost += !std::binary_search(want.begin(), want.end(), i / m.block_size);
      const double miss = idx.empty() ? 0.0 : static_cast<double>(lost) / idx.size();
      ASSERT_NEAR(j["miss"].get<double>(), miss, 1e-5) << "step " << t << " layer " << l;
      std::vector<const float*> rows;
      for (int r = 0; r < m.rows; ++r) rows.push_back(trace.scores(t, l, r));
      oracle.Observe(l, {rows}, {acc});
    }
  }
  EXPECT_FALSE(std::getline(dump, line)) << "dump has extra lines";
  EXPECT_EQ(lines, m.steps * m.layers);
  EXPECT_EQ(sum->bad_scores, oracle.bad());
  // The per-layer statistics the summary reports are the oracle's counts.
  ASSERT_EQ(sum->per_layer.size(), static_cast<size_t>(m.layers));
  uint64_t dense = 0, sparse = 0;
  for (int l = 0; l < m.layers; ++l) {
    const Oracle::Counters& k = oracle.counters(l);
    EXPECT_EQ(sum->per_layer[l].probe_steps, k.probe_steps) << name << " layer " << l;
    EXPECT_EQ(sum->per_layer[l].bad_scores, k.bad_scores) << name << " layer " << l;
    dense += k.dense_steps;
    sparse += k.steps - k.dense_steps;
  }
  EXPECT_EQ(sum->dense_steps, dense) << name;
  EXPECT_EQ(sum->sparse_steps, sparse) << name;
}

TEST(ReplayOracle, MatchesOnIndependentRandomTraces) {
  const Trace t1 = RandomTrace(TempDir("r1"), 3, 64 * 24, 40, 1, 256, 1, 0.0);
  const Trace t3 = RandomTrace(TempDir("r3"), 2, 64 * 30 + 17, 30, 3, 200, 2, 0.01);
  const std::vector<Case> cases = {
      {0.5, 0.0, 0.5f, 0, StateDtype::kFp32},  {0.4, 0.05, 0.8f, 0, StateDtype::kFp32},
      {0.7, 0.2, 0.3f, 5, StateDtype::kFp32},  {0.3, 0.1, 0.9f, 4, StateDtype::kBf16},
      {0.6, 0.25, 0.0f, 3, StateDtype::kBf16},
  };
  int k = 0;
  for (const Case& c : cases) {
    ExpectMatchesOracle(t1, c, "t1_" + std::to_string(k));
    ExpectMatchesOracle(t3, c, "t3_" + std::to_string(k));
    ++k;
  }
}

TEST(ReplayOracle, MatchesOnAGeneratedTrace) {
  GenTraceOptions g;
  g.layers = 3;
  g.slots = 64 * 48;
  g.steps = 50;
  g.topk = 512;
  g.rows = 2;
  g.seed = 9;
  const std::string dir = TempDir("gen");
  ASSERT_TRUE(GenerateTrace(dir, g).ok());
  absl::StatusOr<Trace> t = LoadTrace(dir);
  ASSERT_TRUE(t.ok()) << t.status();
  ExpectMatchesOracle(*t, {0.5, 0.05, 0.5f, 8, StateDtype::kFp32}, "gen");
}

TEST(Replay, SummaryOnAGeneratedTrace) {
  GenTraceOptions g;
  g.layers = 4;
  g.slots = 8192;
  g.steps = 64;
  g.topk = 512;
  const std::string dir = TempDir("sum");
  ASSERT_TRUE(GenerateTrace(dir, g).ok());
  absl::StatusOr<Trace> t = LoadTrace(dir);
  ASSERT_TRUE(t.ok()) << t.status();
  ReplayOptions o;
  o.policy.target_sparsity = 0.5;
  o.policy.exploration = 0.05;
  o.policy.probe_period = 8;
  int last = 0;
  o.progress = [&last](int done, int total) {
    EXPECT_EQ(done, last + 1);
    EXPECT_EQ(total, 64);
    last = done;
  };
  absl::StatusOr<ReplaySummary> s = Replay(*t, o);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(last, 64);
  // Realized sparsity is the target up to rounding; probe and first steps are dense.
  EXPECT_NEAR(s->realized_sparsity, 0.5, 0.01);
  EXPECT_LT(s->effective_sparsity, s->realized_sparsity);
  EXPECT_GT(s->effective_sparsity, 0.5 * 7 / 8 - 0.03);
  // Random block choice at 50% sparsity would lose ~50% of the top-K.
  EXPECT_LT(s->mean_miss, 0.25);
  EXPECT_GE(s->p99_miss, s->mean_miss);
  ASSERT_EQ(s->per_layer.size(), 4u);
  EXPECT_EQ(s->dense_steps + s->sparse_steps, 64u * 4);
  for (const LayerSummary& l : s->per_layer) EXPECT_EQ(l.probe_steps, 7u);  // steps 8..56

  const nlohmann::json j = nlohmann::json::parse(SummaryJson(*s));
  for (const char* key : {"mean_miss", "p99_miss", "realized_sparsity", "effective_sparsity"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  ASSERT_EQ(j["per_layer"].size(), 4u);
  for (const char* key : {"layer", "mean_miss", "p99_miss", "sparsity"}) {
    EXPECT_TRUE(j["per_layer"][0].contains(key)) << key;
  }
  EXPECT_NE(SummaryTable(*s).find("all"), std::string::npos);
}

// The human table shows, next to each layer's realized mean miss, the exploration estimate the
// controller read for it, or "-" when no sparse step was measured by exploration blocks.
TEST(Replay, SummaryTableShowsTheExplorationEstimate) {
  ReplaySummary s;
  s.steps = 64;
  s.layers = 2;
  LayerSummary measured;
  measured.layer = 0;
  measured.mean_miss = 0.0190;
  measured.explore_miss = 0.0123;
  measured.explore_steps = 49;
  LayerSummary unmeasured;
  unmeasured.layer = 1;
  unmeasured.mean_miss = 0.0100;
  s.per_layer = {measured, unmeasured};
  const std::vector<std::string> lines = absl::StrSplit(SummaryTable(s), '\n');
  ASSERT_GE(lines.size(), 3u);
  EXPECT_EQ(std::vector<std::string>(absl::StrSplit(lines[0], ' ', absl::SkipEmpty()))[2],
            "est_miss");
  const std::vector<std::string> l0 = absl::StrSplit(lines[1], ' ', absl::SkipEmpty());
  const std::vector<std::string> l1 = absl::StrSplit(lines[2], ' ', absl::SkipEmpty());
  ASSERT_GE(l0.size(), 3u);
  ASSERT_GE(l1.size(), 3u);
  EXPECT_EQ(l0[1], "0.0190");
  EXPECT_EQ(l0[2], "0.0123");
  EXPECT_EQ(l1[2], "-");
}

TEST(Replay, Bf16AndFp32GiveSimilarQuality) {
  GenTraceOptions g;
  g.layers = 2;
  g.slots = 8192;
  g.steps = 64;
  g.topk = 512;
  const std::string dir = TempDir("bf");
  ASSERT_TRUE(GenerateTrace(dir, g).ok());
  absl::StatusOr<Trace> t = LoadTrace(dir);
  ASSERT_TRUE(t.ok());
  ReplayOptions o;
  o.policy.target_sparsity = 0.5;
  absl::StatusOr<ReplaySummary> f = Replay(*t, o);
  o.dtype = StateDtype::kBf16;
  absl::StatusOr<ReplaySummary> h = Replay(*t, o);
  ASSERT_TRUE(f.ok() && h.ok());
  EXPECT_NEAR(h->mean_miss, f->mean_miss, 0.02);
  EXPECT_EQ(h->realized_sparsity, f->realized_sparsity);
}

TEST(Replay, NonFiniteScoresAreCountedNotPropagated) {
  const Trace t = RandomTrace(TempDir("nan"), 2, 64 * 16, 20, 1, 128, 3, 0.05);
  ReplayOptions o;
  absl::StatusOr<ReplaySummary> s = Replay(t, o);
  ASSERT_TRUE(s.ok());
  EXPECT_GT(s->bad_scores, 0u);
  EXPECT_TRUE(std::isfinite(s->mean_miss));
  EXPECT_TRUE(std::isfinite(s->p99_miss));
}

TEST(Replay, UnwritableDumpIsAnError) {
  const Trace t = RandomTrace(TempDir("dumperr"), 1, 64 * 4, 3, 1, 64, 4, 0.0);
  ReplayOptions o;
  o.dump_path = "/nonexistent-dir/x.jsonl";
  absl::StatusOr<ReplaySummary> s = Replay(t, o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("/nonexistent-dir/x.jsonl"), std::string::npos);
}

}  // namespace
}  // namespace spin::testing
