// The runtime's CUDA pieces under the RDMA transport's GPU paths, on a real
// GPU and without an RDMA device: chunked copies after a producer's fence,
// host functions after a fence, copies ordered before a consumer's stream,
// CopyBytes from pageable memory, the landing, pinned and user pools, and
// the driver calls GPU registration makes (dma-buf export, sync memops,
// write flush).
//
// The producers are kernels that spin 100 ms before writing, on a
// non-blocking stream; where a check runs on CUDA's host-function thread,
// the kernel writes pinned host memory, so the check reads what the GPU
// wrote by then. Every test skips without a usable GPU.
#include "runtime/cuda_support.h"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "rdmarpc/memory.h"
#include "stream_kernels.h"

namespace rdmarpc_test {
namespace {

using rdmarpc::Device;
using rdmarpc::Status;
using rdmarpc::TensorBuffer;
namespace internal = rdmarpc::internal;

constexpr uint8_t kFill = 0xA5;
const Device kGpu = Device::Cuda(0);

size_t CountNot(const uint8_t* data, size_t n, uint8_t value) {
  size_t bad = 0;
  for (size_t i = 0; i < n; ++i) bad += data[i] != value;
  return bad;
}

class CudaSupportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Status gpu = rdmarpc::CudaDeviceStatus(0);
    if (!gpu.ok()) GTEST_SKIP() << "no usable GPU: " << gpu.message();
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
              cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&mismatches_),
                         sizeof(*mismatches_)),
              cudaSuccess);
  }
  void TearDown() override {
    if (mismatches_ != nullptr) cudaFree(mismatches_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Bytes of [data, data + n) on the GPU that are not `value`, counted by a
  // kernel queued on stream_ now.
  unsigned long long MismatchesOnStream(const void* data, size_t n,
                                        uint8_t value) {
    LaunchCountMismatches(stream_, static_cast<const uint8_t*>(data), n, value,
                          mismatches_);
    unsigned long long host = ~0ull;
    EXPECT_EQ(cudaMemcpyAsync(&host, mismatches_, sizeof(host),
                              cudaMemcpyDefault, stream_),
              cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    return host;
  }

  // `n` zeroed bytes of pinned host memory (empty on an error).
  static TensorBuffer ZeroedPinned(size_t n) {
    auto pinned = internal::AllocatePinnedStaging(n);
    EXPECT_TRUE(pinned.ok()) << pinned.status();
    if (!pinned.ok()) return TensorBuffer();
    std::memset(pinned->data(), 0, n);
    return *std::move(pinned);
  }

  // Queues the slow fill of [data, data + n) with kFill on stream_; returns
  // a fence after it (null on an error).
  std::shared_ptr<internal::CudaFence> FillAfterSpin(void* data, size_t n) {
    LaunchSlowFill(stream_, static_cast<uint8_t*>(data), n, kFill, 100);
    auto fence = internal::CudaRecordFence(0, stream_);
    EXPECT_TRUE(fence.ok()) << fence.status();
    return fence.ok() ? *std::move(fence) : nullptr;
  }

  cudaStream_t stream_ = nullptr;
  unsigned long long* mismatches_ = nullptr;
};

// What the host-function thread saw, handed to the test's thread.
struct Seen {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<size_t> offsets, lengths, bad;

  void Add(size_t offset, size_t length, size_t mismatching) {
    std::lock_guard<std::mutex> lock(mu);
    offsets.push_back(offset);
    lengths.push_back(length);
    bad.push_back(mismatching);
    cv.notify_all();
  }
  bool WaitFor(size_t count) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(60),
                       [&] { return offsets.size() >= count; });
  }
};

TEST_F(CudaSupportTest, ChunkedCopyWaitsForTheProducerAndReportsChunksInOrder) {
  const size_t chunk = size_t{1} << 20;
  const size_t n = 5 * chunk + 123;  // a short last chunk
  auto src = TensorBuffer::Allocate(n, kGpu);
  ASSERT_TRUE(src.ok()) << src.status();
  ASSERT_EQ(cudaMemset(src->data(), 0, n), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  TensorBuffer dst = ZeroedPinned(n);
  ASSERT_NE(dst.data(), nullptr);
  auto fence = FillAfterSpin(src->data(), n);
  ASSERT_NE(fence, nullptr);
  Seen seen;
  const auto* landed = static_cast<const uint8_t*>(dst.data());
  int queued = 0;
  Status s = internal::CudaCopyInChunks(
      0, fence.get(), dst.data(), src->data(), n, chunk,
      [&](size_t offset, size_t length) {
        seen.Add(offset, length, CountNot(landed + offset, length, kFill));
      },
      &queued);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(queued, 6);
  ASSERT_TRUE(seen.WaitFor(6)) << "only " << seen.offsets.size() << " chunks";
  std::lock_guard<std::mutex> lock(seen.mu);
  for (size_t k = 0; k < 6; ++k) {
    EXPECT_EQ(seen.offsets[k], k * chunk);
    EXPECT_EQ(seen.lengths[k], k < 5 ? chunk : 123);
    EXPECT_EQ(seen.bad[k], 0u) << "chunk " << k << " read before its producer";
  }
}

TEST_F(CudaSupportTest, ThenAndFenceWaitComeAfterTheProducer) {
  // The producer writes pinned host memory, which the host function and
  // this thread read.
  const size_t n = 64 << 10;
  TensorBuffer pinned = ZeroedPinned(n);
  ASSERT_NE(pinned.data(), nullptr);
  auto fence = FillAfterSpin(pinned.data(), n);
  ASSERT_NE(fence, nullptr);
  Seen seen;
  const auto* bytes = static_cast<const uint8_t*>(pinned.data());
  Status s = internal::CudaThen(
      0, fence.get(), [&] { seen.Add(0, n, CountNot(bytes, n, kFill)); });
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(fence->Wait().ok());
  EXPECT_EQ(CountNot(bytes, n, kFill), 0u) << "Wait returned before the fill";
  ASSERT_TRUE(seen.WaitFor(1));
  std::lock_guard<std::mutex> lock(seen.mu);
  EXPECT_EQ(seen.bad[0], 0u) << "ran before the fenced kernel finished";
}

TEST_F(CudaSupportTest, OrderedCopyIsSeenByTheConsumersStream) {
  for (size_t n : {size_t{256}, size_t{9} << 20}) {
    SCOPED_TRACE(n);
    auto src = internal::AllocatePinnedStaging(n);
    ASSERT_TRUE(src.ok()) << src.status();
    std::memset(src->data(), kFill, n);
    auto dst = internal::AllocateGpuLanding(0, n);
    ASSERT_TRUE(dst.ok()) << dst.status();
    ASSERT_EQ(cudaMemset(dst->data(), 0, n), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    internal::ConsumerStream consumer{stream_};
    Status s = internal::CudaCopyOrdered(dst->data(), kGpu, src->data(),
                                         Device::Host(), n, &consumer, *src);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(MismatchesOnStream(dst->data(), n, kFill), 0u);
  }
}

TEST_F(CudaSupportTest, OrderedCopyWithoutAConsumerIsDoneOnReturn) {
  const size_t n = size_t{3} << 20;
  auto src = internal::AllocatePinnedStaging(n);
  ASSERT_TRUE(src.ok()) << src.status();
  std::memset(src->data(), kFill, n);
  auto dst = internal::AllocateGpuLanding(0, n);
  ASSERT_TRUE(dst.ok()) << dst.status();
  Status s = internal::CudaCopyOrdered(dst->data(), kGpu, src->data(),
                                       Device::Host(), n, nullptr, *src);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(MismatchesOnStream(dst->data(), n, kFill), 0u);
}

TEST_F(CudaSupportTest, CopyBytesFromPageableMemoryIsOnTheGpuWhenItReturns) {
  // Below and above the size that goes through pinned chunks.
  for (size_t n : {size_t{4096}, size_t{1} << 20, (size_t{9} << 20) + 5}) {
    SCOPED_TRACE(n);
    std::vector<uint8_t> pageable(n, kFill);
    auto dst = TensorBuffer::Allocate(n, kGpu);
    ASSERT_TRUE(dst.ok()) << dst.status();
    ASSERT_EQ(cudaMemset(dst->data(), 0, n), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_TRUE(rdmarpc::CopyBytes(dst->data(), kGpu, pageable.data(),
                                   Device::Host(), n)
                    .ok());
    // A kernel on a non-blocking stream, with no synchronization between.
    EXPECT_EQ(MismatchesOnStream(dst->data(), n, kFill), 0u);
    std::vector<uint8_t> back(n, 0);
    ASSERT_TRUE(
        rdmarpc::CopyBytes(back.data(), Device::Host(), dst->data(), kGpu, n)
            .ok());
    EXPECT_EQ(CountNot(back.data(), n, kFill), 0u);
  }
}

TEST_F(CudaSupportTest, PoolsServeTheirKindOfMemoryAndReuseIt) {
  auto landing = internal::AllocateGpuLanding(0, 1 << 20);
  ASSERT_TRUE(landing.ok()) << landing.status();
  EXPECT_EQ(landing->device(), kGpu);
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, landing->data()),
            cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
  const void* first = landing->data();
  *landing = TensorBuffer();
  auto again = internal::AllocateGpuLanding(0, 1 << 20);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->data(), first) << "the landing pool did not reuse memory";

  auto pinned = internal::AllocatePinnedStaging(1 << 20);
  ASSERT_TRUE(pinned.ok()) << pinned.status();
  EXPECT_TRUE(internal::CudaIsPinnedHost(pinned->data()));
  std::vector<uint8_t> pageable(16);
  EXPECT_FALSE(internal::CudaIsPinnedHost(pageable.data()));

  auto pool = rdmarpc::NewCudaMemoryPool(0, 4 << 20);
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto a = (*pool)->Allocate(3 << 20);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->device(), kGpu);
  EXPECT_EQ((*pool)->Allocate(2 << 20).status().code(),
            rdmarpc::StatusCode::kResourceExhausted);
  *a = TensorBuffer();
  EXPECT_TRUE((*pool)->Allocate(4 << 20).ok());
}

TEST_F(CudaSupportTest, DmaBufExportCoversTheRangeAsked) {
  Status supported = internal::CudaDmaBufSupported(0);
  if (!supported.ok()) GTEST_SKIP() << supported.message();
  void* base = nullptr;
  const size_t size = size_t{3} << 20;
  ASSERT_EQ(cudaMalloc(&base, size), cudaSuccess);
  const size_t into = 4096 + 17;
  const auto* ptr = static_cast<const char*>(base) + into;
  auto range = internal::CudaExportDmaBuf(ptr, 1000);
  ASSERT_TRUE(range.ok()) << range.status();
  EXPECT_GE(range->fd, 0);
  const uintptr_t page_start =
      reinterpret_cast<uintptr_t>(base) & ~uintptr_t{4095};
  EXPECT_EQ(range->offset, reinterpret_cast<uintptr_t>(ptr) - page_start);
  const off_t exported = lseek(range->fd, 0, SEEK_END);
  EXPECT_GE(static_cast<uint64_t>(exported), range->offset + 1000)
      << "the dma-buf does not reach the end of the range";
  close(range->fd);
  cudaFree(base);
}

TEST_F(CudaSupportTest, RegistrationDriverCallsSucceed) {
  void* base = nullptr;
  ASSERT_EQ(cudaMalloc(&base, 1 << 20), cudaSuccess);
  Status sync = internal::CudaSetSyncMemops(base);
  EXPECT_TRUE(sync.ok()) << sync;
  Status flush = internal::CudaFlushRdmaWrites(0);
  EXPECT_TRUE(flush.ok()) << flush;
  cudaFree(base);
}

}  // namespace
}  // namespace rdmarpc_test
