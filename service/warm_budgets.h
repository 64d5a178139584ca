// Warm budgets (docs/budgets.md): per-layer difficulty is a property of the model, not of one
// engine run. spind keeps each model's last smoothed miss curves in a state directory (one
// JSON file per model, written atomically after every recompute), and a new per-layer session
// of the same model (AttachRequest.model) starts from them instead of uniform budgets. The
// files survive a spind restart; a bad, mismatched or stale file is ignored with a log line.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "spin/arena.h"
#include "spin/budget.h"

namespace spin::service {

/// A model's saved curves.
struct WarmCurves {
  std::vector<MissCurve> curves;  ///< [L] smoothed miss curves
  int32_t num_blocks = 0;         ///< the B they were sized for
  int64_t saved_unix = 0;         ///< when they were written
};

/// Checks a model name for use as a file name: 1-128 of [A-Za-z0-9._-], not starting with '.'.
absl::Status ValidateModelName(const std::string& model);

/// Writes `text` to `path` whole or not at all: a new temporary file beside it with an
/// unpredictable name, created exclusively (mkostemp: O_CREAT | O_EXCL, so a planted file or
/// symlink is never written through), synced, then renamed over `path` (which replaces a
/// symlink there rather than following it) and the directory synced. The error says which step
/// failed (for files in --state-dir).
absl::Status WriteFileAtomically(const std::string& path, const std::string& text);

/// Reads a state file of at most `max_bytes`: NOT_FOUND when there is none; FAILED_PRECONDITION
/// for a symlink (O_NOFOLLOW), a FIFO, device or directory (only regular files are read, opened
/// O_NONBLOCK so nothing can hang the open), or a file larger than `max_bytes`.
absl::StatusOr<std::string> ReadStateFile(const std::string& path, size_t max_bytes);

/// The largest warm-budget file read (1024 layers of curves take about 0.5 MiB).
inline constexpr size_t kMaxWarmFileBytes = 2u << 20;
/// The largest node-defaults.json read (a few hundred bytes in use).
inline constexpr size_t kMaxDefaultsFileBytes = 64u << 10;
/// Saved times accepted: from the epoch to a day past now (a clock set back a little); anything
/// else (a negative or huge saved_unix) is not trusted as fresh.
inline constexpr int64_t kMaxFutureSeconds = 86400;

/// The state directory's store. Thread-safe (files are written whole, then renamed).

class WarmBudgets {
 public:
  using LogFn = std::function<void(const char*, const std::string&)>;
  /// `dir` empty: disabled (Load finds nothing, Save does nothing).
  WarmBudgets(std::string dir, std::chrono::seconds max_age, LogFn log);

  bool enabled() const { return !dir_.empty(); }
  /// The file of `model`.
  std::string PathOf(const std::string& model) const;
  /// `model`'s curves for a session of geometry `g` (same layers, block size and top-K), or
  /// nullopt: no file, or one that is unreadable, malformed, for another geometry or older than
  /// the maximum age (each logged with what to do).
  std::optional<WarmCurves> Load(const std::string& model, const Geometry& g) const;
  /// Writes `model`'s curves (a temporary file renamed over the old one). Failures are logged.
  void Save(const std::string& model, const Geometry& g, const std::vector<MissCurve>& curves,
            int32_t num_blocks) const;

 private:
  std::string dir_;
  std::chrono::seconds max_age_;
  LogFn log_;
};

}  // namespace spin::service
