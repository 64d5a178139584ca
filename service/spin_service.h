// The spin.v1.Spin gRPC service over a SessionManager (callback API; handlers never block on a
// device). Each handler validates its request completely before it changes anything.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "metrics.h"
#include "session_manager.h"
#include "spin/v1/spin.grpc.pb.h"

namespace spin::service {

class BudgetWatcher;

/// The open WatchBudgets streams, by session.
class BudgetHub {
 public:
  void Add(const std::string& session, BudgetWatcher* w);
  void Remove(BudgetWatcher* w);
  /// Sends `update` to every stream of `session`.
  void Notify(const std::string& session, const spin::v1::GetBudgetsResponse& update);
  /// Ends every stream of `session` with `status`.
  void EndAll(const std::string& session, const grpc::Status& status);

 private:
  std::mutex mu_;
  std::multimap<std::string, BudgetWatcher*> watchers_;
};

/// Converts an absl::Status to the gRPC status with the same code and message.
grpc::Status ToGrpc(const absl::Status& s);

/// The service. Holds no state beyond the session manager.
class SpinService final : public spin::v1::Spin::CallbackService {
 public:
  /// `fd_socket` is the path clients fetch arena fds from (AttachResponse.fd_socket).
  /// `metrics` may be null (no RPC metrics). A non-empty `admin_token` is required (metadata
  /// "authorization: Bearer <token>") by mutating calls that arrive over TCP.
  SpinService(SessionManager* sessions, std::string fd_socket, Metrics* metrics = nullptr,
              std::string admin_token = "")
      : sessions_(sessions),
        fd_socket_(std::move(fd_socket)),
        metrics_(metrics),
        admin_token_(std::move(admin_token)) {
    // A freed session (Detach, or its client went away) ends its budget streams.
    sessions_->SetOnFree([this](const std::string& id) { hub_.EndAll(id, grpc::Status::OK); });
  }

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

 private:
  // Finishes an RPC: records its metrics and completes the reactor.
  grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const char* method,
                                 std::chrono::steady_clock::time_point t0, const absl::Status& s);

  // OK for Unix-socket peers and when no admin token is set; PERMISSION_DENIED otherwise unless
  // the call carries the admin token.
  absl::Status CheckAdmin(grpc::CallbackServerContext* ctx) const;

  SessionManager* sessions_;
  std::string fd_socket_;
  Metrics* metrics_;
  std::string admin_token_;
  BudgetHub hub_;
  std::function<void(const char*, const std::string&)> log_;
};

}  // namespace spin::service
