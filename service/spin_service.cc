#include "spin_service.h"

#include <chrono>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "budget_probe.h"
#include "convert.h"
#include "google/protobuf/arena.h"
#include "grpcpp/support/message_allocator.h"
#include "remote_steps.h"
#include "spin/status_macros.h"

namespace spin::service {
namespace {

namespace pb = spin::v1;

using Clock = std::chrono::steady_clock;

pb::Backend BackendProto(Backend b) {
  return b == Backend::kCuda ? pb::BACKEND_CUDA : pb::BACKEND_CPU;
}

// A policy as the log shows it.
std::string PolicyText(const Policy& p) {
  return absl::StrFormat("sparsity %.4g, exploration %.4g, alpha %.4g, probe period %u, %s",
                         p.target_sparsity, p.exploration, p.alpha, p.probe_period,
                         p.budget_mode == BudgetMode::kMissTarget
                             ? absl::StrFormat("miss-target %.4g", p.miss_target)
                             : std::string(BudgetModeName(p.budget_mode)));
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
      defaults_(options_.defaults_file),
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
    grpc::CallbackServerContext*, const pb::GetBudgetsRequest* req) {
  return hub_.Watch(sessions_->Get(req->session().session_id(), req->session().token()),
                    options_.max_watchers_per_session, options_.max_queued_per_session);
}

void SpinService::PublishBudgets(const Session& s) { hub_.Notify(s.id, BudgetsOf(s)); }

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
  // The node-wide default policy's set fields override the engine's (SetDefaultPolicy).
  uint64_t generation = 0;
  absl::StatusOr<Policy> with = defaults_.Over(p, &generation);
  if (!with.ok()) return Done(ctx, "Attach", t0, with.status());
  p = *with;
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
  const std::optional<pb::PolicyDefaults> now = defaults_.ChangedSince(generation);
  if (!now) return;  // the usual case: nothing changed
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.freed) return;
  absl::StatusOr<Policy> p = WithDefaults(*now, requested);
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
  hub_.Notify(s.id, BudgetsOf(s));
  return absl::OkStatus();
}

void SpinService::RestoreDefaults() { defaults_.Restore(log_); }

grpc::ServerUnaryReactor* SpinService::SetDefaultPolicy(grpc::CallbackServerContext* ctx,
                                                        const pb::SetDefaultPolicyRequest* req,
                                                        pb::SetDefaultPolicyResponse* resp) {
  const auto t0 = Clock::now();
  if (absl::Status a = CheckOperator(ctx); !a.ok()) return Done(ctx, "SetDefaultPolicy", t0, a);
  absl::StatusOr<pb::PolicyDefaults> next = defaults_.Set(*req, log_);
  if (!next.ok()) return Done(ctx, "SetDefaultPolicy", t0, next.status());
  const std::string who = Caller(ctx, false);
  if (ChangesDefaults(*req) && log_) {
    log_("info", absl::StrCat("default policy now {", next->ShortDebugString(), "}, by ", who));
  }
  *resp->mutable_defaults() = *next;
  if (req->apply_to_live()) ApplyDefaultsToLive(*next, who, resp);
  return Done(ctx, "SetDefaultPolicy", t0, absl::OkStatus());
}

void SpinService::ApplyDefaultsToLive(const pb::PolicyDefaults& d, const std::string& who,
                                      pb::SetDefaultPolicyResponse* resp) {
  for (const std::shared_ptr<Session>& s : sessions_->List()) {
    std::lock_guard<std::mutex> lock(s->mu);
    if (s->freed) continue;
    absl::StatusOr<Policy> p = WithDefaults(d, s->policy);
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

grpc::ServerUnaryReactor* SpinService::GetBudgets(grpc::CallbackServerContext* ctx,
                                                  const pb::GetBudgetsRequest* req,
                                                  pb::GetBudgetsResponse* resp) {
  return OnSession(ctx, "GetBudgets", req->session(), false, true,
                   [resp](Session& s, const std::string&) {
                     SPIN_RETURN_IF_ERROR(s.arena->PullControl());
                     *resp = BudgetsOf(s);
                     return absl::OkStatus();
                   });
}

grpc::ServerUnaryReactor* SpinService::OpenSequences(grpc::CallbackServerContext* ctx,
                                                     const pb::OpenSequencesRequest* req,
                                                     pb::OpenSequencesResponse*) {
  return OnSession(ctx, "OpenSequences", req->session(), true,
                   [this, req](Session& s) { return OpenRemoteSequences(*sessions_, s, *req); });
}

grpc::ServerUnaryReactor* SpinService::PredictMasks(grpc::CallbackServerContext* ctx,
                                                    const pb::PredictMasksRequest* req,
                                                    pb::PredictMasksResponse* resp) {
  return OnSession(ctx, "PredictMasks", req->session(), true, [this, req, resp](Session& s) {
    // The probe thread leaves remote sessions alone: their budgets are refreshed here, between
    // steps, by the thread's own rule (a failure is logged; the step goes on with its table).
    auto refresh = [this](Session& session) {
      RefreshAndReport(
          session, [this](Session& x) { PublishBudgets(x); },
          [this](const char* level, const std::string& line) {
            if (log_) log_(level, line);
          });
    };
    return PredictRemoteMasks(*sessions_, s, *req, resp, refresh);
  });
}

grpc::ServerUnaryReactor* SpinService::ObserveScores(grpc::CallbackServerContext* ctx,
                                                     const pb::ObserveScoresRequest* req,
                                                     pb::ObserveScoresResponse* resp) {
  return OnSession(ctx, "ObserveScores", req->session(), true, [this, req, resp](Session& s) {
    return ObserveRemoteScores(*sessions_, s, *req, resp);
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
