// Replay traces (docs/design.md §9): a directory with meta.json and scores.npy, the dense indexer
// score of every slot for each decode step, layer and query row of one sequence.
//
// Loading maps scores.npy (never copied) and validates meta.json against it; every failure is
// one line naming the file, the key or index and what was expected. NaN/inf scores are not a
// load error: the data plane skips and counts them. Unknown meta.json keys are ignored so that
// newer writers can add fields without breaking older readers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "npy.h"

namespace spin {

/// The largest geometry a trace may have: the data plane's limits (spin/arena.h kMaxLayers,
/// kMaxRows, kMaxSlots, and ValidateGeometry's block size), so that a trace that loads is one
/// every command can use: trace-stats, replay (a private arena or a session in spind) and eval
/// all read traces through LoadTrace and nothing else. spinctl checks at compile time that these
/// equal the kernels' constants; the trace fuzz target checks that every trace LoadTrace accepts
/// passes the kernels' ValidateGeometry.
inline constexpr int kTraceMaxLayers = 1024;
inline constexpr int kTraceMaxBlockSize = 4096;
inline constexpr int kTraceMaxRows = 16;
inline constexpr int kTraceMaxSlots = 1 << 24;  ///< the scores' last axis N_max, and topk
/// meta.json is read whole into memory; a larger one is refused (a real one is kilobytes).
inline constexpr uint64_t kTraceMaxMetaBytes = 64ull << 20;

/// The contents of meta.json.
struct TraceMeta {
  int version = 1;                ///< format version; only 1 exists
  int layers = 0;                 ///< indexer layers L
  int block_size = 0;             ///< KV block size b in slots
  int topk = 0;                   ///< post-indexer top-K (may exceed N_max)
  int steps = 0;                  ///< decode steps T
  int rows = 1;                   ///< query rows per step R (1 + MTP drafts)
  std::vector<int32_t> q_pos;     ///< [T] slot of row 0's query key; row r uses q_pos + r
  std::vector<int32_t> ctx_len;   ///< [T] context length of row 0; row r has ctx_len + r
  std::vector<int32_t> accepted;  ///< [T] rows accepted by verification, or empty if absent
};

/// Checks `meta` against itself, the limits above and the scores' last axis `n_max` (everything
/// LoadTrace checks except the scores' leading dimensions). The message names the offending
/// key/index.
absl::Status ValidateTraceMeta(const TraceMeta& meta, int64_t n_max);

/// A loaded trace: validated metadata plus the mapped scores (move-only).
class Trace {
 public:
  /// An empty trace; only assignment and destruction are valid.
  Trace() = default;
  /// Takes over `other`'s mapping; `other` becomes empty.
  Trace(Trace&& other) noexcept = default;
  /// Releases this trace's mapping and takes over `other`'s.
  Trace& operator=(Trace&& other) noexcept = default;
  /// Not copyable: the scores mapping has a single owner.
  Trace(const Trace&) = delete;
  /// Not copyable: the scores mapping has a single owner.
  Trace& operator=(const Trace&) = delete;

  /// The validated meta.json.
  const TraceMeta& meta() const { return meta_; }
  /// Slots per score row: the last axis of scores.npy.
  int64_t n_max() const { return n_max_; }
  /// Scores of step `t`, layer `l`, row `r`: n_max() floats, valid below ctx_len[t] + r.
  /// Requires 0 <= t < steps, 0 <= l < layers, 0 <= r < rows (not checked).
  const float* scores(int t, int l, int r) const {
    return scores_.data() +
           ((static_cast<int64_t>(t) * meta_.layers + l) * meta_.rows + r) * n_max_;
  }
  /// The directory the trace was loaded from.
  const std::string& dir() const { return dir_; }

 private:
  friend absl::StatusOr<Trace> LoadTrace(const std::string& dir);

  TraceMeta meta_;
  NpyArray scores_;
  int64_t n_max_ = 0;
  std::string dir_;
};

/// Loads and validates the trace in directory `dir`: the one validation path of every command
/// that reads a trace. NotFound for a missing directory or file, InvalidArgument for malformed
/// content, geometry beyond the limits above, or a meta.json / scores.npy that is not a regular
/// file (a FIFO is refused at once, never waited on; see OpenRegularFile).
absl::StatusOr<Trace> LoadTrace(const std::string& dir);

/// Parses meta.json text: JSON syntax, required keys and their types (values are checked by
/// ValidateTraceMeta); `source` names the file in messages.
absl::StatusOr<TraceMeta> ParseTraceMeta(const std::string& json_text, const std::string& source);

/// The meta.json text for `meta` (keys in the §9 order, `accepted` only when present).
std::string TraceMetaToJson(const TraceMeta& meta);

/// `meta` without its per-step arrays (q_pos, ctx_len, accepted): the geometry that
/// TraceWriter::Open takes.
TraceMeta TraceGeometry(TraceMeta meta);

/// Writes a trace one step at a time, so a generator never holds all scores in memory. Until
/// Close() succeeds only `dir` and a temporary file in it are created; Close then replaces any
/// trace there, removing meta.json first and writing it last, so a failure at any point leaves
/// either the old trace or no loadable one (move-only; an unclosed writer removes its
/// temporary file).
class TraceWriter {
 public:
  /// Creates `dir` if missing and starts scores.npy for `[steps, layers, rows, n_max]`.
  /// `meta` gives the geometry; its per-step arrays must be empty (WriteStep fills them).
  static absl::StatusOr<TraceWriter> Open(const std::string& dir, const TraceMeta& meta,
                                          int64_t n_max);

  /// A writer that holds nothing; only assignment and destruction are valid.
  TraceWriter() = default;
  /// Takes over `other`'s unfinished trace.
  TraceWriter(TraceWriter&& other) noexcept = default;
  /// Abandons this writer's unfinished trace and takes over `other`'s.
  TraceWriter& operator=(TraceWriter&& other) noexcept = default;
  /// Not copyable: the temporary scores file has a single owner.
  TraceWriter(const TraceWriter&) = delete;
  /// Not copyable: the temporary scores file has a single owner.
  TraceWriter& operator=(const TraceWriter&) = delete;

  /// Appends the next step: `scores` is [layers, rows, n_max] floats; `accepted` < 0 means the
  /// trace has no accepted array (give it on every step or on none).
  absl::Status WriteStep(const float* scores, int32_t q_pos, int32_t ctx_len,
                         int32_t accepted = -1);
  /// Validates the complete metadata, then puts scores.npy and meta.json in place.
  absl::Status Close();

  /// Steps written so far.
  int steps_written() const { return static_cast<int>(meta_.q_pos.size()); }
  /// The metadata accumulated so far.
  const TraceMeta& meta() const { return meta_; }

 private:
  std::string dir_;
  TraceMeta meta_;
  int64_t n_max_ = 0;
  NpyWriter scores_;
};

/// Writes a whole trace at once: `scores` is [steps, layers, rows, n_max] floats.
absl::Status WriteTrace(const std::string& dir, const TraceMeta& meta, int64_t n_max,
                        const float* scores);

/// The part of a trace CutTrace keeps: steps [first_step, first_step + steps) and layers
/// [first_layer, first_layer + layers); a count of 0 means "to the end".
struct TraceCut {
  int first_step = 0;
  int steps = 0;
  int first_layer = 0;
  int layers = 0;
};

/// Writes the part `cut` of `in` as a trace in `out_dir` (through TraceWriter, so a failure
/// leaves no loadable trace there): the same rows, slots, block size and top-K; q_pos, ctx_len
/// and accepted sliced; scores as float32 (a float16 trace is widened, exactly). Each step is
/// a trace step as it was, so the cut replays from a cold start at its first step, as a new
/// sequence would. InvalidArgument when the part is empty or leaves the trace, or when
/// `out_dir` is the trace's own directory.
absl::Status CutTrace(const Trace& in, const std::string& out_dir, const TraceCut& cut);

}  // namespace spin
