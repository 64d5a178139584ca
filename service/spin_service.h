// The spin.v1.Spin gRPC service over a SessionManager (callback API; handlers never block on a
// device). Each handler validates its request completely before it changes anything.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "budget_stream.h"
#include "executor.h"
#include "to_grpc.h"
#include "metrics.h"
#include "node_defaults.h"
#include "session_manager.h"
#include "spin/v1/spin.grpc.pb.h"

namespace spin::service {

/// How the service treats its callers.
struct ServiceOptions {
  /// Required (metadata "authorization: Bearer <token>") by state-changing calls over TCP.
  std::string admin_token;
  /// Without an admin token, state-changing calls over TCP are refused unless this is set
  /// (spind --tcp-allow-unauthenticated; logged as a warning at start).
  bool allow_unauthenticated_tcp = false;
  /// Operator calls (a session by id without its token, SetDefaultPolicy, ListSessions) on the
  /// Unix socket need the admin token too (spind --operators token; the default whenever an
  /// admin token is configured). Off: any process that can open the socket is an operator.
  bool unix_operators_need_token = false;
  /// Worker threads for slow work (attach, data-plane calls, waits on a session's lock).
  size_t workers = 4;
  /// WatchBudgets streams one session may have open.
  size_t max_watchers_per_session = 16;
  /// Calls queued on one session before further ones get RESOURCE_EXHAUSTED.
  size_t max_queued_per_session = 64;
  /// Warm budgets: the store of models' per-layer curves (null or disabled: none).
  std::shared_ptr<const WarmBudgets> warm;
  /// Where the node default policy (SetDefaultPolicy) is kept across restarts, as protobuf JSON
  /// (spind --state-dir: <dir>/node-defaults.json); empty: in memory only.
  std::string defaults_file;
};

/// Longest client_name accepted at attach.
inline constexpr size_t kMaxClientName = 256;

/// The service. Holds no state beyond the session manager (and its worker pool).
class SpinService final : public spin::v1::Spin::CallbackService {
 public:
  /// `fd_socket` is the path clients fetch arena fds from (AttachResponse.fd_socket).
  /// `metrics` may be null (no RPC metrics).
  SpinService(SessionManager* sessions, std::string fd_socket, Metrics* metrics,
              ServiceOptions options);
  /// Tests and tools: `admin_token` as ServiceOptions::admin_token, and TCP callers are allowed
  /// without one (as before the default changed).
  SpinService(SessionManager* sessions, std::string fd_socket, Metrics* metrics = nullptr,
              std::string admin_token = "")
      : SpinService(sessions, std::move(fd_socket), metrics, TestOptions(std::move(admin_token))) {}
  ~SpinService() override;
  /// Reads the node default policy from ServiceOptions::defaults_file, if there is one (call
  /// after SetLogger, before serving). A file that does not parse or holds an out-of-range
  /// field is ignored with a log line saying what to do; the defaults then start empty.
  void RestoreDefaults();
  static ServiceOptions TestOptions(std::string admin_token) {
    ServiceOptions o;
    o.admin_token = std::move(admin_token);
    o.allow_unauthenticated_tcp = true;
    return o;
  }

  /// Before the server's Shutdown: ends every WatchBudgets stream, open or opened later, with
  /// UNAVAILABLE, so the drain waits only for calls that are in flight (a stream stays open
  /// as long as its session).
  void Drain();
  /// Sends the session's budget table to its WatchBudgets streams (caller holds its lock and
  /// pulled its control region).
  void PublishBudgets(const Session& s);
  /// Where the service logs what it cannot return (level, line).
  void SetLogger(std::function<void(const char*, const std::string&)> log) {
    log_ = std::move(log);
  }

  grpc::ServerUnaryReactor* Attach(grpc::CallbackServerContext* ctx,
                                   const spin::v1::AttachRequest* req,
                                   spin::v1::AttachResponse* resp) override;
  grpc::ServerUnaryReactor* Detach(grpc::CallbackServerContext* ctx,
                                   const spin::v1::DetachRequest* req,
                                   spin::v1::DetachResponse* resp) override;
  grpc::ServerUnaryReactor* GetPolicy(grpc::CallbackServerContext* ctx,
                                      const spin::v1::GetPolicyRequest* req,
                                      spin::v1::GetPolicyResponse* resp) override;
  grpc::ServerUnaryReactor* SetPolicy(grpc::CallbackServerContext* ctx,
                                      const spin::v1::SetPolicyRequest* req,
                                      spin::v1::SetPolicyResponse* resp) override;
  grpc::ServerUnaryReactor* GetBudgets(grpc::CallbackServerContext* ctx,
                                       const spin::v1::GetBudgetsRequest* req,
                                       spin::v1::GetBudgetsResponse* resp) override;
  grpc::ServerWriteReactor<spin::v1::GetBudgetsResponse>* WatchBudgets(
      grpc::CallbackServerContext* ctx, const spin::v1::GetBudgetsRequest* req) override;
  grpc::ServerUnaryReactor* OpenSequences(grpc::CallbackServerContext* ctx,
                                          const spin::v1::OpenSequencesRequest* req,
                                          spin::v1::OpenSequencesResponse* resp) override;
  grpc::ServerUnaryReactor* PredictMasks(grpc::CallbackServerContext* ctx,
                                         const spin::v1::PredictMasksRequest* req,
                                         spin::v1::PredictMasksResponse* resp) override;
  grpc::ServerUnaryReactor* ObserveScores(grpc::CallbackServerContext* ctx,
                                          const spin::v1::ObserveScoresRequest* req,
                                          spin::v1::ObserveScoresResponse* resp) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx,
                                     const spin::v1::GetStatsRequest* req,
                                     spin::v1::GetStatsResponse* resp) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx,
                                         const spin::v1::ListSessionsRequest* req,
                                         spin::v1::ListSessionsResponse* resp) override;
  grpc::ServerUnaryReactor* KeepAlive(grpc::CallbackServerContext* ctx,
                                      const spin::v1::KeepAliveRequest* req,
                                      spin::v1::KeepAliveResponse* resp) override;
  grpc::ServerUnaryReactor* SetDefaultPolicy(grpc::CallbackServerContext* ctx,
                                             const spin::v1::SetDefaultPolicyRequest* req,
                                             spin::v1::SetDefaultPolicyResponse* resp) override;

 private:
  // Records an RPC's metrics and completes its reactor.
  void Finish(grpc::ServerUnaryReactor* reactor, const char* method,
              std::chrono::steady_clock::time_point t0, const absl::Status& s);
  // Finishes an RPC on its default reactor (Finish above).
  grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const char* method,
                                 std::chrono::steady_clock::time_point t0, const absl::Status& s);

  // Runs `body` on the session's strand with its lock held (and the session not freed), then
  // finishes the call with what it returned. `mutating` calls need CheckAdmin. With
  // `operator_ok`, a ref without a token is an operator's (CheckAdmin, for reads too) and finds
  // the session by id; `body` gets who called (for the log).
  grpc::ServerUnaryReactor* OnSession(
      grpc::CallbackServerContext* ctx, const char* method, const spin::v1::SessionRef& ref,
      bool mutating, bool operator_ok,
      std::function<absl::Status(Session&, const std::string&)> body);
  grpc::ServerUnaryReactor* OnSession(grpc::CallbackServerContext* ctx, const char* method,
                                      const spin::v1::SessionRef& ref, bool mutating,
                                      std::function<absl::Status(Session&)> body) {
    return OnSession(ctx, method, ref, mutating, false,
                     [body = std::move(body)](Session& s, const std::string&) { return body(s); });
  }
  // Warm budgets: records the session's model and, for a per-layer session of a model with
  // saved curves, starts its controller and table from them (logged either way).
  void StartWarm(Session& s, const std::string& model);
  // An attach takes its policy from the node defaults when the call arrives (generation
  // `generation`) but lists its session only once the arena is made; a SetDefaultPolicy in
  // between applies to listed sessions only. Once listed, the session catches up: when the
  // defaults changed meanwhile, its policy becomes the engine's `requested` one under the
  // current defaults.
  void CatchUpDefaults(Session& s, const Policy& requested, uint64_t generation);
  // Who made a call, for the log: the session's engine, or an operator and how it got in.
  std::string Caller(grpc::CallbackServerContext* ctx, bool with_token) const;
  // Writes `p` as session `s`'s policy (and re-sizes its budgets), logs the change with `who`
  // and counts it under `source` (caller holds the session's lock).
  absl::Status ChangePolicy(Session& s, const Policy& p, const std::string& who,
                            const char* source);
  // SetDefaultPolicy with apply_to_live: `d` over every live session's policy, each changed
  // one listed in `resp` (a session that fails is logged and skipped).
  void ApplyDefaultsToLive(const spin::v1::PolicyDefaults& d, const std::string& who,
                           spin::v1::SetDefaultPolicyResponse* resp);

  // OK for Unix-socket peers, and over TCP for calls carrying the admin token; without an admin
  // token, TCP callers pass only with allow_unauthenticated_tcp. PERMISSION_DENIED otherwise.
  absl::Status CheckAdmin(grpc::CallbackServerContext* ctx) const;
  // Operator authority (docs/spind.md, "Operator control"): CheckAdmin's rule, and on the Unix
  // socket the admin token too when unix_operators_need_token.
  absl::Status CheckOperator(grpc::CallbackServerContext* ctx) const;
  // Whether the call carries the admin token ("authorization: Bearer <token>").
  bool HasAdminToken(grpc::CallbackServerContext* ctx) const;

  SessionManager* sessions_;
  std::string fd_socket_;
  Metrics* metrics_;
  ServiceOptions options_;
  NodeDefaults defaults_;  // the node-wide default policy (SetDefaultPolicy)
  BudgetHub hub_;
  Executor executor_;
  std::function<void(const char*, const std::string&)> log_;
};

}  // namespace spin::service
