// Per-layer block budgets from dense probe steps (docs/design.md §6; docs/budgets.md).
//
// Plain host C++ shared by spind's probe thread and offline replay: it never touches an arena.
// The caller copies the arena's accumulated miss-curve counters and layer statistics into host
// buffers (a memcpy on the CPU backend, a device-to-host copy on the CUDA backend), hands them
// to a BudgetController, and when the controller returns a table writes it into the arena's
// budget table and advances the epoch (WriteBudgetTable for host arenas).
//
// Three pieces:
//   - curve shaping: a probe curve is noisy and need not be monotone; MonotoneCurve fits the
//     closest non-increasing curve (isotonic regression) and CurveMiss interpolates it;
//   - the allocator: kept blocks per layer minimising the worst layer's predicted miss with the
//     total equal to the uniform budget's at the target sparsity, each layer within
//     [ceil(K/b), B] blocks (AllocateBudgets), or, for a miss target, the fewest blocks per layer
//     whose expected miss meets it (AllocateForMissTarget, AllocateForMissLevels);
//   - the controller: smooths successive probe deltas with a per-probe EMA, detects drift and
//     recomputes only then (BudgetController); for a miss target it also measures each layer's
//     miss at the table in force on every probe step and closes the loop on it.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "spin/arena.h"

namespace spin {

/// A layer's miss curve: entry p is the fraction of the dense top-K lost when the layer keeps
/// the fraction CurveKeepFraction(p) = 0.05 (p + 1) of its blocks (the arena's curve grid).
using MissCurve = std::array<double, kCurvePoints>;

/// The non-increasing curve closest to `c` in squared error (pool-adjacent-violators), clamped
/// to [0, 1]. Noise that makes a probe curve rise with the keep fraction is averaged away
/// instead of being clipped to the running minimum (which would bias it low).
MissCurve MonotoneCurve(const MissCurve& c);

/// Predicted miss at keep fraction `keep` of a monotone curve: linear between grid points, and
/// between (0, 1) and the first grid point (keeping nothing misses everything); 0 beyond 1.
double CurveMiss(const MissCurve& monotone, double keep);

/// What the allocator sizes.
struct AllocationInput {
  std::vector<MissCurve> curves;  ///< [L] per-layer miss curves (any values in [0, 1])
  int32_t num_blocks = 0;         ///< B: blocks of the context the budgets are sized for
  int32_t topk = 0;               ///< the indexer's top-K (the floor is ceil(K/b) blocks)
  int32_t block_size = 64;        ///< b
  double target_sparsity = 0.5;   ///< rho of the uniform budget whose total is kept
  /// gamma, the exploration share: of m kept blocks, floor(gamma m) are random, so only the
  /// rest are ranked by the prediction the curves measure (AllocateForMissTarget uses it).
  double exploration = 0;
};

/// The allocator's answer.
struct Allocation {
  std::vector<double> sparsity;   ///< [L] rho_l for the budget table: 1 - blocks[l] / B
  std::vector<int32_t> blocks;    ///< [L] kept blocks m_l at B; KeptBlocks(B, K, b, rho_l) == m_l
  int64_t total_blocks = 0;       ///< sum of blocks == L * KeptBlocks(B, K, b, target)
  double worst_miss = 0;          ///< max over layers of the predicted miss at m_l
  double uniform_worst_miss = 0;  ///< the same for the uniform budget (for logs and metrics)
  double mean_miss = 0;           ///< mean over layers of the predicted miss at m_l
  double uniform_mean_miss = 0;   ///< the same for the uniform budget
};

/// Kept blocks per layer that minimise max_l miss_l(m_l / B) subject to
/// sum_l m_l = L * KeptBlocks(B, K, b, target) and ceil(K/b) <= m_l <= B (the floor capped at B).
/// Curves are made monotone first. The minimax level is found by bisection (each layer then
/// takes the fewest blocks that reach it); blocks left over go one at a time to the layer whose
/// predicted miss drops most, ties to the layer with fewer blocks, then the lower id, so equal
/// curves give exactly the uniform budget. Errors: no layers, B < 1, K < 1, b < 1, a target
/// outside [0, 1) or a non-finite curve value.
absl::StatusOr<Allocation> AllocateBudgets(const AllocationInput& in);

/// Expected miss of a layer that keeps m of B blocks with the exploration share gamma, from its
/// monotone curve: the ranked part r = m - ExplorationBlocks(m, gamma) misses CurveMiss(r / B) of
/// the top-K; the exploration blocks are drawn uniformly from the B - r blocks outside it, which
/// hold every slot it missed, so they recover ExplorationBlocks(m, gamma) / (B - r) of those in
/// expectation. 0 when m >= B. Non-increasing in m.
double ExpectedMiss(const MissCurve& monotone, int32_t m, int32_t num_blocks, double exploration);

/// Kept blocks per layer for a miss target: each layer takes the fewest blocks m, within
/// [ceil(K/b), B], whose ExpectedMiss (monotone curve, exploration share `in.exploration`) is at
/// most `miss_target` (B when none is). No total is imposed. `in.target_sparsity` only sizes the
/// uniform_* fields for comparison. Errors: as AllocateBudgets, and a miss target outside (0, 1).
absl::StatusOr<Allocation> AllocateForMissTarget(const AllocationInput& in, double miss_target);

/// The same with a level per layer (the miss-target controller's levels): layer l takes the
/// fewest blocks whose ExpectedMiss is at most levels[l]. Errors: as AllocateForMissTarget for
/// each level, and a level count other than the layers.
absl::StatusOr<Allocation> AllocateForMissLevels(const AllocationInput& in,
                                                 std::span<const double> levels);

/// Knobs of the controller (docs/budgets.md explains each).
struct BudgetTuning {
  /// EMA weight of one probe step's curve: a snapshot holding n new probe steps per layer moves
  /// the smoothed curve by 1 - (1 - smoothing)^n toward the snapshot's mean curve. (0, 1].
  double smoothing = 0.3;
  /// Recompute when some layer's smoothed curve moved by more than this (max over grid points,
  /// absolute miss fraction) since the curves of the last recompute. [0, 1].
  double drift_threshold = 0.02;
  /// Also recompute when B (mean blocks per step) changed by more than this fraction since the
  /// last recompute (the floor's share of B moves with it). >= 0.
  double blocks_drift = 0.1;
  /// Probe samples every layer needs before the first recompute. >= 1.
  uint64_t min_probes = 1;
  /// Miss-target mode: a layer's measured miss above the target, summed over measured steps
  /// (probe steps, and sparse steps measured by their exploration blocks: its debt), is paid
  /// back over this many measured steps by lowering the layer's level below the target; the
  /// zero miss of a dense table (the cold start) is credit, spent the same way. >= 1.
  double payback_steps = 8;
  /// Miss-target mode: a measured shortfall at a sparse table is banked as credit up to this
  /// share of the target over the payback horizon (so credit lifts a level to at most
  /// (1 + credit_share) M); 0 banks none. [0, 1].
  double credit_share = 0.25;
  /// Miss-target mode: recompute when a layer's expected miss at the blocks it has left
  /// [level (1 - band), level (1 + band)] (below only when fewer blocks would meet the level).
  /// [0, 1).
  double level_band = 0.1;
};

/// Checks each field; the message names the field and its allowed range.
absl::Status ValidateBudgetTuning(const BudgetTuning& t);

/// Host copies of a session's accumulated counters, as they are in the arena.
struct ProbeSnapshot {
  std::span<const uint64_t> curves;   ///< [L * kCurvePoints]: the arena's curves section
  std::span<const LayerStats> stats;  ///< [L]: the arena's stats section
};

/// A recompute's result: the table to write, and why.
struct BudgetUpdate {
  std::vector<double> sparsity;  ///< [L] the new budget table (rho_l)
  Allocation allocation;         ///< details (blocks at B, predicted worst and mean miss)
  int32_t num_blocks = 0;        ///< the B it was sized for
  std::string reason;            ///< "first", "drift 0.031 (layer 3)", "target", "context"
};

/// The probe-side state of one session. Not thread-safe: one owner (the probe thread, or the
/// replay loop) calls Update.
class BudgetController {
 public:
  /// Uses g.layers, g.topk, g.block_size, and ceil(max_slots / b) as B until stats give one.
  explicit BudgetController(const Geometry& g, BudgetTuning tuning = {});

  /// Feeds a snapshot of the accumulated counters (call it as often as wanted; snapshots with
  /// no new probe step change nothing). Per layer, the new probe steps since the last snapshot
  /// give one mean curve (missed slots delta / probe top-K delta) that the EMA absorbs; B is the
  /// mean blocks per step over the window (blocks_total delta / steps delta, all layers).
  /// Returns a new table when every layer has min_probes samples and this is the first
  /// recompute, the target changed, the curves drifted, or B drifted; nullopt otherwise.
  /// Counters that went backwards (a reset arena) restart the controller's baseline. Errors:
  /// spans of the wrong size, a target outside [0, 1).
  /// With `miss_target` > 0 (the miss-target mode): before every layer has data the first call
  /// returns a dense table (reason "cold"); each probe's miss at the table in force moves the
  /// layer's debt and level; tables are AllocateForMissLevels' at the levels, recomputed when a
  /// layer's expected miss leaves its level's band (reasons "miss ...", "slack ...") instead of
  /// on curve drift; a changed miss target or exploration share recomputes ("target") and
  /// clears the debts. Back to a sparsity target before any data, the uniform table at the
  /// target is returned ("target").
  absl::StatusOr<std::optional<BudgetUpdate>> Update(const ProbeSnapshot& snapshot,
                                                     double target_sparsity, double miss_target = 0,
                                                     double exploration = 0);

  /// Starts from curves learned before (a model's last smoothed curves, saved by spind: warm
  /// budgets, docs/budgets.md): they become the smoothed curves, every layer counts min_probes
  /// samples, B becomes `num_blocks` (clamped to the geometry's), and the table for `target` is
  /// returned at once (reason "warm"). Later snapshots refine the curves as usual; drift is
  /// measured from these. Errors: a curve count other than the layers, a value that is not
  /// finite or outside [0, 1], a target outside [0, 1).
  absl::StatusOr<BudgetUpdate> Warm(const std::vector<MissCurve>& curves, int32_t num_blocks,
                                    double target_sparsity, double miss_target = 0,
                                    double exploration = 0);

  /// Recomputes returned so far.
  uint64_t recomputes() const { return recomputes_; }
  /// Probe samples absorbed per layer.
  const std::vector<uint64_t>& samples() const { return samples_; }
  /// The smoothed curves (raw, before MonotoneCurve); meaningful where samples() > 0.
  const std::vector<MissCurve>& smoothed() const { return smoothed_; }
  /// The B the next recompute would use.
  int32_t num_blocks() const { return num_blocks_; }
  /// Miss-target mode, per layer: the miss level of the last table (the target moved by the
  /// layer's debt; 0 before the first miss-target table), and the debt: the sum over probe steps
  /// of the measured miss at the table in force minus the target (negative: credit), bounded
  /// (docs/budgets.md, "Sparsity from a quality target").
  const std::vector<double>& miss_levels() const { return level_; }
  const std::vector<double>& miss_debt() const { return debt_; }
  /// Forgets everything but the geometry and tuning (e.g. when the session's mode changes).
  void Reset();

 private:
  // The allocation for the smoothed curves at `target`, recorded as the one in use.
  absl::StatusOr<BudgetUpdate> Recompute(double target, double miss_target, double exploration,
                                         std::string reason);

  // A table of one sparsity for every layer, recorded as the one in use (the miss-target mode's
  // cold start, and the way back from it).
  BudgetUpdate Fixed(double sparsity, double miss_target, double target, double exploration,
                     std::string reason);
  // Miss-target mode: adds each layer's measured miss at the table in force to its debt.
  void Measure(int32_t layer, uint64_t probes, double probe_miss, double miss_target,
               double exploration);
  // Miss-target mode: adds `steps` measured steps of mean miss `miss` at the table in force to
  // the layer's debt (`dense`: that table kept every block, so a shortfall is exact).
  void Accrue(int32_t layer, uint64_t steps, double miss, double miss_target, bool dense = false);
  // Miss-target mode: layer l's level for the next table.
  double Level(int32_t layer, double miss_target) const;

  int32_t layers_, topk_, block_size_, default_blocks_;
  BudgetTuning tuning_;
  bool have_base_ = false;
  std::vector<uint64_t> base_curves_;
  std::vector<LayerStats> base_stats_;
  std::vector<MissCurve> smoothed_, used_;
  std::vector<uint64_t> samples_;
  int32_t num_blocks_ = 0, used_blocks_ = 0;
  double used_target_ = -1, used_miss_target_ = -1, used_exploration_ = -1;
  uint64_t recomputes_ = 0;
  bool have_table_ = false;    // a table from probe data (or warm curves) was returned
  std::vector<double> table_;  // the last table returned (empty before any)
  bool cold_ = false;          // table_ is the miss-target mode's dense table before any data
  std::vector<double> level_, debt_;  // miss-target mode (miss_levels(), miss_debt())
};

/// INVALID_ARGUMENT unless the table has one entry per layer of `g`, each finite and in [0, 1).
absl::Status ValidateBudgetTable(const Geometry& g, std::span<const double> sparsity);

/// Writes a budget table into a host arena and advances the policy epoch (the kernels read the
/// table at their next launch). Errors: a table of the wrong length or a value outside [0, 1).
/// Device arenas: copy the table and the epoch with the backend's own device writes.
absl::Status WriteBudgetTable(const ArenaView& a, std::span<const double> sparsity);

}  // namespace spin
