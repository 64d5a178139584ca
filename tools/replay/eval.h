// The quality study (`spinctl eval`, docs/lab/quality-study.md): on generated traces or given
// ones (real attention, docs/lab/attention-traces.md), the paper's prediction signals (random,
// prev-layer, prev-iter, prev-iter offset 1) against SPIN without and with exploration, uniform
// against per-layer budgets at equal effective sparsity, and the miss-target mode.
//
// Signals are scored the paper's Table 1 way (Pearson correlation and top-K recall against the
// dense indexer's scores) and as block selectors (query block, then the blocks with the highest
// max-pooled prediction; the ceil(K/b) floor applies). The signals see the previous step's or
// layer's *dense* scores, an oracle that SPIN, which only sees what it selected, does not have.
// SPIN runs are real replays through the CPU data plane (Replay).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gen_trace.h"
#include "replay.h"
#include "trace.h"

namespace spin {

/// What the study runs.
struct EvalOptions {
  std::vector<uint64_t> seeds = {201, 202, 203};  ///< one generated trace per seed
  /// Existing traces to study instead of generated ones (then `seeds` and `gen` are unused;
  /// trace i's exploration draws use seed i + 1).
  std::vector<std::string> trace_dirs;
  /// Worst-layer miss targets M of the miss-target runs (empty: none).
  std::vector<double> miss_targets = {0.01, 0.02, 0.03, 0.05, 0.1};
  int jobs = 1;  ///< traces studied at once (threads); results do not depend on it
  std::vector<double> sparsities = {0.2, 0.3, 0.4, 0.5, 0.6, 0.7};
  GenTraceOptions gen;               ///< trace shape (the seed is replaced by each of `seeds`)
  uint32_t probe_period = 8;         ///< P of the uniform / per-layer budget comparison
  double budget_exploration = 0.05;  ///< gamma of the budget comparison
  float alpha = kDefaultAlpha;
  BudgetTuning tuning;
  std::string work_dir;  ///< where traces are generated (kept)
  /// Progress lines (one per finished run).
  std::function<void(const std::string&)> log;
};

/// Miss statistics of one method at one target sparsity, averaged over the traces.
struct MethodPoint {
  std::string method;
  double target = 0;                    ///< target sparsity
  double effective_sparsity = 0;        ///< skipped / total blocks over all scored pairs
  double mean_miss = 0;                 ///< mean over (step, layer) pairs, then over traces
  double p99_miss = 0;                  ///< nearest-rank p99 per trace, averaged
  double worst_layer_miss = 0;          ///< highest per-layer mean miss per trace, averaged
  std::vector<double> worst_per_trace;  ///< the highest per-layer mean miss of each trace
};

/// Table 1 analogue: a prediction signal's agreement with the dense scores.
struct SignalRow {
  std::string signal;
  double pearson = 0;  ///< mean over (step, layer) pairs and traces
  double recall = 0;   ///< top-K overlap / min(K, context), same averaging
};

struct EvalResult {
  std::vector<SignalRow> signals;
  std::vector<MethodPoint> points;
  /// The miss-target runs: `target` is M (not a sparsity); same probe period and exploration as
  /// the budget comparison.
  std::vector<MethodPoint> miss_target_points;
  std::vector<std::string> traces;
  std::vector<std::string> trace_shapes;  ///< per trace: "L layers x N slots x T steps, top-K K"
};

/// The name of the miss-target method in results ("miss-target P=8").
std::string MissTargetMethod(uint32_t probe_period);

/// A method's p99 step miss at effective sparsity `at`, interpolated linearly between the two
/// points (of `points` named `method`, ordered by effective sparsity) around it; NaN when `at`
/// is outside their range.
double P99AtEffectiveSparsity(const std::vector<MethodPoint>& points, const std::string& method,
                              double at);

/// Generates the traces (or loads the given ones) and runs every method at every sparsity.
absl::StatusOr<EvalResult> RunEval(const EvalOptions& options);

/// Signal statistics and selector misses of the four baseline signals on one trace (exposed for
/// tests). Returns one SignalRow per signal and one MethodPoint per (signal, sparsity).
absl::Status EvalSignals(const Trace& trace, const std::vector<double>& sparsities, uint64_t seed,
                         std::vector<SignalRow>* signals, std::vector<MethodPoint>* points);

/// Everything as one JSON document.
std::string EvalJson(const EvalOptions& options, const EvalResult& r);
/// Markdown tables: Table 1 analogue, then miss per method and sparsity, then the budget
/// comparison with the worst-layer reduction.
std::string EvalMarkdown(const EvalOptions& options, const EvalResult& r);
/// Writes gnuplot data files into `dir`: mean.dat, p99.dat, worst.dat (tab-separated, one row
/// per sparsity, one column per method, a header row of quoted names), and budgets.dat (the
/// budget comparison against effective sparsity, one data set per budget mode).
absl::Status WriteEvalData(const EvalResult& r, const std::string& dir);

}  // namespace spin
