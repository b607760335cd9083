#include "transport/rdma/handshake.h"

#include "absl/strings/str_cat.h"
#include "transport/rdma/connection_setup.h"
#include "transport/rdma/wire.h"

namespace rdmarpc::rdma {

StatusOr<HelloAnswer> ParseHelloAnswer(std::string_view bytes, bool* no_rdma) {
  *no_rdma = false;
  HelloResponse server;
  if (!server.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::UnavailableError("RDMA handshake answer does not parse");
  }
  if (!server.unavailable_reason().empty()) {
    *no_rdma = true;
    return absl::UnavailableError(
        absl::StrCat("the server has no RDMA: ", server.unavailable_reason()));
  }
  if (server.version() != kWireVersion) {
    *no_rdma = true;
    return absl::UnavailableError(
        absl::StrCat("the server speaks RDMA wire version ", server.version(),
                     ", this client ", kWireVersion));
  }
  if (server.cm_port() == 0 || server.cm_port() > 65535 ||
      server.token().size() != kTokenBytes) {
    return absl::UnavailableError("RDMA handshake answer is malformed");
  }
  if (Status offered = CheckReceives(server.receives(), server.receive_bytes(),
                                     "the server's RDMA receives");
      !offered.ok()) {
    return absl::UnavailableError(offered.message());
  }
  if (server.inline_threshold() > server.receive_bytes()) {
    return absl::UnavailableError(absl::StrCat(
        "the server's inline threshold (", server.inline_threshold(),
        " bytes) exceeds its receive buffers (", server.receive_bytes(),
        " bytes)"));
  }
  HelloAnswer answer;
  answer.cm_address = server.cm_address();
  answer.cm_port = static_cast<uint16_t>(server.cm_port());
  answer.token = server.token();
  answer.receives = server.receives();
  answer.receive_bytes = server.receive_bytes();
  answer.inline_threshold = server.inline_threshold();
  answer.server_instance = server.server_instance();
  return answer;
}

StatusOr<HelloRequest> ParseHelloRequest(std::string_view bytes) {
  HelloRequest hello;
  if (!hello.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::InvalidArgumentError("RDMA hello does not parse");
  }
  return hello;
}

}  // namespace rdmarpc::rdma
