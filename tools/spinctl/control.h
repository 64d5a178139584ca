// spinctl's daemon commands: status, sessions, policy, budgets, stats, and replay through a
// session in spind. Each returns the process exit code and prints one line on error.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "replay.h"
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
/// Negative values (or an empty budget) leave a field unchanged.
int CmdPolicySet(const ControlArgs& a, double sparsity, double exploration, float alpha,
                 int64_t probe_period, const std::string& budget, double miss_target = -1);
/// The node's default policy: set the given fields (negative or empty: not set), optionally
/// after clearing it, and with `apply_to_live` every live session's too; prints the defaults
/// and the sessions changed.
int CmdPolicyDefaults(const ControlArgs& a, double sparsity, double exploration, float alpha,
                      int64_t probe_period, const std::string& budget, bool apply_to_live,
                      bool clear, double miss_target = -1);
int CmdBudgets(const ControlArgs& a);
int CmdStats(const ControlArgs& a);

}  // namespace spin
