// The node's default policy (SetDefaultPolicy; docs/spind.md, "Operator control"): the fields
// that override every new session's policy, kept across restarts as protobuf JSON when spind
// has a state directory.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "spin/arena.h"
#include "spin/v1/spin.pb.h"

namespace spin::service {

/// The defaults' set fields over `p`.
absl::StatusOr<Policy> WithDefaults(const spin::v1::PolicyDefaults& d, Policy p);

/// Whether the request changes the defaults (it clears them or sets a field).
bool ChangesDefaults(const spin::v1::SetDefaultPolicyRequest& req);

/// The defaults and the generation of their last change. Thread-safe.
class NodeDefaults {
 public:
  using LogFn = std::function<void(const char*, const std::string&)>;
  /// `file`: where the defaults are kept (<state dir>/node-defaults.json); empty: in memory only.
  explicit NodeDefaults(std::string file) : file_(std::move(file)) {}

  /// Reads the kept defaults, if there are any. A file that does not parse or holds an
  /// out-of-range field is ignored with a log line saying what to do; the defaults stay empty.
  void Restore(const LogFn& log);
  /// An attach's policy `p` under the current defaults (INVALID_ARGUMENT naming both when the
  /// result is out of range), and in `generation` the generation it was taken at.
  absl::StatusOr<Policy> Over(const Policy& p, uint64_t* generation) const;
  /// The current defaults, when they changed since `generation`.
  std::optional<spin::v1::PolicyDefaults> ChangedSince(uint64_t generation) const;
  /// SetDefaultPolicy: the defaults cleared (req.clear) and then req.defaults' set fields
  /// merged in, each in range or nothing changes. A change is written to the file; when that
  /// fails it still holds, and the log says so.
  absl::StatusOr<spin::v1::PolicyDefaults> Set(const spin::v1::SetDefaultPolicyRequest& req,
                                               const LogFn& log);

 private:
  const std::string file_;
  mutable std::mutex mu_;
  spin::v1::PolicyDefaults defaults_;
  uint64_t generation_ = 0;  // bumped with every change of defaults_
};

}  // namespace spin::service
