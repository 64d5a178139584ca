#include "spin_service.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <vector>

#include "absl/strings/str_cat.h"
#include "budget_probe.h"
#include "convert.h"

namespace spin::service {
namespace {

namespace pb = spin::v1;

using Clock = std::chrono::steady_clock;

pb::Backend BackendProto(Backend b) {
  return b == Backend::kCuda ? pb::BACKEND_CUDA : pb::BACKEND_CPU;
}

// The budget table of a session (caller holds the session's lock and pulled the control
// region).
pb::GetBudgetsResponse Budgets(const Session& s) {
  pb::GetBudgetsResponse r;
  const ArenaView& v = s.arena->host();
  for (uint32_t l = 0; l < v.geometry.layers; ++l) r.add_layer_sparsity(v.sparsity[l]);
  r.set_epoch(v.policy->epoch);
  r.set_budget_mode(ToProto(ReadPolicy(v)).budget_mode());
  r.set_recomputes(s.budget_recomputes);
  r.set_reason(s.budget_reason);
  return r;
}

}  // namespace

// One WatchBudgets stream: writes queued updates one at a time; deletes itself when done.
class BudgetWatcher final : public grpc::ServerWriteReactor<pb::GetBudgetsResponse> {
 public:
  explicit BudgetWatcher(BudgetHub* hub) : hub_(hub) {}

  void Push(const pb::GetBudgetsResponse& update) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ending_) return;
    queue_.push_back(update);
    if (!writing_) {
      writing_ = true;
      StartWrite(&queue_.front());
    }
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
    queue_.pop_front();
    if (!ok && !ending_) {  // the client went away
      ending_ = true;
      end_status_ = grpc::Status::CANCELLED;
    }
    if (ending_) {
      writing_ = false;
      Finish(end_status_);
      return;
    }
    if (queue_.empty()) {
      writing_ = false;
    } else {
      StartWrite(&queue_.front());
    }
  }

  void OnCancel() override { End(grpc::Status::CANCELLED); }

  void OnDone() override {
    hub_->Remove(this);
    delete this;
  }

 private:
  BudgetHub* hub_;
  std::mutex mu_;
  std::deque<pb::GetBudgetsResponse> queue_;
  bool writing_ = false, ending_ = false;
  grpc::Status end_status_;
};

void BudgetHub::Add(const std::string& session, BudgetWatcher* w) {
  std::lock_guard<std::mutex> lock(mu_);
  watchers_.emplace(session, w);
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

grpc::ServerWriteReactor<pb::GetBudgetsResponse>* SpinService::WatchBudgets(
    grpc::CallbackServerContext* ctx, const pb::GetBudgetsRequest* req) {
  auto* w = new BudgetWatcher(&hub_);
  auto s = sessions_->Get(req->session().session_id(), req->session().token());
  if (!s.ok()) {
    w->End(ToGrpc(s.status()));
    return w;
  }
  pb::GetBudgetsResponse first;
  {
    std::lock_guard<std::mutex> lock((*s)->mu);
    if (absl::Status st = (*s)->arena->PullControl(); !st.ok()) {
      w->End(ToGrpc(st));
      return w;
    }
    if ((*s)->freed) {  // freed since Get: its streams were already ended
      w->End(grpc::Status::OK);
      return w;
    }
    first = Budgets(**s);
    // Under the session lock: the first message is queued before any update can be, and a
    // Free (which marks the session under this lock before ending its streams) cannot slip in.
    hub_.Add((*s)->id, w);
    w->Push(first);
  }
  return w;
}

void SpinService::PublishBudgets(const Session& s) { hub_.Notify(s.id, Budgets(s)); }

absl::Status SpinService::CheckAdmin(grpc::CallbackServerContext* ctx) const {
  if (admin_token_.empty() || ctx->peer().rfind("unix:", 0) == 0) return absl::OkStatus();
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it != md.end() &&
      std::string(it->second.data(), it->second.size()) == "Bearer " + admin_token_) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      "mutating calls over TCP need spind's admin token: send metadata 'authorization: Bearer "
      "<token>' (spinctl --admin-token-file)");
}

grpc::ServerUnaryReactor* SpinService::Done(grpc::CallbackServerContext* ctx, const char* method,
                                            std::chrono::steady_clock::time_point t0,
                                            const absl::Status& s) {
  const grpc::Status g = ToGrpc(s);
  if (metrics_ != nullptr) {
    metrics_->ObserveRpc(method, g.error_code(),
                         std::chrono::duration<double>(Clock::now() - t0).count());
  }
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(g);
  return r;
}

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

grpc::ServerUnaryReactor* SpinService::Attach(grpc::CallbackServerContext* ctx,
                                              const pb::AttachRequest* req,
                                              pb::AttachResponse* resp) {
  const auto t0 = Clock::now();
  if (absl::Status a = CheckAdmin(ctx); !a.ok()) return Done(ctx, "Attach", t0, a);
  absl::StatusOr<Geometry> g = FromProto(req->geometry());
  if (!g.ok()) return Done(ctx, "Attach", t0, g.status());
  Policy p;  // defaults for what the request leaves at zero
  if (req->has_policy()) {
    p.target_sparsity = req->policy().target_sparsity();
    p.exploration = req->policy().exploration();
    if (req->policy().alpha() != 0.0f) p.alpha = req->policy().alpha();
    p.probe_period = req->policy().probe_period();
    absl::StatusOr<BudgetMode> m = ModeFromProto(req->policy().budget_mode(), p.budget_mode);
    if (!m.ok()) return Done(ctx, "Attach", t0, m.status());
    p.budget_mode = *m;
  }
  absl::StatusOr<std::shared_ptr<Session>> s =
      sessions_->Attach(*g, req->seed(), p, req->client_name());
  if (!s.ok()) return Done(ctx, "Attach", t0, s.status());
  const Session& session = **s;
  resp->set_session_id(session.id);
  resp->set_token(session.token);
  resp->set_backend(BackendProto(session.arena->backend()));
  resp->set_arena_bytes(session.bytes);
  resp->set_device_uuid(session.arena->device_uuid());
  resp->set_arena_header(std::string(reinterpret_cast<const char*>(session.arena->host().header),
                                     sizeof(ArenaHeader)));
  *resp->mutable_policy() = ToProto(p);
  resp->set_fd_socket(fd_socket_);
  return Done(ctx, "Attach", t0, absl::OkStatus());
}

grpc::ServerUnaryReactor* SpinService::Detach(grpc::CallbackServerContext* ctx,
                                              const pb::DetachRequest* req, pb::DetachResponse*) {
  const auto t0 = Clock::now();
  if (absl::Status a = CheckAdmin(ctx); !a.ok()) return Done(ctx, "Detach", t0, a);
  // Open WatchBudgets streams of the session end through the manager's free callback.
  return Done(ctx, "Detach", t0,
              sessions_->Detach(req->session().session_id(), req->session().token()));
}

grpc::ServerUnaryReactor* SpinService::GetPolicy(grpc::CallbackServerContext* ctx,
                                                 const pb::GetPolicyRequest* req,
                                                 pb::GetPolicyResponse* resp) {
  const auto t0 = Clock::now();
  auto s = sessions_->Get(req->session().session_id(), req->session().token());
  if (!s.ok()) return Done(ctx, "GetPolicy", t0, s.status());
  std::lock_guard<std::mutex> lock((*s)->mu);
  ArenaStorage& arena = *(*s)->arena;
  if (absl::Status st = arena.PullControl(); !st.ok()) return Done(ctx, "GetPolicy", t0, st);
  *resp->mutable_policy() = ToProto(ReadPolicy(arena.host()));
  resp->set_epoch(arena.host().policy->epoch);
  return Done(ctx, "GetPolicy", t0, absl::OkStatus());
}

grpc::ServerUnaryReactor* SpinService::SetPolicy(grpc::CallbackServerContext* ctx,
                                                 const pb::SetPolicyRequest* req,
                                                 pb::SetPolicyResponse* resp) {
  const auto t0 = Clock::now();
  if (absl::Status a = CheckAdmin(ctx); !a.ok()) return Done(ctx, "SetPolicy", t0, a);
  auto s = sessions_->Get(req->session().session_id(), req->session().token());
  if (!s.ok()) return Done(ctx, "SetPolicy", t0, s.status());
  std::lock_guard<std::mutex> lock((*s)->mu);
  ArenaStorage& arena = *(*s)->arena;
  if (absl::Status st = arena.PullControl(); !st.ok()) return Done(ctx, "SetPolicy", t0, st);
  Policy p = ReadPolicy(arena.host());
  if (req->has_target_sparsity()) p.target_sparsity = req->target_sparsity();
  if (req->has_exploration()) p.exploration = req->exploration();
  if (req->has_alpha()) p.alpha = req->alpha();
  if (req->has_probe_period()) p.probe_period = req->probe_period();
  absl::StatusOr<BudgetMode> m = ModeFromProto(req->budget_mode(), p.budget_mode);
  if (!m.ok()) return Done(ctx, "SetPolicy", t0, m.status());
  p.budget_mode = *m;
  if (absl::Status st = arena.WritePolicy(p); !st.ok()) return Done(ctx, "SetPolicy", t0, st);
  // Per-layer mode: the allocator re-sizes the table for a new target now, not at the next
  // probe pass, so every change takes effect at the next step.
  // The policy is written: a failure to re-size the budgets (a device error) is logged, and the
  // probe thread retries; the call reports what it changed.
  if (absl::StatusOr<bool> b = RefreshBudgets(**s, true); !b.ok() && log_) {
    log_("error",
         absl::StrCat("session ", (*s)->id, ": budgets after SetPolicy: ", b.status().message()));
  }
  *resp->mutable_policy() = ToProto(p);
  resp->set_epoch(arena.host().policy->epoch);
  hub_.Notify((*s)->id, Budgets(**s));
  return Done(ctx, "SetPolicy", t0, absl::OkStatus());
}

grpc::ServerUnaryReactor* SpinService::GetBudgets(grpc::CallbackServerContext* ctx,
                                                  const pb::GetBudgetsRequest* req,
                                                  pb::GetBudgetsResponse* resp) {
  const auto t0 = Clock::now();
  auto s = sessions_->Get(req->session().session_id(), req->session().token());
  if (!s.ok()) return Done(ctx, "GetBudgets", t0, s.status());
  std::lock_guard<std::mutex> lock((*s)->mu);
  if (absl::Status st = (*s)->arena->PullControl(); !st.ok())
    return Done(ctx, "GetBudgets", t0, st);
  *resp = Budgets(**s);
  return Done(ctx, "GetBudgets", t0, absl::OkStatus());
}

grpc::ServerUnaryReactor* SpinService::OpenSequences(grpc::CallbackServerContext* ctx,
                                                     const pb::OpenSequencesRequest* req,
                                                     pb::OpenSequencesResponse*) {
  const auto t0 = Clock::now();
  if (absl::Status a = CheckAdmin(ctx); !a.ok()) return Done(ctx, "OpenSequences", t0, a);
  auto s = sessions_->Get(req->session().session_id(), req->session().token());
  if (!s.ok()) return Done(ctx, "OpenSequences", t0, s.status());
  std::lock_guard<std::mutex> lock((*s)->mu);
  const uint32_t max = (*s)->geometry.max_seqs;
  for (const pb::SequenceOpen& o : req->sequences()) {
    if (o.sequence() < 0 || static_cast<uint32_t>(o.sequence()) >= max) {
      return Done(ctx, "OpenSequences", t0,
                  absl::OutOfRangeError(
                      absl::StrCat("sequence ", o.sequence(), " is out of range [0, ", max, ")")));
    }
  }
  for (const pb::SequenceOpen& o : req->sequences()) {
    if (absl::Status st = (*s)->arena->ResetSequence(o.sequence(), o.key()); !st.ok()) {
      return Done(ctx, "OpenSequences", t0, st);
    }
  }
  return Done(ctx, "OpenSequences", t0, absl::OkStatus());
}

grpc::ServerUnaryReactor* SpinService::PredictMasks(grpc::CallbackServerContext* ctx,
                                                    const pb::PredictMasksRequest* req,
                                                    pb::PredictMasksResponse* resp) {
  const auto t0 = Clock::now();
  if (absl::Status a = CheckAdmin(ctx); !a.ok()) return Done(ctx, "PredictMasks", t0, a);
  auto s = sessions_->Get(req->session().session_id(), req->session().token());
  if (!s.ok()) return Done(ctx, "PredictMasks", t0, s.status());
  Session& session = **s;
  std::lock_guard<std::mutex> lock(session.mu);
  if (req->begin_step()) {
    if (static_cast<uint32_t>(req->entries_size()) > session.geometry.max_seqs) {
      return Done(ctx, "PredictMasks", t0,
                  absl::InvalidArgumentError(absl::StrCat(
                      req->entries_size(), " entries exceed the session's max_sequences ",
                      session.geometry.max_seqs)));
    }
    std::vector<int32_t> seq, ctx_len, q_pos;
    for (const pb::StepEntry& e : req->entries()) {
      seq.push_back(e.sequence());
      ctx_len.push_back(e.ctx_len());
      q_pos.push_back(e.q_pos());
    }
    const StepBatch batch{seq.data(), ctx_len.data(), q_pos.data(),
                          static_cast<int32_t>(seq.size()), static_cast<int32_t>(req->rows())};
    if (absl::Status st = session.arena->BeginStep(batch); !st.ok())
      return Done(ctx, "PredictMasks", t0, st);
  }
  if (absl::Status st = session.arena->Select(req->layer()); !st.ok())
    return Done(ctx, "PredictMasks", t0, st);
  if (absl::Status st = session.arena->PullOutputs(); !st.ok())
    return Done(ctx, "PredictMasks", t0, st);
  const ArenaView& v = session.arena->host();
  const int32_t n = v.batch->n, rows = v.batch->rows;
  for (int32_t e = 0; e < n; ++e) {
    pb::EntryMask* m = resp->add_masks();
    const int32_t* ids = v.union_ids + static_cast<int64_t>(e) * v.max_blocks;
    m->mutable_blocks()->Add(ids, ids + v.union_count[e]);
    const int32_t* clen = v.compact_len + static_cast<int64_t>(e) * v.geometry.max_rows;
    m->mutable_compact_len()->Add(clen, clen + rows);
  }
  return Done(ctx, "PredictMasks", t0, absl::OkStatus());
}

grpc::ServerUnaryReactor* SpinService::ObserveScores(grpc::CallbackServerContext* ctx,
                                                     const pb::ObserveScoresRequest* req,
                                                     pb::ObserveScoresResponse* resp) {
  const auto t0 = Clock::now();
  if (absl::Status a = CheckAdmin(ctx); !a.ok()) return Done(ctx, "ObserveScores", t0, a);
  auto s = sessions_->Get(req->session().session_id(), req->session().token());
  if (!s.ok()) return Done(ctx, "ObserveScores", t0, s.status());
  Session& session = **s;
  std::lock_guard<std::mutex> lock(session.mu);
  ArenaStorage& arena = *session.arena;
  absl::Status pulled = arena.PullOutputs();
  if (pulled.ok()) pulled = arena.PullControl();
  if (!pulled.ok()) return Done(ctx, "ObserveScores", t0, pulled);
  const ArenaView& v = arena.host();
  const int32_t n = v.batch->n, rows = v.batch->rows;
  if (req->scores_size() != n * rows) {
    return Done(ctx, "ObserveScores", t0,
                absl::InvalidArgumentError(absl::StrCat("scores has ", req->scores_size(),
                                                        " rows; the step has ", n, " entries x ",
                                                        rows, " rows")));
  }
  if (req->accepted_size() != 0 && req->accepted_size() != n) {
    return Done(ctx, "ObserveScores", t0,
                absl::InvalidArgumentError(absl::StrCat("accepted has ", req->accepted_size(),
                                                        " values for ", n, " entries")));
  }
  int64_t stride = 1;
  for (const pb::RowScores& r : req->scores()) {
    stride = std::max<int64_t>(stride, r.logits_size());
  }
  std::vector<float> logits(static_cast<size_t>(n) * rows * stride, -INFINITY);
  for (int32_t x = 0; x < n * rows; ++x) {
    const pb::RowScores& r = req->scores(x);
    const int32_t need =
        v.batch->selected_layer >= 0
            ? v.compact_len[static_cast<int64_t>(x / rows) * v.geometry.max_rows + x % rows]
            : 0;
    if (v.entries[x / rows].seq >= 0 && r.logits_size() < need) {
      return Done(ctx, "ObserveScores", t0,
                  absl::InvalidArgumentError(
                      absl::StrCat("scores of entry ", x / rows, " row ", x % rows, " have ",
                                   r.logits_size(), " values; its compacted length is ", need)));
    }
    std::copy(r.logits().begin(), r.logits().end(), logits.begin() + x * stride);
  }
  std::vector<int32_t> accepted(req->accepted().begin(), req->accepted().end());
  const uint64_t bad_before = [&] {
    uint64_t b = 0;
    for (uint32_t l = 0; l < v.geometry.layers; ++l) b += v.stats[l].bad_scores;
    return b;
  }();
  if (absl::Status st = arena.Observe(req->layer(), logits.data(), stride,
                                      accepted.empty() ? nullptr : accepted.data());
      !st.ok()) {
    return Done(ctx, "ObserveScores", t0, st);
  }
  if (absl::Status st = arena.PullControl(); !st.ok()) return Done(ctx, "ObserveScores", t0, st);
  uint64_t bad_after = 0;
  for (uint32_t l = 0; l < v.geometry.layers; ++l) bad_after += v.stats[l].bad_scores;
  resp->set_bad_scores(bad_after - bad_before);
  return Done(ctx, "ObserveScores", t0, absl::OkStatus());
}

grpc::ServerUnaryReactor* SpinService::GetStats(grpc::CallbackServerContext* ctx,
                                                const pb::GetStatsRequest* req,
                                                pb::GetStatsResponse* resp) {
  const auto t0 = Clock::now();
  auto s = sessions_->Get(req->session().session_id(), req->session().token());
  if (!s.ok()) return Done(ctx, "GetStats", t0, s.status());
  std::lock_guard<std::mutex> lock((*s)->mu);
  if (absl::Status st = (*s)->arena->PullControl(); !st.ok()) return Done(ctx, "GetStats", t0, st);
  const ArenaView& v = (*s)->arena->host();
  for (uint32_t l = 0; l < v.geometry.layers; ++l) {
    *resp->add_layers() = ToProto(l, v.stats[l], v.sparsity[l]);
  }
  return Done(ctx, "GetStats", t0, absl::OkStatus());
}

grpc::ServerUnaryReactor* SpinService::ListSessions(grpc::CallbackServerContext* ctx,
                                                    const pb::ListSessionsRequest*,
                                                    pb::ListSessionsResponse* resp) {
  const auto t0 = Clock::now();
  for (const std::shared_ptr<Session>& s : sessions_->List()) {
    pb::SessionInfo* o = resp->add_sessions();
    o->set_session_id(s->id);
    o->set_client_name(s->client_name);
    *o->mutable_geometry() = ToProto(s->geometry);
    o->set_arena_bytes(s->bytes);
    o->set_backend(BackendProto(s->arena->backend()));
    o->set_device_uuid(s->arena->device_uuid());
    o->set_created_unix_seconds(s->created_unix_seconds);
  }
  return Done(ctx, "ListSessions", t0, absl::OkStatus());
}

}  // namespace spin::service
