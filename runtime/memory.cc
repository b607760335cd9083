#include "rdmarpc/memory.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>

#include "absl/strings/str_cat.h"
#include "runtime/cuda_support.h"

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

// First-fit allocator over one host region. Buffers return their block to
// the free list when their last copy is destroyed.
class HostMemoryPool final : public MemoryPool {
 public:
  HostMemoryPool(void* base, size_t capacity)
      : base_(static_cast<char*>(base)), capacity_(capacity) {
    free_[0] = capacity;
  }
  ~HostMemoryPool() override { std::free(base_); }

  StatusOr<TensorBuffer> Allocate(size_t size) override {
    size_t rounded = (size + kGranule - 1) / kGranule * kGranule;
    if (rounded == 0) rounded = kGranule;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < rounded) continue;
      size_t offset = it->first;
      size_t left = it->second - rounded;
      free_.erase(it);
      if (left > 0) free_[offset + rounded] = left;
      std::shared_ptr<const void> owner(
          base_ + offset,
          [this, offset, rounded](const void*) { Release(offset, rounded); });
      return TensorBuffer::Share(std::move(owner), base_ + offset, size);
    }
    return absl::ResourceExhaustedError(
        absl::StrCat("host memory pool of ", capacity_,
                     " bytes has no free block of ", rounded, " bytes"));
  }

  std::vector<Region> Regions() const override {
    return {Region{base_, capacity_, Device::Host()}};
  }
  Device device() const override { return Device::Host(); }

 private:
  static constexpr size_t kGranule = 64;

  void Release(size_t offset, size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, inserted] = free_.emplace(offset, size);
    // Merge with the following and the preceding free blocks.
    auto next = std::next(it);
    if (next != free_.end() && it->first + it->second == next->first) {
      it->second += next->second;
      free_.erase(next);
    }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        free_.erase(it);
      }
    }
  }

  char* base_;
  size_t capacity_;
  std::mutex mu_;
  std::map<size_t, size_t> free_;  // offset -> size
};

}  // namespace

std::unique_ptr<MemoryPool> NewHostMemoryPool(size_t capacity) {
  size_t rounded = (capacity + 4095) / 4096 * 4096;
  if (rounded == 0) rounded = 4096;
  void* base = std::aligned_alloc(4096, rounded);
  if (base == nullptr) return nullptr;
  return std::make_unique<HostMemoryPool>(base, rounded);
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
