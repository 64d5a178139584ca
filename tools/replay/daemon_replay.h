// Replay of a trace through a session in spind (spinctl --target ... replay).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "replay.h"
#include "trace.h"

namespace spin {

/// Attaches a session sized for the trace, replays through it (the mapped arena with the local
/// data plane, or with `remote` the daemon's PredictMasks/ObserveScores), and detaches.
/// The budget figures of the summary (each layer's final budget, the recomputes, the epoch
/// advance) are the daemon's, read with GetBudgets before and after: in remote mode the
/// client's mirror of the arena never sees the tables spind's probe thread writes. `where`
/// receives a line naming the session.
absl::StatusOr<ReplaySummary> ReplayThroughDaemon(const std::string& target, const Trace& trace,
                                                  const ReplayOptions& options, bool remote,
                                                  const std::string& admin_token,
                                                  std::string* where);

}  // namespace spin
