// RETURN_IF_ERROR / ASSIGN_OR_RETURN for absl::Status code: Abseil 20220623
// ships neither. Lives in common/, the bottom layer, so that every module
// (kernels, server, client) can use it.
#ifndef LOSSD_COMMON_STATUS_MACROS_H_
#define LOSSD_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define LOSSD_STATUS_CONCAT_INNER_(a, b) a##b
#define LOSSD_STATUS_CONCAT_(a, b) LOSSD_STATUS_CONCAT_INNER_(a, b)

// Returns the status of `expr` from the enclosing function when it is not OK.
#define RETURN_IF_ERROR(expr)                      \
  do {                                             \
    const ::absl::Status lossd_status_ = (expr);   \
    if (!lossd_status_.ok()) return lossd_status_; \
  } while (0)

// `lhs = value of rexpr`, or returns its status from the enclosing function.
#define ASSIGN_OR_RETURN(lhs, rexpr)                                           \
  ASSIGN_OR_RETURN_IMPL_(LOSSD_STATUS_CONCAT_(lossd_statusor_, __LINE__), lhs, \
                         rexpr)

#define ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                           \
  if (!statusor.ok()) return statusor.status();      \
  lhs = std::move(statusor).value()

#endif  // LOSSD_COMMON_STATUS_MACROS_H_
