#include "rdmarpc/memory.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "runtime/cuda_support.h"
#include "runtime/first_fit.h"

namespace rdmarpc {

std::string Device::ToString() const {
  return is_host() ? "host" : absl::StrCat("cuda:", index);
}

TensorBuffer TensorBuffer::Borrow(const void* data, size_t size,
                                  Device device) {
  TensorBuffer b;
  b.data_ = const_cast<void*>(data);
  b.size_ = size;
  b.device_ = device;
  return b;
}

TensorBuffer TensorBuffer::Share(std::shared_ptr<const void> owner,
                                 const void* data, size_t size, Device device) {
  TensorBuffer b = Borrow(data, size, device);
  b.owner_ = std::move(owner);
  return b;
}

StatusOr<TensorBuffer> TensorBuffer::Allocate(size_t size, Device device) {
  if (device.is_cuda()) return internal::CudaAllocate(size, device.index);
  // Round up so that aligned_alloc's size rule holds; keep 0-byte tensors
  // cheap but non-null.
  size_t rounded = (size + 63) / 64 * 64;
  if (rounded == 0) rounded = 64;
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", size, " bytes of host memory"));
  }
  std::shared_ptr<const void> owner(
      p, [](const void* q) { std::free(const_cast<void*>(q)); });
  return Share(std::move(owner), p, size, device);
}

TensorBuffer TensorBuffer::Slice(size_t offset, size_t size) const {
  TensorBuffer b = *this;
  b.data_ = static_cast<char*>(data_) + offset;
  b.size_ = size;
  return b;
}

namespace {

// A pool over one region: host memory or one cudaMalloc. Buffers return
// their block when their last copy is destroyed.
class RegionPool final : public MemoryPool {
 public:
  RegionPool(std::shared_ptr<void> region, size_t capacity, Device device)
      : region_(std::move(region)),
        base_(static_cast<char*>(region_.get())),
        capacity_(capacity),
        device_(device),
        fit_(capacity) {}

  StatusOr<TensorBuffer> Allocate(size_t size) override {
    size_t rounded = (size + kGranule - 1) / kGranule * kGranule;
    if (rounded == 0) rounded = kGranule;
    std::lock_guard<std::mutex> lock(mu_);
    std::optional<size_t> offset = fit_.Take(rounded);
    if (!offset) {
      return absl::ResourceExhaustedError(
          absl::StrCat(device_.ToString(), " memory pool of ", capacity_,
                       " bytes has no free block of ", rounded, " bytes"));
    }
    std::shared_ptr<const void> owner(
        base_ + *offset, [this, at = *offset, rounded](const void*) {
          std::lock_guard<std::mutex> lock(mu_);
          fit_.Give(at, rounded);
        });
    return TensorBuffer::Share(std::move(owner), base_ + *offset, size,
                               device_);
  }

  Device device() const override { return device_; }

 private:
  static constexpr size_t kGranule = 64;

  std::shared_ptr<void> region_;
  char* base_;
  size_t capacity_;
  Device device_;
  std::mutex mu_;
  internal::FirstFit fit_;
};

}  // namespace

std::unique_ptr<MemoryPool> NewHostMemoryPool(size_t capacity) {
  size_t rounded = (capacity + 4095) / 4096 * 4096;
  if (rounded == 0) rounded = 4096;
  void* base = std::aligned_alloc(4096, rounded);
  if (base == nullptr) return nullptr;
  return std::make_unique<RegionPool>(
      std::shared_ptr<void>(base, [](void* p) { std::free(p); }), rounded,
      Device::Host());
}

StatusOr<std::unique_ptr<MemoryPool>> NewCudaMemoryPool(int index,
                                                        size_t capacity) {
  size_t rounded = (capacity + 4095) / 4096 * 4096;
  if (rounded == 0) rounded = 4096;
  RDMARPC_ASSIGN_OR_RETURN(TensorBuffer region,
                           internal::CudaAllocate(rounded, index));
  // The region's owner frees the cudaMalloc when the pool goes.
  auto keep = std::make_shared<TensorBuffer>(region);
  std::shared_ptr<void> base(region.data(),
                             [keep](void*) mutable { keep.reset(); });
  return std::unique_ptr<MemoryPool>(std::make_unique<RegionPool>(
      std::move(base), rounded, Device::Cuda(index)));
}

namespace internal {

StatusOr<TensorBuffer> AllocateGpuLanding(int gpu, size_t size) {
  RDMARPC_RETURN_IF_ERROR(CudaCheckDevice(gpu));
  static std::mutex mu;
  // Pools live as long as the process: landed tensors may outlive anything.
  static auto* pools = new std::map<int, std::unique_ptr<MemoryPool>>();
  MemoryPool* pool = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    // A pool that could not be created is not tried again: null stays.
    auto [it, first] = pools->try_emplace(gpu);
    auto& slot = it->second;
    if (first) {
      uint64_t bytes = uint64_t{1} << 30;
      if (const char* env = std::getenv("RDMARPC_CUDA_LANDING_POOL_BYTES")) {
        bytes = std::strtoull(env, nullptr, 10);
      }
      auto created = NewCudaMemoryPool(gpu, bytes);
      if (created.ok()) slot = *std::move(created);
    }
    pool = slot.get();
  }
  if (pool != nullptr) {
    auto buffer = pool->Allocate(size);
    if (buffer.ok()) return buffer;
  }
  return CudaAllocate(size, gpu);
}

}  // namespace internal

const char* GpuRdmaModeName(GpuRdmaMode mode) {
  switch (mode) {
    case GpuRdmaMode::kAuto:
      return "auto";
    case GpuRdmaMode::kDmaBuf:
      return "dma-buf";
    case GpuRdmaMode::kPeerMemory:
      return "peer-memory";
    case GpuRdmaMode::kStaging:
      return "staging";
  }
  return "unknown";
}

int CudaDeviceCount() { return internal::CudaDeviceCountCached(); }

Status CudaDeviceStatus(int index) { return internal::CudaCheckDevice(index); }

Status CopyBytes(void* dst, Device dst_device, const void* src,
                 Device src_device, size_t size) {
  if (size == 0) return absl::OkStatus();
  if (dst_device.is_host() && src_device.is_host()) {
    std::memcpy(dst, src, size);
    return absl::OkStatus();
  }
  return internal::CudaCopy(dst, dst_device, src, src_device, size);
}

}  // namespace rdmarpc
