// Remote mode (docs/spind.md, "Local or remote, never both"): spind runs a session's data plane
// on the client's behalf. Each step checks its request against the session's geometry and
// spind's own copy of the step before it binds the session or touches the arena, so a refused
// call changes nothing; what it reads back from the arena is checked before it is used as a
// size or an index. The caller holds the session's lock.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "session_manager.h"
#include "spin/v1/spin.pb.h"

namespace spin::service {

/// ObserveScores: the largest logits buffer (floats) spind assembles for one call.
inline constexpr int64_t kMaxObserveFloats = int64_t{1} << 26;

/// OpenSequences: resets the request's sequences (each in range, none twice).
absl::Status OpenRemoteSequences(SessionManager& sessions, Session& s,
                                 const spin::v1::OpenSequencesRequest& req);
/// PredictMasks: begins a step when the request says so, selects one layer's blocks and
/// answers each entry's block ids and compacted lengths. `before_step` runs when a step that
/// passed every check is about to begin (spind refreshes the session's budgets there, after
/// every layer of the last step, as offline replay does after each step). That refresh is the
/// probe thread's work, not the call's: a BeginStep that then fails on the device (the only
/// failure left after the checks) does not undo it.
absl::Status PredictRemoteMasks(SessionManager& sessions, Session& s,
                                const spin::v1::PredictMasksRequest& req,
                                spin::v1::PredictMasksResponse* resp,
                                const std::function<void(Session&)>& before_step);
/// ObserveScores: feeds one layer's compacted logits of the step PredictMasks selected.
absl::Status ObserveRemoteScores(SessionManager& sessions, Session& s,
                                 const spin::v1::ObserveScoresRequest& req,
                                 spin::v1::ObserveScoresResponse* resp);

}  // namespace spin::service
