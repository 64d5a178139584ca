// A second, deliberately naive implementation of docs/design.md §5 for a whole session (several
// sequence slots, ragged contexts, MTP rows, slot reuse), written straight from the text: per-slot
// predictions, full sorts, plain vectors, no arena. Tests drive it next to the data plane and
// compare selections, compacted lengths, the V/D state bit for bit (fp32 and bf16), the V block
// summaries, the statistics and the probe miss curves after every call.
//
// It is independent of the code under test: it includes no spin header and calls no spin::
// function. Its numerics are its own, re-derived from the spec:
//   - Philox4x32-10 (Salmon et al., SC'11, as published with Random123), checked against the
//     published known-answer vectors in oracle_test.cc;
//   - the exploration key and counter (docs/design.md §5, numerics.h's documented layout);
//   - float -> bf16 round-to-nearest-even with every NaN stored as 0x7FFF (the arena's unset
//     bf16 value), checked against hand-computed cases in oracle_test.cc.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace spin::testing {

// ----- Independent numerics -----------------------------------------------------------------

/// Philox4x32-10 on a 128-bit counter with a 64-bit key. Each of the 10 rounds multiplies
/// counter words 0 and 2 by the round multipliers (64-bit products split into high and low
/// halves) and permutes: out = {hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0)};
/// round i uses the key bumped i times by the Weyl constants.
inline std::array<uint32_t, 4> OraclePhilox4x32_10(std::array<uint32_t, 4> c,
                                                   std::array<uint32_t, 2> k) {
  const uint64_t m0 = 0xD2511F53u, m1 = 0xCD9E8D57u;
  const uint32_t w0 = 0x9E3779B9u, w1 = 0xBB67AE85u;
  for (uint32_t i = 0; i < 10; ++i) {
    const uint32_t k0 = k[0] + i * w0, k1 = k[1] + i * w1;
    const uint64_t p0 = m0 * c[0], p1 = m1 * c[2];
    c = {static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k0, static_cast<uint32_t>(p1 & 0xFFFFFFFFu),
         static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k1, static_cast<uint32_t>(p0 & 0xFFFFFFFFu)};
  }
  return c;
}

/// The 64-bit Philox key of a sequence: the session seed XOR the engine's sequence key times
/// the odd constant 0x9E3779B97F4A7C15 (mod 2^64).
inline uint64_t OracleExplorationKey(uint64_t seed, uint64_t sequence_key) {
  return seed ^ (sequence_key * 0x9E3779B97F4A7C15ull);
}

/// A block's exploration draw: Philox of counter (block, layer << 16 | row, step mod 2^32,
/// step / 2^32) under the key (low word, high word); the draw is out[0] : out[1] (high : low).
inline uint64_t OracleExplorationDraw(uint64_t key, uint64_t step, uint32_t layer, uint32_t row,
                                      uint32_t block) {
  const std::array<uint32_t, 4> out = OraclePhilox4x32_10(
      {block, (layer << 16) | (row & 0xFFFFu), static_cast<uint32_t>(step & 0xFFFFFFFFu),
       static_cast<uint32_t>(step >> 32)},
      {static_cast<uint32_t>(key & 0xFFFFFFFFu), static_cast<uint32_t>(key >> 32)});
  return (uint64_t{out[0]} << 32) | uint64_t{out[1]};
}

inline uint32_t OracleBitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float OracleFloatOf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// The unset bf16 state value: every NaN is stored as this one pattern.
inline constexpr uint16_t kOracleBf16Unset = 0x7FFF;

/// float -> bf16 bits, round to nearest, ties to the even result; NaN -> kOracleBf16Unset.
/// Written as truncate-then-decide: keep the high half, look at the dropped low half, and
/// round up when it is above one half, or exactly one half with an odd kept half (a carry out
/// of the mantissa correctly bumps the exponent, up to infinity).
inline uint16_t OracleBf16(float f) {
  const uint32_t u = OracleBitsOf(f);
  const bool nan = (u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0;
  if (nan) return kOracleBf16Unset;
  uint32_t kept = u >> 16;
  const uint32_t dropped = u & 0xFFFFu;
  if (dropped > 0x8000u || (dropped == 0x8000u && (kept & 1u) != 0)) kept += 1;
  return static_cast<uint16_t>(kept);
}

/// bf16 bits -> float (exact).
inline float OracleWiden(uint16_t h) { return OracleFloatOf(uint32_t{h} << 16); }

// ----- The session model ----------------------------------------------------------------------

class Oracle {
 public:
  struct Params {
    int layers = 1, seqs = 1, n_max = 0, block = 64, topk = 64;
    double rho = 0.5, gamma = 0.0;  // the uniform target and the exploration share
    float alpha = 0.3f;
    uint32_t period = 0;  // probe period P
    uint64_t seed = 0;    // session seed
    bool bf16 = false;    // state dtype
  };
  /// One batch entry: sequence slot (-1 = none: every block of its rows, no state; ctx 0 =
  /// padding, nothing), context of row 0, query slot of row 0.
  struct Entry {
    int seq = -1, ctx = 0, q = 0;
  };
  /// The statistics counters of one layer (arena.h's LayerStats, by meaning).
  struct Counters {
    uint64_t steps = 0, dense_steps = 0, probe_steps = 0, blocks_kept = 0, blocks_total = 0,
             sparse_blocks_kept = 0, sparse_blocks_total = 0, observed = 0, bad_scores = 0,
             probe_topk = 0, probe_missed = 0;
  };
  static constexpr int kCurvePoints = 20;  // keep fractions 5%, 10%, ..., 100%

  explicit Oracle(const Params& p)
      : p_(p),
        rho_(p.layers, p.rho),
        gamma_(p.gamma),
        seqs_(p.seqs),
        counters_(p.layers),
        curves_(p.layers, std::vector<uint64_t>(kCurvePoints, 0)) {
    for (Seq& s : seqs_) Clear(&s);
  }

  // --- policy (takes effect at the next Begin, as both backends read it when a step begins)
  /// A uniform policy write: every layer's sparsity and the exploration share.
  void SetPolicy(double rho, double gamma) {
    pending_rho_.assign(p_.layers, rho);
    pending_gamma_ = gamma;
    has_pending_ = true;
  }
  /// A per-layer budget table write.
  void SetBudgetTable(const std::vector<double>& rho) {
    pending_rho_ = rho;
    if (!has_pending_) pending_gamma_ = gamma_;
    has_pending_ = true;
  }

  /// Opens (or reopens) slot `seq` with the engine's key: state unset, every layer fresh,
  /// step counter 0. An entry of the current step that names it becomes padding (no
  /// sequence, context 0).
  void Reset(int seq, uint64_t key) {
    Clear(&seqs_[seq]);
    seqs_[seq].open = true;
    seqs_[seq].key = key;
    for (Entry& e : entries_) {
      if (e.seq == seq) e.seq = -1, e.ctx = 0;
    }
  }

  /// Starts a step for the batch.
  void Begin(const std::vector<Entry>& entries, int rows) {
    if (has_pending_) {
      rho_ = pending_rho_;
      gamma_ = pending_gamma_;
      has_pending_ = false;
    }
    entries_ = entries;
    rows_ = rows;
    step_.assign(entries.size(), 0);
    probe_.assign(entries.size(), false);
    probing_.assign(entries.size(), false);
    unions_.assign(entries.size(), {});
    row0_scores_.assign(entries.size(), {});
    for (size_t e = 0; e < entries.size(); ++e) {
      if (entries[e].seq < 0) continue;
      Seq& s = seqs_[entries[e].seq];
      step_[e] = s.steps++;
      probe_[e] = p_.period > 0 && step_[e] % p_.period == 0;
    }
  }

  /// Selects layer `layer` for every entry: per entry the union over rows of the selected
  /// logical blocks, ascending (empty for padding).
  const std::vector<std::vector<int>>& Select(int layer) {
    for (size_t e = 0; e < entries_.size(); ++e) {
      unions_[e].clear();
      probing_[e] = false;
      const Entry& en = entries_[e];
      if (en.seq < 0) {
        // No sequence: every block of its rows (none for padding), nothing counted.
        const int widest = en.ctx > 0 ? CeilDiv(en.ctx + rows_ - 1, p_.block) : 0;
        for (int j = 0; j < widest; ++j) unions_[e].push_back(j);
        continue;
      }
      const Seq& s = seqs_[en.seq];
      const bool fresh = s.fresh[layer];
      const bool dense = fresh || probe_[e];
      probing_[e] = probe_[e] && !fresh;
      const int widest = CeilDiv(en.ctx + rows_ - 1, p_.block);
      std::vector<bool> chosen(widest, false);
      if (dense) {
        std::fill(chosen.begin(), chosen.end(), true);
        if (probing_[e]) row0_scores_[e] = BlockScores(s, layer, en.ctx, en.q);
      } else {
        const uint64_t key = OracleExplorationKey(p_.seed, s.key);
        for (int r = 0; r < rows_; ++r) SelectRow(s, layer, e, r, key, &chosen);
      }
      for (int j = 0; j < widest; ++j) {
        if (chosen[j]) unions_[e].push_back(j);
      }
      Counters& c = counters_[layer];
      const uint64_t kept = unions_[e].size();
      c.steps += 1;
      c.dense_steps += dense ? 1 : 0;
      c.blocks_kept += kept;
      c.blocks_total += widest;
      if (!dense) {
        c.sparse_blocks_kept += kept;
        c.sparse_blocks_total += widest;
      }
    }
    return unions_;
  }

  const std::vector<std::vector<int>>& unions() const { return unions_; }

  /// Slots of row r of entry e in the compacted layout: the union's blocks below the row's
  /// context, the partial one counted by its valid slots.
  int CompactLen(size_t e, int r) const {
    if (entries_[e].seq < 0 && entries_[e].ctx == 0) return 0;
    const int n = entries_[e].ctx + r;
    int len = 0;
    for (int j : unions_[e]) {
      if (j * p_.block < n) len += std::min(p_.block, n - j * p_.block);
    }
    return len;
  }

  /// The logical slot of compacted index c of row r of entry e, -1 if outside the row.
  int Logical(size_t e, int r, int c) const {
    if (c < 0 || c >= CompactLen(e, r)) return -1;
    return unions_[e][c / p_.block] * p_.block + c % p_.block;
  }

  /// Applies the engine's scores of layer `layer`: dense[e][r][i] is the dense score of
  /// logical slot i for row r of entry e (only selected slots are read); rows 0 .. accepted[e]-1
  /// in order. A probe step samples the miss curve from row 0 first.
  void Observe(int layer, const std::vector<std::vector<const float*>>& dense,
               const std::vector<int>& accepted) {
    const float beta = static_cast<float>(1.0 - static_cast<double>(p_.alpha));
    Counters& c = counters_[layer];
    for (size_t e = 0; e < entries_.size(); ++e) {
      const Entry& en = entries_[e];
      if (en.seq < 0) continue;
      Seq& s = seqs_[en.seq];
      if (probing_[e]) ProbeCurve(layer, e, dense[e][0]);
      for (int r = 0; r < accepted[e]; ++r) {
        const int n = en.ctx + r, q = en.q + r;
        for (int j : unions_[e]) {
          for (int i = j * p_.block; i < std::min((j + 1) * p_.block, n); ++i) {
            const float z = dense[e][r][i];
            if (!std::isfinite(z)) {
              ++c.bad_scores;
              continue;
            }
            ++c.observed;
            s.v[layer][i] = Ema(s.v[layer][i], z, beta);
            if (q - i >= 0) s.d[layer][q - i] = Ema(s.d[layer][q - i], z, beta);
          }
        }
      }
      if (accepted[e] > 0) s.fresh[layer] = false;
    }
  }

  // --- what tests compare
  /// Stored bits of V (which = 0) or D (which = 1) entry i: the float's bits for fp32 state,
  /// the bf16 pattern (NaN = 0x7FFF) for bf16 state.
  uint32_t StoredBits(int seq, int layer, int which, int i) const {
    const float x = (which == 0 ? seqs_[seq].v : seqs_[seq].d)[layer][i];
    return p_.bf16 ? OracleBf16(x) : OracleBitsOf(x);
  }
  float Value(int seq, int layer, int which, int i) const {
    return (which == 0 ? seqs_[seq].v : seqs_[seq].d)[layer][i];
  }
  /// The V block summary (arena.h): NaN if any V entry of block j (up to n_max) is unset,
  /// else the largest entry, a zero stored as +0.
  float VSummary(int seq, int layer, int j) const {
    const std::vector<float>& v = seqs_[seq].v[layer];
    float m = -std::numeric_limits<float>::infinity();
    for (int i = j * p_.block; i < std::min((j + 1) * p_.block, p_.n_max); ++i) {
      if (std::isnan(v[i])) return std::numeric_limits<float>::quiet_NaN();
      m = std::max(m, v[i]);
    }
    return m == 0.0f ? 0.0f : m;
  }
  bool Fresh(int seq, int layer) const { return seqs_[seq].fresh[layer]; }
  bool Open(int seq) const { return seqs_[seq].open; }
  uint64_t Key(int seq) const { return seqs_[seq].key; }
  uint64_t Steps(int seq) const { return seqs_[seq].steps; }
  const Counters& counters(int layer) const { return counters_[layer]; }
  const std::vector<uint64_t>& curve(int layer) const { return curves_[layer]; }
  uint64_t bad() const {
    uint64_t b = 0;
    for (const Counters& c : counters_) b += c.bad_scores;
    return b;
  }
  const Params& params() const { return p_; }
  /// Exploration blocks chosen so far (over rows; a block may also be another row's pick).
  uint64_t explored() const { return explored_; }

 private:
  struct Seq {
    bool open = false;
    uint64_t key = 0, steps = 0;
    std::vector<std::vector<float>> v, d;  // [layer][slot], as stored (bf16-rounded if bf16)
    std::vector<bool> fresh;               // [layer]
  };

  static int CeilDiv(int a, int b) { return (a + b - 1) / b; }

  void Clear(Seq* s) const {
    const float unset = std::numeric_limits<float>::quiet_NaN();
    s->open = false;
    s->key = 0;
    s->steps = 0;
    s->v.assign(p_.layers, std::vector<float>(p_.n_max, unset));
    s->d.assign(p_.layers, std::vector<float>(p_.n_max, unset));
    s->fresh.assign(p_.layers, true);
  }

  // z if unset, else fma(alpha, x, beta * z); bf16 state rounds the result on store.
  float Ema(float x, float z, float beta) const {
    float nv = std::isnan(x) ? z : std::fma(p_.alpha, x, beta * z);
    if (p_.bf16) nv = OracleWiden(OracleBf16(nv));
    return nv;
  }

  // m = min(B, max(ceil(K / b), ceil((1 - rho) B - 1e-6))).
  int Kept(int nb, double rho) const {
    const int floor_blocks = CeilDiv(p_.topk, p_.block);
    const double want = std::ceil((1.0 - rho) * nb - 1e-6);
    return std::min(nb, std::max(floor_blocks, static_cast<int>(std::max(want, 0.0))));
  }

  // S[j] over a row of n slots with query q: the largest prediction of the block's slots.
  std::vector<float> BlockScores(const Seq& s, int layer, int n, int q) const {
    const int nb = CeilDiv(n, p_.block);
    std::vector<float> out(nb, -std::numeric_limits<float>::infinity());
    for (int i = 0; i < n; ++i) {
      const int off = std::clamp(q - i, 0, p_.n_max - 1);
      float pred = std::fmax(s.v[layer][i], s.d[layer][off]);  // NaN-ignoring
      if (std::isnan(pred)) pred = std::numeric_limits<float>::infinity();
      out[i / p_.block] = std::max(out[i / p_.block], pred);
    }
    return out;
  }

  void SelectRow(const Seq& s, int layer, size_t e, int r, uint64_t key,
                 std::vector<bool>* chosen) {
    const int n = entries_[e].ctx + r, q = entries_[e].q + r;
    const int nb = CeilDiv(n, p_.block);
    const std::vector<float> sc = BlockScores(s, layer, n, q);
    const int m = Kept(nb, rho_[layer]);
    if (m >= nb) {
      for (int j = 0; j < nb; ++j) (*chosen)[j] = true;
      return;
    }
    const int qb = std::min(q / p_.block, nb - 1);
    (*chosen)[qb] = true;
    int me = static_cast<int>(std::floor(gamma_ * m + 1e-6));
    me = std::clamp(me, 0, m - 1);
    std::vector<int> others;
    for (int j = 0; j < nb; ++j) {
      if (j != qb) others.push_back(j);
    }
    std::sort(others.begin(), others.end(),
              [&](int a, int b) { return sc[a] != sc[b] ? sc[a] > sc[b] : a < b; });
    const int top = m - 1 - me;
    for (int k = 0; k < top; ++k) (*chosen)[others[k]] = true;
    std::vector<std::pair<uint64_t, int>> draws;
    for (size_t k = top; k < others.size(); ++k) {
      draws.push_back(
          {OracleExplorationDraw(key, step_[e], static_cast<uint32_t>(layer),
                                 static_cast<uint32_t>(r), static_cast<uint32_t>(others[k])),
           others[k]});
    }
    std::sort(draws.begin(), draws.end());
    for (int k = 0; k < me; ++k) (*chosen)[draws[k].second] = true;
    explored_ += static_cast<uint64_t>(me);
  }

  // Probe step: the share of row 0's dense top-K (finite scores, ties to the lower slot)
  // outside the best ceil(f B) blocks ranked query block first, then by S, for each f of the
  // grid; and at the step's own budget.
  void ProbeCurve(int layer, size_t e, const float* z) {
    const Entry& en = entries_[e];
    const int n = en.ctx, nb = CeilDiv(n, p_.block);
    std::vector<int> fin;
    for (int i = 0; i < n; ++i) {
      if (std::isfinite(z[i])) fin.push_back(i);
    }
    std::sort(fin.begin(), fin.end(),
              [z](int a, int b) { return z[a] != z[b] ? z[a] > z[b] : a < b; });
    const int k = std::min<int>(p_.topk, static_cast<int>(fin.size()));
    if (k == 0) return;
    std::vector<int> hits(nb, 0);
    for (int t = 0; t < k; ++t) hits[fin[t] / p_.block] += 1;
    const std::vector<float>& sc = row0_scores_[e];
    const int qb = std::min(en.q / p_.block, nb - 1);
    std::vector<int> rank = {qb};
    for (int j = 0; j < nb; ++j) {
      if (j != qb) rank.push_back(j);
    }
    std::sort(rank.begin() + 1, rank.end(),
              [&](int a, int b) { return sc[a] != sc[b] ? sc[a] > sc[b] : a < b; });
    auto missed = [&](int m) {
      int covered = 0;
      for (int t = 0; t < m; ++t) covered += hits[rank[t]];
      return static_cast<uint64_t>(k - covered);
    };
    for (int p = 0; p < kCurvePoints; ++p) {
      curves_[layer][p] += missed(Kept(nb, 1.0 - 0.05 * (p + 1)));
    }
    Counters& c = counters_[layer];
    c.probe_steps += 1;
    c.probe_topk += static_cast<uint64_t>(k);
    c.probe_missed += missed(Kept(nb, rho_[layer]));
  }

  Params p_;
  std::vector<double> rho_, pending_rho_;
  double gamma_ = 0.0, pending_gamma_ = 0.0;
  bool has_pending_ = false;
  std::vector<Seq> seqs_;
  std::vector<Counters> counters_;
  std::vector<std::vector<uint64_t>> curves_;
  // The current step.
  std::vector<Entry> entries_;
  int rows_ = 1;
  std::vector<uint64_t> step_;
  std::vector<bool> probe_, probing_;
  std::vector<std::vector<int>> unions_;
  std::vector<std::vector<float>> row0_scores_;
  uint64_t explored_ = 0;
};

}  // namespace spin::testing
