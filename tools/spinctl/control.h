// spinctl's daemon commands: status, sessions, policy, budgets, stats, and replay through a
// session in spind. Each returns the process exit code and prints one line on error.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "replay.h"
#include "spin/arena.h"
#include "trace.h"

namespace spin {

/// Where and as whom.
struct ControlArgs {
  std::string target;
  std::string session_id;
  std::string token;
  std::string admin_token;  ///< sent as "authorization: Bearer ..." when set (TCP targets)
};

int CmdStatus(const ControlArgs& a);
/// grpc.health.v1 Check of `service` ("" : spind as a whole) within `timeout_ms`: prints the
/// status; 0 only when SERVING (for exec probes).
int CmdHealth(const ControlArgs& a, const std::string& service, int timeout_ms);
int CmdSessions(const ControlArgs& a);
int CmdPolicyGet(const ControlArgs& a);
/// The policy fields a command changes; the ones left unset stay as they are. Values are sent
/// as given: spinctl checks their ranges before (spind checks again).
struct PolicyFields {
  std::optional<double> sparsity;
  std::optional<double> exploration;
  std::optional<float> alpha;
  std::optional<int64_t> probe_period;  ///< 64-bit: a 33-bit value is refused, never wrapped
  std::optional<BudgetMode> budget;
  std::optional<double> miss_target;
};

/// Changes the set fields of one session's policy; prints the policy.
int CmdPolicySet(const ControlArgs& a, const PolicyFields& f);
/// The node's default policy: sets the set fields, after clearing it with `clear`, and with
/// `apply_to_live` every live session's too; prints the defaults and the sessions changed.
int CmdPolicyDefaults(const ControlArgs& a, const PolicyFields& f, bool apply_to_live, bool clear);
int CmdBudgets(const ControlArgs& a);
int CmdStats(const ControlArgs& a);

}  // namespace spin
