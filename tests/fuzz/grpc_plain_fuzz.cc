// Fuzz target for what a plain gRPC peer or an rdmarpc client sends beside
// the lean frames (transport/grpc/lean_codec.h): the first byte picks a
// plain request (protobuf with tensor bytes inline, checked against each
// tensor's dtype and shape by the codec) or the re-send metadata value; the
// rest is the peer's bytes. Any input ends in OK or a clean error.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_seeds.h"
#include "runtime_test.pb.h"
#include "transport/grpc/lean_codec.h"

namespace {

using namespace rdmarpc::grpc_transport;

enum Decoder : char { kPlainRequest = 0, kResend = 1 };

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == kResend) {
    auto r = ParseResendMetadata(bytes);
    if (r && r->client_id == 0) std::abort();
    return 0;
  }
  rdmarpc_runtime_test::Outer msg;
  rdmarpc::CallTensors tensors;
  grpc::Slice slice(bytes);
  grpc::ByteBuffer buffer(&slice, 1);
  rdmarpc::Status s = AcceptPlainRequest(
      &buffer, &msg,
      rdmarpc::internal::TensorPlacement(rdmarpc::Device::Host()),
      /*max_bytes=*/1 << 20, nullptr, &tensors);
  if (s.ok()) {
    // Every accepted tensor reads back as exactly its described bytes.
    if (msg.has_first()) {
      auto view = tensors.Get(msg.first());
      if (view.ok() && view->size() != msg.first().byte_size()) std::abort();
    }
  }
  return 0;
}

std::vector<std::string> FuzzSeeds() {
  rdmarpc_runtime_test::Outer plain;
  rdmarpc::Tensor* first = plain.mutable_first();
  first->set_dtype(rdmarpc::DTYPE_F32);
  first->add_shape(2);
  first->set_byte_size(8);
  first->set_data(std::string(8, '\1'));
  rdmarpc::Tensor* extra = plain.add_extras();
  extra->set_dtype(rdmarpc::DTYPE_U8);
  extra->add_shape(3);
  extra->set_byte_size(3);
  extra->set_data("abc");
  (*plain.mutable_labels())["k"] = "v";
  return {std::string(1, kPlainRequest) + plain.SerializeAsString(),
          std::string(1, kResend) + "77.12345.250",
          std::string(1, kResend) + "0.1.2"};
}
