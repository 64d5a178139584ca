#include "spin_service.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "budget_probe.h"
#include "convert.h"
#include "google/protobuf/arena.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/support/message_allocator.h"
#include "spin/status_macros.h"

namespace spin::service {
namespace {

namespace pb = spin::v1;

using Clock = std::chrono::steady_clock;

pb::Backend BackendProto(Backend b) {
  return b == Backend::kCuda ? pb::BACKEND_CUDA : pb::BACKEND_CPU;
}

// The budget table of a session as spind wrote it, with the arena's epoch (caller holds the
// session's lock and pulled the control region).
std::string PolicyText(const Policy& p) {
  return absl::StrFormat("sparsity %.4g, exploration %.4g, alpha %.4g, probe period %u, %s",
                         p.target_sparsity, p.exploration, p.alpha, p.probe_period,
                         p.budget_mode == BudgetMode::kMissTarget
                             ? absl::StrFormat("miss-target %.4g", p.miss_target)
                             : std::string(BudgetModeName(p.budget_mode)));
}

// The defaults' set fields over `p`.
absl::StatusOr<Policy> WithDefaults(const pb::PolicyDefaults& d, Policy p) {
  if (d.has_target_sparsity()) p.target_sparsity = d.target_sparsity();
  if (d.has_exploration()) p.exploration = d.exploration();
  if (d.has_alpha()) p.alpha = d.alpha();
  if (d.has_probe_period()) p.probe_period = d.probe_period();
  if (d.has_miss_target()) p.miss_target = d.miss_target();
  SPIN_ASSIGN_OR_RETURN(p.budget_mode, ModeFromProto(d.budget_mode(), p.budget_mode));
  return p;
}

// A node default policy whose every set field is in range on its own (checked over the built-in
// policy): what SetDefaultPolicy accepts and RestoreDefaults keeps.
absl::Status ValidateDefaults(const pb::PolicyDefaults& d) {
  absl::StatusOr<Policy> p = WithDefaults(d, Policy{});
  if (!p.ok()) return p.status();
  if (absl::Status v = ValidatePolicy(*p); !v.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("default policy: ", v.message()));
  }
  return absl::OkStatus();
}

pb::GetBudgetsResponse Budgets(const Session& s) {
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

}  // namespace

// Request and response of one call in one protobuf arena of large blocks. gRPC parses a request
// completely before a handler can refuse it, and a few MB of repeated fields become tens of MB
// of small objects; in an arena they live in a few blocks of up to 1 MiB, which glibc maps and
// unmaps as a whole (main() fixes the mmap threshold below that size), so nothing of a refused
// request stays in spind's resident memory.
template <typename Req, typename Resp>
class ArenaMessages final : public grpc::MessageAllocator<Req, Resp> {
 public:
  grpc::MessageHolder<Req, Resp>* AllocateMessages() override { return new Holder(); }

 private:
  class Holder final : public grpc::MessageHolder<Req, Resp> {
   public:
    Holder() : arena_(Options()) {
      this->set_request(google::protobuf::Arena::CreateMessage<Req>(&arena_));
      this->set_response(google::protobuf::Arena::CreateMessage<Resp>(&arena_));
    }
    void Release() override { delete this; }

   private:
    static google::protobuf::ArenaOptions Options() {
      google::protobuf::ArenaOptions o;
      o.start_block_size = 4096;
      o.max_block_size = 1 << 20;
      return o;
    }
    google::protobuf::Arena arena_;
  };
};

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

void SpinService::Drain() {
  hub_.Close(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "spind is stopping: attach again to the spind that replaces it"));
}

SpinService::SpinService(SessionManager* sessions, std::string fd_socket, Metrics* metrics,
                         ServiceOptions options)
    : sessions_(sessions),
      fd_socket_(std::move(fd_socket)),
      metrics_(metrics),
      options_(std::move(options)),
      executor_(options_.workers) {
  sessions_->SetExecutor(&executor_);
  // The calls whose requests carry repeated fields a client sizes.
  static ArenaMessages<pb::ObserveScoresRequest, pb::ObserveScoresResponse> observe_messages;
  static ArenaMessages<pb::PredictMasksRequest, pb::PredictMasksResponse> predict_messages;
  static ArenaMessages<pb::OpenSequencesRequest, pb::OpenSequencesResponse> open_messages;
  static ArenaMessages<pb::AttachRequest, pb::AttachResponse> attach_messages;
  SetMessageAllocatorFor_ObserveScores(&observe_messages);
  SetMessageAllocatorFor_PredictMasks(&predict_messages);
  SetMessageAllocatorFor_OpenSequences(&open_messages);
  SetMessageAllocatorFor_Attach(&attach_messages);
  // A freed session (Detach, or its lease lapsed) ends its budget streams.
  sessions_->SetOnFree([this](const std::string& id) { hub_.EndAll(id, grpc::Status::OK); });
}

SpinService::~SpinService() {
  sessions_->SetOnFree(nullptr);
  sessions_->SetExecutor(nullptr);
}

grpc::ServerWriteReactor<pb::GetBudgetsResponse>* SpinService::WatchBudgets(
    grpc::CallbackServerContext* ctx, const pb::GetBudgetsRequest* req) {
  auto* w = new BudgetWatcher(&hub_);
  auto s = sessions_->Get(req->session().session_id(), req->session().token());
  if (!s.ok()) {
    w->End(ToGrpc(s.status()));
    return w;
  }
  std::shared_ptr<Session> session = *s;
  w->Ref();  // released when `start` has run (or was not queued)
  auto start = [this, w, session] {
    {
      std::lock_guard<std::mutex> lock(session->mu);
      if (session->freed) {  // freed since Get: its streams were already ended
        w->End(grpc::Status::OK);
      } else if (absl::Status st = session->arena->PullControl(); !st.ok()) {
        w->End(ToGrpc(st));
      } else if (!hub_.Add(session->id, w, options_.max_watchers_per_session)) {
        // Under the session lock: the first message is queued before any update can be, and a
        // Free (which marks the session under this lock before ending its streams) cannot slip
        // in.
        w->End(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            absl::StrCat("session ", session->id, " already has ",
                                         options_.max_watchers_per_session,
                                         " WatchBudgets streams open: close one first")));
      } else {
        w->Push(Budgets(*session));
      }
    }
    w->Unref();
  };
  if (!session->strand) {
    start();
  } else if (!session->strand->Post(start, options_.max_queued_per_session)) {
    w->End(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        "too many calls queued on this session: retry later"));
    w->Unref();
  }
  return w;
}

void SpinService::PublishBudgets(const Session& s) { hub_.Notify(s.id, Budgets(s)); }

bool SpinService::HasAdminToken(grpc::CallbackServerContext* ctx) const {
  if (options_.admin_token.empty()) return false;
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  return it != md.end() &&
         ConstantTimeEquals(std::string_view(it->second.data(), it->second.size()),
                            "Bearer " + options_.admin_token);
}

absl::Status SpinService::CheckAdmin(grpc::CallbackServerContext* ctx) const {
  if (ctx->peer().rfind("unix:", 0) == 0) return absl::OkStatus();
  if (options_.admin_token.empty()) {
    if (options_.allow_unauthenticated_tcp) return absl::OkStatus();
    return absl::PermissionDeniedError(
        "state-changing calls over TCP are refused: spind has no admin token. Start it with "
        "--admin-token-file (and send 'authorization: Bearer <token>'), use the Unix socket, or "
        "accept the risk with --tcp-allow-unauthenticated");
  }
  if (HasAdminToken(ctx)) return absl::OkStatus();
  return absl::PermissionDeniedError(
      "state-changing calls over TCP need spind's admin token: send metadata 'authorization: "
      "Bearer <token>' (spinctl --admin-token-file)");
}

absl::Status SpinService::CheckOperator(grpc::CallbackServerContext* ctx) const {
  if (ctx->peer().rfind("unix:", 0) != 0) return CheckAdmin(ctx);
  if (!options_.unix_operators_need_token || HasAdminToken(ctx)) return absl::OkStatus();
  return absl::PermissionDeniedError(
      "operator calls (a session by id without its token, the node default policy, the session "
      "list) need spind's admin token on this node, on the Unix socket too (spind --operators "
      "token): send 'authorization: Bearer <token>' (spinctl --admin-token-file FILE)");
}

void SpinService::Finish(grpc::ServerUnaryReactor* reactor, const char* method,
                         std::chrono::steady_clock::time_point t0, const absl::Status& s) {
  const grpc::Status g = ToGrpc(s);
  if (metrics_ != nullptr) {
    metrics_->ObserveRpc(method, g.error_code(),
                         std::chrono::duration<double>(Clock::now() - t0).count());
  }
  reactor->Finish(g);
}

grpc::ServerUnaryReactor* SpinService::Done(grpc::CallbackServerContext* ctx, const char* method,
                                            std::chrono::steady_clock::time_point t0,
                                            const absl::Status& s) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  Finish(r, method, t0, s);
  return r;
}

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

std::string SpinService::Caller(grpc::CallbackServerContext* ctx, bool with_token) const {
  if (with_token) return "the session's engine (session token)";
  const std::string peer = ctx->peer();
  if (peer.rfind("unix:", 0) == 0) {
    return options_.unix_operators_need_token
               ? "an operator with the admin token on the Unix socket"
               : "an operator on the Unix socket";
  }
  return absl::StrCat("an operator with the admin token from ", peer);
}

grpc::ServerUnaryReactor* SpinService::OnSession(
    grpc::CallbackServerContext* ctx, const char* method, const pb::SessionRef& ref, bool mutating,
    bool operator_ok, std::function<absl::Status(Session&, const std::string&)> body) {
  const auto t0 = Clock::now();
  const bool as_operator = operator_ok && ref.token().empty();
  if (as_operator) {
    if (absl::Status a = CheckOperator(ctx); !a.ok()) {
      if (!mutating && ctx->peer().rfind("unix:", 0) != 0) {
        a = absl::PermissionDeniedError(absl::StrCat(
            "reading a session without its token is for operators: use the Unix socket, or send "
            "spind's admin token over TCP (",
            a.message(), ")"));
      }
      return Done(ctx, method, t0, a);
    }
  } else if (mutating) {
    if (absl::Status a = CheckAdmin(ctx); !a.ok()) return Done(ctx, method, t0, a);
  }
  auto s = as_operator ? sessions_->Find(ref.session_id())
                       : sessions_->Get(ref.session_id(), ref.token());
  if (!s.ok()) return Done(ctx, method, t0, s.status());
  std::shared_ptr<Session> session = *s;
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  // Only the calls an operator may make log who made them (not the remote data-plane calls).
  auto run = [this, reactor, method, t0, session,
              who = operator_ok ? Caller(ctx, !as_operator) : std::string(),
              body = std::move(body)] {
    absl::Status st;
    {
      std::lock_guard<std::mutex> lock(session->mu);
      st = session->freed ? absl::NotFoundError(absl::StrCat("session '", session->id,
                                                             "' was detached during the call"))
                          : body(*session, who);
    }
    Finish(reactor, method, t0, st);
  };
  if (!session->strand) {
    run();
  } else if (!session->strand->Post(run, options_.max_queued_per_session)) {
    Finish(reactor, method, t0,
           absl::ResourceExhaustedError(absl::StrCat(options_.max_queued_per_session,
                                                     " calls already wait on session ", session->id,
                                                     ": retry later")));
  }
  return reactor;
}

grpc::ServerUnaryReactor* SpinService::Attach(grpc::CallbackServerContext* ctx,
                                              const pb::AttachRequest* req,
                                              pb::AttachResponse* resp) {
  const auto t0 = Clock::now();
  if (absl::Status a = CheckAdmin(ctx); !a.ok()) return Done(ctx, "Attach", t0, a);
  absl::StatusOr<Geometry> g = FromProto(req->geometry());
  if (!g.ok()) return Done(ctx, "Attach", t0, g.status());
  if (req->client_name().size() > kMaxClientName) {
    return Done(
        ctx, "Attach", t0,
        absl::InvalidArgumentError(absl::StrCat("client_name has ", req->client_name().size(),
                                                " bytes; the limit is ", kMaxClientName)));
  }
  for (size_t i = 0; i < req->client_name().size(); ++i) {
    const unsigned char ch = static_cast<unsigned char>(req->client_name()[i]);
    if (ch < 0x20 || ch == 0x7f) {
      return Done(ctx, "Attach", t0,
                  absl::InvalidArgumentError(absl::StrCat(
                      "client_name has a control character (byte ", static_cast<int>(ch),
                      ") at offset ", i, ": use printable text")));
    }
  }
  Policy p;  // defaults when the request has no policy
  if (req->has_policy()) {
    absl::StatusOr<Policy> from = FromProto(req->policy());
    if (!from.ok()) return Done(ctx, "Attach", t0, from.status());
    p = *from;
  }
  if (absl::Status v = ValidatePolicy(p); !v.ok()) return Done(ctx, "Attach", t0, v);
  if (!req->model().empty()) {
    if (absl::Status v = ValidateModelName(req->model()); !v.ok()) {
      return Done(ctx, "Attach", t0, v);
    }
  }
  const Policy requested = p;  // the engine's, before the node defaults
  uint64_t generation = 0;
  {
    // The node-wide default policy's set fields override the engine's (SetDefaultPolicy).
    std::lock_guard<std::mutex> lock(defaults_mu_);
    generation = defaults_generation_;
    absl::StatusOr<Policy> with = WithDefaults(defaults_, p);
    absl::Status v = with.ok() ? ValidatePolicy(*with) : with.status();
    if (!v.ok()) {
      return Done(ctx, "Attach", t0,
                  absl::InvalidArgumentError(
                      absl::StrCat("the node's default policy over this attach's: ", v.message(),
                                   " (spinctl policy defaults)")));
    }
    p = *with;
  }
  // The arena is allocated and initialised on a worker: a large one takes a while, and the
  // threads that serve every other caller must not wait for it.
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  executor_.Post([this, reactor, req, resp, t0, g = *g, p, requested, generation] {
    absl::StatusOr<std::shared_ptr<Session>> s =
        sessions_->Attach(g, req->seed(), p, req->client_name(), req->engine_control());
    absl::Status st = s.status();
    if (s.ok()) CatchUpDefaults(**s, requested, generation);
    if (s.ok()) StartWarm(**s, req->model());
    if (s.ok()) {
      const Session& session = **s;
      resp->set_session_id(session.id);
      resp->set_token(session.token);
      resp->set_backend(BackendProto(session.arena->backend()));
      resp->set_arena_bytes(session.bytes);
      resp->set_device_uuid(session.arena->device_uuid());
      ArenaHeader header{};
      if (absl::StatusOr<ArenaHeader> h = MakeArenaHeader(g, req->seed()); h.ok()) header = *h;
      resp->set_arena_header(
          std::string(reinterpret_cast<const char*>(&header), sizeof(ArenaHeader)));
      {
        std::lock_guard<std::mutex> lock((*s)->mu);
        *resp->mutable_policy() = ToProto((*s)->policy);  // after CatchUpDefaults
      }
      resp->set_fd_socket(fd_socket_);
    }
    Finish(reactor, "Attach", t0, st);
  });
  return reactor;
}

grpc::ServerUnaryReactor* SpinService::Detach(grpc::CallbackServerContext* ctx,
                                              const pb::DetachRequest* req, pb::DetachResponse*) {
  const auto t0 = Clock::now();
  if (absl::Status a = CheckAdmin(ctx); !a.ok()) return Done(ctx, "Detach", t0, a);
  auto s = sessions_->Get(req->session().session_id(), req->session().token());
  if (!s.ok()) return Done(ctx, "Detach", t0, s.status());
  // Freeing waits for the session's call in progress: on a worker, after the calls queued on
  // the session. Open WatchBudgets streams end through the manager's free callback.
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::shared_ptr<Session> session = *s;
  auto run = [this, reactor, session, t0] {
    sessions_->Free(session->id);
    Finish(reactor, "Detach", t0, absl::OkStatus());
  };
  // Detach is never refused for a full queue: it goes to the pool when the strand is full.
  if (!session->strand || !session->strand->Post(run, options_.max_queued_per_session)) {
    executor_.Post(run);
  }
  return reactor;
}

grpc::ServerUnaryReactor* SpinService::KeepAlive(grpc::CallbackServerContext* ctx,
                                                 const pb::KeepAliveRequest* req,
                                                 pb::KeepAliveResponse* resp) {
  const auto t0 = Clock::now();
  auto s = sessions_->Get(req->session().session_id(), req->session().token());  // renews
  if (!s.ok()) return Done(ctx, "KeepAlive", t0, s.status());
  resp->set_grace_ms(static_cast<uint64_t>(sessions_->limits().grace.count()));
  return Done(ctx, "KeepAlive", t0, absl::OkStatus());
}

grpc::ServerUnaryReactor* SpinService::GetPolicy(grpc::CallbackServerContext* ctx,
                                                 const pb::GetPolicyRequest* req,
                                                 pb::GetPolicyResponse* resp) {
  return OnSession(ctx, "GetPolicy", req->session(), false, true,
                   [resp](Session& s, const std::string&) {
                     SPIN_RETURN_IF_ERROR(s.arena->PullControl());
                     *resp->mutable_policy() = ToProto(s.policy);
                     resp->set_epoch(s.arena->host().policy->epoch);
                     return absl::OkStatus();
                   });
}

grpc::ServerUnaryReactor* SpinService::SetPolicy(grpc::CallbackServerContext* ctx,
                                                 const pb::SetPolicyRequest* req,
                                                 pb::SetPolicyResponse* resp) {
  return OnSession(
      ctx, "SetPolicy", req->session(), true, true,
      [this, req, resp](Session& s, const std::string& who) {
        ArenaStorage& arena = *s.arena;
        SPIN_RETURN_IF_ERROR(arena.PullControl());
        Policy p = s.policy;
        if (req->has_target_sparsity()) p.target_sparsity = req->target_sparsity();
        if (req->has_exploration()) p.exploration = req->exploration();
        if (req->has_alpha()) p.alpha = req->alpha();
        if (req->has_probe_period()) p.probe_period = req->probe_period();
        if (req->has_miss_target()) p.miss_target = req->miss_target();
        SPIN_ASSIGN_OR_RETURN(BudgetMode m, ModeFromProto(req->budget_mode(), p.budget_mode));
        p.budget_mode = m;
        SPIN_RETURN_IF_ERROR(
            ChangePolicy(s, p, who, req->session().token().empty() ? "operator" : "session"));
        *resp->mutable_policy() = ToProto(p);
        resp->set_epoch(arena.host().policy->epoch);
        return absl::OkStatus();
      });
}

void SpinService::CatchUpDefaults(Session& s, const Policy& requested, uint64_t generation) {
  pb::PolicyDefaults now;
  {
    std::lock_guard<std::mutex> lock(defaults_mu_);
    if (defaults_generation_ == generation) return;  // the usual case: nothing changed
    now = defaults_;
  }
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.freed) return;
  absl::StatusOr<Policy> p = WithDefaults(now, requested);
  absl::Status st = p.status();
  if (st.ok()) st = ValidatePolicy(*p);
  const Policy& q = s.policy;
  if (st.ok() && p->target_sparsity == q.target_sparsity && p->exploration == q.exploration &&
      p->alpha == q.alpha && p->probe_period == q.probe_period && p->budget_mode == q.budget_mode &&
      p->miss_target == q.miss_target) {
    return;  // already so: SetDefaultPolicy(apply_to_live) found the session listed
  }
  if (st.ok()) st = s.arena->PullControl();
  if (st.ok()) {
    st =
        ChangePolicy(s, *p, "spind (the node default policy changed during the attach)", "default");
  }
  if (!st.ok() && log_) {
    log_("error", absl::StrCat("session ", s.id,
                               ": the node default policy set during its "
                               "attach not applied: ",
                               st.message()));
  }
}

void SpinService::StartWarm(Session& s, const std::string& model) {
  // The file is read before the session's lock is taken: whatever is in --state-dir, the
  // session's other callers (and the reaper, metrics, probe thread) never wait on it.
  bool wanted = false;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.model = model;
    s.warm = options_.warm;
    wanted = !model.empty() && s.warm && s.warm->enabled() && TableFromProbes(s.policy.budget_mode);
  }
  if (!wanted) return;
  std::optional<WarmCurves> w = options_.warm->Load(model, s.geometry);
  if (!w) return;
  std::lock_guard<std::mutex> lock(s.mu);
  // The mode may have changed while the file was read (an operator's SetPolicy).
  if (s.freed || !TableFromProbes(s.policy.budget_mode)) return;
  s.budgets = std::make_unique<BudgetController>(s.geometry);
  absl::StatusOr<BudgetUpdate> u =
      s.budgets->Warm(w->curves, w->num_blocks, s.policy.target_sparsity,
                      s.policy.budget_mode == BudgetMode::kMissTarget ? s.policy.miss_target : 0.0,
                      s.policy.exploration);
  absl::Status st = u.status();
  if (st.ok()) st = WriteSessionBudgets(s, u->sparsity);
  if (!st.ok()) {
    s.budgets.reset();
    if (log_) {
      log_("warning", absl::StrCat("session ", s.id, ": warm budgets of model ", model,
                                   " not used: ", st.message(), "; it starts uniform"));
    }
    return;
  }
  s.budget_recomputes += 1;
  s.budget_reason = absl::StrCat("warm (model ", model, ", saved ", w->saved_unix, ")");
  if (log_) {
    log_("info", absl::StrCat("session ", s.id, " starts with model ", model,
                              "'s per-layer budgets (", s.warm->PathOf(model), ")"));
  }
}

absl::Status SpinService::ChangePolicy(Session& s, const Policy& p, const std::string& who,
                                       const char* source) {
  const Policy before = s.policy;
  SPIN_RETURN_IF_ERROR(WriteSessionPolicy(s, p));
  // Per-layer mode: the allocator re-sizes the table for a new target now, not at the next
  // probe pass, so every change takes effect at the next step. The policy is written: a
  // failure to re-size the budgets (a device error) is logged, and the probe thread retries;
  // the call reports what it changed.
  if (absl::StatusOr<bool> b = RefreshBudgets(s, true); !b.ok() && log_) {
    log_("error",
         absl::StrCat("session ", s.id, ": budgets after SetPolicy: ", b.status().message()));
  }
  if (log_) {
    log_("info", absl::StrCat("session ", s.id, " (", s.client_name, "): policy ",
                              PolicyText(before), " -> ", PolicyText(p), ", by ", who));
  }
  if (metrics_ != nullptr) metrics_->CountPolicyChange(source);
  hub_.Notify(s.id, Budgets(s));
  return absl::OkStatus();
}

void SpinService::RestoreDefaults() {
  const std::string& path = options_.defaults_file;
  if (path.empty()) return;
  auto ignored = [&](const std::string& why) {
    if (log_) {
      log_("warning", absl::StrCat("node default policy in ", path, " ignored: ", why,
                                   "; new sessions keep their own policy until an operator sets "
                                   "the defaults again (spinctl policy set --default ...)"));
    }
  };
  // A regular file of at most kMaxDefaultsFileBytes: a FIFO, a device or a symlink there can
  // neither hang start-up nor make spind read without bound.
  absl::StatusOr<std::string> text = ReadStateFile(path, kMaxDefaultsFileBytes);
  if (absl::IsNotFound(text.status())) return;  // none kept yet
  if (!text.ok()) return ignored(std::string(text.status().message()));
  pb::PolicyDefaults d;
  if (const auto st = google::protobuf::util::JsonStringToMessage(*text, &d); !st.ok()) {
    return ignored(absl::StrCat("not a spin.v1.PolicyDefaults in JSON (", st.ToString(), ")"));
  }
  if (absl::Status v = ValidateDefaults(d); !v.ok()) return ignored(std::string(v.message()));
  {
    std::lock_guard<std::mutex> lock(defaults_mu_);
    defaults_ = d;
  }
  if (log_) {
    log_("info", absl::StrCat("node default policy {", d.ShortDebugString(), "} from ", path));
  }
}

grpc::ServerUnaryReactor* SpinService::SetDefaultPolicy(grpc::CallbackServerContext* ctx,
                                                        const pb::SetDefaultPolicyRequest* req,
                                                        pb::SetDefaultPolicyResponse* resp) {
  const auto t0 = Clock::now();
  if (absl::Status a = CheckOperator(ctx); !a.ok()) return Done(ctx, "SetDefaultPolicy", t0, a);
  pb::PolicyDefaults next;
  {
    std::lock_guard<std::mutex> lock(defaults_mu_);
    next = defaults_;
  }
  if (req->clear()) next.Clear();
  next.MergeFrom(req->defaults());  // set fields replace; an unspecified mode keeps the old
  if (absl::Status v = ValidateDefaults(next); !v.ok()) {
    return Done(ctx, "SetDefaultPolicy", t0, v);
  }
  const bool changes = req->clear() || req->defaults().ByteSizeLong() > 0;
  {
    std::lock_guard<std::mutex> lock(defaults_mu_);
    defaults_ = next;
    if (changes) ++defaults_generation_;  // attaches in flight catch up (CatchUpDefaults)
    if (changes && !options_.defaults_file.empty()) {
      // The change holds either way; a node that cannot keep it says so.
      std::string json;
      google::protobuf::util::JsonPrintOptions opts;
      opts.add_whitespace = true;
      absl::Status k = google::protobuf::util::MessageToJsonString(next, &json, opts).ok()
                           ? WriteFileAtomically(options_.defaults_file, json)
                           : absl::InternalError("cannot print the defaults as JSON");
      if (!k.ok() && log_) {
        log_("error", absl::StrCat("the node default policy holds until spind stops: ", k.message(),
                                   " (check --state-dir's space and permissions)"));
      }
    }
  }
  const std::string who = Caller(ctx, false);
  if (changes && log_) {
    log_("info", absl::StrCat("default policy now {", next.ShortDebugString(), "}, by ", who));
  }
  *resp->mutable_defaults() = next;
  if (req->apply_to_live()) {
    for (const std::shared_ptr<Session>& s : sessions_->List()) {
      std::lock_guard<std::mutex> lock(s->mu);
      if (s->freed) continue;
      absl::StatusOr<Policy> p = WithDefaults(next, s->policy);
      absl::Status st = p.status();
      if (st.ok()) st = ValidatePolicy(*p);
      if (st.ok()) st = s->arena->PullControl();
      if (st.ok()) st = ChangePolicy(*s, *p, who + " (default policy, all sessions)", "default");
      if (!st.ok()) {
        // One session's failure (a device error) does not stop the others; it is logged.
        if (log_) {
          log_("error",
               absl::StrCat("session ", s->id, ": default policy not applied: ", st.message()));
        }
        continue;
      }
      resp->add_changed_sessions(s->id);
    }
  }
  return Done(ctx, "SetDefaultPolicy", t0, absl::OkStatus());
}

grpc::ServerUnaryReactor* SpinService::GetBudgets(grpc::CallbackServerContext* ctx,
                                                  const pb::GetBudgetsRequest* req,
                                                  pb::GetBudgetsResponse* resp) {
  return OnSession(ctx, "GetBudgets", req->session(), false, true,
                   [resp](Session& s, const std::string&) {
                     SPIN_RETURN_IF_ERROR(s.arena->PullControl());
                     *resp = Budgets(s);
                     return absl::OkStatus();
                   });
}

grpc::ServerUnaryReactor* SpinService::OpenSequences(grpc::CallbackServerContext* ctx,
                                                     const pb::OpenSequencesRequest* req,
                                                     pb::OpenSequencesResponse*) {
  return OnSession(ctx, "OpenSequences", req->session(), true, [this, req](Session& s) {
    SPIN_RETURN_IF_ERROR(sessions_->CheckBind(s, DriveMode::kRemote));
    const uint32_t max = s.geometry.max_seqs;
    if (static_cast<uint64_t>(req->sequences_size()) > max) {
      return absl::InvalidArgumentError(absl::StrCat(
          req->sequences_size(), " sequences exceed the session's max_sequences ", max));
    }
    std::vector<uint8_t> seen(max, 0);
    for (const pb::SequenceOpen& o : req->sequences()) {
      if (o.sequence() < 0 || static_cast<uint32_t>(o.sequence()) >= max) {
        return absl::OutOfRangeError(
            absl::StrCat("sequence ", o.sequence(), " is out of range [0, ", max, ")"));
      }
      if (seen[o.sequence()]++) {
        return absl::InvalidArgumentError(
            absl::StrCat("sequence ", o.sequence(), " appears twice in the request"));
      }
    }
    SPIN_RETURN_IF_ERROR(sessions_->Bind(s, DriveMode::kRemote));
    for (const pb::SequenceOpen& o : req->sequences()) {
      SPIN_RETURN_IF_ERROR(s.arena->ResetSequence(o.sequence(), o.key()));
    }
    return absl::OkStatus();
  });
}

namespace {

// Remote mode: the current step's outputs as read back from the arena, checked against the
// step spind began and the session's geometry before any of them is used as a size or index.
absl::Status CheckRemoteOutputs(const Session& s) {
  const ArenaView& v = s.arena->host();
  const Geometry& g = s.geometry;
  if (v.batch->n != s.remote_n || v.batch->rows != s.remote_rows) {
    return absl::InternalError(absl::StrCat("session ", s.id, ": the arena's step (", v.batch->n,
                                            " entries x ", v.batch->rows,
                                            " rows) is not the one spind began (", s.remote_n,
                                            " x ", s.remote_rows, "); detach and attach again"));
  }
  const int64_t max_len = static_cast<int64_t>(v.max_blocks) * g.block_size;
  for (int32_t e = 0; e < s.remote_n; ++e) {
    const int64_t count = v.union_count[e];
    if (count < 0 || count > v.max_blocks) {
      return absl::InternalError(absl::StrCat("session ", s.id, ": entry ", e, " has ", count,
                                              " selected blocks, outside [0, ", v.max_blocks,
                                              "]; detach and attach again"));
    }
    const int32_t* ids = v.union_ids + static_cast<int64_t>(e) * v.max_blocks;
    for (int64_t k = 0; k < count; ++k) {
      if (ids[k] < 0 || static_cast<uint32_t>(ids[k]) >= v.max_blocks) {
        return absl::InternalError(absl::StrCat("session ", s.id, ": entry ", e, " selects block ",
                                                ids[k], ", outside [0, ", v.max_blocks,
                                                "); detach and attach again"));
      }
    }
    for (int32_t r = 0; r < s.remote_rows; ++r) {
      const int64_t len = v.compact_len[static_cast<int64_t>(e) * g.max_rows + r];
      if (len < 0 || len > max_len) {
        return absl::InternalError(absl::StrCat("session ", s.id, ": entry ", e, " row ", r,
                                                " has compacted length ", len, ", outside [0, ",
                                                max_len, "]; detach and attach again"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

grpc::ServerUnaryReactor* SpinService::PredictMasks(grpc::CallbackServerContext* ctx,
                                                    const pb::PredictMasksRequest* req,
                                                    pb::PredictMasksResponse* resp) {
  return OnSession(ctx, "PredictMasks", req->session(), true, [this, req, resp](Session& s) {
    SPIN_RETURN_IF_ERROR(sessions_->CheckBind(s, DriveMode::kRemote));
    const Geometry& g = s.geometry;
    if (req->layer() < 0 || static_cast<uint32_t>(req->layer()) >= g.layers) {
      return absl::OutOfRangeError(
          absl::StrCat("layer ", req->layer(), " is out of range [0, ", g.layers, ")"));
    }
    if (req->begin_step()) {
      if (static_cast<uint64_t>(req->entries_size()) > g.max_seqs) {
        return absl::InvalidArgumentError(absl::StrCat(
            req->entries_size(), " entries exceed the session's max_sequences ", g.max_seqs));
      }
      if (req->rows() < 1 || req->rows() > g.max_rows) {
        return absl::InvalidArgumentError(
            absl::StrCat("rows ", req->rows(), " is out of range [1, ", g.max_rows, "]"));
      }
    } else if (s.remote_rows == 0) {
      return absl::FailedPreconditionError(
          "PredictMasks without begin_step needs a step begun earlier: set begin_step on the "
          "step's first call");
    }
    std::vector<int32_t> seq, ctx_len, q_pos;
    if (req->begin_step()) {
      seq.reserve(req->entries_size());
      ctx_len.reserve(req->entries_size());
      q_pos.reserve(req->entries_size());
      for (const pb::StepEntry& e : req->entries()) {
        seq.push_back(e.sequence());
        ctx_len.push_back(e.ctx_len());
        q_pos.push_back(e.q_pos());
      }
    }
    const StepBatch batch{seq.data(), ctx_len.data(), q_pos.data(),
                          static_cast<int32_t>(seq.size()), static_cast<int32_t>(req->rows())};
    if (req->begin_step()) {
      // Everything a refused step could trip on is checked before the session is bound to
      // remote mode or its arena touched: a refused call changes nothing.
      SPIN_RETURN_IF_ERROR(s.arena->CheckStep(batch));
      const uint64_t bytes = RemoteStepMessageBytes(g, batch);
      if (bytes > static_cast<uint64_t>(kMaxMessageBytes)) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "this step's masks or scores could take up to ", bytes, " bytes in one message (",
            batch.n, " entries x ", batch.rows, " rows), over remote mode's ", kMaxMessageBytes,
            "-byte message limit: send fewer entries per step, or map the arena (local mode)"));
      }
    }
    SPIN_RETURN_IF_ERROR(sessions_->Bind(s, DriveMode::kRemote));
    if (req->begin_step()) {
      SPIN_RETURN_IF_ERROR(s.arena->BeginStep(batch));
      s.remote_n = batch.n;
      s.remote_rows = batch.rows;
      s.remote_selected = false;
    }
    SPIN_RETURN_IF_ERROR(s.arena->Select(req->layer()));
    SPIN_RETURN_IF_ERROR(s.arena->PullOutputs());
    SPIN_RETURN_IF_ERROR(CheckRemoteOutputs(s));
    s.remote_selected = true;
    const ArenaView& v = s.arena->host();
    for (int32_t e = 0; e < s.remote_n; ++e) {
      pb::EntryMask* m = resp->add_masks();
      const int32_t* ids = v.union_ids + static_cast<int64_t>(e) * v.max_blocks;
      m->mutable_blocks()->Add(ids, ids + v.union_count[e]);
      const int32_t* clen = v.compact_len + static_cast<int64_t>(e) * g.max_rows;
      m->mutable_compact_len()->Add(clen, clen + s.remote_rows);
    }
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SpinService::ObserveScores(grpc::CallbackServerContext* ctx,
                                                     const pb::ObserveScoresRequest* req,
                                                     pb::ObserveScoresResponse* resp) {
  return OnSession(ctx, "ObserveScores", req->session(), true, [this, req, resp](Session& s) {
    SPIN_RETURN_IF_ERROR(sessions_->CheckBind(s, DriveMode::kRemote));
    const Geometry& g = s.geometry;
    if (req->layer() < 0 || static_cast<uint32_t>(req->layer()) >= g.layers) {
      return absl::OutOfRangeError(
          absl::StrCat("layer ", req->layer(), " is out of range [0, ", g.layers, ")"));
    }
    if (!s.remote_selected) {
      return absl::FailedPreconditionError(
          "ObserveScores needs a PredictMasks of the current step first");
    }
    SPIN_RETURN_IF_ERROR(sessions_->Bind(s, DriveMode::kRemote));
    ArenaStorage& arena = *s.arena;
    absl::Status pulled = arena.PullOutputs();
    if (pulled.ok()) pulled = arena.PullControl();
    SPIN_RETURN_IF_ERROR(pulled);
    SPIN_RETURN_IF_ERROR(CheckRemoteOutputs(s));
    const ArenaView& v = arena.host();
    // Everything below is sized from spind's own copy of the step and the compacted lengths
    // it checked, never from the request: the request is checked against them first.
    const int64_t n = s.remote_n, rows = s.remote_rows;
    if (req->scores_size() != n * rows) {
      return absl::InvalidArgumentError(absl::StrCat("scores has ", req->scores_size(),
                                                     " rows; the step has ", n, " entries x ", rows,
                                                     " rows"));
    }
    if (req->accepted_size() != 0 && req->accepted_size() != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("accepted has ", req->accepted_size(), " values for ", n, " entries"));
    }
    const int64_t max_len = static_cast<int64_t>(v.max_blocks) * g.block_size;
    int64_t stride = 1;
    for (int64_t x = 0; x < n * rows; ++x) {
      const int64_t have = req->scores(static_cast<int>(x)).logits_size();
      const bool live = v.entries[x / rows].seq >= 0;
      const int64_t need = live ? v.compact_len[(x / rows) * g.max_rows + x % rows] : 0;
      if (have < need) {
        return absl::InvalidArgumentError(absl::StrCat("scores of entry ", x / rows, " row ",
                                                       x % rows, " have ", have,
                                                       " values; its compacted length is ", need));
      }
      if (have > max_len) {
        return absl::InvalidArgumentError(
            absl::StrCat("scores of entry ", x / rows, " row ", x % rows, " have ", have,
                         " values; no compacted row of this session is longer than ", max_len));
      }
      stride = std::max(stride, need);
    }
    if (n * rows * stride > kMaxObserveFloats) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "this step's logits (", n, " entries x ", rows, " rows x ", stride,
          " slots) exceed what remote mode assembles in one call (", kMaxObserveFloats,
          " floats): run the data plane locally (fetch the arena) for steps this large"));
    }
    std::vector<float> logits(static_cast<size_t>(n * rows * stride), -INFINITY);
    for (int64_t x = 0; x < n * rows; ++x) {
      const pb::RowScores& r = req->scores(static_cast<int>(x));
      const int64_t take = std::min<int64_t>(r.logits_size(), stride);
      std::copy(r.logits().begin(), r.logits().begin() + take, logits.begin() + x * stride);
    }
    std::vector<int32_t> accepted(req->accepted().begin(), req->accepted().end());
    auto bad_total = [&v, &g] {
      uint64_t b = 0;
      for (uint32_t l = 0; l < g.layers; ++l) b += v.stats[l].bad_scores;
      return b;
    };
    const uint64_t bad_before = bad_total();
    if (absl::Status st = arena.Observe(req->layer(), logits.data(), stride,
                                        accepted.empty() ? nullptr : accepted.data());
        !st.ok()) {
      return st;
    }
    SPIN_RETURN_IF_ERROR(arena.PullControl());
    resp->set_bad_scores(bad_total() - bad_before);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* SpinService::GetStats(grpc::CallbackServerContext* ctx,
                                                const pb::GetStatsRequest* req,
                                                pb::GetStatsResponse* resp) {
  return OnSession(ctx, "GetStats", req->session(), false, true,
                   [resp](Session& s, const std::string&) {
                     SPIN_RETURN_IF_ERROR(s.arena->PullControl());
                     const ArenaView& v = s.arena->host();
                     for (uint32_t l = 0; l < s.geometry.layers; ++l) {
                       *resp->add_layers() = ToProto(l, v.stats[l], s.budgets_written[l]);
                     }
                     return absl::OkStatus();
                   });
}

grpc::ServerUnaryReactor* SpinService::ListSessions(grpc::CallbackServerContext* ctx,
                                                    const pb::ListSessionsRequest*,
                                                    pb::ListSessionsResponse* resp) {
  const auto t0 = Clock::now();
  // Other tenants' session ids, client names and sizes are for operators.
  if (absl::Status a = CheckOperator(ctx); !a.ok()) return Done(ctx, "ListSessions", t0, a);
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
