// Fuzzes the gRPC transport's lean framing decoder (LeanReceiver + the
// runtime's tensor checks) with arbitrary peer messages. The input is a
// sequence of messages, each prefixed by a 2-byte little-endian length.
// Any input must end in OK or a clean error: never a crash, a sanitizer
// report, or a write outside the landing buffers.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_seeds.h"
#include "runtime_test.pb.h"
#include "transport/grpc/lean_codec.h"

namespace {

using rdmarpc::grpc_transport::LeanHead;

grpc::ByteBuffer ToBuffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rdmarpc_runtime_test::Outer msg;
  rdmarpc::CallTensors tensors;
  rdmarpc::grpc_transport::LeanReceiver receiver(
      [&](const LeanHead& head)
          -> rdmarpc::StatusOr<std::vector<rdmarpc::TensorBuffer>> {
        RDMARPC_ASSIGN_OR_RETURN(auto r,
                                 rdmarpc::grpc_transport::AcceptHead(
                                     head, &msg, rdmarpc::Device::Host(),
                                     /*max_bytes=*/1 << 20, nullptr, &tensors));
        return std::move(r.landing);
      });
  size_t pos = 0;
  while (pos + 2 <= size) {
    size_t len = data[pos] | (size_t{data[pos + 1]} << 8);
    pos += 2;
    if (len > size - pos) len = size - pos;
    std::string bytes(reinterpret_cast<const char*>(data + pos), len);
    pos += len;
    grpc::ByteBuffer message = ToBuffer(bytes);
    if (!receiver.OnMessage(&message).ok()) return 0;
  }
  (void)receiver.OnEnd();
  return 0;
}

std::vector<std::string> FuzzSeeds() {
  auto frame = [](const std::vector<std::string>& messages) {
    std::string out;
    for (const std::string& m : messages) {
      out.push_back(static_cast<char>(m.size() & 0xff));
      out.push_back(static_cast<char>(m.size() >> 8));
      out += m;
    }
    return out;
  };
  rdmarpc_runtime_test::Outer outer;
  outer.mutable_first()->set_dtype(rdmarpc::DTYPE_U8);
  outer.mutable_first()->add_shape(16);
  auto* extra = outer.add_extras();
  extra->set_dtype(rdmarpc::DTYPE_I32);
  extra->add_shape(2);
  extra->set_data(std::string(8, '\1'));
  LeanHead head;
  head.set_version(rdmarpc::grpc_transport::kLeanVersion);
  head.set_message(outer.SerializeAsString());
  head.add_tensors()->set_out_of_band(true);
  head.mutable_tensors(0)->set_size(16);
  head.add_tensors()->set_size(8);
  const std::string marker(1, rdmarpc::grpc_transport::kLeanMarker);
  std::string h = marker + head.SerializeAsString();
  head.set_first_chunk(std::string(5, 'c'));
  std::string with_chunk = marker + head.SerializeAsString();
  return {frame({h, std::string(16, 'x')}),
          frame({h, std::string(7, 'a'), std::string(9, 'b')}),
          frame({with_chunk, std::string(11, 'd')}), frame({h}), frame({})};
}
