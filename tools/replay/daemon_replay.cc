#include "daemon_replay.h"

#include <chrono>
#include <memory>

#include "absl/strings/str_cat.h"
#include "grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "remote_data_plane.h"
#include "spin/status_macros.h"
#include "spin/v1/spin.grpc.pb.h"
#include "spin_client.h"

namespace spin {
namespace {

namespace pb = spin::v1;

// The session's budget table as spind has it.
absl::StatusOr<pb::GetBudgetsResponse> DaemonBudgets(client::Session& s) {
  pb::GetBudgetsRequest req;
  req.mutable_session()->set_session_id(s.id());
  req.mutable_session()->set_token(s.token());
  pb::GetBudgetsResponse out;
  grpc::ClientContext c;
  c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (absl::Status st = client::FromGrpc(s.stub().GetBudgets(&c, req, &out), "GetBudgets");
      !st.ok()) {
    return st;
  }
  return out;
}

}  // namespace

absl::StatusOr<ReplaySummary> ReplayThroughDaemon(const std::string& target, const Trace& trace,
                                                  const ReplayOptions& options, bool remote,
                                                  const std::string& admin_token,
                                                  std::string* where) {
  client::AttachOptions ao;
  ao.geometry = TraceGeometry(trace.meta(), trace.n_max(), options.dtype);
  ao.policy = options.policy;
  ao.seed = options.seed;
  ao.client_name = remote ? "spinctl-replay-remote" : "spinctl-replay";
  ao.admin_token = admin_token;
  ao.fetch_arena = !remote;  // a session is driven locally or remotely, never both
  SPIN_ASSIGN_OR_RETURN(std::unique_ptr<client::Session> s, client::Session::Attach(target, ao));
  client::Session& session = *s;
  // The daemon decides where the arena lives; --backend cuda insists on a GPU arena.
  if (options.backend == ReplayBackend::kCuda && !session.on_device()) {
    (void)session.Detach();
    return absl::FailedPreconditionError(
        absl::StrCat("--backend cuda: spind at ", target,
                     " keeps arenas in host memory (start it with --backend cuda, or drop "
                     "--backend)"));
  }
  absl::StatusOr<pb::GetBudgetsResponse> before = DaemonBudgets(session);
  if (!before.ok()) {
    (void)session.Detach();
    return before.status();
  }
  absl::StatusOr<ReplaySummary> out;
  if (remote) {
    auto rdp = client::RemoteDataPlane::Create(&session.stub(), session.id(), session.token(),
                                               ao.geometry);
    if (!rdp.ok()) {
      (void)session.Detach();
      return rdp.status();
    }
    out = ReplayOn(**rdp, trace, options);
  } else {
    out = ReplayOn(session.data_plane(), trace, options);
  }
  // Through the daemon its probe thread writes the tables: report its figures, not the local
  // ones (in remote mode the local arena is only a mirror of the outputs and counters).
  if (out.ok()) {
    absl::StatusOr<pb::GetBudgetsResponse> after = DaemonBudgets(session);
    if (!after.ok()) {
      (void)session.Detach();
      return after.status();
    }
    if (TableFromProbes(options.policy.budget_mode)) {
      out->budget_recomputes = after->recomputes();
    }
    out->epoch_advance = after->epoch() - before->epoch();
    for (LayerSummary& l : out->per_layer) {
      if (l.layer < after->layer_sparsity_size()) l.budget = after->layer_sparsity(l.layer);
    }
  }
  *where = absl::StrCat("through spind at ", target, ", session ", session.id(),
                        remote ? " (remote mode" : " (mapped arena",
                        session.on_device() ? ", GPU " : "", session.device_uuid(), "), detached");
  if (absl::Status d = session.Detach(); !d.ok() && out.ok()) return d;
  return out;
}

}  // namespace spin
