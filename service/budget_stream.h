// WatchBudgets: a session's budget table streamed to its watchers. The probe thread, SetPolicy
// and the node default policy publish through the hub; a freed session and spind's drain end
// the streams.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "session_manager.h"
#include "spin/v1/spin.grpc.pb.h"

namespace spin::service {

/// A session's budget table as spind wrote it, with the arena's epoch (caller holds the
/// session's lock and pulled the control region): what GetBudgets answers and WatchBudgets
/// streams.
spin::v1::GetBudgetsResponse BudgetsOf(const Session& s);

class BudgetWatcher;

/// The open WatchBudgets streams, by session.
class BudgetHub {
 public:
  /// Opens a stream on the session `found` (a lookup that failed: a stream that ends at once
  /// with its error). The first message, the current table, is sent from the session's strand
  /// (`max_queued`: RESOURCE_EXHAUSTED past that many calls waiting there); a session with
  /// `max_per_session` streams open already refuses another.
  grpc::ServerWriteReactor<spin::v1::GetBudgetsResponse>* Watch(
      const absl::StatusOr<std::shared_ptr<Session>>& found, size_t max_per_session,
      size_t max_queued);
  /// Sends `update` to every stream of `session`.
  void Notify(const std::string& session, const spin::v1::GetBudgetsResponse& update);
  /// Ends every stream of `session` with `status`.
  void EndAll(const std::string& session, const grpc::Status& status);
  /// Ends every stream of every session with `status`, and every stream added later at once
  /// (spind is stopping).
  void Close(const grpc::Status& status);

 private:
  friend class BudgetWatcher;
  // Registers a stream; false when `session` already has `max_per_session` streams.
  bool Add(const std::string& session, BudgetWatcher* w, size_t max_per_session);
  void Remove(BudgetWatcher* w);

  std::mutex mu_;
  std::multimap<std::string, BudgetWatcher*> watchers_;
  bool closed_ = false;
  grpc::Status closed_status_;
};

}  // namespace spin::service
