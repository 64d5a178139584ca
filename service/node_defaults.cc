#include "node_defaults.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "convert.h"
#include "google/protobuf/util/json_util.h"
#include "spin/status_macros.h"
#include "warm_budgets.h"

namespace spin::service {
namespace {

namespace pb = spin::v1;

// A node default policy whose every set field is in range on its own (checked over the built-in
// policy): what Set accepts and Restore keeps.
absl::Status ValidateDefaults(const pb::PolicyDefaults& d) {
  absl::StatusOr<Policy> p = WithDefaults(d, Policy{});
  if (!p.ok()) return p.status();
  if (absl::Status v = ValidatePolicy(*p); !v.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("default policy: ", v.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Policy> WithDefaults(const pb::PolicyDefaults& d, Policy p) {
  if (d.has_target_sparsity()) p.target_sparsity = d.target_sparsity();
  if (d.has_exploration()) p.exploration = d.exploration();
  if (d.has_alpha()) p.alpha = d.alpha();
  if (d.has_probe_period()) p.probe_period = d.probe_period();
  if (d.has_miss_target()) p.miss_target = d.miss_target();
  SPIN_ASSIGN_OR_RETURN(p.budget_mode, ModeFromProto(d.budget_mode(), p.budget_mode));
  return p;
}

bool ChangesDefaults(const pb::SetDefaultPolicyRequest& req) {
  return req.clear() || req.defaults().ByteSizeLong() > 0;
}

void NodeDefaults::Restore(const LogFn& log) {
  const std::string& path = file_;
  if (path.empty()) return;
  auto ignored = [&](const std::string& why) {
    if (log) {
      log("warning", absl::StrCat("node default policy in ", path, " ignored: ", why,
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
    std::lock_guard<std::mutex> lock(mu_);
    defaults_ = d;
  }
  if (log) {
    log("info", absl::StrCat("node default policy {", d.ShortDebugString(), "} from ", path));
  }
}

absl::StatusOr<Policy> NodeDefaults::Over(const Policy& p, uint64_t* generation) const {
  std::lock_guard<std::mutex> lock(mu_);
  *generation = generation_;
  absl::StatusOr<Policy> with = WithDefaults(defaults_, p);
  absl::Status v = with.ok() ? ValidatePolicy(*with) : with.status();
  if (!v.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("the node's default policy over this attach's: ",
                                                   v.message(), " (spinctl policy defaults)"));
  }
  return with;
}

std::optional<pb::PolicyDefaults> NodeDefaults::ChangedSince(uint64_t generation) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (generation_ == generation) return std::nullopt;
  return defaults_;
}

absl::StatusOr<pb::PolicyDefaults> NodeDefaults::Set(const pb::SetDefaultPolicyRequest& req,
                                                     const LogFn& log) {
  // One critical section from read to write: two operators setting different fields at once
  // both keep theirs (with two sections, the later write dropped the earlier one's fields).
  std::lock_guard<std::mutex> lock(mu_);
  pb::PolicyDefaults next = defaults_;
  if (req.clear()) next.Clear();
  next.MergeFrom(req.defaults());  // set fields replace; an unspecified mode keeps the old
  SPIN_RETURN_IF_ERROR(ValidateDefaults(next));
  const bool changes = ChangesDefaults(req);
  defaults_ = next;
  if (changes) ++generation_;  // attaches in flight catch up (SpinService::CatchUpDefaults)
  if (changes && !file_.empty()) {
    // The change holds either way; a node that cannot keep it says so.
    std::string json;
    google::protobuf::util::JsonPrintOptions opts;
    opts.add_whitespace = true;
    absl::Status k = google::protobuf::util::MessageToJsonString(next, &json, opts).ok()
                         ? WriteFileAtomically(file_, json)
                         : absl::InternalError("cannot print the defaults as JSON");
    if (!k.ok() && log) {
      log("error", absl::StrCat("the node default policy holds until spind stops: ", k.message(),
                                " (check --state-dir's space and permissions)"));
    }
  }
  return next;
}

}  // namespace spin::service
