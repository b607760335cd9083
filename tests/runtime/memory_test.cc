#include "rdmarpc/memory.h"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "runtime/cuda_support.h"
#include "runtime/first_fit.h"
#include "transport/rdma/gpu_registration.h"

namespace rdmarpc {
namespace {

// Without a driver, the CUDA runtime reports "driver version is
// insufficient": the status must say there is no driver instead.
TEST(CudaDeviceStatusTest, NoDriverIsNotCalledAnOldDriver) {
  if (void* driver = dlopen("libcuda.so.1", RTLD_LAZY)) {
    dlclose(driver);
    GTEST_SKIP() << "an NVIDIA driver is installed here";
  }
  Status s = CudaDeviceStatus(0);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message().find("insufficient"), std::string::npos) << s;
  EXPECT_TRUE(s.message().find("no NVIDIA driver") != std::string::npos ||
              s.message().find("built without CUDA") != std::string::npos)
      << s;
}

TEST(TensorBufferTest, AllocateOwnsAndSharesBytes) {
  auto b = TensorBuffer::Allocate(100);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->size(), 100u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 64, 0u);
  TensorBuffer copy = *b;
  EXPECT_EQ(copy.data(), b->data());
  TensorBuffer part = b->Slice(10, 20);
  EXPECT_EQ(static_cast<char*>(part.data()),
            static_cast<char*>(b->data()) + 10);
  EXPECT_EQ(part.size(), 20u);
}

TEST(TensorBufferTest, ShareKeepsOwnerAlive) {
  auto owner = std::make_shared<std::vector<char>>(8, 'z');
  std::weak_ptr<std::vector<char>> watch = owner;
  TensorBuffer b = TensorBuffer::Share(owner, owner->data(), owner->size());
  owner.reset();
  EXPECT_FALSE(watch.expired());
  EXPECT_EQ(static_cast<char*>(b.data())[7], 'z');
  b = TensorBuffer();
  EXPECT_TRUE(watch.expired());
}

TEST(HostMemoryPoolTest, AllocatesFreesAndCoalesces) {
  auto pool = NewHostMemoryPool(1 << 20);
  ASSERT_NE(pool, nullptr);
  {
    auto a = pool->Allocate(600 << 10);
    ASSERT_TRUE(a.ok());
    // Not enough left for a second big buffer.
    EXPECT_EQ(pool->Allocate(600 << 10).status().code(),
              absl::StatusCode::kResourceExhausted);
    auto b = pool->Allocate(100);
    ASSERT_TRUE(b.ok());
    std::memset(b->data(), 1, 100);
  }
  // Both freed and merged: the whole pool is one block again.
  auto all = pool->Allocate(1 << 20);
  EXPECT_TRUE(all.ok()) << all.status();
}

// Takes are first fit by offset; a block given back merges with a free
// neighbour before it, after it, or both, so the region ends whole.
TEST(FirstFitTest, TakesFirstFitAndMergesGivesBothWays) {
  internal::FirstFit fit(1000);
  for (size_t at = 0; at < 400; at += 100) EXPECT_EQ(fit.Take(100), at);
  EXPECT_EQ(fit.Take(601), std::nullopt);  // 600 left, at 400
  fit.Give(100, 100);                      // a hole, both neighbours taken
  EXPECT_EQ(fit.Take(50), 100u);           // first fit: the hole
  fit.Give(100, 50);                       // joins the hole's rest after it
  fit.Give(0, 100);                        // joins the block after it
  fit.Give(300, 100);                      // joins the tail after it
  EXPECT_EQ(fit.Take(201), 300u);          // 0..200 is too small
  fit.Give(300, 201);
  fit.Give(200, 100);  // joins the blocks before and after it
  EXPECT_EQ(fit.Take(1000), 0u);
  EXPECT_EQ(fit.Take(1), std::nullopt);

  internal::FirstFit tail(300);
  for (size_t at = 0; at < 300; at += 100) EXPECT_EQ(tail.Take(100), at);
  tail.Give(0, 100);
  tail.Give(100, 100);  // joins the block before it
  EXPECT_EQ(tail.Take(200), 0u);
}

TEST(CudaTest, UnavailableIsReportedNotFatal) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "this machine has a GPU";
  Status s = CudaDeviceStatus(0);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_FALSE(s.message().empty());
  EXPECT_EQ(TensorBuffer::Allocate(16, Device::Cuda(0)).status().code(),
            absl::StatusCode::kUnavailable);
}

char this_is_host_memory_[64];

TEST(CudaTest, GpuPoolsAndStagingReportUnavailableWithoutAGpu) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "this machine has a GPU";
  auto pool = NewCudaMemoryPool(0, 1 << 20);
  EXPECT_EQ(pool.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(pool.status().message().find("CUDA"), std::string::npos)
      << pool.status();
  EXPECT_EQ(internal::AllocatePinnedStaging(4096).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(internal::AllocateGpuLanding(0, 4096).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_FALSE(internal::CudaIsPinnedHost(this_is_host_memory_));
}

TEST(GpuRdmaModeTest, NamesAndEnvironmentOverride) {
  EXPECT_STREQ(GpuRdmaModeName(GpuRdmaMode::kDmaBuf), "dma-buf");
  EXPECT_STREQ(GpuRdmaModeName(GpuRdmaMode::kPeerMemory), "peer-memory");
  unsetenv("RDMARPC_GPU_RDMA_MODE");
  EXPECT_EQ(*rdma::GpuRdmaModeFromEnvironment(), GpuRdmaMode::kAuto);
  for (GpuRdmaMode m : {GpuRdmaMode::kAuto, GpuRdmaMode::kDmaBuf,
                        GpuRdmaMode::kPeerMemory, GpuRdmaMode::kStaging}) {
    setenv("RDMARPC_GPU_RDMA_MODE", GpuRdmaModeName(m), 1);
    auto parsed = rdma::GpuRdmaModeFromEnvironment();
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, m);
  }
  setenv("RDMARPC_GPU_RDMA_MODE", "gdr", 1);
  auto bad = rdma::GpuRdmaModeFromEnvironment();
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("dma-buf"), std::string::npos);
  unsetenv("RDMARPC_GPU_RDMA_MODE");
}

TEST(PeerMemoryProbeTest, AgreesWithTheModulesSysfsEntry) {
  struct stat st {};
  const bool loaded =
      stat("/sys/module/nvidia_peermem", &st) == 0 ||
      stat("/sys/kernel/mm/memory_peers/nv_mem/version", &st) == 0;
  Status probe = rdma::ProbePeerMemory();
  EXPECT_EQ(probe.ok(), loaded) << probe;
  if (!loaded) {
    EXPECT_NE(probe.message().find("modprobe nvidia-peermem"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace rdmarpc
