// Checks of the addresses users give: a server's listening address and a
// channel's target. gRPC takes both as strings and, given a malformed one,
// fails late with a guess (UNAVAILABLE, CANCELLED) or wraps an out-of-range
// port around; these checks name the problem up front, as INVALID_ARGUMENT.
//
//   RDMARPC_RETURN_IF_ERROR(internal::CheckListenAddress("0.0.0.0:50051"));
//   Status s = internal::CheckTarget("127.0.0.1:99999");
//   // s: INVALID_ARGUMENT "invalid target '127.0.0.1:99999': port 99999 is
//   //    out of range (1-65535)"
//
// Accepted: "host:port" and "[ipv6]:port"; a string with a gRPC scheme
// ("unix:", "unix-abstract:", "vsock:", "dns:", "ipv4:", "ipv6:") goes to
// gRPC as it is, once its scheme has something after it.
#ifndef RDMARPC_RUNTIME_ADDRESS_H_
#define RDMARPC_RUNTIME_ADDRESS_H_

#include <string>

#include "rdmarpc/status.h"

namespace rdmarpc::internal {

// A ServerBuilder::AddListeningPort address: port 0 picks a free port.
[[nodiscard]] Status CheckListenAddress(const std::string& address);
// A CreateChannel target: the port must be 1-65535.
[[nodiscard]] Status CheckTarget(const std::string& target);

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_ADDRESS_H_
