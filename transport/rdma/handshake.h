// The RDMA handshake: the decoders of the Hello request a client sends on
// the server's gRPC port and of the answer it gets back, and the server's
// table of the one-time tokens it hands out in answers. Both messages are
// peer bytes, so each field is checked here before the transport uses it
// (fuzzed by tests/fuzz/handshake_fuzz.cc, with the CM private data of
// connection_setup.h).
//
//   bool no_rdma = false;
//   StatusOr<HelloAnswer> answer = ParseHelloAnswer(bytes, &no_rdma);
//   if (!answer.ok()) fall back, and stop trying when no_rdma;
//
//   TokenTable tokens(std::chrono::seconds(30));       // server
//   StatusOr<std::string> token = tokens.Issue(client_id);
//   std::optional<uint64_t> client = tokens.Redeem(presented);
#ifndef RDMARPC_TRANSPORT_RDMA_HANDSHAKE_H_
#define RDMARPC_TRANSPORT_RDMA_HANDSHAKE_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
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
  uint32_t first_receives = 0;
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

// The tokens a server handed out and not yet seen back. A CM connect
// request must present one, unused and unexpired. Thread-safe.
class TokenTable {
 public:
  explicit TokenTable(std::chrono::steady_clock::duration lifetime)
      : lifetime_(lifetime) {}

  // A fresh random token (kTokenBytes) for `client_id`; RESOURCE_EXHAUSTED
  // when too many wait for their connect.
  [[nodiscard]] StatusOr<std::string> Issue(uint64_t client_id);
  // The client id `token` was issued to, if it is valid; it is used up
  // either way.
  std::optional<uint64_t> Redeem(const std::string& token);
  // Voids every token (the listener went away, or shutdown).
  void Clear();

 private:
  struct Entry {
    std::chrono::steady_clock::time_point expires;
    uint64_t client_id = 0;
  };
  const std::chrono::steady_clock::duration lifetime_;
  std::mutex mu_;
  std::map<std::string, Entry> tokens_;
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_HANDSHAKE_H_
