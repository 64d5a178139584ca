#include "control.h"

#include <chrono>
#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "convert.h"
#include "grpcpp/grpcpp.h"
#include "spin/v1/spin.grpc.pb.h"

namespace spin {
namespace {

namespace pb = spin::v1;

int Fail(const std::string& what, const grpc::Status& s) {
  std::fprintf(stderr, "spinctl: error: %s: %s (%d)\n", what.c_str(), s.error_message().c_str(),
               static_cast<int>(s.error_code()));
  return 1;
}

// Every control call: a deadline, and the admin token when one is given.
std::string g_admin_token;
void Deadline(grpc::ClientContext* c,
              std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  c->set_deadline(std::chrono::system_clock::now() + timeout);
  if (!g_admin_token.empty()) c->AddMetadata("authorization", "Bearer " + g_admin_token);
}

std::unique_ptr<pb::Spin::Stub> Stub(const ControlArgs& a) {
  g_admin_token = a.admin_token;
  const std::string& target = a.target;
  return pb::Spin::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
}

pb::SessionRef Ref(const ControlArgs& a) {
  pb::SessionRef r;
  r.set_session_id(a.session_id);
  r.set_token(a.token);
  return r;
}

// A mode on the wire in its one text form (spin/arena.h); unset reads as uniform, as spind
// treats it.
std::string ModeName(pb::BudgetMode m) {
  const absl::StatusOr<BudgetMode> mode = ModeFromProto(m, BudgetMode::kUniform);
  return mode.ok() ? std::string(BudgetModeName(*mode)) : "unknown";
}

// The set fields into a SetPolicyRequest or a PolicyDefaults (the same fields by name).
template <typename Message>
void SetFields(const PolicyFields& f, Message* m) {
  if (f.sparsity) m->set_target_sparsity(*f.sparsity);
  if (f.exploration) m->set_exploration(*f.exploration);
  if (f.alpha) m->set_alpha(*f.alpha);
  if (f.probe_period) m->set_probe_period(static_cast<uint32_t>(*f.probe_period));
  if (f.budget) m->set_budget_mode(ModeToProto(*f.budget));
  if (f.miss_target) m->set_miss_target(*f.miss_target);
}

void PrintPolicy(const pb::Policy& p, uint64_t epoch) {
  std::printf(
      "target_sparsity %.4f\nexploration %.4f\nalpha %.4f\nprobe_period %u\n"
      "budget_mode %s\n",
      p.target_sparsity(), p.exploration(), p.alpha(), p.probe_period(),
      ModeName(p.budget_mode()).c_str());
  if (p.budget_mode() == pb::BUDGET_MODE_MISS_TARGET) {
    std::printf("miss_target %.4f\n", p.miss_target());
  }
  std::printf("epoch %llu\n", static_cast<unsigned long long>(epoch));
}

}  // namespace

int CmdStatus(const ControlArgs& a) {
  auto stub = Stub(a);
  grpc::ClientContext c;
  Deadline(&c);
  pb::ListSessionsResponse r;
  grpc::Status s = stub->ListSessions(&c, pb::ListSessionsRequest(), &r);
  if (!s.ok()) return Fail("spind at " + a.target + " is not answering", s);
  uint64_t bytes = 0;
  for (const auto& x : r.sessions()) bytes += x.arena_bytes();
  std::printf("spind at %s: serving, %d sessions, %llu arena bytes\n", a.target.c_str(),
              r.sessions_size(), static_cast<unsigned long long>(bytes));
  return 0;
}

int CmdHealth(const ControlArgs& a, const std::string& service, int timeout_ms) {
  namespace health = grpc::health::v1;
  g_admin_token = a.admin_token;
  auto stub =
      health::Health::NewStub(grpc::CreateChannel(a.target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext c;
  Deadline(&c, std::chrono::milliseconds(timeout_ms));
  health::HealthCheckRequest q;
  q.set_service(service);
  health::HealthCheckResponse r;
  const std::string what = service.empty() ? "spind" : service;
  grpc::Status s = stub->Check(&c, q, &r);
  if (!s.ok()) {
    return Fail(absl::StrCat("health of ", what, " at ", a.target,
                             s.error_code() == grpc::StatusCode::NOT_FOUND
                                 ? ": no such service"
                                 : ": not answering (is spind running on that address?)"),
                s);
  }
  std::printf("%s at %s: %s\n", what.c_str(), a.target.c_str(),
              health::HealthCheckResponse::ServingStatus_Name(r.status()).c_str());
  return r.status() == health::HealthCheckResponse::SERVING ? 0 : 1;
}

int CmdSessions(const ControlArgs& a) {
  auto stub = Stub(a);
  grpc::ClientContext c;
  Deadline(&c);
  pb::ListSessionsResponse r;
  grpc::Status s = stub->ListSessions(&c, pb::ListSessionsRequest(), &r);
  if (!s.ok()) return Fail("ListSessions", s);
  std::printf("%-20s %-16s %6s %5s %9s %5s %12s %s\n", "session", "client", "layers", "seqs",
              "slots", "rows", "arena_bytes", "backend");
  for (const auto& x : r.sessions()) {
    const std::string where =
        x.backend() == pb::BACKEND_CUDA ? "cuda " + x.device_uuid() : std::string("cpu");
    std::printf("%-20s %-16s %6u %5u %9u %5u %12llu %s\n", x.session_id().c_str(),
                x.client_name().c_str(), x.geometry().layers(), x.geometry().max_sequences(),
                x.geometry().max_slots(), x.geometry().max_rows(),
                static_cast<unsigned long long>(x.arena_bytes()), where.c_str());
  }
  return 0;
}

int CmdPolicyGet(const ControlArgs& a) {
  auto stub = Stub(a);
  grpc::ClientContext c;
  Deadline(&c);
  pb::GetPolicyRequest q;
  *q.mutable_session() = Ref(a);
  pb::GetPolicyResponse r;
  grpc::Status s = stub->GetPolicy(&c, q, &r);
  if (!s.ok()) return Fail("GetPolicy", s);
  PrintPolicy(r.policy(), r.epoch());
  return 0;
}

int CmdPolicySet(const ControlArgs& a, const PolicyFields& f) {
  auto stub = Stub(a);
  grpc::ClientContext c;
  Deadline(&c);
  pb::SetPolicyRequest q;
  *q.mutable_session() = Ref(a);
  SetFields(f, &q);
  pb::SetPolicyResponse r;
  grpc::Status s = stub->SetPolicy(&c, q, &r);
  if (!s.ok()) return Fail("SetPolicy", s);
  PrintPolicy(r.policy(), r.epoch());
  return 0;
}

int CmdPolicyDefaults(const ControlArgs& a, const PolicyFields& f, bool apply_to_live, bool clear) {
  auto stub = Stub(a);
  grpc::ClientContext c;
  Deadline(&c);
  pb::SetDefaultPolicyRequest q;
  SetFields(f, q.mutable_defaults());
  q.set_apply_to_live(apply_to_live);
  q.set_clear(clear);
  pb::SetDefaultPolicyResponse r;
  grpc::Status s = stub->SetDefaultPolicy(&c, q, &r);
  if (!s.ok()) return Fail("SetDefaultPolicy", s);
  const pb::PolicyDefaults& now = r.defaults();
  std::string line = "default policy:";
  if (now.has_target_sparsity())
    absl::StrAppendFormat(&line, " sparsity %.4g", now.target_sparsity());
  if (now.has_exploration()) absl::StrAppendFormat(&line, " exploration %.4g", now.exploration());
  if (now.has_alpha()) absl::StrAppendFormat(&line, " alpha %.4g", now.alpha());
  if (now.has_probe_period()) absl::StrAppendFormat(&line, " probe-period %u", now.probe_period());
  if (now.budget_mode() != pb::BUDGET_MODE_UNSPECIFIED) {
    line += " budget " + ModeName(now.budget_mode());
  }
  if (now.has_miss_target()) absl::StrAppendFormat(&line, " miss-target %.4g", now.miss_target());
  if (now.ByteSizeLong() == 0) line += " none (sessions keep the policy they attach with)";
  std::printf("%s\n", line.c_str());
  if (apply_to_live) {
    std::printf("applied to %d live session%s", r.changed_sessions_size(),
                r.changed_sessions_size() == 1 ? "" : "s");
    for (int i = 0; i < r.changed_sessions_size(); ++i) {
      std::printf("%s%s", i ? ", " : ": ", r.changed_sessions(i).c_str());
    }
    std::printf("\n");
  }
  return 0;
}

int CmdBudgets(const ControlArgs& a) {
  auto stub = Stub(a);
  grpc::ClientContext c;
  Deadline(&c);
  pb::GetBudgetsRequest q;
  *q.mutable_session() = Ref(a);
  pb::GetBudgetsResponse r;
  grpc::Status s = stub->GetBudgets(&c, q, &r);
  if (!s.ok()) return Fail("GetBudgets", s);
  std::printf("epoch %llu, %s\nlayer  sparsity\n", static_cast<unsigned long long>(r.epoch()),
              ModeName(r.budget_mode()).c_str());
  for (int l = 0; l < r.layer_sparsity_size(); ++l) {
    std::printf("%5d  %.4f\n", l, r.layer_sparsity(l));
  }
  return 0;
}

int CmdStats(const ControlArgs& a) {
  auto stub = Stub(a);
  grpc::ClientContext c;
  Deadline(&c);
  pb::GetStatsRequest q;
  *q.mutable_session() = Ref(a);
  pb::GetStatsResponse r;
  grpc::Status s = stub->GetStats(&c, q, &r);
  if (!s.ok()) return Fail("GetStats", s);
  std::printf("%5s %8s %6s %6s %9s %9s %9s %8s %6s\n", "layer", "steps", "dense", "probes",
              "realized", "effective", "miss", "budget", "bad");
  for (const auto& l : r.layers()) {
    std::printf("%5u %8llu %6llu %6llu %9.4f %9.4f %9.4f %8.4f %6llu\n", l.layer(),
                static_cast<unsigned long long>(l.steps()),
                static_cast<unsigned long long>(l.dense_steps()),
                static_cast<unsigned long long>(l.probe_steps()), l.realized_sparsity(),
                l.effective_sparsity(), l.miss_rate(), l.sparsity_budget(),
                static_cast<unsigned long long>(l.bad_scores()));
  }
  return 0;
}

}  // namespace spin
