// Conversions between the data-plane types (spin/arena.h) and their spin.v1 messages, shared by
// spind and libspin_client so both sides map fields the same way.
#pragma once

#include "absl/status/statusor.h"
#include "spin/arena.h"
#include "spin/v1/spin.pb.h"

namespace spin {

/// A validated geometry: INVALID_ARGUMENT names the field out of range.
absl::StatusOr<Geometry> FromProto(const spin::v1::Geometry& p);
/// The message of a geometry.
spin::v1::Geometry ToProto(const Geometry& g);
/// A budget mode; UNSPECIFIED means `keep`.
absl::StatusOr<BudgetMode> ModeFromProto(spin::v1::BudgetMode m, BudgetMode keep);
/// The message of a policy.
spin::v1::Policy ToProto(const Policy& p);
/// A policy from its message: an unset alpha is the default, an unspecified budget mode is
/// uniform. Not range-checked (ValidatePolicy does that); fails only on an unknown budget mode.
absl::StatusOr<Policy> FromProto(const spin::v1::Policy& p);
/// The message of one layer's statistics (counters and the ratios derived from them).
spin::v1::LayerStats ToProto(uint32_t layer, const LayerStats& st, double sparsity_budget);
/// The counters of a LayerStats message (the inverse of ToProto, ratios dropped).
LayerStats FromProto(const spin::v1::LayerStats& p);

}  // namespace spin
