// Sessions of spind: one arena per session (docs/design.md §4), its data plane for remote mode, and
// the limits operators set. Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "arena_storage.h"
#include "executor.h"
#include "spin/arena.h"
#include "spin/budget.h"
#include "warm_budgets.h"

namespace spin::service {

/// How a session's data plane is driven. A session is driven either by the process that holds
/// its arena (local: it fetched the fd and runs the data plane on the shared memory) or by
/// spind on the client's behalf (remote: OpenSequences / PredictMasks / ObserveScores), never
/// both: in remote mode spind reads step state back from the arena, which only it may write.
enum class DriveMode { kUnbound, kLocal, kRemote };

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
  /// The probe thread's bookkeeping (under mu): when it last read this session's counters, when
  /// it last logged one of its miss-target level recomputes (none yet: empty) and how many it left
  /// unlogged since, and when the last one saved the model's warm curves.
  std::chrono::steady_clock::time_point probe_visited{};
  std::optional<std::chrono::steady_clock::time_point> level_logged, level_saved;
  uint64_t level_unlogged = 0;
  /// The controller's curves changed since the model's warm file was last written (a level
  /// recompute within the interval leaves them so): SaveUnsavedWarmCurves writes them when the
  /// session is freed or spind stops, so none is lost.
  bool warm_unsaved = false;
  bool freed = false;  ///< set (under mu) when the manager dropped the session
  /// The policy spind wrote last: the authority for GetPolicy, SetPolicy and the probe thread
  /// (the arena's copy can be overwritten by a client that maps it).
  Policy policy;
  /// The budget table spind wrote last (one sparsity per layer), for the same reason.
  std::vector<double> budgets_written;
  /// The engine adopts policy and budget changes at a step boundary (AttachRequest
  /// engine_control): spind keeps `policy` and `budgets_written` as the proposed control and
  /// never writes them into the arena.
  bool engine_control = false;
  /// Bumped by every change of `policy` or `budgets_written`.
  uint64_t control_version = 0;
  /// The served model (AttachRequest.model; empty: none) and the store of its warm budgets,
  /// which the probe thread updates after each recompute.
  std::string model;
  std::shared_ptr<const WarmBudgets> warm;
  /// Remote mode: the step spind began (its own copy; the arena's batch header is not trusted).
  int32_t remote_n = 0, remote_rows = 0;
  bool remote_selected = false;  ///< a PredictMasks of the current remote step ran
  /// Runs the session's RPC work in order, one call at a time (set at attach when the manager
  /// has an executor).
  std::shared_ptr<Strand> strand;
  std::mutex mu;

  // Guarded by the manager's lock, not `mu` (the lease must be readable without waiting on a
  // busy session).
  DriveMode mode = DriveMode::kUnbound;
  int holders = 0;                                  ///< open fd connections holding the session
  std::chrono::steady_clock::time_point last_seen;  ///< last call, fetch or holder release
};

/// Operator limits and where arenas live.
struct Limits {
  uint32_t max_sessions = 64;
  uint64_t max_arena_bytes = 64ull << 30;  ///< over all sessions
  Backend backend = Backend::kCpu;
  int device = 0;  ///< CUDA device ordinal (CUDA backend)
  /// A session nobody holds (no fd connection) and nobody called for this long is freed.
  std::chrono::milliseconds grace{30000};
  /// fd connections one session may hold at once.
  int max_holders = 8;
};

/// Compares secrets (session and admin tokens) in time independent of where they differ.
bool ConstantTimeEquals(std::string_view a, std::string_view b);

/// Session ids are "s-" and 16 hex digits; longer ones are refused before any lookup.
inline constexpr size_t kMaxSessionIdBytes = 64;

/// Creates, finds and frees sessions.
class SessionManager {
 public:
  explicit SessionManager(const Limits& limits) : limits_(limits) {}
  ~SessionManager();

  /// Validates geometry and policy, allocates and initialises the arena. INVALID_ARGUMENT for
  /// bad values, RESOURCE_EXHAUSTED past the limits.
  absl::StatusOr<std::shared_ptr<Session>> Attach(const Geometry& g, uint64_t seed,
                                                  const Policy& policy,
                                                  const std::string& client_name,
                                                  bool engine_control = false);

  /// The session `id` if `token` matches: NOT_FOUND for an unknown id, PERMISSION_DENIED for a
  /// wrong token. A successful Get renews the session's lease.
  absl::StatusOr<std::shared_ptr<Session>> Get(const std::string& id, const std::string& token);

  /// The session `id` without a token (operator paths, logging); renews nothing.
  absl::StatusOr<std::shared_ptr<Session>> Find(const std::string& id) const;

  /// Binds the session to a drive mode (DriveMode): FAILED_PRECONDITION when it is already
  /// bound to the other one, with what to do instead.
  absl::Status Bind(Session& s, DriveMode mode);
  /// What Bind would answer, without binding (checked before a request is validated, so a
  /// refused request changes nothing).
  absl::Status CheckBind(const Session& s, DriveMode mode) const;

  /// An fd connection starts holding session `id` (its lease cannot lapse while held):
  /// NOT_FOUND if it is gone, RESOURCE_EXHAUSTED past Limits::max_holders.
  absl::Status Hold(const std::string& id);
  /// An fd connection holding `id` closed: the lease runs from now. No-op for an unknown id.
  void Release(const std::string& id);
  /// Renews the lease of `id` (a keep-alive). No-op for an unknown id.
  void Touch(const std::string& id);

  /// Frees every session whose lease lapsed (no holder, no call for Limits::grace) and
  /// returns their ids. The reaper thread calls it; tests may call it directly.
  std::vector<std::string> ReapExpired(std::chrono::steady_clock::time_point now);
  /// Starts the reaper thread (every `period`); `log` gets each reaped session's line, and
  /// `after_pass` (if set) runs after every pass (spind returns freed heap memory there).
  void StartReaper(std::chrono::milliseconds period,
                   std::function<void(const std::string&)> log = nullptr,
                   std::function<void()> after_pass = nullptr);
  /// Stops the reaper thread (also done by the destructor).
  void StopReaper();

  /// Frees the session (after the last in-flight call on it returns).
  absl::Status Detach(const std::string& id, const std::string& token);

  /// Where sessions' RPC work runs: each session attached afterwards gets a strand on it.
  void SetExecutor(Executor* executor) { executor_ = executor; }

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
  const Limits& limits() const { return limits_; }

 private:
  static absl::Status BindError(const Session& s, DriveMode mode);
  absl::StatusOr<std::shared_ptr<Session>> FindLocked(const std::string& id) const;
  Limits limits_;
  Executor* executor_ = nullptr;
  std::thread reaper_;
  std::mutex reaper_mu_;
  std::condition_variable reaper_cv_;
  bool reaper_stop_ = false;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> sessions_;
  std::vector<std::string> order_;
  uint64_t bytes_ = 0;
  uint32_t attaching_ = 0;  ///< attaches between their limit check and their insertion
  std::function<void(const std::string&)> on_free_;
};

}  // namespace spin::service
