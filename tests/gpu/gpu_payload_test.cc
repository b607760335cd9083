// Tensors in GPU memory over every transport this machine has: byte-exact
// round trips of several dtypes and sizes in each direction, staging under
// concurrent load, each registration mode forced, and ordering with the
// CUDA streams that produce and consume the tensors.
//
// Without a usable GPU every test skips and says why; the rdma cases skip
// on a machine without an ACTIVE RDMA port.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "e2e_fixture.h"
#include "stream_kernels.h"
#include "transport/rdma/payload_mover.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc_test {
namespace {

using rdmarpc::Device;

const Device kGpu = Device::Cuda(0);

struct GpuCase {
  std::string name;
  rdmarpc::TransportPolicy policy;
  rdmarpc::TransportKind expected;
};

class GpuPayloadTest : public ::testing::TestWithParam<GpuCase> {
 protected:
  void SetUp() override {
    rdmarpc::Status gpu = rdmarpc::CudaDeviceStatus(0);
    if (!gpu.ok()) GTEST_SKIP() << "no usable GPU: " << gpu.message();
    if (GetParam().expected == rdmarpc::TransportKind::kRdma) {
      auto rdma = rdmarpc::rdma::FindRdmaIpv4Address();
      if (!rdma.ok()) {
        GTEST_SKIP() << "no RDMA device here: " << rdma.status().message();
      }
    }
  }

  // A server whose request tensors land on `placement`, forced to `mode`.
  std::unique_ptr<rdmarpc::Server> StartServer(Device placement,
                                               rdmarpc::GpuRdmaMode mode,
                                               int* port) {
    auto server = rdmarpc::ServerBuilder()
                      .AddListeningPort("127.0.0.1:0", port)
                      .RegisterService(&service_)
                      .SetTensorPlacement(placement)
                      .SetGpuRdmaMode(mode)
                      .BuildAndStart();
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? *std::move(server) : nullptr;
  }

  std::unique_ptr<E2E::Stub> Connect(int port, rdmarpc::GpuRdmaMode mode) {
    rdmarpc::ChannelOptions options;
    options.policy = GetParam().policy;
    options.gpu_rdma_mode = mode;
    return E2E::NewStub(
        rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port), options));
  }

  // Sends `bytes` from `from`; the response lands on `to`. Returns the
  // call's stats after checking every byte.
  rdmarpc::CallStats RoundTrip(E2E::Stub* stub, rdmarpc::DType dtype,
                               size_t bytes, Device from, Device to,
                               uint32_t seed) {
    std::vector<uint8_t> host = Pattern(bytes, seed);
    auto src = rdmarpc::TensorBuffer::Allocate(bytes, from);
    EXPECT_TRUE(src.ok()) << src.status();
    if (!src.ok()) return {};
    EXPECT_TRUE(rdmarpc::CopyBytes(src->data(), from, host.data(),
                                   Device::Host(), bytes)
                    .ok());
    rdmarpc::ClientContext ctx;
    ctx.set_response_placement(to);
    EchoRequest req;
    const int64_t elements =
        static_cast<int64_t>(bytes / rdmarpc::DTypeSize(dtype));
    EXPECT_TRUE(
        ctx.tensors().Set(req.mutable_tensor(), dtype, {elements}, *src).ok());
    EchoResponse resp;
    rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s << " (" << bytes << " bytes " << from.ToString()
                        << " -> " << to.ToString() << ")";
    if (!s.ok()) return ctx.stats();
    EXPECT_EQ(ctx.stats().transport, GetParam().expected)
        << ctx.stats().ToString();
    auto out = ctx.tensors().Get(resp.tensor());
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return ctx.stats();
    EXPECT_EQ(out->device(), to);
    EXPECT_EQ(out->dtype(), dtype);
    std::vector<uint8_t> back(bytes);
    EXPECT_TRUE(rdmarpc::CopyBytes(back.data(), Device::Host(), out->data(),
                                   out->device(), bytes)
                    .ok());
    EXPECT_TRUE(back == host) << bytes << " bytes " << from.ToString() << " -> "
                              << to.ToString() << " differ";
    return ctx.stats();
  }

  E2EService service_;
};

struct Direction {
  Device send, server, receive;
};

TEST_P(GpuPayloadTest, DTypesAndSizesRoundTripByteExactEachWay) {
  int gpu_port = 0, host_port = 0;
  auto on_gpu = StartServer(kGpu, rdmarpc::GpuRdmaMode::kAuto, &gpu_port);
  auto on_host =
      StartServer(Device::Host(), rdmarpc::GpuRdmaMode::kAuto, &host_port);
  ASSERT_TRUE(on_gpu && on_host);
  auto to_gpu = Connect(gpu_port, rdmarpc::GpuRdmaMode::kAuto);
  auto to_host = Connect(host_port, rdmarpc::GpuRdmaMode::kAuto);
  // Each leg of each call: host->device, device->host, device->device.
  const Direction directions[] = {
      {Device::Host(), kGpu, kGpu},  // h->d, then d->d
      {kGpu, Device::Host(), kGpu},  // d->h, then h->d
      {kGpu, kGpu, Device::Host()},  // d->d, then d->h
  };
  const rdmarpc::DType dtypes[] = {rdmarpc::DTYPE_U8, rdmarpc::DTYPE_F16,
                                   rdmarpc::DTYPE_F32, rdmarpc::DTYPE_F64,
                                   rdmarpc::DTYPE_I64};
  const size_t sizes[] = {1, 4099, 64 << 10, 1 << 20, (16 << 20) + 8};
  uint32_t seed = 1;
  for (const Direction& d : directions) {
    E2E::Stub* stub = d.server.is_cuda() ? to_gpu.get() : to_host.get();
    for (rdmarpc::DType dtype : dtypes) {
      for (size_t size : sizes) {
        const size_t unit = rdmarpc::DTypeSize(dtype);
        const size_t bytes = std::max(unit, size / unit * unit);
        RoundTrip(stub, dtype, bytes, d.send, d.receive, seed++);
      }
    }
  }
}

TEST_P(GpuPayloadTest, OneGibibyteDeviceToDevice) {
  int port = 0;
  auto server = StartServer(kGpu, rdmarpc::GpuRdmaMode::kAuto, &port);
  ASSERT_TRUE(server);
  auto stub = Connect(port, rdmarpc::GpuRdmaMode::kAuto);
  rdmarpc::CallStats stats = RoundTrip(stub.get(), rdmarpc::DTYPE_BF16,
                                       size_t{1} << 30, kGpu, kGpu, 7);
  std::cout << "1 GiB cuda:0 -> cuda:0: " << stats.ToString() << "\n";
}

TEST_P(GpuPayloadTest, StagingUnderConcurrentLoad) {
  int port = 0;
  auto server = StartServer(kGpu, rdmarpc::GpuRdmaMode::kStaging, &port);
  ASSERT_TRUE(server);
  auto stub = Connect(port, rdmarpc::GpuRdmaMode::kStaging);
  constexpr int kThreads = 8;
  constexpr int kCalls = 12;
  std::vector<std::thread> threads;
  std::atomic<int> staged{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int c = 0; c < kCalls; ++c) {
        // Sizes that are not whole chunks, so the last chunk is short.
        size_t bytes = (size_t{9} << 20) + 4096 * t + c;
        rdmarpc::CallStats stats = RoundTrip(stub.get(), rdmarpc::DTYPE_U8,
                                             bytes, kGpu, kGpu, 100 * t + c);
        if (stats.gpu_rdma_mode == "staging") ++staged;
      }
    });
  }
  for (auto& t : threads) t.join();
  if (GetParam().expected == rdmarpc::TransportKind::kRdma) {
    EXPECT_EQ(staged.load(), kThreads * kCalls);
  }
}

TEST_P(GpuPayloadTest, EachRegistrationModeForcedIsUsedOnlyWhereItWorks) {
  for (rdmarpc::GpuRdmaMode mode :
       {rdmarpc::GpuRdmaMode::kDmaBuf, rdmarpc::GpuRdmaMode::kPeerMemory,
        rdmarpc::GpuRdmaMode::kStaging}) {
    SCOPED_TRACE(rdmarpc::GpuRdmaModeName(mode));
    int port = 0;
    auto server = StartServer(kGpu, mode, &port);
    ASSERT_TRUE(server);
    auto stub = Connect(port, mode);
    rdmarpc::CallStats stats = RoundTrip(stub.get(), rdmarpc::DTYPE_F32,
                                         size_t{8} << 20, kGpu, kGpu, 42);
    std::cout << rdmarpc::GpuRdmaModeName(mode)
              << " forced: " << stats.ToString() << "\n";
    if (GetParam().expected != rdmarpc::TransportKind::kRdma) {
      EXPECT_TRUE(stats.gpu_rdma_mode.empty()) << stats.ToString();
      continue;
    }
    if (stats.gpu_rdma_mode == rdmarpc::GpuRdmaModeName(mode)) {
      EXPECT_EQ(stats.gpu_rdma_reason, "requested");
    } else {
      // Detection said no: staging, with the reason.
      EXPECT_EQ(stats.gpu_rdma_mode, "staging");
      EXPECT_NE(stats.gpu_rdma_reason.find("does not work"), std::string::npos)
          << stats.gpu_rdma_reason;
    }
  }
}

TEST_P(GpuPayloadTest,
       SendWaitsForTheProducersStreamAndReceiveOrdersTheConsumers) {
  int port = 0;
  auto server = StartServer(kGpu, rdmarpc::GpuRdmaMode::kAuto, &port);
  ASSERT_TRUE(server);
  auto stub = Connect(port, rdmarpc::GpuRdmaMode::kAuto);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
            cudaSuccess);
  unsigned long long* mismatches = nullptr;
  ASSERT_EQ(
      cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof(*mismatches)),
      cudaSuccess);
  for (size_t bytes : {size_t{256}, size_t{8} << 20}) {
    SCOPED_TRACE(bytes);
    auto src = rdmarpc::TensorBuffer::Allocate(bytes, kGpu);
    ASSERT_TRUE(src.ok()) << src.status();
    ASSERT_EQ(cudaMemset(src->data(), 0, bytes), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    // The producer: 100 ms of spinning, then the final bytes (0xA5). No
    // synchronization before the call: the runtime must wait on `stream`.
    LaunchSlowFill(stream, static_cast<uint8_t*>(src->data()), bytes, 0xA5,
                   100);
    rdmarpc::ClientContext ctx;
    ctx.set_cuda_stream(stream);
    ctx.set_response_placement(kGpu);
    EchoRequest req;
    ASSERT_TRUE(ctx.tensors()
                    .Set(req.mutable_tensor(), rdmarpc::DTYPE_U8,
                         {static_cast<int64_t>(bytes)}, *src)
                    .ok());
    EchoResponse resp;
    rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s;
    auto out = ctx.tensors().Get(resp.tensor());
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->device(), kGpu);
    // The consumer reads the response on the same stream: ordered after
    // the copy into it without a device-wide synchronization.
    LaunchCountMismatches(stream, static_cast<const uint8_t*>(out->data()),
                          bytes, 0xA5, mismatches);
    unsigned long long host_mismatches = ~0ull;
    ASSERT_EQ(
        cudaMemcpyAsync(&host_mismatches, mismatches, sizeof(host_mismatches),
                        cudaMemcpyDefault, stream),
        cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(host_mismatches, 0u) << ctx.stats().ToString();
  }
  cudaFree(mismatches);
  cudaStreamDestroy(stream);
}

// A peer that writes less than its grant and announces it done leaves the
// reader whatever its landing memory held: each GPU mover must hand out
// landing memory that reads as zero, though its pools held earlier calls'
// bytes (a landing of the same size comes back at the same address).
TEST(GpuLandingTest, LandingMemoryReadsAsZeroWhereNoPeerWrote) {
  rdmarpc::Status gpu = rdmarpc::CudaDeviceStatus(0);
  if (!gpu.ok()) GTEST_SKIP() << "no usable GPU: " << gpu.message();
  for (rdmarpc::GpuRdmaMode mode :
       {rdmarpc::GpuRdmaMode::kDmaBuf, rdmarpc::GpuRdmaMode::kStaging}) {
    const rdmarpc::rdma::PayloadMover& mover =
        rdmarpc::rdma::GpuMoverForTesting(mode);
    // Below the size whose staging clear waits for registration aside.
    for (size_t n : {size_t{4096}, size_t{512} << 10}) {
      SCOPED_TRACE(std::string(rdmarpc::GpuRdmaModeName(mode)) + " " +
                   std::to_string(n));
      const void* earlier = nullptr;
      for (int round = 0; round < 2; ++round) {
        rdmarpc::TensorBuffer staged_to;
        auto landing = mover.AllocateLanding(kGpu, n, {}, &staged_to);
        ASSERT_TRUE(landing.ok()) << landing.status();
        if (round == 1) {
          EXPECT_EQ(landing->data(), earlier) << "the pool did not reuse it";
        }
        std::vector<uint8_t> back(n, 0xFF);
        ASSERT_TRUE(rdmarpc::CopyBytes(back.data(), Device::Host(),
                                       landing->data(), landing->device(), n)
                        .ok());
        EXPECT_EQ(std::count(back.begin(), back.end(), 0),
                  static_cast<ptrdiff_t>(n));
        // An earlier call's bytes, left behind.
        const std::vector<uint8_t> left(n, 0xAB);
        ASSERT_TRUE(rdmarpc::CopyBytes(landing->data(), landing->device(),
                                       left.data(), Device::Host(), n)
                        .ok());
        earlier = landing->data();
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Gpu, GpuPayloadTest,
    ::testing::Values(GpuCase{"grpc", rdmarpc::TransportPolicy::kGrpc,
                              rdmarpc::TransportKind::kGrpc},
                      GpuCase{"rdma", rdmarpc::TransportPolicy::kRdma,
                              rdmarpc::TransportKind::kRdma}),
    [](const ::testing::TestParamInfo<GpuCase>& info) {
      return info.param.name;
    });

}  // namespace
}  // namespace rdmarpc_test
