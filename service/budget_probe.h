// The probe thread of spind (docs/design.md §6): per-layer budgets from the miss curves that probe
// steps accumulate in each session's arena. No per-step RPC: the thread reads the arenas' counters
// (a host mirror pull on the CUDA backend), feeds them to the session's BudgetController
// (spin/budget.h, the same code offline replay runs), and when the controller returns a new
// table writes it into the arena with a new epoch and publishes it (WatchBudgets).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "session_manager.h"

namespace spin::service {

/// One pass over one session (the caller holds `s.mu`): in per-layer mode, feeds the arena's
/// counters to the session's controller and writes the table it returns; in uniform mode,
/// forgets the controller. With `policy_changed` (a SetPolicy just ran) a per-layer session
/// whose controller has no table yet gets the uniform table at the new target, so a new target
/// takes effect at the next step either way. Returns true when the budget table was written.
absl::StatusOr<bool> RefreshBudgets(Session& s, bool policy_changed);

/// Validates `p`, writes it into the session's arena (and, in uniform mode, the budget table)
/// and records it as the session's policy (caller holds `s.mu`). Changes nothing on error.
absl::Status WriteSessionPolicy(Session& s, const Policy& p);
/// Writes a per-layer budget table into the session's arena and records it (caller holds
/// `s.mu`). Changes nothing on error.
absl::Status WriteSessionBudgets(Session& s, const std::vector<double>& sparsity);

/// A miss-target session moves its levels about once a step: those recomputes ("miss ...",
/// "slack ...") are logged, and save the model's warm curves, at most this often per session.
inline constexpr std::chrono::seconds kLevelLogInterval{10};

/// Saves the model's warm curves if a level recompute left them unsaved (caller holds `s.mu`):
/// SessionManager::Free runs it for a session that ends, and spind for each session when it stops.
void SaveUnsavedWarmCurves(Session& s);

/// True for a miss-target level recompute's reason ("miss ...", "slack ...").
bool IsLevelRecompute(const std::string& reason);

/// After RefreshBudgets wrote a table (caller holds `s.mu`): publishes it (`publish`) and logs
/// why, level recomputes at most once per kLevelLogInterval.
void ReportBudgets(Session& s, std::chrono::steady_clock::time_point now,
                   const std::function<void(Session&)>& publish,
                   const std::function<void(const char*, const std::string&)>& log);

/// One refresh as the probe thread runs it (caller holds `s.mu`): RefreshBudgets, an error
/// logged (the table in force stays), a written table reported (ReportBudgets).
void RefreshAndReport(Session& s, const std::function<void(Session&)>& publish,
                      const std::function<void(const char*, const std::string&)>& log);

/// The background thread.
class BudgetProbe {
 public:
  /// Sessions are read every `interval`, miss-target sessions every `miss_target_interval`:
  /// their controller measures every sparse step and should act before the next one, as
  /// offline replay's does (docs/budgets.md, "Live: spind's probe thread"). Remote-mode
  /// sessions are not read here: spind refreshes them as each of their steps begins. `publish`
  /// is called (holding the session's lock) after each table written; `log` gets a level
  /// ("info", "error") and a line (ReportBudgets).
  BudgetProbe(SessionManager* sessions, std::chrono::milliseconds interval,
              std::chrono::milliseconds miss_target_interval, std::function<void(Session&)> publish,
              std::function<void(const char*, const std::string&)> log);
  ~BudgetProbe();
  void Start();
  void Stop();

 private:
  void Loop();
  SessionManager* sessions_;
  std::chrono::milliseconds interval_, miss_target_interval_;
  std::function<void(Session&)> publish_;
  std::function<void(const char*, const std::string&)> log_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace spin::service
