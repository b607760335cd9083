// The install test's consumer: serves its own Reverser service on
// 127.0.0.1:0, calls it through the generated Stub with a tensor and checks
// the result byte for byte. Exits 0 on success, 1 on failure.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "demo.rdmarpc.pb.h"
#include "rdmarpc/rdmarpc.h"

namespace {

class ReverserImpl final : public consumer_demo::Reverser::Service {
 public:
  rdmarpc::Status Reverse(rdmarpc::ServerContext* ctx,
                          const consumer_demo::ReverseRequest& req,
                          consumer_demo::ReverseResponse* resp) override {
    RDMARPC_ASSIGN_OR_RETURN(rdmarpc::TensorView in,
                             ctx->tensors().Get(req.input()));
    if (in.dtype() != rdmarpc::DTYPE_U8 || !in.device().is_host()) {
      return absl::InvalidArgumentError("input must be a u8 host tensor");
    }
    RDMARPC_ASSIGN_OR_RETURN(rdmarpc::TensorBuffer out,
                             rdmarpc::TensorBuffer::Allocate(in.size()));
    const auto* src = in.host_data<uint8_t>();
    auto* dst = static_cast<uint8_t*>(out.data());
    for (size_t i = 0; i < in.size(); ++i) dst[i] = src[in.size() - 1 - i];
    resp->set_tag(req.tag());
    return ctx->tensors().Set(resp->mutable_output(), rdmarpc::DTYPE_U8,
                              in.shape(), std::move(out));
  }
};

}  // namespace

int main() {
  ReverserImpl impl;
  int port = 0;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", &port)
                    .RegisterService(&impl)
                    .BuildAndStart();
  if (!server.ok()) {
    std::fprintf(stderr, "consumer: server failed to start: %s\n",
                 server.status().ToString().c_str());
    return 1;
  }
  std::printf("consumer: server on 127.0.0.1:%d\n", port);

  auto stub = consumer_demo::Reverser::NewStub(
      rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port)));

  // 3 x 1000 bytes, a pattern that is not a palindrome.
  std::vector<uint8_t> input(3000);
  for (size_t i = 0; i < input.size(); ++i) {
    input[i] = static_cast<uint8_t>((i * 7 + 3) % 251);
  }
  rdmarpc::ClientContext ctx;
  ctx.set_timeout(std::chrono::seconds(30));
  consumer_demo::ReverseRequest req;
  req.set_tag("install-test");
  rdmarpc::Status s = ctx.tensors().Set(
      req.mutable_input(), rdmarpc::DTYPE_U8, {3, 1000},
      rdmarpc::TensorBuffer::Borrow(input.data(), input.size()));
  consumer_demo::ReverseResponse resp;
  if (s.ok()) s = stub->Reverse(&ctx, req, &resp);
  int rc = 0;
  if (!s.ok()) {
    std::fprintf(stderr, "consumer: Reverse failed: %s\n",
                 s.ToString().c_str());
    rc = 1;
  } else {
    auto out = ctx.tensors().Get(resp.output());
    if (!out.ok()) {
      std::fprintf(stderr, "consumer: no output tensor: %s\n",
                   out.status().ToString().c_str());
      rc = 1;
    } else {
      std::vector<uint8_t> want(input.rbegin(), input.rend());
      bool shape_ok = out->shape() == std::vector<int64_t>{3, 1000};
      bool bytes_ok = out->dtype() == rdmarpc::DTYPE_U8 &&
                      out->device().is_host() && out->size() == want.size() &&
                      std::memcmp(out->data(), want.data(), want.size()) == 0;
      std::printf(
          "consumer: Reverse(u8[3,1000]) -> tag '%s', %s, shape [%lld,%lld], "
          "%zu bytes, first %u %u %u (want %u %u %u) -> %s\n",
          resp.tag().c_str(), rdmarpc::DTypeName(out->dtype()),
          out->shape().size() > 0 ? static_cast<long long>(out->shape()[0])
                                  : -1,
          out->shape().size() > 1 ? static_cast<long long>(out->shape()[1])
                                  : -1,
          out->size(),
          out->size() > 2 ? static_cast<const uint8_t*>(out->data())[0] : 0u,
          out->size() > 2 ? static_cast<const uint8_t*>(out->data())[1] : 0u,
          out->size() > 2 ? static_cast<const uint8_t*>(out->data())[2] : 0u,
          want[0], want[1], want[2],
          shape_ok && bytes_ok ? "byte-exact" : "WRONG");
      std::printf("consumer: %s\n", ctx.stats().ToString().c_str());
      if (!shape_ok || !bytes_ok || resp.tag() != "install-test") rc = 1;
    }
  }
  (*server)->Shutdown();
  std::printf("consumer: %s\n", rc == 0 ? "PASS" : "FAIL");
  return rc;
}
