// Conversions between the data-plane types (spin/arena.h) and their spin.v1 messages, shared by
// spind and libspin_client so both sides map fields the same way.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "spin/arena.h"
#include "spin/data_plane.h"
#include "spin/v1/spin.pb.h"

namespace spin {

/// A validated geometry: INVALID_ARGUMENT names the field out of range.
absl::StatusOr<Geometry> FromProto(const spin::v1::Geometry& p);
/// The message of a geometry.
spin::v1::Geometry ToProto(const Geometry& g);
/// A budget mode; UNSPECIFIED means `keep`.
absl::StatusOr<BudgetMode> ModeFromProto(spin::v1::BudgetMode m, BudgetMode keep);
spin::v1::BudgetMode ModeToProto(BudgetMode m);
/// The message of a policy.
spin::v1::Policy ToProto(const Policy& p);
/// A policy from its message: an unset alpha is the default, an unspecified budget mode is
/// uniform. Not range-checked (ValidatePolicy does that); fails only on an unknown budget mode.
absl::StatusOr<Policy> FromProto(const spin::v1::Policy& p);
/// The message of one layer's statistics (counters and the ratios derived from them).
spin::v1::LayerStats ToProto(uint32_t layer, const LayerStats& st, double sparsity_budget);
/// The counters of a LayerStats message (the inverse of ToProto, ratios dropped).
LayerStats FromProto(const spin::v1::LayerStats& p);

/// The largest gRPC message spind receives: gRPC's default 4 MiB, set explicitly. It is not
/// raised because gRPC parses a request whole before a handler can refuse it, and small rows
/// cost many times their wire size once parsed (docs/spind.md, "Threads and slow work"). What
/// makes messages large is remote mode: an ObserveScores request carries every row's compacted
/// scores (its PredictMasks response, 4-byte block ids against 64 4-byte scores a block, is far
/// smaller and within libspin_client's own 4 MiB default).
inline constexpr int kMaxMessageBytes = 4 << 20;

/// An upper bound, in bytes, on the larger of a remote-mode step's messages: one PredictMasks
/// response and one ObserveScores request for `batch` (every selected block at 5 varint bytes,
/// every score at 4, with the protobuf framing), from the geometry and the entries' context
/// lengths alone, so spind can refuse a step whose messages could not arrive before it begins.
/// `batch` must have passed ValidateStepShape.
uint64_t RemoteStepMessageBytes(const Geometry& g, const StepBatch& batch);

}  // namespace spin
