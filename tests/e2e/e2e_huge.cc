// A 3 GiB tensor, over protobuf's 2 GiB limit, round-trips byte-exact.
// Separate binary: it needs about 10 GiB of memory and runs alone.
#include "e2e_fixture.h"

namespace rdmarpc_test {
namespace {

TEST_P(E2ETest, ThreeGiBTensorRoundTrips) {
  const size_t size = size_t{3} << 30;
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < size; i += 4096) {
    bytes[i] = static_cast<uint8_t>(i >> 12);
    bytes[i + 4095] = static_cast<uint8_t>(i >> 20);
  }
  bytes[size - 1] = 0x5a;
  rdmarpc::ClientContext ctx;
  ctx.set_timeout(std::chrono::minutes(5));
  EchoRequest req;
  ASSERT_TRUE(ctx.tensors()
                  .Set(req.mutable_tensor(), rdmarpc::DTYPE_U8,
                       {static_cast<int64_t>(size)},
                       rdmarpc::TensorBuffer::Borrow(bytes.data(), size))
                  .ok());
  EchoResponse resp;
  auto start = std::chrono::steady_clock::now();
  rdmarpc::Status s = stub_->Echo(&ctx, req, &resp);
  double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  ASSERT_TRUE(s.ok()) << s;
  auto out = ctx.tensors().Get(resp.tensor());
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), size);
  EXPECT_EQ(0, std::memcmp(out->data(), bytes.data(), size));
  std::printf("3 GiB echo over %s took %.1f s (%s)\n",
              rdmarpc::TransportName(ctx.stats().transport), seconds,
              ctx.stats().ToString().c_str());
}

INSTANTIATE_TEST_SUITE_P(Grpc, E2ETest,
                         ::testing::Values(TransportCase{
                             "grpc", rdmarpc::TransportPolicy::kGrpc,
                             rdmarpc::TransportKind::kGrpc}),
                         CaseName);

}  // namespace
}  // namespace rdmarpc_test
