#include "spin/budget.h"

#include <algorithm>
#include <cmath>
#include <queue>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "spin/numerics.h"
#include "spin/status_macros.h"

namespace spin {
namespace {

// Fewest m in [lo, hi] with miss(m) <= level, for a miss non-increasing in m (hi if none).
template <typename MissFn>
int32_t FewestBlocksMeeting(int32_t lo, int32_t hi, double level, const MissFn& miss) {
  if (miss(hi) > level) return hi;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (miss(mid) <= level) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// A layer's predicted miss as a function of its kept blocks, at B blocks.
struct LayerCurve {
  MissCurve monotone;
  int32_t lo = 1;  // the floor ceil(K/b), capped at B
  double Miss(int32_t m, int32_t num_blocks) const {
    return CurveMiss(monotone, static_cast<double>(m) / num_blocks);
  }
  // Fewest blocks in [lo, B] whose predicted miss is at most `level` (B if none).
  int32_t Need(double level, int32_t num_blocks) const {
    return FewestBlocksMeeting(lo, num_blocks, level,
                               [&](int32_t m) { return Miss(m, num_blocks); });
  }
};

int64_t TotalNeed(const std::vector<LayerCurve>& layers, double level, int32_t num_blocks) {
  int64_t total = 0;
  for (const LayerCurve& c : layers) total += c.Need(level, num_blocks);
  return total;
}

}  // namespace

MissCurve MonotoneCurve(const MissCurve& c) {
  // Pool adjacent violators for a non-increasing fit: blocks of (sum, count) whose means must
  // not increase from left to right; merge while the last block's mean exceeds its
  // predecessor's.
  double sum[kCurvePoints];
  int count[kCurvePoints];
  int blocks = 0;
  for (int p = 0; p < kCurvePoints; ++p) {
    sum[blocks] = c[p];
    count[blocks] = 1;
    ++blocks;
    while (blocks > 1 &&
           sum[blocks - 1] * count[blocks - 2] > sum[blocks - 2] * count[blocks - 1]) {
      sum[blocks - 2] += sum[blocks - 1];
      count[blocks - 2] += count[blocks - 1];
      --blocks;
    }
  }
  MissCurve out;
  int p = 0;
  for (int k = 0; k < blocks; ++k) {
    const double mean = std::clamp(sum[k] / count[k], 0.0, 1.0);
    for (int j = 0; j < count[k]; ++j) out[p++] = mean;
  }
  return out;
}

double CurveMiss(const MissCurve& m, double keep) {
  if (!(keep > 0)) return 1.0;
  if (keep >= CurveKeepFraction(kCurvePoints - 1)) return m[kCurvePoints - 1];
  // Grid point p sits at 0.05 (p + 1); segment [x0, x1] holds keep.
  const double pos = keep / 0.05;                                   // in (0, 20)
  const int p = std::min(static_cast<int>(pos), kCurvePoints - 1);  // x1 = grid point p
  const double x0 = p == 0 ? 0.0 : CurveKeepFraction(p - 1);
  const double y0 = p == 0 ? 1.0 : m[p - 1];
  const double x1 = CurveKeepFraction(p), y1 = m[p];
  const double w = std::clamp((keep - x0) / (x1 - x0), 0.0, 1.0);
  return y0 + w * (y1 - y0);
}

absl::StatusOr<Allocation> AllocateBudgets(const AllocationInput& in) {
  const int32_t L = static_cast<int32_t>(in.curves.size());
  const int32_t B = in.num_blocks;
  if (L < 1) return absl::InvalidArgumentError("budget allocation needs at least one layer");
  if (B < 1 || in.topk < 1 || in.block_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget allocation needs num_blocks, topk and block_size >= 1; got ", B, ", ",
                     in.topk, ", ", in.block_size));
  }
  if (!(in.target_sparsity >= 0 && in.target_sparsity < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("target sparsity ", in.target_sparsity, " is out of range [0, 1)"));
  }
  for (int32_t l = 0; l < L; ++l) {
    for (int p = 0; p < kCurvePoints; ++p) {
      if (!std::isfinite(in.curves[l][p])) {
        return absl::InvalidArgumentError(
            absl::StrCat("miss curve of layer ", l, " has a non-finite value at point ", p));
      }
    }
  }
  const int32_t floor_blocks =
      static_cast<int32_t>(std::min<int64_t>(B, CeilDiv(in.topk, in.block_size)));
  const int32_t uniform = KeptBlocks(B, in.topk, in.block_size, in.target_sparsity);
  const int64_t budget = static_cast<int64_t>(uniform) * L;

  std::vector<LayerCurve> layers(L);
  double top = 0;
  for (int32_t l = 0; l < L; ++l) {
    layers[l].monotone = MonotoneCurve(in.curves[l]);
    layers[l].lo = floor_blocks;
    top = std::max(top, layers[l].Miss(floor_blocks, B));
  }
  // Smallest level whose per-layer needs fit the budget. Need(top) is the floor everywhere,
  // which always fits (uniform >= floor).
  std::vector<int32_t> blocks(L);
  double lo = 0, hi = top;
  if (TotalNeed(layers, 0.0, B) <= budget) {
    hi = 0;
  } else {
    for (int it = 0; it < 64 && hi - lo > 1e-12; ++it) {
      const double mid = 0.5 * (lo + hi);
      (TotalNeed(layers, mid, B) <= budget ? hi : lo) = mid;
    }
  }
  int64_t used = 0;
  for (int32_t l = 0; l < L; ++l) {
    blocks[l] = layers[l].Need(hi, B);
    used += blocks[l];
  }
  // Blocks left over: one at a time to the largest predicted drop in miss; ties to fewer blocks,
  // then the lower layer id. A layer at B takes no more.
  using Entry = std::tuple<double, int32_t, int32_t>;  // gain, -blocks, -layer
  std::priority_queue<Entry> heap;
  auto push = [&](int32_t l) {
    if (blocks[l] < B) {
      heap.emplace(layers[l].Miss(blocks[l], B) - layers[l].Miss(blocks[l] + 1, B), -blocks[l], -l);
    }
  };
  for (int32_t l = 0; l < L; ++l) push(l);
  for (int64_t left = budget - used; left > 0 && !heap.empty(); --left) {
    const int32_t l = -std::get<2>(heap.top());
    heap.pop();
    blocks[l] += 1;
    push(l);
  }

  Allocation out;
  out.blocks = blocks;
  out.sparsity.resize(L);
  for (int32_t l = 0; l < L; ++l) {
    out.sparsity[l] = 1.0 - static_cast<double>(blocks[l]) / B;
    out.total_blocks += blocks[l];
    const double miss = layers[l].Miss(blocks[l], B), umiss = layers[l].Miss(uniform, B);
    out.worst_miss = std::max(out.worst_miss, miss);
    out.uniform_worst_miss = std::max(out.uniform_worst_miss, umiss);
    out.mean_miss += miss / L;
    out.uniform_mean_miss += umiss / L;
  }
  return out;
}

namespace {
// A selection of m < B blocks with exploration share gamma: its ranked part (m minus the
// exploration blocks), and the share of the ranked part's misses left after the exploration
// blocks, drawn uniformly from the B - ranked blocks outside it, recover theirs in expectation.
struct ExplorationSplit {
  int32_t ranked;
  double unrecovered;
};
ExplorationSplit SplitExploration(int32_t m, int32_t num_blocks, double exploration) {
  const int32_t explore = ExplorationBlocks(m, exploration);
  const int32_t ranked = m - explore;
  return {ranked, 1.0 - static_cast<double>(explore) / (num_blocks - ranked)};
}
}  // namespace

double ExpectedMiss(const MissCurve& monotone, int32_t m, int32_t num_blocks, double exploration) {
  if (m >= num_blocks) return 0.0;
  const ExplorationSplit x = SplitExploration(m, num_blocks, exploration);
  return CurveMiss(monotone, static_cast<double>(x.ranked) / num_blocks) * x.unrecovered;
}

absl::StatusOr<Allocation> AllocateForMissLevels(const AllocationInput& in,
                                                 std::span<const double> levels) {
  const int32_t L = static_cast<int32_t>(in.curves.size());
  if (levels.size() != in.curves.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("miss levels for ", levels.size(), " layers; the curves are for ", L));
  }
  for (int32_t l = 0; l < L; ++l) {
    if (!(levels[l] > 0 && levels[l] < 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("miss target ", levels[l], " (layer ", l, ") is out of range (0, 1)"));
    }
  }
  if (!(in.exploration >= 0 && in.exploration < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("exploration ", in.exploration, " is out of range [0, 1)"));
  }
  // The validation and the comparison fields of the minimax allocation, then this allocation.
  SPIN_ASSIGN_OR_RETURN(Allocation ref, AllocateBudgets(in));
  const int32_t B = in.num_blocks;
  const int32_t floor_blocks =
      static_cast<int32_t>(std::min<int64_t>(B, CeilDiv(in.topk, in.block_size)));
  Allocation out;
  out.uniform_worst_miss = ref.uniform_worst_miss;
  out.uniform_mean_miss = ref.uniform_mean_miss;
  out.blocks.resize(L);
  out.sparsity.resize(L);
  for (int32_t l = 0; l < L; ++l) {
    const MissCurve mono = MonotoneCurve(in.curves[l]);
    // ExpectedMiss is non-increasing in m and 0 at B, so the fewest m in [floor, B] meeting the
    // level exists.
    const int32_t m = FewestBlocksMeeting(floor_blocks, B, levels[l], [&](int32_t k) {
      return ExpectedMiss(mono, k, B, in.exploration);
    });
    out.blocks[l] = m;
    out.sparsity[l] = 1.0 - static_cast<double>(m) / B;
    out.total_blocks += m;
    const double miss = ExpectedMiss(mono, m, B, in.exploration);
    out.worst_miss = std::max(out.worst_miss, miss);
    out.mean_miss += miss / L;
  }
  return out;
}

absl::StatusOr<Allocation> AllocateForMissTarget(const AllocationInput& in, double miss_target) {
  if (!(miss_target > 0 && miss_target < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("miss target ", miss_target, " is out of range (0, 1)"));
  }
  const std::vector<double> levels(in.curves.size(), miss_target);
  return AllocateForMissLevels(in, levels);
}

absl::Status ValidateBudgetTuning(const BudgetTuning& t) {
  if (!(t.smoothing > 0 && t.smoothing <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget smoothing ", t.smoothing, " is out of range (0, 1]"));
  }
  if (!(t.drift_threshold >= 0 && t.drift_threshold <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget drift threshold ", t.drift_threshold, " is out of range [0, 1]"));
  }
  if (!(t.blocks_drift >= 0) || !std::isfinite(t.blocks_drift)) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget blocks drift ", t.blocks_drift, " must be a finite value >= 0"));
  }
  if (t.min_probes < 1) {
    return absl::InvalidArgumentError("budget min_probes must be >= 1");
  }
  if (!(t.payback_steps >= 1) || !std::isfinite(t.payback_steps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget payback steps ", t.payback_steps, " must be a finite value >= 1"));
  }
  if (!(t.credit_share >= 0 && t.credit_share <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget credit share ", t.credit_share, " is out of range [0, 1]"));
  }
  if (!(t.level_band >= 0 && t.level_band < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget level band ", t.level_band, " is out of range [0, 1)"));
  }
  return absl::OkStatus();
}

namespace {
// A miss-target layer's level stays within [kMinLevel M, kMaxLevel M]. Its debt is at most what
// kMaxDebt payback horizons at the lowest level repay, its credit what the highest level spends
// in one (no wind-up; at a sparse table, what credit_share spends).
constexpr double kMinLevel = 0.25, kMaxLevel = 2.0, kMaxDebt = 4.0;
}  // namespace

BudgetController::BudgetController(const Geometry& g, BudgetTuning tuning)
    : layers_(static_cast<int32_t>(g.layers)),
      topk_(static_cast<int32_t>(g.topk)),
      block_size_(static_cast<int32_t>(std::max<uint32_t>(1, g.block_size))),
      default_blocks_(static_cast<int32_t>(
          std::max<int64_t>(1, CeilDiv(g.max_slots, std::max<uint32_t>(1, g.block_size))))),
      tuning_(tuning) {
  Reset();
}

void BudgetController::Reset() {
  base_curves_.assign(static_cast<size_t>(layers_) * kCurvePoints, 0);
  base_stats_.assign(layers_, LayerStats{});
  smoothed_.assign(layers_, MissCurve{});
  used_.assign(layers_, MissCurve{});
  samples_.assign(layers_, 0);
  num_blocks_ = default_blocks_;
  used_blocks_ = 0;
  used_target_ = -1;
  used_miss_target_ = -1;
  used_exploration_ = -1;
  recomputes_ = 0;
  have_table_ = false;
  table_.clear();
  cold_ = false;
  level_.assign(layers_, 0.0);
  debt_.assign(layers_, 0.0);
}

double BudgetController::Level(int32_t l, double miss_target) const {
  return std::clamp(miss_target - debt_[l] / tuning_.payback_steps, kMinLevel * miss_target,
                    kMaxLevel * miss_target);
}

void BudgetController::Measure(int32_t l, uint64_t probes, double probe_miss, double miss_target,
                               double exploration) {
  // The probe step ranked the layer's blocks as its selection does (without exploration) and
  // counted the dense top-K slots outside the first m of them, m from the table in force:
  // `probe_miss`. The selection ranks only m - m_e blocks and explores m_e: the curve's drop
  // between the two keep fractions moves the count to the ranked part, and ExpectedMiss's
  // recovery factor accounts for the random blocks.
  const int32_t B = num_blocks_;
  const int32_t m = KeptBlocks(B, topk_, block_size_, table_[l]);
  double e = 0;
  if (m < B) {
    const MissCurve mono = MonotoneCurve(smoothed_[l]);
    const ExplorationSplit x = SplitExploration(m, B, exploration);
    const double shift = CurveMiss(mono, static_cast<double>(x.ranked) / B) -
                         CurveMiss(mono, static_cast<double>(m) / B);
    e = std::min(1.0, probe_miss + std::max(0.0, shift)) * x.unrecovered;
  }
  Accrue(l, probes, e, miss_target, m >= B);
}

void BudgetController::Accrue(int32_t l, uint64_t steps, double miss, double miss_target,
                              bool dense) {
  // A measured excess is debt, repaid in full (up to kMaxDebt levels' worth). A measured
  // shortfall is banked in full when the table was dense (its miss is exactly 0); at a sparse
  // table only up to credit_share of the target over the payback horizon: the measurements are
  // estimates, and banking all of their noise turned into excess in the worst layer. A
  // shortfall never takes back credit already banked.
  const double pay = tuning_.payback_steps;
  const double lo = dense ? -(kMaxLevel - 1) * miss_target * pay
                          : std::min(debt_[l], -tuning_.credit_share * miss_target * pay);
  const double hi = kMaxDebt * (1 - kMinLevel) * miss_target * pay;
  debt_[l] = std::clamp(debt_[l] + static_cast<double>(steps) * (miss - miss_target), lo, hi);
}

absl::StatusOr<std::optional<BudgetUpdate>> BudgetController::Update(const ProbeSnapshot& snap,
                                                                     double target,
                                                                     double miss_target,
                                                                     double exploration) {
  if (snap.curves.size() != static_cast<size_t>(layers_) * kCurvePoints ||
      snap.stats.size() != static_cast<size_t>(layers_)) {
    return absl::InvalidArgumentError(
        absl::StrCat("probe snapshot has ", snap.curves.size(), " curve counters and ",
                     snap.stats.size(), " layer stats; the session has ", layers_, " layers (",
                     layers_ * kCurvePoints, " counters)"));
  }
  if (!(target >= 0 && target < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("target sparsity ", target, " is out of range [0, 1)"));
  }
  // Monotone counters that went backwards mean a new arena: measure from zero again.
  bool backwards = false;
  for (int32_t l = 0; l < layers_ && !backwards; ++l) {
    const LayerStats &s = snap.stats[l], &b = base_stats_[l];
    backwards = s.steps < b.steps || s.probe_steps < b.probe_steps || s.probe_topk < b.probe_topk ||
                s.blocks_total < b.blocks_total || s.explore_steps < b.explore_steps ||
                s.explore_topk < b.explore_topk || s.explore_est < b.explore_est;
  }
  for (size_t i = 0; i < base_curves_.size() && !backwards; ++i) {
    backwards = snap.curves[i] < base_curves_[i];
  }
  if (backwards) {
    std::fill(base_curves_.begin(), base_curves_.end(), 0);
    std::fill(base_stats_.begin(), base_stats_.end(), LayerStats{});
  }

  uint64_t dsteps = 0, dblocks = 0;
  // Miss-target mode: each layer's new probe steps and their miss at the table in force.
  std::vector<std::pair<uint64_t, double>> window(miss_target > 0 ? layers_ : 0, {0, 0.0});
  // ... and its sparse steps' miss as their exploration blocks estimate it (docs/budgets.md,
  // "Measured between probes").
  std::vector<std::pair<uint64_t, double>> explored(window.size(), {0, 0.0});
  for (int32_t l = 0; l < layers_; ++l) {
    const LayerStats &s = snap.stats[l], &b = base_stats_[l];
    dsteps += s.steps - b.steps;
    dblocks += s.blocks_total - b.blocks_total;
    if (!explored.empty() && s.explore_steps > b.explore_steps && s.explore_topk > b.explore_topk) {
      explored[l] = {s.explore_steps - b.explore_steps,
                     std::min(1.0, ExploreMissRate(s.explore_est - b.explore_est,
                                                   s.explore_topk - b.explore_topk))};
    }
    const uint64_t probes = s.probe_steps - b.probe_steps;
    const uint64_t topk = s.probe_topk - b.probe_topk;
    if (probes == 0 || topk == 0) continue;
    MissCurve x;
    for (int p = 0; p < kCurvePoints; ++p) {
      const size_t i = static_cast<size_t>(l) * kCurvePoints + p;
      x[p] = static_cast<double>(snap.curves[i] - base_curves_[i]) / static_cast<double>(topk);
    }
    if (samples_[l] == 0) {
      smoothed_[l] = x;
    } else {
      const double w = 1.0 - std::pow(1.0 - tuning_.smoothing, static_cast<double>(probes));
      for (int p = 0; p < kCurvePoints; ++p) smoothed_[l][p] += w * (x[p] - smoothed_[l][p]);
    }
    samples_[l] += probes;
    if (!window.empty() && s.probe_missed >= b.probe_missed) {
      window[l] = {probes, std::min(1.0, static_cast<double>(s.probe_missed - b.probe_missed) /
                                             static_cast<double>(topk))};
    }
  }
  if (dsteps > 0) {
    // The counters come from an arena a client can write: the mean context is bounded by the
    // geometry's blocks before it sizes anything.
    const double mean = static_cast<double>(dblocks) / static_cast<double>(dsteps);
    num_blocks_ = static_cast<int32_t>(
        std::clamp<double>(std::round(mean), 1.0, static_cast<double>(default_blocks_)));
  }
  std::copy(snap.curves.begin(), snap.curves.end(), base_curves_.begin());
  std::copy(snap.stats.begin(), snap.stats.end(), base_stats_.begin());
  if (!table_.empty()) {
    for (int32_t l = 0; l < static_cast<int32_t>(window.size()); ++l) {
      if (window[l].first > 0)
        Measure(l, window[l].first, window[l].second, miss_target, exploration);
      // The estimate is of the table in force, exploration included.
      if (explored[l].first > 0) Accrue(l, explored[l].first, explored[l].second, miss_target);
    }
  }

  bool ready = true;
  for (int32_t l = 0; l < layers_; ++l) ready = ready && samples_[l] >= tuning_.min_probes;
  if (!ready) {
    if (miss_target > 0 && !have_table_ && !cold_) {
      // Miss-target mode before any probe data: no curve says what any sparsity would miss,
      // and the only table known to meet the target is dense.
      return std::optional<BudgetUpdate>(Fixed(0.0, miss_target, target, exploration, "cold"));
    }
    if (miss_target == 0 && cold_) {
      // Back to a sparsity target before any data: the target applies uniformly.
      return std::optional<BudgetUpdate>(Fixed(target, 0.0, target, exploration, "target"));
    }
    return std::optional<BudgetUpdate>();
  }
  std::string reason;
  const bool new_miss_target =
      miss_target != used_miss_target_ || (miss_target > 0 && exploration != used_exploration_);
  if (!have_table_) {
    reason = "first";
  } else if (target != used_target_ || new_miss_target) {
    reason = "target";
  } else if (miss_target > 0) {
    // Miss-target mode: what matters is each layer's expected miss at the blocks it has, under
    // the current curves, against its level.
    const int32_t B = num_blocks_;
    int32_t over = -1, slack = -1;
    double over_miss = 0, over_level = 0;
    for (int32_t l = 0; l < layers_; ++l) {
      const double level = Level(l, miss_target);
      const MissCurve mono = MonotoneCurve(smoothed_[l]);
      const int32_t m = KeptBlocks(B, topk_, block_size_, table_[l]);
      const double e = ExpectedMiss(mono, m, B, exploration);
      if (e > level * (1 + tuning_.level_band)) {
        if (over < 0 || e / level > over_miss / over_level) {
          over = l;
          over_miss = e;
          over_level = level;
        }
      } else if (slack < 0 && e < level * (1 - tuning_.level_band) &&
                 ExpectedMiss(mono, m - 1, B, exploration) <= level &&
                 m - 1 >= std::min<int64_t>(B, CeilDiv(topk_, block_size_))) {
        slack = l;
      }
    }
    if (over >= 0) {
      reason = absl::StrFormat("miss %.4f over level %.4f (layer %d)", over_miss, over_level, over);
    } else if (slack >= 0) {
      reason = absl::StrFormat("slack (layer %d)", slack);
    } else if (std::abs(num_blocks_ - used_blocks_) > tuning_.blocks_drift * used_blocks_) {
      reason = "context";
    } else {
      return std::optional<BudgetUpdate>();
    }
  } else {
    double drift = 0;
    int32_t where = 0;
    for (int32_t l = 0; l < layers_; ++l) {
      for (int p = 0; p < kCurvePoints; ++p) {
        const double d = std::fabs(smoothed_[l][p] - used_[l][p]);
        if (d > drift) {
          drift = d;
          where = l;
        }
      }
    }
    if (drift > tuning_.drift_threshold) {
      reason = absl::StrFormat("drift %.3f (layer %d)", drift, where);
    } else if (std::abs(num_blocks_ - used_blocks_) > tuning_.blocks_drift * used_blocks_) {
      reason = "context";
    } else {
      return std::optional<BudgetUpdate>();
    }
  }
  // A new miss target (or exploration share) is a new contract: the debts start over.
  if (new_miss_target && have_table_) std::fill(debt_.begin(), debt_.end(), 0.0);
  SPIN_ASSIGN_OR_RETURN(BudgetUpdate u,
                        Recompute(target, miss_target, exploration, std::move(reason)));
  return std::optional<BudgetUpdate>(std::move(u));
}

BudgetUpdate BudgetController::Fixed(double sparsity, double miss_target, double target,
                                     double exploration, std::string reason) {
  BudgetUpdate u;
  u.sparsity.assign(layers_, sparsity);
  u.num_blocks = num_blocks_;
  u.allocation.sparsity = u.sparsity;
  u.allocation.blocks.assign(layers_, KeptBlocks(num_blocks_, topk_, block_size_, sparsity));
  for (int32_t b : u.allocation.blocks) u.allocation.total_blocks += b;
  u.reason = std::move(reason);
  table_ = u.sparsity;
  cold_ = miss_target > 0;
  used_target_ = target;
  used_miss_target_ = miss_target;
  used_exploration_ = exploration;
  recomputes_ += 1;
  return u;
}

absl::StatusOr<BudgetUpdate> BudgetController::Recompute(double target, double miss_target,
                                                         double exploration, std::string reason) {
  AllocationInput in;
  in.curves = smoothed_;
  in.num_blocks = num_blocks_;
  in.topk = topk_;
  in.block_size = block_size_;
  in.target_sparsity = target;
  in.exploration = exploration;
  std::vector<double> levels;
  if (miss_target > 0) {
    for (int32_t l = 0; l < layers_; ++l) levels.push_back(Level(l, miss_target));
  }
  SPIN_ASSIGN_OR_RETURN(Allocation a,
                        miss_target > 0 ? AllocateForMissLevels(in, levels) : AllocateBudgets(in));
  used_ = smoothed_;
  used_blocks_ = num_blocks_;
  used_target_ = target;
  used_miss_target_ = miss_target;
  used_exploration_ = exploration;
  recomputes_ += 1;
  have_table_ = true;
  cold_ = false;
  table_ = a.sparsity;
  if (miss_target > 0) level_ = levels;
  BudgetUpdate u;
  u.sparsity = a.sparsity;
  u.allocation = std::move(a);
  u.num_blocks = num_blocks_;
  u.reason = std::move(reason);
  return u;
}

absl::StatusOr<BudgetUpdate> BudgetController::Warm(const std::vector<MissCurve>& curves,
                                                    int32_t num_blocks, double target,
                                                    double miss_target, double exploration) {
  if (curves.size() != static_cast<size_t>(layers_)) {
    return absl::InvalidArgumentError(
        absl::StrCat("warm curves for ", curves.size(), " layers; the session has ", layers_));
  }
  for (size_t l = 0; l < curves.size(); ++l) {
    for (double x : curves[l]) {
      if (!(x >= 0 && x <= 1)) {
        return absl::InvalidArgumentError(
            absl::StrCat("warm curve of layer ", l, " has the value ", x, "; must be in [0, 1]"));
      }
    }
  }
  if (!(target >= 0 && target < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("target sparsity ", target, " is out of range [0, 1)"));
  }
  Reset();
  smoothed_ = curves;
  samples_.assign(layers_, tuning_.min_probes);
  num_blocks_ = std::clamp<int32_t>(num_blocks, 1, default_blocks_);
  return Recompute(target, miss_target, exploration, "warm");
}

absl::Status ValidateBudgetTable(const Geometry& g, std::span<const double> sparsity) {
  if (sparsity.size() != g.layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "budget table has ", sparsity.size(), " entries; the arena has ", g.layers, " layers"));
  }
  for (size_t l = 0; l < sparsity.size(); ++l) {
    if (!(sparsity[l] >= 0 && sparsity[l] < 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("budget of layer ", l, " is ", sparsity[l], "; must be in [0, 1)"));
    }
  }
  return absl::OkStatus();
}

absl::Status WriteBudgetTable(const ArenaView& a, std::span<const double> sparsity) {
  SPIN_RETURN_IF_ERROR(ValidateBudgetTable(a.geometry, sparsity));
  std::copy(sparsity.begin(), sparsity.end(), a.sparsity);
  a.policy->epoch += 1;
  return absl::OkStatus();
}

}  // namespace spin
