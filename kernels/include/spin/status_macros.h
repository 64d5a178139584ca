// Error propagation over absl::Status, the one way the project passes errors up.
//
//   SPIN_RETURN_IF_ERROR(expr);           // expr is an absl::Status (or a StatusOr's .status())
//   SPIN_ASSIGN_OR_RETURN(T x, expr);     // expr is an absl::StatusOr<T>; x is declared or
//   assigned
//
// Both return the failing absl::Status from the enclosing function, which must return
// absl::Status or absl::StatusOr<U>. Anything else a caller needs to add (context, another code)
// is written out where it is added: these macros only forward.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define SPIN_STATUS_CONCAT_INNER_(a, b) a##b
#define SPIN_STATUS_CONCAT_(a, b) SPIN_STATUS_CONCAT_INNER_(a, b)

#define SPIN_RETURN_IF_ERROR(expr)                                  \
  do {                                                              \
    if (::absl::Status spin_status_ = (expr); !spin_status_.ok()) { \
      return spin_status_;                                          \
    }                                                               \
  } while (false)

#define SPIN_ASSIGN_OR_RETURN(lhs, expr) \
  SPIN_ASSIGN_OR_RETURN_IMPL_(SPIN_STATUS_CONCAT_(spin_statusor_, __LINE__), lhs, expr)

#define SPIN_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return std::move(tmp).status();    \
  lhs = std::move(tmp).value()
