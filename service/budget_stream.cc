#include "budget_stream.h"

#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "convert.h"
#include "to_grpc.h"

namespace spin::service {

namespace pb = spin::v1;

pb::GetBudgetsResponse BudgetsOf(const Session& s) {
  pb::GetBudgetsResponse r;
  const ArenaView& v = s.arena->host();
  for (double x : s.budgets_written) r.add_layer_sparsity(x);
  r.set_epoch(v.policy->epoch);
  r.set_budget_mode(ToProto(s.policy).budget_mode());
  r.set_recomputes(s.budget_recomputes);
  r.set_reason(s.budget_reason);
  *r.mutable_policy() = ToProto(s.policy);
  r.set_control_version(s.control_version);
  r.set_engine_control(s.engine_control);
  return r;
}

// One WatchBudgets stream. Holds at most the message being written and the latest one not yet
// written: a reader slower than the updates sees the newest table, never a backlog (the latest
// table is what matters). Reference-counted: gRPC holds one reference until OnDone, and the
// task that sends the first table (on the session's strand) holds another, so a stream that the
// client cancels before that task runs is not deleted under it.
class BudgetWatcher final : public grpc::ServerWriteReactor<pb::GetBudgetsResponse> {
 public:
  explicit BudgetWatcher(BudgetHub* hub) : hub_(hub) {}

  void Ref() { refs_.fetch_add(1); }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }
  /// Set before OnDone leaves the hub: BudgetHub::Add refuses a watcher that is done.
  bool done() const { return done_.load(); }

  void Push(const pb::GetBudgetsResponse& update) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ending_) return;
    if (writing_) {
      next_ = update;  // replaces an older unwritten one
      has_next_ = true;
      return;
    }
    writing_ = true;
    current_ = update;
    StartWrite(&current_);
  }

  void End(const grpc::Status& status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ending_) return;
    ending_ = true;
    end_status_ = status;
    if (!writing_) Finish(status);  // else OnWriteDone finishes
  }

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ok && !ending_) {  // the client went away
      ending_ = true;
      end_status_ = grpc::Status::CANCELLED;
    }
    if (ending_) {
      writing_ = false;
      Finish(end_status_);
      return;
    }
    if (!has_next_) {
      writing_ = false;
    } else {
      current_ = std::move(next_);
      has_next_ = false;
      StartWrite(&current_);
    }
  }

  void OnCancel() override { End(grpc::Status::CANCELLED); }

  void OnDone() override {
    done_.store(true);
    hub_->Remove(this);
    Unref();
  }

 private:
  BudgetHub* hub_;
  std::atomic<int> refs_{1};
  std::atomic<bool> done_{false};
  std::mutex mu_;
  pb::GetBudgetsResponse current_, next_;
  bool has_next_ = false;
  bool writing_ = false, ending_ = false;
  grpc::Status end_status_;
};

bool BudgetHub::Add(const std::string& session, BudgetWatcher* w, size_t max_per_session) {
  std::lock_guard<std::mutex> lock(mu_);
  // A watcher whose OnDone already ran (it sets done before taking this lock to leave) is not
  // added: it would stay here after being deleted.
  if (w->done()) return true;
  if (closed_) {
    w->End(closed_status_);
    return true;
  }
  if (watchers_.count(session) >= max_per_session) return false;
  watchers_.emplace(session, w);
  return true;
}

void BudgetHub::Remove(BudgetWatcher* w) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = watchers_.begin(); it != watchers_.end(); ++it) {
    if (it->second == w) {
      watchers_.erase(it);
      return;
    }
  }
}

void BudgetHub::Notify(const std::string& session, const pb::GetBudgetsResponse& update) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [lo, hi] = watchers_.equal_range(session);
  for (auto it = lo; it != hi; ++it) it->second->Push(update);
}

void BudgetHub::EndAll(const std::string& session, const grpc::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [lo, hi] = watchers_.equal_range(session);
  for (auto it = lo; it != hi; ++it) it->second->End(status);
}

void BudgetHub::Close(const grpc::Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  closed_status_ = status;
  for (auto& [session, w] : watchers_) w->End(status);
}

grpc::ServerWriteReactor<pb::GetBudgetsResponse>* BudgetHub::Watch(
    const absl::StatusOr<std::shared_ptr<Session>>& found, size_t max_per_session,
    size_t max_queued) {
  auto* w = new BudgetWatcher(this);
  if (!found.ok()) {
    w->End(ToGrpc(found.status()));
    return w;
  }
  std::shared_ptr<Session> session = *found;
  w->Ref();  // released when `start` has run (or was not queued)
  auto start = [this, w, session, max_per_session] {
    {
      std::lock_guard<std::mutex> lock(session->mu);
      if (session->freed) {  // freed since Get: its streams were already ended
        w->End(grpc::Status::OK);
      } else if (absl::Status st = session->arena->PullControl(); !st.ok()) {
        w->End(ToGrpc(st));
      } else if (!Add(session->id, w, max_per_session)) {
        // Under the session lock: the first message is queued before any update can be, and a
        // Free (which marks the session under this lock before ending its streams) cannot slip
        // in.
        w->End(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            absl::StrCat("session ", session->id, " already has ", max_per_session,
                                         " WatchBudgets streams open: close one first")));
      } else {
        w->Push(BudgetsOf(*session));
      }
    }
    w->Unref();
  };
  if (!session->strand) {
    start();
  } else if (!session->strand->Post(start, max_queued)) {
    w->End(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        "too many calls queued on this session: retry later"));
    w->Unref();
  }
  return w;
}

}  // namespace spin::service
