// rdmarpc/status.h: the one error type of rdmarpc.
//
// rdmarpc uses absl::Status and absl::StatusOr with the canonical codes
// (the same numbering as gRPC's status codes) everywhere: in handlers, in
// client calls and in the runtime's own APIs.
//
//   rdmarpc::Status Check(int n) {
//     if (n < 0) return absl::InvalidArgumentError("n must be >= 0");
//     return absl::OkStatus();
//   }
//   rdmarpc::Status Run() {
//     RDMARPC_RETURN_IF_ERROR(Check(1));
//     RDMARPC_ASSIGN_OR_RETURN(int v, Compute());
//     ...
//   }
#ifndef RDMARPC_STATUS_H_
#define RDMARPC_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace rdmarpc {

using Status = absl::Status;
using StatusCode = absl::StatusCode;
template <typename T>
using StatusOr = absl::StatusOr<T>;

}  // namespace rdmarpc

#define RDMARPC_STATUS_CONCAT_INNER_(a, b) a##b
#define RDMARPC_STATUS_CONCAT_(a, b) RDMARPC_STATUS_CONCAT_INNER_(a, b)

// Returns the status of `expr` from the enclosing function if it is not OK.
#define RDMARPC_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status rdmarpc_status_ = (expr);           \
    if (!rdmarpc_status_.ok()) return rdmarpc_status_; \
  } while (false)

// Evaluates `rexpr` (a StatusOr); returns its status if not OK, else moves
// its value into `lhs` (which may be a declaration).
#define RDMARPC_ASSIGN_OR_RETURN(lhs, rexpr) \
  RDMARPC_ASSIGN_OR_RETURN_IMPL_(            \
      RDMARPC_STATUS_CONCAT_(rdmarpc_statusor_, __LINE__), lhs, rexpr)

#define RDMARPC_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();   \
  lhs = std::move(statusor).value()

#endif  // RDMARPC_STATUS_H_
