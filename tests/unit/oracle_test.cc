// The CPU data plane against the independent oracle (oracle.h) over whole sessions: several
// sequence slots with ragged contexts (partial last blocks, queries that trail or lead the
// context), padding entries, slot reuse with new keys, MTP rows with random acceptance, probe
// steps, exploration, policy and budget-table writes between steps, non-finite scores and
// score ties, in fp32 and bf16. After every Select the unions, compacted lengths, physical
// tables and remapped indices must equal the oracle's; after every Observe every V and D entry
// of every sequence and layer must equal it bit for bit, with the V block summaries and fresh
// flags; after every step the statistics, miss curves and sequence records.
//
// The oracle's own numerics are checked first against published and hand-computed answers, so
// an agreement of the two implementations is not an agreement on a shared mistake.
#include "oracle.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "spin/budget.h"
#include "spin/numerics.h"
#include "test_arena.h"

namespace spin::testing {
namespace {

// ----- The oracle's numerics -----------------------------------------------------------------

// Known-answer vectors of Philox4x32-10 published with the Random123 library (kat_vectors).
TEST(OracleNumerics, PhiloxKnownAnswers) {
  EXPECT_EQ(OraclePhilox4x32_10({0, 0, 0, 0}, {0, 0}),
            (std::array<uint32_t, 4>{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(OraclePhilox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                                {0xffffffffu, 0xffffffffu}),
            (std::array<uint32_t, 4>{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(OraclePhilox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
                                {0xa4093822u, 0x299f31d0u}),
            (std::array<uint32_t, 4>{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

// The key and counter layout, by hand: key = seed ^ key * 0x9E3779B97F4A7C15 (mod 2^64), and the
// draw is Philox of (block, layer << 16 | row, step low, step high) under (key low, key high).
TEST(OracleNumerics, ExplorationKeyAndCounterLayout) {
  EXPECT_EQ(OracleExplorationKey(0, 1), 0x9E3779B97F4A7C15ull);
  EXPECT_EQ(OracleExplorationKey(1, 1), 0x9E3779B97F4A7C14ull);
  EXPECT_EQ(OracleExplorationKey(0, 2), 0x3C6EF372FE94F82Aull);  // 2 * c mod 2^64
  EXPECT_EQ(OracleExplorationKey(0xFFull, 0), 0xFFull);
  // Zero key and counter: the first published vector, read as out[0] : out[1].
  EXPECT_EQ(OracleExplorationDraw(0, 0, 0, 0, 0), 0x6627e8d5e169c58dull);
  // All-ones key and counter words: the second vector (block, layer, row, step all ones; the
  // row's 16 bits fill the low half of word 1 and the layer's 16 low bits its high half).
  EXPECT_EQ(OracleExplorationDraw(~0ull, ~0ull, 0xFFFFu, 0xFFFFu, 0xffffffffu),
            0x408f276d41c83b0eull);
  // The third vector: block 0x243f6a88, layer 0x85a3, row 0x08d3, step 0x0370734413198a2e.
  EXPECT_EQ(OracleExplorationDraw(0x299f31d0a4093822ull, 0x0370734413198a2eull, 0x85a3u, 0x08d3u,
                                  0x243f6a88u),
            0xd16cfe0994fdccebull);
}

// Hand-computed bf16 narrowing: round to nearest, ties to even, carries into the exponent,
// overflow to infinity, subnormals, signed zero, and every NaN as the unset pattern 0x7FFF.
TEST(OracleNumerics, Bf16HandComputedCases) {
  const struct {
    uint32_t in;
    uint16_t out;
  } cases[] = {
      {0x3F800000u, 0x3F80},  // 1.0
      {0x3F808000u, 0x3F80},  // 1 + 2^-8: halfway, kept half even -> down
      {0x3F818000u, 0x3F82},  // halfway, kept half odd -> up
      {0x3F808001u, 0x3F81},  // just above halfway -> up
      {0x3F807FFFu, 0x3F80},  // just below halfway -> down
      {0x40490FDBu, 0x4049},  // pi: 0x0FDB dropped, down
      {0x3DCCCCCDu, 0x3DCD},  // 0.1f: 0xCCCD dropped, up
      {0xC0200000u, 0xC020},  // -2.5
      {0x3FFFFFFFu, 0x4000},  // carry through the mantissa into the exponent
      {0x7F7FFFFFu, 0x7F80},  // FLT_MAX overflows to +inf
      {0x7F7F8000u, 0x7F80},  // halfway below the top, odd -> +inf
      {0x7F7F7FFFu, 0x7F7F},  // below halfway: the largest finite bf16
      {0xFF7FFFFFu, 0xFF80},  // -FLT_MAX -> -inf
      {0x7F800000u, 0x7F80},  // +inf
      {0xFF800000u, 0xFF80},  // -inf
      {0x00000000u, 0x0000},  // +0
      {0x80000000u, 0x8000},  // -0
      {0x00000001u, 0x0000},  // smallest subnormal -> +0
      {0x00008000u, 0x0000},  // halfway to the smallest bf16 subnormal, even -> 0
      {0x00018000u, 0x0002},  // halfway, odd -> up
      {0x80018001u, 0x8002},  // negative subnormal above halfway
      {0x7FC00000u, 0x7FFF},  // quiet NaN
      {0x7F800001u, 0x7FFF},  // signalling NaN
      {0xFFC00000u, 0x7FFF},  // negative NaN
      {0xFFFFFFFFu, 0x7FFF},  // all ones
      {0x7FFF8000u, 0x7FFF},  // a NaN whose rounding would carry
  };
  for (const auto& c : cases) {
    EXPECT_EQ(OracleBf16(OracleFloatOf(c.in)), c.out) << std::hex << "input 0x" << c.in;
  }
  EXPECT_EQ(OracleBitsOf(OracleWiden(0x3F82)), 0x3F820000u);
  EXPECT_TRUE(std::isnan(OracleWiden(kOracleBf16Unset)));
}

// The two implementations of narrowing agree on a sweep of the float bit patterns (every 997th
// pattern and the neighbourhood of every rounding boundary of one binade).
TEST(OracleNumerics, Bf16AgreesWithTheDataPlanesNarrowing) {
  uint64_t checked = 0;
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 997, ++checked) {
    const float f = OracleFloatOf(static_cast<uint32_t>(u));
    ASSERT_EQ(OracleBf16(f), FloatToBf16(f)) << std::hex << "input 0x" << u;
  }
  for (uint32_t hi = 0x3F80; hi < 0x4000; ++hi) {
    for (uint32_t lo : {0x7FFFu, 0x8000u, 0x8001u}) {
      const float f = OracleFloatOf(hi << 16 | lo);
      ASSERT_EQ(OracleBf16(f), FloatToBf16(f)) << std::hex << (hi << 16 | lo);
    }
  }
  EXPECT_GT(checked, 4000000u);
}

// ----- Sessions: data plane against oracle -----------------------------------------------------

struct Scenario {
  const char* name;
  StateDtype dtype;
  int rows;
  int block;
  double rho, gamma;
  float alpha;
  uint32_t period;
};

std::string Describe(const Scenario& sc, int step, int layer, const char* what) {
  std::ostringstream o;
  o << sc.name << ", step " << step << ", layer " << layer << ": " << what;
  return o.str();
}

// Compares every V and D entry of every (sequence, layer), the V block summaries and the fresh
// flags; returns the first difference ("" if none).
std::string CompareState(const TestArena& t, const Oracle& o) {
  const ArenaView& a = t.view();
  const Geometry& g = a.geometry;
  for (uint32_t s = 0; s < g.max_seqs; ++s) {
    for (uint32_t l = 0; l < g.layers; ++l) {
      const uint8_t* rec = a.StateRecord(static_cast<int>(s), static_cast<int>(l));
      for (int which = 0; which < 2; ++which) {
        for (uint32_t i = 0; i < g.max_slots; ++i) {
          const uint64_t at = static_cast<uint64_t>(which) * g.max_slots + i;
          uint32_t got;
          if (g.dtype == StateDtype::kFp32) {
            std::memcpy(&got, rec + 4 * at, 4);
          } else {
            uint16_t h;
            std::memcpy(&h, rec + 2 * at, 2);
            got = h;
          }
          const uint32_t want =
              o.StoredBits(static_cast<int>(s), static_cast<int>(l), which, static_cast<int>(i));
          if (got != want) {
            char buf[200];
            std::snprintf(buf, sizeof(buf),
                          "%s[%u] of sequence %u layer %u: arena bits 0x%08x, oracle 0x%08x "
                          "(oracle value %.9g)",
                          which == 0 ? "V" : "D", i, s, l, got, want,
                          static_cast<double>(o.Value(static_cast<int>(s), static_cast<int>(l),
                                                      which, static_cast<int>(i))));
            return buf;
          }
        }
      }
      for (uint32_t j = 0; j < a.max_blocks; ++j) {
        const float got = a.VSummaries(static_cast<int>(s), static_cast<int>(l))[j];
        const float want =
            o.VSummary(static_cast<int>(s), static_cast<int>(l), static_cast<int>(j));
        const bool same =
            std::isnan(want) ? std::isnan(got) : OracleBitsOf(got) == OracleBitsOf(want);
        if (!same) {
          char buf[160];
          std::snprintf(buf, sizeof(buf),
                        "V summary of block %u, sequence %u layer %u: %.9g, oracle %.9g", j, s, l,
                        static_cast<double>(got), static_cast<double>(want));
          return buf;
        }
      }
      const bool fresh = a.fresh[static_cast<uint64_t>(s) * g.layers + l] != 0;
      if (fresh != o.Fresh(static_cast<int>(s), static_cast<int>(l))) {
        return "fresh flag of sequence " + std::to_string(s) + " layer " + std::to_string(l);
      }
    }
  }
  return "";
}

std::string CompareCounters(const TestArena& t, const Oracle& o) {
  const ArenaView& a = t.view();
  for (uint32_t l = 0; l < a.geometry.layers; ++l) {
    const LayerStats& s = a.stats[l];
    const Oracle::Counters& c = o.counters(static_cast<int>(l));
    const std::pair<const char*, std::pair<uint64_t, uint64_t>> fields[] = {
        {"steps", {s.steps, c.steps}},
        {"dense_steps", {s.dense_steps, c.dense_steps}},
        {"probe_steps", {s.probe_steps, c.probe_steps}},
        {"blocks_kept", {s.blocks_kept, c.blocks_kept}},
        {"blocks_total", {s.blocks_total, c.blocks_total}},
        {"sparse_blocks_kept", {s.sparse_blocks_kept, c.sparse_blocks_kept}},
        {"sparse_blocks_total", {s.sparse_blocks_total, c.sparse_blocks_total}},
        {"observed", {s.observed, c.observed}},
        {"bad_scores", {s.bad_scores, c.bad_scores}},
        {"probe_topk", {s.probe_topk, c.probe_topk}},
        {"probe_missed", {s.probe_missed, c.probe_missed}},
    };
    for (const auto& [name, v] : fields) {
      if (v.first != v.second) {
        return "layer " + std::to_string(l) + " " + name + ": arena " + std::to_string(v.first) +
               ", oracle " + std::to_string(v.second);
      }
    }
    for (int p = 0; p < kCurvePoints; ++p) {
      const uint64_t got = a.curves[static_cast<uint64_t>(l) * kCurvePoints + p];
      if (got != o.curve(static_cast<int>(l))[p]) {
        return "layer " + std::to_string(l) + " curve point " + std::to_string(p) + ": arena " +
               std::to_string(got) + ", oracle " + std::to_string(o.curve(static_cast<int>(l))[p]);
      }
    }
  }
  for (uint32_t s = 0; s < a.geometry.max_seqs; ++s) {
    const SeqRecord& r = a.seqs[s];
    if ((r.open != 0) != o.Open(static_cast<int>(s)) ||
        (o.Open(static_cast<int>(s)) &&
         (r.key != o.Key(static_cast<int>(s)) || r.steps != o.Steps(static_cast<int>(s))))) {
      return "sequence record " + std::to_string(s);
    }
  }
  return "";
}

// What the run covered, so that a run that exercised nothing cannot pass.
struct Coverage {
  int sparse_selects = 0, dense_selects = 0, probes = 0, resets = 0, partial_last_blocks = 0;
  int trailing_queries = 0, mtp_partial_accepts = 0, bad_scores = 0, padding_entries = 0;
  uint64_t explored = 0;
};

// One session, both implementations, kSteps steps of a changing batch.
void RunSession(const Scenario& sc, Coverage* cov) {
  SCOPED_TRACE(sc.name);
  // Five sequences in six slots (a batch of five and a padding entry fits; the sixth slot is
  // never opened and must stay untouched).
  constexpr int kSeqs = 5, kSlots = 6, kLayers = 3, kSteps = 36;
  const int b = sc.block;
  Geometry g;
  g.layers = kLayers;
  g.max_seqs = kSlots;
  g.max_slots = static_cast<uint32_t>(b * 40 + b / 2 + 3);  // the arena's last block is partial
  g.block_size = static_cast<uint32_t>(b);
  g.topk = static_cast<uint32_t>(4 * b);
  g.max_rows = static_cast<uint32_t>(sc.rows);
  g.dtype = sc.dtype;
  Policy p;
  p.target_sparsity = sc.rho;
  p.exploration = sc.gamma;
  p.alpha = sc.alpha;
  p.probe_period = sc.period;
  const uint64_t seed = 0x5EEDull + static_cast<uint64_t>(sc.rows);
  TestArena t(g, p, seed);
  Oracle::Params op;
  op.layers = kLayers;
  op.seqs = kSlots;
  op.n_max = static_cast<int>(g.max_slots);
  op.block = b;
  op.topk = static_cast<int>(g.topk);
  op.rho = sc.rho;
  op.gamma = sc.gamma;
  op.alpha = sc.alpha;
  op.period = sc.period;
  op.seed = seed;
  op.bf16 = sc.dtype == StateDtype::kBf16;
  Oracle o(op);
  ASSERT_EQ(CompareState(t, o), "") << "after init";

  std::mt19937 rng(17 + sc.rows * 3 + static_cast<int>(sc.dtype) + b);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  const int cap = static_cast<int>(g.max_slots) - (sc.rows - 1);  // ctx + rows - 1 <= max_slots
  // Ragged starting contexts, most with a partial last block.
  std::vector<int> ctx = {cap - 40, 3 * b + 7, 10 * b, 9, 25 * b + b / 2 + 1};
  std::vector<uint64_t> key = {101, 202, 303, 404, 505};
  // Per (sequence, layer) persistent slot weights: what makes the predictions informative.
  std::vector<std::vector<std::vector<float>>> weight(
      kSeqs, std::vector<std::vector<float>>(kLayers, std::vector<float>(g.max_slots)));
  auto new_weights = [&](int s) {
    for (auto& w : weight[s]) {
      for (float& x : w) x = gauss(rng) + (rng() % 40 == 0 ? 5.0f : 0.0f);
    }
  };
  for (int s = 0; s < kSeqs; ++s) {
    new_weights(s);
    ASSERT_TRUE(t.dp().ResetSequence(s, key[s]).ok());
    o.Reset(s, key[s]);
  }
  auto reset = [&](int s, uint64_t k, int c) {
    ASSERT_TRUE(t.dp().ResetSequence(s, k).ok());
    o.Reset(s, k);
    key[s] = k;
    ctx[s] = c;
    new_weights(s);
    ++cov->resets;
  };
  const int MB = static_cast<int>(t.view().max_blocks);
  std::vector<int32_t> table(static_cast<size_t>(kSlots) * MB);
  for (size_t i = 0; i < table.size(); ++i) table[i] = static_cast<int32_t>((i * 7919) % 100003);

  for (int step = 0; step < kSteps; ++step) {
    // Between steps: slot reuse with a new key, full contexts recycled, policy writes.
    if (step == 9) {
      ASSERT_NO_FATAL_FAILURE(reset(1, 9001, 70));  // reused mid-run
    }
    if (step == 21) {
      ASSERT_NO_FATAL_FAILURE(reset(3, 9003, 5 * b + 1));  // one slot into a block
    }
    for (int s = 0; s < kSeqs; ++s) {
      if (ctx[s] > cap - sc.rows) {
        ASSERT_NO_FATAL_FAILURE(reset(s, key[s] + 1000, 40 + s));  // full: recycled
      }
    }
    if (step == 14) {
      Policy q = p;
      q.target_sparsity = std::min(0.85, sc.rho + 0.2);
      q.exploration = sc.gamma / 2;
      ASSERT_TRUE(WritePolicy(t.view(), q).ok());
      o.SetPolicy(q.target_sparsity, q.exploration);
    }
    if (step == 24) {
      const std::vector<double> budgets = {0.3, 0.75, 0.55};
      ASSERT_TRUE(WriteBudgetTable(t.view(), budgets).ok());
      o.SetBudgetTable(budgets);
    }
    // The batch: live sequences in a shuffled order, sequence 4 only every third step, and
    // padding entries.
    std::vector<int> order = {0, 1, 2, 3};
    if (step % 3 == 0) order.push_back(4);
    std::shuffle(order.begin(), order.end(), rng);
    if (step % 4 == 1) order.insert(order.begin() + 1, -1);
    std::vector<int32_t> seq, c, q, acc;
    std::vector<Oracle::Entry> entries;
    for (int s : order) {
      seq.push_back(s);
      if (s < 0) {
        // Padding (context 0) or, every other time, an entry without a sequence served dense.
        const int dc = step % 8 == 1 ? 0 : 1 + static_cast<int>(rng() % (g.max_slots - sc.rows));
        c.push_back(dc);
        q.push_back(0);
        acc.push_back(0);
        entries.push_back({-1, dc, 0});
        ++cov->padding_entries;
        continue;
      }
      const int cc = ctx[s];
      // The query usually ends the context; sequence 2's trails it by up to 2 slots
      // (compressed slots), sequence 4's is sometimes one past it.
      int qq = cc - 1;
      if (s == 2) qq = std::max(0, cc - 1 - static_cast<int>(rng() % 3));
      if (s == 4 && step % 2 == 0) qq = cc;
      qq = std::min(qq, static_cast<int>(g.max_slots) - sc.rows);
      cov->trailing_queries += qq < cc - 1 ? 1 : 0;
      cov->partial_last_blocks += cc % b != 0 ? 1 : 0;
      c.push_back(cc);
      q.push_back(qq);
      const int a = sc.rows == 1 ? 1 : static_cast<int>(rng() % (sc.rows + 1));
      cov->mtp_partial_accepts += sc.rows > 1 && a < sc.rows ? 1 : 0;
      acc.push_back(a);
      entries.push_back({s, cc, qq});
    }
    const int n = static_cast<int>(seq.size());
    const absl::Status begun =
        t.dp().BeginStep(StepBatch{seq.data(), c.data(), q.data(), n, sc.rows});
    ASSERT_TRUE(begun.ok()) << Describe(sc, step, -1, "BeginStep") << ": " << begun;
    o.Begin(entries, sc.rows);
    for (int l = 0; l < kLayers; ++l) {
      // Dense scores of every (entry, row) over the whole slot range.
      std::vector<std::vector<std::vector<float>>> dense(
          n, std::vector<std::vector<float>>(sc.rows, std::vector<float>(g.max_slots, 0.0f)));
      for (int e = 0; e < n; ++e) {
        if (seq[e] < 0) continue;
        for (int r = 0; r < sc.rows; ++r) {
          for (int i = 0; i < c[e] + r; ++i) {
            const int off = q[e] + r - i;
            float z =
                weight[seq[e]][l][i] + (off >= 0 && off < 40 ? 2.5f : 0.0f) + 0.4f * gauss(rng);
            if (seq[e] == 3) {
              // Coarse non-positive scores (-0, -1, -2, ...): many ties in V, D and S, and
              // blocks whose largest V is a zero (the summary stores it as +0).
              z = std::floor(z);
              if (z >= 0.0f) z = -z;
            }
            const uint32_t u = rng() % 500;
            if (u == 0) z = std::numeric_limits<float>::quiet_NaN();
            if (u == 1) z = std::numeric_limits<float>::infinity();
            if (u == 2) z = -std::numeric_limits<float>::infinity();
            dense[e][r][i] = z;
          }
        }
      }
      ASSERT_TRUE(t.dp().Select(l, table.data(), MB).ok());
      const std::vector<std::vector<int>>& want = o.Select(l);
      for (int e = 0; e < n; ++e) {
        ASSERT_EQ(t.Selected(e), want[e])
            << Describe(sc, step, l, "union") << ", entry " << e << " (sequence " << seq[e] << ")";
        for (int r = 0; r < sc.rows; ++r) {
          ASSERT_EQ(t.view().compact_len[e * g.max_rows + r], o.CompactLen(e, r))
              << Describe(sc, step, l, "compacted length") << ", entry " << e << " row " << r;
        }
        for (size_t k = 0; k < want[e].size(); ++k) {
          ASSERT_EQ(t.view().phys[e * MB + static_cast<int>(k)], table[e * MB + want[e][k]])
              << Describe(sc, step, l, "physical table") << ", entry " << e << " k " << k;
        }
        if (seq[e] < 0) continue;
        const int widest = (c[e] + sc.rows - 1 + b - 1) / b;
        const bool sparse = static_cast<int>(want[e].size()) < widest;
        cov->sparse_selects += sparse ? 1 : 0;
        cov->dense_selects += sparse ? 0 : 1;
      }
      // Remap of compacted indices, in and out of every row's range.
      constexpr int kTopK = 24;
      std::vector<int32_t> idx(static_cast<size_t>(n) * sc.rows * kTopK);
      for (int32_t& x : idx) x = static_cast<int32_t>(rng() % (MB * b + 20)) - 10;
      std::vector<int32_t> remapped = idx;
      ASSERT_TRUE(t.dp().Remap(remapped.data(), kTopK).ok());
      for (int e = 0; e < n; ++e) {
        for (int r = 0; r < sc.rows; ++r) {
          for (int k = 0; k < kTopK; ++k) {
            const size_t at = (static_cast<size_t>(e) * sc.rows + r) * kTopK + k;
            ASSERT_EQ(remapped[at], o.Logical(e, r, idx[at]))
                << Describe(sc, step, l, "remap") << ", entry " << e << " row " << r << " index "
                << idx[at];
          }
        }
      }
      // The engine's compacted logits of the (common) union; junk past each row's length.
      const int64_t stride = static_cast<int64_t>(MB) * b + 3;
      std::vector<float> logits(static_cast<size_t>(n) * sc.rows * stride, 12345.0f);
      std::vector<std::vector<const float*>> rows_of(n);
      for (int e = 0; e < n; ++e) {
        for (int r = 0; r < sc.rows; ++r) {
          rows_of[e].push_back(dense[e][r].data());
          for (int cc = 0; cc < o.CompactLen(e, r); ++cc) {
            logits[(static_cast<size_t>(e) * sc.rows + r) * stride + cc] =
                dense[e][r][o.Logical(e, r, cc)];
          }
        }
      }
      ASSERT_TRUE(t.dp().Observe(l, logits.data(), stride, acc.data()).ok());
      o.Observe(l, rows_of, std::vector<int>(acc.begin(), acc.end()));
      ASSERT_EQ(CompareState(t, o), "") << Describe(sc, step, l, "state after Observe");
    }
    ASSERT_EQ(CompareCounters(t, o), "") << Describe(sc, step, kLayers - 1, "counters");
    for (int e = 0; e < n; ++e) {
      if (seq[e] >= 0) ctx[seq[e]] += std::max(1, acc[e]);
    }
  }
  for (uint32_t l = 0; l < g.layers; ++l) {
    cov->probes += static_cast<int>(t.view().stats[l].probe_steps);
    cov->bad_scores += static_cast<int>(t.view().stats[l].bad_scores);
  }
  cov->explored = o.explored();
}

const Scenario kScenarios[] = {
    {"fp32, 1 row, b 16", StateDtype::kFp32, 1, 16, 0.5, 0.1, 0.3f, 4},
    {"bf16, 1 row, b 16", StateDtype::kBf16, 1, 16, 0.6, 0.2, 0.3f, 5},
    {"fp32, 3 MTP rows, b 16", StateDtype::kFp32, 3, 16, 0.55, 0.15, 0.7f, 4},
    {"bf16, 3 MTP rows, b 16", StateDtype::kBf16, 3, 16, 0.45, 0.25, 0.5f, 3},
    {"fp32, 2 MTP rows, b 64", StateDtype::kFp32, 2, 64, 0.5, 0.2, 0.3f, 6},
    {"bf16, 1 row, b 64", StateDtype::kBf16, 1, 64, 0.4, 0.1, 0.9f, 7},
    {"fp32, 2 rows, alpha 0, no exploration or probes", StateDtype::kFp32, 2, 32, 0.7, 0.0, 0.0f,
     0},
};

TEST(OracleSession, CpuDataPlaneEqualsTheOracleBitForBit) {
  for (const Scenario& sc : kScenarios) {
    Coverage cov;
    ASSERT_NO_FATAL_FAILURE(RunSession(sc, &cov));
    SCOPED_TRACE(sc.name);
    std::printf(
        "%s: %d sparse and %d dense selections, %llu exploration picks, %d probe samples, "
        "%d resets, %d partial last blocks, %d trailing queries, %d partial MTP accepts, "
        "%d bad scores, %d padding entries\n",
        sc.name, cov.sparse_selects, cov.dense_selects,
        static_cast<unsigned long long>(cov.explored), cov.probes, cov.resets,
        cov.partial_last_blocks, cov.trailing_queries, cov.mtp_partial_accepts, cov.bad_scores,
        cov.padding_entries);
    // The run exercised what it claims to: a session that selected nothing sparse, never
    // probed, explored or reset would compare nothing interesting.
    EXPECT_GE(cov.sparse_selects, 200);
    EXPECT_GE(cov.dense_selects, 15);
    EXPECT_GE(cov.resets, 2);
    EXPECT_GE(cov.partial_last_blocks, 50);
    EXPECT_GE(cov.trailing_queries, 5);
    EXPECT_GE(cov.padding_entries, 5);
    EXPECT_GT(cov.bad_scores, 0);
    if (sc.period > 0) {
      EXPECT_GT(cov.probes, 0);
    }
    if (sc.gamma > 0) {
      EXPECT_GT(cov.explored, 0u);
    }
    if (sc.rows > 1) {
      EXPECT_GT(cov.mtp_partial_accepts, 10);
    }
  }
}

}  // namespace
}  // namespace spin::testing
