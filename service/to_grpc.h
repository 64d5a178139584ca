// absl::Status -> gRPC status, for every reply of the service (the numeric codes are identical).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace spin::service {

/// Converts an absl::Status to the gRPC status with the same code and message.
inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace spin::service
