// Conversions between grpc::Status and absl::Status. The canonical codes
// have the same numbers on both sides.
#ifndef RDMARPC_TRANSPORT_GRPC_STATUS_CONVERT_H_
#define RDMARPC_TRANSPORT_GRPC_STATUS_CONVERT_H_

#include <grpcpp/support/status.h>

#include "rdmarpc/status.h"

namespace rdmarpc::grpc_transport {

inline Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return Status(static_cast<StatusCode>(s.error_code()), s.error_message());
}

inline grpc::Status ToGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      std::string(s.message()));
}

}  // namespace rdmarpc::grpc_transport

#endif  // RDMARPC_TRANSPORT_GRPC_STATUS_CONVERT_H_
