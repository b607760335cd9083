// CUDA tensors on the gRPC path: staged through host memory on the sender,
// landing on the device the receiver chose. Skips without a usable GPU.
#include "e2e_fixture.h"

namespace rdmarpc_test {
namespace {

class GpuE2ETest : public ::testing::Test {
 protected:
  void SetUp() override {
    rdmarpc::Status gpu = rdmarpc::CudaDeviceStatus(0);
    if (!gpu.ok()) GTEST_SKIP() << "no usable GPU: " << gpu.message();
    auto server = rdmarpc::ServerBuilder()
                      .AddListeningPort("127.0.0.1:0", &port_)
                      .RegisterService(&service_)
                      .SetTensorPlacement(rdmarpc::Device::Cuda(0))
                      .BuildAndStart();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = E2E::NewStub(
        rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port_)));
  }

  // Sends `size` bytes from `from`, asks for the response on `to`.
  void RoundTrip(size_t size, rdmarpc::Device from, rdmarpc::Device to) {
    std::vector<uint8_t> host(size);
    for (size_t i = 0; i < size; ++i) host[i] = static_cast<uint8_t>(i * 31);
    auto src = rdmarpc::TensorBuffer::Allocate(size, from);
    ASSERT_TRUE(src.ok()) << src.status();
    ASSERT_TRUE(rdmarpc::CopyBytes(src->data(), from, host.data(),
                                   rdmarpc::Device::Host(), size)
                    .ok());
    rdmarpc::ClientContext ctx;
    ctx.set_response_placement(to);
    EchoRequest req;
    ASSERT_TRUE(ctx.tensors()
                    .Set(req.mutable_tensor(), rdmarpc::DTYPE_U8,
                         {static_cast<int64_t>(size)}, *src)
                    .ok());
    EchoResponse resp;
    rdmarpc::Status s = stub_->Echo(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s;
    auto out = ctx.tensors().Get(resp.tensor());
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->device(), to);
    EXPECT_EQ(resp.tensor().device_type(), to.type);
    std::vector<uint8_t> back(size);
    ASSERT_TRUE(rdmarpc::CopyBytes(back.data(), rdmarpc::Device::Host(),
                                   out->data(), out->device(), size)
                    .ok());
    EXPECT_EQ(back, host);
  }

  E2EService service_;
  int port_ = 0;
  std::unique_ptr<rdmarpc::Server> server_;
  std::unique_ptr<E2E::Stub> stub_;
};

TEST_F(GpuE2ETest, HostToDevice) {
  RoundTrip(5 << 20, rdmarpc::Device::Host(), rdmarpc::Device::Cuda(0));
}

TEST_F(GpuE2ETest, DeviceToHost) {
  RoundTrip(5 << 20, rdmarpc::Device::Cuda(0), rdmarpc::Device::Host());
}

TEST_F(GpuE2ETest, DeviceToDevice) {
  RoundTrip(64 << 20, rdmarpc::Device::Cuda(0), rdmarpc::Device::Cuda(0));
}

TEST_F(GpuE2ETest, TinyAndEmpty) {
  RoundTrip(1, rdmarpc::Device::Cuda(0), rdmarpc::Device::Cuda(0));
  RoundTrip(0, rdmarpc::Device::Cuda(0), rdmarpc::Device::Cuda(0));
}

}  // namespace
}  // namespace rdmarpc_test
