// Synthetic indexer-score traces for `spinctl gen-trace`, and the prediction statistics the
// SPIN paper reports for real models (prev-iter Pearson correlation and top-K recall).
//
// The score model has the structure SPIN exploits and the failure modes it has to survive:
// attention sinks and persistent vertical lines, diagonal bands (a local window of recent slots
// and a few fixed-offset "slash" bands that move with the query), important regions spanning
// runs of slots (so the top-K is clustered into blocks), per-layer difficulty, slow drift, and
// sudden shifts where runs of old context become important mid-decode and stay so. The default
// options are tuned to the paper's range for real models (Pearson 0.85-0.91, recall 0.58-0.82).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "trace.h"

namespace spin {

/// What to generate. Same options, same bytes: every draw comes from one seeded mt19937_64.
struct GenTraceOptions {
  int layers = 8;               ///< indexer layers L
  int slots = 16384;            ///< N_max, the scores' last axis
  int steps = 256;              ///< decode steps T
  int rows = 1;                 ///< query rows per step (1 + MTP drafts)
  int block_size = 64;          ///< KV block size written to meta.json
  int topk = 2048;              ///< post-indexer top-K written to meta.json
  uint64_t seed = 1;            ///< RNG seed
  int prompt_len = -1;          ///< ctx_len of step 0; -1: slots - steps * rows - block_size
  double accept_rate = 0.7;     ///< rows > 1: chance each draft is accepted (prefix-valid)
  int shifts = 2;               ///< sudden shifts, evenly spaced over the steps (0: none)
  int shift_needles = 4;        ///< runs of old context that become important at each shift
  double noise_scale = 1.0;     ///< multiplies the per-step score noise of every layer
  double drift_scale = 1.0;     ///< multiplies the speed of the slow drift of every layer
  double nonfinite_rate = 0.0;  ///< fraction of valid scores replaced by NaN/+inf/-inf
  /// rows > 1: shuffle the scores of each rejected draft row over its valid slots, so a
  /// rejected draft's query looks at unrelated places (the worst case for observing it; by
  /// default a rejected row is drawn like an accepted one).
  bool shuffle_rejected = false;
};

/// Checks the options (positive sizes, prompt fits, rates in [0, 1]); one line per problem.
absl::Status ValidateGenTraceOptions(const GenTraceOptions& options);

/// The initial context length the options resolve to (prompt_len, or its default).
int ResolvedPromptLen(const GenTraceOptions& options);

/// The steps at which sudden shifts happen, ascending.
std::vector<int> ShiftSteps(const GenTraceOptions& options);

/// Generates a trace into `dir` (created if missing), one step in memory at a time.
absl::Status GenerateTrace(const std::string& dir, const GenTraceOptions& options);

/// Prev-iter predictability of a trace's row-0 scores, as in the paper's Table 1.
struct TraceStats {
  double prev_iter_pearson = 0;  ///< mean over (t >= 1, l) of Pearson(scores[t], scores[t-1])
  double prev_iter_recall = 0;   ///< mean over (t >= 1, l) of the top-K overlap with step t-1
  std::vector<double> per_layer_pearson;  ///< [L] the Pearson mean of each layer
  std::vector<double> per_layer_recall;   ///< [L] the recall mean of each layer
  std::vector<double> per_step_pearson;   ///< [T] mean over layers; entry 0 is NaN
  std::vector<double> per_step_recall;    ///< [T] mean over layers; entry 0 is NaN
  double prev_layer_pearson = 0;          ///< mean over (t, l >= 1) of Pearson(layer l, layer l-1)
  double topk_block_coverage = 0;         ///< mean fraction of blocks holding any top-K slot
};

/// Computes TraceStats over row 0. Pearson over slots below ctx_len[t-1] where both scores are
/// finite; recall = |topK(t-1) ∩ topK(t)| / min(K, ctx_len[t]), each top-K over its own step's
/// context, non-finite scores excluded, ties to the lower slot. Pairs with no variance are
/// skipped. Needs at least two steps.
absl::StatusOr<TraceStats> ComputeTraceStats(const Trace& trace);

/// A short human-readable report of `stats` (several lines, for spinctl).
std::string FormatTraceStats(const TraceStats& stats);

}  // namespace spin
