// Fuzz target for the RDMA handshake's decoders (transport/rdma/handshake.h,
// connection_setup.h): the first byte picks the Hello request, the Hello
// answer, or the CM private data of a connect request; the rest is the
// peer's bytes. Each must return a Status, never crash, and what it accepts
// must hold the limits the transport relies on.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_seeds.h"
#include "transport/rdma/connection_setup.h"
#include "transport/rdma/handshake.h"
#include "transport/rdma/wire.h"

namespace {

using namespace rdmarpc::rdma;

enum Decoder : char { kHelloRequest = 0, kHelloAnswer = 1, kConnectData = 2 };

std::string Tagged(Decoder d, const std::string& bytes) {
  return std::string(1, d) + bytes;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string_view bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case kHelloRequest:
      (void)ParseHelloRequest(bytes);
      break;
    case kHelloAnswer: {
      bool no_rdma = false;
      auto answer = ParseHelloAnswer(bytes, &no_rdma);
      if (answer.ok()) {
        if (no_rdma || answer->cm_port == 0 ||
            answer->token.size() != kTokenBytes || answer->receives < 4 ||
            answer->first_receives < 4 ||
            answer->first_receives > answer->receives ||
            answer->receives > 4096 || answer->receive_bytes < 1024 ||
            answer->inline_threshold > answer->receive_bytes) {
          std::abort();
        }
      }
      break;
    }
    case kConnectData: {
      auto decoded = DecodeConnectData(bytes);
      if (decoded.ok() && decoded->token.size() != kTokenBytes) std::abort();
      break;
    }
  }
  return 0;
}

std::vector<std::string> FuzzSeeds() {
  HelloRequest request;
  request.set_version(kWireVersion);
  request.set_client_id(77);
  HelloResponse answer;
  answer.set_version(kWireVersion);
  answer.set_cm_address("198.18.0.1");
  answer.set_cm_port(4791);
  answer.set_token(std::string(kTokenBytes, 't'));
  answer.set_receives(64);
  answer.set_first_receives(16);
  answer.set_receive_bytes(32 << 10);
  answer.set_inline_threshold(24 << 10);
  answer.set_server_instance(5);
  HelloResponse refused;
  refused.set_unavailable_reason("no ACTIVE port");
  ConnectData connect;
  connect.token = std::string(kTokenBytes, 'k');
  connect.receives = 64;
  connect.first_receives = 16;
  connect.receive_bytes = 32 << 10;
  return {Tagged(kHelloRequest, request.SerializeAsString()),
          Tagged(kHelloAnswer, answer.SerializeAsString()),
          Tagged(kHelloAnswer, refused.SerializeAsString()),
          Tagged(kConnectData, EncodeConnectData(connect))};
}
