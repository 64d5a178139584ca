// Offline replay: runs the real data plane over a trace as an engine would (docs/design.md §8).
//
// Per step: BeginStep; per layer: Select, "score" the selected blocks from the trace into a
// compacted logits buffer, take the top-K of each row and Remap it, Observe. The quality proxy
// is the miss rate of row 0: the fraction of the dense top-K (from the trace) that falls in
// skipped blocks.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "spin/arena.h"
#include "spin/budget.h"
#include "spin/data_plane.h"
#include "trace.h"

namespace spin {

/// Which data plane runs the replay.
enum class ReplayBackend { kCpu, kCuda };

/// When the rows of an MTP step are observed (docs/design.md §5, docs/lab/mtp-contract.md).
/// kSameStep, kRow0 and kAll need nothing the data plane lacks; kDeferred and kLate are emulated
/// here on the CPU backend (uniform budgets, no probes) to measure what the others would cost.
enum class MtpObserve {
  kSameStep,  ///< rows 0..accepted-1 at the step itself (acceptance known in advance: offline)
  kRow0,      ///< row 0 at once, draft rows never (the engine contract)
  kAll,       ///< every row at once, accepted or not
  kDeferred,  ///< row 0 at once, rows 1..accepted-1 at the next step before its selection
  kLate,      ///< rows 0..accepted-1 at the next step, after its selection
};

/// Parses "same-step", "row0", "all", "deferred" or "late".
absl::StatusOr<MtpObserve> ParseMtpObserve(const std::string& name);

/// What to replay with.
struct ReplayOptions {
  ReplayBackend backend = ReplayBackend::kCpu;
  Policy policy;              ///< sparsity, exploration, alpha, probe period, budgets
  uint64_t seed = 1;          ///< session seed of the exploration draws
  uint64_t sequence_key = 0;  ///< the trace's sequence key
  StateDtype dtype = StateDtype::kFp32;
  std::string dump_path;  ///< JSONL, one line per (step, layer); empty = none
  MtpObserve mtp_observe = MtpObserve::kSameStep;  ///< MTP traces: when draft rows are observed
  /// Per-layer budgets (the arena's policy in kPerLayer mode): run the daemon's
  /// BudgetController in process, fed after every probe step, writing the budget table and
  /// advancing the epoch when it recomputes; the table starts uniform at the target. False: the
  /// arena's owner (spind) writes the table and replay only reads it.
  bool local_budgets = true;
  BudgetTuning budget_tuning;  ///< smoothing and drift rule of the local controller
  /// Offline diagnostic of the miss-target mode (`--miss-measure exact`): every sparse step that
  /// the data plane measured by its exploration blocks is measured instead by its realized row-0
  /// miss, which replay knows from the trace's dense scores. The controller then sees what an
  /// exact measurement would show it; the selections, exploration included, are unchanged until
  /// the tables differ. Local replay only (an engine never knows its realized miss).
  bool exact_miss_measure = false;
  /// Called after each step with (steps done, steps total).
  std::function<void(int, int)> progress;
};

/// Per-layer results.
struct LayerSummary {
  int layer = 0;
  double mean_miss = 0;  ///< over the layer's non-dense steps
  double p99_miss = 0;
  double sparsity = 0;            ///< realized: skipped / total blocks over non-dense steps
  double effective_sparsity = 0;  ///< over all steps, dense ones included
  double budget = 0;              ///< the layer's budget table entry (rho_l) at the end
  uint64_t probe_steps = 0;
  uint64_t bad_scores = 0;
  /// The data plane's own estimate of mean_miss from its exploration blocks (what spind's
  /// miss-target controller measures between probes; docs/budgets.md), over the sparse steps
  /// it could measure (explore_steps); 0 when none.
  double explore_miss = 0;
  uint64_t explore_steps = 0;
};

/// Whole-trace results.
struct ReplaySummary {
  int steps = 0;
  int layers = 0;
  double mean_miss = 0;  ///< over all non-dense (step, layer) pairs
  double p99_miss = 0;
  double realized_sparsity = 0;      ///< skipped / total blocks over non-dense steps
  double effective_sparsity = 0;     ///< skipped / total blocks, dense steps counted as dense
  uint64_t sparse_steps = 0;         ///< non-dense (step, layer) pairs
  uint64_t dense_steps = 0;          ///< dense (step, layer) pairs (fresh or probe)
  uint64_t bad_scores = 0;           ///< non-finite scores skipped by Observe
  double worst_layer_mean_miss = 0;  ///< the highest per-layer mean miss
  int worst_layer = 0;               ///< the layer that has it (lowest id on ties)
  BudgetMode budget_mode = BudgetMode::kUniform;
  uint64_t budget_recomputes = 0;  ///< tables written (local controller, or spind's probe thread)
  uint64_t epoch_advance = 0;      ///< how far the arena's epoch moved during the replay
  std::vector<LayerSummary> per_layer;
};

/// The arena geometry that holds one trace.
Geometry TraceGeometry(const TraceMeta& meta, int64_t n_max, StateDtype dtype);

/// Replays `trace` on a data plane whose arena fits TraceGeometry (any backend, any owner),
/// using sequence slot 0. The arena's policy is used as it is.
absl::StatusOr<ReplaySummary> ReplayOn(DataPlane& dp, const Trace& trace,
                                       const ReplayOptions& options);

/// Replays `trace` on a private CPU arena built from `options`.
absl::StatusOr<ReplaySummary> Replay(const Trace& trace, const ReplayOptions& options);

/// The summary as one JSON object (keys documented in docs/replay.md).
std::string SummaryJson(const ReplaySummary& s);

/// The summary as a human-readable table.
std::string SummaryTable(const ReplaySummary& s);

}  // namespace spin
