// The RDMA handshake's decoders: the Hello request a client sends on the
// server's gRPC port, and the answer it gets back. Both are peer bytes, so
// each field is checked here before the transport uses it (fuzzed by
// tests/fuzz/handshake_fuzz.cc, with the CM private data of
// connection_setup.h).
//
//   bool no_rdma = false;
//   StatusOr<HelloAnswer> answer = ParseHelloAnswer(bytes, &no_rdma);
//   if (!answer.ok()) fall back, and stop trying when no_rdma;
#ifndef RDMARPC_TRANSPORT_RDMA_HANDSHAKE_H_
#define RDMARPC_TRANSPORT_RDMA_HANDSHAKE_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "rdmarpc/status.h"
#include "transport/rdma/rdma_frame.pb.h"

namespace rdmarpc::rdma {

// The server's answer, checked.
struct HelloAnswer {
  std::string cm_address;
  uint16_t cm_port = 0;
  std::string token;  // kTokenBytes
  uint32_t receives = 0;
  uint32_t receive_bytes = 0;
  uint64_t inline_threshold = 0;  // <= receive_bytes
  uint64_t server_instance = 0;
};

// The answer, or UNAVAILABLE saying what is wrong with it. `no_rdma` is set
// when the server has no RDMA or speaks another wire version: asking again
// will not help.
[[nodiscard]] StatusOr<HelloAnswer> ParseHelloAnswer(std::string_view bytes,
                                                     bool* no_rdma);

// INVALID_ARGUMENT unless `bytes` is a Hello request.
[[nodiscard]] StatusOr<HelloRequest> ParseHelloRequest(std::string_view bytes);

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_HANDSHAKE_H_
