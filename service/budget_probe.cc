#include "budget_probe.h"

#include <algorithm>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "spin/status_macros.h"

namespace spin::service {

absl::Status WriteSessionPolicy(Session& s, const Policy& p) {
  SPIN_RETURN_IF_ERROR(ValidatePolicy(p));
  // An engine_control session's engine writes the arena at a step boundary (the proposal is
  // what GetBudgets returns).
  if (!s.engine_control) SPIN_RETURN_IF_ERROR(s.arena->WritePolicy(p));
  s.policy = p;
  if (p.budget_mode == BudgetMode::kUniform) {
    s.budgets_written.assign(s.geometry.layers, p.target_sparsity);
  }
  s.control_version += 1;
  return absl::OkStatus();
}

absl::Status WriteSessionBudgets(Session& s, const std::vector<double>& sparsity) {
  SPIN_RETURN_IF_ERROR(ValidateBudgetTable(s.geometry, sparsity));
  if (!s.engine_control) SPIN_RETURN_IF_ERROR(s.arena->WriteBudgets(sparsity.data()));
  s.budgets_written = sparsity;
  s.control_version += 1;
  return absl::OkStatus();
}

absl::StatusOr<bool> RefreshBudgets(Session& s, bool policy_changed) {
  ArenaStorage& arena = *s.arena;
  SPIN_RETURN_IF_ERROR(arena.PullControl());
  const ArenaView& v = arena.host();
  // spind's own policy, not the arena's copy (a client that maps the arena can write it); the
  // counters and curves are read from the arena and only ever used as numbers, bounded by the
  // session's geometry in the controller.
  const Policy& p = s.policy;
  if (!TableFromProbes(p.budget_mode)) {
    SaveUnsavedWarmCurves(s);
    s.budgets.reset();  // a later switch back starts from fresh curves
    return false;
  }
  if (s.budgets == nullptr) s.budgets = std::make_unique<BudgetController>(s.geometry);
  const uint32_t L = v.geometry.layers;
  const ProbeSnapshot snap{
      std::span<const uint64_t>(v.curves, static_cast<size_t>(L) * kCurvePoints),
      std::span<const LayerStats>(v.stats, L)};
  const double miss_target = p.budget_mode == BudgetMode::kMissTarget ? p.miss_target : 0.0;
  SPIN_ASSIGN_OR_RETURN(std::optional<BudgetUpdate> u,
                        s.budgets->Update(snap, p.target_sparsity, miss_target, p.exploration));
  if (u.has_value()) {
    SPIN_RETURN_IF_ERROR(WriteSessionBudgets(s, u->sparsity));
    s.budget_recomputes += 1;
    s.budget_reason = u->reason;
    // The model's curves for its next sessions (warm budgets): a file written with two fsyncs,
    // so a miss-target session's level recomputes (about one a step) save at most once per
    // kLevelLogInterval; the newest curves are saved when the session ends
    // (SaveUnsavedWarmCurves).
    const auto now = std::chrono::steady_clock::now();
    const bool level = IsLevelRecompute(u->reason);
    s.warm_unsaved = true;
    if (!level || !s.level_saved || now - *s.level_saved >= kLevelLogInterval) {
      SaveUnsavedWarmCurves(s);
      if (level) s.level_saved = now;
    }
    return true;
  }
  if (policy_changed && s.budgets->recomputes() == 0) {
    // No probe data yet: the new target applies uniformly until the first recompute.
    const std::vector<double> uniform(L, p.target_sparsity);
    bool same = true;
    for (uint32_t l = 0; l < L; ++l) same = same && s.budgets_written[l] == p.target_sparsity;
    if (same) return false;
    SPIN_RETURN_IF_ERROR(WriteSessionBudgets(s, uniform));
    return true;
  }
  return false;
}

BudgetProbe::BudgetProbe(SessionManager* sessions, std::chrono::milliseconds interval,
                         std::chrono::milliseconds miss_target_interval,
                         std::function<void(Session&)> publish,
                         std::function<void(const char*, const std::string&)> log)
    : sessions_(sessions),
      interval_(interval),
      miss_target_interval_(miss_target_interval),
      publish_(std::move(publish)),
      log_(std::move(log)) {}

BudgetProbe::~BudgetProbe() { Stop(); }

void BudgetProbe::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void BudgetProbe::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void SaveUnsavedWarmCurves(Session& s) {
  if (!s.warm_unsaved || !s.warm || s.model.empty() || s.budgets == nullptr) return;
  s.warm->Save(s.model, s.geometry, s.budgets->smoothed(), s.budgets->num_blocks());
  s.warm_unsaved = false;
}

bool IsLevelRecompute(const std::string& reason) {
  return absl::StartsWith(reason, "miss ") || absl::StartsWith(reason, "slack ");
}

void ReportBudgets(Session& s, std::chrono::steady_clock::time_point now,
                   const std::function<void(Session&)>& publish,
                   const std::function<void(const char*, const std::string&)>& log) {
  publish(s);
  const bool level = IsLevelRecompute(s.budget_reason);
  if (level && s.level_logged && now - *s.level_logged < kLevelLogInterval) {
    s.level_unlogged += 1;
    return;
  }
  std::string line = absl::StrCat("session ", s.id, ": per-layer budgets recomputed (",
                                  s.budget_reason, "), recompute ", s.budget_recomputes);
  if (level) {
    if (s.level_unlogged > 0) {
      absl::StrAppend(&line, "; ", s.level_unlogged,
                      " level recomputes since the last such line not logged");
    }
    s.level_logged = now;
    s.level_unlogged = 0;
  }
  log("info", line);
}

void RefreshAndReport(Session& s, const std::function<void(Session&)>& publish,
                      const std::function<void(const char*, const std::string&)>& log) {
  absl::StatusOr<bool> written = RefreshBudgets(s, false);
  if (!written.ok()) {
    log("error", absl::StrCat("budgets of session ", s.id, ": ", written.status().message()));
  } else if (*written) {
    ReportBudgets(s, std::chrono::steady_clock::now(), publish, log);
  }
}

void BudgetProbe::Loop() {
  using Clock = std::chrono::steady_clock;
  // Every pass at the shorter interval: miss-target sessions are read each pass, the others
  // once their interval has passed (a pass costs a list and a try-lock per session).
  const std::chrono::milliseconds wait = std::min(miss_target_interval_, interval_);
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, wait, [this] { return stop_; })) {
    lock.unlock();
    for (const std::shared_ptr<Session>& s : sessions_->List()) {
      // A session busy with a call is visited at the next pass: the thread never waits on one
      // session while the others' budgets are due.
      std::unique_lock<std::mutex> session_lock(s->mu, std::try_to_lock);
      if (!session_lock.owns_lock() || s->freed) continue;
      // A remote session (one that began a step through PredictMasks; remote_rows is under mu,
      // unlike the drive mode) is refreshed as each of its steps begins, after every layer of
      // the last one: a read here could fall between two layers of a step.
      if (s->remote_rows > 0) continue;
      const bool miss_target = s->policy.budget_mode == BudgetMode::kMissTarget;
      const Clock::time_point now = Clock::now();
      // Other sessions every interval_ (a pass may come up to `wait` early).
      if (!miss_target && now - s->probe_visited < interval_ - wait) continue;
      s->probe_visited = now;
      RefreshAndReport(*s, publish_, log_);
    }
    lock.lock();
  }
}

}  // namespace spin::service
