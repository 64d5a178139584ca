// Sessions of spind: one arena per session (DESIGN §4), its data plane for remote mode, and the
// limits operators set. Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "arena_storage.h"
#include "spin/arena.h"
#include "spin/budget.h"

namespace spin::service {

/// One attached session. `mu` serialises every use of its arena.
struct Session {
  std::string id;
  std::string token;
  std::string client_name;
  Geometry geometry;
  int64_t created_unix_seconds = 0;
  uint64_t bytes = 0;  ///< bytes held against --max-arena-bytes (the client's mapping size)
  std::unique_ptr<ArenaStorage> arena;
  /// Per-layer budget mode: the probe-side state (smoothed miss curves) of the allocator.
  std::unique_ptr<BudgetController> budgets;
  uint64_t budget_recomputes = 0;  ///< budget tables written by the allocator
  std::string budget_reason;       ///< why the last one was written ("first", "drift ...")
  bool freed = false;              ///< set (under mu) when the manager dropped the session
  std::mutex mu;
};

/// Operator limits and where arenas live.
struct Limits {
  uint32_t max_sessions = 64;
  uint64_t max_arena_bytes = 64ull << 30;  ///< over all sessions
  Backend backend = Backend::kCpu;
  int device = 0;  ///< CUDA device ordinal (CUDA backend)
};

/// Creates, finds and frees sessions.
class SessionManager {
 public:
  explicit SessionManager(const Limits& limits) : limits_(limits) {}

  /// Validates geometry and policy, allocates and initialises the arena. INVALID_ARGUMENT for
  /// bad values, RESOURCE_EXHAUSTED past the limits.
  absl::StatusOr<std::shared_ptr<Session>> Attach(const Geometry& g, uint64_t seed,
                                                  const Policy& policy,
                                                  const std::string& client_name);

  /// The session `id` if `token` matches: NOT_FOUND for an unknown id, PERMISSION_DENIED for a
  /// wrong token.
  absl::StatusOr<std::shared_ptr<Session>> Get(const std::string& id,
                                               const std::string& token) const;

  /// Frees the session (after the last in-flight call on it returns).
  absl::Status Detach(const std::string& id, const std::string& token);

  /// Called (outside the manager's lock) with the id of every session freed.
  void SetOnFree(std::function<void(const std::string&)> f) { on_free_ = std::move(f); }

  /// Frees the session without a token (its client went away). No-op for an unknown id.
  void Free(const std::string& id);

  /// Every session, in creation order.
  std::vector<std::shared_ptr<Session>> List() const;

  /// Arena bytes held by all sessions.
  uint64_t arena_bytes() const;

  /// Where arenas are allocated.
  Backend backend() const { return limits_.backend; }
  int device() const { return limits_.device; }

 private:
  Limits limits_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> sessions_;
  std::vector<std::string> order_;
  uint64_t bytes_ = 0;
  std::function<void(const std::string&)> on_free_;
};

}  // namespace spin::service
